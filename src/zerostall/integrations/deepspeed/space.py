"""The check that the file system of a DeepSpeed save's directory can hold it on every rank
(its bytes counted by :mod:`zerostall.saving.estimate`): a save that cannot fit is refused with
the numbers instead of failing part way with ENOSPC."""

from __future__ import annotations

import os

from ...collectives import Group
from ...errors import InsufficientSpaceError
from ...storage.base import free_bytes


def free_space(save_dir: str) -> int:
    """The bytes free in ``save_dir`` (made if missing) as this rank sees it."""
    os.makedirs(save_dir, exist_ok=True)
    return free_bytes(save_dir)


def check_space(group: Group, directory: str, needed: int, free: int) -> None:
    """Refuse on every rank, before anything is written, the save of checkpoint ``directory`` when
    every rank's ``needed`` bytes together exceed the ``free`` space any rank sees in its save directory."""
    total = group.all_reduce_ints([needed])[0]
    short = int(total > free)
    if group.all_reduce_ints([short])[0]:
        seen = f"its file system has {free} bytes free" if short else "another rank sees less free space"
        raise InsufficientSpaceError(
            f"checkpoint {directory} needs {total} bytes (every rank's tensors, swap files and what describes "
            f"them), but {seen}: free space there or save elsewhere; nothing was written")
