"""The bytes a DeepSpeed save will write, counted before any is written, and the check that the
file system of its directory can hold them on every rank: a save that cannot fit is refused
with the numbers instead of failing part way with ENOSPC."""

from __future__ import annotations

import os
from typing import Any

import torch

from ...collectives import Group
from ...errors import InsufficientSpaceError
from ...format import codec
from ...format.layout import dump_json
from ...storage.base import free_bytes
from . import values

_PER_RANK = 64 << 10  # each data file's last file-system block, the commit's record file
_HEADER = 64  # the fixed part of a tensor's key in its data file's header
_DESCRIBED = 192  # the fixed part of its manifest entry (and commit record)


def needed_bytes(state: dict[str, Any], offloaded: dict[str, dict[str, torch.Tensor]], block_size: int,
                 allow_pickle: bool, world_size: int) -> int:
    """What this rank's save of ``state`` (DeepSpeed's files, each :func:`values.split`) and its
    ``offloaded`` swap files will write: their tensors, with the headers, manifest entries and
    block checksums that describe them (twice with other ranks: in this rank's commit record too),
    and their python values as encoded."""
    copies = 1 if world_size == 1 else 2
    total = _PER_RANK
    for name, split in state.items():
        for key, tensor in split[values.TENSORS].items():
            total += _tensor_bytes(len(name) + len(key), tensor, block_size, copies)
        total += len(dump_json(codec.encode(split[values.VALUE], where=name, allow_pickle=allow_pickle)))
    for kind, files in offloaded.items():
        for key, tensor in files.items():
            total += _tensor_bytes(len(kind) + len(key), tensor, block_size, copies)
    return total


def _tensor_bytes(name_length: int, tensor: torch.Tensor, block_size: int, copies: int) -> int:
    """A tensor's data, and what describes it: its key in the data file's header, and in the
    manifest (and its rank's commit record: ``copies``) its path, shape and a checksum per block."""
    blocks = -(-tensor.nbytes // block_size)
    described = _DESCRIBED + 4 * name_length + 24 * (tensor.dim() + blocks)
    return tensor.nbytes + _HEADER + name_length + copies * described


def check_space(group: Group, directory: str, save_dir: str, needed: int) -> None:
    """Refuse on every rank, before anything is written, the save of checkpoint ``directory`` in
    ``save_dir`` when every rank's ``needed`` bytes together exceed the free space any rank sees there."""
    total = group.all_reduce_ints([needed])[0]
    os.makedirs(save_dir, exist_ok=True)
    free = free_bytes(save_dir)
    short = int(total > free)
    if group.all_reduce_ints([short])[0]:
        raise InsufficientSpaceError(
            f"checkpoint {directory} needs {total} bytes (every rank's tensors, swap files and what describes "
            f"them), but {'its file system has ' + str(free) + ' bytes free' if short else 'another rank sees less free space'}"
            ": free space there or save elsewhere; nothing was written")
