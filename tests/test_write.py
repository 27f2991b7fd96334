"""The write stage's byte streams: what a data file receives for each tensor, whatever its device."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from zerostall.format.checksums import block_checksums, pieces
from zerostall.memory import owned_bytes, tensor_bytes
from zerostall.saving.write import device_pieces


@pytest.mark.parametrize("n, block, window", [(0, 64, 32), (1, 64, 32), (1000, 64, 100), (1 << 20, 4096, 3000),
                                              (3 << 20, 1 << 20, 1 << 20), (3 << 20, 1 << 21, 5 << 19)])
def test_device_pieces_stream_the_same_bytes_and_blocks_as_a_whole_copy(n, block, window):
    t = torch.randint(0, 256, (n,), dtype=torch.uint8)
    got = list(device_pieces(t, block, threading.Event(), window=window))
    assert [len(p) for p in got] == [hi - lo for lo, hi in pieces(n, block)]
    assert b"".join(bytes(p) for p in got) == bytes(tensor_bytes(t))


def test_device_pieces_of_a_wide_dtype_are_its_bytes():
    t = torch.randn(7, 33, dtype=torch.float64)
    data = b"".join(bytes(p) for p in device_pieces(t, 256, threading.Event(), window=1000))
    assert data == bytes(tensor_bytes(t)) and block_checksums(memoryview(data), 256) == block_checksums(
        tensor_bytes(t), 256)


def test_a_byte_view_of_a_temporary_owns_it():
    view = owned_bytes(torch.arange(1 << 16, dtype=torch.int32).clone())[4:12]
    gc.collect()
    noise = [torch.full((1 << 16,), -1, dtype=torch.int32) for _ in range(8)]  # would reuse freed memory
    assert bytes(view) == torch.tensor([1, 2], dtype=torch.int32).numpy().tobytes() and noise


def test_byte_views_refuse_tensors_off_the_host():
    for view in (tensor_bytes, owned_bytes):
        with pytest.raises(ValueError, match="needs a tensor in host memory, not on meta"):
            view(torch.empty(4, device="meta"))
