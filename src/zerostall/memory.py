"""Zero-copy byte views of tensor memory, for writing from and reading into tensors directly; new
host memory for bulk fills."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Callable

import torch

_PYBUF_WRITE = 0x200
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)


_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=None)
def _advise() -> Callable[..., int] | None:
    """``madvise`` where advice is what gives huge pages: Linux with transparent huge pages in
    ``madvise`` mode (``always`` gives them unasked, without the compaction advice may cost), unless
    ``ZEROSTALL_HUGE_PAGES=0``."""
    if not sys.platform.startswith("linux") or os.environ.get("ZEROSTALL_HUGE_PAGES", "1") == "0":
        return None
    try:
        with open(_THP_MODE) as f:
            if "[madvise]" not in f.read():
                return None
    except OSError:
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A new CPU tensor for a bulk fill (a read, a staging copy), its memory offered to the kernel
    for transparent huge pages: filling it then faults once per 2 MiB, not per 4 KiB.

    What ``THP_MEM_ALLOC_ENABLE=1`` does for every torch allocation of the process, here only for
    the memory zerostall fills; elsewhere (see :func:`_advise`) a plain ``torch.empty``.
    """
    out = torch.empty(shape, dtype=dtype)
    n = out.nbytes
    madvise = _advise() if n >= 4 * _HUGE_PAGE else None
    if madvise is not None:
        ptr = out.data_ptr()
        start = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE  # whole huge pages inside the allocation
        madvise(start, ptr + n - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
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
