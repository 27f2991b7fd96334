"""Commit: the records of every rank, the manifest assembled and published, old files cleaned up.

The commit runs no collective, so it never hangs on a dead rank and runs from background writers
that are not members of the training process group. Each rank writes its data files, then a small
``done`` record (its files, chunks and checksums). The coordinator waits for every record,
assembles the manifest and publishes it (the commit point), then deletes the files no manifest
references any more; the other ranks wait for the coordinator's word. A rank that fails writes a
``failed`` record; the coordinator then writes an ``abort`` record, and every waiter gives up at
once. A rank that dies writes nothing: everyone gives up when the timeout expires.

Waiting costs no storage request while the slowest rank writes: the ranks ring and wait through the
process group's store (:mod:`zerostall.doorbell`), and look at the storage only now and then (after
10 s, 30 s, 70 s...: in case a rank could not reach the store). Without a reachable store they
poll the storage with exponential backoff.
"""

from __future__ import annotations

import json
import logging
import operator
import time
from typing import Any

from ..collectives import Group
from ..doorbell import Doorbell, Unreachable
from ..errors import CommitError
from ..format import codec, subclass
from ..format.layout import (Chunk, Entry, Manifest, abort_name, dump_json, generation_time, load_json, parse_record,
                             record_name)
from ..state import fqn
from ..storage import Storage
from ..storage.location import manifest_generation, remove_stale
from .collect import Collected, WriteItem, path_key
from .plan import Plan

log = logging.getLogger(__name__)

_FIRST_POLL = 0.002  # seconds between storage polls without a store: doubling up to the cap
_MAX_POLL = 0.1  # on local storage
_MAX_REMOTE_POLL = 1.0  # on an object store, where each poll is a billed request
_FIRST_CHECK = 10.0  # seconds of waiting on the store before a look at the storage: doubling up to the cap
_MAX_CHECK = 120.0


def open_doorbell(group: Group, storage: Storage, generation: str) -> Doorbell | None:
    """The store through which the ranks of this save ring and wait, or None (poll the storage)."""
    return Doorbell.open(group.store, group.size, storage.location, generation)


def write_record(storage: Storage, generation: str, rank: int, kind: str, payload: dict[str, Any],
                 bell: Doorbell | None = None) -> None:
    """This rank's ``done`` or ``failed`` record, then the doorbell rung (when there is one)."""
    storage.put(record_name(generation, rank, kind), dump_json(payload))
    if kind == "done":
        _ring(bell, rank, None)


def _ring(bell: Doorbell | None, rank: int, failure: str | None) -> None:
    if bell is not None:
        try:
            bell.ring(rank, failure)
        except Unreachable as exc:
            log.warning("could not ring the commit doorbell (the coordinator will find the record): %s", exc)


def write_abort(storage: Storage, generation: str, reason: str, bell: Doorbell | None = None) -> None:
    """Tell every waiting rank that this generation will never commit (best effort)."""
    try:
        storage.put(abort_name(generation), reason.encode())
    except OSError:
        pass
    announce(bell, f"abort:{reason}")


def announce(bell: Doorbell | None, verdict: str) -> None:
    """The coordinator's verdict on the doorbell (best effort: waiters also look at the storage)."""
    if bell is not None:
        try:
            bell.announce(verdict)
        except Unreachable as exc:
            log.warning("could not announce the commit on the doorbell (waiters will find the manifest): %s", exc)


class _Waiting:
    """The schedule of one wait: the store in slices (a storage check after each), or storage polls."""

    def __init__(self, storage: Storage, bell: Doorbell | None, timeout: float) -> None:
        self.bell, self.deadline = bell, time.monotonic() + timeout
        self.delay, self.slice = _FIRST_POLL, _FIRST_CHECK
        self.cap = _MAX_REMOTE_POLL if storage.remote else _MAX_POLL

    def ring(self, key: str) -> bool:
        """Wait on the doorbell for ``key`` for the next slice; False once it is time to look at the storage."""
        if self.bell is None:
            return False
        try:
            rang = self.bell.wait(key, min(self.slice, max(self.deadline - time.monotonic(), 0.0)))
        except Unreachable as exc:
            log.warning("the commit doorbell is unreachable; polling the storage: %s", exc)
            self.bell = None
            return False
        self.slice = min(2 * self.slice, _MAX_CHECK)
        return rang

    def drop(self) -> None:
        """Stop waiting on the doorbell: it rang without a decision (poll the storage instead)."""
        self.bell = None

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def pause(self) -> None:
        """Between storage polls without a doorbell: exponential backoff."""
        if self.bell is None:
            time.sleep(self.delay)
            self.delay = min(2 * self.delay, self.cap)


