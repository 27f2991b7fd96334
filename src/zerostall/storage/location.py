"""A checkpoint's location: what may be written there, the one atomic step that commits it, and
the clean-up after it.

Saves and copies share all three: a location holding files that are not a checkpoint's is refused,
a committed checkpoint is replaced only when asked, the manifest is published last, refused at the
last moment when another writer committed there meanwhile, and the files no manifest references
any more are removed after. No torch: ``zerostall cp`` runs it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Callable, Iterable

from ..errors import CheckpointError, CheckpointExistsError
from ..format.layout import MANIFEST_NAME, file_generation, manifest_tmp_name, parse_record
from .base import Storage

log = logging.getLogger(__name__)

_GENERATION_RE = re.compile(rb'"generation":"([0-9a-f]+-[0-9a-f]+)"')


def check_location(storage: Storage, overwrite: bool, *, what: str = "save",
                   names: Iterable[str] | None = None) -> None:
    """Refuse a location holding files that are not a checkpoint's (a checkpoint root, a model
    directory), and one holding a committed checkpoint unless ``overwrite``. ``what`` ("save",
    "copy") names the operation in the errors; ``names``: the location's files, where the caller
    listed them already."""
    names = storage.list() if names is None else list(names)
    if MANIFEST_NAME in names and not overwrite:
        raise CheckpointExistsError(f"{storage.location} already holds a committed checkpoint; nothing was written: "
                                    f"{what} with overwrite=True (--overwrite) to replace it (it stays readable until "
                                    f"the new one commits), or {what} into a new location")
    foreign = [n for n in names if n != MANIFEST_NAME and file_generation(n) is None]
    if foreign:
        raise CheckpointError(f"{storage.location} holds files that are not part of a zerostall checkpoint "
                              f"({few(foreign)}); nothing was written: {what} into a new or empty location, or into an "
                              "existing checkpoint to replace it")


def within(inner: str, outer: str) -> bool:
    """Whether location ``inner`` is ``outer`` or lies inside it (paths resolved through links; URLs by prefix)."""
    if "://" not in inner and "://" not in outer:
        inner, outer = os.path.realpath(inner), os.path.realpath(outer)
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


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
    """The generation named by the manifest in place, read from its first bytes only; None when
    there is none. A read that fails raises (an OSError): what is in place is then unknown, and a
    caller that took it for "none" could delete a committed checkpoint's files."""
    try:
        head = storage.read_head(MANIFEST_NAME, 256)
    except (FileNotFoundError, NotADirectoryError):  # no manifest, or no directory to hold one
        return None
    match = _GENERATION_RE.search(head)
    return match.group(1).decode() if match else None


def remove_stale(storage: Storage, keep: str, stale: Callable[[str], bool]) -> None:
    """After the commit of generation ``keep``: remove the files of the other generations ``stale``
    accepts (no manifest references them any more) and ``keep``'s commit records, and abort the
    uploads still open under those names or ``keep``'s (its files were all complete at its commit:
    one still open is a crashed earlier attempt's). Best effort, file by file: a file that cannot be
    removed is logged and the others still go; the commit stands either way."""
    def gone(name: str) -> bool:
        gen = file_generation(name)
        return gen is not None and (parse_record(name) is not None if gen == keep else stale(gen))

    def unfinished(name: str) -> bool:  # the location's own files, not those of a location inside it
        gen = None if "/" in name else file_generation(name)
        return gen is not None and (gen == keep or stale(gen))

    try:
        names = storage.list()
    except OSError as exc:
        log.warning("could not list %s to remove the files no manifest references: %s", storage.location, exc)
        names = []
    for name in filter(gone, names):
        try:
            storage.delete(name)
        except OSError as exc:
            log.warning("could not remove stale %s in %s: %s", name, storage.location, exc)
    try:
        if storage.abort_uploads(which=unfinished):
            log.info("aborted the unfinished uploads of earlier saves or copies in %s", storage.location)
    except OSError as exc:
        log.warning("could not abort the unfinished uploads of earlier saves or copies in %s: %s",
                    storage.location, exc)
