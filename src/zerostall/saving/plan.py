"""Plan: who writes which chunk of the global state, cached per structure; replicas checked.

Every rank describes what it holds (a structure: one row per global leaf, no data). When every rank
holds the same leaves in regular layouts (DTensors, whole tensors, python values), which one
all-reduce of the structure's rank-independent digest establishes, each rank plans alone by rule
(:func:`grid_plan`): no rows travel, whatever the world size. Otherwise the rows of all ranks are
gathered once and every rank computes the same plan from them (:func:`build_plan`), so the plan
needs no further messages. Either way a replicated chunk is written once. A plan is cached under
this rank's structure digest: the next save of an unchanged structure only checks, with one small
collective, that every rank still proposes the same plan.
"""

from __future__ import annotations

import bisect
import json
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
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
    fields = [(r.key, r.kind, r.dtype, r.shape, r.offsets, r.sizes, r.nbytes, r.alias_of, r.subclass, r.grid)
              for r in rows]
    return xxhash.xxh3_64_intdigest(dump_json(fields))  # tuples, not dataclasses: serialized in C


def regular_digest(rows: Sequence[Row], world: int) -> int | None:
    """A 64-bit digest of the structure without this rank's part in it, when a rank can plan it alone:
    every tensor a DTensor over a mesh of all ``world`` ranks (``Row.grid``) or a whole tensor, no
    tensor subclass. Equal on every rank means all hold the same leaves, in the same layouts. None
    otherwise (the rows must then be gathered)."""
    fields = []
    for r in rows:
        if r.grid is not None:
            if r.grid[3] != world or not math.prod(r.shape or ()):  # a sub-mesh; an empty DTensor: boxes shared
                return None
            fields.append((r.key, r.kind, r.dtype, r.shape, r.grid[0]))
        elif r.kind == "subclass" or (r.kind == "tensor" and (any(r.offsets) or r.sizes != r.shape)):
            return None
        else:
            fields.append((r.key, r.kind, r.dtype, r.shape, r.alias_of))
    return xxhash.xxh3_64_intdigest(dump_json(fields))


def _named(key: str, box: str = "") -> str:
    return fqn(codec.decode_path(json.loads(key))) + box


@dataclass
class SavePlan:
    """Who writes which chunk, and the global entry table (in a rank-independent order); made from
    every rank's rows (see :func:`build_plan`)."""

    digests: tuple[int, ...]
    entries: list[Row]
    writers: dict[ChunkKey, int]
    slots: dict[ChunkKey, int]  # each chunk several ranks hold: its place in the replica check
    seed: int = 0  # the coordinator's random bits, drawn when the plan was made: part of generation ids

    @property
    def slot_count(self) -> int:
        """The replica check's slots, on every rank."""
        return len(self.slots)

    def writes(self, rank: int, key: ChunkKey) -> bool:
        """Whether ``rank`` writes the chunk ``key``."""
        return self.writers.get(key) == rank

    def fits(self, rank: int, digest: int) -> bool:
        """Whether the plan was made for ``rank``'s structure of ``digest``."""
        return self.digests[rank] == digest

    def slot_name(self, slot: int) -> str:
        """The leaf (and box) of a replica-check slot, for an error."""
        key, offsets = next(k for k, s in self.slots.items() if s == slot)
        return _named(key, f" (box at {list(offsets)})" if offsets else "")


@dataclass
class GridPlan:
    """One rank's part of a plan it made alone (see :func:`grid_plan`): the chunks it writes, and the
    replica-check slots of those of its chunks that other ranks hold too."""

    rank: int
    digest: int
    entries: list[Row]
    mine: set[ChunkKey]
    slots: dict[ChunkKey, int]  # this rank's chunks that several ranks hold: their places in the replica check
    slot_rows: list[tuple[int, str, int]]  # each replicated leaf's first slot, key and number of boxes
    seed: int = 0

    @property
    def slot_count(self) -> int:
        """The replica check's slots, on every rank (every replicated leaf's boxes)."""
        return self.slot_rows[-1][0] + self.slot_rows[-1][2] if self.slot_rows else 0

    def writes(self, rank: int, key: ChunkKey) -> bool:
        """Whether ``rank`` (this plan's) writes the chunk ``key``."""
        return rank == self.rank and key in self.mine

    def fits(self, rank: int, digest: int) -> bool:
        """Whether the plan was made for ``rank``'s structure of ``digest``."""
        return rank == self.rank and self.digest == digest

    def slot_name(self, slot: int) -> str:
        """The leaf (and box) of a replica-check slot, for an error."""
        first, key, boxes = self.slot_rows[bisect.bisect_right([f for f, _, _ in self.slot_rows], slot) - 1]
        return _named(key, f" (box {slot - first} of {boxes})" if boxes > 1 else "")


