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
so the run initializes a 1-rank gloo group in this process (over TCP on loopback, with
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
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zerostall as zs
from common import (N_TENSORS, AsyncContender, DCPArm, Futures, NoCheckpoint, Timing, ZeroOverheadDCP, ZerostallArm,
                    build_state, clear, dcp_default_start, dcp_read, describe, descendants, first_save, init_group,
                    median, model_state_bytes, overheads, print_json, print_save_table, print_train_table, progress,
                    remove, rep_seconds, rnd, rotated, save_summary, show, state_bytes, status_kib, time_save,
                    train, zerostall_read, zerostall_start)

MEM_STATE_MB = 64
MEM_SAVES = 50
MLP_WIDTH, MLP_DEPTH, MLP_BATCH = 1280, 4, 256


# --- the contenders -------------------------------------------------------------------------


class FallingBackDCP(ZeroOverheadDCP):
    """DCP's zero-overhead mode without pinning (no CUDA here); should the reused stager fail to start a save after its
    first, a fresh stager per save from then on, said in ``notes``."""

    def __init__(self) -> None:
        super().__init__(pin=False)
        self.saves = 0  # saves started with the reused stager
        self.notes: list[str] = []

    def start(self, state: Any, path: str) -> Futures:
        """Start a save: (staged, committed); a failing reused stager is replaced by fresh ones and the save retried."""
        if not self.reuse:
            return super().start(state, path)
        try:
            futures = super().start(state, path)
        except Exception as exc:  # e.g. pytorch#183413 on torch 2.11
            if self.saves == 0:
                raise  # not a reuse failure
            self.notes.append(f"reusing one DefaultStager failed ({describe(exc)}); fresh stager per save from then on")
            progress(self.notes[-1])
            self.fall_back()
            return super().start(state, path)
        self.saves += 1
        return futures


def zerostall_contender(saver: zs.AsyncSaver) -> AsyncContender:
    return AsyncContender("zerostall", zerostall_start(saver), zerostall_read)


def dcp_default_contender() -> AsyncContender:
    return AsyncContender("dcp_default", dcp_default_start, dcp_read)


def dcp_zero_overhead_contender(zoc: FallingBackDCP) -> AsyncContender:
    return AsyncContender("dcp_zero_overhead", zoc.start, dcp_read)


# --- the save timings -----------------------------------------------------------------------


@dataclass
class SaveResults:
    first: dict[str, Timing] = field(default_factory=dict)
    reps: dict[str, list[Timing]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def run_saves(cs: list[AsyncContender], state: dict[str, torch.Tensor], root: str, reps: int) -> SaveResults:
    out = SaveResults()
    live = []
    for c in cs:
        progress(f"first save: {c.name}")
        try:
            out.first[c.name] = first_save(c, state, root)
            out.reps[c.name] = []
            live.append(c)
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
            out.errors[c.name] = describe(exc)
            progress(f"{c.name} failed: {out.errors[c.name]}")
        show(f"first {c.name}", out.first.get(c.name))
    for rep in range(1, reps + 1):
        for c in list(live):
            path = os.path.join(root, f"{c.name}-{rep}")
            try:
                timing = time_save(lambda c=c, path=path: c.start(state, path))
            except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
                out.errors[c.name] = f"rep {rep}: {describe(exc)}"
                live.remove(c)
                continue
            finally:
                gc.collect()
            remove(path)
            out.reps[c.name].append(timing)
            show(f"rep {rep}/{reps} {c.name}", timing)
    return out


# --- the training overhead ------------------------------------------------------------------


class Trainer:
    """A small CPU MLP with AdamW and one fixed batch: ~70-110 ms a step on this 2-core VM."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
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


def run_training(arms: list[NoCheckpoint], trainer: Trainer, steps: int, every: int, runs: int,
                 root: str) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for arm in arms:
        progress(f"training warm-up: {arm.name}")
        train(trainer, arm, 2 * every, every, lambda step, arm=arm: os.path.join(root, f"{arm.name}-warm-{step}"))
        clear(root)
    for run in range(1, runs + 1):
        for arm in rotated(arms, run - 1):  # no arm always runs first
            gc.collect()
            s = train(trainer, arm, steps, every,
                      lambda step, arm=arm, run=run: os.path.join(root, f"{arm.name}-{run}-{step}"))
            clear(root)
            seconds[arm.name].append(s)
            progress(f"training run {run}/{runs} {arm.name:10s} {s:.3f} s")
    return seconds


# --- host memory ----------------------------------------------------------------------------


def tree_rss_mib() -> float:
    me = os.getpid()
    return sum(status_kib(p, "VmRSS") for p in [me, *descendants(me)]) / 1024


def memory_growth(start: Callable[[Any, str], Futures], state: dict, path: str) -> float:
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


# --- the report -----------------------------------------------------------------------------


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
            init_group()
            notes.append("1-rank gloo process group (TCP on loopback) initialized in-process: DCP's process "
                          "mode needs one; every contender ran under it")

        # -- save timings on the big state --
        progress(f"building a {args.size_mb} MiB state of {args.tensors} tensors")
        state = build_state(args.size_mb << 20, n=args.tensors)
        nbytes = state_bytes(state)
        saver = zs.AsyncSaver(writer=args.writer)
        pool_alloc_s = saver.reserve(state)
        progress(f"zerostall pool allocation {pool_alloc_s:.3f} s")
        zoc = FallingBackDCP()
        cs = [zerostall_contender(saver), dcp_default_contender(), dcp_zero_overhead_contender(zoc)]
        res = run_saves(cs, state, root, args.reps)
        errors.update(res.errors)
        notes += zoc.notes
        zoc_works = "dcp_zero_overhead" not in res.errors
        stager_mode = zoc.mode if zoc_works else None
        saver.close()
        zoc.close()
        del state, cs
        clear(root)
        gc.collect()

        # -- training overhead --
        trainer = Trainer()
        train_saver = zs.AsyncSaver(writer=args.writer)
        train_saver.reserve(trainer.state())
        train_zoc = FallingBackDCP()
        dcp_mode = "zero_overhead" if zoc_works else "thread"
        dcp_start = train_zoc.start if zoc_works else dcp_default_start
        arms = [NoCheckpoint(), ZerostallArm(train_saver), DCPArm(dcp_start)]
        train_seconds = run_training(arms, trainer, args.train_steps, args.save_every, args.train_runs, root)
        notes += train_zoc.notes
        train_saver.close()
        train_zoc.close()
        clear(root)
        train_state_bytes = model_state_bytes(trainer.model, trainer.optimizer)
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
            mem_zoc = FallingBackDCP()
            try:
                dcp_growth = memory_growth(mem_zoc.start, small, os.path.join(root, "mem-dcp"))
            except Exception as exc:  # noqa: BLE001 - reported in errors
                errors["dcp_zero_overhead_host_mem"] = describe(exc)
            notes += mem_zoc.notes
            mem_zoc.close()
        progress(f"host memory growth: zerostall {growth:.1f} MiB, DCP zero-overhead "
                 + ("n/a" if dcp_growth is None else f"{dcp_growth:.1f} MiB"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)

    print_save_table(res.first, res.reps, res.errors, names)
    print(f"zerostall pool allocation (reserve): {pool_alloc_s:.3f} s")
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
            **save_summary(res.first, res.reps, res.errors, names),
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
            "seconds": rep_seconds(res.reps, names),
            "train_seconds": {arm: [round(x, 4) for x in s] for arm, s in train_seconds.items()},
        }
        print_json(result)


if __name__ == "__main__":
    main()
