"""Asynchronous saving from the GPU: zerostall against DCP ``async_save``, in one run, same state and target.

    python bench/async_gpu.py [--device cuda|cpu] [--size-mb N] [--reps R] [--train-steps N]
                              [--save-every K] [--train-reps R] [--mem-state-mb N] [--dir D]
                              [--deadline-s S] [--json]

Made for the lent H100 (``python bench/async_gpu.py --json``, ~7 minutes); ``--device cpu`` runs
the same code paths on the CPU with tiny sizes, as a smoke test (``--size-mb 64 --train-steps 20
--reps 2``). Every contender saves into the same directory (default a fresh one under /dev/shm)
under a 1-rank gloo process group initialized in this process over TCP loopback (DCP's process
mode needs one; zerostall runs under it too, as under torchrun). Four parts, in this order:

1. Save timings. One deterministic state (default 8 GiB of bf16 on the device, 256 tensors of
   log-uniform sizes) is saved by: zerostall (one ``zs.AsyncSaver()``, its defaults: pinned pool,
   fsync, ``if_busy="wait"``); DCP ``async_save`` in its default mode (thread, a fresh default
   stager that stages inside the call, so its staged time is its stall); DCP in its zero-overhead
   mode (``AsyncCheckpointerType.PROCESS`` with ``DefaultStager(StagingOptions(use_pinned_memory,
   use_shared_memory, use_async_staging, use_non_blocking_copy all True))``; pinning and
   non-blocking copies only with CUDA). The stager is reused across saves where the torch release
   allows: a second save with it (after changing a tensor) must commit and read back right, else
   (pytorch#183413 on 2.11) a fresh stager is made per save, as that release's users must, and the
   JSON says which (``dcp_zero_overhead_stager``, with the reason in ``errors``). zerostall's pool
   is allocated first by ``saver.reserve(state)`` (``zerostall_pool_alloc_s``); the pool pins its
   arena in place (``cudaHostRegister``), which torch's pinned host allocator statistics do not
   count, so ``zerostall_pool_pinned_bytes`` is what the pool reports it registered
   (``BufferPool.pinned_bytes``), and ``zerostall_pool_pinned_bytes_after_close`` what it still
   has registered once the saver is closed (0 expected); ``pinned_bytes_after_zerostall_close`` is
   what torch's pinned host allocator still holds then, all other pinned buffers gone. The raw floor,
   ``d2h_pinned_gbps``: the state copied into preallocated pinned buffers (one arena, touched
   first), ``non_blocking`` copies then one ``torch.cuda.synchronize()``, timed; median of --reps
   after a warm copy (the arena is freed, and torch's pinned cache emptied, before the
   contenders run). Per save, timed from
   the call: ``stall_s`` until the call returns, ``staged_s`` until the staged future is done (the
   state may be mutated), ``committed_s`` until the commit/upload future is done (each stamped by
   a done-callback). Each contender's first save is reported apart (``*_first_*``); it is also its
   warm-up and is checked: a tensor overwritten once the save is staged must read back with its
   old value. Then --reps interleaved reps (the order rotated each rep), each to a fresh path,
   waiting for the commit before the next save, paths deleted outside the timing; medians, with
   the per-rep lists in ``seconds``.
2. Stale capture. A 64 MiB tensor is set to an old value (synchronized), then the compute stream
   is given ~1 s of queued matmuls followed by ``t.copy_(new)``, and the save is called at once,
   without synchronizing; after the commit the checkpoint is read back: holding anything but the
   new values is a stale capture. 3 trials each for zerostall and for DCP's async staging (its
   zero-overhead mode, stager mode as found in part 1). ``*_stale_pending`` counts the trials in
   which the queued write was still pending when the save call returned (a trial where it was not
   proves nothing). On the CPU every op is synchronous and the check passes trivially.
3. Host memory. RSS (less shared pages) of this process and its descendants (from /proc) plus
   /dev/shm usage (statvfs: machine-wide), before and after 50 zerostall saves of a smaller state
   (256 MiB; 16 MiB on the CPU) into one path, after a reserve and one warm save:
   ``host_mem_growth_mb`` (parts ``host_mem_rss_growth_mb``, ``host_mem_shm_growth_mb``).
4. Training overhead. A transformer LM (GPU: 20 layers x 1024 wide, 8k vocabulary, ~268 M
   parameters, bf16 autocast, fused AdamW: ~3.2 GB of fp32 state; CPU: a tiny one) trains
   --train-steps steps (300) on one fixed batch, saving ``{"model": model, "optim": optimizer}``
   every --save-every steps (30; 5 on the CPU) into two alternating paths, every scheduled save
   committed (no skipping), the final drain inside the timed region. Arms: no checkpoint; zerostall
   (``saver.save`` after the step, ``handle.wait_staged()`` right before the next
   ``optimizer.step()``, the pool reserved up front); DCP in its best mode here (zero-overhead when
   it runs, else the default thread mode), waiting for its staging before the optimizer step and
   for the previous upload before the next save, as DCP's tutorial does (no synchronize before the
   call: see part 2 for what that captures). One untimed warm-up per arm (2 saves), then
   --train-reps (3) rounds, the order of the arms rotated per round; overhead % = median of an arm
   / median of the no-checkpoint arm - 1, range = min/max of the per-round overheads. Rounds stop
   early, with a note in ``errors``, only if the next one would overrun --deadline-s.

Every part runs even if an earlier one failed (the failure lands in ``errors``); waits on futures
time out at the deadline, so a hang is reported, not silent. Progress goes to stderr; tables to
stdout; with --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
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

import zerostall as zs
from zerostall.options import default_threads
from common import (IMPORT_ERRORS, N_TENSORS, T0, WHATS, AsyncContender, DCPArm, Futures, NoCheckpoint, Timing,
                    ZeroOverheadDCP, ZerostallArm, build_state, clear, dcp_default_start, dcp_read, describe,
                    descendants, first_save, init_group, median, model_state_bytes, overheads, print_json,
                    print_save_table, print_train_table, progress, remove, rep_seconds, rnd, rotated, save_summary,
                    show, state_bytes, status_kib, sync, time_save, train, zero_overhead_missing, zerostall_read,
                    zerostall_start)

if __name__ == "__mp_main__":  # DCP's writer process re-imports this module: quiet its per-save lines
    logging.disable(logging.INFO)
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")

STALE_TRIALS = 3
STALE_TENSOR_MB = 64
STALE_BUSY_S = 1.0  # GPU seconds of matmuls queued before the write (CPU: a token amount)
MEM_SAVES = 50
FUTURE_TIMEOUT_S = 120.0  # no single wait may take longer (an 8 GB save commits in ~10 s); capped by the deadline
REPORT_RESERVE_S = 20.0  # time kept for closing and printing after the last part


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    width: int
    heads: int
    layers: int
    ffn: int
    batch: int
    seq: int


GPU_MODEL = ModelConfig(vocab=8192, width=1024, heads=16, layers=20, ffn=4096, batch=8, seq=512)
CPU_MODEL = ModelConfig(vocab=256, width=64, heads=4, layers=2, ffn=256, batch=4, seq=32)


# --- small helpers --------------------------------------------------------------------------


class Deadline:
    """The wall-clock budget of the whole run; waits never outlast it."""

    def __init__(self, seconds: float) -> None:
        self.end = T0 + seconds
        self.hung = False  # set when a wait timed out: threads may be stuck, exit hard at the end

    def left(self) -> float:
        return self.end - time.perf_counter()

    def wait_s(self) -> float:
        return max(5.0, min(FUTURE_TIMEOUT_S, self.left()))

    def result(self, future: Future) -> Any:
        try:
            return future.result(timeout=self.wait_s())
        except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError since 3.11
            self.hung = True
            raise
        except Exception as exc:
            if type(exc).__name__ == "TimeoutError":  # python 3.10's concurrent.futures class
                self.hung = True
            raise


def pinned_allocated_bytes() -> int | None:
    """Bytes the CUDA host (pinned) caching allocator holds, where this torch reports it."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - a statistic, not worth failing for
        return None
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