Plan = SavePlan | GridPlan


def grid_plan(rows: Sequence[Row], rank: int, world: int, digest: int, seed: int = 0) -> GridPlan:
    """This rank's plan of a structure every rank holds alike (equal :func:`regular_digest`), by rule.

    A box held by several ranks (a DTensor's along its replicated mesh dimensions; a whole tensor or
    a value, by every rank) is written by one of them, balanced over them by bytes (:func:`balance`)
    among the leaves of the same layout: every holder of such a box holds the same boxes of that
    layout, so all compute the same choice. An empty box of a DTensor is written by none (the
    others cover the tensor). Each replicated leaf's boxes take consecutive replica-check slots.
    """
    mine: set[ChunkKey] = set()
    slots: dict[ChunkKey, int] = {}
    slot_rows: list[tuple[int, str, int]] = []
    layouts: dict[int | None, list[Row]] = {}  # a layout's id (None: every rank holds it) -> its shared leaves
    count = 0
    for row in rows:
        if row.kind == "alias":
            continue
        copies, boxes, box = (row.grid[1], row.grid[3] // row.grid[1], row.grid[4]) if row.grid else (world, 1, 0)
        if copies > 1:
            slot_rows.append((count, row.key, boxes))
            count += boxes
        if row.grid is not None and not math.prod(row.sizes):
            continue
        if copies == 1:
            mine.add((row.key, row.offsets))
        else:
            slots[(row.key, row.offsets)] = count - boxes + box
            layouts.setdefault(row.grid[0] if row.grid is not None else None, []).append(row)
    for same in layouts.values():
        copies, position = (same[0].grid[1], same[0].grid[2]) if same[0].grid is not None else (world, rank)
        where, _ = balance([row.nbytes for row in same], copies)
        mine.update((row.key, row.offsets) for row, b in zip(same, where) if b == position)
    return GridPlan(rank, digest, list(rows), mine, slots, slot_rows, seed)


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
    where, _ = balance([sizes[k] for k in keys], len(structures), order=order, allowed=lambda i: holders[keys[i]])
    slots = {key: n for n, key in enumerate(sorted(k for k in keys if len(holders[k]) > 1))}
    return SavePlan(tuple(digests), list(entries.values()), dict(zip(keys, where)), slots, seed)


def _describe(row: Row) -> str:
    if row.kind == "tensor":
        return f"a {row.dtype} tensor of shape {list(row.shape or ())}"
    if row.kind == "subclass":
        return f"a {row.subclass} tensor subclass ({row.dtype}) of shape {list(row.shape or ())}"
    return "an alias" if row.kind == "alias" else "a python value"


def _lanes(value: int | None) -> list[int]:
    """``value``'s low 60 bits as three 20-bit pieces and their squares (zeros for None): summed over
    ranks, ``S1**2 == world * S2`` holds for every piece exactly when every rank sent the same value."""
    if value is None:
        return [0] * 6
    pieces = [(value >> shift) & 0xFFFFF for shift in (0, 20, 40)]
    return [x for p in pieces for x in (p, p * p)]


def _alike(sums: Sequence[int], world: int) -> bool:
    return all(sums[i] * sums[i] == world * sums[i + 1] for i in range(0, len(sums), 2))


_LANES = 4 + 6  # the slot, the clock, the seed, ranks that cannot plan alone; a regular digest's pieces


class SavePlanner:
    """Computes save plans and caches them per process group and structure (see :mod:`zerostall.saving.plan`).

    Planning costs one all-reduce of a few int64s, whatever the world size, unless ranks must gather
    their rows. Each rank proposes the most recently used cached plan that fits its own structure
    (slot ``p``, 1-based; 0 for none) and contributes ``p + p**2 << 32``; the sums ``S1 = sum(p)`` and
    ``S2 = sum(p**2)`` satisfy ``S1**2 == world * S2`` exactly when every rank proposed the same slot,
    so agreement is exact, not probabilistic; a rank without a cached plan adds its structure's
    regular digest the same way (:func:`_lanes`), so ranks that all hold it alike plan alone. The
    same all-reduce carries the coordinator's clock and random bits (for the generation id) and the
    number of ranks that could not prepare the save (see :meth:`refuse`). Every rank's cache changes
    only on agreed outcomes, so slot numbers mean the same plan everywhere.
    """

    def __init__(self, cache_size: int = 8) -> None:
        self._caches: dict[Any, list[Plan]] = {}
        self._cache_size = cache_size
        self._alone = threading.Lock()  # one process's saves may plan in several savers' workers at once

    @staticmethod
    def refuse(group: Group) -> None:
        """Take part in the first planning collective as a rank that cannot save: every rank then
        raises, where the others would wait for this one in the collective for good."""
        group.all_reduce_or_fail([0] * _LANES, "", failed=True)

    def plan(self, group: Group, collected: Collected) -> tuple[Plan, str, bool]:
        """The plan, the generation id every rank uses, and whether planning ran (not cached)."""
        if group.size > 1:  # the caller's thread, which alone runs this group's collectives
            return self._plan(group, collected)
        with self._alone:
            return self._plan(group, collected)

    def _plan(self, group: Group, collected: Collected) -> tuple[Plan, str, bool]:
        cache = self._caches.setdefault(group.pg, [])
        digest = collected.digest if collected.digest is not None else structure_digest(collected.rows)
        slot = next((n for n, p in enumerate(cache, 1) if p.fits(group.rank, digest)), 0)
        regular = regular_digest(collected.rows, group.size) if not slot and group.size > 1 else None
        clock, seed = (time.time_ns(), secrets.randbits(32)) if group.is_coordinator else (0, 0)
        sums = group.all_reduce_or_fail(
            [slot + (slot * slot << 32), clock, seed, int(regular is None), *_lanes(regular)],
            "{failed} other rank(s) could not prepare this save (their errors say why); nothing was written")
        proposals, clock, seed, irregular = sums[:4]
        s1, s2 = proposals & 0xFFFFFFFF, proposals >> 32
        if s1 and s1 * s1 == group.size * s2:
            plan = cache.pop(s1 // group.size - 1)
            cache.insert(0, plan)
            return plan, generation_id(clock, plan.seed), False
        plan: Plan
        if not irregular and _alike(sums[4:], group.size):
            plan = grid_plan(collected.rows, group.rank, group.size, digest, seed)
        else:
            structures = group.all_gather_object(collected.rows)
            try:
                plan = build_plan(structures, [structure_digest(rows) for rows in structures], seed=seed)
            except ValueError as exc:
                raise StateMismatchError(str(exc)) from None
        check_replicas(group, plan, collected)
        cache.insert(0, plan)
        del cache[self._cache_size:]
        return plan, generation_id(clock, plan.seed), True


_UNHELD = 2 ** 63 - 1  # the minimum's neutral value: a slot no rank filled


def check_replicas(group: Group, plan: Plan, collected: Collected) -> None:
    """On a structure's first save, check by checksum that every replica holds the same value: one
    all-reduce (minimum) of each replicated chunk's checksum and of its negation, at the chunk's
    slot; the two agree exactly when every holder sent the same checksum."""
    if group.size == 1 or not plan.slot_count:
        return
    lanes = torch.full((plan.slot_count, 2), _UNHELD, dtype=torch.int64)

    def put(slot: int, data: Any) -> None:
        checksum = xxhash.xxh3_64_intdigest(data) >> 2  # 62 bits: its negation is an int64 too
        lanes[slot, 0], lanes[slot, 1] = checksum, -checksum

    slots = plan.slots
    for item in collected.items:
        if not item.rank_local and item.key in slots:
            put(slots[item.key], owned_bytes(item.tensor.cpu()))
    for key, encoded in collected.objects.items():
        if (key, ()) in slots:
            put(slots[(key, ())], json.dumps(encoded, sort_keys=True).encode())
    for chunk, shard in collected.shards.items():  # a replicated box of a tensor subclass: its context too
        if chunk in slots:
            put(slots[chunk], json.dumps(shard, sort_keys=True).encode())
    least = group.minima(lanes)
    bad = ((least[:, 0] != _UNHELD) & (least[:, 0] != -least[:, 1])).nonzero().flatten().tolist()
    if bad:
        raise StateMismatchError(f"replicas disagree on {', '.join(plan.slot_name(s) for s in bad)}: ranks hold "
                                 "different values for a leaf that is not sharded; make them equal or mark it with "
                                 "zerostall.rank_local()")
