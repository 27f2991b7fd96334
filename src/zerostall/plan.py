"""Plans: which data file each chunk goes to (save), and which stored bytes each target needs (load)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class WriteItem:
    """One chunk to write: the source tensor (CPU, contiguous) and its place in the entry."""

    entry: int
    name: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def assign_files(items: Sequence[WriteItem], n_files: int) -> list[list[WriteItem]]:
    """Spread items over at most ``n_files`` files with balanced bytes (largest first, least loaded).

    Within a file, items are ordered by descending element size so that packing them with no
    gaps keeps every tensor at its natural alignment (a safetensors requirement).
    """
    n_files = max(1, min(n_files, len(items)))
    heap = [(0, i) for i in range(n_files)]
    files: list[list[tuple[int, WriteItem]]] = [[] for _ in range(n_files)]
    order = sorted(range(len(items)), key=lambda i: -items[i].nbytes)
    for i in order:
        load, f = heapq.heappop(heap)
        files[f].append((i, items[i]))
        heapq.heappush(heap, (load + items[i].nbytes, f))
    return [
        [item for _, item in sorted(f, key=lambda p: (-p[1].tensor.element_size(), p[0]))]
        for f in files if f
    ]


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes (offsets, sizes), or None when they do not overlap."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def element_span(chunk: Box, inner: Box) -> tuple[int, int]:
    """First and one-past-last element index, within the row-major chunk, that ``inner`` touches."""
    strides = contiguous_strides(chunk[1])
    first = sum((io - co) * st for io, co, st in zip(inner[0], chunk[0], strides))
    last = sum((io + isz - 1 - co) * st for io, isz, co, st in zip(inner[0], inner[1], chunk[0], strides))
    return first, last + 1
