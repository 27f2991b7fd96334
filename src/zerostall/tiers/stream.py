"""The stream of one transfer between two ranks: its header, the order its chunks travel in, and
the few chunks on the wire at once.

A stream is a header (the length of a JSON document, then the document: the step the copy is of,
the copy's file names and sizes, the chunk size, how many files travel at once and where each
data file's chunks are cut, or why there is nothing), then the files' bytes in chunks. Both ends
derive the chunks from the header alone, so a receiver follows the stream to its end whatever it
makes of the bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.layout import dump_json, load_json

HEADER_LIMIT = 64 << 20
"""A copy's names, sizes and cuts; a longer header is a broken or hostile stream."""
CHUNK_LIMIT = 64 << 20
"""The largest chunk a receiver takes (it holds a few)."""
IN_FLIGHT = 4
"""Chunks of one transfer on the wire at once."""
FILES_LIMIT = 4096
"""A copy's files (its manifest and a data file per writer thread); more is a broken or hostile stream."""


class LinkError(CheckpointError):
    """A transfer between two ranks failed in the transport: the peer died, or a wait timed out.
    gloo then closes the pair for good, so the group that carried it cannot be trusted again."""


@dataclass(frozen=True)
class Plan:
    """What a header announces: the files (names and sizes, the manifest first), the chunk size,
    how many files travel at once, and per file the offsets where a chunk must begin (the bounds of
    tensors large enough for a receiver to put straight into memory)."""

    files: list[tuple[str, int]]
    chunk: int
    wave: int
    cuts: list[list[int]]

    def waves(self) -> Iterator[tuple[list[int], Iterator[tuple[int, int, int]]]]:
        """The order the chunks travel in, by wave: (its files' indexes, its chunks as (file index,
        offset, size)). The manifest travels alone, then the other files ``wave`` at a time, their
        chunks in turn, so the receiver writes that many files at once (writes into one file wait
        for each other)."""
        starts = range(1, len(self.files), self.wave)
        for group in [[0]] + [list(range(i, min(i + self.wave, len(self.files)))) for i in starts]:
            turns = zip_longest(*(self._chunks(f) for f in group))
            yield group, (c for turn in turns for c in turn if c is not None)

    def _chunks(self, f: int) -> Iterator[tuple[int, int, int]]:
        """File ``f`` in chunks of at most ``chunk`` bytes, none across a cut."""
        size = self.files[f][1]
        bounds = [0, *self.cuts[f], size]
        for lo, hi in zip(bounds, bounds[1:]):
            for offset in range(lo, hi, self.chunk):
                yield f, offset, min(self.chunk, hi - offset)

    def edges(self) -> set[tuple[int, int]]:
        """Every (file index, offset) that a chunk begins at or ends at for sure: each file's start, cuts and end."""
        return {(f, c) for f, (_, size) in enumerate(self.files) for c in (0, *self.cuts[f], size)}


def send_header(pg: Any, dst: int, header: dict[str, Any]) -> None:
    """Send ``header`` to ``dst``: its length, then its JSON."""
    data = torch.frombuffer(bytearray(dump_json(header)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), group_dst=dst, group=pg)
    dist.send(data, group_dst=dst, group=pg)


def plan_header(plan: Plan) -> dict[str, Any]:
    """The header that announces ``plan``."""
    return {"files": [list(f) for f in plan.files], "chunk": plan.chunk, "wave": plan.wave, "cuts": plan.cuts}


def receive_header(pg: Any, src: int, final: Path, step: int | None) -> Plan | None:
    """What the copy of ``step`` that ``src`` sends holds, or None when it has none; a header of the
    wrong shape is a :class:`CorruptCheckpointError` (the stream cannot be followed further), one
    of another step a :class:`LinkError` (the two ranks are out of step: the group is not to be trusted)."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, group_src=src, group=pg)
    n = int(length.item())
    if not 0 < n <= HEADER_LIMIT:
        raise CorruptCheckpointError(f"rank {src} announced a header of {n} bytes for {final}: not a copy (refused)")
    data = torch.empty(n, dtype=torch.uint8)
    dist.recv(data, group_src=src, group=pg)
    try:
        header = load_json(data.numpy().tobytes())
    except ValueError as exc:
        raise CorruptCheckpointError(f"rank {src} sent a header for {final} that is not JSON: {exc}") from None
    header = header if isinstance(header, dict) else {}
    if header.get("step") != step:
        raise LinkError(f"rank {src} sent a copy of step {header.get('step')!r:.20} for {final}, of step {step}: the "
                        "two ranks are out of step, so the tier's group is not used again")
    if "error" in header:  # a copy found damaged or incomplete where it lies is damage, as one found here
        kind = CorruptCheckpointError if header.get("damaged") is True else CheckpointError
        raise kind(f"rank {src} could not send its copy for {final}: {header['error']}")
    files, chunk, wave, cuts = header.get("files", ()), header.get("chunk"), header.get("wave"), header.get("cuts")
    if files is None:
        return None
    if not (isinstance(files, list) and 0 < len(files) <= FILES_LIMIT
            and all(isinstance(f, list) and len(f) == 2 and type(f[1]) is int and f[1] >= 0 for f in files)
            and type(chunk) is int and 0 < chunk <= CHUNK_LIMIT and type(wave) is int and 0 < wave <= 64
            and isinstance(cuts, list) and len(cuts) == len(files)
            and all(_increasing(c, size) for c, (_, size) in zip(cuts, files))):
        raise CorruptCheckpointError(f"rank {src} sent a header for {final} of the wrong shape: {header!r:.200}")
    return Plan([(name, size) for name, size in files], chunk, wave, cuts)


def _increasing(cuts: Any, size: int) -> bool:
    """Cuts of a file of ``size`` bytes: ints strictly inside it, each above the one before."""
    return (isinstance(cuts, list) and all(type(c) is int and 0 < c < size for c in cuts)
            and all(a < b for a, b in zip(cuts, cuts[1:])))


class Wire:
    """The chunks of one transfer on the wire, at most ``IN_FLIGHT`` at once, completed in order."""

    def __init__(self, pg: Any, peer: int) -> None:
        self.pg, self.peer = pg, peer
        self.works: deque[tuple[Any, torch.Tensor | None, Callable[[], None] | None]] = deque()

    def send(self, data: torch.Tensor) -> None:
        self._post(dist.isend(data, group_dst=self.peer, group=self.pg), data, None)

    def receive(self, into: torch.Tensor, then: Callable[[], None]) -> None:
        """Receive the next chunk into ``into``; ``then()`` runs once it has arrived."""
        self._post(dist.irecv(into, group_src=self.peer, group=self.pg), into, then)

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once every chunk posted so far has arrived (or been sent)."""
        self._post(None, None, fn)

    def finish(self) -> None:
        while self.works:
            self._complete_one()

    def _post(self, work: Any, data: torch.Tensor | None, then: Callable[[], None] | None) -> None:
        """Queue a transfer (or only a callback); complete the oldest while ``IN_FLIGHT`` are queued."""
        self.works.append((work, data, then))  # the tensor stays referenced until its transfer is done
        if len(self.works) >= IN_FLIGHT:
            self._complete_one()

    def _complete_one(self) -> None:
        work, _, then = self.works.popleft()
        if work is not None:
            work.wait()
        if then is not None:
            then()
