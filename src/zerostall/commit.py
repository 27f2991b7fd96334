"""The commit across ranks, through storage only: no collective, so no hang on a dead rank.

Each rank writes its data files, then a small ``done`` record (its files, chunks and checksums).
The coordinator waits for every record, writes the manifest (the commit point) and cleans up;
the other ranks wait for a manifest of their generation to appear. A rank that fails writes a
``failed`` record; the coordinator then writes an ``abort`` record, and every waiter gives up at
once. A rank that dies writes nothing: everyone gives up when the timeout expires.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from .errors import CheckpointError
from .format import MANIFEST_NAME, abort_name, dump_json, load_json, parse_record, record_name
from .storage import Storage

_FIRST_POLL = 0.002
_MAX_POLL = 0.1
_GENERATION_RE = re.compile(rb'"generation":"([0-9a-f]+-[0-9a-f]+)"')


class CommitError(CheckpointError):
    """The save did not commit: a rank failed, died or timed out."""


def _put(storage: Storage, name: str, data: bytes) -> None:
    """Publish a small file atomically: a reader polling for it never sees it half-written."""
    storage.publish(name, f"{name}.tmp", data)


def write_record(storage: Storage, generation: str, rank: int, kind: str, payload: dict[str, Any]) -> None:
    _put(storage, record_name(generation, rank, kind), dump_json(payload))


def write_abort(storage: Storage, generation: str, reason: str) -> None:
    """Tell every waiting rank that this generation will never commit (best effort)."""
    try:
        _put(storage, abort_name(generation), reason.encode())
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


def manifest_generation(storage: Storage) -> str | None:
    """The generation named by the manifest in place, read from its first bytes only."""
    try:
        head = storage.read_head(MANIFEST_NAME, 256)
    except OSError:
        return None
    match = _GENERATION_RE.search(head)
    return match.group(1).decode() if match else None
