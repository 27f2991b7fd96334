"""Which checkpoint a DeepSpeed tag names in a save directory: ``latest`` as DeepSpeed writes it
(a plain tag), committed zerostall checkpoints, and checkpoints of DeepSpeed's own engine (its
files, no zerostall manifest). Each function runs on one rank (rank 0 decides for the others)."""

from __future__ import annotations

import glob
import logging
import os

from ...errors import CheckpointNotFoundError
from ...format.layout import MANIFEST_NAME
from ...roots.root import LATEST_NAME, CheckpointRoot, validate_tag
from ...storage import storage_for

log = logging.getLogger(__name__)


def resolve(load_dir: str, tag: str | None) -> str:
    """On rank 0: the tag to open (empty when there is none)."""
    root = CheckpointRoot(storage_for(load_dir))
    committed = [info.name for info in root.checkpoints()] if os.path.isdir(load_dir) else []
    if tag is not None and tag != LATEST_NAME:
        validate_tag(tag)
        if tag not in committed:
            raise CheckpointNotFoundError(f"no committed zerostall checkpoint {tag!r} in {load_dir}"
                                          + (f" (there: {', '.join(committed[-5:])})" if committed else ""))
        return tag
    named = root.read_latest() if committed else None
    if named in committed:
        return named
    if committed:
        newest = root.latest() or ""
        log.warning("%s/latest %s; opening the newest committed checkpoint, %s", load_dir,
                    f"names {named!r}, which is not a committed checkpoint" if named else "is missing", newest)
        return newest
    return ""


def deepspeeds_own(load_dir: str, tag: str | None) -> str:
    """On rank 0: :meth:`ZeroStallCheckpointEngine.deepspeeds_own` (empty for None)."""
    if tag is None or tag == LATEST_NAME:
        tag = CheckpointRoot(storage_for(load_dir)).read_latest()  # as DeepSpeed writes it: a plain tag
        if tag is None:
            return ""
    validate_tag(tag)
    directory = os.path.join(load_dir, tag)
    if os.path.exists(os.path.join(directory, MANIFEST_NAME)):
        return ""
    return tag if glob.glob(os.path.join(glob.escape(directory), "*_model_states.pt")) else ""
