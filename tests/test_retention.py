"""Retention rules (``zerostall.roots.retention.kept``): property-based simulations of long training runs
plus example-based edge cases.

The simulations play a training run: steps strictly increase (random gaps, step 0 included),
``created`` never decreases, metrics are random (ties, NaN, None, missing, +-inf). After every step a
new checkpoint commits, retention runs over the committed set with the pinned steps (the step
resumed from, sometimes the next step still being written, sometimes a stale pin), and the steps
not kept are deleted. Invariants are checked after every step, both against the current set and
against the whole history of the run (what retention promises never to delete).

Behaviour pinned down here, read from ``retention.py``:

* ``keep_best`` candidates are the metric values that are real numbers and not NaN; None, a
  missing key and NaN are never candidates. +-inf ARE candidates: -inf is the best possible value
  for ``mode="min"``, +inf for ``mode="max"`` -- and the opposite infinity is merely the worst
  candidate (it still fills a best-K slot when fewer than K better candidates exist).
* Ties in the metric go to the newer step.
* ``protect`` is a guard, not a rule: a policy with only ``protect`` keeps everything ("all").
* ``keep_time_interval``: walking by step, the oldest step is kept, then each step whose
  ``created`` is at least the interval after the last step kept by this rule.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerostall.roots.retention import CheckpointRecord, RetentionPolicy, kept

METRIC = "loss"
REASONS = {"newest", "pinned", "all", "last", "every", "best", "time", "protected"}
RULES = ("keep_last", "keep_every", "keep_best", "keep_time_interval")
MISSING = object()  # the metric key is absent from the record

SIM_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- helpers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Protect:
    """A reproducible, printable ``protect`` predicate: a pseudo-random subset of steps."""

    salt: int
    percent: int

    def __call__(self, step: int) -> bool:
        return (step * 2654435761 + self.salt) % 100 < self.percent


def record(step: int, created: float, value: object = MISSING) -> CheckpointRecord:
    metrics = {} if value is MISSING else {METRIC: value}
    return CheckpointRecord(step, created, metrics)  # type: ignore[arg-type]


def is_candidate(value: object) -> bool:
    """What may count as best: a real number that is not NaN (so +-inf count)."""
    return isinstance(value, (int, float)) and not math.isnan(value)


def best_order(records, mode: str) -> list[int]:
    """Candidate steps, best first; equal values: the newer step first."""
    cands = [(r.metrics[METRIC], r.step) for r in records
             if METRIC in r.metrics and is_candidate(r.metrics[METRIC])]
    if mode == "max":
        return [s for _, s in sorted(cands, reverse=True)]  # biggest value, then biggest step
    return [s for _, s in sorted(cands, key=lambda vs: (vs[0], -vs[1]))]


def time_walk(records, interval: float) -> set[int]:
    out, last = set(), None
    for r in sorted(records, key=lambda r: r.step):
        if last is None or r.created - last >= interval:
            out.add(r.step)
            last = r.created
    return out


def expected_by_reason(records, policy: RetentionPolicy, pinned) -> dict[str, set[int]]:
    """An independent model: for each reason, the steps it keeps."""
    steps = sorted(r.step for r in records)
    out: dict[str, set[int]] = {k: set() for k in REASONS}
    if not steps:
        return out
    out["newest"] = {steps[-1]}
    out["pinned"] = set(pinned) & set(steps)
    if all(getattr(policy, n) is None for n in RULES):
        out["all"] = set(steps)
        return out
    if policy.keep_last is not None:
        out["last"] = set(steps[len(steps) - policy.keep_last:]) if policy.keep_last < len(steps) else set(steps)
    if policy.keep_every is not None:
        out["every"] = {s for s in steps if s % policy.keep_every == 0}
    if policy.keep_best is not None:
        out["best"] = set(best_order(records, policy.mode)[:policy.keep_best])
    if policy.keep_time_interval is not None:
        out["time"] = time_walk(records, policy.keep_time_interval)
    if policy.protect is not None:
        out["protected"] = {s for s in steps if policy.protect(s)}
    return out


def check_one_run(records, policy: RetentionPolicy, pinned, result: dict[int, list[str]]) -> None:
    """Invariants of a single call of ``kept``."""
    steps = [r.step for r in records]
    committed = set(steps)
    # (9) only committed steps, each with at least one known reason, none listed twice
    assert set(result) <= committed, f"uncommitted steps kept: {set(result) - committed}"
    for step, why in result.items():
        assert why, f"step {step} kept without a reason"
        assert set(why) <= REASONS, f"step {step}: unknown reasons {why}"
        assert len(why) == len(set(why)), f"step {step}: reasons repeated {why}"
    if not records:
        assert result == {}
        return
    # (1) the newest committed step is kept
    newest = max(steps)
    assert newest in result and "newest" in result[newest]
    # (2) every committed pinned step is kept
    for p in pinned:
        if p in committed:
            assert "pinned" in result[p], f"pinned step {p} not kept: {result.get(p)}"
    # (7) protected steps are kept
    if policy.protect is not None:
        for s in steps:
            if policy.protect(s):
                assert s in result, f"protected step {s} not kept"
    if all(getattr(policy, n) is None for n in RULES):
        # (8) no rules: everything kept
        assert set(result) == committed
        assert all("all" in why for why in result.values())
    else:
        # (3) keep_last: the last K of the current set
        if policy.keep_last is not None:
            for s in sorted(steps)[-policy.keep_last:]:
                assert "last" in result.get(s, ()), f"step {s} among the last {policy.keep_last} not kept"
        # (4) keep_every
        if policy.keep_every is not None:
            for s in steps:
                if s % policy.keep_every == 0:
                    assert "every" in result.get(s, ()), f"step {s} divisible by {policy.keep_every} not kept"
        # (5) keep_best: exactly min(K, #candidates) bests; nothing not-best is better
        if policy.keep_best is not None:
            by_step = {r.step: r for r in records}
            bests = {s for s, why in result.items() if "best" in why}
            cands = {s for s, r in by_step.items() if METRIC in r.metrics and is_candidate(r.metrics[METRIC])}
            assert bests <= cands, f"NaN/None/missing counted as best: {bests - cands}"
            assert len(bests) == min(policy.keep_best, len(cands))
            sign = 1 if policy.mode == "min" else -1
            for b in bests:
                vb = sign * by_step[b].metrics[METRIC]
                for c in cands - bests:
                    vc = sign * by_step[c].metrics[METRIC]
                    assert vb < vc or (vb == vc and b > c), (
                        f"step {c} ({by_step[c].metrics[METRIC]}) beats best step {b} ({by_step[b].metrics[METRIC]})")
        # (6) keep_time_interval, by the docstring's definition
        if policy.keep_time_interval is not None:
            times = sorted((r.step, r.created) for r in records)
            timed = [(s, c) for s, c in times if "time" in result.get(s, ())]
            assert timed and timed[0][0] == times[0][0], "the oldest step starts the time walk"
            for (_, c0), (_, c1) in itertools.pairwise(timed):
                assert c1 - c0 >= policy.keep_time_interval
            last_created = None
            for s, c in times:
                if "time" in result.get(s, ()):
                    last_created = c
                else:
                    assert last_created is not None and c - last_created < policy.keep_time_interval, (
                        f"step {s} is {c - last_created}s after the last time-kept one: should be kept")
    # exactness against the model: each reason names exactly the steps it should, nothing else kept
    model = expected_by_reason(records, policy, pinned)
    for reason in REASONS:
        got = {s for s, why in result.items() if reason in why}
        assert got == model[reason], f"reason {reason!r}: got {sorted(got)}, expected {sorted(model[reason])}"
    assert set(result) == set().union(*model.values())


def check_deterministic(records, policy, pinned, result, rng: random.Random) -> None:
    """(10) same input, same output; the order of records and of pins does not matter."""
    assert kept(list(records), policy, list(pinned)) == result
    shuffled, pins = list(records), list(pinned)
    rng.shuffle(shuffled)
    rng.shuffle(pins)
    again = kept(shuffled, policy, pins)
    assert again == result, "result depends on the order of the records"


# -- strategies ---------------------------------------------------------------------------------

metric_values = st.one_of(
    st.just(MISSING),
    st.none(),
    st.just(math.nan),
    st.just(math.inf),
    st.just(-math.inf),
    st.sampled_from([0.0, -0.0, 1.0, 1.5, 2.0, 3]),  # ties (and an int)
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
)


@st.composite
def policies(draw, allow_none: bool = True) -> RetentionPolicy:
    keep_best = draw(st.none() | st.integers(1, 4))
    policy = RetentionPolicy(
        keep_last=draw(st.none() | st.integers(1, 6)),
        keep_every=draw(st.none() | st.integers(1, 12)),
        keep_best=keep_best,
        metric=METRIC if keep_best is not None or draw(st.booleans()) else None,
        mode=draw(st.sampled_from(["min", "max"])),
        keep_time_interval=draw(st.none() | st.floats(0.5, 120.0)),
        protect=draw(st.none() | st.builds(Protect, st.integers(0, 99), st.integers(1, 15))),
    )
    return policy


@dataclass
class Tick:
    """One step of a simulated run."""

    gap: int            # steps since the previous checkpoint
    dt: float           # seconds since the previous checkpoint
    value: object       # the metric value (or MISSING)
    resume: int | None  # after retention: pin (resume from) the n-th surviving step
    inflight: bool      # the next step is being written while retention runs
    stale_pin: bool     # also pin a step that is not committed (deleted or never written)


ticks = st.builds(
    Tick,
    gap=st.integers(1, 7),
    dt=st.one_of(st.just(0.0), st.floats(0.01, 60.0)),
    value=metric_values,
    resume=st.none() | st.none() | st.none() | st.integers(0, 10**6),
    inflight=st.booleans(),
    stale_pin=st.integers(0, 9).map(lambda n: n == 0),
)


def random_ticks(rng: random.Random, n: int) -> list[Tick]:
    def value() -> object:
        k = rng.randrange(10)
        if k == 0:
            return MISSING
        if k == 1:
            return rng.choice([None, math.nan, math.inf, -math.inf])
        if k < 5:
            return rng.choice([0.0, 1.0, 1.5, 2.0])
        return rng.uniform(-100, 100)
    return [Tick(gap=rng.randint(1, 7), dt=rng.choice([0.0, rng.uniform(0.01, 60.0)]), value=value(),
                 resume=rng.randrange(10**6) if rng.random() < 0.05 else None, inflight=rng.random() < 0.5,
                 stale_pin=rng.random() < 0.1) for _ in range(n)]


# -- the simulation -----------------------------------------------------------------------------


def simulate(first_step: int, run: list[Tick], policy_for, rng: random.Random, fixed_policy: bool) -> None:
    """Play ``run``; ``policy_for(i)`` is the policy at tick i. With ``fixed_policy`` also check
    what retention promises across the whole run (never deleting what a rule keeps forever)."""
    current: dict[int, CheckpointRecord] = {}
    history: list[CheckpointRecord] = []
    resumed: int | None = None
    step, created = first_step, 1000.0
    for i, tick in enumerate(run):
        if i:
            step += tick.gap
            created += tick.dt
        rec = record(step, created, tick.value)
        current[step] = rec
        history.append(rec)
        policy = policy_for(i)

        pins: set[int] = set()
        if resumed is not None:
            pins.add(resumed)
        if tick.inflight:
            pins.add(step + 1 + rng.randrange(3))  # in flight: not committed yet
        if tick.stale_pin:
            pins.add(rng.choice([h.step for h in history if h.step not in current] or [-1]))
        pinned = sorted(pins)

        records = list(current.values())
        result = kept(records, policy, pinned)
        check_one_run(records, policy, pinned, result)
        check_deterministic(records, policy, pinned, result, rng)

        # across the run
        assert step in result, "the checkpoint that just committed was deleted"
        if resumed is not None:
            assert resumed in result, f"the step resumed from ({resumed}) was deleted"
        if fixed_policy and not policy.keeps_all:
            all_steps = [h.step for h in history]
            if policy.keep_every is not None:
                for s in all_steps:
                    assert s % policy.keep_every != 0 or s in result, f"step {s} (every {policy.keep_every}) was lost"
            if policy.keep_last is not None:
                for s in all_steps[-policy.keep_last:]:
                    assert s in result, f"step {s}, among the last {policy.keep_last} ever, was lost"
            if policy.keep_best is not None:
                for s in best_order(history, policy.mode)[:policy.keep_best]:
                    assert s in result, f"step {s}, among the {policy.keep_best} best ever, was lost"
            if policy.keep_time_interval is not None:
                # deletion never removes a time anchor, so the rule over the survivors gives the
                # same steps as over the whole history
                timed = {s for s, why in result.items() if "time" in why}
                assert timed == time_walk(history, policy.keep_time_interval)
            if policy.protect is not None:
                for s in all_steps:
                    assert not policy.protect(s) or s in result, f"protected step {s} was lost"
        if fixed_policy and policy.keeps_all:
            assert set(result) == {h.step for h in history}

        # delete what is not kept
        current = {s: r for s, r in current.items() if s in result}
        assert current.keys() == result.keys()
        if tick.resume is not None:
            survivors = sorted(current)
            resumed = survivors[tick.resume % len(survivors)]


@SIM_SETTINGS
@given(first=st.integers(0, 5), run=st.lists(ticks, min_size=1, max_size=120), policy=policies(),
       seed=st.integers(0, 2**32 - 1))
def test_simulated_run_fixed_policy(first, run, policy, seed):
    simulate(first, run, lambda i: policy, random.Random(seed), fixed_policy=True)


@settings(max_examples=12, deadline=None)
@given(first=st.integers(0, 5), length=st.integers(300, 500), policy=policies(), seed=st.integers(0, 2**32 - 1))
def test_long_simulated_run_fixed_policy(first, length, policy, seed):
    rng = random.Random(seed)
    simulate(first, random_ticks(rng, length), lambda i: policy, rng, fixed_policy=True)


@SIM_SETTINGS
@given(first=st.integers(0, 5), run=st.lists(ticks, min_size=1, max_size=120),
       pols=st.lists(policies(), min_size=1, max_size=6), choice=st.lists(st.integers(0, 5), min_size=1),
       seed=st.integers(0, 2**32 - 1))
def test_simulated_run_policy_changes_every_step(first, run, pols, choice, seed):
    """Any combination of rules at each step (the run re-configured): the per-call invariants."""
    simulate(first, run, lambda i: pols[choice[i % len(choice)] % len(pols)], random.Random(seed),
             fixed_policy=False)


@settings(max_examples=150, deadline=None)
@given(recs=st.lists(st.tuples(st.integers(0, 60), st.floats(0, 1000), metric_values), max_size=25,
                     unique_by=lambda t: t[0]),
       policy=policies(), pinned=st.lists(st.integers(-5, 70), unique=True, max_size=5),
       seed=st.integers(0, 2**32 - 1))
def test_arbitrary_records(recs, policy, pinned, seed):
    """Any set of records (``created`` not even ordered by step), any pins: the per-call invariants."""
    records = [record(s, c, v) for s, c, v in recs]
    result = kept(records, policy, pinned)
    check_one_run(records, policy, pinned, result)
    check_deterministic(records, policy, pinned, result, random.Random(seed))


# -- examples -----------------------------------------------------------------------------------


def test_empty_input():
    assert kept([], RetentionPolicy()) == {}
    assert kept([], RetentionPolicy(keep_last=2), pinned=[3]) == {}
    assert kept([], RetentionPolicy(keep_best=1, metric=METRIC)) == {}


@pytest.mark.parametrize("policy", [
    RetentionPolicy(),
    RetentionPolicy(keep_last=3),
    RetentionPolicy(keep_every=7),
    RetentionPolicy(keep_best=2, metric=METRIC),
    RetentionPolicy(keep_time_interval=10.0),
])
def test_single_checkpoint_is_kept(policy):
    result = kept([record(5, 1.0, math.nan)], policy)
    assert list(result) == [5]
    assert result[5][0] == "newest"


def test_no_rules_keeps_everything():
    records = [record(s, float(s)) for s in (0, 3, 4, 9)]
    result = kept(records, RetentionPolicy())
    assert set(result) == {0, 3, 4, 9}
    assert all("all" in why for why in result.values())


def test_protect_alone_is_not_a_rule_and_keeps_everything():
    records = [record(s, float(s)) for s in (1, 2, 3)]
    result = kept(records, RetentionPolicy(protect=lambda s: s == 2))
    assert set(result) == {1, 2, 3}


def test_protect_with_rules():
    records = [record(s, float(s)) for s in range(1, 11)]
    result = kept(records, RetentionPolicy(keep_last=1, protect=lambda s: s in (2, 5)))
    assert result == {10: ["newest", "last"], 2: ["protected"], 5: ["protected"]}


@pytest.mark.parametrize("values", [
    [math.nan, math.nan, math.nan],
    [MISSING, MISSING, MISSING],
    [None, math.nan, MISSING],
])
def test_keep_best_with_no_usable_metric_keeps_only_the_newest(values):
    records = [record(s, float(s), v) for s, v in zip((1, 2, 3), values)]
    assert kept(records, RetentionPolicy(keep_best=2, metric=METRIC)) == {3: ["newest"]}


def test_keep_best_ignores_nan_and_missing():
    records = [record(1, 1, 5.0), record(2, 2, math.nan), record(3, 3, MISSING), record(4, 4, 7.0),
               record(5, 5, None), record(6, 6, 9.0)]
    result = kept(records, RetentionPolicy(keep_best=2, metric=METRIC, mode="min"))
    assert result == {6: ["newest"], 1: ["best"], 4: ["best"]}


def test_metric_of_another_name_is_missing():
    records = [CheckpointRecord(1, 1.0, {"acc": 0.1}), CheckpointRecord(2, 2.0, {"acc": 0.9})]
    assert kept(records, RetentionPolicy(keep_best=1, metric=METRIC)) == {2: ["newest"]}


@pytest.mark.parametrize("mode", ["min", "max"])
def test_ties_go_to_the_newer_step(mode):
    records = [record(s, float(s), 1.0) for s in (1, 2, 3)] + [record(4, 4.0, math.nan)]
    result = kept(records, RetentionPolicy(keep_best=1, metric=METRIC, mode=mode))
    assert result == {4: ["newest"], 3: ["best"]}
    result = kept(records, RetentionPolicy(keep_best=2, metric=METRIC, mode=mode))
    assert result == {4: ["newest"], 3: ["best"], 2: ["best"]}


def test_tie_between_zero_and_negative_zero_goes_to_the_newer_step():
    records = [record(1, 1, 0.0), record(2, 2, -0.0), record(3, 3, 1.0)]
    assert kept(records, RetentionPolicy(keep_best=1, metric=METRIC)) == {3: ["newest"], 2: ["best"]}


def test_modes():
    records = [record(1, 1, 3.0), record(2, 2, 1.0), record(3, 3, 2.0), record(4, 4, 0.5)]
    assert kept(records, RetentionPolicy(keep_best=1, metric=METRIC, mode="min")) == {4: ["newest", "best"]}
    assert kept(records, RetentionPolicy(keep_best=1, metric=METRIC, mode="max")) == {4: ["newest"], 1: ["best"]}


def test_infinities_are_candidates():
    """-inf is the best for min, +inf for max; the other infinity is only the worst candidate."""
    records = [record(1, 1, math.inf), record(2, 2, 1.0), record(3, 3, -math.inf), record(4, 4, math.nan)]
    assert kept(records, RetentionPolicy(keep_best=1, metric=METRIC, mode="min")) == {4: ["newest"], 3: ["best"]}
    assert kept(records, RetentionPolicy(keep_best=1, metric=METRIC, mode="max")) == {4: ["newest"], 1: ["best"]}
    # with K larger than the finite candidates, the worst infinity fills a slot (NaN never does)
    result = kept(records, RetentionPolicy(keep_best=4, metric=METRIC, mode="min"))
    assert result == {4: ["newest"], 3: ["best"], 2: ["best"], 1: ["best"]}


def test_best_does_not_evict_the_newest():
    records = [record(10, 1.0, 1.0), record(20, 2.0, 5.0)]
    result = kept(records, RetentionPolicy(keep_best=1, metric=METRIC, mode="min"))
    assert result == {10: ["best"], 20: ["newest"]}


def test_pinned_steps():
    records = [record(s, float(s)) for s in (1, 2, 3, 4)]
    # 2 resumed from, 5 in flight (not committed), 99 stale: only committed pins show up
    result = kept(records, RetentionPolicy(keep_last=1), pinned=[2, 5, 99])
    assert result == {4: ["newest", "last"], 2: ["pinned"]}


def test_keep_last_larger_than_the_set():
    records = [record(s, float(s)) for s in (1, 2, 3)]
    assert set(kept(records, RetentionPolicy(keep_last=10))) == {1, 2, 3}


def test_keep_every_includes_step_zero():
    records = [record(s, float(s)) for s in range(8)]
    assert set(kept(records, RetentionPolicy(keep_every=3))) == {0, 3, 6, 7}


def test_keep_time_interval_definition():
    # created:   0   4   9  10  21  25  31   (interval 10)
    # kept:      x       .   x   x       x    (0 -> 10 -> 21 -> 31; 9 is 9s after 0, not enough)
    created = {1: 0.0, 2: 4.0, 3: 9.0, 4: 10.0, 5: 21.0, 6: 25.0, 7: 31.0}
    records = [record(s, c) for s, c in created.items()]
    result = kept(records, RetentionPolicy(keep_time_interval=10.0))
    assert {s for s, why in result.items() if "time" in why} == {1, 4, 5, 7}
    assert set(result) == {1, 4, 5, 7}


@pytest.mark.parametrize("kwargs", [
    {"keep_best": 1},
    {"keep_best": 1, "metric": None},
    {"keep_last": 0},
    {"keep_last": -1},
    {"keep_every": 0},
    {"keep_every": -3},
    {"keep_best": 0, "metric": METRIC},
    {"mode": "mean"},
    {"mode": "MIN"},
    {"mode": ""},
    {"keep_best": 1, "metric": METRIC, "mode": "best"},
])
def test_invalid_policies_raise(kwargs):
    with pytest.raises(ValueError):
        RetentionPolicy(**kwargs)


@pytest.mark.parametrize("interval", [0, 0.0, -1.0])
def test_time_interval_zero_or_negative_is_refused_or_keeps_everything(interval):
    """``keep_time_interval`` <= 0: by the docstring's definition ("at least that many seconds passed
    since the last one kept by this rule") every checkpoint qualifies, so either the policy is refused
    like ``keep_last=0`` is, or every step is kept. It must never silently delete all but the newest."""
    try:
        policy = RetentionPolicy(keep_time_interval=interval)
    except ValueError:
        return
    records = [record(s, float(s)) for s in (1, 2, 3, 4)]
    assert set(kept(records, policy)) == {1, 2, 3, 4}


def test_two_checkpoints_of_one_step_count_once():
    """A tag saved beside its step's checkpoint (``save(200, tag="final")``) made step 200 count
    twice: keep_last=2 kept one step, keep_best=2 one besides it."""
    records = [record(100, 1.0, 0.3), record(200, 2.0, 0.1), record(200, 3.0, 0.1), record(300, 4.0, 0.5),
               record(400, 5.0, 0.6)]
    assert set(kept(records[:3], RetentionPolicy(keep_last=2))) == {100, 200}
    assert set(kept(records, RetentionPolicy(keep_best=2, metric="loss"))) == {100, 200, 400}


@pytest.mark.parametrize("value", [2.5, True, "2"])
def test_counts_must_be_ints(value):
    """keep_last=2.5 was accepted; every retention round then failed in the background."""
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        RetentionPolicy(keep_last=value)
