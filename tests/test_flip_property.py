"""No silent corruption: whichever byte of whichever file of a checkpoint is damaged, every way of
reading it either gives back exactly what was saved or raises a typed zerostall error, and
``verify`` reports the damage (every byte is under a checksum: data blocks, data-file headers,
the manifest)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerostall as zs


def original() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(40, 50, generator=g), "b": torch.randn(3000, generator=g).to(torch.bfloat16),
            "small": torch.arange(7, dtype=torch.int32), "step": 12, "name": "run-1"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "ck"
    zs.save(original(), path, block_size=4096)
    return path


def read_ways(path) -> dict[str, Callable[[], dict]]:
    """Every way of reading the checkpoint: direct load, converting load, single-tensor reads."""
    def load() -> dict:
        return zs.load({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                        for k, v in original().items()}, path)

    def converting_load() -> dict:
        wide = {k: torch.zeros(v.shape, dtype=torch.float64) if isinstance(v, torch.Tensor) else v
                for k, v in original().items()}
        return {k: v.to(original()[k].dtype) if isinstance(v, torch.Tensor) else v
                for k, v in zs.load(wide, path).items()}

    def read() -> dict:
        with zs.open(path) as ck:
            return {k: ck.read(k) for k in original()}

    return {"load": load, "converting load": converting_load, "read": read}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 10**6), where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_any_flipped_byte_is_caught_or_harmless(pristine, tmp_path_factory, which, where, mask):
    path = tmp_path_factory.mktemp("flip") / "ck"
    shutil.copytree(pristine, path)
    files = sorted(os.listdir(path))
    name = files[which % len(files)]
    data = bytearray((path / name).read_bytes())
    at = int(where * len(data))
    data[at] ^= mask
    (path / name).write_bytes(bytes(data))
    wrong = []
    for how, read in read_ways(path).items():
        try:
            got = read()
        except zs.CheckpointError:
            continue
        if not same(got, original()):
            wrong.append(how)
    assert not wrong, f"{name} byte {at} ^ {mask:#x}: {wrong} returned damaged data without an error"
    with pytest.raises(zs.CorruptCheckpointError):  # every byte is covered: data blocks, headers, manifest
        zs.verify(path)
