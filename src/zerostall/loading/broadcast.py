"""Broadcast loads: chunks that every rank needs whole are read once and sent to the others.

Each such chunk is read (and verified) by one rank, balanced by bytes, and broadcast into
preallocated buffers on the others: the target tensor itself where layouts match, else a buffer
of at most the load's staging budget (a larger chunk travels in slices of that size), copied into
every target that holds the chunk (tied weights loaded into separate tensors each get it). Every
rank runs every broadcast, even after a failed read or copy, and then all fail together, so no
rank waits in a collective for good.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from ..balance import balance
from ..collectives import Group
from ..errors import CheckpointError
from ..format.boxes import Box, intersect
from ..format.layout import Chunk, Entry
from ..memory import host_empty, tensor_bytes
from .fetch import MAX_ITEMSIZE, Fetcher, Target, copy_part, direct_read

ChunkId = tuple[int, int]  # an entry's index in the manifest and a chunk's index in the entry
Whole = tuple[torch.Tensor, Box, Entry, Chunk]  # a target that needs a chunk whole
Slice = tuple[ChunkId, int, int]  # bytes [lo, hi) of a chunk, broadcast together


def broadcast_fill(fetcher: Fetcher, group: Group, targets: list[Target], verify: bool,
                   staging: int) -> set[tuple[int, int]]:
    """Deliver the chunks that every rank needs whole: one rank reads each (balanced by bytes,
    verified) and broadcasts it into preallocated buffers, the target itself where layouts
    match; other buffers hold at most ``staging`` bytes at a time (at least a block). Returns
    the (target id, chunk id) pairs delivered."""
    if group.device.type != "cpu":
        raise CheckpointError("broadcast=True moves host buffers and needs a process group that can (gloo); "
                              "open the checkpoint with process_group=dist.new_group(backend='gloo')")
    index = {id(e): i for i, e in enumerate(fetcher.manifest.entries)}
    wanted: dict[ChunkId, list[Whole]] = {}
    for target, box, entry in targets:
        for n, chunk in enumerate(entry.chunks):
            if intersect(box, (chunk.offsets, chunk.sizes)) == (chunk.offsets, chunk.sizes) and chunk.nbytes:
                wanted.setdefault((index[id(entry)], n), []).append((target, box, entry, chunk))
    for key in wanted:  # a target that can take the bytes as they are receives them first
        wanted[key].sort(key=lambda whole: not direct_read(*whole))
    mine = [key for key in wanted if direct_read(*wanted[key][0])]
    unit = math.lcm(fetcher.manifest.block_size, MAX_ITEMSIZE)  # whole blocks and whole elements
    # every rank must run the same broadcasts of the same sizes: which chunks travel whole into a
    # target, and the slices of the others, are agreed (each rank's targets and budget may differ)
    everyone = group.all_gather_object((sorted(wanted), mine, max(unit, staging // unit * unit)))
    common = sorted(set.intersection(*(set(map(tuple, keys)) for keys, _, _ in everyone)))
    direct = set(common).intersection(*(set(map(tuple, keys)) for _, keys, _ in everyone))
    step = min(size for _, _, size in everyone)
    nbytes = {key: wanted[key][0][3].nbytes for key in common}
    order = sorted(range(len(common)), key=lambda i: (-nbytes[common[i]], common[i]))
    where, _ = balance([nbytes[key] for key in common], group.size, order=order)
    readers = dict(zip(common, where))
    slices = [(key, lo, min(lo + step, nbytes[key])) for key in common
              for lo in (range(0, nbytes[key], step) if key not in direct else (0,))]
    failure: BaseException | None = None
    with ThreadPoolExecutor(fetcher.threads, thread_name_prefix="zerostall-read") as pool:
        for batch in _batches(slices, lambda s: 0 if s[0] in direct else s[2] - s[1], staging):
            failure = _broadcast_batch(fetcher, group, pool, batch, wanted, readers, direct, verify) or failure
    with group.failing_together(f"broadcast load from {fetcher.path} failed: {{failed}} rank(s) could not "
                                "read or place their share (their errors name the file)"):
        if failure is not None:
            raise failure
    return {(id(whole[0]), id(whole[3])) for key in common for whole in wanted[key]}


def _broadcast_batch(fetcher: Fetcher, group: Group, pool: ThreadPoolExecutor, batch: list[Slice],
                     wanted: dict[ChunkId, list[Whole]], readers: dict[ChunkId, int], direct: set[ChunkId],
                     verify: bool) -> BaseException | None:
    """Read this rank's slices of ``batch``, broadcast every slice from its reader (every rank
    runs the same broadcasts, even after a failed read) and copy them into the targets that did
    not receive them. Returns this rank's first failure."""
    buffers = {s: wanted[s[0]][0][0].data.reshape(-1).view(torch.uint8) if s[0] in direct
               else host_empty(s[2] - s[1]) for s in batch}
    reads = {s: pool.submit(_read_slice, fetcher, wanted[s[0]][0], s, buffers[s], verify)
             for s in batch if readers[s[0]] == group.rank}
    failure = None
    for s in batch:
        if s in reads:
            try:
                reads[s].result()
            except Exception as exc:  # whatever it is, this rank still takes part in every broadcast
                failure = failure or exc
        group.broadcast_tensor(buffers[s], src=readers[s[0]])
    with torch.no_grad():
        for (key, lo, _), buf in buffers.items():
            for target, box, entry, chunk in wanted[key][1 if key in direct else 0:]:
                try:
                    copy_part(target, box, entry, chunk, (chunk.offsets, chunk.sizes), lo, buf.view(entry.torch_dtype))
                except Exception as exc:
                    failure = failure or exc
    return failure


def _read_slice(fetcher: Fetcher, whole: Whole, s: Slice, buf: torch.Tensor, verify: bool) -> None:
    """Read bytes [lo, hi) of the chunk ``s`` names into ``buf``."""
    _, _, entry, chunk = whole
    fetcher.read_bytes(entry, chunk, s[1], tensor_bytes(buf), verify)


def _batches(items: list[Any], size: Callable[[Any], int], limit: int) -> Iterator[list[Any]]:
    """``items`` in order, in batches of at most ``limit`` total ``size`` (an item alone may exceed it)."""
    batch: list[Any] = []
    total = 0
    for item in items:
        if batch and total + size(item) > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size(item)
    if batch:
        yield batch