def empty_host_cache() -> str | None:
    """Give cached pinned blocks back to the OS (names differ between releases; best effort);
    returns the name of the function that did it, or None."""
    candidates = [("torch.accelerator.empty_host_cache", getattr(getattr(torch, "accelerator", None),
                                                                  "empty_host_cache", None)),
                  ("torch._C._accelerator_emptyHostCache", getattr(torch._C, "_accelerator_emptyHostCache", None)),
                  ("torch._C._host_emptyCache", getattr(torch._C, "_host_emptyCache", None)),
                  ("torch._C._cuda_emptyHostCache", getattr(torch._C, "_cuda_emptyHostCache", None))]
    if not torch.cuda.is_available():
        return None
    for name, fn in candidates:
        if fn is not None:
            try:
                fn()
                return name
            except Exception:  # noqa: BLE001, S112 - best effort
                continue
    return None


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --- the contenders -------------------------------------------------------------------------

NAMES = ["zerostall", "dcp_default", "dcp_zero_overhead"]
BF16 = (torch.bfloat16,)  # the state's dtype, as a model's weights on the GPU


# --- part 1: save timings -------------------------------------------------------------------


@dataclass
class SaveResults:
    nbytes: int = 0
    n_tensors: int = 0
    pool_alloc_s: float | None = None
    pool_bytes: int | None = None
    pool_pinned_bytes: int | None = None
    pool_pinned_after_close: int | None = None
    pinned_after_close: int | None = None
    pinned_before_contenders: int | None = None
    host_cache_emptied_by: str | None = None
    d2h_s: list[float] = field(default_factory=list)
    d2h_pinned: bool = False
    first: dict[str, Timing] = field(default_factory=dict)
    reps: dict[str, list[Timing]] = field(default_factory=dict)
    stager_mode: str | None = None  # DCP zero-overhead: "reused" / "fresh per save" / None (did not run)
    reuse_probe: Timing | None = None


