"""The re-save journal: a save over a checkpoint replaces it once committed, and a save that never
commits leaves no attempt behind and loses no checkpoint it was to replace.

Before a save of a tag that is not a step's, or of a committed checkpoint that it alone sets aside
(saved over), the coordinator records ``{tag: where the old one was set aside, or None}`` in
``.resaving`` at the root. After the save commits, the checkpoint it replaced is deleted and the
entry goes. A writer that takes over a root (the one before it died) finds what is left: each tag
that did not commit has its attempt removed and the checkpoint set aside for it moved back, so a
crash while saving over a checkpoint does not send the next restore back to an earlier step.
Checkpoints set aside by a rollback (later steps went with them) stay set aside: the run had forked.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from ..format.layout import SUPERSEDED_NAME
from ..storage import SMALL_FILE_BYTES, Storage
from .sharing import delete_checkpoint, has_manifest, refs_set_aside
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


def settle(root: Storage, *, takeover: bool) -> None:
    """Each noted save that committed: the checkpoint it replaced is deleted (kept, as any set aside,
    where another set aside refers to its files: both may be moved back), and the note goes. With
    ``takeover`` (no save in flight: a writer taking the root over, the one before dead, or a
    manager about to save), each that did not commit (it died, or failed) has its attempt removed
    and what it set aside moved back; otherwise it may be in flight, and stays."""
    entries = _read(root)
    if entries is None:
        return
    if not entries:  # a damaged journal (an empty one is deleted, never written): nothing it says can be undone
        if takeover:
            root.delete(RESAVING_NAME)
        return

    def where(name: str) -> str:
        return root.child(name).location

    left = {}
    for tag, aside in entries.items():
        if has_manifest(root.child(tag)):
            if aside is not None:
                _drop_replaced(root, tag, aside.partition("/")[2], where)
        elif not takeover:
            left[tag] = aside
        elif remove_attempt(root, tag, where) and aside is not None and root.child(aside).exists():
            root.move(aside, tag)
            log.warning("the save over %s never committed: the checkpoint it was to replace is back in place",
                        where(tag))
    if left == entries:
        return
    if left:
        root.put(RESAVING_NAME, json.dumps(left).encode())
    else:
        root.delete(RESAVING_NAME)


def _drop_replaced(root: Storage, tag: str, name: str, where: Callable[[str], str]) -> None:
    """Delete ``.superseded/name``, which the committed ``tag`` replaced, unless a checkpoint set
    aside refers to the files of ``tag`` (the replaced one's)."""
    aside = root.child(SUPERSEDED_NAME)
    if not aside.child(name).exists():
        return
    if any(tag in refs.values() for refs in refs_set_aside(aside, but=name)):
        log.info("%s/%s stays: checkpoints set aside refer to its files", where(SUPERSEDED_NAME), name)
        return
    delete_checkpoint(aside, name, set())
