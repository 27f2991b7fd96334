"""Planning without gathering rows: ranks that hold the same leaves in regular layouts (DTensors over a
mesh of all ranks, whole tensors, python values) agree through one all-reduce of their structure's
rank-independent digest, and each plans alone by rule (``saving/plan.py``: ``regular_digest``,
``grid_plan``). Checked here: on simulated ranks, every chunk of the global state is written exactly
once and the writes are balanced; on real gloo ranks, real DTensors give the rows this planning needs,
a save of them gathers no rows and loads back exactly, and a structure that differs between ranks
falls back to the gathered rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import zerostall as zs
from zerostall.saving.collect import Row, collect
from zerostall.saving.plan import build_plan, grid_plan, regular_digest, structure_digest


def split(length: int, n: int, i: int) -> tuple[int, int]:
    step = -(-length // n)
    start = min(step * i, length)
    return start, max(0, min(length, start + step) - start)


def hsdp_rows(rank: int, world: int, replicas: int, shapes: list[tuple[int, int]]) -> list[Row]:
    """A rank's rows of an HSDP-like state: each tensor Shard(0) over ``world // replicas`` ranks and
    replicated over ``replicas``, a whole tensor on every rank and a python value."""
    shards = world // replicas
    rows = []
    for i, shape in enumerate(shapes):
        start, size = split(shape[0], shards, rank % shards)
        offsets = (start if size else shape[0], 0)
        rows.append(Row(f'["w{i}"]', "tensor", "float32", shape, offsets, (size, shape[1]), size * shape[1] * 4,
                        grid=(77, replicas, rank // shards, world, rank % shards)))
    rows.append(Row('["bias"]', "tensor", "float32", (5,), (0,), (5,), 20))
    rows.append(Row('["step"]', "object"))
    return rows


@pytest.mark.parametrize("world,replicas", [(8, 2), (8, 4), (16, 1), (6, 6)])
def test_every_chunk_is_written_once_and_the_writes_are_balanced(world, replicas):
    shapes = [(7 + 13 * i, 3) for i in range(40)] + [(2, 3)]  # the last one: empty boxes on most ranks
    structures = [hsdp_rows(r, world, replicas, shapes) for r in range(world)]
    digests = {regular_digest(rows, world) for rows in structures}
    assert len(digests) == 1 and None not in digests
    plans = [grid_plan(rows, r, world, structure_digest(rows)) for r, rows in enumerate(structures)]
    writers: dict[tuple, list[int]] = {}
    for r, (plan, rows) in enumerate(zip(plans, structures)):
        for row in rows:
            if plan.writes(r, (row.key, row.offsets)):
                writers.setdefault((row.key, row.offsets), []).append(r)
        assert not plan.writes((r + 1) % world, (rows[0].key, rows[0].offsets))  # a plan speaks for its rank
    nonempty = {(row.key, row.offsets) for rows in structures for row in rows if math.prod(row.sizes)}
    assert set(writers) == nonempty and all(len(w) == 1 for w in writers.values())
    full = build_plan(structures, [structure_digest(rows) for rows in structures])
    sizes = {(row.key, row.offsets): row.sizes for rows in structures for row in rows}
    assert nonempty == {key for key in full.writers if math.prod(sizes[key])}  # what gathered rows plan, less empties
    size = {(row.key, row.offsets): row.nbytes for rows in structures for row in rows}
    load = [sum(size[k] for k, w in writers.items() if w == [r]) for r in range(world)]
    assert max(load) <= 1.25 * sum(load) / world, load
    slots: dict[tuple, set[int]] = {}  # the replica check's: each replicated box has one, alike on its holders
    for plan, rows in zip(plans, structures):
        assert plan.slot_count == plans[0].slot_count
        for row in rows:
            if (row.key, row.offsets) in plan.slots:
                slots.setdefault((row.key, row.offsets), set()).add(plan.slots[(row.key, row.offsets)])
    replicated = {(r.key, r.offsets) for r in structures[0] if r.key in ('["bias"]', '["step"]') or replicas > 1}
    assert {k for k in slots} == {k for k in nonempty if k[0] in {key for key, _ in replicated}}
    assert all(len(s) == 1 for s in slots.values()) and len({min(s) for s in slots.values()}) == len(slots)


def test_structures_a_rank_cannot_plan_alone_have_no_regular_digest():
    rows = hsdp_rows(0, 8, 2, [(16, 3)])
    assert regular_digest(rows, 8) is not None
    assert regular_digest(rows, 16) is None  # the mesh holds fewer ranks than the group: others hold no box
    box_without_layout = Row('["x"]', "tensor", "float32", (8,), (4,), (4,), 16)
    assert regular_digest(rows + [box_without_layout], 8) is None
    assert regular_digest(rows + [Row('["q"]', "subclass", "float32", (4,), (0,), (4,), 0, subclass="X")], 8) is None
    empty = Row('["e"]', "tensor", "float32", (0, 3), (0, 0), (0, 3), 0, grid=(77, 2, 0, 8, 0))
    assert regular_digest(rows + [empty], 8) is None  # every rank's box of it is the same empty one
    other = [Row(r.key, r.kind, r.dtype, r.shape, r.offsets, r.sizes, r.nbytes, grid=r.grid and (78, *r.grid[1:]))
             for r in rows]
    assert regular_digest(other, 8) != regular_digest(rows, 8)  # another layout
    assert regular_digest(hsdp_rows(1, 8, 2, [(16, 3)]), 8) == regular_digest(rows, 8)  # another rank's box


# -- functions that run on every rank ----------------------------------------------------------


def value(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def state_2x2(extra_on_rank: int | None = None) -> dict:
    """On a 2 x 2 mesh: HSDP-like (Replicate, Shard), the transposed one, a 2-D shard, tensors on every rank."""
    mesh = init_device_mesh("cpu", (2, 2))
    state = {"hsdp": distribute_tensor(value((9, 4), 1), mesh, [Replicate(), Shard(0)]),
             "other": distribute_tensor(value((6, 5), 2), mesh, [Shard(1), Replicate()]),
             "both": distribute_tensor(value((5, 3), 3), mesh, [Shard(0), Shard(1)]),
             "tiny": distribute_tensor(value((1, 2), 4), mesh, [Replicate(), Shard(0)]),  # empty boxes
             "whole": value((33,), 5), "step": 11}
    if dist.get_rank() == extra_on_rank:
        state["extra"] = torch.ones(3)
    return state


def save_counting_gathers(path: str, extra_on_rank: int | None) -> dict:
    from zerostall import collectives

    gathered: list[str] = []
    original = collectives.Group.all_gather_object

    def spy(self, payload):
        rows = isinstance(payload, list) and payload and isinstance(payload[0], Row)
        gathered.append("rows" if rows else type(payload).__name__)
        return original(self, payload)

    state = state_2x2(extra_on_rank)
    state["saved_to"] = {path: torch.zeros(1)}  # a structure these workers have not planned before (plans are cached)
    collected = collect(state, dist.get_rank(), allow_pickle=False)
    grids = {row.key: row.grid for row in collected.rows}
    collectives.Group.all_gather_object = spy
    try:
        info = zs.save(state, path)
    finally:
        collectives.Group.all_gather_object = original
    return {"grids": grids, "gathered": gathered, "replanned": info.replanned}


def load_2x2(path: str) -> bool:
    mesh = init_device_mesh("cpu", (2, 2))
    target = {"hsdp": distribute_tensor(torch.zeros(9, 4), mesh, [Shard(0), Shard(1)]),
              "other": distribute_tensor(torch.zeros(6, 5), mesh, [Replicate(), Replicate()]),
              "both": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(1), Shard(0)]),
              "tiny": distribute_tensor(torch.zeros(1, 2), mesh, [Replicate(), Replicate()]),
              "whole": torch.zeros(33), "step": 0}
    out, _ = zs.load(target, path, strict=False)  # all but the key naming the path
    return all(torch.equal(out[k].full_tensor(), value(tuple(out[k].shape), s))
               for k, s in (("hsdp", 1), ("other", 2), ("both", 3), ("tiny", 4))) \
        and torch.equal(out["whole"], value((33,), 5)) and out["step"] == 11


def test_dtensor_rows_say_where_their_box_sits_in_the_layout(ranks, tmp_path):
    runs = ranks(4).run(save_counting_gathers, str(tmp_path / "ck"), None)
    for rank, run in enumerate(runs):  # mesh (2, 2): rank = 2 * first coordinate + second
        first, second = divmod(rank, 2)
        grids = run["grids"]
        assert grids['["hsdp"]'][1:] == (2, first, 4, second) and grids['["other"]'][1:] == (2, second, 4, first)
        assert grids['["tiny"]'] == grids['["hsdp"]'], (rank, grids)
        assert grids['["both"]'][1:] == (1, 0, 4, rank) and grids['["whole"]'] is None and grids['["step"]'] is None
        assert {k: g[0] for k, g in grids.items() if g} == {k: g[0] for k, g in runs[0]["grids"].items() if g}
    assert len({runs[0]["grids"][k][0] for k in ('["hsdp"]', '["other"]', '["both"]')}) == 3  # three layouts


def test_a_regular_save_gathers_no_rows_and_loads_back_exactly(ranks, tmp_path):
    path = str(tmp_path / "ck")
    runs = ranks(4).run(save_counting_gathers, path, None)
    for run in runs:
        assert run["replanned"] and run["gathered"] == [], runs  # planned; the replica check is an all-reduce
    assert all(ranks(4).run(load_2x2, path))
    with zs.open(path) as ck:
        for key in ("hsdp", "other", "both", "tiny"):
            boxes = [(c.offsets, c.sizes) for c in ck.entries[key].chunks]
            assert len(boxes) == len(set(boxes)) and all(math.prod(s) for _, s in boxes), (key, boxes)
        assert len(ck.entries["whole"].chunks) == 1 and len(ck.entries["step"].chunks) == 0


def test_a_structure_that_differs_between_ranks_is_planned_from_gathered_rows(ranks, tmp_path):
    path = str(tmp_path / "ck")
    runs = ranks(4).run(save_counting_gathers, path, 2)
    assert all("rows" in run["gathered"] for run in runs)
    with zs.open(path) as ck:
        assert torch.equal(ck.read("extra"), torch.ones(3)) and torch.equal(ck.read("hsdp"), value((9, 4), 1))
        assert torch.equal(ck.read("both"), value((5, 3), 3)) and torch.equal(ck.read("whole"), value((33,), 5))


def save_disagreeing_replicas(path: str) -> str:
    """On a 2 x 2 mesh (Replicate, Shard(0)): rank 3's box of "w" differs from rank 1's, which holds the same box."""
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2))
    local = torch.full((2, 3), float(dist.get_rank() % 2)) + (1 if dist.get_rank() == 3 else 0)
    state = {"w": DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False), "ok": torch.ones(2)}
    try:
        zs.save(state, path)
    except zs.StateMismatchError as exc:
        return str(exc)
    return "saved"


def test_dtensor_replicas_that_disagree_are_named_on_every_rank(ranks, tmp_path):
    messages = ranks(4).run(save_disagreeing_replicas, str(tmp_path / "ck"))
    assert all(m.startswith("replicas disagree on w (box 1 of 2)") for m in messages), messages
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def fsdp_tp_saved_and_loaded(path: str) -> dict:
    """FSDP2 over "dp" and tensor parallel over "tp" on a 2 x 2 mesh, AdamW after a step (strided shards,
    replicated biases, the optimizer's step tensors on every rank): saved, then loaded into a fresh copy."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from zerostall import collectives

    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optim = build(3)
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))).pow(2).mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    gathered: list[bool] = []
    original = collectives.Group.all_gather_object

    def spy(self, payload):
        gathered.append(isinstance(payload, list) and bool(payload) and isinstance(payload[0], Row))
        return original(self, payload)

    collectives.Group.all_gather_object = spy
    try:
        zs.save({"model": msd, "optim": osd, "saved_to": {path: torch.zeros(1)}}, path)
    finally:
        collectives.Group.all_gather_object = original
    fresh, fresh_optim = build(4)
    fresh(torch.randn(4, 16)).pow(2).mean().backward()
    fresh_optim.step()  # its moments exist, with other values
    fmsd, fosd = get_state_dict(fresh, fresh_optim)
    out, _ = zs.load({"model": fmsd, "optim": fosd}, path, strict=False)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    same = all(torch.equal(full(out["model"][k]), full(v)) for k, v in msd.items())
    same &= all(torch.equal(full(out["optim"]["state"][k][m]), full(v[m]))
                for k, v in osd["state"].items() for m in v)
    return {"rows_gathered": any(gathered), "same": same,
            "placements": sorted({type(p).__name__ for v in msd.values() for p in v.placements})}


def test_fsdp_with_tensor_parallel_plans_alone_and_loads_back_exactly(ranks, tmp_path):
    runs = ranks(4).run(fsdp_tp_saved_and_loaded, str(tmp_path / "ck"))
    assert all(run["same"] and not run["rows_gathered"] for run in runs), runs
    assert {"Replicate", "Shard", "_StridedShard"} <= set(runs[0]["placements"])