def d2h_copy_seconds(state: dict[str, torch.Tensor], device: torch.device, reps: int, pin: bool) -> list[float]:
    """Seconds to copy the state into preallocated (pinned on CUDA), touched host buffers."""
    total = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in state.values())
    arena = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    arena.zero_()
    views, offset = [], 0
    for t in state.values():
        n = t.numel() * t.element_size()
        views.append(arena[offset:offset + n].view(t.dtype).reshape(t.shape))
        offset += -(-n // 64) * 64
    seconds = []
    for rep in range(reps + 1):  # rep 0 is the warm copy
        sync(device)
        start = time.perf_counter()
        for buf, t in zip(views, state.values()):
            buf.copy_(t, non_blocking=pin)
        sync(device)
        if rep:
            seconds.append(time.perf_counter() - start)
    key = next(iter(state))
    if not torch.equal(views[0], state[key].cpu()):
        raise AssertionError("the raw device-to-host copy is wrong")
    del views, arena
    return seconds


def probe_reuse(zoc: ZeroOverheadDCP, state: dict[str, torch.Tensor], root: str, device: torch.device,
                deadline: Deadline) -> tuple[Timing | None, str | None]:
    """A second save with the same stager, after a tensor changed: (its timing, None) when it
    commits and reads back the new value, else (None, why not)."""
    key = next(iter(state))
    state[key].add_(1.0)
    sync(device)
    expected = state[key].cpu()
    path = os.path.join(root, "dcp_zero_overhead-reuse")
    try:
        timing = time_save(lambda: zoc.start(state, path), deadline.result)
        got = dcp_read(path, key, expected)
        if not torch.equal(got, expected):
            return None, "a reused DefaultStager saved stale data (the tensor changed since the first save)"
        return timing, None
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        return None, describe(exc)
    finally:
        remove(path)


def run_save_part(args: argparse.Namespace, device: torch.device, root: str, deadline: Deadline,
                  errors: dict[str, str], notes: list[str]) -> SaveResults:
    out = SaveResults()
    pin = device.type == "cuda"
    progress(f"part 1: building a {args.size_mb} MiB bf16 state of {N_TENSORS} tensors on {device}")
    state = build_state(args.size_mb << 20, dtypes=BF16, device=device)
    out.nbytes, out.n_tensors = state_bytes(state), len(state)

    saver = zs.AsyncSaver()
    out.pool_alloc_s = saver.reserve(state)
    out.pool_bytes = saver.pool.nbytes
    out.pool_pinned_bytes = saver.pool.pinned_bytes
    progress(f"zerostall pool: {out.pool_bytes / 1e9:.2f} GB allocated in {out.pool_alloc_s:.3f} s "
             f"({out.pool_pinned_bytes / 1e9:.2f} GB pinned)")

    try:
        out.d2h_pinned = pin
        out.d2h_s = d2h_copy_seconds(state, device, args.reps, pin)
        progress(f"raw D2H ({'pinned' if pin else 'host memory'}): "
                 f"{out.nbytes / statistics.median(out.d2h_s) / 1e9:.2f} GB/s")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        errors["d2h"] = describe(exc)
    gc.collect()
    out.host_cache_emptied_by = empty_host_cache()
    out.pinned_before_contenders = pinned_allocated_bytes()  # the pool alone, if the cache was emptied

    zoc: ZeroOverheadDCP | None = None
    cs = [AsyncContender("zerostall", zerostall_start(saver), zerostall_read),
          AsyncContender("dcp_default", dcp_default_start, dcp_read)]
    why_not = zero_overhead_missing()
    if why_not is None:
        zoc = ZeroOverheadDCP(pin)
        cs.append(AsyncContender("dcp_zero_overhead", zoc.start, dcp_read))
    else:
        errors["dcp_zero_overhead"] = why_not
    live = []
    for c in cs:
        progress(f"first save: {c.name}")
        try:
            out.first[c.name] = first_save(c, state, root, deadline.result, device)
            out.reps[c.name] = []
            live.append(c)
            show(f"first {c.name}", out.first[c.name])
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
            errors[c.name] = f"first save: {describe(exc)}"
            progress(f"{c.name} failed: {errors[c.name]}")
        gc.collect()

    if zoc is not None and any(c.name == "dcp_zero_overhead" for c in live):
        progress("dcp_zero_overhead: saving again with the same stager")
        out.reuse_probe, failure = probe_reuse(zoc, state, root, device, deadline)
        if failure is not None:
            errors["dcp_zero_overhead_stager_reuse"] = failure
            notes.append(f"reusing DCP's DefaultStager failed ({failure}); a fresh stager per save from then on")
            progress(notes[-1])
            zoc.fall_back()
        else:
            show("reused dcp_zero_overhead", out.reuse_probe)
        out.stager_mode = zoc.mode
        gc.collect()

    for rep in range(1, args.reps + 1):
        for c in rotated(list(live), rep - 1):
            if deadline.left() < REPORT_RESERVE_S:
                errors.setdefault("save_reps", f"stopped at rep {rep}: out of time")
                break
            path = os.path.join(root, f"{c.name}-{rep}")
            sync(device)
            try:
                timing = time_save(lambda c=c, path=path, s=state: c.start(s, path), deadline.result)
            except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
                remove(path)
                if c.name == "dcp_zero_overhead" and zoc is not None and zoc.reuse and not deadline.hung:
                    errors["dcp_zero_overhead_stager_reuse"] = f"rep {rep}: {describe(exc)}"
                    notes.append(f"a reused DCP stager failed in rep {rep}; a fresh stager per save from then on")
                    zoc.fall_back()
                    out.stager_mode = zoc.mode
                    try:
                        timing = time_save(lambda c=c, path=path, s=state: c.start(s, path), deadline.result)
                    except Exception as exc2:  # noqa: BLE001
                        errors[c.name] = f"rep {rep}: {describe(exc2)}"
                        live.remove(c)
                        continue
                else:
                    errors[c.name] = f"rep {rep}: {describe(exc)}"
                    live.remove(c)
                    continue
            finally:
                gc.collect()
            remove(path)
            out.reps[c.name].append(timing)
            show(f"rep {rep}/{args.reps} {c.name}", timing)

    if "dcp_zero_overhead" not in [c.name for c in live]:
        out.stager_mode = None
    with contextlib.suppress(Exception):
        saver.close()
    out.pool_pinned_after_close = saver.pool.pinned_bytes
    gc.collect()
    out.pinned_after_close = pinned_allocated_bytes()  # still held by torch's host cache after close()?
    if zoc is not None:
        zoc.close()
    del state, cs, live
    clear(root)
    free_device_memory(device)
    empty_host_cache()
    return out


# --- part 2: stale capture ------------------------------------------------------------------


@dataclass
class StaleResult:
    stale: int | None = None  # trials whose checkpoint did not hold the new values
    pending: int | None = None  # trials where the queued write was still pending at the save's return
    outcomes: list[str] = field(default_factory=list)  # "new" / "old" / "mixed" per trial
    stager: str | None = None  # DCP: "reused" / "fresh per save"


class Busy:
    """Queues ~``seconds`` of matmuls on the current stream (calibrated once)."""

    def __init__(self, device: torch.device, seconds: float) -> None:
        n = 16384 if device.type == "cuda" else 256
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.a = torch.randn(n, n, device=device, dtype=dtype) / math.sqrt(n)
        self.out = torch.empty_like(self.a)
        self.device = device
        self.queue(2)
        sync(device)
        start = time.perf_counter()
        self.queue(5)
        sync(device)
        per = (time.perf_counter() - start) / 5
        self.iters = max(1, math.ceil(seconds / max(per, 1e-6)))
        self.seconds = per * self.iters

    def queue(self, iters: int | None = None) -> None:
        for _ in range(self.iters if iters is None else iters):
            torch.mm(self.a, self.a, out=self.out)


Reader = Callable[[str, str, torch.Tensor], torch.Tensor]  # (path, key, like) -> the saved tensor


def stale_trials(name: str, start: Callable[[Any, str], Futures], read: Reader,
                 busy: Busy, device: torch.device, root: str, deadline: Deadline) -> StaleResult:
    numel = (STALE_TENSOR_MB << 20) // 4
    state = {"w": torch.zeros(numel, device=device)}
    warm = os.path.join(root, f"stale-{name}-warm")
    deadline.result(start(state, warm)[1])  # the first save's costs stay out of the trials
    remove(warm)
    out = StaleResult(stale=0, pending=0)
    for trial in range(STALE_TRIALS):
        old, new = float(2 * trial + 1), float(2 * trial + 2)
        state["w"].fill_(old)
        new_values = torch.full((numel,), new, device=device)
        sync(device)
        busy.queue()
        state["w"].copy_(new_values)  # queued behind the matmuls
        written = torch.cuda.Event() if device.type == "cuda" else None
        if written is not None:
            written.record()
        path = os.path.join(root, f"stale-{name}-{trial}")
        staged, committed = start(state, path)  # no synchronize: that is the point
        pending = written is not None and not written.query()
        if staged is not None:
            deadline.result(staged)
        deadline.result(committed)
        got = read(path, "w", new_values.cpu())
        remove(path)
        outcome = "new" if bool((got == new).all()) else "old" if bool((got == old).all()) else "mixed"
        out.outcomes.append(outcome)
        out.stale += outcome != "new"
        out.pending += pending
        progress(f"stale check {name} trial {trial + 1}/{STALE_TRIALS}: checkpoint holds {outcome} values"
                 f" (write {'pending' if pending else 'already done'} when the call returned)")
        sync(device)
    return out


def run_stale_part(device: torch.device, root: str, deadline: Deadline, stager_mode: str | None,
                   errors: dict[str, str]) -> dict[str, StaleResult]:
    progress(f"part 2: stale capture, {STALE_TRIALS} trials each")
    busy = Busy(device, STALE_BUSY_S if device.type == "cuda" else 0.02)
    progress(f"queued work per trial: {busy.iters} matmuls, ~{busy.seconds:.2f} s")
    results: dict[str, StaleResult] = {}
    saver = zs.AsyncSaver()
    try:
        results["zerostall"] = stale_trials("zerostall", zerostall_start(saver), zerostall_read, busy, device,
                                            root, deadline)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        errors["zerostall_stale_check"] = describe(exc)
    finally:
        with contextlib.suppress(Exception):
            saver.close()
    why_not = zero_overhead_missing()
    if why_not is not None or stager_mode is None:
        errors["dcp_stale_check"] = why_not or "DCP's zero-overhead mode failed in part 1"
    else:
        zoc = ZeroOverheadDCP(pin=device.type == "cuda", reuse=stager_mode == "reused")
        try:
            try:
                results["dcp"] = stale_trials("dcp", zoc.start, dcp_read, busy, device, root, deadline)
            except Exception as exc:
                if not zoc.reuse or deadline.hung:
                    raise
                errors["dcp_stale_stager_reuse"] = describe(exc)
                zoc.fall_back()
                clear(root)
                results["dcp"] = stale_trials("dcp", zoc.start, dcp_read, busy, device, root, deadline)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            errors["dcp_stale_check"] = describe(exc)
        finally:
            if "dcp" in results:
                results["dcp"].stager = zoc.mode
            zoc.close()
    del busy
    clear(root)
    free_device_memory(device)
    return results


# --- part 3: host memory --------------------------------------------------------------------


def shm_used_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def host_footprint_mib() -> tuple[float, float]:
    """(RSS less shared pages of the process tree, /dev/shm usage), MiB; shared pages are counted
    once, in /dev/shm."""
    tree = [os.getpid(), *descendants(os.getpid())]
    rss = sum(status_kib(p, "VmRSS") - status_kib(p, "RssShmem") for p in tree) / 1024
    return rss, shm_used_bytes() / 2**20


@dataclass
class MemResult:
    growth_mb: float | None = None
    rss_growth_mb: float | None = None
    shm_growth_mb: float | None = None
    state_mb: int = 0
    saves: int = 0


def run_mem_part(args: argparse.Namespace, device: torch.device, root: str, deadline: Deadline) -> MemResult:
    out = MemResult(state_mb=args.mem_state_mb, saves=MEM_SAVES)
    progress(f"part 3: host memory over {MEM_SAVES} zerostall saves of a {args.mem_state_mb} MiB state")
    state = build_state(args.mem_state_mb << 20, seed=1, n=64, dtypes=BF16, device=device)
    path = os.path.join(root, "mem")
    with zs.AsyncSaver() as saver:
        saver.reserve(state)
        start = zerostall_start(saver)
        deadline.result(start(state, path)[1])
        gc.collect()
        rss0, shm0 = host_footprint_mib()
        for _ in range(MEM_SAVES):
            deadline.result(start(state, path)[1])
        gc.collect()
        rss1, shm1 = host_footprint_mib()
    out.rss_growth_mb, out.shm_growth_mb = rss1 - rss0, shm1 - shm0
    out.growth_mb = out.rss_growth_mb + out.shm_growth_mb
    progress(f"host memory growth {out.growth_mb:.1f} MiB "
             f"(RSS {out.rss_growth_mb:+.1f}, /dev/shm {out.shm_growth_mb:+.1f})")
    del state
    clear(root)
    free_device_memory(device)
    return out


# --- part 4: training overhead --------------------------------------------------------------


class LM(torch.nn.Module):
    """A pre-norm transformer language model (no causal mask: the cost is what matters here)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.width)
        layer = torch.nn.TransformerEncoderLayer(cfg.width, cfg.heads, cfg.ffn, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(cfg.width)
        self.head = torch.nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


class Trainer:
    """The model, AdamW and one fixed batch on ``device``."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = LM(cfg).to(device)
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **fused)
        gen = torch.Generator(device=device).manual_seed(0)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=device, generator=gen)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]
        self.forward_backward()
        self.optimizer.step()  # the optimizer's state exists from here on, so reserve() sees it
        sync(device)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optimizer}

    def forward_backward(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                    else contextlib.nullcontext())
        with autocast:
            logits = self.model(self.x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), self.y.flatten()).backward()

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def state_nbytes(self) -> int:
        return model_state_bytes(self.model, self.optimizer)


