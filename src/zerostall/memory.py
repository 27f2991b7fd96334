"""Zero-copy byte views of tensor memory, for writing from and reading into tensors directly."""

from __future__ import annotations

import ctypes

import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (valid while ``t`` lives)."""
    n = t.nbytes
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
