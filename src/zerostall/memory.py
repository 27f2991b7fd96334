"""Zero-copy byte views of tensor memory, for writing from and reading into tensors directly; new
host memory for bulk fills."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os

import torch

_PYBUF_WRITE = 0x200
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)


_HUGE_PAGE = 1 << 21
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=None)
def _advised() -> bool:
    """Whether advice is what gives huge pages: Linux with transparent huge pages in ``madvise``
    mode (``always`` gives them unasked, without the compaction advice may cost), unless
    ``ZEROSTALL_HUGE_PAGES=0``."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("ZEROSTALL_HUGE_PAGES", "1") == "0":
        return False
    try:
        with open(_THP_MODE) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A new CPU tensor for a bulk fill (a read, a staging copy), in memory offered to the kernel
    for transparent huge pages: filling it then faults once per 2 MiB, not per 4 KiB.

    Where advice gives them (see :func:`_advised`) and the tensor is large, the memory is a mapping
    of its own, starting on a 2 MiB boundary and unmapped when the tensor is freed, so the advice
    never reaches memory that the process's allocator hands out again; like a memory-mapped
    tensor's, its storage cannot be resized. Otherwise a plain ``torch.empty``.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    n = math.prod(dims) * dtype.itemsize
    if n < 4 * _HUGE_PAGE or not _advised():
        return torch.empty(dims, dtype=dtype)
    mapping = mmap.mmap(-1, n + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    # a storage of exactly its bytes (saved or shared, it carries no padding), keeping the mapping alive
    return torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=start).view(dtype).view(dims)


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
