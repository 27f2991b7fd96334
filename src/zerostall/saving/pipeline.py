"""A save, stage by stage: collect → plan (the collective part) → write → commit.

:func:`prepare` runs in the caller's thread (planning may run collectives); :func:`request` lets a
saver's worker do most of it for one process (:class:`Deferred`); :func:`persist` needs no process
group, so it can run in a background thread or a writer process. Only once the
manifest is published are the files of older generations deleted, so a crash at any instant
leaves either the old or the new checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..collectives import Group
from ..errors import CheckpointError, UnsupportedValueError
from ..format import codec
from ..format.layout import manifest_tmp_name
from ..format.tensor_check import MAX_INT
from ..gcpause import gc_paused
from ..options import SaveOptions, default_threads
from ..storage import LocalStorage, S3Storage, Storage, storage_for
from ..storage.location import check_location, manifest_generation, publish_manifest
from ..storage.references import check_unreferenced, linked
from .collect import Collected, Version, WriteItem, collect, versions
from .incremental import Reuse, next_reuse, refer, split_unchanged
from .commit import (announce, assemble, await_commit, await_records, clean_up_after_commit, delete_generation,
                     open_doorbell, record, report_failure, write_abort, write_record)
from .plan import Plan, SavePlanner
from .recollect import CollectCache, Snapshot
from .write import create, write_data

log = logging.getLogger(__name__)

_PLANNER = SavePlanner()


@dataclass
class SaveInfo:
    """What one rank's save did: the checkpoint it committed and where the time went."""

    path: str
    generation: str
    step: int | None
    bytes_written: int
    replanned: bool
    collect_s: float
    plan_s: float
    write_s: float
    commit_s: float
    total_s: float
    reuse: Reuse | None = None
    """With ``incremental``: what the next save of this rank may refer to (its chunks, as committed)."""


@dataclass
class Prepared:
    """A save after its collective part: what this rank writes, under which generation, and how."""

    group: Group
    collected: Collected
    plan: Plan
    generation: str
    replanned: bool
    items: list[WriteItem]
    storage: Storage
    step: int | None
    metadata: Any
    options: SaveOptions
    collect_s: float
    plan_s: float
    reuse: Reuse | None = None
    versions: list[Version] | None = None  # with incremental: each item's version counter when it was collected


def prepare(state: Any, path: str | os.PathLike[str] | Storage, options: SaveOptions, *, process_group: Any = None,
            step: int | None = None, metadata: Mapping[str, Any] | None = None,
            cache: CollectCache | None = None, reuse: Reuse | None = None) -> Prepared:
    """Check the location, collect (through ``cache``, a saver's, when given) and plan a save
    (collective when distributed); no byte is written yet, and a rank that cannot take part makes
    every rank raise. ``reuse``: an incremental save's chunks to refer to where unchanged (a manager's)."""
    t0 = time.perf_counter()
    group = Group(process_group)
    storage = storage_for(path, fsync=options.fsync)
    with gc_paused():
        try:
            step, encoded = _settings(group, storage, options, step, metadata)
            collected = (collect if cache is None else cache.collect)(state, group.rank,
                                                                      allow_pickle=options.allow_pickle)
        except Exception:
            _PLANNER.refuse(group)
            raise
        return _planned(group, collected, storage, step, encoded, options, reuse, time.perf_counter() - t0)


def request(state: Any, path: str | os.PathLike[str] | Storage, options: SaveOptions, *, process_group: Any = None,
            step: int | None = None, metadata: Mapping[str, Any] | None = None, cache: CollectCache,
            reuse: Reuse | None = None, defer: bool = True) -> Prepared | Deferred:
    """:func:`prepare`; or, when ``defer``, for one process whose structure ``cache`` holds, only
    what must happen before the caller goes on (a :class:`Deferred`, whose :meth:`~Deferred.prepare`
    does the rest)."""
    group = Group(process_group)
    if group.size > 1 or not defer:
        return prepare(state, path, options, process_group=process_group, step=step, metadata=metadata,
                       cache=cache, reuse=reuse)
    t0 = time.perf_counter()
    storage = storage_for(path, fsync=options.fsync)
    with gc_paused():
        step, encoded = _settings(group, storage, options, step, metadata)
        snap = cache.snapshot(state, allow_pickle=options.allow_pickle)
        if snap is None:
            collected = cache.collect_anew(state, group.rank, allow_pickle=options.allow_pickle)
            return _planned(group, collected, storage, step, encoded, options, reuse, time.perf_counter() - t0)
    return Deferred(snap, cache, group, storage, step, encoded, options, reuse, time.perf_counter() - t0)


