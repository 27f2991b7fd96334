"""Plans: which data file each chunk goes to (save), and which stored bytes each target needs (load)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import xxhash

from .format import dump_json

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(slots=True)
class WriteItem:
    """One chunk to write: the source tensor (CPU, contiguous), its entry and its box offsets."""

    entry: Any
    name: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    key: tuple[str, tuple[int, ...]] = ("", ())
    rank_local: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


def assign_files(items: Sequence[WriteItem], n_files: int) -> list[list[WriteItem]]:
    """Spread items over at most ``n_files`` files with balanced bytes (largest first, least loaded).

    Within a file, items are ordered by descending element size so that packing them with no
    gaps keeps every tensor at its natural alignment (a safetensors requirement).
    """
    n_files = max(1, min(n_files, len(items)))
    sizes = [item.nbytes for item in items]
    heap = [(0, i) for i in range(n_files)]
    files: list[list[int]] = [[] for _ in range(n_files)]
    for i in sorted(range(len(items)), key=sizes.__getitem__, reverse=True):
        load, f = heap[0]
        files[f].append(i)
        heapq.heapreplace(heap, (load + sizes[i], f))
    return [[items[i] for i in sorted(f, key=lambda i: (-items[i].tensor.element_size(), i))] for f in files if f]


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


def flat_boxes(sizes: Sequence[int], first: int, end: int) -> list[Box]:
    """Boxes (offsets, sizes) that tile the elements ``[first, end)`` of a row-major tensor of
    ``sizes``, in order: a partial row, whole rows, a partial row, each level alike (at most
    ``2 * ndim - 1`` boxes), so a byte range of stored data can be copied as strided regions."""
    if first >= end:
        return []
    if not sizes:
        return [((), ())]
    inner = 1
    for s in sizes[1:]:
        inner *= s
    row, col = divmod(first, inner)
    last_row, last_col = divmod(end, inner)
    if row == last_row:
        return [((row, *o), (1, *s)) for o, s in flat_boxes(sizes[1:], col, last_col)]
    boxes: list[Box] = []
    if col:
        boxes += [((row, *o), (1, *s)) for o, s in flat_boxes(sizes[1:], col, inner)]
        row += 1
    if last_row > row:
        boxes.append(((row, *[0] * (len(sizes) - 1)), (last_row - row, *sizes[1:])))
    if last_col:
        boxes += [((last_row, *o), (1, *s)) for o, s in flat_boxes(sizes[1:], 0, last_col)]
    return boxes


# -- the global save plan ------------------------------------------------------------------------
#
# Every rank describes what it holds (a "structure": one row per global leaf, no data); the rows
# of all ranks are gathered once and every rank computes the same plan from them, so the plan
# needs no further messages. A plan is cached under the digests of all ranks' structures: the
# next save of an unchanged structure only checks, with one small collective, that the digests
# still agree.

ChunkKey = tuple[str, tuple[int, ...]]


@dataclass(slots=True)
class Row:
    """One global leaf as one rank holds it: a tensor box, an alias or a python value."""

    key: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    nbytes: int = 0
    alias_of: str | None = None


def structure_digest(rows: Sequence[Row]) -> int:
    """A 64-bit digest of a rank's structure: equal digests mean a cached plan still fits it."""
    fields = [(r.key, r.kind, r.dtype, r.shape, r.offsets, r.sizes, r.nbytes, r.alias_of) for r in rows]
    return xxhash.xxh3_64_intdigest(dump_json(fields))  # tuples, not dataclasses: serialized in C, ~15x repr


@dataclass
class SavePlan:
    """Who writes which chunk, and the global entry table (in a rank-independent order)."""

    digests: tuple[int, ...]
    entries: list[Row]
    writers: dict[ChunkKey, int]
    holders: dict[ChunkKey, list[int]]
    bytes_per_rank: list[int]
    seed: int = 0  # the coordinator's random bits, drawn when the plan was made: part of generation ids

    def writes(self, rank: int, key: ChunkKey) -> bool:
        return self.writers.get(key) == rank


def build_plan(structures: Sequence[Sequence[Row]], digests: Sequence[int], seed: int = 0) -> SavePlan:
    """Dedup replicated chunks and balance their writing over their holders.

    Chunks are taken fewest holders first, then largest first, and each goes to its least-loaded
    holder by bytes (lowest rank on ties): deterministic, so every rank computes the same plan.
    Python values are written by their lowest-ranked holder. Raises ``ValueError`` naming the key
    when ranks disagree on a leaf's kind, dtype or global shape.
    """
    entries: dict[str, Row] = {}
    holders: dict[ChunkKey, list[int]] = {}
    sizes: dict[ChunkKey, int] = {}
    for rank, rows in enumerate(structures):
        for row in rows:
            first = entries.setdefault(row.key, row)
            if (first.kind, first.dtype, first.shape, first.alias_of) != (row.kind, row.dtype, row.shape, row.alias_of):
                raise ValueError(f"{row.key}: rank {rank} holds {_describe(row)}, another rank {_describe(first)}; "
                                 "mark per-rank values with zerostall.rank_local()")
            if row.kind in ("tensor", "object"):
                key = (row.key, row.offsets)
                holders.setdefault(key, []).append(rank)
                sizes[key] = row.nbytes
    load = [0] * len(structures)
    writers: dict[ChunkKey, int] = {}
    for key in sorted(holders, key=lambda k: (len(holders[k]), -sizes[k], k)):
        writer = min(holders[key], key=lambda r: (load[r], r))
        writers[key] = writer
        load[writer] += sizes[key]
    return SavePlan(tuple(digests), list(entries.values()), writers, holders, load, seed)


def _describe(row: Row) -> str:
    if row.kind == "tensor":
        return f"a {row.dtype} tensor of shape {list(row.shape or ())}"
    return "an alias" if row.kind == "alias" else "a python value"
