"""Helpers shared by the benchmarks in bench/, one copy each, so every benchmark builds, times and reports alike.

- the test state (``build_state``) and its size, process groups and device synchronization;
- progress lines, exception descriptions, output cleanup, rotation of interleaved reps, the JSON line;
- asynchronous saves (bench/async_save.py, bench/async_gpu.py): timing one save from its futures,
  the contenders (zerostall's ``AsyncSaver``, DCP ``async_save`` by default and in its zero-overhead
  mode), each one's checked first save, the training loop and its arms, and the save and training
  summaries;
- the host memory of this process tree, from /proc.

The benchmarks run as ``python bench/X.py``, so bench/ is on ``sys.path`` and they ``from common import``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import random
import shutil
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zerostall as zs

# --- version-robust access to DCP's async API (torch 2.11 .. 2.13) ---------------------------

IMPORT_ERRORS: dict[str, str] = {}  # what could not be imported, reported under the JSON's errors
try:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError as _exc:  # older than 2.9
    DefaultStager = StagingOptions = None  # type: ignore[assignment, misc]
    IMPORT_ERRORS["dcp_default_stager"] = f"{type(_exc).__name__}: {_exc}"
try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
except ImportError as _exc:
    AsyncCheckpointerType = None  # type: ignore[assignment, misc]
    IMPORT_ERRORS["dcp_async_checkpointer_type"] = f"{type(_exc).__name__}: {_exc}"
ASYNC_SAVE_PARAMS = set(inspect.signature(dcp.async_save).parameters)

T0 = time.perf_counter()  # when this process imported the helpers: the start of its run
N_TENSORS = 256
MIXED = (torch.float32, torch.float32, torch.bfloat16)  # build_state's dtypes in turn: every third tensor bf16
CPU = torch.device("cpu")
WHATS = ("stall_s", "staged_s", "committed_s")  # the three times of one asynchronous save


# --- the state ------------------------------------------------------------------------------


def build_state(total_bytes: int, seed: int = 0, n: int = N_TENSORS, dtypes: tuple[torch.dtype, ...] = MIXED,
                device: torch.device = CPU) -> dict[str, torch.Tensor]:
    """A deterministic state of ~total_bytes on ``device``: n tensors, log-uniform sizes (1:4096), dtypes in turn."""
    rng = random.Random(seed)
    weights = [math.exp(rng.uniform(0.0, math.log(4096))) for _ in range(n)]
    scale = total_bytes / sum(weights)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for i, weight in enumerate(weights):
        dtype = dtypes[i % len(dtypes)]
        numel = max(1, int(weight * scale) // dtype.itemsize)
        shape = (numel // 1024, 1024) if numel >= 1024 else (numel,)
        state[f"layers.{i}.{dtype_name(dtype)}"] = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    sync(device)
    return state


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype without its ``torch.`` prefix, for tensor names."""
    return str(dtype).removeprefix("torch.")


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors of a flat state: the numerator of every GB/s."""
    return sum(t.numel() * t.element_size() for t in state.values())


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a model's state_dict plus its optimizer's tensors: what a training checkpoint saves."""
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return n + sum(t.numel() * t.element_size() for s in optimizer.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))


# --- processes and devices ------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only: on the CPU every op is synchronous), so timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int = 0, world: int = 1, port: int | None = None, timeout: timedelta | None = None) -> None:
    """A gloo process group over TCP on loopback; MASTER_ADDR also tells DCP's process mode where to put its store."""
    port = free_port() if port is None else port
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)


# --- running and reporting ------------------------------------------------------------------


def write_all(fd: int, view: memoryview, writeback: bool = False) -> None:
    """Write all of ``view`` to ``fd`` (``os.write`` may write less than asked). ``writeback``: for a
    file about to be fsynced, start the write-back of every few MiB written, as zerostall does
    (:class:`zerostall.storage.vectored.WriteBack`), so a raw anchor is the best a plain write can do."""
    from zerostall.storage.vectored import WRITEBACK_BYTES, WriteBack

    behind, end = (WriteBack(fd), os.lseek(fd, 0, os.SEEK_CUR)) if writeback else (None, 0)
    while view.nbytes:
        n = os.write(fd, view[:WRITEBACK_BYTES] if behind is not None else view)
        view, end = view[n:], end + n
        if behind is not None:
            behind.wrote(end)


def progress(line: str) -> None:
    """A progress line on stderr, stamped with the seconds since the run started (stdout is for results)."""
    print(f"[{time.perf_counter() - T0:6.1f}s] {line}", file=sys.stderr, flush=True)


def describe(exc: BaseException) -> str:
    """The exception (its message cut at 500 characters) and where it was raised, for the JSON's errors."""
    text = f"{type(exc).__name__}: {exc}"[:500]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return text
    where = frames[-1]
    return f"{text} (at {where.filename}:{where.lineno} in {where.name})"


