"""CheckpointManager: checkpoints by step under one root, ``latest``, open/close, resume, retention.

The root (see :mod:`zerostall.roots.root`) holds one checkpoint per step (``step_000000100``) or tag,
the ``latest`` pointer and the writer lease (see :mod:`zerostall.roots.lease`). A new writer removes
what a dead one left uncommitted. Saving a step below committed ones (a rollback), or one that
exists, moves those into ``.superseded/`` first. Retention (see :mod:`zerostall.roots.retention`) runs on the coordinator after
each commit, in the background; a checkpoint is deleted manifest first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import weakref
from concurrent import futures
from typing import Any

from .collectives import Group
from .errors import CheckpointError, CheckpointNotFoundError, UnsupportedValueError
from .format.layout import RNG_KEY
from .gcpause import gc_paused
from .loading.checkpoint import Checkpoint
from .loading.load_plan import key_filter
from .options import LoadOptions, SaveOptions
from .roots import forking, resaving
from .roots.increments import Increments
from .roots.lease import DEFAULT_TTL, WriterLease, take_root
from .roots.loaders import LoaderGuard
from .roots.restore import NOTHING, PerRankCopy, RestoreInfo, newest_first, other_world, restore_first_whole
from .roots.retention import CheckpointRecord, RetentionPolicy, checked_metrics, policy_of, split_shorthand
from .roots.root import LATEST_NAME, CheckpointRoot, checkpoint_name, retained, step_tag, tag_step, validate_tag
from .roots.schedule import SaveSchedule
from .saving.asynchronous import AsyncSaver
from .saving.handles import OneShot, SaveHandle
from .saving.pipeline import SaveInfo, checked_step, persist, prepare
from .saving.plan import SavePlanner
from .state import RankLocal, rank_local, rng_state, set_rng_state
from .storage import Storage, storage_for
from .tiers.local import LocalTier, check_outside
from .tiers.tier import NodeTier

log = logging.getLogger(__name__)


class CheckpointManager:
    """Steps and tags under one root: ``save`` (create → save → commit), ``open``, ``restore``,
    ``latest``, retention. Collective when distributed: every rank makes the same calls.

    ``root``: a path or a :class:`Storage`. ``retention``: the retention rules; ``save_options``/
    ``load_options``: the options of its saves and of ``open``/``restore``. The fields of a
    :class:`RetentionPolicy` (``keep_last=3``; not with ``retention``) and of :class:`SaveOptions`
    (``fsync=False``) are keywords too; any other keyword is a ``TypeError`` here. ``save_every`` and
    ``save_interval_s`` drive :meth:`should_save`; ``async_save`` makes ``save`` return a
    :class:`SaveHandle` at once. ``rank_local_keys``: top-level keys saved per rank (data loaders);
    RNG states are saved and restored per rank. ``local``: the node-local tier (:class:`LocalTier`).
    """

    def __init__(self, root: str | os.PathLike[str] | Storage, *, retention: RetentionPolicy | None = None,
                 save_options: SaveOptions | None = None, load_options: LoadOptions | None = None,
                 save_every: int | None = None, save_interval_s: float | None = None, async_save: bool = False,
                 rank_local_keys: tuple[str, ...] = ("dataloader", "data_loader"), process_group: Any = None,
                 lease_ttl: float = DEFAULT_TTL, local: LocalTier | None = None, **shorthand: Any) -> None:
        rules, overrides = split_shorthand(shorthand)
        self.policy = policy_of(retention, rules)
        self.save_options, self.load_options = SaveOptions.of(save_options, overrides), LoadOptions.of(load_options)
        self.checkpoint_root = CheckpointRoot(storage_for(root, fsync=self.save_options.fsync))
        self.root = self.checkpoint_root.location
        self.rank_local_keys, self.process_group = rank_local_keys, process_group
        self.group = Group(process_group)
        self.schedule = SaveSchedule(self.group, save_every, save_interval_s)
        self.saver = AsyncSaver() if async_save else None
        self._pinned: set[int] = set()
        self._deleter = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerostall-retention")
        self._pending_delete: futures.Future[None] | None = None
        self._committing: futures.Future[None] | None = None
        self.lease: WriterLease | None = None
        self.last_restore: RestoreInfo = NOTHING
        """What the last :meth:`restore` restored: step, source(s), checkpoints passed over as damaged."""
        self._save_options = self.save_options
        self.increments = Increments(self.save_options)  # with incremental: what the next save refers to
        self.loaders = LoaderGuard()  # data loaders' draws from the global RNG kept in step with a resume
        if local is not None and not isinstance(local, LocalTier):
            raise TypeError(f"local must be a zerostall.LocalTier, not {type(local).__name__}")
        if local is not None:
            check_outside(local, self.root)
        self.group.agree(functools.partial(self._take_root, lease_ttl))  # a refusal is raised on every rank
        self.tier = None
        try:
            self.tier = NodeTier(local, self.group, self.root) if local is not None else None
        except BaseException:
            self.close()  # the root's lease and the threads: a manager that did not start holds nothing
            raise
        self._due: tuple[int, bool, bool] | None = None  # should_save's last answer: step, persistent, local
        self._sharing: SaveHandle | None = None  # the root's save copying from the local tier's capture

    def _take_root(self, lease_ttl: float) -> bytes:
        """On the coordinator: take the root and its writer lease (see :func:`take_root`)."""
        self.lease = take_root(self.checkpoint_root, lease_ttl)  # every commit first checks it is still this one's
        weakref.finalize(self, self.lease.release)  # a manager dropped unclosed does not hold the root
        self._save_options = dataclasses.replace(self.save_options,
                                                 before_commit=self.lease.fence(self.save_options.before_commit))
        return b""

    # -- deciding and saving -------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due in any tier: the root every ``save_every`` steps and/or
        ``save_interval_s`` seconds, the local tier every ``local.every`` steps; the same answer on
        every rank (see :class:`SaveSchedule`). Call it on every rank, every step."""
        persistent = self.schedule.due(step)
        local = self.tier is not None and self.tier.due(step)
        self._due = (step, persistent, local)
        return persistent or local

    def _tiers_due(self, step: int) -> tuple[bool, bool]:
        """Where ``save(step)`` writes: as :meth:`should_save` said for it; else the root, and the local tier if due."""
        if self._due is not None and self._due[0] == step and (self._due[1] or self._due[2]):
            return self._due[1], self._due[2]
        return True, self.tier is not None and self.tier.due(step)

    def save(self, step: int, state: Any, *, metrics: dict[str, float] | None = None,
             tag: str | None = None) -> SaveInfo | SaveHandle:
        """create → save → commit: write ``state`` as ``step`` (or ``tag``) into every tier due
        (see :meth:`should_save`), then, for the root, update ``latest`` and apply retention once it
        has committed. A local-tier save is always asynchronous; when the only one due, its handle is returned."""
        step = checked_step(step)
        if step is None:
            raise UnsupportedValueError("CheckpointManager.save needs the training step (a non-negative int)")
        metrics = checked_metrics(metrics)
        persistent, local = self._tiers_due(step) if tag is None else (True, False)
        if self.tier is not None and self.tier.before_save(None if tag else step, persistent) and not persistent:
            self._go_on_from(step)
        tag = tag or step_tag(step)
        storage = self.checkpoint_root.child(validate_tag(tag)) if persistent else None
        self.loaders.before_save(state, sys._getframe(1))
        wrapped = self._wrap(state)
        shared = None  # the local save, whose capture the root's save of the same step copies from
        if local:
            assert self.tier is not None
            if self._sharing is not None:  # the root's last save copies from the local saver's buffers
                futures.wait([self._sharing.staged])
            shared = self.tier.save(step, wrapped, self.save_options)
            if not persistent:
                return shared
        assert storage is not None
        self._before_saving(step, tag)
        metadata = {"metrics": metrics, "tag": tag}
        self.schedule.saved()
        self._pinned.add(step)  # retention keeps it while its save is in flight
        try:
            reuse = self.increments.base(step, tag)
            if self.saver is None:
                with gc_paused():  # as zs.save: no cyclic collections over the per-leaf objects
                    prepared = prepare(wrapped, storage, self._save_options, process_group=self.process_group,
                                       step=step, metadata=metadata, reuse=reuse)
                    if shared is not None:
                        shared.lend(prepared.items, [None] * len(prepared.items))
                    info = persist(prepared)
                self._pinned.discard(step)
                self.increments.committed(info)
                self._commit(tag, step)
                return info
            handle = self.saver.save(wrapped, storage, self._save_options, process_group=self.process_group,
                                     step=step, metadata=metadata, share=shared, reuse=reuse)
        except BaseException:
            self._pinned.discard(step)  # a save refused (an earlier one's failure, say) pins nothing
            self._undo_failed_saves(failed=True)  # every rank is past its failed commit (or never started)
            raise
        assert handle is not None
        self._sharing = handle if shared is not None else None
        self._committing = committing = futures.Future()
        handle.committed.add_done_callback(
            OneShot(functools.partial(self._committed_async, tag=tag, step=step, committing=committing)))
        return handle

    def _go_on_from(self, step: int) -> None:
        """The run goes on from ``step``, its local tier's saves first: the root's later checkpoints are set aside."""
        self.group.agree(lambda: self._deleter.submit(forking.fork, self.checkpoint_root, step,
                                                      self._still_the_writer).result() or b"")

    def _undo_failed_saves(self, failed: bool = False) -> None:
        """On the coordinator, with no save in flight: put back what failed saves set aside (``failed``: right
        after one, whose error stays the one raised; the next save or restore tries again)."""
        try:
            if self.group.is_coordinator and self.checkpoint_root.journaled:
                self._still_the_writer()
                self._deleter.submit(resaving.settle, self.checkpoint_root.storage, takeover=True).result()
                self.checkpoint_root.journaled = False
        except Exception as exc:
            if not failed:
                raise
            log.warning("left set aside under %s until the next save or restore: %s", self.root, exc)

    def _before_saving(self, step: int, tag: str) -> None:
        """Settle the last async save's commit; on the coordinator, undo failed saves (:mod:`~zerostall.roots.resaving`)
        and move checkpoints of later steps or of ``tag`` into ``.superseded/``. A failure refuses it on every rank."""
        try:
            self._settle_commit()
            if not self.group.is_coordinator:
                return
            self._undo_failed_saves()
            later = forking.later(self.checkpoint_root, step, tag)
            if later or tag in self.checkpoint_root.bare or tag_step(tag) is None:  # not while retention deletes
                self._still_the_writer()
                self._deleter.submit(forking.set_aside, self.checkpoint_root, later, step, tag).result()
        except Exception:
            SavePlanner.refuse(self.group)
            raise

    def _committed_async(self, fut: futures.Future, tag: str, step: int, committing: futures.Future) -> None:
        """Runs when an asynchronous save is done: commit it (latest, retention) if it succeeded."""
        try:
            self._pinned.discard(step)
            if fut.unseen_exception() is None:  # a failure stays the user's to see
                self.increments.committed(fut.unseen_result())
                self._commit(tag, step)
            else:
                self._undo_failed_saves(failed=True)
        except BaseException as exc:
            committing.set_exception(exc)  # raised once, by the next wait(), save() or close()
        else:
            committing.set_result(None)

    def _commit(self, tag: str, step: int | None) -> None:
        """After the checkpoint committed: point ``latest`` at it, then apply retention in the
        background. If ``latest`` cannot be written (a full disk), raise and delete nothing."""
        if not self.group.is_coordinator:
            return
        self._still_the_writer()
        try:
            self.checkpoint_root.write_latest(tag, step)
        except OSError as exc:  # `latest` still names the previous checkpoint, which must stay
            raise CheckpointError(f"{tag} is committed, but {self.checkpoint_root.where(LATEST_NAME)} could not be "
                                  f"pointed at it: {exc}") from exc
        self._pending_delete = self._deleter.submit(self._apply_retention, self._pending_delete)

    # -- reading -------------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[str, CheckpointRecord]]:
        """Committed checkpoints (tag, record), oldest step first (step-less: -1); each manifest's head parsed once."""
        return [(info.name, info.record()) for info in self.checkpoint_root.checkpoints()]

    def latest(self) -> str | None:
        """The newest committed checkpoint's tag, found by listing (the ``latest`` file mirrors it for other tools); a
        newer manifest that cannot be read is raised, a damaged one passed over with a warning (see ``newest``)."""
        return self.checkpoint_root.latest()

    def open(self, tag: str | int | None = None, **overrides: Any) -> Checkpoint | None:
        """Open ``tag`` (``None``/``"latest"``: the newest committed; a step: its) on every rank: rank 0 resolves,
        everyone opens the same one. ``None`` when nothing was committed yet; a named tag that does not exist
        raises :class:`CheckpointNotFoundError`. Close it (or use ``with``). Keywords override ``load_options``."""
        resolved = json.loads(self.group.agree(lambda: json.dumps(self.latest() if tag in (None, "latest")
                                                                  else checkpoint_name(tag)).encode()))
        if resolved is None:
            return None
        return self._checkpoint(resolved, LoadOptions.of(self.load_options, overrides))

    def _checkpoint(self, tag: str, options: LoadOptions) -> Checkpoint:
        """A read session on checkpoint ``tag`` of the root (its directory itself, never a root in it)."""
        try:
            ck = Checkpoint(self.checkpoint_root.child(tag), options, process_group=self.process_group)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {tag!r} under {self.root}") from None
        ck.tag = tag
        return ck

    def restore(self, state: Any, tag: str | int | None = None, *, fallback: bool = True, strict: bool | None = None,
                **overrides: Any) -> int | None:
        """Load the newest committed checkpoint (or ``tag``) into ``state`` in place (its python values and
        tuples replaced in the dict), RNG states included; returns its step, or ``None`` for a fresh start. It
        stays protected from retention; :attr:`last_restore` says what was restored.

        A damaged newest checkpoint (a checksum, a truncated or missing file) makes every rank fall back to
        the previous committed one, with a warning naming it and what failed; never past a ``tag`` asked for,
        nor over an I/O error. ``fallback=False`` raises instead. ``strict=False`` (default: the
        ``load_options``' own) resumes on another world size, leaving each rank's RNG and per-rank state as
        they are. Other keywords override fields of the manager's ``load_options``."""
        self.last_restore, tag = NOTHING, checkpoint_name(tag)  # until this restore says otherwise, even if it raises
        futures.wait([self._committing] if self._committing else [])  # the save in flight first (its failure stays)
        options = LoadOptions.of(self.load_options, {**overrides, **({} if strict is None else {"strict": strict})})
        named = tag not in (None, "latest")
        tiers, unreachable = self.tier is not None and not named, None
        try:  # the coordinator undoes failed saves first: a checkpoint one set aside is restored, not the one before
            candidates = json.loads(self.group.agree(lambda: json.dumps((self._undo_failed_saves(), [(tag, None, -1)]
                                                    if named else newest_first(self.checkpoint_root))[1]).encode()))
        except CheckpointError as exc:  # the local tier may do without the root
            if not tiers:
                raise
            candidates, unreachable = [], exc
        kept = PerRankCopy(None if options.strict else self._wrap)  # what another world size leaves as it is
        root = functools.partial(restore_first_whole, self.group, self.checkpoint_root, fallback=fallback, named=named,
                                 attempt=functools.partial(self._load, state, options, kept),
                                 record=functools.partial(setattr, self, "last_restore"))
        if self.tier is not None and tiers:  # the newest step of the root and the tiers together (and what they hold)
            kept.before_attempt(state, fills=True)  # the tiers' copies hold this layout's per-rank state
            info, loaded, seen = self.tier.restore(self._wrap(state), options, candidates, unreachable,
                                                   fallback=fallback, root=root)
            self.last_restore = info or self.last_restore
        else:
            loaded, seen = root(candidates), None
        if self.tier is not None:  # the run goes on from this step: the tier's newer steps are another timeline's
            self.tier.forget_after(self.last_restore.step if loaded is not None else None, seen)
            if loaded is not None and self.last_restore.step is not None and unreachable is None:
                self._go_on_from(self.last_restore.step)  # (a root that could not be listed: at its next save)
        if loaded is None:  # nothing committed yet
            return None
        for key in state.keys() & loaded.keys():  # python values and tuples are new objects: put them in place
            got = loaded[key]  # (per-rank state not loaded is left as it is)
            state[key] = got.value if isinstance(got, RankLocal) and not isinstance(state[key], RankLocal) else got
        self.loaders.after_load(state)
        if RNG_KEY in loaded:
            set_rng_state(loaded[RNG_KEY].value)
        step = self.last_restore.step
        if step is not None:
            self._pinned.add(step)
        return step

    def _load(self, state: Any, options: LoadOptions, kept: PerRankCopy, tag: str) -> tuple[int | None, Any]:
        """Load checkpoint ``tag`` into the tensors of ``state`` (per-rank state copied into ``kept``
        first, or put back from it); returns its step and the loaded state, which :meth:`restore` puts in place."""
        with self._checkpoint(tag, options) as ck:
            other = ck.manifest.world_size != self.group.size
            kept.before_attempt(state, fills=not other)
            wrapped = self._wrap(state)
            if other:  # per-rank state cannot go to ranks one to one
                per_rank, asked = [k for k, v in wrapped.items() if isinstance(v, RankLocal)], key_filter(options.keys)
                other_world(self.checkpoint_root.where(tag), ck.manifest.world_size, self.group, options.strict,
                            [k for k in per_rank if asked is None or asked(k)])
                for key in per_rank:  # each rank keeps its own
                    del wrapped[key]
            result = ck.load(wrapped, options)
        return ck.step, result[0] if isinstance(result, tuple) else result  # (state, Mismatch) when not strict

    def _wrap(self, state: Any) -> dict[str, Any]:
        if not isinstance(state, dict):
            raise TypeError("CheckpointManager saves a dict of named parts, e.g. {'model': m, 'optim': o}")
        wrapped = {k: rank_local(v) if k in self.rank_local_keys else v for k, v in state.items()}
        wrapped[RNG_KEY] = rank_local(rng_state())
        return wrapped

    # -- retention -----------------------------------------------------------------------------
    def _still_the_writer(self) -> None:
        """Raise unless this manager still holds the root's writer lease (see :class:`LeaseFence`)."""
        if self.lease is not None:
            self.lease.fence()()

    def _apply_retention(self, earlier: futures.Future[None] | None) -> None:
        """One round; an ``earlier`` round's failure (it is done: one thread runs them) is raised after it."""
        self._still_the_writer()
        kept = retained(self.checkpoint_root.checkpoints(), self.policy, self.increments.pinned(self._pinned))
        for tag in [tag for tag, rules in kept.items() if not rules]:
            self.checkpoint_root.delete(tag)
        self.checkpoint_root.collect_retained()
        if earlier is not None and (failed := earlier.exception()) is not None:
            raise failed

    def wait_staged(self) -> None:
        """Block until the save in flight (if any) has captured the state: call it before changing the state."""
        if self.tier is not None:
            self.tier.wait_staged()
        if self.saver is not None:
            self.saver.wait_staged()

    def wait(self) -> None:
        """Finish the saves in flight (replication to other nodes included) and the retention they triggered."""
        if self.tier is not None:
            self.tier.wait()
        if self.saver is not None:
            self.saver.wait()
        self._settle_commit()
        pending, self._pending_delete = self._pending_delete, None
        if pending is not None:
            pending.result()

    def _settle_commit(self) -> None:
        """Wait for the commit (``latest``, retention) of the last asynchronous save; its failure is raised here."""
        committing, self._committing = self._committing, None
        if committing is not None:
            committing.result()

    def close(self) -> None:
        """Finish pending work, stop background threads and give up the writer lease."""
        with contextlib.ExitStack() as stack:  # the steps below run last to first, whatever the others raise
            if self.lease is not None:
                stack.callback(self.lease.release)
            stack.callback(self._deleter.shutdown, wait=True)
            if self.saver is not None:
                stack.callback(self.saver.close)
            if self.tier is not None:
                stack.callback(self.tier.close)
            self.wait()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
