"""The writer lease of a checkpoint root: which process writes there, renewed while it lives.

A small JSON file (``.writer-lease``) on the root's storage, created exclusively and replaced to
renew it. ``flock`` is not used: it is unreliable on NFS/Lustre and does not exist on object stores.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from typing import Any, Callable

from ..errors import CheckpointError, ConcurrentWriteError, StorageError
from ..storage import SMALL_FILE_BYTES, Storage, storage_for
from ..storage.base import FileTooLargeError
from .root import LEASE_NAME, CheckpointRoot

log = logging.getLogger(__name__)

DEFAULT_TTL = 60.0


def _pid_namespace() -> str:
    """This process's PID namespace (a container has its own, new at every start): pids name
    processes only within it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


class WriterLease:
    """Who writes under a root: host, boot id, pid and a token, renewed every ``ttl / 3`` seconds.

    A lease is stale when it was not renewed within its ``ttl`` (recorded in it), or when it names
    this host and boot and a pid that no longer runs. ``fsync`` applies when ``root`` is a path.
    """

    def __init__(self, root: str | os.PathLike[str] | Storage, ttl: float, fsync: bool = True) -> None:
        self.storage = storage_for(root, fsync=fsync)
        self.where = f"{self.storage.location.rstrip('/')}/{LEASE_NAME}"
        self.ttl = ttl
        self.me = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid_namespace": _pid_namespace(),
                   "pid": os.getpid(), "token": secrets.token_hex(8)}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        """The lease as it is now; None when there is none (see :func:`read_lease`)."""
        return read_lease(self.storage)

    def fence(self, then: Callable[[], None] | None = None) -> LeaseFence:
        """A check (picklable, for a writer process) that this lease is still ours, for
        ``SaveOptions.before_commit``; ``then`` runs after it."""
        return LeaseFence(self.storage, self.me["token"], then)

    def is_stale(self, lease: dict[str, Any]) -> bool:
        """Whether ``lease`` was not renewed in time, or names a process of this host (and PID
        namespace: a container that shares the host's name has its own) that is gone."""
        if time.time() - lease.get("renewed", 0) > lease.get("ttl", self.ttl):
            return True
        if self._here(lease):
            try:
                os.kill(int(lease["pid"]), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, KeyError, ValueError):
                return False
        return False

    def acquire(self) -> None:
        """Take the lease or raise naming its live holder. A new lease is created exclusively; a
        stale one is replaced only if it is still the one seen (a conditional PUT on an object
        store), then read back after a moment to settle a race where no such check holds."""
        current = self.holder()
        if current is not None and current.get("token") != self.me["token"] and not self.is_stale(current):
            current = self._outlive(current)
        if current is None:
            if self.storage.create_exclusive(LEASE_NAME, self._record()):
                self._start_renewing()
                return
            current = self.holder()  # another manager created it since we looked
        if current is not None and current.get("token") != self.me["token"] and not self.is_stale(current):
            raise CheckpointError(f"{self.storage.location} is being written by {current.get('host')} "
                                  f"pid {current.get('pid')} (lease renewed "
                                  f"{time.time() - current.get('renewed', 0):.0f} s ago); "
                                  "two managers must not write one root")
        self._replace(current)
        time.sleep(random.uniform(0.01, 0.05))
        if (self.holder() or {}).get("token") != self.me["token"]:
            raise CheckpointError(f"another manager took {self.storage.location} at the same moment")
        self._start_renewing()

    def _here(self, lease: dict[str, Any]) -> bool:
        """Whether ``lease``'s pid names a process this one can see: the same host, boot and PID namespace."""
        return all(lease.get(k) == self.me[k] for k in ("host", "boot_id", "pid_namespace"))

    def _outlive(self, lease: dict[str, Any]) -> dict[str, Any] | None:
        """Wait, for a live-looking ``lease`` of another host or container, until its holder renews it
        (it is alive: returned, to be refused) or its ttl runs out (it died with its node or
        container: a job restarted elsewhere takes over instead of failing until then). Returns the
        lease as it is then."""
        if self._here(lease):
            return lease  # its pid said whether it lives
        log.info("the writer lease of %s is held by %s, not renewed for %.0f s: waiting for it to be renewed or to "
                 "lapse", self.storage.location, lease.get("host"), time.time() - lease.get("renewed", 0))
        while True:
            time.sleep(max(0.05, min(1.0, lease.get("renewed", 0) + lease.get("ttl", self.ttl) - time.time())))
            now = self.holder()
            if now is None or self.is_stale(now) or (now.get("token"), now.get("renewed")) != (
                    lease.get("token"), lease.get("renewed")):
                return now

    def _record(self) -> bytes:
        return json.dumps({**self.me, "ttl": self.ttl, "renewed": time.time()}).encode()

    def _replace(self, seen: dict[str, Any] | None) -> None:
        """Write our lease over ``seen``, checking at the switch that it is still there."""
        def unchanged() -> None:
            if (self.holder() or {}).get("token") != (seen or {}).get("token"):
                raise CheckpointError(f"another manager took {self.storage.location} at the same moment")

        try:
            self.storage.publish(LEASE_NAME, self._tmp_name(), self._record(), before_replace=unchanged)
        except ConcurrentWriteError as exc:
            raise CheckpointError(f"another manager took {self.storage.location} at the same moment") from exc

    @staticmethod
    def _tmp_name() -> str:
        return f"{LEASE_NAME}.{secrets.token_hex(4)}.tmp"

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._keep_alive, name="zerostall-lease", daemon=True)
        self._thread.start()

    def _keep_alive(self) -> None:
        """Renew every ``ttl / 3`` seconds while the lease is still ours; once another process holds
        it (this one was paused past the ttl, say), stop: never overwrite the new holder's lease.
        The check and the renewal are one publish: on an object store a PUT conditional on the
        lease the check read, so a takeover between the two fails the renewal."""
        while not self._stop.wait(self.ttl / 3):
            try:
                self.storage.publish(LEASE_NAME, self._tmp_name(), self._record(), before_replace=self.fence())
            except OSError as exc:
                log.warning("could not renew the writer lease %s: %s", self.where, exc)
            except CheckpointError as exc:
                log.error("%s; stopped renewing it", exc)
                return

    def release(self) -> None:
        """Stop renewing and remove the lease, if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if (self.holder() or {}).get("token") == self.me["token"]:
                self.storage.delete(LEASE_NAME)
        except OSError as exc:  # it lapses after its ttl
            log.warning("could not remove the writer lease %s (%s): it lapses %.0f s after its last renewal",
                        self.where, exc, self.ttl)


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The lease of the root at ``storage`` as it is now; None when there is none (or it is not a
    lease: too big, not JSON). A failure to read it (an object store's error) is raised as a
    :class:`StorageError`: whether a writer holds the root is then unknown, never taken for no."""
    try:
        lease = json.loads(storage.read_bytes(LEASE_NAME, SMALL_FILE_BYTES))
    except (FileNotFoundError, FileTooLargeError, ValueError, RecursionError):  # none, or not a lease (a few
        return None  # hundred bytes of JSON)
    except OSError as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(f"cannot read the writer lease {storage.location.rstrip('/')}/{LEASE_NAME}: {exc}") from exc
    return lease if isinstance(lease, dict) else None


