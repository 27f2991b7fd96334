"""Zero-copy byte views of tensor memory, for writing from and reading into tensors directly."""

from __future__ import annotations

import ctypes

import torch

_PYBUF_WRITE = 0x200
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (valid while ``t`` lives).

    Built by ``PyMemoryView_FromMemory``: a plain 1-D ``B`` view with no ctypes array type per
    size, which made every later slice and buffer export measurably slower on the write path.
    """
    n = t.nbytes
    if n == 0:
        return memoryview(bytearray())
    return _memory_view(t.data_ptr(), n, _PYBUF_WRITE)