def slots(root: str, arm: NoCheckpoint, every: int) -> Callable[[int], str]:
    """The arm's save path at a step: two slots in turn, under the arm's directory."""
    return lambda step: os.path.join(root, arm.name, f"slot{(step // every) % 2}")


def train_or_fall_back(trainer: Trainer, arm: NoCheckpoint, steps: int, every: int, root: str,
                       zoc: ZeroOverheadDCP | None, deadline: Deadline, errors: dict[str, str], label: str) -> float:
    """One run of ``train``; should a reused DCP stager fail on this state, fresh stagers from
    then on and the run once more."""
    try:
        return train(trainer, arm, steps, every, slots(root, arm, every))
    except Exception as exc:
        if not (isinstance(arm, DCPArm) and zoc is not None and zoc.reuse) or deadline.hung:
            raise
        errors["dcp_train_stager_reuse"] = f"{label}: {describe(exc)}"
        progress(f"training with a reused DCP stager failed ({errors['dcp_train_stager_reuse']}); "
                 "a fresh stager per save from then on")
        zoc.fall_back()
        clear_arm(root, arm.name)
        return train(trainer, arm, steps, every, slots(root, arm, every))


@dataclass
class TrainResult:
    seconds: dict[str, list[float]] = field(default_factory=dict)
    warm_s: dict[str, float] = field(default_factory=dict)
    dcp_mode: str | None = None
    dcp_stager: str | None = None  # zero-overhead mode: "reused" / "fresh per save"
    n_params: int = 0
    state_nbytes: int = 0
    rounds: int = 0


