"""Distributed save/load over real gloo process groups (2–4 ranks, persistent workers)."""

from __future__ import annotations

import errno
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import zerostall as zs
from distributed import RankError
from faults import FaultyStorage
from zerostall.storage import LocalStorage

# -- functions that run on every rank ----------------------------------------------------------


def full_value(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def dtensor(value: torch.Tensor, mesh_shape: tuple[int, ...], placements) -> DTensor:
    mesh = init_device_mesh("cpu", mesh_shape)
    return distribute_tensor(value, mesh, placements)


def save_sharded(path: str, mesh_shape: tuple[int, ...], placements) -> None:
    state = {"w": dtensor(full_value((10, 6), 1), mesh_shape, placements),
             "v": dtensor(full_value((7,), 2), (dist.get_world_size(),), [Shard(0)]),
             "tiny": dtensor(full_value((2,), 4), (dist.get_world_size(),), [Shard(0)]),  # empty shards at 4 ranks
             "step": 3}
    zs.save(state, path)


def load_sharded(path: str, mesh_shape: tuple[int, ...], placements) -> bool:
    state = {"w": dtensor(torch.zeros(10, 6), mesh_shape, placements),
             "v": dtensor(torch.zeros(7), (dist.get_world_size(),), [Replicate()]),
             "tiny": dtensor(torch.zeros(2), (dist.get_world_size(),), [Shard(0)]), "step": 0}
    out = zs.load(state, path, max_staging_bytes=64)
    return (torch.equal(out["w"].full_tensor(), full_value((10, 6), 1))
            and torch.equal(out["tiny"].full_tensor(), full_value((2,), 4))
            and torch.equal(out["v"].full_tensor(), full_value((7,), 2)) and out["step"] == 3)


def replicated_state(rank: int, corrupt_rank: int | None = None) -> dict:
    state = {f"layer{i}": full_value((100 + 37 * i, 64), i) for i in range(24)}
    if rank == corrupt_rank:
        state["layer3"] = state["layer3"] + 1
    return state


def save_replicated(path: str, corrupt_rank: int | None = None, **options) -> dict:
    info = zs.save(replicated_state(dist.get_rank(), corrupt_rank), path, **options)
    return {"bytes": info.bytes_written, "replanned": info.replanned}


def load_replicated(path: str, broadcast: bool) -> dict:
    target = {k: torch.zeros_like(v) for k, v in replicated_state(0).items()}
    before = _rchar()
    zs.load(target, path, broadcast=broadcast)
    read = _rchar() - before
    ok = all(torch.equal(target[k], v) for k, v in replicated_state(0).items())
    return {"ok": ok, "read": read}


def load_replicated_staged(path: str, cap: int) -> dict:
    """Broadcast load into bf16 targets (so every chunk goes through a staging buffer); records the
    staging bytes of each broadcast batch."""
    from zerostall.loading import broadcast

    batches: list[int] = []
    original = broadcast._broadcast_batch

    def spy(fetcher, group, pool, batch, wanted, readers, direct, verify):
        batches.append(sum(hi - lo for key, lo, hi in batch if key not in direct))
        return original(fetcher, group, pool, batch, wanted, readers, direct, verify)

    broadcast._broadcast_batch = spy
    try:
        target = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in replicated_state(0).items()}
        zs.load(target, path, broadcast=True, max_staging_bytes=cap)
    finally:
        broadcast._broadcast_batch = original
    ok = all(torch.equal(target[k], v.to(torch.bfloat16)) for k, v in replicated_state(0).items())
    return {"ok": ok, "batches": batches}


def broadcast_load_untied(path: str) -> list[bool]:
    """Load a checkpoint of tied weights into separate tensors, one of them in bf16 (staged)."""
    target = {"a": torch.zeros(1000), "b": torch.zeros(1000), "c": torch.zeros(1000, dtype=torch.bfloat16)}
    zs.load(target, path, broadcast=True)
    saved = torch.arange(1000, dtype=torch.float32)
    return [torch.equal(target["a"], saved), torch.equal(target["b"], saved),
            torch.equal(target["c"], saved.to(torch.bfloat16))]


