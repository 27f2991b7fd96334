"""A checkpoint's location: what may be written there, and the one atomic step that commits it.

Saves and copies share both: a location holding files that are not a checkpoint's is refused, a
committed checkpoint is replaced only when asked, and the manifest is published last, refused at
the last moment when another writer committed there meanwhile. No torch: ``zerostall cp`` runs it.
"""

from __future__ import annotations

import re
from typing import Callable

from ..errors import CheckpointError, CheckpointExistsError
from ..format.layout import MANIFEST_NAME, file_generation, manifest_tmp_name
from .base import Storage

_GENERATION_RE = re.compile(rb'"generation":"([0-9a-f]+-[0-9a-f]+)"')


def check_location(storage: Storage, overwrite: bool, *, what: str = "save") -> None:
    """Refuse a location holding files that are not a checkpoint's (a checkpoint root, a model
    directory), and one holding a committed checkpoint unless ``overwrite``. ``what`` ("save",
    "copy") names the operation in the errors."""
    names = storage.list()
    if MANIFEST_NAME in names and not overwrite:
        raise CheckpointExistsError(f"{storage.location} already holds a committed checkpoint; nothing was written: "
                                    f"{what} with overwrite=True (--overwrite) to replace it (it stays readable until "
                                    f"the new one commits), or {what} into a new location")
    foreign = [n for n in names if n != MANIFEST_NAME and file_generation(n) is None]
    if foreign:
        raise CheckpointError(f"{storage.location} holds files that are not part of a zerostall checkpoint "
                              f"({few(foreign)}); nothing was written: {what} into a new or empty location, or into an "
                              "existing checkpoint to replace it")


def few(names: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``names`` and how many more, for an error message."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f", … ({more} more)" if more > 0 else "")


def publish_manifest(storage: Storage, generation: str, manifest: bytes, previous: str | None, *, what: str = "save",
                     before_commit: Callable[[], None] | None = None) -> None:
    """Publish ``manifest`` (of ``generation``): the single atomic step that makes the checkpoint
    exist. Refused at the last moment if the manifest in place is no longer ``previous`` (the
    generation found when the writing began): another writer committed into the path meanwhile, its
    clean-up may have removed this one's data files, and its checkpoint stays; or if
    ``before_commit`` (an outside fence, such as a writer lease) raises."""
    def last_checks() -> None:
        current = manifest_generation(storage)
        if current != previous:
            raise CheckpointError(f"the {what} {generation} into {storage.location} was not committed: another "
                                  f"checkpoint ({current}) was committed there while it was in flight (two writers "
                                  "on one path?); that checkpoint is kept")
        if before_commit is not None:
            before_commit()

    try:
        storage.publish(MANIFEST_NAME, manifest_tmp_name(generation), manifest, before_replace=last_checks)
    except OSError as exc:
        raise CheckpointError(f"committing the manifest in {storage.location} failed: {exc}") from exc


def manifest_generation(storage: Storage) -> str | None:
    """The generation named by the manifest in place, read from its first bytes only."""
    try:
        head = storage.read_head(MANIFEST_NAME, 256)
    except OSError:
        return None
    match = _GENERATION_RE.search(head)
    return match.group(1).decode() if match else None