@dataclass
class Deferred:
    """A save of one process whose structure is unchanged, as :func:`request` leaves it: the
    state's leaves, their version counters and python values taken in the caller's thread
    (a :class:`~zerostall.saving.recollect.Snapshot`); collecting and planning wait for
    :meth:`prepare`, in a saver's worker, while the caller goes on."""

    snapshot: Snapshot
    cache: CollectCache
    group: Group
    storage: Storage
    step: int | None
    metadata: Any
    options: SaveOptions
    reuse: Reuse | None
    snapshot_s: float

    def prepare(self, copies: list[torch.Tensor] | None = None,
                recorded: list[Version] | None = None) -> tuple[Prepared, list[Version]]:
        """The save as :func:`prepare` makes it, and each item's version to compare after its copy
        (a change since the snapshot fails the save). With ``copies``: the tensor leaves of a
        snapshot that matches were copied there already, checked against their ``recorded`` versions."""
        t0 = time.perf_counter()
        with gc_paused():
            if copies is None:
                collected, recorded = self.cache.complete(self.snapshot, self.group.rank)
            else:
                collected = self.cache.from_copies(self.snapshot, self.group.rank, copies)
            assert recorded is not None
            prepared = _planned(self.group, collected, self.storage, self.step, self.metadata, self.options,
                                self.reuse, self.snapshot_s + time.perf_counter() - t0, recorded)
        return prepared, recorded


def _settings(group: Group, storage: Storage, options: SaveOptions, step: Any,
              metadata: Mapping[str, Any] | None) -> tuple[int | None, Any]:
    """The step and metadata as a manifest records them, once the location is checked (by the coordinator)."""
    step = checked_step(step)
    encoded = encoded_metadata(metadata, options.allow_pickle)  # a rank may pass it alone: refuse together
    if group.is_coordinator:
        check_location(storage, options.overwrite)
        if options.overwrite:
            check_unreferenced(storage)
    return step, encoded


def _fenced(storage: Storage, options: SaveOptions) -> Callable[[], None] | None:
    """``options.before_commit``, then (with ``overwrite``) the check, again, that no checkpoint
    beside ``storage`` refers to what it replaces: one may have committed since the save began."""
    if not options.overwrite:
        return options.before_commit

    def check() -> None:
        if options.before_commit is not None:
            options.before_commit()
        check_unreferenced(storage)
    return check


def _planned(group: Group, collected: Collected, storage: Storage, step: int | None, metadata: Any,
             options: SaveOptions, reuse: Reuse | None, collect_s: float,
             recorded: list[Version] | None = None) -> Prepared:
    """Plan a collected save (collective when distributed). ``recorded``: its items' versions, when
    taken earlier (an incremental save compares them with its last)."""
    t0 = time.perf_counter()
    plan, generation, replanned = _PLANNER.plan(group, collected)
    items = collected.items if group.size == 1 else [i for i in collected.items
                                                     if i.rank_local or plan.writes(group.rank, i.key)]
    if options.incremental and recorded is None:
        recorded = versions(items)
    return Prepared(group, collected, plan, generation, replanned, items, storage, step, metadata, options,
                    collect_s, time.perf_counter() - t0, reuse, recorded if options.incremental else None)


def checked_step(step: Any) -> int | None:
    """``step`` as the int a manifest records (numpy and 0-d tensor integers accepted), or None."""
    if step is None:
        return None
    try:
        value = operator.index(step) if not isinstance(step, bool) else -1
    except TypeError:
        value = -1
    if not 0 <= value <= MAX_INT:  # what a manifest may record
        raise UnsupportedValueError(f"step={step!r} is not a training step: pass an int in [0, 2**63) (or None)")
    return value


def encoded_metadata(metadata: Mapping[str, Any] | None, allow_pickle: bool) -> Any:
    """``metadata`` (a mapping, or None) as the manifest records it."""
    try:
        as_dict = dict(metadata or {})
    except (TypeError, ValueError):
        raise UnsupportedValueError(f"metadata of type {type(metadata).__name__} is not a mapping: pass a dict of "
                                    "what the checkpoint should record (or None)") from None
    return codec.encode(as_dict, where="metadata", allow_pickle=allow_pickle)


def for_writer_process(prepared: Prepared) -> Prepared:
    """A picklable copy of ``prepared`` for a writer process: no process group, no live tensors
    other than the (captured, shared-memory) items this rank writes, storage by location (a
    :class:`LocalStorage` pickles as its path and fsync setting, an :class:`S3Storage` as its URL
    and options)."""
    if not isinstance(prepared.storage, (LocalStorage, S3Storage)):
        raise CheckpointError(f"a writer process needs a local path or an s3:// URL, not {prepared.storage.location} "
                              f"({type(prepared.storage).__name__}): use writer='thread'")
    collected = dataclasses.replace(prepared.collected, items=[], optimizers=[])
    return dataclasses.replace(prepared, group=prepared.group.detached(), collected=collected)


