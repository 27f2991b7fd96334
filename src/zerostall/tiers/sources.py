"""Restore from the tiers: the newest step every rank's copy survived, each from the fastest copy.

Every rank reports its node's copies (one rank a node) and the digest of its own layout, in one
all-gather; from what it gathered, every rank picks alike the newest step that holds a copy of
every rank's state, saved from the layout that rank has now, on some node (:func:`choose`),
unless the persistent tier holds a newer one. A rank
whose node holds its copy loads it (``"local"``); the others receive theirs from a node that
holds it (``"peer"``), every block checked on arrival, straight into the state where it can
(:mod:`zerostall.tiers.transfer`). Every rank then says how it fared: if any
copy was damaged, every rank goes on together, to the next copy of that state, then to an
older step, and (returning None) to the persistent tier; any other failure is raised on every rank.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..collectives import Group
from ..errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ..loading.opening import read_manifest_head
from ..roots.restore import DAMAGED, FAILED, OK, kind_of
from ..roots.root import typed_error
from ..storage import storage_for
from .copies import LAYOUT_KEY
from .local import NodeDirectory
from .nodes import Nodes
from .placing import Placer
from .stream import LinkError
from .timelines import Timeline, kept_until, latest
from .transfer import Landed, exchange

log = logging.getLogger(__name__)

LOCAL, PEER = "local", "peer"

Copy = tuple[int, int, int]  # (node, step, rank): one node's copy of one rank's state at one step
Load = Callable[[str, Landed | None], Any]
"""Loads a copy, given its folder and, for one just received, how it landed (every block checked
on arrival, its manifest read, some entries maybe already received into their tensors)."""


@dataclass
class Choice:
    """A step to restore, and where each rank's copy comes from: (node, sending rank) by rank."""

    step: int
    sources: list[tuple[int, int]]
    kinds: list[str] = field(default_factory=list)


UNREADABLE = "?"
"""The digest reported for a copy whose manifest is damaged: taken for any layout's, so that a
restore tries it, finds it damaged (recorded, refused under ``fallback=False``) and goes on."""


def report(directory: NodeDirectory, world: int, leader: bool) -> dict[int, dict[int, str]]:
    """This node's copies: {step: {rank: layout digest}}, the digest empty for copies a restore on
    ``world`` ranks cannot use (only the node's first rank lists them, once for the node), and
    :data:`UNREADABLE` for one whose manifest is damaged; another error reading it (an I/O error) is raised."""
    held: dict[int, dict[int, str]] = {}
    if not leader:
        return held
    for step, ranks in directory.holdings().items():
        for rank in ranks:
            try:
                head = read_manifest_head(storage_for(str(directory.copy_path(step, rank))))
            except (CheckpointError, OSError) as exc:
                if kind_of(exc) != DAMAGED:
                    raise  # an I/O error is not damage: the copy may be the newest whole one
                held.setdefault(step, {})[rank] = UNREADABLE
                continue
            meta = head.metadata if isinstance(head.metadata, dict) else {}
            moved = meta.get("rank", rank) != rank  # by hand: never taken for the rank its folder names
            if moved:
                log.warning("local tier: %s holds rank %s's copy, not rank %d's: not used",
                            directory.copy_path(step, rank), meta.get("rank"), rank)
            usable = not moved and head.world_size == 1 and meta.get("world_size") == world and \
                isinstance(meta.get(LAYOUT_KEY), str)
            held.setdefault(step, {})[rank] = meta[LAYOUT_KEY] if usable else ""  # "": never this layout's
    return held


def choose(nodes: Nodes, digests: list[str], held: list[dict[int, dict[int, str]]], bad: set[Copy],
           newer_than: int | None) -> Choice | None:
    """The newest step above ``newer_than`` with a good copy of every rank's state somewhere (its
    own node's first, else a node in ring order from its own); None when there is none."""
    world = len(digests)
    holders: dict[tuple[int, int], list[int]] = {}
    for node, copies in enumerate(held):
        for step, ranks in copies.items():
            for rank, digest in ranks.items():
                if rank < world and digest in (digests[rank], UNREADABLE) and (node, step, rank) not in bad:
                    holders.setdefault((step, rank), []).append(node)
    for step in sorted({s for s, _ in holders}, reverse=True):
        if newer_than is not None and step <= newer_than:
            break
        if all((step, r) in holders for r in range(world)):
            sources = []
            for rank in range(world):
                own = nodes.index(rank)
                node = min(holders[(step, rank)], key=lambda n: (n - own) % nodes.count)
                on_node = nodes.ranks_on(node)
                sources.append((node, rank if node == own else on_node[rank % len(on_node)]))
            return Choice(step, sources, [LOCAL if n == nodes.index(r) else PEER for r, (n, _) in enumerate(sources)])
    return None


