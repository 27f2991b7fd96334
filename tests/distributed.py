"""A pool of persistent worker processes, one per rank of a real gloo process group.

Starting a process and importing torch costs seconds, so distributed tests share workers: a
``RankPool(n)`` spawns ``n`` workers once, each joins one ``gloo`` group (CPU, loopback), and
``pool.run(fn, ...)`` runs a module-level ``fn`` on every rank at once and returns the per-rank
results in rank order. Arguments and results travel as plain pickles (tensors are copied).

Failures raise :class:`RankError` once every rank's outcome is known:

- some ranks raised and every rank returned: the pool checks with one all_reduce that the group
  still works and stays alive if it does (else it is torn down);
- a worker died (e.g. it SIGKILLed itself): noticed at once through its process sentinel; the
  other ranks still get up to ``death_grace`` seconds to finish (their own failure detection,
  e.g. a commit timeout, usually ends sooner; gloo fails collectives with a dead peer in well
  under a second), then the pool is torn down;
- ``timeout`` expired (e.g. a rank blocked in a collective): the pool is torn down.

A torn-down pool cannot be reused (``pool.alive`` is False): make a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SRC_DIR = os.path.join(os.path.dirname(TESTS_DIR), "src")
_SHUTDOWN = b""  # an empty task tells a worker to exit


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised on one rank: qualified type name, message, formatted traceback."""

    rank: int
    type: str
    message: str
    traceback: str


_Outcome = tuple[dict[int, Any], dict[int, RemoteFailure], list[int], list[int]]
"""What one task came to: results, failures, dead ranks, timed-out ranks."""


class RankError(RuntimeError):
    """Ranks raised (``failures``), died (``dead``) or did not finish (``timed_out``).

    ``results`` maps the ranks that returned normally to their results.
    """

    def __init__(self, failures: dict[int, RemoteFailure], dead: list[int],
                 timed_out: list[int], results: dict[int, Any], note: str = "") -> None:
        self.failures, self.dead, self.timed_out, self.results = failures, dead, timed_out, results
        lines = [f"rank {r} raised {f.type}: {f.message}" for r, f in sorted(failures.items())]
        lines += [f"rank(s) {dead} died"] if dead else []
        lines += [f"rank(s) {timed_out} did not finish before the timeout"] if timed_out else []
        lines += [note] if note else []
        lines += [f"--- traceback of rank {r} ---\n{f.traceback.rstrip()}"
                  for r, f in sorted(failures.items())]
        super().__init__("\n".join(lines))


def _failure(rank: int, exc: BaseException) -> RemoteFailure:
    cls = type(exc)
    return RemoteFailure(rank, f"{cls.__module__}.{cls.__qualname__}", str(exc),
                         "".join(traceback.format_exception(exc)))


def _resolve(module: str, qualname: str, path: str | None) -> Callable[..., Any]:
    """Import ``module``, or load it from ``path`` under the same name if that fails (pytest
    may import test modules under names that are not importable from ``sys.path``)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        if path is None:
            raise
        if os.path.dirname(path) not in sys.path:
            sys.path.insert(0, os.path.dirname(path))  # for the module's own sibling imports
        spec = importlib.util.spec_from_file_location(module, path)
        assert spec is not None and spec.loader is not None, path
        mod = sys.modules[module] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[module]
            raise
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _die_with_parent(parent_pid: int) -> None:
    """On Linux, have the kernel SIGKILL this worker when the parent dies, however it dies."""
    with contextlib.suppress(AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it died before that
        os._exit(1)


def _worker(rank: int, world_size: int, store_port: int, timeout_s: float,
            env: dict[str, str], parent_pid: int, conn: Connection) -> None:
    """Worker main: join the group, then run tasks until told to stop or the parent is gone."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.update(env)  # before torch is imported
    sys.path[:0] = [p for p in (TESTS_DIR, SRC_DIR) if p not in sys.path]
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    except BaseException as e:
        conn.send_bytes(pickle.dumps((False, _failure(rank, e))))
        return
    conn.send_bytes(pickle.dumps((True, os.getpid())))
    while (task := _recv_or_shutdown(conn)) != _SHUTDOWN:
        try:
            module, qualname, path, payload = pickle.loads(task)
            fn = _resolve(module, qualname, path)
            args, kwargs = pickle.loads(payload)  # after the import: args may use its classes
            reply = pickle.dumps((True, fn(*args, **kwargs)), pickle.HIGHEST_PROTOCOL)
        except BaseException as e:
            reply = pickle.dumps((False, _failure(rank, e)))
        conn.send_bytes(reply)
    if dist.is_initialized():  # unless a task destroyed it
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips torch's interpreter teardown, about 1 s a process here


def _recv_or_shutdown(conn: Connection) -> bytes:
    """The next task; a shutdown if the parent is gone."""
    try:
        return conn.recv_bytes()
    except EOFError:
        return _SHUTDOWN