class LeaseFence:
    """Raises unless the root's lease still holds ``token``: run right before anything a writer
    that lost its lease must not do (a commit, moving or deleting checkpoints, ``latest``)."""

    def __init__(self, storage: Storage, token: str, then: Callable[[], None] | None = None) -> None:
        self.storage, self.token, self.then = storage, token, then

    def __call__(self) -> None:
        lease = read_lease(self.storage)
        if (lease or {}).get("token") != self.token:
            holder = f"{lease.get('host')} pid {lease.get('pid')}" if lease else "nobody"
            raise CheckpointError(f"this process no longer holds the writer lease of {self.storage.location} (held "
                                  f"by {holder}: it was taken over, e.g. while this process was paused past the "
                                  "lease's ttl); nothing more is written, moved or deleted there: stop this writer")
        if self.then is not None:
            self.then()


def live_holder(root: Storage) -> dict[str, Any] | None:
    """The writer lease of ``root`` when it is live (a manager is writing there), else None."""
    lease = WriterLease(root, ttl=DEFAULT_TTL)
    holder = lease.holder()
    if holder is None or lease.is_stale(holder):
        return None
    return holder


def take_root(root: CheckpointRoot, ttl: float) -> WriterLease:
    """On a manager's coordinator: create the root, refuse one that holds what is not ours, take its
    writer lease and remove what a dead writer left (see :meth:`CheckpointRoot.clean_stale_attempts`).
    Returns the lease, held and renewed; a failure releases it and is a :class:`CheckpointError`."""
    lease = None
    try:
        root.storage.create()
        root.check_only_ours()
        lease = WriterLease(root.storage, ttl)
        lease.acquire()
        root.clean_stale_attempts(temp_age=ttl)
    except BaseException as exc:
        if lease is not None:
            lease.release()
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write checkpoints under {root.location}: {exc}") from exc
        raise
    return lease
