"""A multi-rank commit's wake-up calls through the process group's c10d store.

Ranks waiting for a commit wait on the store server (``TCPStore.wait`` blocks in the server until a
key exists), so they send no storage request while the slowest rank writes. The store is reached
by its host and port with a connection of the save's own, so the background writer of a training
process (a thread, or a writer process outside the process group) rings and waits too, and a
blocking wait never holds the connection training uses. The storage stays the record: every rank
still writes its ``done``/``failed`` record there, and a store that cannot be reached (another
kind of store, or the server gone with its training process) only means falling back to polling
the storage (:mod:`zerostall.saving.commit`).

Keys, under ``zerostall/<location>/<generation>/``: ``r<rank>`` (``done`` or ``failed:<reason>``),
``finished`` (a counter), ``ready`` (set by the last rank to finish, or at once by a failed one)
and ``verdict`` (``ok``, or ``abort:<reason>``, set by the coordinator). The coordinator removes
the rank keys once it has read them, and a verdict when it announces the next one on that store
(every rank read it before the next save could commit): one verdict stays with the store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT = timedelta(seconds=5)


@dataclass(frozen=True)
class StoreAddress:
    """Where a process group's TCPStore listens: picklable, so a writer process connects too."""

    host: str
    port: int


_last_verdict: dict[StoreAddress, str] = {}  # per store, the verdict key this process announced last


def store_address(pg: Any) -> StoreAddress | None:
    """The TCPStore behind process group ``pg``; None for a store of another kind (file, hash)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_process_group_store(pg)
    except (AttributeError, KeyError, RuntimeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return StoreAddress(store.host, store.port) if isinstance(store, dist.TCPStore) else None


class Unreachable(Exception):
    """The store did not answer (or is gone): wait by polling the storage instead."""


class Doorbell:
    """The store keys of one save (see the module docstring); every method raises
    :class:`Unreachable` when the store fails."""

    def __init__(self, address: StoreAddress, size: int, location: str, generation: str) -> None:
        import torch.distributed as dist

        self.size, self.address = size, address
        self.prefix = f"zerostall/{location}/{generation}/"
        try:
            self.store = dist.TCPStore(address.host, address.port, is_master=False, timeout=_CONNECT_TIMEOUT)
        except (RuntimeError, OSError) as exc:
            raise Unreachable(f"the process group's store at {address.host}:{address.port}: {exc}") from exc

    @classmethod
    def open(cls, address: StoreAddress | None, size: int, location: str, generation: str) -> Doorbell | None:
        """The doorbell of a save of ``size`` ranks, or None (one rank, no TCPStore, or none reachable)."""
        if address is None or size < 2:
            return None
        try:
            return cls(address, size, location, generation)
        except Unreachable as exc:
            log.warning("commit coordination falls back to polling the storage: %s", exc)
            return None

    def _do(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (RuntimeError, OSError) as exc:  # torch's DistError is a RuntimeError
            raise Unreachable(str(exc)) from exc

    def ring(self, rank: int, failure: str | None = None) -> None:
        """Say this rank finished (its ``done`` record written), or failed; the last one to
        finish, or a failed one, wakes the coordinator."""
        self._do(self.store.set, f"{self.prefix}r{rank}", "done" if failure is None else f"failed:{failure}")
        finished = self._do(self.store.add, f"{self.prefix}finished", 1)
        if failure is not None or finished == self.size - 1:
            self._do(self.store.set, f"{self.prefix}ready", "1")

    def wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` (``ready`` or ``verdict``) was set within ``seconds``."""
        start = time.monotonic()
        try:
            self.store.wait([self.prefix + key], timedelta(seconds=max(seconds, 0.001)))
            return True
        except (RuntimeError, OSError) as exc:
            if time.monotonic() - start >= 0.9 * seconds:
                return False  # the wait timed out: not yet
            raise Unreachable(str(exc)) from exc

    def outcomes(self, ranks: list[int]) -> dict[int, str]:
        """What the ranks that finished said: ``done`` or ``failed:<reason>``."""
        keys = {r: f"{self.prefix}r{r}" for r in ranks}
        present = {r: k for r, k in keys.items() if self._do(self.store.check, [k])}
        return {r: self._do(self.store.get, k).decode(errors="replace") for r, k in present.items()}

    def forget_ranks(self, ranks: list[int]) -> None:
        """Remove the keys the coordinator has read (best effort)."""
        for key in [*(f"r{r}" for r in ranks), "finished", "ready"]:
            try:
                self.store.delete_key(self.prefix + key)
            except (RuntimeError, OSError):
                return

    def announce(self, verdict: str) -> None:
        """The coordinator's word to the waiting ranks: ``ok`` (committed) or ``abort:<reason>``; the
        verdict it announced before on this store goes (so a long job does not grow the store)."""
        key = f"{self.prefix}verdict"
        self._do(self.store.set, key, verdict)
        previous, _last_verdict[self.address] = _last_verdict.get(self.address), key
        if previous is not None and previous != key:
            try:
                self.store.delete_key(previous)
            except (RuntimeError, OSError):
                pass  # a few bytes left with the store

    def verdict(self) -> str:
        return self._do(self.store.get, f"{self.prefix}verdict").decode(errors="replace")