@dataclass(frozen=True)
class Survey:
    """What every node holds, as every rank learned it: each rank's layout digest, and by node
    the copies it holds ({step: {rank: digest}}, as :func:`report` gives) that belong to the
    newest timeline a node records (see :mod:`zerostall.tiers.timelines`), each node's timeline,
    and the coordinator's clock."""

    digests: list[str]
    held: list[dict[int, dict[int, str]]]
    timelines: list[Timeline | None]
    clock: float

    @property
    def timeline(self) -> Timeline | None:
        """The newest timeline a node records: the one the run went on along."""
        return latest(self.timelines)

    def replicated(self, world: int, copies: int, until: int) -> int:
        """The newest step up to ``until`` of which the nodes hold ``copies`` copies of every
        rank's state (-1: none): the one retention keeps while no newer one is replicated."""
        count = Counter((step, rank) for held in self.held for step, ranks in held.items() for rank in ranks)
        return max((s for s, _ in count if s <= until and all(count[(s, r)] >= copies for r in range(world))),
                   default=-1)

    def newest(self, nodes: Nodes, bad: set[Copy]) -> int | None:
        """The newest step with a good copy of every rank's state on some node, leaving out the
        copies found ``bad`` (the same on every rank)."""
        choice = choose(nodes, self.digests, self.held, bad, None)
        return None if choice is None else choice.step


def survey(group: Group, nodes: Nodes, directory: NodeDirectory, digest: str) -> Survey:
    """Every node's copies and timeline, and every rank's layout ``digest`` (collective: each
    node's first rank lists its directory, then one all-gather)."""
    leader = nodes.leads(group.rank)
    def listing() -> tuple[str, dict[int, dict[int, str]], Timeline | None, float]:
        try:
            mine = (report(directory, group.size, leader), directory.timeline()) if leader else ({}, None)
        except OSError as exc:
            raise typed_error(exc, f"cannot list the local tier in {directory.run}")
        return digest, *mine, time.time()

    reports = group.all_gather_or_fail(listing, "the local tier could not be listed on {failed} other rank(s) (their "
                                                "errors say why)")
    firsts = [nodes.ranks_on(node)[0] for node in range(nodes.count)]  # each lists its node's copies
    found: list[Timeline | None] = [reports[r][2] for r in firsts]
    current = latest(found)
    held: list[dict[int, dict[int, str]]] = []
    for r in firsts:
        copies, until = reports[r][1], kept_until(reports[r][2], nodes.ids[r], current)
        held.append({step: ranks for step, ranks in copies.items() if step <= until})
        if len(held[-1]) < len(copies) and group.is_coordinator:
            log.warning("the local tier on node %s holds copies of an abandoned timeline (it missed a job), not "
                        "used: steps %s", nodes.ids[r], sorted(s for s in copies if s > until)[-5:])
    return Survey([d for d, *_ in reports], held, found, reports[0][3])


def restore_from_tiers(group: Group, pg: Any, nodes: Nodes, directory: NodeDirectory, seen: Survey,
                       newer_than: int | None, load: Load, place: Placer | None, *, fallback: bool,
                       fallbacks: list[tuple[str, str]], bad: set[Copy]) -> tuple[Choice, Any] | None:
    """Restore this rank from the tiers (see the module's docstring), from what ``seen`` found:
    returns the choice made and what ``load`` returned, or None when the persistent tier is to be
    used; a copy from a peer is received into memory where ``place`` says. Copies found damaged
    are added to ``bad`` and to ``fallbacks`` (what, why)."""
    digests, held = seen.digests, seen.held
    while True:  # every rank chooses alike: from what the survey gathered, and the same copies found bad
        chosen = choose(nodes, digests, held, bad, newer_than)
        if chosen is None:
            return None
        outcome, result, error = _attempt(group, pg, nodes, directory, chosen, load, place)
        try:
            outcomes = _outcomes(group, outcome)
        except RuntimeError as exc:  # a rank died or timed out: the restarted job restores again
            link = LinkError(f"the tier's group failed: {exc}")
            link.__cause__ = exc
            raise CheckpointError(f"restoring step {chosen.step} from the local tier failed: not every rank answered "
                                  f"({exc}); this rank's outcome: {outcome[1] or 'ok'}") from link
        if all(kind == OK for kind, _ in outcomes):
            return chosen, result
        damaged = [(r, message) for r, (kind, message) in enumerate(outcomes) if kind == DAMAGED]
        if not damaged or any(kind == FAILED for kind, _ in outcomes):
            failed = [(r, m) for r, (k, m) in enumerate(outcomes) if k != OK]
            raise CheckpointError(f"restoring step {chosen.step} from the local tier failed on "
                                  + "; ".join(f"rank {r}: {m}" for r, m in failed)) from error
        for r, message in damaged:
            node = chosen.sources[r][0]
            bad.add((node, chosen.step, r))
            fallbacks.append((f"step {chosen.step}, rank {r}'s copy on node {nodes.ids[nodes.ranks_on(node)[0]]} "
                              f"({chosen.kinds[r]})", message))
        reason = "; ".join(f"rank {r}: {m}" for r, m in damaged)
        if not fallback:
            raise CorruptCheckpointError(f"a local-tier copy of step {chosen.step} is damaged ({reason}); "
                                         "restore(..., fallback=True) restores from the next good copy instead") \
                from error
        log.log(logging.WARNING if group.is_coordinator else logging.DEBUG,
                "local-tier copy of step %d is damaged (%s): trying the next copy", chosen.step, reason)


