"""Plan: who writes which chunk of the global state, cached per structure; replicas checked.

Every rank describes what it holds (a structure: one row per global leaf, no data); the rows of
all ranks are gathered once and every rank computes the same plan from them, so the plan needs no
further messages. Replicated chunks are written once, by the least-loaded rank that holds them.
A plan is cached under the digests of all ranks' structures: the next save of an unchanged
structure only checks, with one small collective, that every rank still proposes the same plan.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import xxhash

from ..balance import balance
from ..collectives import Group
from ..errors import StateMismatchError
from ..format import codec
from ..format.layout import dump_json, generation_id
from ..memory import owned_bytes
from ..state import fqn
from .collect import ChunkKey, Collected, Row


def structure_digest(rows: Sequence[Row]) -> int:
    """A 64-bit digest of a rank's structure: equal digests mean a cached plan still fits it."""
    fields = [(r.key, r.kind, r.dtype, r.shape, r.offsets, r.sizes, r.nbytes, r.alias_of, r.subclass) for r in rows]
    return xxhash.xxh3_64_intdigest(dump_json(fields))  # tuples, not dataclasses: serialized in C


@dataclass
class SavePlan:
    """Who writes which chunk, and the global entry table (in a rank-independent order)."""

    digests: tuple[int, ...]
    entries: list[Row]
    writers: dict[ChunkKey, int]
    holders: dict[ChunkKey, list[int]]
    bytes_per_rank: list[int]
    seed: int = 0  # the coordinator's random bits, drawn when the plan was made: part of generation ids

    def writes(self, rank: int, key: ChunkKey) -> bool:
        """Whether ``rank`` writes the chunk ``key``."""
        return self.writers.get(key) == rank


def build_plan(structures: Sequence[Sequence[Row]], digests: Sequence[int], seed: int = 0) -> SavePlan:
    """Dedup replicated chunks and balance their writing over their holders.

    Chunks are taken fewest holders first, then largest first, and each goes to its least-loaded
    holder by bytes (lowest rank on ties): deterministic, so every rank computes the same plan.
    Python values are written by their lowest-ranked holder; the description of a tensor subclass's
    box is written like a chunk (by one of the ranks holding that box). Raises ``ValueError`` naming
    the key when ranks disagree on a leaf's kind, dtype or global shape.
    """
    entries: dict[str, Row] = {}
    holders: dict[ChunkKey, list[int]] = {}
    sizes: dict[ChunkKey, int] = {}
    for rank, rows in enumerate(structures):
        for row in rows:
            first = entries.setdefault(row.key, row)
            if (first.kind, first.dtype, first.shape, first.alias_of, first.subclass) != \
                    (row.kind, row.dtype, row.shape, row.alias_of, row.subclass):
                raise ValueError(f"{row.key}: rank {rank} holds {_describe(row)}, another rank {_describe(first)}; "
                                 "mark per-rank values with zerostall.rank_local()")
            if row.kind != "alias":
                key = (row.key, row.offsets)
                holders.setdefault(key, []).append(rank)
                sizes[key] = row.nbytes
    keys = list(holders)
    order = sorted(range(len(keys)), key=lambda i: (len(holders[keys[i]]), -sizes[keys[i]], keys[i]))
    where, load = balance([sizes[k] for k in keys], len(structures), order=order, allowed=lambda i: holders[keys[i]])
    return SavePlan(tuple(digests), list(entries.values()), dict(zip(keys, where)), holders, load, seed)


def _describe(row: Row) -> str:
    if row.kind == "tensor":
        return f"a {row.dtype} tensor of shape {list(row.shape or ())}"
    if row.kind == "subclass":
        return f"a {row.subclass} tensor subclass ({row.dtype}) of shape {list(row.shape or ())}"
    return "an alias" if row.kind == "alias" else "a python value"