def await_records(storage: Storage, generation: str, ranks: list[int], timeout: float,
                  bell: Doorbell | None = None) -> dict[int, dict[str, Any]]:
    """The ``done`` records of ``ranks``; raises :class:`CommitError` on a failure or the timeout."""
    if not ranks:
        return {}
    waiting = _Waiting(storage, bell, timeout)
    wanted = set(ranks)
    while True:
        if waiting.ring("ready"):
            done, failed = _records_rung(waiting, ranks)
        else:
            done, failed = _records_listed(storage, generation, wanted)
        if failed:
            raise CommitError("save failed on " + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))
        if done == wanted:
            if waiting.bell is not None:
                waiting.bell.forget_ranks(ranks)
            return {r: load_json(storage.read_bytes(record_name(generation, r, "done"))) for r in sorted(wanted)}
        if waiting.expired():
            raise CommitError(f"ranks {sorted(wanted - done)} did not finish writing within {timeout:.0f} s "
                              f"(dead or stuck); the save of generation {generation} is abandoned")
        waiting.pause()


def _records_rung(waiting: _Waiting, ranks: list[int]) -> tuple[set[int], dict[int, str]]:
    """The ranks that said on the doorbell they are done, and the reasons of those that failed; a
    doorbell that rang without a decision is dropped (the storage is polled instead)."""
    try:
        said = waiting.bell.outcomes(ranks)  # type: ignore[union-attr]
    except Unreachable:
        said = {}
    done = {r for r, m in said.items() if m == "done"}
    failed = {r: m.removeprefix("failed:") for r, m in said.items() if m != "done"}
    if not failed and len(done) < len(ranks):
        waiting.drop()
    return done, failed


def _records_listed(storage: Storage, generation: str, wanted: set[int]) -> tuple[set[int], dict[int, str]]:
    """The ranks of ``wanted`` whose ``done`` record is in the storage, and the reasons of those that failed."""
    done, failed = set(), {}
    for name in storage.list():
        parsed = parse_record(name)
        if parsed is None or parsed[0] != generation or parsed[1] not in wanted:
            continue
        if parsed[2] == "done":
            done.add(parsed[1])
        elif parsed[2] == "failed":
            failed[parsed[1]] = _failure_reason(storage.read_bytes(name))
    return done, failed


