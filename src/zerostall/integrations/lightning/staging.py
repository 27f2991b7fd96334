"""Where a Lightning save is written before it is moved into place, the move, and the sweep of
what saves killed half-way left.

A save of a path that holds no committed checkpoint yet (a first save; Lightning's own file or
link) is written beside it in a hidden folder (``.zerostall-staging-`` and a hash of the name, which
Lightning's lookups of ``last`` and ``hpc_ckpt_`` never match) and moved over the path once
committed, so a save killed half-way leaves nothing there that a resume would take.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shutil

from ...errors import CheckpointError
from ...format.layout import MANIFEST_NAME
from ...storage import storage_for
from ...storage.local import fsync_dir
from ...storage.location import check_location

log = logging.getLogger(__name__)

STAGING = ".zerostall-staging-"
"""The name's beginning of the hidden folder a save is written to before it is moved into place."""


def sweep(folder: str) -> None:
    """Delete the staging folders, and the empty stand-ins of asynchronous saves, that saves killed
    before their commit left in ``folder`` (top-k names are not saved again, so nothing else would);
    a staging folder that committed but was never moved into place (killed in between) is kept, and
    named in the log."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):  # not made yet: nothing left there
        return
    for name in names:
        left = os.path.join(folder, name)
        if os.path.islink(left) or not os.path.isdir(left):
            continue
        if name.endswith(".ckpt") and _removed(left):  # only an empty folder is removed
            log.info("removed %s, the empty stand-in of an asynchronous save that never committed", left)
        if not name.startswith(STAGING):
            continue
        if os.path.isfile(os.path.join(left, MANIFEST_NAME)):
            log.warning("%s holds a committed checkpoint that was never moved into place (the run stopped "
                        "between its commit and the move): load it from there, or delete it", left)
            continue
        shutil.rmtree(left, ignore_errors=True)
        log.info("removed %s, left by a save that never committed", left)


def staging_path(path: str, lightnings_dcp: bool = False) -> str | None:
    """Where a save of ``path`` is written before it is moved there: a hidden folder beside it
    (a name Lightning's lookups of ``last`` and ``hpc_ckpt_`` never match) while no committed
    checkpoint is at ``path``, or a link is (``save_last="link"``: the link is replaced, never written
    through into the checkpoint it names); None (written in place, swapped atomically at its
    commit) otherwise. A folder at ``path`` holding other files than a save's is refused (unless
    ``lightnings_dcp`` and it is the sharded checkpoint of Lightning's ``ModelParallelStrategy``)."""
    if is_url(path):
        return None
    if not os.path.islink(path):
        if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            return None
        _not_foreign(path, lightnings_dcp=lightnings_dcp)
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f"{STAGING}{hashlib.sha256(name.encode()).hexdigest()[:16]}")


def place(staged: str, path: str, fsync: bool, lightnings_dcp: bool = False) -> None:
    """Move the committed checkpoint ``staged`` to ``path``: over Lightning's own file or link
    there in one atomic exchange where the file system can (else removed first), over a folder
    whose save never committed (or, ``lightnings_dcp``, Lightning's sharded checkpoint), or into
    the free name."""
    if os.path.islink(path) or os.path.isfile(path):
        if _exchange(staged, path):
            os.remove(staged)  # what was at path
        else:
            os.remove(path)
            os.rename(staged, path)
    else:
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            _not_foreign(path, staged, lightnings_dcp)
            shutil.rmtree(path)  # a save that never committed (killed half-way), or Lightning's DCP folder
        os.rename(staged, path)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def _not_foreign(path: str, staged: str | None = None, lightnings_dcp: bool = False) -> None:
    """Refuse a folder at ``path`` that holds anything but the files of a save that never committed
    (the user's own folder; Lightning's sharded checkpoint, unless ``lightnings_dcp``): it would be
    deleted to make room. ``staged``: where this save's committed checkpoint waits meanwhile."""
    if not os.path.isdir(path) or (lightnings_dcp and _is_lightnings_dcp(path)):
        return
    try:
        check_location(storage_for(path), True, what="save")
    except CheckpointError as exc:
        kept = f"; this save's checkpoint is kept in {staged}" if staged else ""
        raise CheckpointError(f"{path} is a folder that is not a zerostall checkpoint, which a save there would "
                              f"delete ({exc}){kept}: save under another name") from None


def _is_lightnings_dcp(path: str) -> bool:
    """Whether folder ``path`` is a sharded checkpoint of Lightning's ``ModelParallelStrategy``
    (DCP's ``.metadata`` and ``*.distcp`` shards, Lightning's ``meta.pt``), and nothing else."""
    names = os.listdir(path)
    return ".metadata" in names and all(n in (".metadata", "meta.pt") or n.endswith(".distcp") for n in names)


def _exchange(a: str, b: str) -> bool:
    """Swap the entries ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or file system has no such call."""
    call = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if call is None:
        return False
    at_cwd, exchange = -100, 2
    if call(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def _removed(empty: str) -> bool:
    """Remove the folder ``empty`` if it is empty; False when it is not, or cannot be."""
    try:
        os.rmdir(empty)
    except OSError:  # not empty, gone already, or not ours to remove
        return False
    return True


def is_url(path: str) -> bool:
    return "://" in path
