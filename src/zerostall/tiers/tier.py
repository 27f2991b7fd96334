"""The local tier at run time, as a :class:`~zerostall.CheckpointManager` drives it.

Built once on every rank (collective): the node of every rank, the tier's own gloo process group
(transfers between nodes never share the training group), and the node's directory cleaned of
what a crashed trainer or a finished run left. Each local save captures this rank's whole state
asynchronously into its own copy, with no collective (but the first save's space check); once it
committed, the background worker (:mod:`zerostall.tiers.replication`) sends it to the holders and
retires old steps. A failed local save is logged and counted there, never raised into training.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..collectives import ALONE, Group
from ..errors import CheckpointError
from ..gcpause import gc_paused
from ..options import LoadOptions, SaveOptions
from ..roots.restore import Candidate, PassedOver, RestoreInfo
from ..roots.root import step_tag, typed_error
from ..saving.asynchronous import AsyncSaver
from ..saving.estimate import bytes_needed
from ..saving.handles import SaveHandle
from .copies import LAYOUT_KEY, View, load_copy, placeable, placements, view
from .local import LocalTier, NodeDirectory, check_space, run_id_for
from .nodes import NODE_ENV, Nodes, gather_nodes
from .replication import Replicator
from .sources import Survey, restore_from_tiers, say_why_not, survey
from .timelines import following, kept_until
from .transfer import Landed

log = logging.getLogger(__name__)


class NodeTier:
    """The local tier of one manager on this rank (see the module's docstring)."""

    def __init__(self, options: LocalTier, group: Group, persistent: str) -> None:
        self.options, self.group = options, group
        if group.size > 1 and group.size != dist.get_world_size():
            raise CheckpointError(
                f"the local tier needs a manager over every rank of the job: this one runs on {group.size} of its "
                f"{dist.get_world_size()} ranks (process_group=...), and the tier's own process group can only be "
                "made with every rank of the job taking part (torch.distributed's rule). Give the manager "
                "process_group=None, or leave local= off for it; nothing was saved")
        self.directory = NodeDirectory(options.directory, options.run_id or run_id_for(persistent))
        self.nodes: Nodes = gather_nodes(group)
        self.pg = None
        self.restoring = group  # the restore's collectives: on the tier's group, bounded by its timeout
        if group.size > 1:
            self.pg = self._new_group()
            self.restoring = Group(self.pg)
        self.leader = self.nodes.leads(group.rank)
        try:
            with group.failing_together(f"the local tier in {options.directory} could not be prepared on {{failed}} "
                                        "other rank(s) (their errors say why)"):
                if self.leader:
                    try:
                        self.directory.claim()
                        self.directory.clean_at_start()
                    except OSError as exc:
                        raise typed_error(exc, f"cannot prepare the local tier in {options.directory}") from exc
            self._check_one_directory_per_node()
        except BaseException:
            self.directory.release()
            if self.pg is not None:
                dist.destroy_process_group(self.pg)
            raise
        self.replicas = min(options.replicas, self.nodes.count)
        if options.replicas > 1 and self.nodes.count == 1 and group.is_coordinator:
            log.info("local tier: one node, so no replicas on other nodes (replicas=%d asked for)", options.replicas)
        background = self.restoring if group.size > 1 else Group(ALONE)
        self.token = group.agree(lambda: secrets.token_hex(8).encode()).decode()  # its store keys' and timelines' id
        self.replicator = Replicator(background, self.pg, self.nodes, self.directory, self.replicas, options.keep,
                                     self.token, options.timeout_s)
        self.saver = AsyncSaver()
        self._space_checked = False
        self._said_slow = False  # whether a step dropped before its replication was logged
        self._last = -1  # the newest step saved (or restored) on this timeline
        self._timeline = False  # whether this run's timeline is set: a restore took a step, or a save began anew

    @property
    def failures(self) -> int:
        """Local saves that failed on this rank (each logged; a restore never uses such a step)."""
        return self.replicator.save_failures

    def _new_group(self) -> Any:
        """The tier's own gloo group over the training group's ranks (collective, on every rank of the job)."""
        return dist.new_group(dist.get_process_group_ranks(self.group.pg), backend="gloo",
                              timeout=timedelta(seconds=self.options.timeout_s))

    def before_save(self, step: int | None, persistent: bool) -> bool:
        """A save's collective point, on every rank before anything is written (``step``: None for a
        tag's save); returns whether the run starts a new timeline here. The first save of a run
        that restored nothing does: the local steps found at start (an earlier run's) are removed,
        so no later restore takes them. So does a save of a step below one this tier saved (the run
        went back by itself, without a restore): its local steps from ``step`` on are removed, as the
        root sets its own aside. A persistent save mends a broken group (see :meth:`mend`)."""
        if not self._timeline or (step is not None and step < self._last):
            self.forget_after(None if not self._timeline else step - 1)
            return True
        if persistent:
            self.mend()
        return False

    def mend(self, *, if_any: bool = False) -> bool:
        """At a collective point of the training thread (a persistent save; a restore, ``if_any``):
        once the tier's group failed on every rank (on any rank, ``if_any``), make a new one, so
        replication goes on from the next local save. Collective on the training group. Returns
        whether no rank's group is broken now (the same answer on every rank)."""
        if self.pg is None:
            return True
        broken = self.group.all_reduce_ints([self.replicator.broken is not None])[0]
        if broken == 0 or (broken < self.group.size and not if_any):  # those not broken yet soon are
            return broken == 0
        self.wait()  # every step saved so far has been handled without the group, on every rank
        self.group.all_reduce_ints([0])  # and every rank is here: the new group's rendezvous waits timeout_s at most
        try:
            fresh, why = self._new_group(), None
        except Exception as exc:  # the job's store or a rank unreachable: go on without the group, as before
            fresh, why = None, exc
        if self.group.all_reduce_min([fresh is not None])[0] == 0:
            if fresh is not None:
                dist.destroy_process_group(fresh)
            log.error("local tier: its process group could not be made anew on rank %d (%s); no step is replicated "
                      "until the next try", self.group.rank, why or "on another rank")
            return False
        old, self.pg = self.pg, fresh
        self.restoring = Group(self.pg)
        self.replicator.relink(self.restoring, self.pg)
        dist.destroy_process_group(old)
        if self.group.is_coordinator:
            log.warning("local tier: its process group was made anew; replication goes on from the next local save")
        return True

    def _check_one_directory_per_node(self) -> None:
        """Refuse, on every rank, ranks that share a node id but not its directory (two machines or
        containers given one ``ZEROSTALL_NODE_ID``): only the first's copies would be listed and retired."""
        seen = self.group.all_gather_object(self.directory.identity())
        apart = [r for r, where in enumerate(seen) if where != seen[self.nodes.ranks_on(self.nodes.index(r))[0]]]
        if apart:
            first = self.nodes.ranks_on(self.nodes.index(apart[0]))[0]
            raise CheckpointError(
                f"rank(s) {apart[:8]} share the node id {self.nodes.ids[apart[0]]!r} with rank {first} but not its "
                f"local tier directory {self.directory.run}: two machines (or containers) run under one node id. Give "
                f"each machine its own {NODE_ENV} (or unset it: the hostname and boot id name a node); nothing was "
                "saved")

    def due(self, step: int) -> bool:
        return step % self.options.every == 0

    def save(self, step: int, state: dict[str, Any], options: SaveOptions) -> SaveHandle:
        """Start saving this rank's copy of ``step`` (collective only the first time: the space
        check); replication and retention follow its commit in the background. Steps saved before
        and not yet taken up by replication (it is slower than the saves) are dropped first, so the
        node never holds more steps than the space check counted and ``save()`` never waits for it."""
        if not self._space_checked:  # a collective: a value one rank cannot encode fails it on every rank
            with self.group.failing_together("the first local-tier save could not be prepared on {failed} other "
                                             "rank(s) (their errors say why); nothing was saved"):
                tree, flat, digest = view(state)
                nbytes = bytes_needed(flat.leaves, options.block_size, options.allow_pickle, 1)  # saved alone
            self._check_space(nbytes)
            self._space_checked = True
        else:
            tree, flat, digest = view(state)
        metadata = {"tier": "local", "rank": self.group.rank, "world_size": self.group.size,
                    "node": self.nodes.ids[self.group.rank], LAYOUT_KEY: digest}
        path = self.directory.copy_path(step, self.group.rank)
        local = dataclasses.replace(options, fsync=False, overwrite=True, before_commit=None, incremental=False)
        self._drop_unreplicated(step)
        self._last = max(self._last, step)
        handle = self.saver.save(tree, str(path), local, process_group=ALONE, step=step, metadata=metadata)
        assert handle is not None
        self.saver.hold_steps([obj for obj, _ in flat.statefuls.values() if isinstance(obj, torch.optim.Optimizer)])
        self.replicator.submit(step, handle.quiet().committed)  # every rank's worker must see every step
        return handle

    def _drop_unreplicated(self, step: int) -> None:
        """Once the local save before has committed (the saver waits for it anyway), drop the steps
        replication has not taken up; said once, as it means replication is slower than the saves."""
        self.saver.await_done()
        dropped = self.replicator.drop_waiting(step)
        if dropped and not self._said_slow:
            self._said_slow = True
            log.warning("local tier: replication is slower than the local saves, so step(s) %s were dropped on rank "
                        "%d before being replicated (replication goes on with the newest, step %d or later): raise "
                        "LocalTier.every to save less often", dropped, self.group.rank, step)

    def _check_space(self, nbytes: int) -> None:
        """Before the first local save: other runs' folders no live process holds are removed (see
        :meth:`NodeDirectory.remove_other_runs`), then each node needs room for (keep + 2) steps of
        its copies: the ``keep`` newest, the one being replicated and the one being written."""
        sizes = self.group.all_gather_object(nbytes)
        with self.group.failing_together(f"the local tier in {self.options.directory} has too little space on "
                                         "{failed} other node(s) (their errors give the numbers); nothing was saved"):
            if self.leader:
                try:
                    self.directory.remove_other_runs()
                except OSError as exc:
                    raise typed_error(exc, f"cannot prepare the local tier in {self.options.directory}") from exc
                node = self.nodes.index(self.group.rank)
                held = set(self.nodes.ranks_on(node))
                for r in list(held):
                    held.update(self.nodes.sources(r, self.replicas))
                check_space(self.options.directory, (self.options.keep + 2) * sum(sizes[r] for r in held),
                            self.directory.bytes_used())

    @gc_paused()  # the caller waits: no cyclic collections over the per-leaf and per-chunk objects
    def restore(self, state: dict[str, Any], options: LoadOptions, candidates: list[Candidate],
                unreachable: Exception | None, *, fallback: bool,
                root: Callable[..., Any]) -> tuple[RestoreInfo | None, Any, Survey]:
        """Restore ``state`` from the newest step: the root's checkpoints (``candidates``, newest
        first) newer than the newest step the tiers hold for every rank, then that step (its other
        copies, older steps), then the root's older checkpoints. ``root(candidates, earlier=...,
        until=...)`` restores from the root as :func:`restore_first_whole` does, recording what it
        restored. Returns what the tiers restored (None when the root did), the loaded state and
        what the tiers hold (for :meth:`forget_after`)."""
        self.wait()
        if not self.mend(if_any=True):  # a group that failed earlier in this run (a restore that timed out)
            raise CheckpointError("the local tier's process group failed earlier in this run and could not be made "
                                  "anew (the log says why), so it cannot restore: restart the job, or "
                                  "restore(tag=...) a checkpoint of the root")
        target = view(state, restoring=True)
        seen = survey(self.restoring, self.nodes, self.directory, target.digest)
        load = functools.partial(_load, state, target, options)
        place = functools.partial(placements, target) if placeable(options) else None
        fallbacks: list[tuple[str, str]] = []
        bad: set[tuple[int, int, int]] = set()  # copies found damaged
        i = 0  # the root's next checkpoint to try
        while (best := seen.newest(self.nodes, bad)) is not None:  # the tiers' newest whole step left
            cut = next((n for n in range(i, len(candidates)) if candidates[n][2] <= best), len(candidates))
            if cut > i:  # the root's newer checkpoints first; all of them damaged: the tiers' step
                got = root(candidates[i:], until=cut - i, earlier=tuple(fallbacks))
                if not isinstance(got, PassedOver):
                    return None, got, seen
                fallbacks = list(got.fallbacks)
            rest = [step for _, damage, step in candidates[cut:] if damage is None]
            try:  # the tiers' steps no older than the root's next (all damaged: the root's next, and on)
                chosen = restore_from_tiers(self.restoring, self.pg, self.nodes, self.directory, seen,
                                            rest[0] - 1 if rest else None, load, place, fallback=fallback,
                                            fallbacks=fallbacks, bad=bad)
            except CheckpointError as exc:
                self.replicator.lost_link(exc)
                root([], until=0, earlier=tuple(fallbacks))  # records what was passed over: nothing restored
                raise
            if chosen is not None:
                break
            i = cut
        else:
            if unreachable is not None:
                raise unreachable
            say_why_not(self.group, seen, self.directory, fresh=not candidates[i:] and not fallbacks)
            return None, root(candidates[i:], earlier=tuple(fallbacks)), seen
        choice, loaded = chosen
        if unreachable is not None and self.group.is_coordinator:
            log.warning("the checkpoint root could not be listed (%s): restored step %d from the local tier",
                        unreachable, choice.step)
        kinds = tuple(choice.kinds)
        info = RestoreInfo(choice.step, kinds[self.group.rank], kinds, tuple(fallbacks), step_tag(choice.step))
        return info, loaded, seen

    def forget_after(self, step: int | None, seen: Survey | None = None) -> None:
        """Delete this node's local steps newer than ``step`` (None: every one), once a restore took
        ``step`` (``seen``: what its survey found): they belong to a timeline that does not go on (a
        rollback, saves made after the step a crash fell back to), so no later restore takes them or
        mixes them with this run's. A new timeline is recorded on every node of the job; a node that
        missed jobs keeps only its copies of steps the run went through (see :mod:`.timelines`)."""
        self.wait()
        if seen is None:
            self.mend(if_any=True)  # a broken group's store holds what the ranks posted about the abandoned timeline
            seen = survey(self.group, self.nodes, self.directory, "")
        node = self.nodes.ids[self.group.rank]
        until = kept_until(seen.timelines[self.nodes.index(self.group.rank)], node, seen.timeline)
        timeline = following(seen.timeline, step, seen.clock, self.token, self.nodes.ids)
        with self.group.failing_together("the local tier's newer steps could not be removed on {failed} other "
                                         "rank(s) (their errors say why)"):  # and no rank saves before they are
            if self.leader:  # and a node that missed jobs, those of the timeline it was left on
                try:
                    self.directory.remove_steps([s for s in self.directory.steps()
                                                 if step is None or s > min(step, until)])
                except OSError as exc:
                    raise typed_error(exc, f"cannot remove the newer steps of the local tier in {self.directory.run}")
            self.replicator.forget_after(step, -1 if step is None else seen.replicated(self.group.size, self.replicas,
                                                                                        step))
        with self.group.failing_together("the local tier's timeline could not be recorded on {failed} other "
                                         "rank(s) (their errors say why)"):  # once every node removed its steps
            if self.leader:
                try:
                    self.directory.set_timeline(timeline)
                except OSError as exc:
                    raise typed_error(exc, f"the local tier's timeline could not be recorded in {self.directory.run}")
        self._timeline = True
        self._last = -1 if step is None else step

    def wait_staged(self) -> None:
        self.saver.wait_staged()

    def wait(self) -> None:
        """Finish the local save in flight and every replication submitted."""
        try:
            self.saver.wait()
        finally:
            self.replicator.wait()

    def close(self) -> None:
        """Finish the saves and replication in flight, then stop the saver, the worker and the tier's group."""
        try:
            self.wait()
        finally:
            try:
                self.saver.close()
            finally:
                self.replicator.close()
                self.directory.release()
                pg, self.pg = self.pg, None  # closed once: a second close has nothing left to destroy
                if pg is not None:
                    dist.destroy_process_group(pg)


def _load(state: dict[str, Any], target: View, options: LoadOptions, path: str, landed: Landed | None) -> Any:
    """Load a copy into ``state`` (seen as ``target``); one just received (``landed``) had every
    block checked on arrival, so it is not checked a second time, and its manifest is not read again."""
    if landed is None:
        return load_copy(state, target, path, options=options)
    return load_copy(state, target, path, options=dataclasses.replace(options, verify=False), placed=landed.placed,
                     manifest=landed.manifest)
