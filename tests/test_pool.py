"""The RankPool test harness itself: real gloo groups in persistent worker processes.

Design choice under test: a task that raises on some ranks while every rank still returns leaves
the pool alive (after a health-check all_reduce); a dead worker, a timeout or a failed health
check tears the pool down, and the ``ranks`` fixture replaces it on the next request.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, RankPool

# A run timeout no test reaches: where a test checks that a death is noticed without waiting for
# the run's timeout, a pool that waited for it would hang, and pytest-timeout fails the test. No
# wall-clock bound of the test's own then depends on how fast the machine is.
NEVER = 3600.0

# --- functions run on the ranks (module level, so the workers can import them) ---


def rank_info() -> tuple[int, int, float, int, str | None, int]:
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return (dist.get_rank(), dist.get_world_size(), t.item(), os.getpid(),
            os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())


def pid() -> int:
    return os.getpid()


def fail_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return dist.get_rank()


def kill_self_on(victim: int, survivor_seconds: float) -> int:
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(survivor_seconds)
    return dist.get_rank()


def kill_self_during_barrier(victim: int) -> str:
    if dist.get_rank() == victim:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return "unreachable"


def barrier_on_rank0_only() -> int:
    if dist.get_rank() == 0:
        dist.barrier()
    return dist.get_rank()


def leave_async_collective_pending() -> None:
    """Rank 0 leaves an all_reduce in flight; rank 1 raises: the group is now out of step."""
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 skipped the collective")
    dist.all_reduce(torch.ones(1), async_op=True)


def scale(t: torch.Tensor, factor: float = 1.0, *, offset: float = 0.0) -> torch.Tensor:
    return t * factor + offset + dist.get_rank()


def unpicklable_result() -> object:
    return lambda: None


def read_env(name: str) -> str | None:
    return os.environ.get(name)


# --- tests ---


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_and_world_size_with_all_reduce(ranks, world_size: int) -> None:
    out = ranks(world_size).run(rank_info)
    total = world_size * (world_size + 1) / 2
    assert [o[:3] for o in out] == [(r, world_size, total) for r in range(world_size)]
    assert len({o[3] for o in out}) == world_size  # one process per rank
    assert all(o[4:] == ("1", 1) for o in out)  # one thread each


def test_pool_is_reused(ranks) -> None:
    pool = ranks(2)
    first = pool.run(pid)
    assert ranks(2) is pool
    assert pool.run(pid) == first == pool.pids


def test_per_rank_arguments_kwargs_and_tensors(ranks) -> None:
    pool = ranks(2)
    out = pool.run_per_rank(scale, [(torch.ones(3), 2.0), (torch.ones(3), 3.0)], offset=0.5)
    assert torch.equal(out[0], torch.full((3,), 2.5))
    assert torch.equal(out[1], torch.full((3,), 4.5))
    with pytest.raises(ValueError, match="3 argument tuples for 2 ranks"):
        pool.run_per_rank(scale, [(torch.ones(1),)] * 3)


def test_exception_names_rank_and_keeps_pool(ranks) -> None:
    pool = ranks(2)
    pids = pool.run(pid)
    with pytest.raises(RankError) as info:
        pool.run(fail_on, 1)
    err = info.value
    assert list(err.failures) == [1] and err.results == {0: 0}
    assert not err.dead and not err.timed_out
    failure = err.failures[1]
    assert failure.type == "builtins.ValueError"
    assert failure.message == "deliberate failure on rank 1"
    assert "in fail_on" in failure.traceback and "raise ValueError" in failure.traceback
    assert "rank 1 raised builtins.ValueError" in str(err)
    assert "traceback of rank 1" in str(err) and "in fail_on" in str(err)
    assert pool.alive and ranks(2) is pool  # every rank returned: the pool stays
    assert pool.run(pid) == pids


def test_unpicklable_result_is_an_error_not_a_hang(ranks) -> None:
    pool = ranks(2)
    with pytest.raises(RankError) as info:
        pool.run(unpicklable_result, timeout=30)
    assert sorted(info.value.failures) == [0, 1]
    assert pool.alive


def test_local_function_is_refused(ranks) -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match="module-level"):
        ranks(2).run(local)


def test_killed_rank_is_reported_promptly_and_pool_replaced(ranks) -> None:
    pool = ranks(2)
    with pytest.raises(RankError) as info:
        pool.run(kill_self_on, 1, 1.0, timeout=NEVER)  # the survivor takes 1 s more
    assert info.value.dead == [1] and info.value.results == {0: 0}  # noticed through the sentinel
    assert not info.value.failures and not info.value.timed_out
    assert "rank(s) [1] died" in str(info.value)
    assert not pool.alive
    with pytest.raises(RuntimeError, match="closed or broken"):
        pool.run(pid)
    fresh = ranks(2)
    assert fresh is not pool and fresh.alive
    assert [o[:3] for o in fresh.run(rank_info)] == [(0, 2, 3.0), (1, 2, 3.0)]


def test_survivors_of_a_death_get_death_grace_seconds(ranks) -> None:
    pool = ranks(2)
    with pytest.raises(RankError) as info:
        pool.run(kill_self_on, 1, NEVER, timeout=NEVER, death_grace=1)  # the survivor never finishes
    assert info.value.dead == [1] and info.value.timed_out == [0] and not info.value.results
    assert not pool.alive


def test_peers_blocked_on_a_killed_rank_fail_promptly(ranks) -> None:
    pool = ranks(4)
    with pytest.raises(RankError) as info:
        pool.run(kill_self_during_barrier, 2, timeout=NEVER)
    err = info.value
    assert err.dead == [2] and not err.timed_out
    assert sorted(err.failures) == [0, 1, 3]  # gloo: "Connection closed by peer"
    assert "Connection closed by peer" in err.failures[0].message
    assert not pool.alive


def test_rank_stuck_in_collective_times_out(ranks) -> None:
    pool = ranks(2)
    start = time.monotonic()
    with pytest.raises(RankError, match="did not finish before the timeout") as info:
        pool.run(barrier_on_rank0_only, timeout=3)
    assert time.monotonic() - start >= 3  # not before the timeout (whatever the machine's speed)
    assert info.value.timed_out == [0] and info.value.results == {1: 1}
    assert not pool.alive
    fresh = ranks(2)
    assert fresh is not pool and fresh.run(fail_on, -1) == [0, 1]


def test_group_out_of_step_after_an_error_is_torn_down(ranks) -> None:
    pool = ranks(2)
    with pytest.raises(RankError, match="failed its health check") as info:
        pool.run(leave_async_collective_pending)
    assert list(info.value.failures) == [1]
    assert not pool.alive and ranks(2).run(fail_on, -1) == [0, 1]


def test_function_from_module_not_on_sys_path(ranks, tmp_path: Path, monkeypatch) -> None:
    """Like a test module that pytest imported under a name the workers cannot import."""
    import importlib.util

    path = tmp_path / "helper_mod.py"
    path.write_text("import torch.distributed as dist\n\n"
                    "def twice():\n    return 2 * dist.get_rank()\n")
    spec = importlib.util.spec_from_file_location("not_a_pkg.helper_mod", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "not_a_pkg.helper_mod", mod)
    spec.loader.exec_module(mod)
    assert ranks(2).run(mod.twice) == [0, 2]


def test_env_passthrough_and_clean_close() -> None:
    pool = RankPool(2, env={"ZS_POOL_TEST": "yes"}, timeout=30)
    try:
        assert pool.run(read_env, "ZS_POOL_TEST") == ["yes", "yes"]
    finally:
        pool.close()
    assert not pool.alive
    for p in pool.pids:
        with pytest.raises(ProcessLookupError):  # exited and reaped
            os.kill(p, 0)
    pool.close()  # idempotent
