"""When a save is due: every N steps and/or every T seconds, with the same answer on every rank."""

from __future__ import annotations

import json
import math
import time
from typing import Callable

from ..collectives import Group

PROBE_STEPS = 10  # steps timed before the first estimate of a step's duration (several ranks)


class SaveSchedule:
    """Decides at each step whether a save is due.

    Steps are a clock all ranks share; seconds are not: each rank reads its own clock at its own
    moment, and ranks that disagree enter the collective save apart and hang. So with several
    ranks only the coordinator reads the time, at steps announced in advance: there it says
    whether ``interval_s`` has passed since the last save and, from the step rate it measured,
    the step half-way to the moment it will have (one small broadcast); no rank communicates in
    between. A save never comes early, and comes late only if the steps slow down more than
    twofold between two checks; a dozen or so checks an interval. With one rank the time is read
    at every step.
    """

    def __init__(self, group: Group, every: int | None, interval_s: float | None,
                 clock: Callable[[], float] | None = None) -> None:
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(f"save_every must be None or an int >= 1 (steps), not {every!r}")
        if interval_s is not None and (type(interval_s) not in (int, float) or not 0 < interval_s < math.inf):
            raise ValueError(f"save_interval_s must be None or a number of seconds > 0, not {interval_s!r}")
        self.group = group
        self.every = every
        self.interval_s = interval_s
        self.clock = clock or time.monotonic
        self._last_save = self.clock()
        self._check_at: int | None = None
        self._mark = (0, 0.0)  # the step and (coordinator's) time of the last check
        self._answer: tuple[int, bool] | None = None  # the last step asked about, and the answer given

    def saved(self) -> None:
        """A save started now: the interval counts from here."""
        self._last_save = self.clock()

    def due(self, step: int) -> bool:
        """Whether ``step`` is due (a collective at announced steps when ``interval_s`` is set);
        asked again for the same step, the same answer (without a collective)."""
        by_step = self.every is not None and step % self.every == 0
        if self.interval_s is None:
            return by_step
        if self._answer is not None and self._answer[0] == step:
            return self._answer[1]
        answer = self._due_in_time(step, by_step)
        self._answer = (step, answer)
        return answer

    def _due_in_time(self, step: int, by_step: bool) -> bool:
        if self._check_at is None or step < self._mark[0]:  # the first call, or steps went back (a restore)
            self._check_at = step if self.group.size == 1 else step + PROBE_STEPS
            self._mark = (step, self.clock())
        if step < self._check_at:
            return by_step
        return self._check(step) or by_step

    def _check(self, step: int) -> bool:
        assert self.interval_s is not None
        now = self.clock()
        decision = None
        if self.group.is_coordinator:
            elapsed = now - self._last_save
            due = elapsed >= self.interval_s
            ahead = 1
            if self.group.size > 1:
                per_step = (now - self._mark[1]) / max(step - self._mark[0], 1)
                remaining = self.interval_s if due else self.interval_s - elapsed
                ahead = max(1, math.ceil(remaining / per_step / 2)) if per_step > 0 else 1
            decision = json.dumps([due, step + ahead]).encode()
        due, self._check_at = json.loads(self.group.broadcast_bytes(decision))
        self._mark = (step, now)
        return due