def _attempt(group: Group, pg: Any, nodes: Nodes, directory: NodeDirectory, choice: Choice, load: Load,
             place: Placer | None) -> tuple[tuple[str, str], Any, Exception | None]:
    """Receive this rank's copy if it is a peer's, send the copies others need from this rank,
    then load (a copy on this rank's node: while the sends go); returns (outcome, message), what
    ``load`` returned and this rank's error (None when it succeeded)."""
    rank, step = group.rank, choice.step
    sends = [(r, directory.copy_path(step, r)) for r, (_, sender) in enumerate(choice.sources)
             if sender == rank and r != rank]
    receives = [(choice.sources[rank][1], directory.copy_path(step, rank))] if choice.kinds[rank] == PEER else []
    landed = None
    try:
        if sends and not receives:
            return (OK, ""), _load_while_sending(pg, sends, str(directory.copy_path(step, rank)), load, step=step,
                                                 cut=place is not None), None
        got = exchange(pg, sends, receives, step=step, cut=place is not None, place=place) if sends or receives else []
        landed = got[0] if receives else None
        return (OK, ""), load(str(directory.copy_path(step, rank) if landed is None else landed.folder), landed), None
    except Exception as exc:
        return (kind_of(exc) if kind_of(exc) == DAMAGED else FAILED, f"{type(exc).__name__}: {exc}"), None, exc
    finally:
        if landed is not None and landed.placed:  # holds only what did not go into memory: never kept
            shutil.rmtree(landed.folder, ignore_errors=True)


def _load_while_sending(pg: Any, sends: list[tuple[int, Path]], own: str, load: Load, *, step: int, cut: bool) -> Any:
    """Load this rank's copy ``own`` while its ``sends`` go; the sends end (peers wait on them)
    whatever the load does, and the first error is raised."""
    with ThreadPoolExecutor(1, thread_name_prefix="zerostall-send") as pool:
        sending = pool.submit(exchange, pg, sends, [], step=step, cut=cut)
        try:
            loaded = load(own, None)
        except BaseException:
            sending.exception()
            raise
        sending.result()
    return loaded


def _outcomes(group: Group, outcome: tuple[str, str]) -> list[tuple[str, str]]:
    """Every rank's outcome: one all-reduce when every rank's is OK; else an all-gather after it."""
    if group.all_reduce_ints([outcome[0] != OK])[0] == 0:
        return [(OK, "")] * group.size
    return group.all_gather_object(outcome)


def say_why_not(group: Group, seen: Survey, directory: NodeDirectory, fresh: bool) -> None:
    """The tiers hold steps, but none that a restore can use: log it, once. Where they were saved
    from another layout (world size, mesh) and the root holds no checkpoint (``fresh``), raise
    :class:`StateMismatchError` instead: the fresh start that follows would delete those steps."""
    steps = sorted({s for copies in seen.held for s in copies}, reverse=True)
    if not steps:
        return
    other = any(d not in (seen.digests[r] if r < len(seen.digests) else None, UNREADABLE)
                for copies in seen.held for ranks in copies.values() for r, d in ranks.items())
    if fresh and other:
        raise StateMismatchError(
            f"the local tier ({directory.run}) holds steps {steps[:5]} saved from another layout than the ranks have "
            "now (another world size or mesh), and the persistent tier holds no checkpoint: nothing was restored, and "
            f"nothing deleted. Restart with the ranks and nodes that saved them, or delete {directory.run} on every "
            "node to start from scratch")
    if group.is_coordinator:
        log.warning("the local tier holds steps %s, but no step left holds a good copy of every rank's state saved "
                    "from the layout the ranks have now (another world size or mesh, copies lost or damaged): "
                    "restoring from the persistent tier%s", steps[:5], "" if not fresh else ", which holds none")
