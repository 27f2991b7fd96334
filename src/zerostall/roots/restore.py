"""Restoring the newest undamaged checkpoint of a root, on every rank together.

Every rank tries the same checkpoint, then learns in one gather how every rank fared. If any rank
found it damaged (a checksum, a truncated or missing file, a manifest that does not check), all
ranks go on to the previous committed one, whose load fills every target again. Any other failure
(an I/O error, a mismatched state) is raised on every rank: a transient error must not silently
resume an older step.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from ..collectives import Group
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from ..format.layout import RNG_KEY
from ..state import RankLocal, flatten, rebuild
from .described import DAMAGE
from .root import CheckpointRoot, tag_step

log = logging.getLogger(__name__)

T = TypeVar("T")

PERSISTENT = "persistent"
"""The source of a checkpoint read from the manager's root."""

OK, DAMAGED, ELSEWHERE, FAILED = "ok", "damaged", "elsewhere", "failed"


@dataclass(frozen=True)
class RestoreInfo:
    """What the last :meth:`CheckpointManager.restore` did (``mgr.last_restore``): the same on
    every rank but for ``source``, this rank's own."""

    step: int | None
    """The step restored; None when nothing was (a fresh start, or a restore that raised)."""

    source: str | None
    """Where this rank's state came from: ``"persistent"`` (the manager's root); ``"local"`` and
    ``"peer"`` are the faster tiers' names. None when nothing was restored."""

    sources: tuple[str, ...]
    """Every rank's source, by rank (empty when nothing was restored)."""

    fallbacks: tuple[tuple[str, str], ...]
    """The checkpoints found damaged and passed over, newest first: (tag, what failed on which rank)."""

    tag: str | None = None
    """The tag of the checkpoint restored (None when nothing was)."""


NOTHING = RestoreInfo(None, None, (), ())


@dataclass(frozen=True)
class PassedOver:
    """What :func:`restore_first_whole` returns when every candidate it was to try (``until``) was
    damaged and another source goes on: the checkpoints passed over and why."""

    fallbacks: tuple[tuple[str, str], ...]


def kind_of(exc: BaseException) -> str:
    """How a failed attempt counts: DAMAGED (the checkpoint's bytes or files are not what was saved),
    ELSEWHERE (a plain :class:`CheckpointError` with no I/O error behind it: how a rank learns that
    another rank failed) or FAILED (anything else, an I/O or storage error above all)."""
    if isinstance(exc, DAMAGE):
        return DAMAGED
    if type(exc) is CheckpointError and not isinstance(exc.__cause__, OSError):
        return ELSEWHERE
    return FAILED


Candidate = tuple[str, str | None, int]
"""A checkpoint a restore may try: its tag, why it is known to be damaged (None: not known), its
step (-1 for a checkpoint without one)."""


def newest_first(root: CheckpointRoot) -> list[Candidate]:
    """The checkpoints a restore tries, newest first: the committed ones, and those of a step tag
    whose manifest is damaged (with why: they are passed over, and said to be). A manifest that
    could not be read for another reason (an I/O error) is raised: it may be the newest."""
    found: list[tuple[int, str, str | None]] = [(-1 if i.step is None else i.step, i.name, None)
                                                for i in root.checkpoints()]
    for tag, exc in root.unreadable.items():
        if isinstance(exc, CheckpointNotFoundError):  # deleted since it was listed
            continue
        if kind_of(exc) != DAMAGED:
            raise exc
        step = tag_step(tag)
        if step is not None:
            found.append((step, tag, f"{type(exc).__name__}: {exc}"))
    return [(tag, damage, step) for step, tag, damage in sorted(found, reverse=True)]


