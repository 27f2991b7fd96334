"""Broadcast loads: chunks that every rank needs whole are read once and sent to the others.

Each such chunk is read (and verified) by one rank, balanced by bytes, and broadcast into
preallocated buffers on the others: the target tensor itself where layouts match, a bounded
buffer otherwise. Every rank runs every broadcast, even after a failed read, and then all fail
together, so no rank waits in a collective for good.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from ..balance import balance
from ..collectives import Group
from ..errors import CheckpointError
from ..format.boxes import Box, intersect, region
from ..format.layout import Chunk, Entry
from ..memory import host_empty
from .fetch import Fetcher, Target, direct_read

ChunkId = tuple[int, int]  # an entry's index in the manifest and a chunk's index in the entry
Whole = tuple[torch.Tensor, Box, Entry, Chunk]  # a target that needs a chunk whole


def broadcast_fill(fetcher: Fetcher, group: Group, targets: list[Target], verify: bool, staging: int) -> set[int]:
    """Deliver the chunks that every rank needs whole: one rank reads each (balanced by bytes,
    verified) and broadcasts it into preallocated buffers, the target itself where layouts
    match; other buffers hold at most ``staging`` bytes at a time. Returns the ids of the
    chunks delivered."""
    if group.device.type != "cpu":
        raise CheckpointError("broadcast=True moves host buffers and needs a process group that can (gloo); "
                              "open the checkpoint with process_group=dist.new_group(backend='gloo')")
    index = {id(e): i for i, e in enumerate(fetcher.manifest.entries)}
    wanted: dict[ChunkId, Whole] = {}
    for target, box, entry in targets:
        for n, chunk in enumerate(entry.chunks):
            if intersect(box, (chunk.offsets, chunk.sizes)) == (chunk.offsets, chunk.sizes) and chunk.nbytes:
                wanted[(index[id(entry)], n)] = (target, box, entry, chunk)
    everyone = group.all_gather_object(sorted(wanted))
    common = sorted(set.intersection(*(set(map(tuple, keys)) for keys in everyone)))
    order = sorted(range(len(common)), key=lambda i: (-wanted[common[i]][3].nbytes, common[i]))
    where, _ = balance([wanted[key][3].nbytes for key in common], group.size, order=order)
    readers = dict(zip(common, where))
    direct = {key for key in common if direct_read(*wanted[key])}
    failure: CheckpointError | None = None
    with ThreadPoolExecutor(fetcher.threads, thread_name_prefix="zerostall-read") as pool:
        for batch in _batches(common, lambda k: 0 if k in direct else wanted[k][3].nbytes, staging):
            failure = _broadcast_batch(fetcher, group, pool, batch, wanted, readers, direct, verify) or failure
    with group.failing_together(f"broadcast load from {fetcher.path} failed: {{failed}} rank(s) could not "
                                     "read their share (their errors name the file)"):
        if failure is not None:
            raise failure
    return {id(wanted[key][3]) for key in common}

def _broadcast_batch(fetcher: Fetcher, group: Group, pool: ThreadPoolExecutor, batch: list[ChunkId],
                     wanted: dict[ChunkId, Whole], readers: dict[ChunkId, int], direct: set[ChunkId],
                     verify: bool) -> CheckpointError | None:
    """Read this rank's chunks of ``batch``, broadcast every chunk of it from its reader (every
    rank runs the same broadcasts, even after a failed read) and copy staged bytes into their
    targets. Returns this rank's first read failure."""
    buffers = {key: wanted[key][0].data.reshape(-1).view(torch.uint8) if key in direct
               else host_empty(wanted[key][3].nbytes) for key in batch}
    reads = {key: pool.submit(fetcher.read_chunk, wanted[key][2], wanted[key][3], buffers[key], verify)
             for key in batch if readers[key] == group.rank}
    failure = None
    for key in batch:
        if key in reads:
            try:
                reads[key].result()
            except CheckpointError as exc:
                failure = failure or exc
        group.broadcast_tensor(buffers[key], src=readers[key])
    with torch.no_grad():
        for key in (k for k in batch if k not in direct):
            target, box, entry, chunk = wanted[key]
            src = buffers[key].view(entry.torch_dtype).reshape(chunk.sizes)
            target[region((chunk.offsets, chunk.sizes), box)].copy_(src)
    return failure


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
