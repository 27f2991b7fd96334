"""What dead writers left under a root, removed by the next lease holder: checkpoints that never
committed, a removal a crash interrupted, and unfinished uploads (an object store's, which no
listing shows). Only the root's own: another program's files and uploads beside it stay."""

from __future__ import annotations

import logging
import secrets
from typing import Callable

from ..format.layout import SUPERSEDED_NAME, file_generation
from ..format.retained import RETAINED_NAME
from ..storage import Storage
from .sharing import has_manifest

log = logging.getLogger(__name__)

TRASH_PREFIX = ".deleting-"
"""Uncommitted attempts being removed are moved aside under names starting so."""


def remove_attempts(storage: Storage, where: Callable[[str], str]) -> None:
    """Remove the ``step_*`` checkpoints of ``storage`` (a root) that never committed, and what an
    interrupted removal left. Each attempt is first moved aside (``.deleting-*``), so a writer that
    outlived its lease can never commit a manifest into a checkpoint whose data files are being
    deleted: locally the move is one rename, so its commit then fails, or came first and the attempt
    is put back. ``where(name)``: the location of ``name``, for messages."""
    if storage.abort_uploads(which=_owned):
        log.info("aborted the unfinished uploads a dead writer left under %s", storage.location)
    for name in storage.children():
        if name.startswith(TRASH_PREFIX):
            storage.delete_tree(name)  # a removal that a crash interrupted
        elif name.startswith("step_") and not has_manifest(child := storage.child(name)):
            names = child.list()
            if any(file_generation(n) for n in names) or not (names or child.children()):
                if RETAINED_NAME not in names:
                    remove_attempt(storage, name, where)
            else:  # no checkpoint's files: someone's own, named like one
                log.warning("%s holds no checkpoint's files but others, left as they are: move them out of the root",
                            where(name))


def _owned(path: str) -> bool:
    """Whether an upload to ``path`` (under a root) is the root's: a checkpoint's data file (right
    under the root's folder of that checkpoint), or anything in the folders it alone writes
    (checkpoints set aside or being removed)."""
    folder, _, name = path.rpartition("/")
    return bool(folder) and ((file_generation(name) is not None and "/" not in folder)
                             or folder.startswith((TRASH_PREFIX, SUPERSEDED_NAME)))


def remove_attempt(storage: Storage, name: str, where: Callable[[str], str]) -> bool:
    """Remove the uncommitted checkpoint ``name`` (see :func:`remove_attempts`); False if it committed meanwhile."""
    trash = f"{TRASH_PREFIX}{name}.{secrets.token_hex(4)}"
    try:
        storage.move(name, trash)
    except FileNotFoundError:
        return True
    if has_manifest(storage.child(trash)):
        log.warning("%s committed while it was being cleaned up: a writer outlived its lease", where(name))
        storage.move(trash, name)
        return False
    log.info("removing the uncommitted checkpoint %s left by a dead writer", where(name))
    storage.delete_tree(trash)
    return True
