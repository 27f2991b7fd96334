"""Random resharding over real gloo groups: tensors of random shape and dtype, saved by 4 ranks in a
random DTensor layout (1-D or 2-D mesh; Shard of any dim, nested shards, replicas, uneven and empty
shards) and random block size, then loaded by 4 and by 2 ranks in other random layouts with a
random staging budget, with and without broadcast reads, and by one process whole: every load
must give the saved tensor exactly."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import zerostall as zs

CASES = 16
DTYPES = [torch.float32, torch.bfloat16, torch.int16, torch.float64, torch.uint8]


def case_value(rng: random.Random) -> torch.Tensor:
    shape = tuple(rng.randint(1, 11) for _ in range(rng.randint(1, 3)))
    data = torch.randint(0, 256, (torch.Size(shape).numel() * 8,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    dtype = rng.choice(DTYPES)
    return data[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)


def random_layout(rng: random.Random, ndim: int, world: int) -> tuple[tuple[int, ...], list]:
    mesh = rng.choice([(world,), (2, world // 2)] if world >= 4 else [(world,)])
    placements = [rng.choice([Replicate()] + [Shard(d) for d in range(ndim)]) for _ in mesh]
    return mesh, placements


def as_dtensor(value: torch.Tensor, mesh_shape: tuple[int, ...], placements: list) -> DTensor:
    """This rank's shard of ``value`` (which every rank holds whole), cut without a collective:
    gloo broadcasts no bf16, int16 or uint8."""
    mesh = init_device_mesh("cpu", mesh_shape)
    return DTensor.from_local(value[shard_slices(value, mesh, placements)].clone(), mesh, placements,
                              run_check=False, shape=value.shape, stride=value.stride())


def shard_slices(value: torch.Tensor, mesh, placements: list) -> tuple[slice, ...]:
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def cases(seed: int) -> list[tuple[torch.Tensor, int]]:
    """The saved values, each with the seed of its layouts (the same on every rank)."""
    rng = random.Random(seed)
    return [(case_value(rng), rng.randrange(2**31)) for _ in range(CASES)]


def save_cases(root: str, seed: int) -> list[str]:
    saved = []
    for i, (value, layout_seed) in enumerate(cases(seed)):
        rng = random.Random(layout_seed)
        mesh, placements = random_layout(rng, value.dim(), dist.get_world_size())
        block = rng.choice([4096, 8192, 4 << 20])
        zs.save({"t": as_dtensor(value, mesh, placements), "i": i}, f"{root}/c{i}", block_size=block)
        saved.append(f"{mesh} {placements} block {block}")
    return saved


def load_cases(root: str, seed: int) -> list[str]:
    """Load every case in a random layout of this world; the descriptions of those that differ."""
    wrong = []
    world = dist.get_world_size()
    for i, (value, layout_seed) in enumerate(cases(seed)):
        rng = random.Random(layout_seed + world)  # not the save's layout (but it may be drawn again)
        mesh, placements = random_layout(rng, value.dim(), world)
        staging = rng.choice([64, 4096, 256 << 20])
        broadcast = rng.random() < 0.5
        target = as_dtensor(torch.zeros_like(value), mesh, placements)
        out = zs.load({"t": target, "i": -1}, f"{root}/c{i}", max_staging_bytes=staging, broadcast=broadcast)
        expected = value[shard_slices(value, target.device_mesh, placements)]
        if out["i"] != i or not same_bytes(out["t"].to_local(), expected):
            wrong.append(f"case {i}: {tuple(value.shape)} {value.dtype} into {mesh} {placements} staging {staging} broadcast {broadcast}")
    return wrong


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def test_random_layouts_reshard_exactly(ranks, tmp_path):
    root = str(tmp_path)
    seed = 20261123
    layouts = ranks(4).run(save_cases, root, seed)[0]
    assert ranks(4).run(load_cases, root, seed) == [[]] * 4, layouts
    assert ranks(2).run(load_cases, root, seed) == [[]] * 2, layouts
    for i, (value, _) in enumerate(cases(seed)):
        out = zs.load({"t": torch.zeros_like(value), "i": -1}, f"{root}/c{i}")
        assert out["i"] == i and same_bytes(out["t"], value), layouts[i]
        with zs.open(f"{root}/c{i}") as ck:  # every rank's files and their header checksums reached the manifest
            assert ck.manifest.headers.keys() == ck.manifest.files.keys()
        zs.verify(f"{root}/c{i}")
