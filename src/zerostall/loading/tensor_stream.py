"""Tensor entries streamed in row-major order a slab at a time, for writers of other formats
(export): read through a :class:`~zerostall.loading.fetch.Fetcher` (every block's checksum verified; the
boxes of any number of ranks assembled), cast on the way, into buffers allocated once.

Reused buffers keep resident memory flat: a fresh buffer per slab would leave freed memory
resident (glibc raises its mmap threshold after a large free, then serves later slabs from a
heap it does not trim). Reads go through ``preadv``, never memory maps, whose pages would count
as resident too.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import torch

from ..format.boxes import flat_boxes
from ..format.layout import Entry, Manifest
from ..memory import tensor_bytes
from ..storage import Storage
from .fetch import Fetcher

_MAX_ITEMSIZE = 16  # slabs start at whole elements of every dtype
_END = object()


class TensorStream:
    """Reads tensor entries of one checkpoint (its ``manifest`` on ``storage``) a slab of at most
    about ``slab_bytes`` at a time; ``staging``: the bytes a resharding read may stage at once."""

    def __init__(self, storage: Storage, manifest: Manifest, threads: int, slab_bytes: int, staging: int) -> None:
        self.fetcher = Fetcher(storage, manifest, threads)
        self.block, self.threads = manifest.block_size, threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zerostall-read")
        self.unit = math.lcm(manifest.block_size, _MAX_ITEMSIZE)  # slabs start at whole blocks: checked reads
        self.slab = max(self.unit, slab_bytes // self.unit * self.unit)
        self.staging = staging
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._ring = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]

    def close(self) -> None:
        self._pool.shutdown()
        self.fetcher.close()

    def steps(self, entry: Entry, dtype: torch.dtype) -> list[tuple[int, int]]:
        """Element ranges ``[first, last)`` of ``entry`` read at a time when written as ``dtype``."""
        stored = entry.torch_dtype.itemsize
        per_unit = self.unit // stored
        step = max(per_unit, self.slab // max(stored, dtype.itemsize) // per_unit * per_unit)
        numel = math.prod(entry.shape or ())
        return [(first, min(first + step, numel)) for first in range(0, numel, step)]

    def read(self, entry: Entry, dtype: torch.dtype, first: int, last: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[first, last)`` of ``entry`` as ``dtype``, read into the start of the byte
        tensor ``out``; returns that part of ``out``."""
        stored = entry.torch_dtype
        n = last - first
        dest = out[:n * stored.itemsize] if dtype == stored else self._scratch_bytes(n * stored.itemsize)
        shape = tuple(entry.shape or ())
        if len(entry.chunks) == 1 and entry.chunks[0].sizes == shape:  # one chunk: a byte range of it
            self._read_range(entry, first * stored.itemsize, tensor_bytes(dest))
        else:  # stored by several ranks: the boxes of this range, from every chunk they meet
            targets, at = [], 0
            for box in flat_boxes(shape, first, last):
                size = math.prod(box[1]) * stored.itemsize
                targets.append((dest[at:at + size].view(stored).view(box[1]), box, entry))
                at += size
            self.fetcher.fill(targets, True, self.staging)
        if dtype == stored:
            return dest
        result = out[:n * dtype.itemsize]
        result.view(dtype).copy_(dest.view(stored))
        return result

    def _read_range(self, entry: Entry, lo: int, out: memoryview) -> None:
        """Bytes ``[lo, lo + len(out))`` of the one chunk of ``entry``, checked, read in parallel in
        whole blocks (``lo`` starts a block)."""
        blocks = -(-len(out) // self.block)
        per = -(-blocks // min(blocks, self.threads)) * self.block
        chunk = entry.chunks[0]
        list(self._pool.map(lambda a: self.fetcher.read_piece(entry, chunk, lo + a, out[a:a + per], True),
                            range(0, len(out), per)))

    def parts(self, tensors: Iterable[tuple[Entry, torch.dtype]]) -> Iterator[memoryview]:
        """The bytes of each ``(entry, dtype)`` in order, a slab at a time, each read by a helper
        thread while the one before is consumed. A view is valid until the next one is asked for."""
        def produce() -> Iterator[memoryview]:
            turn = 0
            for entry, dtype in tensors:
                for first, last in self.steps(entry, dtype):
                    turn ^= 1
                    buf = self._buffer(turn, (last - first) * max(entry.torch_dtype.itemsize, dtype.itemsize))
                    yield tensor_bytes(self.read(entry, dtype, first, last, buf))

        with ThreadPoolExecutor(1, thread_name_prefix="zerostall-export") as pool:
            source = produce()
            pending = pool.submit(next, source, _END)
            while True:
                part = pending.result()
                if part is _END:
                    return
                pending = pool.submit(next, source, _END)
                yield part

    def _buffer(self, turn: int, n: int) -> torch.Tensor:
        if self._ring[turn].numel() < n:
            self._ring[turn] = torch.empty(0, dtype=torch.uint8)  # freed before the larger one is made
            self._ring[turn] = torch.empty(n, dtype=torch.uint8)
        return self._ring[turn]

    def _scratch_bytes(self, n: int) -> torch.Tensor:
        if self._scratch.numel() < n:
            self._scratch = torch.empty(0, dtype=torch.uint8)
            self._scratch = torch.empty(n, dtype=torch.uint8)
        return self._scratch[:n]
