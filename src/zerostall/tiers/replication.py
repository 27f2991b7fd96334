"""After each local save, in the background: replicate it to other nodes, then retire old steps.

One thread per rank works through the local saves in order (each handed over by ``save()`` as it
starts, so waiting for the worker waits for every step saved so far), so ``save()`` runs no
collective. For each step the ranks first agree, in one small all-reduce on the tier's own
process group (never the training group), whether every rank holds its copy: a step some rank
lacks (its save failed, or was dropped) can never be restored, so none is sent. Else each rank
sends its copy to its holders and receives the copies it holds for others, all in one
:func:`~zerostall.tiers.transfer.exchange` on that group. A received copy is published only once
every block checked. A failure is logged and counted, never raised into training: the step is
then restored from other copies, or the root.

Replication never holds a save back. When it is slower than the local saves, the steps handed
over and not yet taken up are dropped at the next save (:meth:`drop_waiting`, the one thing
``save()`` deletes): this rank's copy is set aside and deleted, so the ranks skip the step, and
the newest step is replicated next. A node so holds at most ``keep + 2`` steps (the ``keep``
newest, the one being replicated, the one being written) however slow replication is.

Then, in one small all-reduce on the same group, the ranks agree whether every rank saved this
step, and whether every rank saved and replicated it (the all-reduce itself waits for every rank's
exchange of that step); so the ranks know the newest step every rank saved, and the newest every
rank saved and replicated. Each node's first rank deletes the saved steps older than the ``keep``
newest of them, but never the newest replicated one (while replication fails, it is the step a
lost node restores from) nor a newer step (its save may still be writing); and it deletes the
steps some rank failed to save, which no restore can use (nor may they take a place in ``keep``).

A peer that dies or a transfer that times out breaks the group (gloo closes the pair). Each rank
then says so once, at error level, and goes on without it: no more replication, and the ranks
agree through the group's key-value store instead (the job's rendezvous store, which outlives the
pair): each posts the steps it saved, the first rank posts the newest step every rank has posted
(so the store answers ranks + nodes requests a step, not ranks × nodes), and each node's first
rank deletes the steps saved up to it beyond the ``keep`` newest of them, but never the newest
replicated before the break; until every rank has posted, nothing. The training thread makes a
new group at its next collective point (:meth:`~zerostall.tiers.tier.NodeTier.mend`), and this
worker goes on with it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import threading
import time
from concurrent import futures
from datetime import timedelta
from typing import Any, Callable, TypeVar

import orjson

import torch.distributed as dist

from ..collectives import Group
from .local import NodeDirectory
from .nodes import Nodes
from .stream import LinkError
from .transfer import exchange

log = logging.getLogger(__name__)
T = TypeVar("T")

_POSTED = 64  # the newest steps a rank posts as saved, once the group is broken
_ANSWERS = 8  # the first rank's newest answers kept in the store (a node's first rank may lag behind)


@dataclasses.dataclass
class _Job:
    """A local save handed over to the worker."""

    step: int
    committed: futures.Future[Any]
    dropped: bool = False  # its copy deleted before the worker took it up (a newer save came first)


class Replicator:
    """This rank's background worker of the local tier (see the module's docstring)."""

    def __init__(self, group: Group, pg: Any, nodes: Nodes, directory: NodeDirectory, replicas: int,
                 keep: int, token: str, timeout_s: float) -> None:
        self.group, self.pg, self.directory, self.keep = group, pg, directory, keep
        self._key = f"zerostall-tier-{token}-saved/{{}}"  # this tier's posts (another attempt's are other keys)
        self._answer = f"zerostall-tier-{token}-everywhere/{{}}"  # the first rank's, by step
        self._answered: collections.deque[str] = collections.deque()  # the first rank's answers in the store
        self._timeout = timedelta(seconds=timeout_s)
        self.rank = group.rank
        self.leader = nodes.leads(self.rank)
        self.holders = nodes.holders(self.rank, replicas)
        self.sources = nodes.sources(self.rank, replicas)
        self.failures = 0
        """Steps whose replication failed on this rank (logged each time)."""
        self.save_failures = 0
        """Local saves that failed on this rank (logged each time; a restore never uses such a step)."""
        self.replicated: list[tuple[int, float]] = []
        """Steps replicated on this rank, with the seconds each took."""
        self._jobs: collections.deque[_Job] = collections.deque()  # handed over, not yet taken up
        self._busy = False  # whether the worker is on a step
        self._taken = -1  # the step the worker took up last: a later job of it shares its copy
        self._closing = False
        self._lock = threading.Condition()
        self.dropped = 0
        """Steps dropped on this rank before their replication began (a newer local save came first)."""
        self._saved = -1  # the newest step this rank saved
        self._done = -1  # the newest step this rank saved and replicated
        self._agreed = (-1, -1)  # the newest steps every rank saved, and saved and replicated, last agreed
        self._kept: list[int] = []  # the newest steps this rank saved (posted to the store once broken)
        self._partial: set[int] = set()  # steps agreed to be missing some rank's copy, until removed
        self.broken: str | None = None
        """Why the tier's group failed on this rank (None while it works): replication has stopped."""
        self._thread = threading.Thread(target=self._run, name="zerostall-replication", daemon=True)
        self._thread.start()

    def submit(self, step: int, committed: futures.Future[Any]) -> None:
        """Replicate ``step`` once its local save ends (``committed``: its future). A failed save is
        logged and counted here, never raised into training; the step then goes on without it."""
        with self._lock:
            self._jobs.append(_Job(step, committed))
            self._lock.notify_all()

    def drop_waiting(self, step: int) -> list[int]:
        """Before the local save of ``step`` (the ones handed over committed): drop the steps the
        worker has not taken up, deleting this rank's copy of each (set aside at once, deleted in a
        thread of its own), so the node never holds more steps than the space check counted; but
        neither ``step`` itself nor the step the worker took up last (saved again: each copy is
        rewritten in place, the one a job taken up replicated among them). Returns the steps
        dropped whose save had succeeded. A failure to delete is logged, never raised into training."""
        with self._lock:
            waiting = [job for job in self._jobs if not job.dropped and job.step not in (step, self._taken)]
            for job in waiting:
                job.dropped = True
        for job in waiting:
            try:
                aside = self.directory.set_aside(job.step, self.rank)
                if aside is not None:
                    threading.Thread(target=shutil.rmtree, args=(aside,), kwargs={"ignore_errors": True},
                                     name="zerostall-tier-drop", daemon=True).start()
            except Exception as exc:  # left for retention, or the next start-up
                log.warning("local tier: the copy of step %d on rank %d, dropped before its replication, could not "
                            "be deleted: %s: %s", job.step, self.rank, type(exc).__name__, exc)
        dropped = [job.step for job in waiting if job.committed.exception() is None]
        self.dropped += len(dropped)
        return dropped

    def _take(self) -> _Job | None:
        with self._lock:
            self._lock.wait_for(lambda: self._jobs or self._closing)
            if not self._jobs:
                return None
            self._busy = True
            job = self._jobs.popleft()
            self._taken = job.step
            return job

    def _run(self) -> None:
        while (job := self._take()) is not None:
            step = job.step
            try:
                futures.wait([job.committed])
                saved = self._saved_here(step, job.committed.exception()) and not job.dropped
                replicated = self.broken is None and (not (self.holders or self.sources)
                                                      or self._everyone_saved(step, saved) and self._replicate(step))
                if saved:
                    self._saved = step
                    self._kept = [*self._kept[1 - _POSTED:], step]
                    if replicated:
                        self._done = step
                self._retire(step, saved, saved and replicated)
            except Exception as exc:  # a file system error: the next step retires again
                log.warning("local tier: retiring old steps after step %d failed: %s: %s", step,
                            type(exc).__name__, exc)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _saved_here(self, step: int, failure: BaseException | None) -> bool:
        if failure is not None:
            self.save_failures += 1
            log.error("local-tier save of step %d failed on rank %d (%d so far): %s", step, self.rank,
                      self.save_failures, failure)
        return failure is None

    def _everyone_saved(self, step: int, saved: bool) -> bool:
        """Whether every rank holds its copy of ``step`` (one small all-reduce): else none is sent, as a
        step some rank lacks (its save failed, or was dropped) is never restored."""
        try:
            return self.group.all_reduce_min([int(saved)])[0] == 1
        except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
            self._failed(step, exc, broken=True)
            return False

    def _replicate(self, step: int) -> bool:
        start = time.perf_counter()
        own = self.directory.copy_path(step, self.rank)
        try:
            exchange(self.pg, [(dst, own) for dst in self.holders],
                     [(src, self.directory.copy_path(step, src)) for src in self.sources], step=step)
        except Exception as exc:  # never fatal to training: the step still has its own copies
            self._failed(step, exc, broken=isinstance(exc, LinkError))
            return False
        self.replicated.append((step, time.perf_counter() - start))
        return True

    def _failed(self, step: int, exc: BaseException, *, broken: bool) -> None:
        """Log and count a failed replication of ``step``; ``broken``: it broke the tier's group."""
        self.failures += 1
        log.warning("replicating step %d of rank %d failed (%d so far): %s: %s", step, self.rank, self.failures,
                    type(exc).__name__, exc)
        if broken:
            self._break(exc)

    def _retire(self, step: int, saved_here: bool, replicated_here: bool) -> None:
        """Delete the steps every rank saved beyond the ``keep`` newest, but never the newest
        replicated one (agreed on the group, or through its store once the group is broken), and
        the steps agreed to be missing some rank's copy (they can never be restored)."""
        saved: int | None = None
        replicated = self._agreed[1]
        if self.broken is None:
            try:  # whether every rank saved this very step, and replicated it: not the newest each saved
                whole, spread = self.group.all_reduce_min([int(saved_here), int(replicated_here)])
                self._agreed = saved, replicated = (step if whole else self._agreed[0],
                                                    step if spread else self._agreed[1])
                if not whole:
                    self._partial.add(step)
            except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
                self._break(exc)
        if self.broken is not None:
            saved = self._saved_everywhere(step)
        if not self.leader or saved is None:
            if not self.leader:
                self._partial.clear()  # a node's first rank deletes them
            return
        steps = self.directory.steps()
        done = [s for s in steps if s <= saved and s not in self._partial]
        self.directory.remove_steps([s for s in done[:-self.keep] if s != replicated]
                                    + [s for s in steps if s in self._partial])
        self._partial.clear()

    def _saved_everywhere(self, step: int) -> int | None:
        """With the group broken, after ``step``: post the steps this rank saved to the group's
        store; the first rank answers with the newest step every rank has posted, which a node's
        first rank waits for and returns. None while unknown (not every rank has posted)."""
        def post_and_read(store: Any) -> int:
            store.set(self._key.format(self.rank), orjson.dumps(self._kept))
            answer = self._answer.format(step)
            if self.rank == 0:
                keys = [self._key.format(r) for r in range(self.group.size)]
                posts = [set(orjson.loads(p)) for p in store.multi_get(keys)] if store.check(keys) else []
                store.set(answer, str(max(set.intersection(*posts), default=-1) if posts else -1))
                self._answered.append(answer)
                if len(self._answered) > _ANSWERS:
                    store.delete_key(self._answered.popleft())
            if not self.leader:
                return -1
            store.wait([answer], self._timeout)
            return int(store.get(answer))

        newest = self._in_store(post_and_read)  # no store to reach, or no answer in time: nothing is deleted
        return newest if newest is not None and newest >= 0 else None

    def forget_after(self, step: int | None, replicated: int = -1) -> None:
        """The run goes on from ``step`` (None: from scratch): steps newer than it were deleted, so
        they no longer count as saved, also in what this rank posts; with the group still broken
        (it could not be made anew), at once, and the first rank's answers about them are removed.
        ``replicated``: the newest step up to it the nodes hold every replica of, kept by retention."""
        def kept(s: int) -> int:
            return s if step is not None and s <= step else -1

        self._kept = [s for s in self._kept if kept(s) >= 0]
        self._partial = {s for s in self._partial if kept(s) >= 0}
        self._saved, self._done = kept(self._saved), kept(self._done)
        self._agreed = (kept(self._agreed[0]), kept(self._agreed[1]))
        if step is not None:  # a restarted process knew none: the step restored counts as saved, and as
            self._agreed = (max(self._agreed[0], step), max(self._agreed[1], replicated))  # replicated only if it is
        if self.broken is not None:
            self._in_store(self._repost)

    def lost_link(self, exc: BaseException) -> None:
        """Take the tier's group for broken if ``exc`` came of a broken link (a restore's transfer or
        collective on it), so the next restore in this process makes the group anew before using it."""
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, LinkError):
            cause = cause.__cause__
        if cause is not None and self.broken is None:
            self._break(cause)

    def relink(self, group: Group, pg: Any) -> None:
        """Go on with the tier's new group (made on every rank while this worker had nothing to do),
        once this rank's keys are gone from the old one's store (the job's, which outlives it)."""
        self._in_store(self._forget_keys)  # a few keys left behind if it cannot
        self._answered.clear()
        self.group, self.pg, self.broken = group, pg, None

    def _repost(self, store: Any) -> None:
        """Post this rank's saved steps anew, and remove the first rank's answers (about steps gone)."""
        store.set(self._key.format(self.rank), orjson.dumps(self._kept))
        while self._answered:
            store.delete_key(self._answered.popleft())

    def _forget_keys(self, store: Any) -> None:
        for key in [self._key.format(self.rank), *self._answered]:
            store.delete_key(key)

    def _in_store(self, work: Callable[[Any], T]) -> T | None:
        """``work`` on the store of the tier's group (the job's, which outlives a broken group), or
        None, logged, when the store cannot be reached or does not answer in time."""
        try:
            return work(dist.distributed_c10d._get_process_group_store(self.pg))
        except Exception as exc:
            log.debug("local tier: the store of the tier's group cannot be used: %s: %s", type(exc).__name__, exc)
            return None

    def _break(self, exc: BaseException) -> None:
        """The tier's group failed: say so once, loudly, and go on without it (see the module's docstring)."""
        self.broken = f"{type(exc).__name__}: {exc}"
        log.error("local tier: its process group failed on rank %d (%s). No step is replicated to other nodes "
                  "until the next persistent save or restore makes a new group (local saves go on, old ones retired "
                  "as before)", self.rank, self.broken)

    def wait(self) -> None:
        """Block until every step submitted so far is replicated (or failed, or dropped) and retired."""
        with self._lock:
            self._lock.wait_for(lambda: not self._jobs and not self._busy)

    def close(self) -> None:
        """Finish the steps submitted, then stop the thread."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join()
