"""After each local save, in the background: replicate it to other nodes, then retire old steps.

One thread per rank works through the local saves in order, so ``save()`` runs no collective and
deletes nothing. For each step it sends this rank's copy to its holders and receives the copies
it holds for others, all in one :func:`~zerostall.tiers.transfer.exchange` over the tier's own
process group (never the training group). Every rank takes part in every step, also when its own
save failed (it then sends word that it has nothing), so the pairs always match. A received copy
is published only once every block checked. A failure is logged and counted, never raised into
training: the step is then restored from other copies, or the root.

Then, in one small all-reduce on the same group, the ranks agree on the newest step every rank
has saved, and the newest every rank has saved and replicated (the all-reduce itself waits for
every rank's exchange of that step); each node's first rank deletes the saved steps older than
the ``keep`` newest of them, but never the newest replicated one (while replication fails, it is
the step a lost node restores from) nor a newer step (its save may still be writing).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from ..collectives import Group
from .local import NodeDirectory
from .nodes import Nodes
from .transfer import exchange

log = logging.getLogger(__name__)

class Replicator:
    """This rank's background worker of the local tier (see the module's docstring)."""

    def __init__(self, group: Group, pg: Any, nodes: Nodes, directory: NodeDirectory, replicas: int,
                 keep: int) -> None:
        self.group, self.pg, self.directory, self.keep = group, pg, directory, keep
        self.rank = group.rank
        self.leader = nodes.leads(self.rank)
        self.holders = nodes.holders(self.rank, replicas)
        self.sources = nodes.sources(self.rank, replicas)
        self.failures = 0
        """Steps whose replication failed on this rank (logged each time)."""
        self.replicated: list[tuple[int, float]] = []
        """Steps replicated on this rank, with the seconds each took."""
        self._queue: queue.Queue[tuple[int, bool] | None] = queue.Queue()
        self._saved = -1  # the newest step this rank saved
        self._done = -1  # the newest step this rank saved and replicated
        self._thread = threading.Thread(target=self._run, name="zerostall-replication", daemon=True)
        self._thread.start()

    def submit(self, step: int, saved: bool) -> None:
        """Replicate ``step`` once its local save is done (``saved``: whether it committed here)."""
        self._queue.put((step, saved))

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            step, saved = job
            try:
                replicated = self._replicate(step, saved) if self.holders or self.sources else True
                if saved:
                    self._saved = step
                    if replicated:
                        self._done = step
                self._retire()
            except Exception as exc:  # the tier's group failed (a peer died): the next restore sorts it out
                log.warning("local tier: retiring old steps after step %d failed: %s: %s", step,
                            type(exc).__name__, exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _replicate(self, step: int, saved: bool) -> bool:
        start = time.perf_counter()
        own = self.directory.copy_path(step, self.rank) if saved else None
        try:
            exchange(self.pg, [(dst, own) for dst in self.holders],
                     [(src, self.directory.copy_path(step, src)) for src in self.sources])
        except Exception as exc:  # never fatal to training: the step still has its own copies
            self.failures += 1
            log.warning("replicating step %d of rank %d failed (%d so far): %s: %s", step, self.rank, self.failures,
                        type(exc).__name__, exc)
            return False
        self.replicated.append((step, time.perf_counter() - start))
        return True

    def _retire(self) -> None:
        saved, replicated = self.group.all_reduce_min([self._saved, self._done])
        if not self.leader:
            return
        done = [s for s in self.directory.steps() if s <= saved]
        self.directory.remove_steps([s for s in done[:-self.keep] if s != replicated])

    def wait(self) -> None:
        """Block until every step submitted so far is replicated (or failed) and retired."""
        self._queue.join()

    def close(self) -> None:
        """Finish the steps submitted, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
