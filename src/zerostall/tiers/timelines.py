"""Timelines: which of a node's local-tier copies belong to the run as it goes on.

Each time a job takes a step (a restore) or starts from scratch, the run goes on from that step
along a new timeline, which every node of the job records (``.zerostall-timeline``). A timeline
names its sequence number, start time and id, the job's nodes, and the forks of the last
timelines: where each went on from. A node that missed jobs holds copies of an older timeline:
those up to the step every later timeline forked at are steps the run went through, and stay
usable; newer ones were abandoned (a rollback, saves after the step a crash fell back to) and
are never mixed with the run's.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

Timeline = list
"""[sequence number, start time, id, the job's node ids, forks]: ordered as lists are, the newest
last; forks are [sequence number, id, step it went on from (None: from scratch)] of the last
timelines, this one's last."""

FORKS_KEPT = 64
"""The forks a timeline recalls: a node that missed more jobs than that keeps none of its copies."""


def valid(found: Any) -> bool:
    """Whether ``found`` (read from a node's file) has a timeline's shape."""
    return isinstance(found, list) and len(found) == 5 and type(found[0]) is int and isinstance(found[1], float) \
        and isinstance(found[2], str) and isinstance(found[3], list) and all(isinstance(n, str) for n in found[3]) \
        and isinstance(found[4], list) and all(_fork(f) for f in found[4])


def _fork(f: Any) -> bool:
    return isinstance(f, list) and len(f) == 3 and type(f[0]) is int and isinstance(f[1], str) \
        and (f[2] is None or type(f[2]) is int)


def latest(timelines: Iterable[Timeline | None]) -> Timeline | None:
    """The newest of ``timelines`` (None: older than any)."""
    return max((t for t in timelines if t is not None), default=None)


def kept_until(timeline: Timeline | None, node: str, current: Timeline | None) -> float:
    """The newest step of the copies of ``node`` (whose directory records ``timeline``) that belong
    to the ``current`` timeline: all of them on it or on a node that took part in it (one that
    could not record it removed its newer steps first); else those up to every later fork; none
    (-1) when its timeline is not among the forks ``current`` recalls, or one since started from scratch."""
    if current is None or timeline == current or node in current[3]:
        return math.inf
    forks = current[4]
    since = next((i for i, (seq, tid, _) in enumerate(forks)
                  if timeline is not None and (seq, tid) == (timeline[0], timeline[2])), None)
    if since is None:
        return -1
    later = [step for _, _, step in forks[since + 1:]]
    return -1 if None in later else min(later, default=math.inf)


def following(current: Timeline | None, step: int | None, clock: float, tid: str, nodes: Iterable[str]) -> Timeline:
    """The timeline a job on ``nodes`` starts at ``clock`` from ``step`` (None: from scratch)."""
    seq = current[0] + 1 if current is not None else 0
    forks = current[4][-(FORKS_KEPT - 1):] if current is not None else []
    return [seq, clock, tid, sorted(set(nodes)), [*forks, [seq, tid, step]]]