def run_train_part(args: argparse.Namespace, device: torch.device, root: str, deadline: Deadline,
                   stager_mode: str | None, errors: dict[str, str]) -> TrainResult:
    out = TrainResult()
    if deadline.left() < 3 * REPORT_RESERVE_S:
        raise RuntimeError(f"skipped: {deadline.left():.0f} s left before --deadline-s")
    cfg = GPU_MODEL if device.type == "cuda" else CPU_MODEL
    trainer = Trainer(cfg, device)
    out.n_params, out.state_nbytes = trainer.n_params(), trainer.state_nbytes()
    progress(f"part 4: training a {out.n_params / 1e6:.1f} M-parameter LM ({out.state_nbytes / 1e9:.2f} GB of state), "
             f"{args.train_steps} steps, a save every {args.save_every}, {args.train_reps} rounds")
    saver = zs.AsyncSaver()
    saver.reserve(trainer.state())
    zoc: ZeroOverheadDCP | None = None
    if stager_mode is not None:
        zoc = ZeroOverheadDCP(pin=device.type == "cuda", reuse=stager_mode == "reused")
        out.dcp_mode, dcp_start = "zero_overhead", zoc.start
    else:
        out.dcp_mode, dcp_start = "thread (default)", dcp_default_start
    arms: list[NoCheckpoint] = [NoCheckpoint(), ZerostallArm(saver, deadline.result),
                               DCPArm(dcp_start, deadline.result)]

    def run_arm(arm: NoCheckpoint, steps: int, label: str, t: Trainer = trainer) -> float:
        return train_or_fall_back(t, arm, steps, args.save_every, root, zoc, deadline, errors, label)

    warm_steps = 2 * args.save_every
    live = []
    for arm in arms:
        os.makedirs(os.path.join(root, arm.name), exist_ok=True)
        try:
            out.warm_s[arm.name] = run_arm(arm, warm_steps, "warm-up")
            out.seconds[arm.name] = []
            live.append(arm)
            progress(f"training warm-up {arm.name:10s} {out.warm_s[arm.name]:.2f} s for {warm_steps} steps")
        except Exception as exc:  # noqa: BLE001 - an arm that fails is reported, not fatal
            errors[f"train_{arm.name}"] = f"warm-up: {describe(exc)}"
            progress(f"training arm {arm.name} failed: {errors[f'train_{arm.name}']}")
        clear_arm(root, arm.name)
    # a round's cost: first guessed from the warm-ups (pessimistic: they hold each arm's first
    # saves), then the last round's duration; a round starts only if one that long still fits
    estimate = sum(out.warm_s[a.name] * args.train_steps / warm_steps for a in live)
    for rnd_i in range(1, args.train_reps + 1):
        if deadline.left() < estimate + REPORT_RESERVE_S:
            errors["train_rounds"] = (f"stopped after {rnd_i - 1} of {args.train_reps} rounds: the next "
                                      f"(~{estimate:.0f} s) would overrun --deadline-s")
            progress(errors["train_rounds"])
            break
        started = time.perf_counter()
        for arm in rotated(list(live), rnd_i - 1):  # no arm always runs first
            gc.collect()
            try:
                s = run_arm(arm, args.train_steps, f"round {rnd_i}")
            except Exception as exc:  # noqa: BLE001
                errors[f"train_{arm.name}"] = f"round {rnd_i}: {describe(exc)}"
                live.remove(arm)
                continue
            finally:
                clear_arm(root, arm.name)
            out.seconds[arm.name].append(s)
            progress(f"training round {rnd_i}/{args.train_reps} {arm.name:10s} {s:.3f} s")
        out.rounds = rnd_i
        estimate = time.perf_counter() - started
    out.dcp_stager = None if zoc is None else zoc.mode
    with contextlib.suppress(Exception):
        saver.close()
    if zoc is not None:
        zoc.close()
    del trainer, arms, live, run_arm
    clear(root)
    free_device_memory(device)
    return out


