"""Commit: the records of every rank, the manifest assembled and published, old files cleaned up.

The commit runs through storage only, no collective, so it never hangs on a dead rank and runs
from background writers that are not members of the training process group. Each rank writes its
data files, then a small ``done`` record (its files, chunks and checksums). The coordinator waits
for every record, assembles the manifest and publishes it (the commit point), then deletes the
files no manifest references any more;
the other ranks wait for a manifest of their generation to appear. A rank that fails writes a
``failed`` record; the coordinator then writes an ``abort`` record, and every waiter gives up at
once. A rank that dies writes nothing: everyone gives up when the timeout expires.
"""

from __future__ import annotations

import json
import logging
import operator
import time
from typing import Any, Callable

from . import codec, subclass
from .collect import Collected, WriteItem, path_key
from .collectives import Group
from .errors import CommitError
from .format import (Chunk, Entry, Manifest, abort_name, dump_json, file_generation, generation_time,
                     load_json, parse_record, record_name)
from .location import publish_manifest
from .opening import manifest_generation
from .plan import SavePlan
from .state import fqn
from .storage import Storage

log = logging.getLogger(__name__)

_FIRST_POLL = 0.002
_MAX_POLL = 0.1


def write_record(storage: Storage, generation: str, rank: int, kind: str, payload: dict[str, Any]) -> None:
    storage.put(record_name(generation, rank, kind), dump_json(payload))


def write_abort(storage: Storage, generation: str, reason: str) -> None:
    """Tell every waiting rank that this generation will never commit (best effort)."""
    try:
        storage.put(abort_name(generation), reason.encode())
    except OSError:
        pass


def _sleep(delay: float) -> float:
    time.sleep(delay)
    return min(delay * 2, _MAX_POLL)


def await_records(storage: Storage, generation: str, ranks: list[int], timeout: float) -> dict[int, dict[str, Any]]:
    """The ``done`` records of ``ranks``; raises :class:`CommitError` on a failure or the timeout."""
    deadline = time.monotonic() + timeout
    delay = _FIRST_POLL
    wanted = set(ranks)
    while True:
        done, failed = set(), {}
        for name in storage.list():
            parsed = parse_record(name)
            if parsed is None or parsed[0] != generation or parsed[1] not in wanted:
                continue
            if parsed[2] == "done":
                done.add(parsed[1])
            elif parsed[2] == "failed":
                failed[parsed[1]] = _failure_reason(storage.read_bytes(name))
        if failed:
            raise CommitError("save failed on " + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))
        if done == wanted:
            return {r: load_json(storage.read_bytes(record_name(generation, r, "done"))) for r in sorted(wanted)}
        if time.monotonic() > deadline:
            raise CommitError(f"ranks {sorted(wanted - done)} did not finish writing within {timeout:.0f} s "
                              f"(dead or stuck); the save of generation {generation} is abandoned")
        delay = _sleep(delay)


def _failure_reason(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")


def await_commit(storage: Storage, generation: str, timeout: float) -> None:
    """Wait until the manifest of ``generation`` is in place; raises on abort or the timeout."""
    deadline = time.monotonic() + timeout
    delay = _FIRST_POLL
    while True:
        if manifest_generation(storage) == generation:
            return
        try:
            reason = storage.read_bytes(abort_name(generation)).decode(errors="replace")
        except FileNotFoundError:
            reason = None
        if reason is not None:
            raise CommitError(f"the save was aborted by the coordinator: {reason}")
        if time.monotonic() > deadline:
            raise CommitError(f"no commit of generation {generation} within {timeout:.0f} s (coordinator dead or stuck)")
        delay = _sleep(delay)


def report_failure(storage: Storage, generation: str, group: Group, exc: BaseException) -> None:
    """Make the other ranks give up now instead of at the timeout (best effort)."""
    reason = f"{type(exc).__name__}: {exc}"
    try:
        if group.is_coordinator:
            write_abort(storage, generation, reason)
        else:
            write_record(storage, generation, group.rank, "failed", {"error": reason})
    except OSError:
        log.warning("could not record the failure of rank %d in %s", group.rank, storage.location)


def record(collected: Collected, plan: SavePlan, rank: int, files: dict[str, int], headers: dict[str, str],
           written: list[WriteItem]) -> dict[str, Any]:
    """This rank's ``done`` record: its files (sizes, header checksums), the chunks it wrote and
    the values it owns."""
    return {
        "rank": rank,
        "files": files,
        "headers": headers,
        "chunks": [[i.key[0], i.entry.chunks[-1].to_json()] for i in written if not i.rank_local],
        "objects": [[k, v] for k, v in collected.objects.items() if plan.writes(rank, (k, ()))],
        "shards": [[k, shard] for (k, o), shard in collected.shards.items() if plan.writes(rank, (k, o))],
        "rank_local": [e.to_json() for e in collected.rank_local],
    }


def assemble(collected: Collected, plan: SavePlan, files: dict[str, int], headers: dict[str, str],
             records: dict[int, dict[str, Any]], generation: str, world_size: int, step: int | None, metadata: Any,
             block_size: int) -> Manifest:
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
    files, headers = dict(files), dict(headers)
    for rank, record in sorted(records.items()):
        files.update(record["files"])
        headers.update(record["headers"])
        for key, chunk in record["chunks"]:
            entries[index[(key, None)]].chunks.append(Chunk.from_json(chunk))
        for key, value in record["objects"]:
            entries[index[(key, None)]].value = value
        for key, shard in record.get("shards", ()):
            entries[index[(key, None)]].shards.append(shard)  # type: ignore[union-attr]
        for data in record["rank_local"]:
            entry = Entry.from_json(data)
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
                    world_size=world_size, block_size=block_size, step=step, metadata=metadata, headers=headers)


def publish(storage: Storage, manifest: Manifest, previous: str | None,
            before_commit: Callable[[], None] | None = None) -> None:
    """Publish the assembled manifest (see :func:`zerostall.location.publish_manifest`)."""
    publish_manifest(storage, manifest.generation, manifest.to_bytes(), previous, before_commit=before_commit)


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
    have run ahead) and the commit records of this one. Other newer generations may belong to
    a save still in flight, so they stay."""
    for name in storage.list():
        gen = file_generation(name)
        older = gen is not None and gen != keep and (gen == replaced or generation_time(gen) <= generation_time(keep))
        if older or (gen == keep and parse_record(name) is not None):
            try:
                storage.delete(name)
            except OSError as exc:
                log.warning("could not remove stale %s in %s: %s", name, storage.location, exc)
