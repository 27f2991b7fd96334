"""CheckpointManager: a directory of checkpoints by step, ``latest``, open/close, resume, retention.

Layout under ``root``: one checkpoint directory per step (``step_000000100``) or tag, a
``latest`` pointer (JSON, replaced atomically, written only after a commit) and a writer lease
(``.writer-lease``) naming the host, boot and process that writes here, renewed while it lives.
A new writer removes what a dead one left uncommitted, renamed aside (``.deleting-*``) first.
Saving a step below committed ones (a rollback) moves those into ``.superseded/`` first.
Retention (see :mod:`zerostall.retention`) runs on the coordinator after each commit, in the
background; a checkpoint is deleted manifest first, so a half-deleted one is never seen as valid.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import secrets
import shutil
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from .api import open as open_checkpoint, save
from .asynchronous import AsyncSaver, SaveHandle
from .checkpoint import Checkpoint
from .collectives import Group
from .errors import CheckpointError, CheckpointNotFoundError
from .format import MANIFEST_NAME
from .opening import read_manifest_head
from .retention import CheckpointRecord, RetentionPolicy, kept, numeric_metrics
from .saving import SaveInfo
from .schedule import SaveSchedule
from .state import RankLocal, rank_local
from .storage.local import LocalStorage, fsync_dir

log = logging.getLogger(__name__)

LATEST_NAME = "latest"
LEASE_NAME = ".writer-lease"
_TRASH_PREFIX = ".deleting-"
SUPERSEDED_NAME = ".superseded"
_RNG_KEY = "__rng__"


def step_tag(step: int) -> str:
    return f"step_{step:09d}"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def publish(root: str, name: str, data: bytes, fsync: bool) -> None:
    """Replace ``root/name`` atomically (the storage's own temp + rename commit)."""
    LocalStorage(root, fsync=fsync).publish(name, f"{name}.{secrets.token_hex(4)}.tmp", data)


class WriterLease:
    """Who writes under a root: host, boot id, pid and a token, renewed every ``ttl / 3`` seconds.

    A lease is stale when it was not renewed within its ``ttl`` (recorded in it), or when it names this host and boot
    and a pid that no longer runs. ``flock`` is not used: it is unreliable on NFS/Lustre and does
    not exist on object stores.
    """

    def __init__(self, root: str, ttl: float, fsync: bool) -> None:
        self.root = root
        self.path = os.path.join(root, LEASE_NAME)
        self.ttl = ttl
        self.fsync = fsync
        self.me = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                   "token": secrets.token_hex(8)}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def is_stale(self, lease: dict[str, Any]) -> bool:
        if time.time() - lease.get("renewed", 0) > lease.get("ttl", self.ttl):
            return True
        if lease.get("host") == self.me["host"] and lease.get("boot_id") == self.me["boot_id"]:
            try:
                os.kill(int(lease["pid"]), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, KeyError, ValueError):
                return False
        return False

    def acquire(self) -> None:
        """Take the lease or raise naming its live holder; re-read after writing to settle races."""
        current = self.holder()
        if current is not None and current.get("token") != self.me["token"] and not self.is_stale(current):
            raise CheckpointError(f"{os.path.dirname(self.path)} is being written by {current.get('host')} "
                                  f"pid {current.get('pid')} (lease renewed {time.time() - current['renewed']:.0f} s "
                                  "ago); two managers must not write one root")
        self._renew()
        time.sleep(random.uniform(0.01, 0.05))
        if (self.holder() or {}).get("token") != self.me["token"]:
            raise CheckpointError(f"another manager took {os.path.dirname(self.path)} at the same moment")
        self._thread = threading.Thread(target=self._keep_alive, name="zerostall-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        publish(self.root, LEASE_NAME, json.dumps({**self.me, "ttl": self.ttl, "renewed": time.time()}).encode(),
                self.fsync)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._renew()
            except OSError as exc:
                log.warning("could not renew the writer lease %s: %s", self.path, exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if (self.holder() or {}).get("token") == self.me["token"]:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _remove_if_older(path: str, seconds: float) -> None:
    """Remove ``path`` if it was last modified more than ``seconds`` ago (a file that young may
    belong to a writer that is still running)."""
    try:
        if time.time() - os.stat(path).st_mtime > seconds:
            os.unlink(path)
    except FileNotFoundError:
        pass


class CheckpointManager:
    """Steps and tags under one root: ``save`` (create → save → commit), ``open``, ``restore``,
    ``latest``, retention. Collective when distributed: every rank makes the same calls.

    ``keep_*``/``metric``/``mode``/``protect`` set the retention rules; ``save_every`` and
    ``save_interval_s`` drive :meth:`should_save`; ``async_save`` makes ``save`` return a
    :class:`SaveHandle` at once. ``rank_local_keys`` are top-level keys of the state saved per
    rank (data loaders); RNG states (torch, CUDA, python, numpy) are saved and restored per rank.
    """

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None, keep_every: int | None = None,
                 keep_best: int | None = None, metric: str | None = None, mode: str = "min",
                 keep_time_interval: float | None = None, protect: Callable[[int], bool] | None = None,
                 save_every: int | None = None, save_interval_s: float | None = None, async_save: bool = False,
                 rank_local_keys: tuple[str, ...] = ("dataloader", "data_loader"), process_group: Any = None,
                 fsync: bool = True, lease_ttl: float = 60.0, **save_options: Any) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.policy = RetentionPolicy(keep_last, keep_every, keep_best, metric, mode, keep_time_interval, protect)
        self.rank_local_keys = rank_local_keys
        self.process_group = process_group
        self.group = Group(process_group)
        self.schedule = SaveSchedule(self.group, save_every, save_interval_s)
        self.fsync = fsync
        self.save_options = save_options
        self.saver = AsyncSaver() if async_save else None
        self._pinned: set[int] = set()
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerostall-retention")
        self._pending_delete: Future[None] | None = None
        self._committing: Future[None] | None = None
        self._records: dict[str, tuple[tuple[int, int, int], CheckpointRecord]] = {}  # see checkpoints()
        self.lease: WriterLease | None = None
        if self.group.is_coordinator:
            try:
                os.makedirs(self.root, exist_ok=True)
                self.lease = WriterLease(self.root, lease_ttl, fsync)
                self.lease.acquire()
                self._clean_stale_attempts()
            except OSError as exc:
                raise CheckpointError(f"cannot write checkpoints under {self.root}: {exc}") from exc

    # -- deciding and saving -------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due: every ``save_every`` steps and/or ``save_interval_s`` seconds,
        the same answer on every rank (see :class:`SaveSchedule`); call it on every rank, every step."""
        return self.schedule.due(step)

    def save(self, step: int, state: Any, *, metrics: dict[str, float] | None = None,
             tag: str | None = None) -> SaveInfo | SaveHandle:
        """create → save → commit: write ``state`` as ``step`` (or ``tag``), then update ``latest``
        and apply retention once it has committed."""
        tag = tag or step_tag(step)
        path = self.create(tag)
        self._settle_commit()
        self._set_aside_later_than(step, tag)
        wrapped = self._wrap(state)
        metadata = {"metrics": dict(metrics or {}), "tag": tag}
        self.schedule.saved()
        self._pinned.add(step)
        options = {"process_group": self.process_group, "step": step, "metadata": metadata, "fsync": self.fsync,
                   **self.save_options}
        if self.saver is None:
            try:
                info = save(wrapped, path, **options)
            finally:
                self._pinned.discard(step)
            self.commit(tag, step)
            return info
        handle = self.saver.save(wrapped, path, **options)
        assert handle is not None
        self._committing = committing = Future()
        handle.committed.add_done_callback(
            _OneShot(functools.partial(self._committed_async, tag=tag, step=step, committing=committing)))
        return handle

    def _set_aside_later_than(self, step: int, tag: str) -> None:
        """Saving ``step`` while checkpoints of later steps exist forks the run (a rollback to an
        earlier checkpoint, or a new run in the same root): move those into ``.superseded/``, so
        that restore, ``latest`` and retention follow the run being written (they pick by step, and
        would resume the abandoned run or delete the new one's checkpoints) and nothing is lost.
        ``tag`` itself stays: this save replaces it, safely, as any save into a path does."""
        if not self.group.is_coordinator:
            return
        later = [name for name, record in self.checkpoints() if record.step > step and name != tag]
        if later:
            self._deleter.submit(self._move_aside, later, step).result()  # not while retention deletes

    def _move_aside(self, tags: list[str], step: int) -> None:
        aside = os.path.join(self.root, SUPERSEDED_NAME)
        os.makedirs(aside, exist_ok=True)
        for tag in tags:
            target = os.path.join(aside, tag)
            while os.path.exists(target):
                target = os.path.join(aside, f"{tag}.{secrets.token_hex(4)}")
            try:
                os.rename(os.path.join(self.root, tag), target)
            except FileNotFoundError:
                continue
            log.warning("step %d is being saved under %s, which holds later steps: %s moved to %s (move it back "
                        "to resume from it)", step, self.root, tag, target)
        if self.fsync:
            fsync_dir(aside)
            fsync_dir(self.root)

    def _committed_async(self, fut: Future, tag: str, step: int, committing: Future) -> None:
        """Runs when an asynchronous save is done: commit it (latest, retention) if it succeeded."""
        try:
            self._pinned.discard(step)
            if fut.exception() is None:
                self.commit(tag, step)
        except BaseException as exc:
            committing.set_exception(exc)  # raised once, by the next wait(), save() or close()
        else:
            committing.set_result(None)

    def create(self, tag: str) -> str:
        """The directory a new checkpoint ``tag`` is written into (created by the save itself)."""
        if "/" in tag or tag in (LATEST_NAME, LEASE_NAME) or tag.startswith("."):
            raise ValueError(f"invalid checkpoint tag {tag!r}")
        return os.path.join(self.root, tag)

    def commit(self, tag: str, step: int | None) -> None:
        """After the checkpoint committed: point ``latest`` at it, then apply retention in the
        background. If ``latest`` cannot be written (a full disk), raise and delete nothing."""
        if not self.group.is_coordinator:
            return
        try:
            publish(self.root, LATEST_NAME, json.dumps({"tag": tag, "step": step}).encode(), self.fsync)
        except OSError as exc:  # `latest` still names the previous checkpoint, which must stay
            raise CheckpointError(f"{tag} is committed, but {os.path.join(self.root, LATEST_NAME)} could not be "
                                  f"pointed at it: {exc}") from exc
        self._pending_delete = self._deleter.submit(self._apply_retention)

    # -- reading -------------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[str, CheckpointRecord]]:
        """Committed checkpoints (tag, record), oldest step first. Only the head of each manifest
        is parsed, once per manager while it stays the same file (retention runs after every save)."""
        found = []
        seen: dict[str, tuple[tuple[int, int, int], CheckpointRecord]] = {}
        for name in sorted(os.listdir(self.root)) if os.path.isdir(self.root) else ():
            if name.startswith("."):
                continue
            try:
                st = os.stat(os.path.join(self.root, name, MANIFEST_NAME))
            except (FileNotFoundError, NotADirectoryError):
                continue
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._records.get(name)
            if cached is not None and cached[0] == key:
                record = cached[1]
            else:
                try:
                    manifest = read_manifest_head(LocalStorage(os.path.join(self.root, name)))
                except CheckpointError:
                    continue
                metadata = manifest.metadata if isinstance(manifest.metadata, dict) else {}
                metrics = numeric_metrics(metadata.get("metrics") or {})
                record = CheckpointRecord(manifest.step if manifest.step is not None else -1, manifest.created, metrics)
            seen[name] = (key, record)
            found.append((name, record))
        self._records = seen
        return sorted(found, key=lambda item: (item[1].step, item[0]))

    def latest(self) -> str | None:
        """The newest committed checkpoint's tag. Found by scanning, which cannot lag behind a
        commit; the ``latest`` file mirrors it for other tools."""
        found = self.checkpoints()
        return found[-1][0] if found else None

    def open(self, tag: str | None = None, **options: Any) -> Checkpoint | None:
        """Open ``tag`` (``None``/``"latest"``: the newest committed) on every rank: rank 0 resolves,
        everyone opens the same one. ``None`` when nothing was committed yet; a named tag that
        does not exist raises :class:`CheckpointNotFoundError`. Close it (or use ``with``)."""
        resolved = None
        if self.group.is_coordinator:
            resolved = self.latest() if tag in (None, "latest") else tag
        payload = json.dumps(resolved).encode() if self.group.is_coordinator else None
        resolved = json.loads(self.group.broadcast_bytes(payload))
        if resolved is None:
            return None
        path = os.path.join(self.root, resolved)
        try:
            ck = open_checkpoint(path, process_group=self.process_group, **options)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {resolved!r} under {self.root}") from None
        ck.tag = resolved
        return ck

    def restore(self, state: Any, tag: str | None = None, **load_options: Any) -> int | None:
        """Load the newest (or ``tag``) checkpoint into ``state`` in place, RNG states included;
        returns its step, or ``None`` for a fresh start. It stays protected from retention."""
        ck = self.open(tag)
        if ck is None:
            return None
        with ck:
            wrapped = self._wrap(state)
            ck.load(wrapped, **load_options)
        _set_rng_state(wrapped[_RNG_KEY].value)
        if ck.step is not None:
            self._pinned.add(ck.step)
        return ck.step

    def _wrap(self, state: Any) -> dict[str, Any]:
        if not isinstance(state, dict):
            raise TypeError("CheckpointManager saves a dict of named parts, e.g. {'model': m, 'optim': o}")
        wrapped = {k: rank_local(v) if k in self.rank_local_keys and not isinstance(v, RankLocal) else v
                   for k, v in state.items()}
        wrapped[_RNG_KEY] = rank_local(_rng_state())
        return wrapped

    # -- retention -----------------------------------------------------------------------------
    def _apply_retention(self) -> None:
        found = self.checkpoints()
        keep = kept([r for _, r in found], self.policy, pinned=sorted(self._pinned))
        for tag, record in found:
            if record.step not in keep:
                delete_checkpoint(os.path.join(self.root, tag))

    def _clean_stale_attempts(self) -> None:
        """Remove step directories that never committed: we hold the lease, so their writer is dead
        (and temp files of ``latest``/lease updates that a crash interrupted).

        Each directory is first renamed out of the way in one atomic step, so that a writer that outlived
        its lease can never commit a manifest into a directory whose data files are being deleted:
        its commit then fails, or came first and the directory is put back whole."""
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith(_TRASH_PREFIX):
                shutil.rmtree(path, ignore_errors=True)  # a cleanup that a crash interrupted
            elif name.startswith((f"{LATEST_NAME}.", f"{LEASE_NAME}.")) and name.endswith(".tmp"):
                _remove_if_older(path, self.lease.ttl)  # a publish that a crash interrupted
            elif name.startswith("step_") and os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST_NAME)):
                trash = os.path.join(self.root, f"{_TRASH_PREFIX}{name}.{secrets.token_hex(4)}")
                try:
                    os.rename(path, trash)
                except FileNotFoundError:
                    continue
                if os.path.exists(os.path.join(trash, MANIFEST_NAME)):
                    log.warning("%s committed while it was being cleaned up: a writer outlived its lease", path)
                    os.rename(trash, path)
                    continue
                log.info("removing the uncommitted checkpoint %s left by a dead writer", path)
                shutil.rmtree(trash, ignore_errors=True)

    def wait(self) -> None:
        """Finish the save in flight and the retention it triggered."""
        if self.saver is not None:
            self.saver.wait()
        self._settle_commit()
        if self._pending_delete is not None:
            self._pending_delete.result()

    def _settle_commit(self) -> None:
        """Wait for the commit step (``latest``, retention) of the last asynchronous save; its
        failure is raised here, once."""
        committing, self._committing = self._committing, None
        if committing is not None:
            committing.result()

    def close(self) -> None:
        """Finish pending work, stop background threads and give up the writer lease."""
        try:
            self.wait()
        finally:
            try:
                if self.saver is not None:
                    self.saver.close()
            finally:
                self._deleter.shutdown(wait=True)
                if self.lease is not None:
                    self.lease.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _OneShot:
    """A done-callback that lets go of what it calls once it has run: a finished future keeps its
    callbacks, so one holding the manager would tie manager, saver and handle into a cycle."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[[Future], None]) -> None:
        self._call: Callable[[Future], None] | None = call

    def __call__(self, fut: Future) -> None:
        call, self._call = self._call, None
        if call is not None:
            call(fut)


def delete_checkpoint(path: str) -> None:
    """Delete a checkpoint so that it never looks valid half-way: the manifest goes first."""
    try:
        os.unlink(os.path.join(path, MANIFEST_NAME))
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
