"""Asynchronous saving: zerostall's AsyncSaver against DCP ``async_save``, in one run, same data and target.

    python bench/async_save.py [--size-mb N] [--tensors T] [--reps R] [--dir D] [--train-steps N] [--json]

One deterministic state (default 1 GiB of fp32/bf16 CPU tensors of mixed sizes, 256 tensors, the
state of bench/save_load.py; --tensors for more) is saved asynchronously by every contender into the same directory
(default a fresh one under /dev/shm, so software overhead is what shows):

- zerostall: one ``zs.AsyncSaver(writer=...)`` (``--writer thread`` by default, or ``process``; if_busy="wait", fsync on); its buffer
  pool is allocated up front by ``saver.reserve(state)`` and reported apart (``pool_alloc_s``);
- DCP default: ``dcp.async_save(state, checkpoint_id=path)`` (thread mode; a fresh stager per save,
  which stages synchronously inside the call, so its staged time is its stall);
- DCP zero-overhead: ``async_stager=DefaultStager(StagingOptions(use_pinned_memory=False,
  use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False))`` (no pinning or
  non-blocking copies on a CPU-only machine) with ``AsyncCheckpointerType.PROCESS``; one stager is
  reused across saves (its staging cache is keyed by the source storages), and should a reused
  stager fail the run falls back to a fresh one per save and says so in ``notes``.

Process group: DCP's process mode needs an initialized process group (its ``_ProcessGroupInitInfo``
calls ``dist.get_rank``; without one it raises "Default process group has not been initialized"),
so the run initializes a 1-rank gloo group in this process (a ``FileStore`` under --dir, and
``MASTER_ADDR=127.0.0.1`` so DCP's writer process sets up its own store on loopback). Every
contender runs under that group, as it would under torchrun; ``--no-pg`` runs without one
(DCP's zero-overhead figures are then null, with the reason in ``errors``).

Per save, timed from the call: ``stall_s`` until the call returns (the caller is blocked),
``staged_s`` until the staged future is done (the state may be mutated), ``committed_s`` until
the commit/upload future is done (a future's time is stamped by a done-callback; one already done
when the call returns is stamped at the return). Each contender's first save is reported apart
(``first_*``) and is also its warm-up: it checks the snapshot by overwriting one tensor as soon as
the save is staged and reading the checkpoint back after the commit. The timed saves then run in
interleaved reps (rep 1: every contender, rep 2: ...), each to a fresh path, waiting for the
commit before the next contender; paths are deleted outside the timing; figures are medians.

Training overhead: a CPU MLP (4 x 1280 wide, batch 256, AdamW: ~6.6 M parameters, ~75 MiB of
model + optimizer state, ~70-110 ms a step here) trains --train-steps steps, saving
``{"model": model, "optim": optimizer}`` every --save-every steps, in three arms: no checkpoint;
zerostall (``saver.save`` after the step, ``handle.wait_staged()`` right before the next
``optimizer.step()``, every save committed: ``if_busy="wait"``); DCP async in its best mode here
(zero-overhead when it runs, else thread mode), waiting for staging before the optimizer step
likewise and for the previous save's upload before the next save, as DCP users must. The final
drain is inside the timed region. One untimed warm-up run per arm (the saver's pool reserved, DCP's
writer process and stager cache warm), then --train-runs interleaved runs (default 4), the order of
the arms rotated from run to run; overhead % = median of an arm / median of the no-checkpoint arm
- 1; the range is that of the per-run overheads, each run against the no-checkpoint run of the
same round. Runs of the same arm vary by ~15% on this VM, so overheads below that are noise.

Host memory: RSS (VmRSS, MiB) of this process plus its descendants (DCP's writer process) before
and after 50 zerostall async saves of a 64 MiB state into one path (after a reserve and one warm
save), and the same for DCP's zero-overhead mode when it runs.

Progress goes to stderr; tables to stdout; with --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

import zerostall as zs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from save_load import N_TENSORS, build_state, state_bytes

MEM_STATE_MB = 64
MEM_SAVES = 50
MLP_WIDTH, MLP_DEPTH, MLP_BATCH = 1280, 4, 256


# --- timing one asynchronous save -----------------------------------------------------------


@dataclass
class Timing:
    stall_s: float
    staged_s: float
    committed_s: float


def stamp(future: Future, fallback: float) -> list[float]:
    """A list that receives the time ``future`` finishes (``fallback`` if it already has)."""
    when: list[float] = []
    if future.done():
        when.append(fallback)
    else:
        future.add_done_callback(lambda _: when.append(time.perf_counter()))
    return when


def time_save(start_save: Callable[[], tuple[Future | None, Future]],
              after_staged: Callable[[], None] | None = None) -> Timing:
    """Time one save; ``start_save`` returns its (staged or None, committed) futures. None means
    staging happened inside the call. ``after_staged`` runs once staged (untimed use only)."""
    start = time.perf_counter()
    staged, committed = start_save()
    returned = time.perf_counter()
    staged_at = stamp(staged, returned) if staged is not None else [returned]
    committed_at = stamp(committed, returned)
    if staged is not None:
        staged.result()
    if after_staged is not None:
        after_staged()
    committed.result()
    while not (staged_at and committed_at):  # callbacks run just after result() wakes us
        time.sleep(1e-4)
    return Timing(returned - start, staged_at[0] - start, committed_at[0] - start)


# --- the contenders -------------------------------------------------------------------------


def dcp_futures(result: Future | AsyncSaveResponse) -> tuple[Future | None, Future]:
    if isinstance(result, AsyncSaveResponse):
        return result.staging_completion, result.upload_completion
    return None, result


def zero_overhead_stager() -> DefaultStager:
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                        use_async_staging=True, use_non_blocking_copy=False))


class ZeroOverheadDCP:
    """DCP's zero-overhead mode: one reused stager, or a fresh one per save once reuse fails."""

    def __init__(self) -> None:
        self.stager: DefaultStager | None = zero_overhead_stager()
        self.saves = 0  # saves started with self.stager
        self.notes: list[str] = []

    def start(self, state: Any, path: str) -> tuple[Future | None, Future]:
        if self.stager is not None:
            try:
                futures = dcp_futures(self._call(state, path, self.stager))
                self.saves += 1
                return futures
            except Exception as exc:  # e.g. pytorch#183413 on torch 2.11
                if self.saves == 0:
                    raise  # not a reuse failure
                self.notes.append(f"reusing one DefaultStager failed ({type(exc).__name__}: {exc}); "
                                  "fresh stager per save from then on")
                progress(self.notes[-1])
                self.close()
        stager = zero_overhead_stager()
        staged, committed = dcp_futures(self._call(state, path, stager))
        committed.add_done_callback(lambda _: stager.close())
        return staged, committed

    @staticmethod
    def _call(state: Any, path: str, stager: DefaultStager) -> Future | AsyncSaveResponse:
        return dcp.async_save(state, checkpoint_id=path, async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    @property
    def stager_mode(self) -> str:
        return "reused" if self.stager is not None else "fresh per save"

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


@dataclass
class Contender:
    """One way to start an asynchronous save and read one tensor of it back."""

    name: str  # JSON prefix: zerostall, dcp_default, dcp_zero_overhead
    start: Callable[[Any, str], tuple[Future | None, Future]]
    read: Callable[[str, str, torch.Tensor], torch.Tensor]


def zerostall_read(path: str, key: str, like: torch.Tensor) -> torch.Tensor:
    with zs.open(path) as ck:
        return ck.read((key,)).clone()


def dcp_read(path: str, key: str, like: torch.Tensor) -> torch.Tensor:
    target = {key: torch.zeros_like(like)}
    dcp.load(target, checkpoint_id=path)
    return target[key]


def zerostall_contender(saver: zs.AsyncSaver) -> Contender:
    def start(state: Any, path: str) -> tuple[Future | None, Future]:
        handle = saver.save(state, path)
        return handle.staged, handle.committed

    return Contender("zerostall", start, zerostall_read)


def dcp_default_contender() -> Contender:
    return Contender("dcp_default", lambda s, p: dcp_futures(dcp.async_save(s, checkpoint_id=p)), dcp_read)


def dcp_zero_overhead_contender(zoc: ZeroOverheadDCP) -> Contender:
    return Contender("dcp_zero_overhead", zoc.start, dcp_read)


# --- the save timings -----------------------------------------------------------------------


@dataclass
class SaveResults:
    first: dict[str, Timing] = field(default_factory=dict)
    reps: dict[str, list[Timing]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def first_save(c: Contender, state: dict[str, torch.Tensor], root: str) -> Timing:
    """The contender's first save (its warm-up), checked: a tensor overwritten as soon as the save
    is staged must read back with its old value."""
    key = next(iter(state))
    original = state[key].clone()
    path = os.path.join(root, f"{c.name}-first")
    timing = time_save(lambda: c.start(state, path), after_staged=lambda: state[key].fill_(-7.0))
    state[key].copy_(original)
    if not torch.equal(c.read(path, key, original), original):
        raise AssertionError(f"{c.name}: the checkpoint holds a value written after the save was staged")
    remove(path)
    return timing


def run_saves(cs: list[Contender], state: dict[str, torch.Tensor], root: str, reps: int) -> SaveResults:
    out = SaveResults()
    live = []
    for c in cs:
        progress(f"first save: {c.name}")
        try:
            out.first[c.name] = first_save(c, state, root)
            out.reps[c.name] = []
            live.append(c)
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
            out.errors[c.name] = f"{type(exc).__name__}: {exc}"
            progress(f"{c.name} failed: {out.errors[c.name]}")
        show(f"first {c.name}", out.first.get(c.name))
    for rep in range(1, reps + 1):
        for c in list(live):
            path = os.path.join(root, f"{c.name}-{rep}")
            try:
                timing = time_save(lambda c=c, path=path: c.start(state, path))
            except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
                out.errors[c.name] = f"rep {rep}: {type(exc).__name__}: {exc}"
                live.remove(c)
                continue
            finally:
                gc.collect()
            remove(path)
            out.reps[c.name].append(timing)
            show(f"rep {rep}/{reps} {c.name}", timing)
    return out


def show(label: str, t: Timing | None) -> None:
    if t is not None:
        progress(f"{label:32s} stall {t.stall_s:.4f} s  staged {t.staged_s:.4f} s  committed {t.committed_s:.3f} s")


# --- the training overhead ------------------------------------------------------------------


class Trainer:
    """A small CPU MLP with AdamW and one fixed batch: ~70-110 ms a step on this 2-core VM."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(MLP_DEPTH):
            layers += [torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers, torch.nn.Linear(MLP_WIDTH, 10))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(MLP_BATCH, MLP_WIDTH, generator=gen)
        self.y = torch.randint(0, 10, (MLP_BATCH,), generator=gen)
        self.forward_backward()
        self.optimizer.step()  # the optimizer's state exists from here on, so reserve() sees it

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optimizer}

    def forward_backward(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()


class NoCheckpoint:
    name = "none"

    def save(self, state: Any, path: str) -> None:
        pass

    def before_step(self) -> None:
        pass

    def drain(self) -> None:
        pass


class ZerostallArm(NoCheckpoint):
    """``wait`` blocks on a future (the GPU bench passes one with a deadline)."""

    name = "zerostall"

    def __init__(self, saver: zs.AsyncSaver, wait: Callable[[Future], Any] = Future.result) -> None:
        self.saver, self.wait = saver, wait
        self.handle: zs.SaveHandle | None = None

    def save(self, state: Any, path: str) -> None:
        self.handle = self.saver.save(state, path)  # if_busy="wait": waits for the last commit

    def before_step(self) -> None:
        if self.handle is not None:
            self.wait(self.handle.staged)

    def drain(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.wait(handle.committed)


class DCPArm(NoCheckpoint):
    name = "dcp"

    def __init__(self, start: Callable[[Any, str], tuple[Future | None, Future]],
                 wait: Callable[[Future], Any] = Future.result) -> None:
        self.start, self.wait = start, wait
        self.staged: Future | None = None
        self.committed: Future | None = None

    def save(self, state: Any, path: str) -> None:
        self.drain()  # one DCP save in flight at a time: the user waits for the last upload
        self.staged, self.committed = self.start(state, path)

    def before_step(self) -> None:
        if self.staged is not None:
            staged, self.staged = self.staged, None
            self.wait(staged)

    def drain(self) -> None:
        committed, self.staged, self.committed = self.committed, None, None
        if committed is not None:
            self.wait(committed)


def train(trainer: Trainer, arm: NoCheckpoint, steps: int, every: int, root: str, tag: str) -> float:
    """Seconds for ``steps`` steps saving every ``every`` steps, the final drain included."""
    start = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.forward_backward()
        arm.before_step()
        trainer.optimizer.step()
        if step % every == 0:
            arm.save(trainer.state(), os.path.join(root, f"{arm.name}-{tag}-{step}"))
    arm.drain()
    return time.perf_counter() - start


def run_training(arms: list[NoCheckpoint], trainer: Trainer, steps: int, every: int, runs: int,
                 root: str) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for arm in arms:
        progress(f"training warm-up: {arm.name}")
        train(trainer, arm, 2 * every, every, root, "warm")
        clear(root)
    for run in range(1, runs + 1):
        k = (run - 1) % len(arms)
        for arm in arms[k:] + arms[:k]:  # rotate the order: no arm always runs first
            gc.collect()
            s = train(trainer, arm, steps, every, root, str(run))
            clear(root)
            seconds[arm.name].append(s)
            progress(f"training run {run}/{runs} {arm.name:10s} {s:.3f} s")
    return seconds


# --- host memory ----------------------------------------------------------------------------


def status_kib(pid: int, field_name: str) -> int:
    """A ``kB`` field of /proc/PID/status (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field_name + ":"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, StopIteration):
        return 0


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for kid in kids:
            found += [kid, *descendants(kid)]
    return found


def tree_rss_mib() -> float:
    me = os.getpid()
    return sum(status_kib(p, "VmRSS") for p in [me, *descendants(me)]) / 1024


def memory_growth(start: Callable[[Any, str], tuple[Future | None, Future]], state: dict, path: str) -> float:
    """RSS growth (MiB) of this process tree over MEM_SAVES saves into one path, after a warm one."""
    start(state, path)[1].result()
    gc.collect()
    before = tree_rss_mib()
    for _ in range(MEM_SAVES):
        staged, committed = start(state, path)
        (staged or committed).result()
        committed.result()
    gc.collect()
    return tree_rss_mib() - before


# --- helpers --------------------------------------------------------------------------------


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def clear(root: str) -> None:
    for name in os.listdir(root):
        if name != "pg-store":
            remove(os.path.join(root, name))


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rnd(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def init_group(root: str) -> None:
    """A 1-rank gloo process group in this process (DCP's process mode needs one)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(os.path.join(root, "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


# --- the report -----------------------------------------------------------------------------


def save_summary(res: SaveResults, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        reps = res.reps.get(name, [])
        first = res.first.get(name)
        out[f"{name}_first_stall_s"] = rnd(first.stall_s) if first else None
        out[f"{name}_first_staged_s"] = rnd(first.staged_s) if first else None
        out[f"{name}_first_committed_s"] = rnd(first.committed_s) if first else None
        for what in ("stall_s", "staged_s", "committed_s"):
            ok = len(reps) > 0 and name not in res.errors
            out[f"{name}_{what}"] = rnd(median([getattr(t, what) for t in reps])) if ok else None
    return out


def print_save_table(res: SaveResults, names: list[str], pool_alloc_s: float) -> None:
    print(f"{'contender':18s} {'first stall':>11s} {'stall s':>9s} {'staged s':>9s} {'committed s':>11s}")
    for name in names:
        reps, first = res.reps.get(name, []), res.first.get(name)
        if not reps or first is None or name in res.errors:
            print(f"{name:18s} {'failed: ' + res.errors.get(name, '?')[:80]}")
            continue
        print(f"{name:18s} {first.stall_s:11.4f} {median([t.stall_s for t in reps]):9.4f}"
              f" {median([t.staged_s for t in reps]):9.4f} {median([t.committed_s for t in reps]):11.3f}")
    print(f"zerostall pool allocation (reserve): {pool_alloc_s:.3f} s")


def overheads(seconds: dict[str, list[float]]) -> dict[str, Any]:
    base = seconds["none"]
    out: dict[str, Any] = {}
    for arm, s in seconds.items():
        if arm == "none":
            continue
        paired = [100 * (a / b - 1) for a, b in zip(s, base, strict=True)]
        out[f"{arm}_train_overhead_pct"] = round(100 * (median(s) / median(base) - 1), 2)
        out[f"{arm}_train_overhead_pct_range"] = [round(min(paired), 2), round(max(paired), 2)]
    return out


def print_train_table(seconds: dict[str, list[float]], over: dict[str, Any]) -> None:
    print(f"{'arm':12s} {'median s':>9s} {'min s':>8s} {'max s':>8s} {'overhead %':>11s} {'paired range %':>16s}")
    for arm, s in seconds.items():
        pct = over.get(f"{arm}_train_overhead_pct")
        rng = over.get(f"{arm}_train_overhead_pct_range")
        pct_text = "" if pct is None else f"{pct:+.1f}"
        rng_text = "" if rng is None else f"{rng[0]:+.1f} .. {rng[1]:+.1f}"
        print(f"{arm:12s} {median(s):9.3f} {min(s):8.3f} {max(s):8.3f} {pct_text:>11s} {rng_text:>16s}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="state size in MiB (1024)")
    parser.add_argument("--reps", type=int, default=5, help="timed saves per contender (5)")
    parser.add_argument("--tensors", type=int, default=N_TENSORS,
                        help=f"number of tensors of the timed state ({N_TENSORS}); thousands show per-tensor costs")
    parser.add_argument("--dir", default="/dev/shm", help="where to save (a fresh dir under it)")
    parser.add_argument("--train-steps", type=int, default=60, help="training steps per run (60)")
    parser.add_argument("--save-every", type=int, default=10, help="save every N steps (10)")
    parser.add_argument("--train-runs", type=int, default=4, help="timed runs per arm (4)")
    parser.add_argument("--no-pg", action="store_true", help="run without a process group")
    parser.add_argument("--writer", choices=["thread", "process"], default="thread",
                        help="zerostall's background writer: threads, or a persistent spawned process")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    root = tempfile.mkdtemp(prefix="zerostall-bench-async-", dir=args.dir)
    errors: dict[str, str] = {}
    notes: list[str] = []
    names = ["zerostall", "dcp_default", "dcp_zero_overhead"]
    try:
        if args.no_pg:
            notes.append("no process group")
        else:
            init_group(root)
            notes.append("1-rank gloo process group (FileStore) initialized in-process: DCP's process "
                          "mode needs one; every contender ran under it")

        # -- save timings on the big state --
        progress(f"building a {args.size_mb} MiB state of {args.tensors} tensors")
        state = build_state(args.size_mb << 20, n=args.tensors)
        nbytes = state_bytes(state)
        saver = zs.AsyncSaver(writer=args.writer)
        pool_alloc_s = saver.reserve(state)
        progress(f"zerostall pool allocation {pool_alloc_s:.3f} s")
        zoc = ZeroOverheadDCP()
        cs = [zerostall_contender(saver), dcp_default_contender(), dcp_zero_overhead_contender(zoc)]
        res = run_saves(cs, state, root, args.reps)
        errors.update(res.errors)
        notes += zoc.notes
        zoc_works = "dcp_zero_overhead" not in res.errors
        stager_mode = zoc.stager_mode if zoc_works else None
        saver.close()
        zoc.close()
        del state, cs
        clear(root)
        gc.collect()

        # -- training overhead --
        trainer = Trainer()
        train_saver = zs.AsyncSaver(writer=args.writer)
        train_saver.reserve(trainer.state())
        train_zoc = ZeroOverheadDCP()
        dcp_mode = "zero_overhead" if zoc_works else "thread"
        dcp_start = train_zoc.start if zoc_works else dcp_default_contender().start
        arms = [NoCheckpoint(), ZerostallArm(train_saver), DCPArm(dcp_start)]
        train_seconds = run_training(arms, trainer, args.train_steps, args.save_every, args.train_runs, root)
        notes += train_zoc.notes
        train_saver.close()
        train_zoc.close()
        clear(root)
        train_state_bytes = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
        train_state_bytes += sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                                 for t in s.values() if isinstance(t, torch.Tensor))
        del trainer, arms
        gc.collect()

        # -- host memory --
        progress(f"host memory: {MEM_SAVES} async saves of a {MEM_STATE_MB} MiB state")
        small = build_state(MEM_STATE_MB << 20, seed=1)
        mem_saver = zs.AsyncSaver(writer=args.writer)
        mem_saver.reserve(small)
        growth = memory_growth(zerostall_contender(mem_saver).start, small, os.path.join(root, "mem-zs"))
        mem_saver.close()
        dcp_growth = None
        if zoc_works:
            mem_zoc = ZeroOverheadDCP()
            try:
                dcp_growth = memory_growth(mem_zoc.start, small, os.path.join(root, "mem-dcp"))
            except Exception as exc:  # noqa: BLE001 - reported in errors
                errors["dcp_zero_overhead_host_mem"] = f"{type(exc).__name__}: {exc}"
            notes += mem_zoc.notes
            mem_zoc.close()
        progress(f"host memory growth: zerostall {growth:.1f} MiB, DCP zero-overhead "
                 + ("n/a" if dcp_growth is None else f"{dcp_growth:.1f} MiB"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)

    print_save_table(res, names, pool_alloc_s)
    print()
    over = overheads(train_seconds)
    print_train_table(train_seconds, over)
    print(f"host memory growth over {MEM_SAVES} saves of {MEM_STATE_MB} MiB: zerostall {growth:.1f} MiB"
          + (f", DCP zero-overhead {dcp_growth:.1f} MiB" if dcp_growth is not None else ""))
    if args.json:
        result = {
            "state_gb": round(nbytes / 1e9, 4),
            "state_bytes": nbytes,
            "n_tensors": args.tensors,
            "zerostall_pool_alloc_s": round(pool_alloc_s, 4),
            **save_summary(res, names),
            "dcp_default_staged_is_stall": True,
            "dcp_zero_overhead_stager": stager_mode,
            "zerostall_train_overhead_pct": over.get("zerostall_train_overhead_pct"),
            "dcp_train_overhead_pct": over.get("dcp_train_overhead_pct"),
            "zerostall_train_overhead_pct_range": over.get("zerostall_train_overhead_pct_range"),
            "dcp_train_overhead_pct_range": over.get("dcp_train_overhead_pct_range"),
            "dcp_train_mode": dcp_mode,
            "train_median_s": {arm: round(median(s), 4) for arm, s in train_seconds.items()},
            "train_state_bytes": train_state_bytes,
            "train_steps": args.train_steps,
            "save_every": args.save_every,
            "train_runs": args.train_runs,
            "host_mem_growth_mb": round(growth, 2),
            "dcp_zero_overhead_host_mem_growth_mb": rnd(dcp_growth, 2),
            "host_mem_saves": MEM_SAVES,
            "host_mem_state_mb": MEM_STATE_MB,
            "reps": args.reps,
            "writer": args.writer,
            "dir": args.dir,
            "process_group": not args.no_pg,
            "torch_version": torch.__version__,
            "errors": errors,
            "notes": notes,
            "seconds": {
                f"{name}_{what}": [round(getattr(t, what), 4) for t in res.reps.get(name, [])]
                for name in names for what in ("stall_s", "staged_s", "committed_s")
            },
            "train_seconds": {arm: [round(x, 4) for x in s] for arm, s in train_seconds.items()},
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()