def clear_arm(root: str, name: str) -> None:
    path = os.path.join(root, name)
    remove(path)
    os.makedirs(path, exist_ok=True)


# --- the report -----------------------------------------------------------------------------


def print_save_part(res: SaveResults, errors: dict[str, str]) -> None:
    """Part 1 on stdout: the state, the save table, then the pool, raw D2H and stager figures."""
    print(f"state: {res.nbytes / 1e9:.2f} GB in {res.n_tensors} tensors")
    print_save_table(res.first, res.reps, errors, NAMES)
    if res.pool_alloc_s is not None:
        print(f"zerostall pool allocation (reserve): {res.pool_alloc_s:.3f} s, "
              f"{(res.pool_pinned_bytes or 0) / 1e9:.2f} GB of {(res.pool_bytes or 0) / 1e9:.2f} GB pinned")
    if res.d2h_s:
        kind = "pinned" if res.d2h_pinned else "pageable (no CUDA)"
        print(f"raw D2H into preallocated {kind} buffers: {res.nbytes / statistics.median(res.d2h_s) / 1e9:.2f} GB/s")
    if res.stager_mode is not None:
        print(f"DCP zero-overhead stager: {res.stager_mode}")


def print_stale(stale: dict[str, StaleResult]) -> None:
    for name, r in stale.items():
        print(f"stale captures, {name}: {r.stale}/{STALE_TRIALS} (write pending at the call in {r.pending}; "
              f"outcomes {', '.join(r.outcomes)})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where the state lives (cuda)")
    parser.add_argument("--size-mb", type=int, default=8192, help="part 1 state size in MiB (8192)")
    parser.add_argument("--reps", type=int, default=3, help="timed saves per contender, part 1 (3)")
    parser.add_argument("--dir", default="/dev/shm", help="where to save (a fresh dir under it)")
    parser.add_argument("--train-steps", type=int, default=300, help="training steps per run (300)")
    parser.add_argument("--save-every", type=int, default=None, help="save every N steps (30; CPU: 5)")
    parser.add_argument("--train-reps", type=int, default=3, help="interleaved runs per training arm (3)")
    parser.add_argument("--mem-state-mb", type=int, default=None, help="part 3 state size in MiB (256; CPU: 16)")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="wall-clock budget of the run (540)")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    args = parser.parse_args()
    if args.save_every is None:
        args.save_every = 30 if args.device == "cuda" else 5
    if args.mem_state_mb is None:
        args.mem_state_mb = 256 if args.device == "cuda" else 16
    return args