def broadcast_load_in_each_ranks_dtype(path: str, budget: int) -> bool:
    """Rank 0's target takes the stored float32 bytes as they are, rank 1's is float64 (staged)."""
    dtype = torch.float32 if dist.get_rank() == 0 else torch.float64
    target = {"w": torch.zeros(1024, dtype=dtype)}
    zs.load(target, path, broadcast=True, max_staging_bytes=budget * (1 + dist.get_rank()))
    return torch.equal(target["w"], torch.arange(1024, dtype=dtype))


def broadcast_load_with_an_extra_key_on_rank_1(path: str) -> str:
    target = {k: torch.zeros_like(v) for k, v in replicated_state(0).items()}
    if dist.get_rank() == 1:
        target["extra"] = torch.zeros(2)
    try:
        zs.load(target, path, broadcast=True)
    except zs.CheckpointError as exc:
        untouched = all(not t.any() for t in target.values())
        return f"{type(exc).__name__} (target untouched: {untouched}): {exc}"
    return "loaded"


def save_with_an_unsupported_value_on_rank_1(path: str) -> list[str]:
    outcomes = []
    for step, bad in ((1, False), (2, True), (3, False)):
        state = {"w": torch.full((8,), float(step)), "own": zs.rank_local({"n": step})}
        if bad and dist.get_rank() == 1:
            state["own"] = zs.rank_local({"n": object()})
        try:
            zs.save(state, path, step=step, overwrite=True)
            outcomes.append("saved")
        except zs.CheckpointError as exc:
            with zs.open(path) as ck:
                outcomes.append(f"{type(exc).__name__} (step {ck.step} stays): {exc}")
    return outcomes


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def count_collectives(path: str) -> list[dict]:
    """Save the same structure three times (values change), then a changed one; count collectives."""
    from zerostall import collectives

    calls: list[tuple[str, int]] = []
    originals = {name: getattr(collectives.Group, name) for name in ("all_reduce_ints", "all_gather_object")}

    def counting(name):
        def wrapper(self, payload):
            calls.append((name, len(pickle.dumps(payload))))
            return originals[name](self, payload)
        return wrapper

    for name in originals:
        setattr(collectives.Group, name, counting(name))
    try:
        out = []
        for step, extra in ((1, False), (2, False), (3, False), (4, True)):
            calls.clear()
            state = {"w": full_value((64, 8), 0) * step, "step": step}
            if extra:
                state["new"] = torch.ones(3)
            info = zs.save(state, path, overwrite=True)
            out.append({"replanned": info.replanned, "calls": list(calls), "plan_s": info.plan_s})
        return out
    finally:
        for name, fn in originals.items():
            setattr(collectives.Group, name, fn)


def rank_local_round_trip(path: str) -> dict:
    rank = dist.get_rank()
    zs.save({"w": torch.ones(4), "rng": zs.rank_local({"seed": rank, "t": torch.full((2,), float(rank))})}, path)
    target = {"w": torch.zeros(4), "rng": zs.rank_local({"seed": -1, "t": torch.zeros(2)})}
    out = zs.load(target, path)
    return {"seed": out["rng"].value["seed"], "t": out["rng"].value["t"].tolist()}


def load_rank_local_other_world(path: str) -> str:
    target = {"w": torch.zeros(4), "rng": zs.rank_local({"seed": -1, "t": torch.zeros(2)})}
    try:
        zs.load(target, path)
    except zs.StateMismatchError as exc:
        return str(exc)
    return "loaded"


def failing_save(path: str, how: str, timeout: float) -> str:
    """Rank 1's data file write fails (ENOSPC) or it SIGKILLs itself there, through a
    FaultyStorage around the path; report what every rank saw."""
    rank = dist.get_rank()
    storage = FaultyStorage(LocalStorage(path))
    if rank == 1 and how == "kill":
        storage.crash("write")
    elif rank == 1:
        storage.fail("write", OSError(errno.ENOSPC, "No space left on device (injected)"))
    state = {"w": full_value((32, 32), 5), "own": zs.rank_local(torch.full((4,), float(rank))),  # rank 1 writes
             "rank": zs.rank_local(rank)}
    start = time.monotonic()
    try:
        zs.save(state, storage, commit_timeout=timeout, overwrite=True)
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    return "committed"