def abandon(prepared: Prepared | Deferred, exc: BaseException) -> None:
    """This rank gives up a planned save before writing (its capture, or the handover to its writer
    process, failed): tell the other ranks now, through the storage and the doorbell they wait on,
    so that they stop waiting for it instead of waiting out ``commit_timeout``."""
    p = prepared
    if isinstance(p, Prepared) and p.group.size > 1:
        try:
            create(p.storage)
        except OSError:
            pass  # report_failure says so
        report_failure(p.storage, p.generation, p.group, exc, open_doorbell(p.group, p.storage, p.generation))
    p.storage.close()


def _in_place(storage: Storage) -> str | None:
    """The generation of the checkpoint in place, which the save replaces: the commit checks it is
    still there (see :func:`~zerostall.storage.location.publish_manifest`). One that cannot be read
    stops the save: taken for none, it would make that check fail, blaming another writer."""
    try:
        return manifest_generation(storage)
    except OSError as exc:
        raise CheckpointError(f"the manifest in place at {storage.location} cannot be read ({exc}): nothing was "
                              "saved, and the checkpoint there is untouched; save again once it reads") from exc


def _not_committed(storage: Storage, generation: str, group: Group, exc: BaseException, bell: Any) -> None:
    """After the coordinator's commit failed: the other ranks are told, and this rank's files
    removed, unless the manifest in place is this save's. When that manifest cannot be read (its
    publication's outcome unknown) the files stay: a later save's clean-up removes them if unused."""
    try:
        if manifest_generation(storage) == generation:
            return
        known = True
    except OSError as err:
        known = False
        log.warning("the save %s into %s failed and the manifest in place cannot be read (%s): its files are kept, "
                    "in case its commit took effect", generation, storage.location, err)
    if group.size > 1:
        write_abort(storage, generation, f"{type(exc).__name__}: {exc}", bell)
    if known:
        delete_generation(storage, generation, group.rank)
        storage.delete(manifest_tmp_name(generation))


def persist(prepared: Prepared) -> SaveInfo:
    """Write this rank's items and take part in the commit (see :mod:`zerostall.saving.commit`)."""
    p, group, storage, generation = prepared, prepared.group, prepared.storage, prepared.generation
    threads = p.options.threads or default_threads()
    t0 = time.perf_counter()
    bell = open_doorbell(group, storage, generation)
    try:
        previous = _in_place(storage) if group.is_coordinator else None
        create(storage)
        written, same = (p.items, []) if p.reuse is None else split_unchanged(p.items, p.versions, p.reuse, threads,
                                                                              p.options.block_size)
        files, headers = write_data(storage, written, generation, group.rank, threads, p.options.block_size)
        own = sum(files.values())
        refs = refer(same, p.reuse, files, headers) if p.reuse is not None else {}
        placed = [item.entry.chunks[-1] for item in p.items] if p.options.incremental else []  # before the
        # coordinator adds the other ranks' chunks to the same entries
        if not group.is_coordinator:
            with gc_paused():
                done = record(p.collected, p.plan, group.rank, files, headers, p.items, refs)
            write_record(storage, generation, group.rank, "done", done, bell)
    except BaseException as exc:
        delete_generation(storage, generation, group.rank)
        if group.size > 1:
            report_failure(storage, generation, group, exc, bell)
        storage.close()
        raise
    t_write = time.perf_counter()
    try:
        if group.is_coordinator:
            others = await_records(storage, generation, list(range(1, group.size)), p.options.commit_timeout, bell)
            with gc_paused():
                manifest = assemble(p.collected, p.plan, files, headers, others, generation, group.size, p.step,
                                    p.metadata, p.options.block_size, refs)
                linked(storage, manifest)  # every file referred to is still its owner's: else nothing commits
                publish_manifest(storage, manifest.generation, manifest.to_bytes(), previous,
                                 before_commit=_fenced(storage, p.options))
            announce(bell, "ok")
        else:
            await_commit(storage, generation, p.options.commit_timeout, bell)
    except BaseException as exc:
        if group.is_coordinator:
            _not_committed(storage, generation, group, exc, bell)
        storage.close()
        raise
    if group.is_coordinator:
        clean_up_after_commit(storage, generation, previous)
    storage.close()
    end = time.perf_counter()
    reuse = None
    if p.options.incremental:
        tag = storage.location.rstrip("/").rsplit("/", 1)[-1]
        reuse = next_reuse(tag, p.step, p.items, p.versions, placed, files, headers, refs)
    return SaveInfo(storage.location, generation, p.step, own, p.replanned, p.collect_s,
                    p.plan_s, t_write - t0, end - t_write, p.collect_s + p.plan_s + end - t0, reuse)
