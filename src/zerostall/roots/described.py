"""What a listing says of one checkpoint under a root: committed, incomplete, corrupt (damaged)
or unreadable (its manifest could not be read: an I/O error, not known to be damaged), with what
its manifest tells of a committed one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ..format import codec
from ..format.layout import ManifestHead, file_generation
from ..loading.opening import read_manifest_head
from ..storage import Storage
from ..storage.references import read_retained
from .retention import CheckpointRecord, numeric_metrics

DAMAGE = (CorruptCheckpointError, IncompleteCheckpointError)
"""What a checkpoint's own bytes or files cause (not an I/O error): a reason to pass it over."""

COMMITTED = "committed"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
UNREADABLE = "unreadable"  # not known to be damaged: its manifest could not be read (an I/O error)
RETAINED = "retained"  # deleted, but some of its data files are still referred to (see roots.sharing)


@dataclass
class CheckpointInfo:
    """One checkpoint as a listing shows it. ``status``: committed (its manifest reads and checks),
    incomplete (data files but no manifest: its save never committed), corrupt or unreadable
    (``error`` says why). Step, created and metrics come from a committed one's manifest; ``bytes``: its data."""

    name: str
    location: str
    status: str
    step: int | None = None
    bytes: int = 0
    created: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    """A committed one's own data files and sizes (a retained one's: those kept)."""
    refs: dict[str, str] = field(default_factory=dict)
    """The data files of other checkpoints of the root it refers to, with their tags (incremental saves)."""
    referenced_bytes: int = 0
    """The size of those files, as its manifest records them."""

    def record(self) -> CheckpointRecord:
        """What retention knows of it (a step-less checkpoint counts as step -1)."""
        return CheckpointRecord(-1 if self.step is None else self.step, self.created or 0.0,
                                numeric_metrics(self.metrics))


def describe(storage: Storage, name: str) -> CheckpointInfo:
    """Read the checkpoint at ``storage`` (called ``name``) and classify it (see the module's docstring)."""
    try:
        head = read_manifest_head(storage)
    except IncompleteCheckpointError:
        try:
            kept = read_retained(storage)
        except CheckpointError as exc:
            return CheckpointInfo(name, storage.location, _failed(exc), error=str(exc))
        if kept is not None:
            return CheckpointInfo(name, storage.location, RETAINED, bytes=sum(kept[0].values()), files=kept[0])
        info = CheckpointInfo(name, storage.location, INCOMPLETE)
    except CheckpointError as exc:
        info = CheckpointInfo(name, storage.location, _failed(exc), error=str(exc))
    else:
        return committed_info(name, storage, head)
    info.bytes = sum(_size(storage, n) for n in storage.list() if file_generation(n))
    return info


def _failed(exc: CheckpointError) -> str:
    return CORRUPT if isinstance(exc, DAMAGE) else UNREADABLE


def _size(storage: Storage, name: str) -> int:
    """The size of file ``name``; 0 if it vanished meanwhile or is not a regular file."""
    try:
        return storage.size(name)
    except OSError:
        return 0


def committed_info(name: str, storage: Storage, head: ManifestHead) -> CheckpointInfo:
    """The committed checkpoint ``name`` at ``storage``, as its manifest's ``head`` describes it."""
    metadata = head.metadata if isinstance(head.metadata, dict) else {}
    try:  # as saved: non-finite floats and numbers of earlier versions are encoded
        metrics = codec.decode(metadata.get("metrics"), where=f"{name} metrics")
    except CheckpointError:
        metrics = None
    return CheckpointInfo(name, storage.location, COMMITTED, head.step, head.total_bytes, head.created,
                          dict(metrics) if isinstance(metrics, dict) else {},
                          files={n: s for n, s in head.files.items() if n not in head.refs}, refs=head.refs,
                          referenced_bytes=sum(head.files[n] for n in head.refs))