def remove(path: str) -> None:
    """Delete a saved checkpoint, file or directory, if there is one: outputs are deleted between reps."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def clear(root: str) -> None:
    """Delete everything under root (the run's scratch directory), keeping root itself."""
    for name in os.listdir(root):
        remove(os.path.join(root, name))


def rotated(items: list[Any], k: int) -> list[Any]:
    """items rotated left by k: each interleaved rep shifts the order, so nothing always runs first."""
    k %= max(1, len(items))
    return items[k:] + items[:k]


def median(values: list[float]) -> float | None:
    """The median, or None for no values (a contender or arm that did not run)."""
    return statistics.median(values) if values else None


def rnd(value: float | None, digits: int = 4) -> float | None:
    """value rounded for the JSON, None kept."""
    return None if value is None else round(value, digits)


def print_json(result: dict[str, Any]) -> None:
    """The result as one JSON line on stdout, flushed: the last line, which other tools read."""
    print(json.dumps(result), flush=True)


# --- timing one asynchronous save -----------------------------------------------------------

Futures = tuple["Future[Any] | None", "Future[Any]"]  # (staged or None: staged at return, committed)


@dataclass
class Timing:
    """One asynchronous save's times from its call: returned, staged, committed."""

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


def time_save(start_save: Callable[[], Futures], wait: Callable[[Future], Any] = Future.result,
              after_staged: Callable[[], None] | None = None) -> Timing:
    """Time one save from the call, waiting with ``wait``; ``after_staged`` runs once staged (untimed use only)."""
    start = time.perf_counter()
    staged, committed = start_save()
    returned = time.perf_counter()
    staged_at = stamp(staged, returned) if staged is not None else [returned]
    committed_at = stamp(committed, returned)
    if staged is not None:
        wait(staged)
    if after_staged is not None:
        after_staged()
    wait(committed)
    while not (staged_at and committed_at):  # the callbacks run just after result() wakes us
        time.sleep(1e-4)
    return Timing(returned - start, staged_at[0] - start, committed_at[0] - start)


def show(label: str, t: Timing | None) -> None:
    """A progress line with one save's times."""
    if t is not None:
        progress(f"{label:32s} stall {t.stall_s:.4f} s  staged {t.staged_s:.4f} s  committed {t.committed_s:.3f} s")


# --- the asynchronous contenders ------------------------------------------------------------


@dataclass
class AsyncContender:
    """One way to start an asynchronous save, and to read one tensor of a checkpoint back."""

    name: str  # JSON prefix: zerostall, dcp_default, dcp_zero_overhead
    start: Callable[[Any, str], Futures]
    read: Callable[[str, str, torch.Tensor], torch.Tensor]  # (path, key, like) -> the saved tensor, on the CPU


def zerostall_start(saver: zs.AsyncSaver) -> Callable[[Any, str], Futures]:
    """Start a save with ``saver``: its (staged, committed) futures."""
    def start(state: Any, path: str) -> Futures:
        handle = saver.save(state, path, overwrite=True)  # timed saves reuse their paths, as DCP does
        assert handle is not None  # if_busy="wait" never skips
        return handle.staged, handle.committed

    return start


def zerostall_read(path: str, key: str, like: torch.Tensor) -> torch.Tensor:
    """One tensor of a zerostall checkpoint."""
    with zs.open(path) as ck:
        return ck.read((key,)).clone()


def dcp_futures(result: Any) -> Futures:
    """(staged, committed) from ``dcp.async_save``'s return: an ``AsyncSaveResponse`` if it stages asynchronously."""
    committed = getattr(result, "upload_completion", None)
    if committed is not None:
        return getattr(result, "staging_completion", None), committed
    return None, result


def dcp_default_start(state: Any, path: str) -> Futures:
    """DCP ``async_save`` at its defaults (thread mode; staging happens inside the call)."""
    return dcp_futures(dcp.async_save(state, checkpoint_id=path))


def dcp_read(path: str, key: str, like: torch.Tensor) -> torch.Tensor:
    """One tensor of a DCP checkpoint, loaded into a CPU tensor shaped like ``like`` (which may be on the GPU)."""
    target = {key: torch.zeros(like.shape, dtype=like.dtype)}
    dcp.load(target, checkpoint_id=path)
    return target[key]


def zero_overhead_missing() -> str | None:
    """Why DCP's zero-overhead mode cannot run on this torch, or None when it can."""
    if DefaultStager is None or StagingOptions is None:
        return "torch.distributed.checkpoint.staging.DefaultStager is missing"
    if AsyncCheckpointerType is None or not hasattr(AsyncCheckpointerType, "PROCESS"):
        return "AsyncCheckpointerType.PROCESS is missing"
    missing = {"async_stager", "async_checkpointer_type"} - ASYNC_SAVE_PARAMS
    if missing:
        return f"dcp.async_save has no {sorted(missing)} parameter"
    return None


class ZeroOverheadDCP:
    """DCP's zero-overhead mode: process mode and the all-on ``DefaultStager``, one stager (made by the first save)
    reused while ``reuse`` holds, else a fresh one per save (closed once that save is uploaded)."""

    def __init__(self, pin: bool, reuse: bool = True) -> None:
        self.pin = pin  # pinned memory and non-blocking copies need CUDA
        self.reuse = reuse
        self.stager: Any = None

    def new_stager(self) -> Any:
        """A stager with every staging option on (pinning and non-blocking copies only with ``pin``)."""
        return DefaultStager(StagingOptions(use_pinned_memory=self.pin, use_shared_memory=True,
                                            use_async_staging=True, use_non_blocking_copy=self.pin))

    @staticmethod
    def call(state: Any, path: str, stager: Any) -> Any:
        """``dcp.async_save`` in process mode with ``stager``."""
        return dcp.async_save(state, checkpoint_id=path, async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    def start(self, state: Any, path: str) -> Futures:
        """Start a save: (staged, committed)."""
        if self.reuse:
            if self.stager is None:
                self.stager = self.new_stager()
            return dcp_futures(self.call(state, path, self.stager))
        stager = self.new_stager()
        try:
            staged, committed = dcp_futures(self.call(state, path, stager))
        except BaseException:
            stager.close()
            raise
        committed.add_done_callback(lambda _: stager.close())
        return staged, committed

    def fall_back(self) -> None:
        """From now on, a fresh stager per save (a reused one failed on this torch)."""
        self.reuse = False
        self.close()

    @property
    def mode(self) -> str:
        """How stagers are used, for the JSON: "reused" or "fresh per save"."""
        return "reused" if self.reuse else "fresh per save"

    def close(self) -> None:
        """Close the reused stager, if any."""
        if self.stager is not None:
            stager, self.stager = self.stager, None
            with contextlib.suppress(Exception):
                stager.close()


def first_save(c: AsyncContender, state: dict[str, torch.Tensor], root: str,
               wait: Callable[[Future], Any] = Future.result, device: torch.device = CPU) -> Timing:
    """The contender's first save (its warm-up), checked: a tensor overwritten once the save is staged must read back
    with its old value."""
    key = next(iter(state))
    original = state[key].clone()
    path = os.path.join(root, f"{c.name}-first")
    sync(device)
    try:
        try:
            timing = time_save(lambda: c.start(state, path), wait, after_staged=lambda: state[key].fill_(-7.0))
        finally:
            state[key].copy_(original)  # also after a failure: the next contender saves the same state
        sync(device)
        if not torch.equal(c.read(path, key, original), original.cpu()):
            raise AssertionError(f"{c.name}: the checkpoint holds a value written after the save was staged")
    finally:
        remove(path)
    return timing


def save_summary(first: dict[str, Timing], reps: dict[str, list[Timing]], errors: dict[str, str],
                 names: list[str]) -> dict[str, Any]:
    """The JSON's ``<name>_first_<what>`` and ``<name>_<what>`` (median over reps) per contender; a contender that
    failed (``name`` in ``errors``) has no medians: fewer reps than the others are not comparable."""
    out: dict[str, Any] = {}
    for name in names:
        f = first.get(name)
        for what in WHATS:
            out[f"{name}_first_{what}"] = rnd(getattr(f, what)) if f else None
        for what in WHATS:
            ok = name not in errors
            out[f"{name}_{what}"] = rnd(median([getattr(t, what) for t in reps.get(name, [])])) if ok else None
    return out


def rep_seconds(reps: dict[str, list[Timing]], names: list[str]) -> dict[str, list[float]]:
    """The JSON's ``seconds``: every rep's times per contender and time, in rep order."""
    return {f"{name}_{what}": [round(getattr(t, what), 4) for t in reps.get(name, [])]
            for name in names for what in WHATS}


def print_save_table(first: dict[str, Timing], reps: dict[str, list[Timing]], errors: dict[str, str],
                     names: list[str]) -> None:
    """The save timings as a table on stdout, a failed contender with its error."""
    print(f"{'contender':18s} {'first stall':>11s} {'stall s':>9s} {'staged s':>9s} {'committed s':>11s}")
    for name in names:
        r, f = reps.get(name, []), first.get(name)
        if not r or f is None or name in errors:
            print(f"{name:18s} failed: {errors.get(name, 'did not run')[:100]}")
            continue
        print(f"{name:18s} {f.stall_s:11.4f} {median([t.stall_s for t in r]):9.4f}"
              f" {median([t.staged_s for t in r]):9.4f} {median([t.committed_s for t in r]):11.3f}")


# --- the training overhead ------------------------------------------------------------------


class NoCheckpoint:
    """The training arm that never saves; the others override its three hooks."""

    name = "none"

    def save(self, state: Any, path: str) -> None:
        """Start a save of the training state after an optimizer step."""

    def before_step(self) -> None:
        """Wait for what must be done before the next optimizer step mutates the state."""

    def drain(self) -> None:
        """Wait for the last save to commit (inside the timed region)."""


class ZerostallArm(NoCheckpoint):
    """Training with zerostall's AsyncSaver: staged before the next optimizer step; ``wait`` blocks on a future (the
    GPU bench passes one with a deadline)."""

    name = "zerostall"

    def __init__(self, saver: zs.AsyncSaver, wait: Callable[[Future], Any] = Future.result) -> None:
        self.saver, self.wait = saver, wait
        self.handle: zs.SaveHandle | None = None

    def save(self, state: Any, path: str) -> None:
        """Start a save; if_busy="wait": waits for the last commit."""
        self.handle = self.saver.save(state, path, overwrite=True)

    def before_step(self) -> None:
        """Wait until the last save is staged."""
        if self.handle is not None:
            self.wait(self.handle.staged)

    def drain(self) -> None:
        """Wait until the last save is committed."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.wait(handle.committed)


class DCPArm(NoCheckpoint):
    """Training with DCP ``async_save`` (``start``): staged before the next optimizer step, one save in flight."""

    name = "dcp"

    def __init__(self, start: Callable[[Any, str], Futures], wait: Callable[[Future], Any] = Future.result) -> None:
        self.start, self.wait = start, wait
        self.staged: Future | None = None
        self.committed: Future | None = None

    def save(self, state: Any, path: str) -> None:
        """Start a save once the last one is uploaded, as DCP users must."""
        self.drain()
        self.staged, self.committed = self.start(state, path)

    def before_step(self) -> None:
        """Wait until the last save is staged."""
        if self.staged is not None:
            staged, self.staged = self.staged, None
            self.wait(staged)

    def drain(self) -> None:
        """Wait until the last save is uploaded."""
        committed, self.staged, self.committed = self.committed, None, None
        if committed is not None:
            self.wait(committed)


def train(trainer: Any, arm: NoCheckpoint, steps: int, every: int, path: Callable[[int], str]) -> float:
    """Seconds for ``steps`` steps saving to ``path(step)`` every ``every`` steps, the final drain included; ``trainer``
    has ``device``, ``optimizer``, ``forward_backward()`` and ``state()``."""
    sync(trainer.device)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.forward_backward()
        arm.before_step()
        trainer.optimizer.step()
        if step % every == 0:
            arm.save(trainer.state(), path(step))
    arm.drain()
    sync(trainer.device)
    return time.perf_counter() - start


def overheads(seconds: dict[str, list[float]]) -> dict[str, Any]:
    """Per checkpointing arm, the JSON's overhead %: median against the no-checkpoint arm's median, and the range of
    the per-round overheads."""
    base = seconds.get("none", [])
    out: dict[str, Any] = {}
    for arm, s in seconds.items():
        if arm == "none" or not s or not base:
            continue
        paired = [100 * (a / b - 1) for a, b in zip(s, base, strict=False)]  # by round; a failed arm ran fewer
        out[f"{arm}_train_overhead_pct"] = round(100 * (statistics.median(s) / statistics.median(base) - 1), 2)
        out[f"{arm}_train_overhead_pct_range"] = [round(min(paired), 2), round(max(paired), 2)]
    return out


def print_train_table(seconds: dict[str, list[float]], over: dict[str, Any]) -> None:
    """The training runs as a table on stdout."""
    print(f"{'arm':12s} {'median s':>9s} {'min s':>8s} {'max s':>8s} {'overhead %':>11s} {'per-round range %':>18s}")
    for arm, s in seconds.items():
        if not s:
            continue
        pct, span = over.get(f"{arm}_train_overhead_pct"), over.get(f"{arm}_train_overhead_pct_range")
        pct_text = "" if pct is None else f"{pct:+.1f}"
        span_text = "" if span is None else f"{span[0]:+.1f} .. {span[1]:+.1f}"
        print(f"{arm:12s} {statistics.median(s):9.3f} {min(s):8.3f} {max(s):8.3f} {pct_text:>11s} {span_text:>18s}")


# --- host memory ----------------------------------------------------------------------------


def status_kib(pid: int, field_name: str) -> int:
    """A ``kB`` field of /proc/PID/status (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field_name + ":"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, StopIteration):
        return 0


def descendants(pid: int) -> list[int]:
    """Every process below pid (DCP's writer process, zerostall's writer), from /proc."""
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