def restore_first_whole(group: Group, root: CheckpointRoot, candidates: list[Candidate],
                        attempt: Callable[[str], tuple[int | None, T]], *, fallback: bool, named: bool,
                        record: Callable[[RestoreInfo], None], earlier: tuple[tuple[str, str], ...] = (),
                        until: int | None = None) -> T | PassedOver | None:
    """``attempt(tag)`` (which returns the step it restored and a result) on every rank for each of
    ``candidates`` (checkpoints of ``root``, newest first, as :func:`newest_first` lists them) until it
    succeeds on every rank, going on only past damage and only when ``fallback``; returns its
    result (None for no candidates: a fresh start). Otherwise raises on every rank: a damaged
    checkpoint's error names what failed (and what ``fallback=True`` would restore), and when every
    candidate is damaged it lists them. ``named``: the one candidate was asked for by tag.
    ``earlier``: copies already found damaged elsewhere (a faster tier's): with no candidate, no
    fresh start either (their bytes may be in the state), an error. ``record`` gets what was
    restored (and passed over, ``earlier`` first), whether this raises or not. ``until``: only the
    first ``until`` candidates are tried, then another source (a faster tier's step, no older than
    the rest): when they are all damaged, :class:`PassedOver` is returned for it to go on."""
    damaged: list[tuple[str, str]] = []
    restored: RestoreInfo | None = None
    try:
        for n, (tag, known, _) in enumerate(candidates[:until]):
            error: Exception | None = None
            if known is not None:  # found damaged while listing, the same on every rank: not tried
                outcomes = [(DAMAGED, known, "")]
            else:
                try:
                    step, result = attempt(tag)
                    outcome = (OK, "", PERSISTENT)
                except Exception as exc:
                    error, outcome = exc, (kind_of(exc), f"{type(exc).__name__}: {exc}", "")
                outcomes = group.all_gather_object(outcome)
            if all(kind == OK for kind, _, _ in outcomes):
                sources = tuple(source for _, _, source in outcomes)
                restored = RestoreInfo(step, sources[group.rank], sources, earlier + tuple(damaged), tag)
                return result
            found = [(rank, message) for rank, (kind, message, _) in enumerate(outcomes) if kind == DAMAGED]
            if not found or any(kind == FAILED for kind, _, _ in outcomes):  # never resume an older step over it
                if error is not None and kind_of(error) != ELSEWHERE:
                    raise error
                failed = [(rank, message) for rank, (kind, message, _) in enumerate(outcomes) if kind != OK]
                raise CheckpointError(f"restoring {root.where(tag)} failed on " + _by_rank(
                    [(rank, message) for rank, message in failed if outcomes[rank][0] != ELSEWHERE] or failed))
            reason = _by_rank(found) if len(outcomes) > 1 else found[0][1]
            damaged.append((tag, reason))
            following, handing = candidates[n + 1:], until is not None and n + 1 >= until
            if not (fallback and (following or handing)):
                raise _refusal(error, root, tag, reason, damaged, following, named, handing) from error
            log.log(logging.WARNING if group.is_coordinator else logging.DEBUG,
                    "checkpoint %s is damaged (%s): restoring %s instead (restore with fallback=False to refuse)",
                    root.where(tag), reason, "a faster tier's newest whole step" if handing
                    else f"the previous committed one, {following[0][0]},")
        if until is not None:
            return PassedOver(earlier + tuple(damaged))
        if earlier:
            tried = "; ".join(f"{what}: {why}" for what, why in earlier[:3])
            raise CorruptCheckpointError(f"every copy tried is damaged ({tried}) and {root.location} holds no "
                                         "other checkpoint: nothing whole is left to restore, and the state may hold "
                                         "part of a damaged copy; build the state anew to start from scratch")
        return None
    finally:
        record(restored or RestoreInfo(None, None, (), earlier + tuple(damaged)))


def _by_rank(messages: list[tuple[int, str]]) -> str:
    return "; ".join(f"rank {rank}: {message}" for rank, message in messages)


