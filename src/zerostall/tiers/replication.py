"""Replication: after each local save, every rank's copy goes to its holders on other nodes.

One background thread per rank works through the local saves in order. For each step it sends
this rank's copy to its holders and receives the copies it holds for others, all in one
:func:`~zerostall.tiers.transfer.exchange` over the tier's own process group (never the training
group). Every rank takes part in every step, also when its own save failed (it then sends word
that it has nothing), so the pairs always match. A received copy is published only once every
block checked. A failure is logged and counted, never raised into training: the step is then
restored from other copies, or the persistent tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from .local import NodeDirectory
from .nodes import Nodes
from .transfer import exchange

log = logging.getLogger(__name__)


class Replicator:
    """This rank's replication thread (see the module's docstring)."""

    def __init__(self, pg: Any, nodes: Nodes, directory: NodeDirectory, rank: int, replicas: int) -> None:
        self.pg, self.directory, self.rank = pg, directory, rank
        self.holders = nodes.holders(rank, replicas)
        self.sources = nodes.sources(rank, replicas)
        self.failures = 0
        """Steps whose replication failed on this rank (logged each time)."""
        self.replicated: list[tuple[int, float]] = []
        """Steps replicated on this rank, with the seconds each took."""
        self._queue: queue.Queue[tuple[int, bool] | None] = queue.Queue()
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="zerostall-replication", daemon=True)
        self._thread.start()

    def submit(self, step: int, saved: bool) -> None:
        """Replicate ``step`` once its local save is done (``saved``: whether it committed here)."""
        with self._lock:
            self._pending.add(step)
        self._queue.put((step, saved))

    @property
    def pending(self) -> set[int]:
        """Steps submitted and not yet replicated: their copies must stay until they are sent."""
        with self._lock:
            return set(self._pending)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            step, saved = job
            try:
                self._replicate(step, saved)
            finally:
                with self._lock:
                    self._pending.discard(step)
                self._queue.task_done()
        self._queue.task_done()

    def _replicate(self, step: int, saved: bool) -> None:
        start = time.perf_counter()
        own = self.directory.copy_path(step, self.rank) if saved else None
        try:
            exchange(self.pg, [(dst, own) for dst in self.holders],
                     [(src, self.directory.copy_path(step, src)) for src in self.sources])
        except Exception as exc:  # never fatal to training: the step still has its own copies
            self.failures += 1
            log.warning("replicating step %d of rank %d failed (%d so far): %s: %s", step, self.rank, self.failures,
                        type(exc).__name__, exc)
            return
        self.replicated.append((step, time.perf_counter() - start))

    def wait(self) -> None:
        """Block until every step submitted so far is replicated (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the steps submitted, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
