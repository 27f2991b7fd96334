"""The node-local tier: its options, and one run's copies in a node's directory.

A node's directory holds, per run, one folder a step, and in it one ordinary one-rank checkpoint
per rank whose state the node keeps (its own ranks', and the replicas it received)::

    <directory>/<run id>/step_000000010/rank_00003/manifest.json, data files

A copy exists once its manifest does (the save's atomic commit). A run's folder holds a marker
file, ``.zerostall-run``, which the node's first rank keeps locked (``flock``) while the run
lives, and ``.zerostall-timeline``, the timeline its copies belong to (a node that missed a job
holds an abandoned one). At start-up, what a crashed trainer or a finished run left is removed: other runs' folders
(those with a marker no live process holds; nothing else in the directory is touched), copies
whose save never committed, replicas still arriving.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InsufficientSpaceError, InvalidPathError
from ..format.layout import MANIFEST_NAME
from ..storage.base import free_bytes
from ..storage.location import within
from .timelines import Timeline, valid

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{9,})$")
_COPY_RE = re.compile(r"^rank_(\d{5,})$")
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

MARKER = ".zerostall-run"
"""The file that makes a folder of the node directory a run's (see the module's docstring)."""
TIMELINE = ".zerostall-timeline"
"""The timeline the node's copies belong to (see :meth:`NodeDirectory.timeline`)."""

DROPPED = ".dropped-"
"""The prefix of a copy set aside to be deleted (see :meth:`NodeDirectory.set_aside`)."""

INCOMING = ".incoming-"
"""The prefix of a copy's folder while it arrives from another node, beside the folder it is
published as (removed at start-up when a crash leaves one)."""
_REPLACED_RE = re.compile(rf"^{re.escape(INCOMING)}(rank_\d{{5,}})-[0-9a-f]+-replaced$")