def _check_group() -> float:
    """The health check after a failed task: every rank must see the right sum."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _teardown(procs: list[mp.process.BaseProcess], conns: list[Connection],
              graceful: bool) -> None:
    """Stop the workers (asking them to exit first if ``graceful``) and reap them."""
    if graceful:
        for c in conns:
            with contextlib.suppress(OSError):  # unless that worker is already gone
                c.send_bytes(_SHUTDOWN)
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()


class RankPool:
    """``world_size`` persistent worker processes forming one gloo process group.

    ``env`` adds environment variables in the workers (set before they import torch);
    ``timeout`` is the process group's collective timeout in seconds. Not thread-safe.
    ``pids`` lists the workers' process ids in rank order.
    """

    def __init__(self, world_size: int, env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> None:
        from torch.distributed import TCPStore

        self.world_size = world_size
        # The rendezvous store lives here: no port race, no files, survives worker deaths.
        self._store = TCPStore("127.0.0.1", 0, world_size, is_master=True,
                               wait_for_workers=False, timeout=timedelta(seconds=timeout))
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._broken = False
        # Runs on close(), on garbage collection and at exit (before multiprocessing's join).
        self._finalizer = multiprocessing.util.Finalize(
            self, _teardown, (self._procs, self._conns, True), exitpriority=10)
        worker_env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
        ctx = mp.get_context("spawn")
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker, name=f"rank{rank}", args=(
                rank, world_size, self._store.port, timeout, worker_env, os.getpid(),
                child_end))
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        results, failures, dead, timed_out = self._gather(timeout + 60, death_grace=0)
        if failures or dead or timed_out:
            self._break()
            raise RankError(failures, dead, timed_out, results, "the pool failed to start")
        self.pids: list[int] = [results[r] for r in range(world_size)]

    @property
    def alive(self) -> bool:
        """True while the pool can run tasks: not closed, not torn down, all workers alive."""
        return (not self._broken and self._finalizer.still_active()
                and all(p.is_alive() for p in self._procs))

    def close(self) -> None:
        """Shut the workers down cleanly (idempotent)."""
        self._finalizer()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
            death_grace: float = 30.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank at once; return the results in rank order.

        ``fn`` must be a module-level function. Raises :class:`RankError` if a rank raised,
        died or did not finish within ``timeout`` seconds; once a rank has died the others get
        at most ``death_grace`` more seconds.
        """
        return self.run_per_rank(fn, [args] * self.world_size, timeout=timeout,
                                 death_grace=death_grace, **kwargs)

    def run_per_rank(self, fn: Callable[..., Any], args_per_rank: list[tuple[Any, ...]], *,
                     timeout: float = 120.0, death_grace: float = 30.0,
                     **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, rank ``r`` calling ``fn(*args_per_rank[r], **kwargs)``."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{len(args_per_rank)} argument tuples for {self.world_size} ranks")
        if "<locals>" in fn.__qualname__:
            raise ValueError(f"{fn.__qualname__} is not a module-level function")
        results, failures, dead, timed_out = self._run(fn, args_per_rank, kwargs, timeout,
                                                       death_grace)
        note = f"run timeout: {timeout:g} s" if timed_out else ""
        if failures and self.alive and not self._group_works():
            self._break()
            note = "the process group failed its health check afterwards: pool torn down"
        if failures or dead or timed_out:
            raise RankError(failures, dead, timed_out, results, note)
        return [results[r] for r in range(self.world_size)]

    def _group_works(self) -> bool:
        """After a task failed on some ranks: does the group still all_reduce correctly?"""
        results, failures, dead, timed_out = self._run(
            _check_group, [()] * self.world_size, {}, timeout=5.0, death_grace=0)
        return not (failures or dead or timed_out) and all(
            v == self.world_size for v in results.values())

    def _run(self, fn: Callable[..., Any], args_per_rank: list[tuple[Any, ...]],
             kwargs: dict[str, Any], timeout: float, death_grace: float) -> _Outcome:
        """Send the task to every rank (all pickled first: never to only some), gather."""
        if not self.alive:
            raise RuntimeError("this RankPool is closed or broken; make a new one")
        path = getattr(sys.modules.get(fn.__module__), "__file__", None)
        tasks = [pickle.dumps((fn.__module__, fn.__qualname__, path, pickle.dumps(
            (args, kwargs), pickle.HIGHEST_PROTOCOL))) for args in args_per_rank]
        for conn, task in zip(self._conns, tasks, strict=True):
            with contextlib.suppress(OSError):  # a worker that just died: _gather reports it
                conn.send_bytes(task)
        return self._gather(timeout, death_grace)

    def _gather(self, timeout: float, death_grace: float) -> _Outcome:
        """Wait for one reply per rank while watching the workers' sentinels.

        Returns (results, failures, dead ranks, timed-out ranks) and tears the pool down if a
        rank died or timed out, or if the wait itself is interrupted (e.g. by Ctrl-C).
        """
        results: dict[int, Any] = {}
        failures: dict[int, RemoteFailure] = {}
        dead: set[int] = set()
        pending = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout
        try:
            while pending:
                ready = wait([*pending, *sentinels], max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
                for obj in ready:
                    if obj in sentinels:  # exited; a reply sent before that is still read
                        dead.add(sentinels.pop(obj))
                        deadline = min(deadline, time.monotonic() + death_grace)
                    elif obj in pending:
                        rank = pending.pop(obj)
                        try:
                            ok, value = pickle.loads(obj.recv_bytes())
                        except EOFError:
                            continue
                        except Exception as e:  # a reply this process cannot unpickle
                            ok, value = False, _failure(rank, e)
                        (results if ok else failures)[rank] = value
                for conn, rank in list(pending.items()):
                    if rank in dead and not conn.poll():  # pipe held open by a grandchild
                        del pending[conn]
        except BaseException:
            self._break()
            raise
        timed_out = sorted(pending.values())
        if dead or timed_out:
            self._break()
        return results, failures, sorted(dead), timed_out

    def _break(self) -> None:
        """Tear the pool down at once, without asking the workers."""
        if not self._broken:
            self._broken = True
            self._finalizer.cancel()
            _teardown(self._procs, self._conns, graceful=False)
