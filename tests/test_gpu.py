"""CUDA paths: saving from GPU tensors, loading into them through pinned staging, capture on a side
stream. They need a GPU, so they run on the GPU machine (``./dev test tests/test_gpu.py``), not in CI."""

from __future__ import annotations

import pytest
import torch

import zerostall as zs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(64, 48, device="cuda", generator=g)
    return {
        "w": base,
        "wt": base.t(),  # a non-contiguous view sharing storage with w
        "b16": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
        "big": torch.randn(3, 1 << 20, device="cuda", generator=g),
        "ints": torch.arange(17, device="cuda", dtype=torch.int64),
        "step": 7,
    }


def test_cuda_state_round_trips_through_small_pinned_staging(tmp_path):
    state = cuda_state()
    zs.save(state, str(tmp_path / "ck"))
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    out = zs.load(target, str(tmp_path / "ck"), max_staging_bytes=64 << 10)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert out[key].is_cuda and torch.equal(out[key], value), key
    assert out["step"] == 7


def test_cuda_targets_convert_dtype_and_load_slices(tmp_path):
    state = cuda_state()
    zs.save(state, str(tmp_path / "ck"))
    with zs.open(str(tmp_path / "ck")) as ck:
        half = {"big": torch.zeros(3, 1 << 20, device="cuda", dtype=torch.bfloat16)}
        ck.load(half, keys=["big"], strict=False)
        assert torch.equal(half["big"], state["big"].to(torch.bfloat16))
        assert torch.equal(ck.read("w").cuda(), state["w"])


def test_async_capture_sees_queued_kernels_and_not_later_writes(tmp_path):
    x = torch.zeros(4096, 4096, device="cuda")
    for _ in range(20):  # queue work that writes x; save() must not read x before it finishes
        x.add_(1.0)
    with zs.AsyncSaver() as saver:
        handle = saver.save({"x": x}, str(tmp_path / "ck"))
        handle.wait_staged()
        x.fill_(-1.0)  # after capture: must not reach the checkpoint
        handle.result()
    loaded = zs.load({"x": torch.empty(4096, 4096, device="cuda")}, str(tmp_path / "ck"))
    assert torch.equal(loaded["x"], torch.full_like(x, 20.0))
