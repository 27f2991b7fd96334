"""Retention: which committed checkpoints to keep, and by which rule. A pure function, no I/O."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import UnsupportedValueError
from ..options import SaveOptions


def _number(value: Any) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def numeric_metrics(metrics: dict) -> dict[str, float]:
    """The metrics retention can rank by: the numeric ones."""
    return {k: v for k, v in metrics.items() if _number(v)}


def checked_metrics(metrics: Any) -> dict[str, float]:
    """``metrics`` as a dict of names to python numbers (what listing and ``keep_best`` rank by; a
    numpy scalar, such as ``np.mean`` returns, becomes one)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics={metrics!r} is not a dict: pass e.g. metrics={{'loss': 0.31}}")
    bad = [k for k, v in metrics.items() if not isinstance(k, str) or not _number(v)]
    if bad:
        raise UnsupportedValueError(f"metrics {bad[0]!r} (= {metrics[bad[0]]!r}) is not a number under a string name: "
                                    "metrics are numbers that listing and keep_best rank by (a tensor: pass .item())")
    return {k: int(v) if isinstance(v, numbers.Integral) else float(v) for k, v in metrics.items()}


@dataclass(frozen=True)
class CheckpointRecord:
    """What retention knows of a committed checkpoint."""

    step: int
    created: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints to keep. Rules combine: a checkpoint is kept when any rule keeps
    it; with no rule, all are kept. The newest is always kept, and so is the one being resumed from."""

    keep_last: int | None = None
    """Keep the K newest steps."""

    keep_every: int | None = None
    """Keep the steps divisible by N (milestones)."""

    keep_best: int | None = None
    """Keep the K best steps by ``metric`` (NaN or missing is never best; ties go to the newer step)."""

    metric: str | None = None
    """The metric ``keep_best`` ranks by, from the ``metrics`` given to ``CheckpointManager.save``."""

    mode: str = "min"
    """Whether the best ``metric`` is the smallest ("min") or the largest ("max")."""

    keep_time_interval: float | None = None
    """Walking by step, keep one checkpoint each time at least this many seconds passed since the
    last one kept by this rule."""

    protect: Callable[[int], bool] | None = None
    """Keep every step for which this returns True."""

    def __post_init__(self) -> None:
        if self.keep_best is not None and self.metric is None:
            raise ValueError("keep_best needs a metric")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {self.mode!r}")
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be an int >= 1, not {value!r}")
        interval = self.keep_time_interval
        if interval is not None and not interval > 0:
            raise ValueError("keep_time_interval must be a positive number of seconds")

    @property
    def keeps_all(self) -> bool:
        return all(getattr(self, n) is None for n in ("keep_last", "keep_every", "keep_best", "keep_time_interval"))


def kept(records: Sequence[CheckpointRecord], policy: RetentionPolicy,
         pinned: Sequence[int] = ()) -> dict[int, list[str]]:
    """The steps to keep, each with the rules that keep it.

    The newest step is always kept ("newest"), and so is every step in ``pinned`` ("pinned": the
    checkpoint being resumed from, or one still being written). Steps not in the result may go.
    """
    steps = sorted({r.step for r in records})  # a tag saved beside its step's checkpoint is one step, not two
    reasons: dict[int, list[str]] = {}

    def keep(step: int, why: str) -> None:
        reasons.setdefault(step, []).append(why)

    if not steps:
        return reasons
    keep(steps[-1], "newest")
    for step in sorted(set(pinned)):
        if step in steps:
            keep(step, "pinned")
    if policy.keeps_all:
        for step in steps:
            keep(step, "all")
        return reasons
    if policy.keep_last:
        for step in steps[-policy.keep_last:]:
            keep(step, "last")
    if policy.keep_every:
        for step in steps:
            if step % policy.keep_every == 0:
                keep(step, "every")
    if policy.keep_best:
        sign = 1 if policy.mode == "min" else -1
        best: dict[int, float] = {}  # each step's best score, of the checkpoints it has
        for r in records:
            v = r.metrics.get(policy.metric or "")
            if _number(v) and not math.isnan(v) and (r.step not in best or sign * v < sign * best[r.step]):
                best[r.step] = v
        for step, _ in sorted(best.items(), key=lambda sv: (sign * sv[1], -sv[0]))[:policy.keep_best]:
            keep(step, "best")
    if policy.keep_time_interval:
        last = None
        for r in sorted(records, key=lambda r: r.step):
            if last is None or r.created - last >= policy.keep_time_interval:
                keep(r.step, "time")
                last = r.created
    if policy.protect:
        for step in steps:
            if policy.protect(step):
                keep(step, "protected")
    return reasons


def split_shorthand(shorthand: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shorthand keywords split into retention rules and save options; any other is a TypeError."""
    rules = {f.name for f in dataclasses.fields(RetentionPolicy)}
    options = {f.name for f in dataclasses.fields(SaveOptions)}
    for key in shorthand:
        if key not in rules | options:
            close = difflib.get_close_matches(key, sorted(rules | options), n=1)
            raise TypeError(f"CheckpointManager got an unexpected keyword {key!r}"
                            + (f"; did you mean {close[0]!r}?" if close else ""))
    return ({k: v for k, v in shorthand.items() if k in rules and v is not None},
            {k: v for k, v in shorthand.items() if k in options})


def policy_of(retention: RetentionPolicy | None, rules: dict[str, Any]) -> RetentionPolicy:
    """The one retention policy: ``retention``, or one built from the rule keywords given."""
    if retention is None:
        return RetentionPolicy(**rules)
    if rules:
        raise ValueError(f"retention= and {', '.join(f'{name}=' for name in rules)} both set retention rules: "
                         "give the rules either as a RetentionPolicy or as keywords")
    return retention
