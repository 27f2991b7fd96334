"""Asynchronous saves on CPU: staged/committed futures, snapshots, errors, pool, memory, exit."""

from __future__ import annotations

import contextlib
import errno
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist

import zerostall as zs
from faults import GATE_TIMEOUT, FaultyStorage
from zerostall.saving import asynchronous
from zerostall.saving.pipeline import prepare
from zerostall.storage import LocalStorage

TESTS = os.path.dirname(os.path.abspath(__file__))  # for child scripts: where faults.py is


def state_of(value: float, n: int = 1 << 16) -> dict:
    return {"w": torch.full((n,), value), "b": torch.full((3, 3), value).t(), "step": int(value)}


def loaded(path) -> dict:
    target = state_of(0.0)
    return zs.load(target, path)


def test_mutation_after_staged_does_not_reach_the_checkpoint(tmp_path):
    with zs.AsyncSaver() as saver:
        state = state_of(1.0)
        handle = saver.save(state, tmp_path / "ck", step=1)
        handle.wait_staged()
        state["w"].fill_(9.0)
        state["b"].fill_(9.0)
        state["step"] = 9
        info = handle.result()
    assert info.step == 1
    out = loaded(tmp_path / "ck")
    assert torch.equal(out["w"], torch.full((1 << 16,), 1.0)) and out["step"] == 1
    assert torch.equal(out["b"], torch.full((3, 3), 1.0))


