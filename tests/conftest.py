"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from types import ModuleType

import pytest
from distributed import RankPool


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """Factory: ``ranks(n)`` gives a live :class:`RankPool` of ``n`` ranks.

    One pool per world size is kept for the whole session and reused while it is alive; a pool
    torn down by a dead worker, a timeout or a failed health check is replaced by a fresh one.
    All pools are closed at the end of the session.
    """
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close()
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


class TaskLog:
    """The futures of every task submitted to one module's thread pools, so that a test can hold a
    thread back until another thread's task has failed."""

    def __init__(self) -> None:
        self.tasks: list[Future] = []

    def wait_for_a_failure(self, timeout: float = 10.0) -> None:
        done, _ = wait(list(self.tasks), timeout=timeout, return_when=FIRST_EXCEPTION)
        assert any(task.exception() is not None for task in done), "no task failed"


@pytest.fixture
def task_log(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], TaskLog]:
    """Factory: ``task_log(module)`` records the tasks that ``module``'s ThreadPoolExecutors run."""

    def record(module: ModuleType) -> TaskLog:
        log = TaskLog()

        class RecordingPool(module.ThreadPoolExecutor):  # type: ignore[name-defined]
            def submit(self, *args, **kwargs) -> Future:
                log.tasks.append(super().submit(*args, **kwargs))
                return log.tasks[-1]

        monkeypatch.setattr(module, "ThreadPoolExecutor", RecordingPool)
        return log

    return record