def run_part(name: str, errors: dict[str, str], fn: Callable[[], Any], default: Any,
             deadline: Deadline | None = None, need_s: float = 0.0) -> Any:
    """Run one part; a failure is recorded in ``errors`` and the run goes on. A part that needs
    more than the time left (``need_s``) is skipped, so the report still comes out."""
    if deadline is not None and deadline.left() < need_s:
        errors[name] = f"skipped: {deadline.left():.0f} s left before --deadline-s, {need_s:.0f} s needed"
        progress(errors[name])
        return default
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every part reports, none stops the others
        errors[name] = describe(exc)
        progress(f"{name} failed: {errors[name]}")
        return default


def main() -> None:
    args = parse_args()
    for message in ("torch.distributed is disabled", "Detected an existing checkpoint", ".*TypedStorage.*",
                    "Ignoring pin_memory flag", ".*synchronize_staging.*"):
        warnings.filterwarnings("ignore", message=message)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available here (use --device cpu for a smoke test)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deadline = Deadline(args.deadline_s)
    errors: dict[str, str] = dict(IMPORT_ERRORS)
    notes: list[str] = [("1-rank gloo process group over TCP loopback, initialized in-process; every contender "
                         "ran under it")]
    root = tempfile.mkdtemp(prefix="zerostall-bench-gpu-", dir=args.dir)
    saves, stale, mem, training = SaveResults(), {}, MemResult(), TrainResult()
    try:
        init_group()
        saves = run_part("save_part", errors, lambda: run_save_part(args, device, root, deadline, errors, notes),
                         saves)
        stale = run_part("stale_part", errors, lambda: run_stale_part(device, root, deadline, saves.stager_mode,
                                                                      errors), stale, deadline, 2 * REPORT_RESERVE_S)
        mem = run_part("mem_part", errors, lambda: run_mem_part(args, device, root, deadline), mem,
                       deadline, 2 * REPORT_RESERVE_S)
        training = run_part("train_part", errors,
                            lambda: run_train_part(args, device, root, deadline, saves.stager_mode, errors), training)
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)

    print_save_part(saves, errors)
    print()
    print_stale(stale)
    if mem.growth_mb is not None:
        print(f"host memory growth over {mem.saves} zerostall saves of {mem.state_mb} MiB: {mem.growth_mb:.1f} MiB")
    print()
    over = overheads(training.seconds)
    print_train_table(training.seconds, over)
    print(f"DCP arm mode: {training.dcp_mode}" + (f", stager {training.dcp_stager}" if training.dcp_stager else ""))
    if errors:
        print("errors: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    if args.json:
        zs_stale, dcp_stale = stale.get("zerostall"), stale.get("dcp")
        d2h_med = median(saves.d2h_s)
        none_med = median(training.seconds.get("none", []))
        result = {
            "state_gb": round(saves.nbytes / 1e9, 4),
            "state_bytes": saves.nbytes,
            "n_tensors": saves.n_tensors,
            "d2h_pinned_gbps": rnd(saves.nbytes / d2h_med / 1e9, 3) if d2h_med else None,
            "d2h_pinned": saves.d2h_pinned,
            "zerostall_pool_alloc_s": rnd(saves.pool_alloc_s),
            "zerostall_pool_bytes": saves.pool_bytes,
            "zerostall_pool_pinned_bytes": saves.pool_pinned_bytes,
            "zerostall_pool_pinned_bytes_after_close": saves.pool_pinned_after_close,
            "pinned_bytes_before_contenders": saves.pinned_before_contenders,
            "pinned_bytes_after_zerostall_close": saves.pinned_after_close,
            "pinned_cache_emptied_by": saves.host_cache_emptied_by,
            **save_summary(saves.first, saves.reps, errors, NAMES),
            "dcp_default_staged_is_stall": True,
            "dcp_zero_overhead_stager": saves.stager_mode,
            "dcp_zero_overhead_reuse_probe": (None if saves.reuse_probe is None else
                                              {w: rnd(getattr(saves.reuse_probe, w)) for w in WHATS}),
            "zerostall_train_overhead_pct": over.get("zerostall_train_overhead_pct"),
            "dcp_train_overhead_pct": over.get("dcp_train_overhead_pct"),
            "zerostall_train_overhead_pct_range": over.get("zerostall_train_overhead_pct_range"),
            "dcp_train_overhead_pct_range": over.get("dcp_train_overhead_pct_range"),
            "dcp_train_mode": training.dcp_mode,
            "dcp_train_stager": training.dcp_stager,
            "train_median_s": {a: rnd(median(s)) for a, s in training.seconds.items()},
            "train_min_s": {a: rnd(min(s)) if s else None for a, s in training.seconds.items()},
            "train_max_s": {a: rnd(max(s)) if s else None for a, s in training.seconds.items()},
            "train_step_s": rnd(none_med / args.train_steps, 5) if none_med else None,
            "train_params": training.n_params,
            "train_state_gb": round(training.state_nbytes / 1e9, 4),
            "train_steps": args.train_steps,
            "save_every": args.save_every,
            "train_reps": args.train_reps,
            "train_rounds_run": training.rounds,
            "host_mem_growth_mb": rnd(mem.growth_mb, 2),
            "host_mem_rss_growth_mb": rnd(mem.rss_growth_mb, 2),
            "host_mem_shm_growth_mb": rnd(mem.shm_growth_mb, 2),
            "host_mem_saves": mem.saves,
            "host_mem_state_mb": mem.state_mb,
            "zerostall_stale_captures": zs_stale.stale if zs_stale else None,
            "dcp_stale_captures": dcp_stale.stale if dcp_stale else None,
            "stale_trials": STALE_TRIALS,
            "zerostall_stale_pending": zs_stale.pending if zs_stale else None,
            "dcp_stale_pending": dcp_stale.pending if dcp_stale else None,
            "stale_outcomes": {name: r.outcomes for name, r in stale.items()},
            "dcp_stale_stager": dcp_stale.stager if dcp_stale else None,
            "reps": args.reps,
            "dir": args.dir,
            "zerostall_threads": default_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda,
            "elapsed_s": round(time.perf_counter() - T0, 1),
            "errors": errors,
            "notes": notes,
            "seconds": rep_seconds(saves.reps, NAMES),
            "d2h_seconds": [round(s, 4) for s in saves.d2h_s],
            "train_seconds": {a: [round(x, 4) for x in s] for a, s in training.seconds.items()},
            "train_warmup_s": {a: round(x, 4) for a, x in training.warm_s.items()},
        }
        print_json(result)
    sys.stdout.flush()
    if deadline.hung:  # a wait timed out: a stuck writer thread would block a normal exit
        sys.stderr.flush()
        os._exit(3)


if __name__ == "__main__":
    main()
