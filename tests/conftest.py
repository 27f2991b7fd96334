"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

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