def _refusal(error: Exception | None, root: CheckpointRoot, tag: str, reason: str, damaged: list[tuple[str, str]],
             following: list[Candidate], named: bool, handing: bool = False) -> CheckpointError:
    """The error of a restore that stops at damaged ``tag``: falling back was off (the hint names
    what ``fallback=True`` would restore; ``handing``: a faster tier's step), there was nothing
    before it, or every one was damaged."""
    if len(damaged) > 1:
        tried = "; ".join(f"{name} ({why})" for name, why in damaged)
        return CorruptCheckpointError(f"every checkpoint tried under {root.location} is damaged, so nothing was "
                                      f"restored (the state's tensors may hold partly loaded values): {tried}")
    previous = next((name for name, known, _ in following if known is None), None)
    if handing:
        hint = "; restore(..., fallback=True) restores the newest step a faster tier holds whole instead"
    elif previous is not None:
        hint = f"; restore(..., fallback=True) restores the previous committed checkpoint, {previous}, instead"
    else:
        hint = (f"; it was asked for by tag={tag!r}, so no other is restored in its place (restore without tag= "
                "falls back to the newest undamaged one)" if named else "; there is no earlier committed checkpoint")
    if isinstance(error, DAMAGE):
        return type(error)(f"{error}{hint}")
    return CorruptCheckpointError(f"checkpoint {root.where(tag)} is damaged ({reason}){hint}")


def other_world(where: str, saved: int, group: Group, strict: bool, asked: list[str]) -> None:
    """Refuse a strict restore of checkpoint ``where``, saved by ``saved`` ranks, on another number
    of ranks when it asks for per-rank state (``asked``: those keys, ``RNG_KEY`` among them),
    naming the call that works; a non-strict one leaves every rank's per-rank state as it is, and
    says so once. A restore that asks for none (``keys`` leave it out) has nothing to refuse."""
    if not asked:
        return
    what = ", ".join("the RNG states" if k == RNG_KEY else repr(k) for k in sorted(asked, key=lambda k: k != RNG_KEY))
    if strict:
        raise StateMismatchError(f"{where} was saved by {saved} rank(s) and is restored on {group.size}: its per-rank "
                                 f"state ({what}) cannot be given to these ranks one to one; to resume on another "
                                 "world size, call mgr.restore(state, strict=False): it restores everything else "
                                 "and leaves each rank's per-rank state as it is")
    log.log(logging.WARNING if group.is_coordinator else logging.DEBUG, "%s was saved by %d rank(s) and is restored "
            "on %d: its per-rank state (%s) is not restored, each rank keeps its own", where, saved, group.size, what)


class PerRankCopy:
    """The per-rank parts of a state (:class:`RankLocal` values; the RNG states aside, which a
    restore sets from what it loaded) as a non-strict restore was given them, copied to host memory
    before the first attempt that loads them. An attempt that failed on another rank may have
    loaded its per-rank values in place here; a checkpoint of another world size leaves per-rank
    state as it is, so an attempt at one puts them back first. ``wrap``: the state's parts, per-rank
    ones as :class:`RankLocal` (None: a strict restore, which never leaves per-rank state unloaded)."""

    def __init__(self, wrap: Callable[[Any], dict[str, Any]] | None) -> None:
        self.wrap = wrap
        self.parts: dict[str, Any] | None = None  # the copy, once taken: the parts, their leaves, the leaves' copies
        self.flat: Any = None
        self.saved: dict[Any, Any] = {}

    def before_attempt(self, state: dict[str, Any], fills: bool) -> None:
        """Before an attempt that ``fills`` the per-rank parts: copy them (once); else put them back."""
        if self.wrap is None:
            return
        if fills:
            self._keep(self.wrap(state))
        elif self.parts is not None:
            self._put_back(state)

    def _keep(self, wrapped: dict[str, Any]) -> None:
        if self.parts is not None:
            return
        self.parts = {k: v for k, v in wrapped.items() if isinstance(v, RankLocal) and k != RNG_KEY}
        self.flat = flatten(self.parts)  # stateful objects by their state dicts, as a load sees them
        self.saved = {path: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor)
                      else copy.deepcopy(leaf) for path, leaf in self.flat.leaves.items()}

    def _put_back(self, state: dict[str, Any]) -> None:
        assert self.parts is not None
        with torch.no_grad():
            for path, leaf in self.flat.leaves.items():
                if isinstance(leaf, torch.Tensor):
                    leaf.copy_(self.saved[path])
        rebuild(self.parts, self.flat, {path: copy.deepcopy(value) for path, value in self.saved.items()
                                        if not isinstance(value, torch.Tensor)})
        for key, part in self.parts.items():  # a tuple is rebuilt, not refilled
            state[key] = part if isinstance(state[key], RankLocal) else part.value
