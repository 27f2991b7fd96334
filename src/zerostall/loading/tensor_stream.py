"""Tensor entries streamed in row-major order a slab at a time, for writers of other formats
(export): every stored byte is read once, in whole checked blocks, and copied straight into the
output dtype.

A slab of a tensor saved by many ranks needs a piece of every rank's chunk (``Shard(1)``: a few
rows of each), less than a checksum block of each: the block a slab needs only the start of is
held for the next slab (at most ``staging`` bytes of such blocks; beyond that it is read again).
Bytes that land in the output as they are stored (the same dtype, in one run of it) are read
straight into the output; the others through a per-thread staging buffer. One thread pool and the
storage's open files serve every slab.

Reused buffers keep resident memory flat: a fresh buffer per slab would leave freed memory
resident (glibc raises its mmap threshold after a large free, then serves later slabs from a
heap it does not trim). Reads go through ``preadv``, never memory maps, whose pages would count
as resident too.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, NamedTuple

import torch

from ..format.boxes import contiguous_strides, element_span, flat_boxes, intersect
from ..format.layout import Chunk, Entry, Manifest
from ..memory import tensor_bytes
from ..storage import Storage
from .fetch import MAX_ITEMSIZE, run_largest_first
from .reader import ChunkReader

_END = object()


class _Read(NamedTuple):
    """Stored bytes ``[lo, hi)`` of a chunk (whole units), of which ``[take_lo, take_hi)`` go to
    the output: straight into it (``direct``), else through a staging buffer, or through ``keep``,
    a buffer that holds the unit for the next slab."""

    chunk: Chunk
    lo: int
    hi: int
    take_lo: int
    take_hi: int
    direct: bool = False
    keep: torch.Tensor | None = None


class _Copy(NamedTuple):
    """Chunk bytes ``[take_lo, take_hi)`` of a held unit that starts at ``lo``, to the output."""

    chunk: Chunk
    held: torch.Tensor
    lo: int
    take_lo: int
    take_hi: int


class TensorStream:
    """Reads tensor entries of one checkpoint (its ``manifest`` on ``storage``) a slab of at most
    about ``slab_bytes`` at a time with ``threads`` threads; ``staging``: the bytes of blocks held
    between slabs."""

    def __init__(self, storage: Storage, manifest: Manifest, threads: int, slab_bytes: int, staging: int) -> None:
        self.reader = ChunkReader(storage, manifest, threads)
        self.block = manifest.block_size
        self.workers = max(threads, storage.requests_in_flight)  # waiting on requests costs no core
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="zerostall-read")
        self.unit = math.lcm(manifest.block_size, MAX_ITEMSIZE)  # slabs start at whole blocks: checked reads
        self.slab = max(self.unit, slab_bytes // self.unit * self.unit)
        self.staging = staging
        self._local = threading.local()  # .buf: this thread's staging buffer
        self._ring = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        self._held: dict[int, tuple[int, torch.Tensor]] = {}  # id(chunk) -> (unit start, its bytes)
        self._spare: list[torch.Tensor] = []  # buffers for held units, not holding one now
        self._held_bytes = 0  # of every buffer for held units

    def close(self) -> None:
        self._pool.shutdown()
        self.reader.close()

    def steps(self, entry: Entry, dtype: torch.dtype) -> list[tuple[int, int]]:
        """Element ranges ``[first, last)`` of ``entry`` read at a time when written as ``dtype``."""
        stored = entry.torch_dtype.itemsize
        per_unit = self.unit // stored
        step = max(per_unit, self.slab // max(stored, dtype.itemsize) // per_unit * per_unit)
        numel = math.prod(entry.shape or ())
        return [(first, min(first + step, numel)) for first in range(0, numel, step)]

    def read(self, entry: Entry, dtype: torch.dtype, out: torch.Tensor) -> None:
        """The whole of ``entry`` as ``dtype`` into the start of the byte tensor ``out``."""
        self._start(entry)
        self._fill(entry, dtype, 0, math.prod(entry.shape or ()), out)
        self._release()

    def parts(self, tensors: Iterable[tuple[Entry, torch.dtype]]) -> Iterator[memoryview]:
        """The bytes of each ``(entry, dtype)`` in order, a slab at a time, each read by a helper
        thread while the one before is consumed. A view is valid until the next one is asked for."""
        def produce() -> Iterator[memoryview]:
            turn = 0
            for entry, dtype in tensors:
                self._start(entry)
                for first, last in self.steps(entry, dtype):
                    turn ^= 1
                    buf = self._buffer(turn, (last - first) * dtype.itemsize)
                    self._fill(entry, dtype, first, last, buf)
                    yield tensor_bytes(buf[:(last - first) * dtype.itemsize])
                self._release()

        with ThreadPoolExecutor(1, thread_name_prefix="zerostall-export") as pool:
            source = produce()
            pending = pool.submit(next, source, _END)
            while True:
                part = pending.result()
                if part is _END:
                    return
                pending = pool.submit(next, source, _END)
                yield part

    # -- one slab --------------------------------------------------------------------------------
    def _start(self, entry: Entry) -> None:
        self._release()
        if not self.reader.storage.remote:  # a truncated data file is named before any read (see Fetcher)
            self.reader.check_sizes(entry)

    def _release(self) -> None:
        self._spare.extend(buf for _, buf in self._held.values())
        self._held.clear()

    def _fill(self, entry: Entry, dtype: torch.dtype, first: int, last: int, out: torch.Tensor) -> None:
        """Elements ``[first, last)`` of ``entry`` as ``dtype`` into the start of the byte tensor ``out``:
        from every chunk they meet, the units held from the slab before copied first, then the
        others read in parallel."""
        shape = tuple(entry.shape or ())
        stored = entry.torch_dtype
        unit = math.lcm(self.block, stored.itemsize)  # whole blocks (checked reads) of whole elements
        piece = max(unit, self.slab // self.workers // unit * unit)
        dest = out[:(last - first) * dtype.itemsize].view(dtype)
        copies: list[_Copy] = []
        reads: list[_Read] = []
        kept: list[tuple[Chunk, int, torch.Tensor]] = []
        for chunk in entry.chunks:
            span = _span(shape, chunk, first, last)
            if span is None:
                continue
            lo, hi, n = span[0] * stored.itemsize, span[1] * stored.itemsize, chunk.nbytes
            start = lo
            held = self._held.pop(id(chunk), None)
            if held is not None and held[0] != lo // unit * unit:  # not the unit this slab starts in
                self._spare.append(held[1])
            elif held is not None:
                self._held[id(chunk)] = held
                start = min(held[0] + unit, n)
                copies.append(_Copy(chunk, held[1], held[0], lo, min(hi, start)))
                if hi < start:  # the slab ends inside it: still held
                    continue
                self._spare.append(self._held.pop(id(chunk))[1])  # free for this slab's reads: copies go first
            if start >= hi:
                continue
            last_unit = (hi - 1) // unit * unit
            partial = hi < min(last_unit + unit, n)  # the next slab starts inside the last unit
            at = start // unit * unit
            if at < start or (partial and at == last_unit):  # a unit whose start was not held, or the only one
                end = min(at + unit, n)
                keep = self._keep(unit) if partial and at == last_unit else None
                reads.append(_Read(chunk, at, end, start, min(hi, end), keep=keep))
                if keep is not None:
                    kept.append((chunk, at, keep))
                at = end
            middle = last_unit if partial else hi
            for a in range(at, middle, piece):
                b = min(a + piece, middle)
                direct = dtype == stored and _contiguous(shape, chunk, a // stored.itemsize, b // stored.itemsize)
                reads.append(_Read(chunk, a, b, a, b, direct=direct))
            if partial and last_unit >= at:
                keep = self._keep(unit)
                reads.append(_Read(chunk, last_unit, min(last_unit + unit, n), last_unit, hi, keep=keep))
                if keep is not None:
                    kept.append((chunk, last_unit, keep))
        copy = lambda run, _: self._copy(entry, run[0].held, run[0], shape, first, dest)  # noqa: E731
        run_largest_first(self._pool, self.workers, copy, [([c], c.take_hi - c.take_lo) for c in copies], True)
        read = lambda run, _: self._read(entry, run[0], shape, first, dest, out)  # noqa: E731
        run_largest_first(self._pool, self.workers, read, [([r], r.hi - r.lo) for r in reads], True)
        for chunk, at, buf in kept:
            self._held[id(chunk)] = (at, buf)

    def _keep(self, unit: int) -> torch.Tensor | None:
        """A buffer to hold a unit for the next slab, or None when held units take ``staging`` already."""
        for i, buf in enumerate(self._spare):
            if buf.numel() >= unit:
                return self._spare.pop(i)
        if self._held_bytes + unit > self.staging:
            return None
        self._held_bytes += unit
        return torch.empty(unit, dtype=torch.uint8)

    def _read(self, entry: Entry, job: _Read, shape: tuple[int, ...], first: int, dest: torch.Tensor,
              out: torch.Tensor) -> None:
        """Read (checked) one job's bytes: straight to the output, or staged then copied there."""
        itemsize = entry.torch_dtype.itemsize
        if job.direct:
            at = (_global_index(shape, job.chunk, job.lo // itemsize) - first) * itemsize
            self.reader.read_piece(entry, job.chunk, job.lo, tensor_bytes(out)[at:at + job.hi - job.lo], True)
            return
        buf = job.keep if job.keep is not None else self._staging(job.hi - job.lo)
        self.reader.read_piece(entry, job.chunk, job.lo, tensor_bytes(buf)[:job.hi - job.lo], True)
        self._copy(entry, buf, job, shape, first, dest)

    def _copy(self, entry: Entry, buf: torch.Tensor, job: _Read | _Copy, shape: tuple[int, ...], first: int,
              dest: torch.Tensor) -> None:
        """Copy chunk bytes ``[take_lo, take_hi)`` from ``buf`` (holding the chunk's bytes from
        ``lo`` on) into ``dest`` (the output's elements from ``first`` on), cast on the way."""
        stored = entry.torch_dtype
        data = buf[job.take_lo - job.lo:job.take_hi - job.lo].view(stored)
        chunk, e0 = job.chunk, job.take_lo // stored.itemsize
        strides, global_strides = contiguous_strides(chunk.sizes), contiguous_strides(shape)
        for offsets, sizes in flat_boxes(chunk.sizes, e0, e0 + data.numel()):
            src = data.as_strided(sizes, strides, data.storage_offset() + _dot(offsets, strides) - e0)
            at = _dot([o + c for o, c in zip(offsets, chunk.offsets)], global_strides) - first
            dest.as_strided(sizes, global_strides, dest.storage_offset() + at).copy_(src)

    def _staging(self, n: int) -> torch.Tensor:
        """This thread's reusable staging buffer of at least ``n`` bytes."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < n:
            self._local.buf = None  # freed before the larger one is made
            buf = self._local.buf = torch.empty(n, dtype=torch.uint8)
        return buf

    def _buffer(self, turn: int, n: int) -> torch.Tensor:
        if self._ring[turn].numel() < n:
            self._ring[turn] = torch.empty(0, dtype=torch.uint8)  # freed before the larger one is made
            self._ring[turn] = torch.empty(n, dtype=torch.uint8)
        return self._ring[turn]


def _dot(a: Iterable[int], b: Iterable[int]) -> int:
    return sum(x * y for x, y in zip(a, b))


def _span(shape: tuple[int, ...], chunk: Chunk, first: int, last: int) -> tuple[int, int] | None:
    """The elements ``[e0, e1)`` of ``chunk`` (row-major) that lie in the elements ``[first, last)``
    of the tensor, or None: a chunk's elements keep the tensor's row-major order, so they are one run."""
    box = (tuple(chunk.offsets), tuple(chunk.sizes))
    spans = [element_span(box, inter) for part in flat_boxes(shape, first, last)
             if (inter := intersect(part, box)) is not None]
    return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None


def _global_index(shape: tuple[int, ...], chunk: Chunk, element: int) -> int:
    """The tensor's (row-major) index of element ``element`` of ``chunk``."""
    index = 0
    for stride, offset, size in zip(contiguous_strides(chunk.sizes), chunk.offsets, shape):
        coordinate, element = divmod(element, stride)
        index = index * size + coordinate + offset
    return index


def _contiguous(shape: tuple[int, ...], chunk: Chunk, e0: int, e1: int) -> bool:
    """Whether elements ``[e0, e1)`` of ``chunk`` are one run of the tensor's elements."""
    return _global_index(shape, chunk, e1 - 1) - _global_index(shape, chunk, e0) == e1 - 1 - e0