@dataclass(frozen=True)
class LocalTier:
    """Frequent checkpoints into a node-local directory, replicated to other nodes
    (``CheckpointManager(root, local=LocalTier(...))``); checked when built."""

    directory: str
    """A directory on this node (a RAM disk such as ``/dev/shm/zs``, or local NVMe), the same path on
    every node, outside the checkpoint root; it outlives the trainer, so a restarted job restores from it."""

    every: int = 10
    """Save to this tier every ``every`` steps (``should_save`` is True at these steps too)."""

    keep: int = 1
    """Newest complete steps this tier keeps, besides the one being written and the one being replicated."""

    replicas: int = 2
    """Copies of each rank's state, its own included: ``replicas - 1`` go to other nodes (as many as
    there are other nodes)."""

    run_id: str | None = None
    """Keeps runs apart in a shared directory (two jobs running at once need two); None: derived
    from the persistent root, so it stays the same when the job is requeued. At start, the folders
    of other runs that no live process holds are removed (nothing else in the directory is touched)."""

    timeout_s: float = 300.0
    """The longest any transfer between nodes may wait (replication and restore): a peer that died
    makes them fail after this, never hang."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
            raise ValueError(f"LocalTier.directory must be a path, not {self.directory!r}")
        object.__setattr__(self, "directory", os.fspath(self.directory))
        for name in ("every", "keep", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LocalTier.{name} must be an int >= 1, not {value!r}")
        if self.run_id is not None and not (isinstance(self.run_id, str) and _RUN_RE.match(self.run_id)):
            raise ValueError(f"LocalTier.run_id must be None or a plain name (letters, digits, '.', '_', '-'), "
                             f"not {self.run_id!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"LocalTier.timeout_s must be a number > 0, not {self.timeout_s!r}")


def check_outside(tier: LocalTier, root: str) -> None:
    """Refuse a tier directory inside the persistent root (a local path): the root holds only
    checkpoints, so the next manager on it would refuse to start."""
    if "://" not in root and within(tier.directory, root):
        raise InvalidPathError(f"LocalTier.directory {tier.directory} lies inside the checkpoint root {root}, which "
                               "holds only checkpoints (a restarted manager would refuse it): give the local tier a "
                               "directory of its own, such as /dev/shm/zs or one on local NVMe")


def run_id_for(persistent: str) -> str:
    """The run id of the run whose persistent root is ``persistent`` (a URL, or a path: resolved,
    so every spelling of one directory, through symbolic links too, gives the same id)."""
    where = persistent if "://" in persistent else os.path.realpath(persistent)
    return "run-" + hashlib.sha256(where.encode()).hexdigest()[:16]


class NodeDirectory:
    """One run's copies on this node (see the module's docstring)."""

    def __init__(self, directory: str, run_id: str) -> None:
        self.top = Path(directory)
        self.run = self.top / run_id
        self._claim: int | None = None  # the locked marker's descriptor, while this process holds the run

    def claim(self) -> None:
        """Make the run's folder and marker, and hold the marker locked (shared) until :meth:`release`:
        no other run's start-up removes a live run."""
        self.run.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run / MARKER, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._claim = fd

    def _put_back_replaced(self) -> list[str]:
        """Put back each copy that a replica's arrival moved aside (see ``replaced_path``) when the
        process died before the new copy took its place; returns those put back."""
        back = []
        for _, folder in self._steps():
            for p in _entries(folder):
                if (m := _REPLACED_RE.match(p.name)) and (p / MANIFEST_NAME).is_file() \
                        and not (folder / m.group(1)).exists():
                    os.rename(p, folder / m.group(1))
                    back.append(str(folder / m.group(1)))
        return back

    def identity(self) -> tuple[int, int] | None:
        """The run's marker as this process sees it (device, inode), or None where it sees none:
        ranks that share a node must see one file (two machines given one node id do not)."""
        try:
            st = os.stat(self.run / MARKER)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def release(self) -> None:
        fd, self._claim = self._claim, None
        if fd is not None:
            os.close(fd)

    def timeline(self) -> Timeline | None:
        """The timeline this node's copies belong to, as the last job to take a step (or start anew)
        here wrote it; None where none did, or the file is damaged. A node that missed a job holds
        an older one than the nodes that took part: its copies belong to an abandoned timeline."""
        try:
            found = json.loads((self.run / TIMELINE).read_bytes())
        except FileNotFoundError:
            return None
        except (ValueError, RecursionError):
            log.warning("local tier %s: %s is damaged: its copies are taken for another timeline's", self.run, TIMELINE)
            return None
        return found if valid(found) else None

    def set_timeline(self, timeline: Timeline) -> None:
        """Record that this node's copies belong to ``timeline`` (replaced atomically)."""
        temp = self.run / f"{TIMELINE}.{secrets.token_hex(4)}.tmp"
        temp.write_text(json.dumps(timeline))
        os.replace(temp, self.run / TIMELINE)

    def step_path(self, step: int) -> Path:
        return self.run / f"step_{step:09d}"

    def copy_path(self, step: int, rank: int) -> Path:
        """Where the copy of ``rank``'s state at ``step`` lies on this node (whether it exists or not)."""
        return self.step_path(step) / f"rank_{rank:05d}"

    def holdings(self) -> dict[int, list[int]]:
        """The committed copies on this node: {step: [ranks]}."""
        held: dict[int, list[int]] = {}
        for step, folder in self._steps():
            ranks = sorted(int(m.group(1)) for p in _entries(folder) if (m := _COPY_RE.match(p.name))
                           and (p / MANIFEST_NAME).is_file())
            if ranks:
                held[step] = ranks
        return held

    def _steps(self) -> list[tuple[int, Path]]:
        return sorted((int(m.group(1)), p) for p in _entries(self.run) if (m := _STEP_RE.match(p.name)))

    def steps(self) -> list[int]:
        """Every step with a folder here, its copies committed or not."""
        return [step for step, _ in self._steps()]

    def clean_at_start(self) -> list[str]:
        """Remove this run's copies that never committed and replicas still arriving (a crashed
        trainer's leftovers); returns what was removed. Run by one rank of the node, once it has
        claimed the run (:meth:`claim`)."""
        if back := self._put_back_replaced():
            log.info("local tier %s: put back %s, moved aside by a replica that never took its place", self.top,
                     ", ".join(back))
        leftovers = [p for _, folder in self._steps() for p in _entries(folder)
                     if not (_COPY_RE.match(p.name) and (p / MANIFEST_NAME).is_file())]
        leftovers += [p for p in _entries(self.run) if not _STEP_RE.match(p.name) and p.name not in (MARKER, TIMELINE)]
        for p in leftovers:
            _remove(p)
        for _, folder in self._steps():
            if not any(_entries(folder)):
                _remove(folder)
        return self._said_removed(leftovers)

    def remove_other_runs(self) -> list[str]:
        """Remove the folders of other runs that no live process holds (a finished or crashed
        job's); returns what was removed. Run by one rank of the node at the run's first local
        save, not at start-up: every manager of a requeued job (one per root) claims its run
        before then, so none takes another's steps, still to be restored, for a finished job's."""
        return self._said_removed([p for p in _entries(self.top) if p != self.run and _remove_abandoned(p)])

    def _said_removed(self, removed: list[Path]) -> list[str]:
        if removed:
            log.info("local tier %s: removed %s", self.top, ", ".join(str(p.relative_to(self.top)) for p in removed))
        return [str(p) for p in removed]

    def remove_steps(self, steps: Iterable[int]) -> None:
        """Delete these steps' folders (each copy's manifest first, so a half-deleted copy is never
        taken for a committed one). Only steps named: a folder that appeared since the caller
        listed them is the next save's, still being written."""
        for step in steps:
            folder = self.step_path(step)
            for copy in _entries(folder):
                (copy / MANIFEST_NAME).unlink(missing_ok=True)
            _remove(folder)

    def set_aside(self, step: int, rank: int) -> Path | None:
        """Move ``rank``'s copy of ``step`` aside (one rename) under a name no listing takes and
        start-up removes, for the caller to delete; where it went, or None when there is none. A
        save of that step may then write its copy anew while the old one is being deleted."""
        copy = self.copy_path(step, rank)
        aside = copy.with_name(f"{DROPPED}{copy.name}-{secrets.token_hex(4)}")
        try:
            os.rename(copy, aside)
        except FileNotFoundError:
            return None
        return aside

    def bytes_used(self) -> int:
        """Bytes of every file of this run on this node."""
        return sum(f.stat().st_size for f in self.run.rglob("*") if f.is_file()) if self.run.is_dir() else 0


