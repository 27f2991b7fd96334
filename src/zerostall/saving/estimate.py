"""The bytes a save writes, counted before any is written: what a free-space check compares with
the free space, so that a save that cannot fit is refused with the numbers instead of failing
part way with ENOSPC."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..format import codec
from ..format.layout import dump_json
from ..state import fqn

_PER_RANK = 64 << 10  # each data file's last file-system block, the commit's record file
_HEADER = 64  # the fixed part of a tensor's key in its data file's header
_DESCRIBED = 192  # the fixed part of an entry in the manifest (and in its rank's commit record)


def bytes_needed(leaves: Mapping[tuple[Any, ...], Any], block_size: int, allow_pickle: bool,
                 world_size: int) -> int:
    """What one rank's save of ``leaves`` (a flattened state's, by key path) writes: each tensor's
    bytes with its key in a data file's header, and every entry's description (key path, shape, a
    checksum per block; twice with other ranks: in the rank's commit record too), python values as
    encoded."""
    copies = 1 if world_size == 1 else 2
    total = _PER_RANK
    for path, leaf in leaves.items():
        name = len(fqn(path))
        if isinstance(leaf, torch.Tensor):
            blocks = -(-leaf.nbytes // block_size)
            total += leaf.nbytes + _HEADER + name + copies * (_DESCRIBED + 4 * name + 24 * (leaf.dim() + blocks))
        else:
            value = codec.encode(leaf, where=fqn(path), allow_pickle=allow_pickle)
            total += copies * (_DESCRIBED + 4 * name) + len(dump_json(value))
    return total
