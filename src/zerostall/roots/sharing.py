"""Deleting checkpoints that share data files: an incremental checkpoint refers to files of the
earlier checkpoints of its root that wrote the bytes. Deleting such a checkpoint removes what no
other checkpoint refers to, and keeps the rest behind a retained record (``retained.json``) in
place of its manifest, so that the files stay a checkpoint's own (readers check that) while the
checkpoint is gone from listings. Each step is safe to interrupt: the record is written before the
manifest goes, and a record is shrunk before the files it stops listing are deleted.
"""

from __future__ import annotations

import logging
import secrets
from typing import Callable, Iterable

from ..errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                      UnsafeFileError)
from ..format.layout import MANIFEST_NAME, SUPERSEDED_NAME, file_generation
from ..format.retained import RETAINED_NAME, retained_bytes
from ..loading.opening import read_manifest_head
from ..storage import Storage
from ..storage.references import read_retained

log = logging.getLogger(__name__)


def referenced(refs_of: Iterable[dict[str, str]]) -> dict[str, set[str]]:
    """The files each checkpoint (by tag) must keep: those that the ``refs`` given refer to."""
    kept: dict[str, set[str]] = {}
    for refs in refs_of:
        for name, tag in refs.items():
            kept.setdefault(tag, set()).add(name)
    return kept


def retire(checkpoint: Storage, files: dict[str, int], headers: dict[str, str], keep: set[str]) -> None:
    """Delete the committed checkpoint at ``checkpoint`` (owning ``files``) except the files of
    ``keep``: first the retained record listing them, then the manifest, then every other file."""
    kept = {n: files[n] for n in sorted(keep) if n in files}
    checkpoint.put(RETAINED_NAME, retained_bytes(kept, {n: headers[n] for n in kept if n in headers}))
    checkpoint.delete(MANIFEST_NAME)
    _delete_all_but(checkpoint, set(kept) | {RETAINED_NAME})


def shrink(checkpoint: Storage, keep: set[str]) -> bool:
    """The retained data at ``checkpoint``, cut down to the files of ``keep``: the record first,
    then the files it no longer lists. True when nothing is kept (the caller removes the rest)."""
    listed = read_retained(checkpoint)
    if listed is None:
        return not keep
    files, headers = listed
    still = {n: s for n, s in files.items() if n in keep}
    if not still:
        checkpoint.delete(RETAINED_NAME)  # its data files are then an uncommitted attempt's: removable
        return True
    if len(still) < len(files):
        checkpoint.put(RETAINED_NAME, retained_bytes(still, {n: headers[n] for n in still if n in headers}))
    _delete_all_but(checkpoint, set(still) | {RETAINED_NAME})
    return False


def _delete_all_but(checkpoint: Storage, keep: set[str]) -> None:
    for name in checkpoint.list():
        if name not in keep and (file_generation(name) or name.endswith(".tmp") or name == MANIFEST_NAME):
            checkpoint.delete(name)


def has_manifest(storage: Storage) -> bool:
    """Whether a manifest is in place at ``storage`` (something other than a file there counts: not
    for a clean-up to judge)."""
    try:
        storage.size(MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except UnsafeFileError:
        pass
    return True


def refs_set_aside(aside: Storage, but: str | None = None) -> list[dict[str, str]]:
    """The references of the checkpoints set aside under ``aside`` (``.superseded/``) other than
    ``but``: those with no manifest (retained data, an empty folder) or a damaged one refer to
    nothing; one that cannot be read now raises, for what it refers to is unknown."""
    refs = []
    for name in aside.children():
        if name == but:
            continue
        try:
            refs.append(read_manifest_head(aside.child(name)).refs)
        except (CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError):
            continue
    return refs


def delete_checkpoint(root: Storage, tag: str, keep: set[str]) -> bool:
    """Delete checkpoint ``tag`` of ``root`` but its files of ``keep`` (referred to by others): the
    manifest goes first, or a retained record takes its place. True when nothing of it is left."""
    checkpoint = root.child(tag)
    if keep:
        try:
            head = read_manifest_head(checkpoint)
        except IncompleteCheckpointError:  # retained already
            return shrink(checkpoint, keep) and _delete_tree(root, tag)
        retire(checkpoint, head.files, head.headers, keep)
        return False
    checkpoint.delete(MANIFEST_NAME)  # a retained record left behind lists files nobody refers to: collectable
    return _delete_tree(root, tag)


def collect_retained(root: Storage, references: Callable[[], dict[str, set[str]]]) -> None:
    """Remove the retained data under ``root`` that no checkpoint refers to any more."""
    known: dict[str, set[str]] | None = None
    for name in root.children():
        checkpoint = root.child(name)
        if name.startswith(".") or has_manifest(checkpoint) or RETAINED_NAME not in checkpoint.list():
            continue
        known = references() if known is None else known
        if shrink(checkpoint, known.get(name, set())):
            _delete_tree(root, name)


def _delete_tree(root: Storage, tag: str) -> bool:
    root.delete_tree(tag)
    return not root.child(tag).exists()


def set_aside(root: Storage, tags: list[str], step: int, target: str, refs: dict[str, dict[str, str]],
              before: Callable[[dict[str, str]], None]) -> None:
    """Move checkpoints ``tags`` of ``root`` into ``.superseded/``, never over one set aside
    before, to save ``step`` as ``target``; nothing is lost (each may be moved back). Retained data
    under ``target`` goes with them (only they may refer to it). If a committed checkpoint that
    stays (``refs``: each one's references) refers to any of them, nothing is moved: it would stop loading.
    ``before`` is given where each will go (tag: its name in ``.superseded/``) before anything moves."""
    if target not in tags and RETAINED_NAME in root.child(target).list():
        tags = [*tags, target]
    broken = sorted({(name, tag) for name, of in refs.items() if name not in tags
                     for tag in of.values() if tag in tags})
    if broken:
        raise CheckpointError(
            f"cannot save step {step} as {target} under {root.location}: "
            f"{'; '.join(f'{name} refers to data files of {tag}' for name, tag in broken)}, which saving it would set "
            "aside (the referring checkpoint would stop loading). Delete or move the referring checkpoint first, or "
            "save under another tag; nothing was moved")
    aside = root.child(SUPERSEDED_NAME)
    if tags:
        aside.create()
    going: dict[str, str] = {}
    for tag in tags:
        name = tag
        while aside.child(name).exists():
            name = f"{tag}.{secrets.token_hex(4)}"
        going[tag] = name
    before(going)
    for tag, name in going.items():
        try:
            root.move(tag, f"{SUPERSEDED_NAME}/{name}")
        except FileNotFoundError:
            continue
        if tag == target:  # replaced once the save commits (see roots.resaving) unless others went too
            log.info("%s is being saved again: the one before moved to %s", tag, aside.child(name).location)
        else:
            log.warning("step %d is being saved under %s, which holds later steps: %s moved to %s (move it back, "
                        "with what it refers to, to resume from it)", step, root.location, tag,
                        aside.child(name).location)
