"""Zero-copy byte views of tensor memory, for writing from and reading into tensors directly."""

from __future__ import annotations

import ctypes
import sys

import torch

_PYBUF_WRITE = 0x200
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)


_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14
_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform.startswith("linux") else None
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A new CPU tensor for a bulk fill (a read, a staging copy), its memory offered to the kernel
    for transparent huge pages (Linux): first touches then fault once per 2 MiB, not per 4 KiB.

    What ``THP_MEM_ALLOC_ENABLE=1`` does for every torch allocation of the process, here only for
    the memory zerostall fills. Without transparent huge pages (or outside Linux) a plain
    ``torch.empty``.
    """
    out = torch.empty(shape, dtype=dtype)
    n = out.nbytes
    if _madvise is not None and n >= 4 * _HUGE_PAGE:
        ptr = out.data_ptr()
        start = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE  # whole huge pages inside the allocation
        _madvise(start, ptr + n - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, valid only while ``t`` lives: the
    view does not own it, so never pass a temporary (such as ``x.cpu()``; see :func:`owned_bytes`).

    Built by ``PyMemoryView_FromMemory``: a plain 1-D ``B`` view with no ctypes array type per
    size, which made every later slice and buffer export measurably slower on the write path.
    """
    if t.device.type != "cpu":
        raise ValueError(f"a byte view needs a tensor in host memory, not on {t.device}: copy it to the CPU first")
    n = t.nbytes
    if n == 0:
        return memoryview(bytearray())
    return _memory_view(t.data_ptr(), n, _PYBUF_WRITE)


def owned_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor that keeps the tensor alive as long as the view (or a
    slice of it) lives: for temporaries, such as the host copy of a device tensor."""
    if t.device.type != "cpu":
        raise ValueError(f"a byte view needs a tensor in host memory, not on {t.device}: copy it to the CPU first")
    if t.nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    array._owner = t  # type: ignore[attr-defined]
    return memoryview(array).cast("B")