def fsdp_model(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp_steps(model, optim, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def fsdp_resume(path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = fsdp_model(0)
    fsdp_steps(model, optim, 2, seed=1)
    msd, osd = get_state_dict(model, optim)
    zs.save({"model": msd, "optim": osd}, path)
    expected = fsdp_steps(model, optim, 3, seed=2)

    fresh, fresh_optim = fsdp_model(7)
    msd, osd = get_state_dict(fresh, fresh_optim)
    state = zs.load({"model": msd, "optim": osd}, path)
    set_state_dict(fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"expected": expected, "resumed": fsdp_steps(fresh, fresh_optim, 3, seed=2)}


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world,save_mesh,save_pl,load_world,load_mesh,load_pl", [
    (2, (2,), [Shard(0)], 2, (2,), [Shard(1)]),          # FSDP-like rows -> TP-like columns
    (2, (2,), [Shard(1)], 2, (2,), [Shard(0)]),          # and back
    (2, (2,), [Shard(1)], 4, (4,), [Shard(0)]),          # M > N
    (4, (2, 2), [Shard(0), Shard(1)], 2, (2,), [Shard(0)]),  # 2-D mesh -> 1-D, M < N
    (4, (2, 2), [Replicate(), Shard(0)], 4, (4,), [Shard(1)]),  # HSDP-style replicate x shard
    (4, (4,), [Shard(0)], 2, (2,), [Replicate()]),       # uneven (10 rows / 4) and into replicas
], ids=["2to2-rows-cols", "2to2-cols-rows", "2to4", "2d-to-1d", "hsdp", "uneven-to-replicated"])
def test_resharding_load(ranks, tmp_path, world, save_mesh, save_pl, load_world, load_mesh, load_pl):
    path = str(tmp_path / "ck")
    ranks(world).run(save_sharded, path, save_mesh, save_pl)
    assert all(ranks(load_world).run(load_sharded, path, load_mesh, load_pl))
    single = zs.load({"w": torch.zeros(10, 6), "v": torch.zeros(7), "tiny": torch.zeros(2), "step": 0}, path)
    assert torch.equal(single["w"], full_value((10, 6), 1)) and torch.equal(single["v"], full_value((7,), 2))


def save_and_load_empty_shards(path: str) -> bool:
    """Two DTensors of one row over two ranks: rank 1 holds two empty shards of equal shape (both at data pointer 0)."""
    zs.save({"a": dtensor(full_value((1, 4), 1), (2,), [Shard(0)]),
             "b": dtensor(full_value((1, 4), 2), (2,), [Shard(0)])}, path)
    out = zs.load({"a": dtensor(torch.zeros(1, 4), (2,), [Shard(0)]), "b": dtensor(torch.zeros(1, 4), (2,), [Shard(0)])},
                  path)
    return torch.equal(out["a"].full_tensor(), full_value((1, 4), 1)) and torch.equal(out["b"].full_tensor(),
                                                                                      full_value((1, 4), 2))


def test_empty_shards_of_equal_shape_are_not_aliases(ranks, tmp_path):
    assert all(ranks(2).run(save_and_load_empty_shards, str(tmp_path / "ck")))


def test_single_process_checkpoint_loads_sharded(ranks, tmp_path):
    path = str(tmp_path / "ck")
    zs.save({"w": full_value((10, 6), 1), "v": full_value((7,), 2), "tiny": full_value((2,), 4), "step": 3}, path)
    assert all(ranks(2).run(load_sharded, path, (2,), [Shard(1)]))


def test_replicated_state_is_written_once_and_balanced(ranks, tmp_path):
    path = str(tmp_path / "ck")
    infos = ranks(4).run(save_replicated, path)
    with zs.open(path) as ck:
        assert all(len(e.chunks) == 1 for e in ck.entries.values())
        total = sum(e.nbytes for e in ck.entries.values())
    written = [i["bytes"] for i in infos]
    assert sum(written) < total * 1.01 + 4 * 4096 * 4  # each byte once (plus file headers)
    assert max(written) / (sum(written) / 4) <= 1.10
    for broadcast in (False, True):
        loads = ranks(4).run(load_replicated, path, broadcast)
        assert all(r["ok"] for r in loads)
        ratio = sum(r["read"] for r in loads) / total
        assert (ratio < 1.2) if broadcast else (ratio > 3.5), ratio


@pytest.mark.parametrize("budget", [64, 1 << 20])
def test_ranks_whose_targets_differ_in_dtype_or_budget_run_the_same_broadcasts(ranks, tmp_path, budget):
    """Whether a chunk went whole into a target, and how the others were sliced, was each rank's own
    decision: ranks ran broadcasts of different sizes (a gloo abort, or a hang until the timeout)."""
    path = str(tmp_path / "ck")
    zs.save({"w": torch.arange(1024.0)}, path, block_size=16)
    assert ranks(2).run(broadcast_load_in_each_ranks_dtype, path, budget, timeout=120) == [True, True]


def test_tied_weights_broadcast_into_separate_tensors_fill_each_of_them(ranks, tmp_path):
    """Every target of a chunk broadcast once gets it (one of them used to keep its old values)."""
    path = str(tmp_path / "ck")
    tied = torch.arange(1000, dtype=torch.float32)
    zs.save({"a": tied, "b": tied, "c": tied}, path)
    assert ranks(2).run(broadcast_load_untied, path) == [[True, True, True]] * 2


def test_a_broadcast_load_refused_on_one_rank_is_refused_on_all(ranks, tmp_path):
    """The other ranks would wait in the broadcast for a rank that raised while planning."""
    path = str(tmp_path / "ck")
    zs.save(replicated_state(0), path)
    first, second = ranks(2).run(broadcast_load_with_an_extra_key_on_rank_1, path, timeout=60)
    assert second.startswith("StateMismatchError (target untouched: True)") and "extra" in second
    assert first.startswith("CheckpointError (target untouched: True)") and "1 other rank" in first


def test_a_save_one_rank_cannot_collect_fails_on_every_rank_and_keeps_the_checkpoint(ranks, tmp_path):
    """Rank 1 holds a value the encoding refuses: rank 0 used to wait for it in the planning
    collective for good. Both raise, the checkpoint at the path stays, the next save works."""
    path = str(tmp_path / "ck")
    first, second = ranks(2).run(save_with_an_unsupported_value_on_rank_1, path, timeout=60)
    assert first[0] == second[0] == first[2] == second[2] == "saved"
    assert first[1].startswith("CheckpointError (step 1 stays): 1 other rank(s) could not prepare")
    assert second[1].startswith("UnsupportedValueError (step 1 stays)") and "own" in second[1]
    with zs.open(path) as ck:
        assert ck.step == 3


def test_broadcast_load_staging_is_bounded(ranks, tmp_path):
    """Chunks that cannot be received into their targets (bf16 targets of f32 entries) travel in
    batches within the budget; a chunk larger than the budget in slices of it (whole blocks)."""
    path = str(tmp_path / "ck")
    zs.save(replicated_state(0), path, block_size=16 << 10)  # here: the workers' plan caches stay as others expect
    cap = 100_000  # below the largest chunks (up to 243 KB), far below the 3.3 MB they add up to
    for run in ranks(2).run(load_replicated_staged, path, cap):
        assert run["ok"]
        assert len(run["batches"]) > 30 and max(run["batches"]) <= cap, run["batches"]


def test_replicas_that_disagree_are_named(ranks, tmp_path):
    with pytest.raises(RankError) as err:
        ranks(2).run(save_replicated, str(tmp_path / "ck"), 1)
    assert set(err.value.failures) == {0, 1}
    for failure in err.value.failures.values():
        assert failure.type.endswith("StateMismatchError") and "layer3" in failure.message


def test_second_save_runs_one_small_collective(ranks, tmp_path):
    runs = ranks(2).run(count_collectives, str(tmp_path / "ck"))
    for rank_runs in runs:
        first, second, third, changed = rank_runs
        assert first["replanned"] and not second["replanned"] and not third["replanned"] and changed["replanned"]
        for cached in (second, third):
            assert [name for name, _ in cached["calls"]] == ["all_reduce_ints"]
            assert cached["calls"][0][1] < 128  # a few int64s, whatever the world size
        assert [name for name, _ in changed["calls"]] == ["all_reduce_ints"]  # regular: planned alone, no gather
    with zs.open(str(tmp_path / "ck")) as ck:
        assert ck.step is None and "new" in ck.entries


def test_rank_local_values_round_trip_and_report_world_change(ranks, tmp_path):
    path = str(tmp_path / "ck")
    results = ranks(2).run(rank_local_round_trip, path)
    assert results == [{"seed": 0, "t": [0.0, 0.0]}, {"seed": 1, "t": [1.0, 1.0]}]
    with zs.open(path) as ck:
        assert {"rng.seed@rank0", "rng.seed@rank1", "rng.t@rank1"} <= set(ck.entries)
    messages = ranks(4).run(load_rank_local_other_world, path)
    assert all("rank-local, saved by 2 ranks, loading on 4" in m for m in messages)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_rank_failure_fails_the_save_everywhere_and_keeps_the_previous(ranks, tmp_path, how):
    path = str(tmp_path / "ck")
    zs.save({"w": torch.ones(32, 32), "rank": zs.rank_local(0)}, path)
    if how == "raise":
        rank0, rank1 = ranks(2).run(failing_save, path, how, 6.0, timeout=60)
        assert "No space left on device (injected)" in rank1
    else:
        with pytest.raises(RankError) as err:
            ranks(2).run(failing_save, path, how, 6.0, timeout=60)
        assert err.value.dead == [1]
        rank0 = err.value.results[0]
    # an exception is reported by rank 1's own record, at once; a death by the commit timeout
    expected = "rank 1: CheckpointError" if how == "raise" else "ranks [1] did not finish writing within 6 s"
    assert rank0.startswith("CommitError") and expected in rank0, rank0
    target = {"w": torch.zeros(32, 32), "rank": zs.rank_local(-1)}
    zs.load(target, path, strict=False)
    assert torch.equal(target["w"], torch.ones(32, 32))
    zs.verify(path)


def test_fsdp2_model_and_optimizer_resume_bit_exactly(ranks, tmp_path):
    results = ranks(2).run(fsdp_resume, str(tmp_path / "ck"))
    for r in results:
        assert r["resumed"] == r["expected"]


def plain_mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def save_fsdp_tp(path: str) -> dict:
    """FSDP2 over "dp" + tensor parallel over "tp" on a 2x2 mesh: strided shards included."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = plain_mlp(3)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    sd = model.state_dict()
    zs.save({"model": sd}, path)
    return {"full": {k: v.full_tensor() for k, v in sd.items()},
            "placements": sorted({type(p).__name__ for v in sd.values() for p in v.placements})}


def load_fsdp_only(path: str) -> bool:
    from torch.distributed.fsdp import fully_shard

    model = plain_mlp(99)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    zs.load({"model": model}, path)
    return all(torch.equal(v.full_tensor(), plain_mlp(3).state_dict()[k]) for k, v in model.state_dict().items())


def test_fsdp_plus_tp_strided_shards_reshard_exactly(ranks, tmp_path):
    path = str(tmp_path / "ck")
    results = ranks(4).run(save_fsdp_tp, path)
    assert "_StridedShard" in results[0]["placements"]
    reference = plain_mlp(3).state_dict()
    for k, v in results[0]["full"].items():
        assert torch.equal(v, reference[k]), k
    model = plain_mlp(50)
    zs.load({"model": model}, path)  # into one process, no process group
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    assert all(ranks(2).run(load_fsdp_only, path))  # FSDP+TP on 4 ranks -> FSDP on 2


def load_wrong_shape(path: str) -> str:
    try:
        zs.load({"w": dtensor(torch.zeros(10, 7), (dist.get_world_size(),), [Shard(0)]), "v": torch.zeros(7),
                 "tiny": torch.zeros(2), "step": 0}, path)
    except zs.StateMismatchError as exc:
        return str(exc)
    return "loaded"


def test_structure_mismatch_on_load_is_named(ranks, tmp_path):
    path = str(tmp_path / "ck")
    ranks(2).run(save_sharded, path, (2,), [Shard(0)])
    for message in ranks(2).run(load_wrong_shape, path):
        assert "w (shape [10, 6] in the checkpoint, [10, 7] in the target)" in message


def save_pipeline_stages(path: str) -> None:
    """Pipeline parallel: each rank holds different layers; only rank 0 has the embedding."""
    rank = dist.get_rank()
    state = {"layers": {f"stage{rank}": full_value((3, 3), 10 + rank)}}
    if rank == 0:
        state["embed"] = full_value((5,), 9)
    zs.save(state, path)


def test_pipeline_stages_are_all_in_the_checkpoint(ranks, tmp_path):
    path = str(tmp_path / "ck")
    ranks(2).run(save_pipeline_stages, path)
    with zs.open(path) as ck:
        whole = ck.state()
    assert torch.equal(whole["embed"], full_value((5,), 9))
    assert torch.equal(whole["layers"]["stage0"], full_value((3, 3), 10))
    assert torch.equal(whole["layers"]["stage1"], full_value((3, 3), 11))


def save_and_load_own_keys(path: str, wanted: str) -> str:
    """Each rank saves its own keys (pipeline stages), then loads them back with strict=True;
    ``wanted`` "own": its own keys, "stage0": every rank only stage 0's."""
    rank = dist.get_rank()
    zs.save({"stage": {f"layer{rank}.w": full_value((4,), 20 + rank)}}, path)
    key = f"layer{rank}.w" if wanted == "own" else "layer0.w"
    target = {"stage": {key: torch.zeros(4)}}
    try:
        zs.load(target, path)
    except zs.StateMismatchError as exc:
        return str(exc)
    return "ok" if torch.equal(target["stage"][key], full_value((4,), 20 + int(key[5]))) else "wrong values"


def test_each_rank_loads_its_own_keys_strictly(ranks, tmp_path):
    assert ranks(2).run(save_and_load_own_keys, str(tmp_path / "ck"), "own") == ["ok", "ok"]


def test_an_entry_no_rank_wants_is_unexpected_on_every_rank(ranks, tmp_path):
    out = ranks(2).run(save_and_load_own_keys, str(tmp_path / "ck"), "stage0")
    assert all("unexpected in the checkpoint: stage.layer1.w" in o for o in out), out


def planning_fails_on_rank_1(path: str) -> str:
    """Rank 1's planning raises (two entries collide once "module" is stripped); rank 0's does not."""
    zs.save({"module.w": torch.ones(2), "w": torch.zeros(2)}, path)
    target = {"module.w": torch.zeros(2), "w": torch.zeros(2)}
    try:
        zs.load(target, path, strip=("module",) if dist.get_rank() == 1 else ())
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_a_load_one_rank_cannot_plan_fails_on_every_rank(ranks, tmp_path):
    rank0, rank1 = ranks(2).run(planning_fails_on_rank_1, str(tmp_path / "ck"))
    assert rank1.startswith("StateMismatchError: entries") and "collide" in rank1
    assert rank0.startswith("CheckpointError: load from") and "1 other rank(s) could not match" in rank0


def load_half_that_is_damaged_on_rank_0(path: str) -> str:
    """Each rank loads its half of "w"; only rank 0's half holds a flipped byte."""
    mesh = init_device_mesh("cpu", (2,))
    w = DTensor.from_local(torch.zeros(512, 256), mesh, [Shard(0)], run_check=False, shape=(1024, 256),
                           stride=(256, 1))
    try:
        zs.load({"w": w}, path)
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_read_that_fails_on_one_rank_fails_the_load_on_every_rank(ranks, tmp_path):
    """The rank whose reads were fine used to return, and wait for the failed one in the job's next collective."""
    path = tmp_path / "ck"
    zs.save({"w": torch.arange(1024 * 256, dtype=torch.float32).reshape(1024, 256)}, path, block_size=64 << 10)
    with zs.open(path) as ck:
        chunk = ck.entries["w"].chunks[0]
    with open(path / chunk.file, "r+b") as f:  # row 3: rank 0's half
        f.seek(chunk.offset + 3 * 256 * 4)
        byte = f.read(1)[0]
        f.seek(chunk.offset + 3 * 256 * 4)
        f.write(bytes([byte ^ 1]))
    rank0, rank1 = ranks(2).run(load_half_that_is_damaged_on_rank_0, str(path), timeout=60)
    assert rank0.startswith("CorruptCheckpointError: checksum mismatch"), rank0
    assert rank1.startswith("CheckpointError: load from") and "1 other rank(s) could not read" in rank1, rank1


def save_into_a_foreign_directory(path: str) -> str:
    try:
        zs.save({"w": torch.ones(2), "r": zs.rank_local(torch.full((2,), float(dist.get_rank())))}, path)
    except zs.CheckpointError as exc:
        return str(exc)
    return "saved"


def test_a_foreign_directory_is_refused_on_every_rank_before_any_writes(ranks, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    rank0, rank1 = ranks(2).run(save_into_a_foreign_directory, str(tmp_path))
    assert "holds files that are not part of a zerostall checkpoint (config.json)" in rank0
    assert "1 other rank(s) could not prepare this save" in rank1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no data file, no record


def test_a_save_over_a_checkpoint_without_overwrite_is_refused_on_every_rank(ranks, tmp_path):
    path = tmp_path / "ck"
    zs.save({"w": torch.ones(2)}, path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    rank0, rank1 = ranks(2).run(save_into_a_foreign_directory, str(path))
    assert "already holds a committed checkpoint" in rank0 and "overwrite=True" in rank0
    assert "1 other rank(s) could not prepare this save" in rank1
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def mismatch_on_one_rank(path: str) -> str:
    zs.save({"w": torch.ones(4)}, path)
    target = {"w": torch.zeros(4)}
    if dist.get_rank() == 1:
        target["extra"] = torch.zeros(2)  # only this rank's state does not match
    try:
        zs.load(target, path)
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_strict_mismatch_on_one_rank_fails_the_load_on_every_rank(ranks, tmp_path):
    """Without broadcast, the rank whose state did not match raised alone, and the others waited
    in the load's next collective until the process group's timeout."""
    rank0, rank1 = ranks(2).run(mismatch_on_one_rank, str(tmp_path / "ck"), timeout=60)
    assert rank1.startswith("StateMismatchError") and "missing from the checkpoint: extra" in rank1, rank1
    assert "1 other rank(s) could not match their state with it" in rank0 and "nothing was loaded" in rank0, rank0


def boxes_read_one_after_another(path: str) -> list[str]:
    """Entries of three chunks each, read by box one after another from fresh sessions."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = {"a": torch.arange(9.0).reshape(3, 3), "b": torch.arange(6.0) * 10, "c": torch.arange(12.0).reshape(3, 4)}
    zs.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, path)
    said = []
    if dist.get_rank() == 0:
        for order in (("a", "b", "c"), ("c", "a", "b"), ("b", "c", "a")):
            with zs.open(path, process_group=dist.new_group([0])) as ck:
                for k in order:
                    last = ((full[k].shape[0] - 1,) + (0,) * (full[k].dim() - 1), (1,) + tuple(full[k].shape[1:]))
                    said.append(torch.equal(ck.read(k, box=last), full[k][-1:]))
    else:
        dist.new_group([0])  # every rank makes each group
        dist.new_group([0])
        dist.new_group([0])
    return said


def test_reads_by_box_of_entries_read_one_after_another_use_their_own_chunks(ranks, tmp_path):
    """A session reading entries one at a time builds each entry anew; the index of an entry's
    chunks was cached by id(), which the next entry could get: "its chunks do not cover the tensor"
    on a good checkpoint."""
    said = ranks(3).run(boxes_read_one_after_another, str(tmp_path / "ck"), timeout=60)
    assert said[0] == [True] * 9


def strided_and_part_of_the_ranks(path: str) -> list[str]:
    from torch.distributed.tensor.placement_types import _StridedShard

    said = []
    whole = init_device_mesh("cpu", (dist.get_world_size(),))
    strided = distribute_tensor(torch.arange(24.0).reshape(12, 2), whole, [_StridedShard(0, split_factor=2)])
    try:
        zs.save({"w": strided}, f"{path}/strided")
        said.append("saved")
    except zs.UnsupportedValueError as exc:
        said.append(str(exc))
    part = dist.device_mesh.DeviceMesh("cpu", [0, 1])  # ranks 0 and 1 of the three
    w = torch.arange(16.0).reshape(4, 4)
    zs.save({"w": distribute_tensor(w, part, [Shard(0)])}, f"{path}/part")
    target = {"w": distribute_tensor(torch.zeros(4, 4), part, [Shard(1)])}
    zs.load(target, f"{path}/part")
    said.append(dist.get_rank() == 2 or torch.equal(target["w"].full_tensor(), w))
    return said


def test_a_strided_shard_that_is_no_box_is_refused_and_a_dtensor_of_part_of_the_ranks_round_trips(ranks, tmp_path):
    """A strided shard whose rows are not one block was saved as if they were (a checkpoint that
    did not open); a DTensor on ranks 0 and 1 of three was saved into a malformed manifest (rank 2
    got a box of no dimension), and loaded into with an untyped error."""
    said = ranks(3).run(strided_and_part_of_the_ranks, str(tmp_path), timeout=120)
    for rank in said:
        assert "not one block of the tensor" in rank[0] and rank[1] is True, rank


def tied_with_an_empty_shard(path: str) -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(0)])  # 2 rows over 3 ranks: one empty
    zs.save({"embed": w, "lm_head": w}, path)
    with zs.open(path) as ck:
        tied = ck.manifest.entries[1].alias_of is not None or ck.manifest.entries[0].alias_of is not None
    target = distribute_tensor(torch.zeros(2, 4), mesh, [Shard(0)])
    zs.load({"embed": target, "lm_head": target}, path)
    return tied and torch.equal(target.full_tensor(), torch.arange(8.0).reshape(2, 4))


def test_tied_dtensors_with_an_empty_shard_on_a_rank_are_saved_once(ranks, tmp_path):
    """The rank whose shard was empty could not tell the second key for the same DTensor (no data
    pointer): it listed a tensor where the others listed an alias, and the save was refused."""
    assert ranks(3).run(tied_with_an_empty_shard, str(tmp_path / "ck"), timeout=60) == [True] * 3


def agreements(fail_on: int, midway: bool) -> tuple[str, list[int]]:
    """A block of ``failing_together(points=2)`` failing on rank ``fail_on`` (before the midway
    agreement when ``midway``, which the other ranks make), then the job's next collective."""
    from zerostall.collectives import Group

    group = Group(None)
    try:
        with group.failing_together("failed on {failed} other rank(s)", points=2) as halfway:
            if dist.get_rank() == fail_on:
                raise RuntimeError("this rank's file is damaged")
            if midway:
                halfway()
        said = "done"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    return said, group.all_reduce_ints([10])


@pytest.mark.parametrize("midway", [False, True])
def test_every_rank_makes_each_agreement_of_a_block_that_fails_on_one(ranks, midway):
    """With the block's agreements left to its end, a rank that learnt of the other's failure at the
    first one skipped the second: the failed rank's second all-reduce met the job's next collective
    (10 + 10 + 1 came back as 11), and that rank's own next collective waited for good."""
    (said0, next0), (said1, next1) = ranks(2).run(agreements, 1, midway)
    assert said0 == "CheckpointError: failed on 1 other rank(s)" and said1 == "RuntimeError: this rank's file is damaged"
    assert next0 == next1 == [20]
