"""The re-save journal: a save that never commits leaves no attempt behind and loses no checkpoint it
was to replace.

Before a save of a tag that is not a step's, or of a committed checkpoint that it alone sets aside
(saved over), the coordinator records ``{tag: where the old one was set aside, or None}`` in
``.resaving`` at the root; once the save commits, the entry goes. A writer that takes over a root
(the one before it died) finds what is left: each tag that did not commit has its attempt removed
and the checkpoint set aside for it moved back, so a crash while saving over a checkpoint does not
send the next restore back to an earlier step. Step checkpoints set aside by a rollback (later
steps went with them) are not moved back: the run had forked.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from ..format.layout import SUPERSEDED_NAME
from ..storage import SMALL_FILE_BYTES, Storage
from .sharing import has_manifest
from .stale import remove_attempt

log = logging.getLogger(__name__)

RESAVING_NAME = ".resaving"


def _plain(name: object) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".") and name != ".."


def _read(root: Storage) -> dict[str, str | None] | None:
    """The journal's entries, None without one; a damaged one (no writer of ours wrote it so) holds
    none, with a warning."""
    try:
        data = root.read_bytes(RESAVING_NAME, SMALL_FILE_BYTES)
    except FileNotFoundError:
        return None
    try:
        entries = json.loads(data)
    except (ValueError, RecursionError):
        entries = None
    aside = f"{SUPERSEDED_NAME}/"
    if not isinstance(entries, dict) or not all(
            _plain(tag) and (where is None or isinstance(where, str) and where.startswith(aside)
                             and _plain(where[len(aside):])) for tag, where in entries.items()):
        log.warning("%s/%s is not a re-save journal zerostall wrote; it is ignored", root.location, RESAVING_NAME)
        return {}
    return entries


def record(root: Storage, tag: str, aside: str | None) -> None:
    """Before saving ``tag``: note it, and where its committed checkpoint is about to be set aside."""
    entries = _read(root) or {}
    entries[tag] = aside
    root.put(RESAVING_NAME, json.dumps(entries).encode())


def committed(root: Storage, tag: str) -> None:
    """``tag`` committed: nothing of its entry is to be undone."""
    entries = _read(root) or {}
    if entries.pop(tag, False) is False:
        return
    if entries:
        root.put(RESAVING_NAME, json.dumps(entries).encode())
    else:
        root.delete(RESAVING_NAME)


def undo(root: Storage, where: Callable[[str], str]) -> None:
    """For a writer taking the root over: remove the attempt of each tag noted that did not commit,
    and move back what was set aside for it."""
    entries = _read(root)
    if entries is None:
        return
    for tag, aside in entries.items():
        if has_manifest(root.child(tag)) or not remove_attempt(root, tag, where):
            continue  # it committed: the one set aside stays superseded
        if aside is not None and root.child(aside).exists():
            root.move(aside, tag)
            log.warning("the save over %s never committed: the checkpoint it was to replace is back in place",
                        where(tag))
    root.delete(RESAVING_NAME)  # a damaged journal too
