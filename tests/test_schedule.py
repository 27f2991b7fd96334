"""SaveSchedule / CheckpointManager.should_save: by steps, by seconds, the same answer on every rank."""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist

import zerostall as zs
from zerostall.collectives import Group
from zerostall.roots.schedule import SaveSchedule


class Clock:
    """A clock the test moves: ``now`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(schedule: SaveSchedule, clock: Clock, durations: list[float]) -> list[int]:
    """Steps 1.. taking ``durations`` seconds each; the steps a save was due at (and was made)."""
    saved = []
    for step, seconds in enumerate(durations, start=1):
        clock.now += seconds
        if schedule.due(step):
            schedule.saved()
            saved.append(step)
    return saved


def test_one_rank_saves_every_n_steps_and_at_the_first_step_past_the_interval():
    assert run(SaveSchedule(Group(), 4, None), Clock(), [1.0] * 12) == [4, 8, 12]
    clock = Clock()
    assert run(SaveSchedule(Group(), None, 10.0, clock), clock, [3.0] * 12) == [4, 8, 12]
    clock = Clock()
    assert run(SaveSchedule(Group(), 5, 10.0, clock), clock, [3.0] * 12) == [4, 5, 9, 10]
    assert run(SaveSchedule(Group(), None, None), Clock(), [1.0] * 5) == []


def test_asking_twice_about_one_step_gives_one_answer():
    """With save_interval_s, the second question about a due step (an eval's, then the save's)
    said no, and a loop that saved on the second answer never saved."""
    clock = Clock()
    schedule = SaveSchedule(Group(), None, 10.0, clock)
    saved = []
    for step in range(1, 13):
        clock.now += 3.0
        first = schedule.due(step)
        if schedule.due(step):
            assert first
            schedule.saved()
            saved.append(step)
    assert saved == [4, 8, 12]


@pytest.mark.parametrize("every, interval", [(0, None), (-10, None), (2.5, None), (True, None), (None, 0.0),
                                             (None, -1.0), (None, float("nan")), (None, float("inf"))])
def test_a_bad_cadence_is_refused_when_built(every, interval):
    """save_every=0 raised ZeroDivisionError at the first should_save; a NaN interval never saved."""
    with pytest.raises(ValueError, match="save_every|save_interval_s"):
        SaveSchedule(Group(), every, interval)


class JitteryClock(Clock):
    """Rank ``rank``'s clock: the shared time of the step, plus this rank's own lag at that step
    (ranks reach a step at slightly different moments)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rng = random.Random(rank)

    def __call__(self) -> float:
        return self.now + self.rng.uniform(0.0, 0.4)


def durations(seed: int = 5) -> list[float]:
    rng = random.Random(seed)  # about 1 s a step, then about 3 s (an evaluation phase, a slower node)
    return [rng.uniform(0.8, 1.2) for _ in range(60)] + [rng.uniform(2.5, 3.5) for _ in range(60)]


def naive(rank: int, interval: float) -> list[int]:
    """The steps a rank would find due by reading its own clock at every step."""
    clock, saved, last = JitteryClock(rank), [], 0.0
    for step, seconds in enumerate(durations(), start=1):
        clock.now += seconds
        now = clock()
        if now - last >= interval:
            saved.append(step)
            last = now
    return saved


def decisions(interval: float) -> tuple[list[int], list[float]]:
    """On this rank: the steps found due, and the shared times the saves were made."""
    clock = JitteryClock(dist.get_rank())
    saved = run(SaveSchedule(Group(), None, interval, clock), clock, durations())
    times, now = [], 0.0
    for step, seconds in enumerate(durations(), start=1):
        now += seconds
        if step in saved:
            times.append(now)
    return saved, times


def test_ranks_whose_clocks_disagree_agree_on_every_save(ranks):
    """Each rank reads its clock at its own moment: decided by each rank's own reading, the ranks
    would disagree (one enters the collective save, the other trains on: a hang). The
    coordinator's decision is the one every rank follows."""
    assert naive(0, 10.0) != naive(1, 10.0)
    (steps0, times0), (steps1, times1) = ranks(2).run(decisions, 10.0)
    assert steps0 == steps1 and len(steps0) >= 15
    gaps = [b - a for a, b in zip([0.0] + times0, times0)]
    assert min(gaps) >= 10.0 - 0.4  # never early (by the coordinator's clock, which lags by up to 0.4 s)
    assert max(gaps) <= 10.0 + 2 * 3.5  # late by two steps at most, even right after the step rate tripled


def test_manager_should_save_follows_the_schedule_and_counts_from_the_last_save(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr("time.monotonic", clock)
    mgr = zs.CheckpointManager(tmp_path, save_interval_s=10.0, fsync=False)  # takes the clock of its time
    monkeypatch.undo()
    with mgr:
        saved = []
        for step in range(1, 13):
            clock.now += 3.0
            if mgr.should_save(step):
                mgr.save(step, {"x": step})
                saved.append(step)
        assert saved == [4, 8, 12]