def test_background_failure_surfaces_on_the_future_the_next_save_and_close(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    saver = zs.AsyncSaver()
    saver.save(state_of(1.0), tmp_path / "file" / "ck")  # nobody looks at its handle
    with pytest.raises(zs.CheckpointError, match="previous asynchronous save failed: .*cannot create checkpoint"):
        saver.save(state_of(2.0), tmp_path / "ok")
    handle = saver.save(state_of(3.0), tmp_path / "ok")  # reported once, then saving goes on
    handle.result()
    saver.save(state_of(4.0), tmp_path / "file" / "again")
    with pytest.raises(zs.CheckpointError):
        saver.close()
    assert loaded(tmp_path / "ok")["step"] == 3


def gated(path, gate: threading.Event) -> FaultyStorage:
    """``path`` with every data file write held until ``gate`` is set: a save stays in flight."""
    storage = FaultyStorage(LocalStorage(str(path)))
    storage.block("write", gate)
    return storage


class _Waiters(list):
    """A future's list of waiters, where ``concurrent.futures.wait()`` registers one: the first
    opens ``gate``."""

    def __init__(self, waiters: list, gate: threading.Event) -> None:
        super().__init__(waiters)
        self.gate = gate

    def append(self, waiter) -> None:
        self.gate.set()
        super().append(waiter)


@contextlib.contextmanager
def released_by_a_wait(handle, gate: threading.Event) -> Iterator[None]:
    """Inside: ``gate`` is set once someone waits for ``handle``'s save to commit (``result()`` or
    ``exception()`` of its ``committed`` future, or ``concurrent.futures.wait`` on it), not before,
    so a save held at ``gate`` stays held unless it is waited for, however long anything takes.
    On the way out the gate opens in any case."""
    future = handle.committed

    def opening(wait):
        def waited(*args, **kwargs):
            gate.set()
            return wait(*args, **kwargs)
        return waited

    future.result, future.exception = opening(future.result), opening(future.exception)
    future._waiters = _Waiters(future._waiters, gate)
    try:
        yield
    finally:
        gate.set()
        del future.result, future.exception  # they held the future: no cycle left behind


def test_sync_save_waits_for_the_async_one_in_flight(tmp_path):
    gate = threading.Event()
    a = gated(tmp_path / "a", gate)
    handle = zs.async_save(state_of(1.0), a)
    handle.wait_staged()
    with released_by_a_wait(handle, gate):
        zs.save(state_of(2.0), tmp_path / "b")  # waits until the async save committed
        assert handle.done(), "the sync save did not wait for the asynchronous one in flight"
    assert handle.result().step is None
    assert a.names("write")
    assert loaded(tmp_path / "a")["step"] == 1 and loaded(tmp_path / "b")["step"] == 2


def test_a_load_waits_for_the_save_in_flight_to_the_same_checkpoint(tmp_path):
    """It waited for the capture only, and read the checkpoint the save in flight was replacing."""
    zs.save(state_of(1.0), tmp_path / "a")
    gate = threading.Event()
    handle = zs.async_save(state_of(2.0), gated(tmp_path / "a", gate), overwrite=True)
    handle.wait_staged()
    with released_by_a_wait(handle, gate):
        assert zs.load(state_of(0.0), tmp_path / "a")["step"] == 2
    handle.result()


def test_a_load_leaves_an_earlier_asynchronous_failure_to_the_saver(tmp_path, monkeypatch):
    """A load of another, good checkpoint raised the failure of an earlier ``async_save``'s capture
    and loaded nothing; that failure is the saver's to raise (its next save, wait or close)."""
    zs.save(state_of(1.0), tmp_path / "good")

    def failing(*args, **kwargs):
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(asynchronous, "capture", failing)
    zs.async_save({"only_here": torch.ones(5)}, tmp_path / "failed")  # nobody looks at its handle
    assert zs.load(state_of(0.0), tmp_path / "good")["step"] == 1
    monkeypatch.undo()
    with pytest.raises(zs.CheckpointError, match="previous asynchronous save failed: the copy failed"):
        zs.save(state_of(3.0), tmp_path / "next")
    zs.async_save(state_of(4.0), tmp_path / "after").result()  # the process-wide saver holds no failed save on


def test_one_save_in_flight_wait_or_skip(tmp_path):
    gate = threading.Event()
    with zs.AsyncSaver(if_busy="skip") as saver:
        a = gated(tmp_path / "a", gate)
        first = saver.save(state_of(1.0), a, overwrite=True)
        assert saver.save(state_of(2.0), tmp_path / "b", overwrite=True) is None
        gate.set()
        first.result()
        saver.save(state_of(3.0), tmp_path / "b", overwrite=True).result()
    assert a.names("write") and loaded(tmp_path / "b")["step"] == 3
    gate.clear()
    with zs.AsyncSaver() as saver:
        c = gated(tmp_path / "c", gate)
        first = saver.save(state_of(1.0), c, overwrite=True)
        with released_by_a_wait(first, gate):
            second = saver.save(state_of(2.0), tmp_path / "c", overwrite=True)  # waits for the first to commit
            assert first.done(), "the second save did not wait for the first"
        second.result()
    assert c.names("write") and loaded(tmp_path / "c")["step"] == 2


def test_pool_is_reused_and_close_releases_it(tmp_path):
    saver = zs.AsyncSaver()
    assert saver.pool.nbytes == 0 and saver.pool.allocations == 0
    assert saver.reserve(state_of(0.0)) > 0  # allocated now...
    assert saver.pool.nbytes >= (1 << 16) * 4 and saver.pool.allocations == 1
    assert saver.reserve(state_of(5.0)) == 0  # ...once: the same structure fits the pool
    arena = saver.pool.buffers(prepare(state_of(0.0), tmp_path / "x", zs.SaveOptions()).items)[0]
    saver.save(state_of(1.0), tmp_path / "ck").result()
    assert saver.pool.buffers(prepare(state_of(0.0), tmp_path / "x", zs.SaveOptions()).items)[0] is arena
    assert saver.pool.allocations == 1
    saver.close()
    assert saver.pool.nbytes == 0


def test_reserve_waits_for_the_save_in_flight_before_replacing_its_buffers(tmp_path):
    """The buffers a save in flight copies into and writes from are not released under it (a
    pinned arena would be unpinned while a device copy still lands in it)."""
    gate = threading.Event()
    with zs.AsyncSaver() as saver:
        handle = saver.save(state_of(1.0), gated(tmp_path / "a", gate))
        with released_by_a_wait(handle, gate):
            saver.reserve({"other": torch.ones(1 << 10)})  # another structure: a new arena
            assert handle.done(), "reserve did not wait for the save in flight"
        handle.result()
    assert loaded(tmp_path / "a")["step"] == 1 and torch.equal(loaded(tmp_path / "a")["w"], torch.ones(1 << 16))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_fifty_async_saves_keep_memory_flat(tmp_path):
    state = {f"t{i}": torch.randn(1 << 18) for i in range(8)}  # 8 MiB
    with zs.AsyncSaver() as saver:
        for _ in range(3):
            saver.save(state, tmp_path / "ck", overwrite=True).result()
        before = rss_mb()
        for step in range(50):
            saver.save(state, tmp_path / "ck", step=step, overwrite=True).wait_staged()
        saver.wait()
        growth = rss_mb() - before
        assert saver.pool.allocations == 1, "the saves did not reuse the capture pool"
    assert growth < 64, f"RSS grew by {growth:.1f} MB over 50 saves"
    with zs.open(tmp_path / "ck") as ck:
        assert ck.step == 49


def test_exit_drains_the_save_in_flight(tmp_path):
    """The script ends while its save's write is held: the write goes on only once the interpreter
    is exiting (a threading exit hook, registered after zerostall's drain, runs before it)."""
    script = textwrap.dedent(f"""
        import sys, threading, torch
        sys.path.insert(0, {TESTS!r})
        import zerostall as zs
        from faults import FaultyStorage
        from zerostall.storage import LocalStorage

        exiting = threading.Event()
        threading._register_atexit(exiting.set)

        def until_exit(op, name):
            exiting.wait()
            print("write released at exit", flush=True)

        storage = FaultyStorage(LocalStorage({str(tmp_path / "ck")!r}))
        storage.call("write", until_exit)
        zs.async_save({{"w": torch.ones(1000)}}, storage, step=7)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "write released at exit" in proc.stdout, proc.stderr
    with zs.open(tmp_path / "ck") as ck:
        assert ck.step == 7


def test_exit_drains_the_save_in_flight_when_zerostall_is_imported_before_torch(tmp_path):
    """torch, imported after zerostall, loads concurrent.futures, whose exit hook stops taking work
    (a save's write threads). The save is held before its write threads start until a hook
    registered between the two imports runs: the drain must run before concurrent.futures' hook.
    It used to run after it, and the save failed (or, held like this, hung until the gate gave up)."""
    script = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {TESTS!r})
        import zerostall as zs
        from faults import FaultyStorage
        from zerostall.storage import LocalStorage

        exiting = threading.Event()
        threading._register_atexit(exiting.set)
        assert "torch" not in sys.modules  # torch, and with it concurrent.futures, comes after
        import torch

        storage = FaultyStorage(LocalStorage({str(tmp_path / "ck")!r}))
        storage.block("create", exiting)
        zs.async_save({{"w": torch.ones(1000)}}, storage, step=7)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "failed" not in proc.stderr, proc.stderr
    with zs.open(tmp_path / "ck") as ck:
        assert ck.step == 7


def async_on_ranks(path: str) -> dict:
    rank = dist.get_rank()
    state = {"w": torch.full((64,), 2.0), "own": zs.rank_local(torch.full((2,), float(rank)))}
    with zs.AsyncSaver() as saver:
        handle = saver.save(state, path, step=5)
        handle.wait_staged()
        state["w"].fill_(0.0)
        info = handle.result()
    target = {"w": torch.zeros(64), "own": zs.rank_local(torch.zeros(2))}
    zs.load(target, path)
    return {"step": info.step, "w": target["w"][0].item(), "own": target["own"].value.tolist()}


def test_async_save_across_ranks(ranks, tmp_path):
    results = ranks(2).run(async_on_ranks, str(tmp_path / "ck"))
    assert results == [{"step": 5, "w": 2.0, "own": [0.0, 0.0]}, {"step": 5, "w": 2.0, "own": [1.0, 1.0]}]


def skip_on_ranks(path: str) -> list[bool]:
    """Rank 1's first save is held after its ``done`` record, so rank 0 commits it and is done
    while it is still in flight on rank 1 until rank 1 has asked for the second save."""
    rank = dist.get_rank()
    gate = threading.Event()
    first_path = FaultyStorage(LocalStorage(f"{path}/a"))
    held = first_path.block("publish", gate, name="*.done", at="after") if rank == 1 else None
    state = {"w": torch.full((64,), 1.0)}
    with zs.AsyncSaver(if_busy="skip") as saver:
        first = saver.save(state, first_path, step=1)
        if rank == 0:
            first.result()  # done here, in flight on rank 1
        second = saver.save(state, f"{path}/b", step=2)
        gate.set()
        first.result()
        dist.barrier()
        state["w"].fill_(3.0)
        third = saver.save(state, f"{path}/b", step=3)
        third.result()
    assert held is None or held.count == 1
    return [second is None, third is not None]


def test_ranks_skip_together_while_a_save_is_in_flight_on_any_of_them(ranks, tmp_path):
    """A save is collective: if one rank skipped while another saved, the other would wait in the
    save's collectives for good. Rank 0 is done with the first save and rank 1 is not: both skip."""
    assert ranks(2).run(skip_on_ranks, str(tmp_path)) == [[True, True], [True, True]]
    with zs.open(tmp_path / "b") as ck:
        assert ck.step == 3 and ck.read("w")[0].item() == 3.0


def next_save(saver: zs.AsyncSaver, path: str) -> str:
    """What the saver's next save says: "saved", or the error it raised."""
    try:
        saver.save({"w": torch.ones(4)}, path).result()
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def failure_seen_on_rank_0_only(path: str) -> str:
    """Every rank's first save fails (the coordinator's before_commit raises); rank 0's caller looks
    at its handle, rank 1's does not, so rank 1's next save raises the failure."""
    def refuse() -> None:
        raise RuntimeError("refused")

    with zs.AsyncSaver() as saver:
        first = saver.save({"w": torch.ones(4)}, f"{path}/a", before_commit=refuse)
        futures.wait([first.committed])
        if dist.get_rank() == 0:
            with pytest.raises(RuntimeError, match="refused"):
                first.result()
        return next_save(saver, f"{path}/b")


def failure_arriving_while_the_next_save_waits(path: str) -> str:
    """Rank 0's commit takes longer than the commit timeout: rank 1 gives up on that save (its
    failure arrives while its next save waits for it); rank 0 commits it."""
    with zs.AsyncSaver() as saver:
        saver.save({"w": torch.ones(4)}, f"{path}/a", commit_timeout=0.5, before_commit=lambda: time.sleep(2))
        return next_save(saver, f"{path}/b")


@pytest.mark.parametrize("scenario", [failure_seen_on_rank_0_only, failure_arriving_while_the_next_save_waits])
def test_a_failure_one_rank_has_not_seen_refuses_the_next_save_on_every_rank(ranks, tmp_path, scenario):
    """Rank 1 used to raise alone, and rank 0 waited in the save's collectives for good: a failure
    seen on rank 0 only, or one arriving while the next save waits for the save in flight (the
    failures were checked before that wait)."""
    rank0, rank1 = ranks(2).run(scenario, str(tmp_path), timeout=60)
    assert rank1.startswith("CheckpointError: a previous asynchronous save failed:"), rank1
    assert rank0.startswith("CheckpointError: a previous asynchronous save failed on 1 other rank(s)"), rank0
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_sigterm_lets_the_save_in_flight_commit(tmp_path):
    """SIGTERM arrives while the save's write is held; the signal opens the hold, then the saver's
    handler drains the save and lets the signal end the process."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time, torch
        sys.path.insert(0, {TESTS!r})
        import zerostall as zs
        from faults import FaultyStorage
        from zerostall.storage import LocalStorage

        gate = threading.Event()
        storage = FaultyStorage(LocalStorage({str(tmp_path / "ck")!r}))
        held = storage.block("write", gate)
        saver = zs.AsyncSaver(drain_on_signals=[signal.SIGTERM])
        drain = signal.getsignal(signal.SIGTERM)

        def open_then_drain(signum, frame):
            gate.set()
            drain(signum, frame)

        signal.signal(signal.SIGTERM, open_then_drain)
        saver.save({{"w": torch.ones(1000)}}, storage, step=3).wait_staged()
        held.fired.wait()
        print("write held when the signal came", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -15, proc.stderr  # the signal still ends the process, after the commit
    assert "write held when the signal came" in proc.stdout
    with zs.open(tmp_path / "ck") as ck:
        assert ck.step == 3


def test_a_child_forked_with_a_save_in_flight_exits_and_leaves_the_save_to_its_parent(tmp_path):
    """The child inherited the parent's savers: its exit waited for a save only the parent's threads
    could finish (it hung for good), and with writer="process" it stopped the parent's writer."""
    script = textwrap.dedent(f"""
        import os, sys, threading, torch
        sys.path.insert(0, {TESTS!r})
        import zerostall as zs
        from faults import FaultyStorage
        from zerostall.storage import LocalStorage

        gate = threading.Event()
        storage = FaultyStorage(LocalStorage({str(tmp_path / "ck")!r}))
        storage.block("write", gate)
        saver = zs.AsyncSaver()
        handle = saver.save({{"w": torch.ones(1000)}}, storage, step=3)
        writer = zs.AsyncSaver(writer="process")
        writer.save({{"w": torch.ones(10)}}, {str(tmp_path / "a")!r}).result()
        pid = os.fork()
        if pid == 0:
            try:
                saver.save({{"w": torch.ones(10)}}, {str(tmp_path / "child")!r})
            except zs.CheckpointError as exc:
                print("child:", exc, flush=True)
            sys.exit(0)  # the save in flight is the parent's
        _, status = os.waitpid(pid, 0)
        print("child exited", os.waitstatus_to_exitcode(status), flush=True)
        gate.set()
        print("committed", handle.result().step, flush=True)
        print("writer", writer.save({{"w": torch.ones(10)}}, {str(tmp_path / "b")!r}).result().step, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "child: this AsyncSaver belongs to process" in proc.stdout
    assert "child exited 0\ncommitted 3\nwriter None" in proc.stdout, proc.stdout
    assert "writer process died" not in proc.stderr


PROCESS_WRITER = f"""
import fcntl, os, signal, sys, torch
sys.path.insert(0, {TESTS!r})
import zerostall as zs
from faults import CommitHeldByLock

if __name__ == "__main__":
    path, lock, how = sys.argv[1], sys.argv[2], sys.argv[3]
    held = open(lock, "wb")
    fcntl.flock(held, fcntl.LOCK_EX)  # the writer process's commit waits for this lock: until the kill
    state = {{"w": torch.full((1 << 20,), 1.0), "step": 1}}
    saver = zs.AsyncSaver(writer="process")
    handle = saver.save(state, CommitHeldByLock(path, lock=lock), step=1)
    handle.wait_staged()
    state["w"].fill_(2.0)
    if how != "live":
        print("manifest before the kill:", os.path.exists(os.path.join(path, "manifest.json")), flush=True)
    if how == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "term":  # as Slurm's scancel or a terminal's kill: the trainer's whole process group
        os.killpg(os.getpgid(0), signal.SIGTERM)
    fcntl.flock(held, fcntl.LOCK_UN)
    print("committed", handle.result().step, flush=True)
    saver.close()
"""


@pytest.mark.parametrize("how", ["live", "die", "term"],
                         ids=["normal", "trainer-killed-after-staged", "process-group-terminated"])
def test_process_writer_commits_even_if_the_trainer_dies(tmp_path, how):
    """The writer process finishes the save handed over when the trainer is killed, or when SIGTERM
    reaches the whole process group (the writer ignores it, then exits with the trainer gone)."""
    script = tmp_path / "train.py"
    script.write_text(PROCESS_WRITER)
    path = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "lock"), how],
                          capture_output=True, text=True, timeout=180, start_new_session=True)
    assert proc.returncode == {"live": 0, "die": -9, "term": -15}[how], proc.stderr
    if how != "live":  # the trainer died before the commit (held until then): the writer process finished it alone
        assert "manifest before the kill: False" in proc.stdout
    deadline = time.monotonic() + 60  # for the orphaned writer process to commit (not a timing bound)
    while not (path / "manifest.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    target = {"w": torch.zeros(1 << 20), "step": 0}
    zs.load(target, path)
    assert target["step"] == 1 and torch.equal(target["w"], torch.ones(1 << 20))
    assert zs.verify(path) == 4 << 20  # the writer process's files, their blocks and headers


def test_a_dead_writer_process_is_replaced(tmp_path):
    """A writer process killed between saves (the OOM killer, say) costs nothing: the next save
    starts a new one and commits; it used to fail that save and every later one (broken pipe)."""
    state = {"w": torch.arange(1000.0)}
    saver = zs.AsyncSaver(writer="process")
    try:
        saver.save(state, tmp_path / "a").result()
        writers = [p for p in multiprocessing.active_children() if p.name == "zerostall-writer"]
        assert len(writers) == 1
        os.kill(writers[0].pid, signal.SIGKILL)
        writers[0].join(30)
        assert saver.save(state, tmp_path / "b", step=2).result().step == 2
    finally:
        saver.close()
    assert torch.equal(zs.load({"w": torch.zeros(1000)}, tmp_path / "b")["w"], state["w"])


def test_a_failure_seen_on_its_handle_is_not_raised_again_one_nobody_saw_is(tmp_path):
    storage = FaultyStorage(LocalStorage(str(tmp_path / "ck")))
    disk_full = storage.fail("write", OSError(errno.ENOSPC, "No space left on device"), times=2)
    saver = zs.AsyncSaver()
    handle = saver.save(state_of(1.0), storage)
    with pytest.raises(zs.CheckpointError, match="No space left"):
        handle.result()  # seen here...
    assert saver.save(state_of(2.0), tmp_path / "ok").result().step is None  # ...so the next save goes on
    storage.fail("write", OSError(errno.ENOSPC, "No space left on device"))
    saver.save(state_of(3.0), storage)  # nobody looks at this one's handle
    with pytest.raises(zs.CheckpointError, match="a previous asynchronous save failed: .*No space left"):
        saver.save(state_of(4.0), tmp_path / "ok2")
    saver.close()  # raised once, by the save above: not again
    assert disk_full.fired.is_set()


def test_a_failure_seen_on_the_committed_future_is_not_raised_again(tmp_path):
    """``handle.committed.result()`` sees a failure as ``handle.result()`` does: the next save and
    close go on (the failure was raised twice before, once by the future and again by the save)."""
    storage = FaultyStorage(LocalStorage(str(tmp_path / "ck")))
    storage.fail("write", OSError(errno.ENOSPC, "No space left on device"))
    saver = zs.AsyncSaver()
    handle = saver.save(state_of(1.0), storage)
    with pytest.raises(zs.CheckpointError, match="No space left"):
        handle.committed.result()  # seen here...
    assert saver.save(state_of(2.0), tmp_path / "ok").committed.result().step is None  # ...not again
    storage.fail("write", OSError(errno.ENOSPC, "No space left on device"))
    failing = saver.save(state_of(3.0), storage)
    assert isinstance(failing.committed.exception(), zs.CheckpointError)  # returned to the caller: seen too
    saver.close()
    assert loaded(tmp_path / "ok")["step"] == 2


def test_a_failure_a_done_callback_sees_is_not_raised_again_by_the_next_save(tmp_path):
    """The next save used to wake before the callbacks ran, and raised the failure a second time."""
    storage = FaultyStorage(LocalStorage(str(tmp_path / "ck")))
    storage.fail("write", OSError(errno.ENOSPC, "No space left on device"))
    seen: list[BaseException | None] = []

    def on_done(fut: Future) -> None:
        time.sleep(0.2)  # it reports something first
        seen.append(fut.exception())

    with zs.AsyncSaver() as saver:
        saver.save(state_of(1.0), storage).committed.add_done_callback(on_done)
        assert saver.save(state_of(2.0), tmp_path / "ok").result().step is None
    assert isinstance(seen[0], zs.CheckpointError)


def test_a_failure_raised_by_the_next_save_first_is_still_the_futures_outcome_and_raised_once(tmp_path):
    """The other order: the next save reports the failure nobody looked at; the handle's futures
    still tell it (a future's outcome does not change), and close does not raise it a third time."""
    storage = FaultyStorage(LocalStorage(str(tmp_path / "ck")))
    storage.fail("write", OSError(errno.ENOSPC, "No space left on device"))
    saver = zs.AsyncSaver()
    handle = saver.save(state_of(1.0), storage)
    with pytest.raises(zs.CheckpointError, match="a previous asynchronous save failed: .*No space left"):
        saver.save(state_of(2.0), tmp_path / "ok")
    with pytest.raises(zs.CheckpointError, match="No space left"):
        handle.committed.result()
    assert saver.save(state_of(3.0), tmp_path / "ok").committed.result().step is None
    saver.close()
    assert loaded(tmp_path / "ok")["step"] == 3


def test_a_managers_async_failure_is_raised_by_its_next_save(tmp_path):
    """The manager's own done callback looked at the failure (``committed.exception()``), which
    counted it as seen: nobody was told, and the next save went on as if step 1 had committed."""
    root = FaultyStorage(LocalStorage(str(tmp_path)))
    root.fail("write", OSError(errno.ENOSPC, "No space left on device"), name="step_000000001/*")
    with zs.CheckpointManager(root, async_save=True) as mgr:
        failed = mgr.save(1, state_of(1.0))
        futures.wait([failed.committed])
        with pytest.raises(zs.CheckpointError, match="a previous asynchronous save failed: .*No space left"):
            mgr.save(2, state_of(2.0))
        mgr.save(3, state_of(3.0)).result()
        assert [tag for tag, _ in mgr.checkpoints()] == ["step_000000003"]


def test_a_wait_that_times_out_just_before_the_failure_arrives_has_not_seen_it(tmp_path):
    """``handle.result(timeout)`` raises TimeoutError; a failure set between that and the check of
    what was raised was counted as seen, so no later save or close raised it."""
    gate = threading.Event()
    storage = gated(tmp_path / "ck", gate)
    storage.fail("write", OSError(errno.EIO, "Input/output error"))  # once the gate opens
    saver = zs.AsyncSaver()
    handle = saver.save(state_of(1.0), storage)

    def failure_arrives() -> bool:  # the worker fails the save just after the wait below timed out
        gate.set()
        futures.wait([handle.committed])
        return Future.done(handle.committed)

    handle.committed.done = failure_arrives
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.01)
    assert not handle.failure_seen
    with pytest.raises(zs.CheckpointError, match="a previous asynchronous save failed: .*Input/output"):
        saver.save(state_of(2.0), tmp_path / "ok")
    saver.close()


def test_a_save_in_flight_cannot_be_cancelled(tmp_path):
    """``handle.committed.cancel()`` succeeded on a save in flight: the worker's ``set_result``
    then raised, the committed checkpoint was reported as failed, and every wait on the future
    (``saver.wait()``, the next save, ``close()``) hung for good."""
    saver = zs.AsyncSaver()
    gate = threading.Event()
    handle = saver.save(state_of(1.0), gated(tmp_path / "ck", gate), step=1)
    handle.wait_staged()
    assert handle.committed.cancel() is False and handle.staged.cancel() is False
    gate.set()
    assert handle.result(timeout=GATE_TIMEOUT).step == 1 and not handle.committed.cancelled()
    saver.save(state_of(2.0), tmp_path / "ok").result(timeout=GATE_TIMEOUT)
    saver.close()
    assert loaded(tmp_path / "ck")["step"] == 1


def test_save_builds_its_bookkeeping_with_the_cyclic_collector_paused(tmp_path):
    """Like zs.save: collections over a state's per-leaf objects would land in the caller's wait
    (a full one walks every object of the process)."""
    state = {"t": [torch.zeros(4) for _ in range(3000)]}
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    with zs.AsyncSaver() as saver:
        saver.save(state, str(tmp_path / "a")).result()
        gc.callbacks.append(count)
        try:
            handle = saver.save(state, str(tmp_path / "b"))
        finally:
            gc.callbacks.remove(count)
        handle.result()
    assert len(collections) <= 1 and gc.isenabled()  # at most the one its leftovers start once collection resumes


def test_a_state_with_an_inference_mode_tensor_saves_asynchronously(tmp_path):
    """Inference-mode tensors keep no version counter: the change check skips them, the save goes on."""
    with torch.inference_mode():
        frozen = torch.arange(10.0)
    state = {"frozen": frozen, "w": torch.ones(3)}
    with zs.AsyncSaver() as saver:
        for n in range(2):  # the second save collects again from the first
            saver.save(state, tmp_path / f"s{n}").result()
    for n in range(2):
        with zs.open(tmp_path / f"s{n}") as ck:
            assert torch.equal(ck.read("frozen"), frozen) and torch.equal(ck.read("w"), state["w"])