def _failure_reason(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")


def await_commit(storage: Storage, generation: str, timeout: float, bell: Doorbell | None = None) -> None:
    """Wait until the manifest of ``generation`` is in place; raises on abort or the timeout."""
    waiting = _Waiting(storage, bell, timeout)
    while True:
        if waiting.ring("verdict"):
            try:
                verdict = waiting.bell.verdict()  # type: ignore[union-attr]
            except Unreachable:
                verdict = ""
            if verdict == "ok":
                return
            if verdict.startswith("abort:"):
                raise CommitError(f"the save was aborted by the coordinator: {verdict.removeprefix('abort:')}")
            waiting.drop()
        if _committed(storage, generation):
            return
        try:
            reason = storage.read_bytes(abort_name(generation)).decode(errors="replace")
        except FileNotFoundError:
            reason = None
        if reason is not None:
            raise CommitError(f"the save was aborted by the coordinator: {reason}")
        if waiting.expired():
            raise CommitError(f"no commit of generation {generation} within {timeout:.0f} s (coordinator dead or "
                              "stuck): this rank gave up, but a coordinator that is only slow may still commit it "
                              "(this rank's files are kept): raise commit_timeout for slow storage")
        waiting.pause()


def report_failure(storage: Storage, generation: str, group: Group, exc: BaseException,
                   bell: Doorbell | None = None) -> None:
    """Make the other ranks give up now instead of at the timeout (best effort)."""
    reason = f"{type(exc).__name__}: {exc}"
    if group.is_coordinator:
        write_abort(storage, generation, reason, bell)
        return
    try:
        write_record(storage, generation, group.rank, "failed", {"error": reason})
    except OSError:
        log.warning("could not record the failure of rank %d in %s", group.rank, storage.location)
    _ring(bell, group.rank, reason)


def record(collected: Collected, plan: Plan, rank: int, files: dict[str, int], headers: dict[str, str],
           written: list[WriteItem], refs: dict[str, str]) -> dict[str, Any]:
    """This rank's ``done`` record: its files (sizes, header checksums; those of other checkpoints
    it refers to, with their owners), the chunks it saved (as in a manifest: arrays naming a file
    by its place in ``files``) and the values it owns."""
    index = {name: i for i, name in enumerate(files)}
    return {
        "rank": rank,
        "files": files,
        "headers": headers,
        "refs": refs,
        "chunks": [[i.key[0], i.entry.chunks[-1].to_array(index)] for i in written if not i.rank_local],
        "objects": [[k, v] for k, v in collected.objects.items() if plan.writes(rank, (k, ()))],
        "shards": [[k, shard] for (k, o), shard in collected.shards.items() if plan.writes(rank, (k, o))],
        "rank_local": [e.to_json(index) for e in collected.rank_local],
    }


def assemble(collected: Collected, plan: Plan, files: dict[str, int], headers: dict[str, str],
             records: dict[int, dict[str, Any]], generation: str, world_size: int, step: int | None, metadata: Any,
             block_size: int, refs: dict[str, str]) -> Manifest:
    """The coordinator builds the manifest from the plan, its own entries (which already hold the
    chunks it wrote) and the other ranks' records."""
    entries: list[Entry] = []
    index: dict[tuple[str, int | None], int] = {}
    paths = {key: path for path, key in collected.keys.items()}
    for row in plan.entries:
        entry = collected.entries.get(row.key)
        if entry is None:
            path = paths.get(row.key) or codec.decode_path(json.loads(row.key))
            entry = Entry(fqn(path), path, row.kind, dtype=row.dtype, shape=row.shape, cls=row.subclass,
                          shards=[] if row.kind == "subclass" else None)
        index[(row.key, None)] = len(entries)
        entries.append(entry)
    for row, entry in zip(plan.entries, entries):
        if row.kind == "alias":
            entry.alias_of = index[(row.alias_of or "", None)]
    for key, value in collected.objects.items():
        if plan.writes(0, (key, ())):
            entries[index[(key, None)]].value = value
    for (key, offsets), shard in collected.shards.items():
        if plan.writes(0, (key, offsets)):
            entries[index[(key, None)]].shards.append(shard)  # type: ignore[union-attr]
    for entry in collected.rank_local:
        index[(path_key(entry.path), 0)] = len(entries)
        entries.append(entry)
    files, headers, refs = dict(files), dict(headers), dict(refs)
    for rank, record in sorted(records.items()):
        files.update(record["files"])
        headers.update(record["headers"])
        refs.update(record.get("refs", {}))
        names = list(record["files"])
        for key, chunk in record["chunks"]:
            entries[index[(key, None)]].chunks.append(Chunk.from_json(chunk, names))
        for key, value in record["objects"]:
            entries[index[(key, None)]].value = value
        for key, shard in record.get("shards", ()):
            entries[index[(key, None)]].shards.append(shard)  # type: ignore[union-attr]
        for data in record["rank_local"]:
            entry = Entry.from_json(data, names)
            index[(path_key(entry.path), rank)] = len(entries)
            entries.append(entry)
    for entry in entries:
        if len(entry.chunks) > 1:
            entry.chunks.sort(key=operator.attrgetter("offsets"))
    subclass.link(entries, lambda key, rank: index[(key, rank)])
    for path, ref in collected.refs.items():
        key = collected.keys[path]
        ref.index = index.get((key, None), index.get((key, 0), -1))
    return Manifest(generation=generation, entries=entries, files=files, tree=codec.encode(collected.skeleton),
                    world_size=world_size, block_size=block_size, step=step, metadata=metadata, headers=headers,
                    refs=refs)


def _committed(storage: Storage, generation: str) -> bool:
    """Whether the manifest in place is ``generation``'s; a read that fails is a no (the wait goes on)."""
    try:
        return manifest_generation(storage) == generation
    except OSError as exc:
        log.debug("could not read the manifest in %s while waiting for the commit: %s", storage.location, exc)
        return False


def delete_generation(storage: Storage, generation: str, rank: int) -> None:
    """Remove this rank's files of a save that did not commit (best effort: an unreachable storage
    must not hide why the save failed; a later save or the manager's clean-up removes them)."""
    own = f"{generation}-r{rank:05d}"
    try:
        names = storage.list()
    except OSError as exc:
        log.warning("could not list %s to remove the files of the failed save: %s", storage.location, exc)
        return
    for name in names:
        if name.startswith(own):
            try:
                storage.delete(name)
            except OSError:
                log.warning("could not remove %s of the failed save in %s", name, storage.location)


def clean_up_after_commit(storage: Storage, keep: str, replaced: str | None) -> None:
    """After a commit, remove the files of older generations (no manifest references them any
    more), of the generation the commit ``replaced`` (whatever its date: a writer's clock may
    have run ahead) and the commit records of this one, and abort the unfinished uploads of
    those generations (a save that crashed, or one still in flight, whose commit will be refused:
    the manifest it found has changed) and of this one (its files were complete at its commit).
    Other newer generations may belong to a save still in flight, so they stay. The routine is the
    copy's too (:func:`~zerostall.storage.location.remove_stale`)."""
    remove_stale(storage, keep, lambda gen: gen == replaced or generation_time(gen) <= generation_time(keep))
