"""Incremental saves: a chunk whose bytes equal those of the same chunk in the manager's last
committed save is not written again; the manifest refers to its bytes where they lie.

"Unchanged" is decided by the bytes' own block checksums (those a save computes anyway), never by
a tensor's version counter or ``requires_grad``: writes through ``.data`` bump no version, and a
frozen tensor can still be written in place. A version counter that moved does tell "written to":
such a chunk is written without being compared. References always name the checkpoint that wrote
the bytes (never a reference of a reference), so they can only point back in time, never form a
cycle, and a checkpoint that owns no referenced file can be deleted without looking further.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..balance import balance
from ..format.checksums import BlockHasher, block_checksums
from ..format.layout import Chunk
from ..memory import tensor_bytes
from .collect import ChunkKey, Version, WriteItem
from .write import device_pieces


@dataclass
class Reuse:
    """What one rank's next incremental save may refer to: the chunks of its last committed save."""

    tag: str
    """The checkpoint that save committed (a directory beside the next one, in the same root)."""
    step: int | None
    """Its step: a save of this step or an earlier one sets it aside, so nothing may refer to it."""
    chunks: dict[ChunkKey, Chunk]
    """Each chunk this rank saved, by key: its box, file, offset, size and block checksums."""
    files: dict[str, tuple[str, int, str]]
    """Each data file those chunks lie in: the tag of the checkpoint owning it, its size, its header checksum."""
    versions: dict[ChunkKey, Version]
    """Each chunk's tensor's version counter when that save collected it: one that moved since was
    written to in place, so it is written again without being compared first."""


def split_unchanged(items: list[WriteItem], now: list[Version] | None, reuse: Reuse, threads: int,
                    block_size: int) -> tuple[list[WriteItem], list[tuple[WriteItem, Chunk]]]:
    """The items to write, and those whose bytes equal the chunk ``reuse`` holds under the same key
    and box (each with that chunk); the candidates are hashed in parallel, balanced by bytes. An
    item whose version counter (``now``, in the items' order) moved since is written unhashed:
    writing is always safe; only "unchanged" needs the proof of equal checksums."""
    candidates, changed = [], []
    for i, item in enumerate(items):
        held = reuse.chunks.get(item.key)
        moved = now is not None and now[i] is not None and reuse.versions.get(item.key, now[i]) != now[i]
        if held is not None and not moved and held.nbytes == item.nbytes > 0 \
                and held.sizes == tuple(item.tensor.shape) and held.offset % max(1, item.tensor.element_size()) == 0:
            # (an empty chunk is written: it would keep an earlier file alive for nothing)
            candidates.append((item, held))
        else:
            changed.append(item)
    if not candidates:
        return changed, []
    n = max(1, min(threads, len(candidates)))
    where, _ = balance([item.nbytes for item, _ in candidates], n)
    groups: list[list[tuple[WriteItem, Chunk]]] = [[] for _ in range(n)]
    for pair, g in zip(candidates, where):
        groups[g].append(pair)
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="zerostall-compare") as pool:
        verdicts = list(pool.map(lambda g: [_checksums(i, block_size) == held.checksums for i, held in g], groups))
    same: list[tuple[WriteItem, Chunk]] = []
    for group, equal in zip(groups, verdicts):
        for pair, eq in zip(group, equal):
            if eq:
                same.append(pair)
            else:
                changed.append(pair[0])
    return changed, same


def _checksums(item: WriteItem, block_size: int) -> list[str]:
    tensor = item.tensor
    if tensor.device.type == "cpu":
        return block_checksums(tensor_bytes(tensor), block_size)
    hasher = BlockHasher(block_size)
    for piece in device_pieces(tensor, block_size, threading.Event()):
        hasher.update(piece)
    return hasher.finish()


def refer(same: list[tuple[WriteItem, Chunk]], reuse: Reuse, files: dict[str, int],
          headers: dict[str, str]) -> dict[str, str]:
    """Give each unchanged item's entry the chunk it refers to (its new box position kept), add the
    files they lie in to ``files`` and ``headers``; returns those files' owners (the manifest's ``refs``)."""
    refs: dict[str, str] = {}
    for item, held in same:
        item.entry.chunks.append(Chunk(item.offsets, held.sizes, held.file, held.offset, held.nbytes,
                                       list(held.checksums)))
        if held.file not in refs:
            refs[held.file], files[held.file], headers[held.file] = reuse.files[held.file]
    return refs


def next_reuse(tag: str, step: int | None, items: list[WriteItem], now: list[Version] | None, placed: list[Chunk],
               files: dict[str, int], headers: dict[str, str], refs: dict[str, str]) -> Reuse:
    """What the save after this one (committed as ``tag``) may refer to: every item's chunk
    (``placed``, in the items' order), in a file this save wrote or one it referred to in turn
    (named with the checkpoint that owns it)."""
    chunks = {item.key: chunk for item, chunk in zip(items, placed)}
    owners = {name: (refs.get(name, tag), size, headers.get(name, "")) for name, size in files.items()}
    versions = {item.key: v for item, v in zip(items, now)} if now is not None else {}
    return Reuse(tag, step, chunks, owners, versions)