def step_folders(directory: str) -> list[tuple[str, int, Path]]:
    """The step folders of every run in the node directory ``directory``, or of the one run when
    ``directory`` is a run's folder: (run id, step, folder), in order (what ``zerostall ls`` lists)."""
    top = Path(directory)
    runs = [NodeDirectory(str(top.parent), top.name)]
    if not runs[0].steps():
        runs = [NodeDirectory(directory, p.name) for p in _entries(top) if p.is_dir() and _RUN_RE.match(p.name)]
    return [(run.run.name, step, run.step_path(step)) for run in runs for step in run.steps()]


def check_space(directory: str, needed: int, reusable: int) -> None:
    """Raise :class:`InsufficientSpaceError` unless ``directory``'s file system has ``needed``
    bytes, counting ``reusable`` bytes already there that retention will free."""
    os.makedirs(directory, exist_ok=True)
    free = free_bytes(directory)
    if needed <= free + reusable:
        return
    shm = " (a RAM disk: raise its size, e.g. docker run --shm-size)" if directory.startswith("/dev/shm") else ""
    raise InsufficientSpaceError(
        f"the local tier in {directory} needs {needed} bytes ((keep + 2) x this node's copies), but its file system "
        f"has {free} bytes free (+{reusable} this run's older copies){shm}: free space there, lower "
        "LocalTier.keep or replicas, or choose a larger directory; nothing was written")


def _remove_abandoned(folder: Path) -> bool:
    """Remove ``folder`` if it is a run's folder (it holds the marker) that no live process holds,
    holding its marker locked meanwhile; whether it was removed."""
    if folder.is_symlink() or not (folder / MARKER).is_file():
        return False
    try:
        fd = os.open(folder / MARKER, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a live run holds it
        _remove(folder)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replaced_path(final: Path) -> Path:
    """Where a copy at ``final`` waits, moved aside, while a replica that arrived takes its place;
    start-up puts it back if the process died between the two renames."""
    return final.parent / f"{INCOMING}{final.name}-{secrets.token_hex(4)}-replaced"
