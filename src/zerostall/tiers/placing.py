"""Where a copy arriving for a restore goes in memory: which of its chunks are received straight
into the state's tensors, instead of into the copy's folder (see :mod:`zerostall.tiers.transfer`).

A sender cuts its stream at the bounds of chunks of at least :data:`PLACEABLE` bytes; the receiver
asks a :data:`Placer` (the state's side) which of the tensor entries the stream carries alone
can take their bytes as they are, and keeps those whose bytes overlap no other chosen one's, in
the files or in memory, so every byte hashed in memory is the byte left there.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Collection

import torch

from ..format.layout import Manifest
from ..state import fqn
from .stream import Plan

PLACEABLE = 256 << 10
"""The bytes of a chunk from which a sender cuts the stream at its bounds, so that a restoring
receiver may put it straight into memory (smaller ones travel with their neighbours)."""

Placer = Callable[[Manifest, Collection[int]], dict[int, torch.Tensor]]
"""Given a received copy's manifest and the tensor entries (by index) whose one chunk the stream
carries alone: the memory (contiguous ``uint8``, the chunk's size) each of them may be received into."""


class Spans:
    """The memory each placed chunk of a copy arrives into, by file, and the entries placed."""

    def __init__(self, plan: Plan, manifest: Manifest, place: Placer) -> None:
        self.by_file: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # (start, end, memory), sorted
        self.placed: list[str] = []  # the dotted names of the entries placed, as a load selects them
        index = {name: f for f, (name, _) in enumerate(plan.files)}
        edges, alone = plan.edges(), {}  # alone: the entries of one chunk cut at both ends: (file, start, end)
        for i, entry in enumerate(manifest.entries):
            if entry.kind == "tensor" and len(entry.chunks) == 1:
                f, start = index.get(entry.chunks[0].file), entry.chunks[0].offset
                end = start + entry.chunks[0].nbytes
                if f and end > start and (f, start) in edges and (f, end) in edges:
                    alone[i] = (f, start, end)
        chosen = []
        for i, into in (place(manifest, alone.keys()) if alone else {}).items():
            f, start, end = alone.get(i, (0, 0, 0))
            if f and into.dtype == torch.uint8 and into.is_contiguous() and into.numel() == end - start:
                chosen.append((f, start, end, into, fqn(manifest.entries[i].path)))
        kept, ends, memory_end = [], {}, -1
        for f, start, end, into, name in sorted(chosen, key=lambda c: c[3].data_ptr()):
            if into.data_ptr() >= memory_end:
                kept.append((f, start, end, into, name))
                memory_end = into.data_ptr() + into.numel()
        for f, start, end, into, name in sorted(kept, key=lambda c: c[:3]):
            if start >= ends.get(f, 0):
                self.by_file.setdefault(f, []).append((start, end, into))
                self.placed.append(name)
                ends[f] = end

    def memory(self, f: int, offset: int, n: int) -> torch.Tensor | None:
        """Where in memory the chunk of file ``f`` at ``offset`` of ``n`` bytes arrives, or None (a buffer)."""
        spans = self.by_file.get(f)
        i = bisect_right(spans, offset, key=lambda s: s[0]) - 1 if spans else -1
        if i < 0 or offset + n > spans[i][1]:
            return None
        start, _, into = spans[i]
        return into[offset - start:offset - start + n]


def direct(into: torch.Tensor) -> bool:
    """Whether bytes are received straight into ``into`` (host memory), rather than into a buffer,
    checked there and copied into it (a GPU's memory)."""
    return into.device.type == "cpu"