class SavePlanner:
    """Computes save plans and caches them per process group and structure (see :mod:`zerostall.saving.plan`).

    A save of a cached structure costs one all-reduce of three int64s, whatever the world size: each
    rank proposes the most recently used cached plan that fits its own structure (slot ``p``, 1-based;
    0 for none) and contributes ``p + p**2 << 32``; the sums ``S1 = sum(p)`` and ``S2 = sum(p**2)``
    satisfy ``S1**2 == world * S2`` exactly when every rank proposed the same slot, so agreement is
    exact, not probabilistic. The second lane carries the coordinator's clock for the generation id,
    the third the number of ranks that could not prepare the save (see :meth:`refuse`).
    Every rank's cache changes only on agreed outcomes, so slot numbers mean the same plan everywhere.
    """

    def __init__(self, cache_size: int = 8) -> None:
        self._caches: dict[Any, list[SavePlan]] = {}
        self._cache_size = cache_size
        self._alone = threading.Lock()  # one process's saves may plan in several savers' workers at once

    @staticmethod
    def refuse(group: Group) -> None:
        """Take part in the first planning collective as a rank that cannot save: every rank then
        raises, where the others would wait for this one in the collective for good."""
        group.all_reduce_or_fail([0, 0], "", failed=True)

    def plan(self, group: Group, collected: Collected) -> tuple[SavePlan, str, bool]:
        """The plan, the generation id every rank uses, and whether planning ran (not cached)."""
        if group.size > 1:  # the caller's thread, which alone runs this group's collectives
            return self._plan(group, collected)
        with self._alone:
            return self._plan(group, collected)

    def _plan(self, group: Group, collected: Collected) -> tuple[SavePlan, str, bool]:
        cache = self._caches.setdefault(group.pg, [])
        digest = collected.digest if collected.digest is not None else structure_digest(collected.rows)
        slot = next((n for n, p in enumerate(cache, 1) if p.digests[group.rank] == digest), 0)
        clock = time.time_ns() if group.is_coordinator else 0
        proposals, clock = group.all_reduce_or_fail(
            [slot + (slot * slot << 32), clock], "{failed} other rank(s) could not prepare this "
            "save (their errors say why); nothing was written")
        s1, s2 = proposals & 0xFFFFFFFF, proposals >> 32
        if s1 and s1 * s1 == group.size * s2:
            plan = cache.pop(s1 // group.size - 1)
            cache.insert(0, plan)
            return plan, generation_id(clock, plan.seed), False
        gathered = group.all_gather_object((collected.rows, secrets.randbits(32)))
        structures = [rows for rows, _ in gathered]
        try:
            plan = build_plan(structures, [structure_digest(rows) for rows in structures], seed=gathered[0][1])
        except ValueError as exc:
            raise StateMismatchError(str(exc)) from None
        check_replicas(group, plan, collected)
        cache.insert(0, plan)
        del cache[self._cache_size:]
        return plan, generation_id(clock, plan.seed), True


def check_replicas(group: Group, plan: SavePlan, collected: Collected) -> None:
    """On a structure's first save, check by checksum that every replica holds the same value."""
    if group.size == 1:
        return
    mine: dict[ChunkKey, int] = {}
    for item in collected.items:
        if not item.rank_local and len(plan.holders[item.key]) > 1:
            mine[item.key] = xxhash.xxh3_64_intdigest(owned_bytes(item.tensor.cpu()))
    for key, encoded in collected.objects.items():
        if len(plan.holders[(key, ())]) > 1:
            mine[(key, ())] = xxhash.xxh3_64_intdigest(json.dumps(encoded, sort_keys=True).encode())
    for chunk, shard in collected.shards.items():  # a replicated box of a tensor subclass: its context too
        if len(plan.holders[chunk]) > 1:
            mine[chunk] = xxhash.xxh3_64_intdigest(json.dumps(shard, sort_keys=True).encode())
    everyone = group.all_gather_object(mine)
    bad = sorted({key for d in everyone for key, h in d.items() if any(o.get(key, h) != h for o in everyone)})
    if bad:
        names = ", ".join(fqn(codec.decode_path(json.loads(k))) + (f" (box at {list(o)})" if o else "") for k, o in bad)
        raise StateMismatchError(f"replicas disagree on {names}: ranks hold different values for a leaf that is "
                                 "not sharded; make them equal or mark it with zerostall.rank_local()")
