"""Distributed save/load of zerostall against PyTorch DCP, on N gloo ranks of this machine.

    python bench/distributed.py [--world N] [--size-mb N] [--reps R] [--dir D] [--json]

N ranks are spawned (torch.multiprocessing, gloo, OMP_NUM_THREADS=1). Together they save and load
three states with each contender at its defaults, collectively on the default process group:
zerostall (``zs.save(state, path)`` / ``zs.load(state, path)``) and DCP
(``dcp.save(state, checkpoint_id=path)`` / ``dcp.load(state, checkpoint_id=path)``).

- fsdp: a model sharded with FSDP2 (``fully_shard`` per block and at the root, over a 1-D CPU
  DeviceMesh) and its AdamW state after one step, ``{"model": ..., "optim": ...}`` from
  ``get_state_dict(model, optim)``; the parameters are ~1/3 of --size-mb (AdamW keeps exp_avg and
  exp_avg_sq), so model + optimizer state is ~--size-mb across all ranks. The model is a 16-block
  Llama-layout transformer (~590 tensor leaves with the optimizer state: the structure of a real
  checkpoint, whose planning cost grows with its leaves) or, with --fsdp-model linear, a stack of
  Linear layers (~60 leaves);
- replicated (DDP-style): every rank holds the same full plain tensors, ~--size-mb in all, 256
  tensors of mixed sizes and dtypes (``build_state`` of bench/common.py, as in bench/save_load.py). Here zerostall also
  loads with ``broadcast=True`` (one replica reads each byte, the others receive it over gloo);
- reshard: 16 float32 matrices (~--size-mb in all) saved as DTensors sharded by rows
  (``Shard(0)``) and loaded into the same matrices sharded by columns (``Shard(1)``): every rank
  needs a strided part of every saved shard (as when the tensor-parallel layout changes).

Method: every contender is warmed with one untimed save and load of each state; that load goes
into the zeroed state and must reproduce it. Then repetitions are interleaved (rep 1: every
contender, rep 2: every contender, ...); every save goes to a fresh path in a fresh directory under
--dir (default /dev/shm), deleted after its loads, outside the timing; every load goes in place into
the same, already-touched state. A time is one rank's wall time from a barrier to the end of its
call; the figure is the median over reps of the maximum over ranks.

Measured alongside, untimed:
- write imbalance: data bytes written by the busiest rank / mean bytes per rank, from the file
  names (zerostall ``<generation>-r<rank:05d>-<n>.safetensors``, DCP ``__<rank>_<n>.distcp``);
- read bytes ratio: bytes read by all ranks during a load (``rchar`` deltas of /proc/self/io: read
  syscalls on files; gloo's socket traffic and pages touched through mmap do not count), summed
  over ranks, / the bytes of the checkpoint's data files;
- zerostall's planning time on the first save of the fsdp structure and on later saves, when
  zerostall's ``save`` returns a ``SaveInfo`` whose ``plan_s`` is the planning time of that save.

An operation that fails on any rank is reported under ``errors`` (with the first failing rank) and
skipped from then on; the other contenders go on (a failure that leaves the ranks in different
collectives ends the run at the process group's timeout, GROUP_TIMEOUT). Progress goes to stderr, a
table to stdout; with --json the last line of stdout is one JSON object.
"""

import argparse
import functools
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import zerostall as zs
from common import build_state, describe, free_port, init_group, print_json, progress

GROUP_TIMEOUT = timedelta(minutes=5)  # a contender stuck in a collective fails instead of hanging
MAX_WIDTH = 1024  # of the Linear layers
MIN_LAYERS = 8
TRANSFORMER_LAYERS = 16
VOCAB_PER_DIM = 4  # vocabulary = 4 x width
RESULT_FILE = "result.json"  # rank 0 hands the result to the parent through this file in the root
CASES = ("fsdp", "replicated", "reshard")
RESHARD_TENSORS = 16


@dataclass
class Contender:
    """One library: a collective save, the loads to time on what it saved, its data files."""

    name: str
    save: Callable[[Any, str], Any]
    loads: dict[str, Callable[[Any, str], Any]]  # op name -> in-place load
    data_file: re.Pattern[str]  # matches its data file names; group 1 is the writing rank
    plan_s: Callable[[], float | None] = lambda: None  # planning time of its last save

    @property
    def save_op(self) -> str:
        return f"{self.name}_save"


@dataclass
class RankLog:
    """What one rank measured on one state. Errors are agreed, so they are the same on every rank;
    file sizes are read by rank 0 only."""

    state_bytes: int
    tensors: int  # tensor leaves of the state (what planning walks)
    seconds: dict[str, list[float]] = field(default_factory=dict)  # op -> one per rep
    read_bytes: dict[str, list[int]] = field(default_factory=dict)  # load op -> one per rep
    plan_s: dict[str, list[float]] = field(default_factory=dict)  # "first" / "resave" -> values
    errors: dict[str, str] = field(default_factory=dict)  # op -> first failure
    written: dict[str, list[int]] = field(default_factory=dict)  # contender -> bytes per rank


# --- the contenders -------------------------------------------------------------------------


_last_zerostall_save: list[zs.SaveInfo] = []


def zerostall_save(state: Any, path: str) -> None:
    _last_zerostall_save[:] = [zs.save(state, path)]


def zerostall_plan_s() -> float | None:
    """Planning time of the last zerostall save (its ``SaveInfo.plan_s``)."""
    return _last_zerostall_save[0].plan_s if _last_zerostall_save else None


def dcp_save(state: Any, path: str) -> None:
    dcp.save(state, checkpoint_id=path)


def dcp_load(state: Any, path: str) -> None:
    dcp.load(state, checkpoint_id=path)


def contenders(broadcast: bool) -> list[Contender]:
    zs_loads: dict[str, Callable[[Any, str], Any]] = {"zerostall_load": zs.load}
    if broadcast:
        zs_loads["zerostall_broadcast_load"] = functools.partial(zs.load, broadcast=True)
    return [
        Contender(
            "zerostall",
            zerostall_save,
            zs_loads,
            re.compile(r"^.+-r(\d{5})-\d+\.safetensors$"),
            zerostall_plan_s,
        ),
        Contender("dcp", dcp_save, {"dcp_load": dcp_load}, re.compile(r"^__(\d+)_\d+\.distcp$")),
    ]


# --- the states -----------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block's parameters (Llama layout: 4 attention and 3 MLP matrices, 2
    norms): the state structure an FSDP2 checkpoint of a real model has, at any width."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        x = x + self.wo(self.wv(h) * torch.sigmoid(self.wq(h) * self.wk(h)))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, dim: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, 8 * dim // 3) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def fsdp_shape(total_bytes: int, kind: str) -> tuple[int, int]:
    """(width, layers) of a model whose fp32 parameters are ~total_bytes / 3 (AdamW keeps two more
    copies): a transformer of TRANSFORMER_LAYERS blocks, or a stack of Linear layers."""
    params = total_bytes // 3 // 4
    if kind == "transformer":  # 12 d^2 per block, plus embedding and output (VOCAB_PER_DIM d^2 each)
        per_d2 = 12 * TRANSFORMER_LAYERS + 2 * VOCAB_PER_DIM
        return max(64, math.isqrt(params // per_d2) // 64 * 64), TRANSFORMER_LAYERS
    width = min(MAX_WIDTH, max(64, math.isqrt(params // MIN_LAYERS) // 64 * 64))
    return width, max(1, round(params / (width * width + width)))


def fsdp_state(total_bytes: int, world: int, kind: str) -> dict[str, Any]:
    """An FSDP2-sharded model after one AdamW step, as DCP's get_state_dict gives it."""
    width, layers = fsdp_shape(total_bytes, kind)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same initial model on every rank
    if kind == "transformer":
        model: nn.Module = Transformer(width, layers, VOCAB_PER_DIM * width)
        blocks, batch = list(model.layers), torch.randint(0, VOCAB_PER_DIM * width, (2, 8))
    else:
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        blocks, batch = list(model), torch.randn(4, width)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(batch).sum().backward()
    optim.step()
    optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def reshard_states(total_bytes: int, world: int) -> tuple[dict[str, DTensor], dict[str, DTensor]]:
    """The same global matrices (~total_bytes of float32), sharded by rows for the save and by
    columns for the load: every loaded shard takes a strided part of every saved one."""
    mesh = init_device_mesh("cpu", (world,))
    cols = 1024 * world
    rows = max(world, total_bytes // (RESHARD_TENSORS * cols * 4) // world * world)
    torch.manual_seed(1)  # the same values on every rank
    full = [torch.randn(rows + world * i, cols) for i in range(RESHARD_TENSORS)]
    by_rows = {f"w{i}": distribute_tensor(t, mesh, [Shard(0)]) for i, t in enumerate(full)}
    by_cols = {f"w{i}": distribute_tensor(t, mesh, [Shard(1)]) for i, t in enumerate(full)}
    return by_rows, by_cols


def tensors(node: Any) -> Iterator[torch.Tensor]:
    """Every tensor leaf of a nested state, DTensors included."""
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from tensors(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from tensors(value)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def logical_bytes(state: Any) -> int:
    """Bytes of the state as one copy: DTensors at their global size, plain tensors once."""
    return sum(t.numel() * t.element_size() for t in tensors(state))


@torch.no_grad()
def snapshot(state: Any) -> list[torch.Tensor]:
    return [local(t).clone() for t in tensors(state)]


@torch.no_grad()
def fill(state: Any, values: list[torch.Tensor] | None) -> None:
    """Copy values into this rank's part of every tensor of state, or zero them (None)."""
    for i, t in enumerate(tensors(state)):
        if values is None:
            local(t).zero_()
        else:
            local(t).copy_(values[i])


def mismatch(state: Any, expected: list[torch.Tensor]) -> str | None:
    bad = sum(not torch.equal(local(t), e) for t, e in zip(tensors(state), expected))
    return f"loaded wrong data into {bad} tensors" if bad else None


# --- measuring on every rank ----------------------------------------------------------------


def rchar() -> int:
    """Bytes this process has read through read syscalls, all threads together."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def first_error(error: str | None) -> str | None:
    """The first failure on any rank (the same answer on every rank), or None."""
    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(outcomes) if e), None)


def call(fn: Callable[[Any, str], Any], state: Any, path: str) -> tuple[float, str | None]:
    """One collective call on every rank: this rank's seconds from a barrier, any rank's failure."""
    dist.barrier()
    start = time.perf_counter()
    error = None
    try:
        fn(state, path)
    except Exception as exc:  # noqa: BLE001 (one contender failing must not stop the others)
        error = describe(exc)
    seconds = time.perf_counter() - start
    return seconds, first_error(error)


def bytes_by_rank(path: str, pattern: re.Pattern[str], world: int) -> list[int]:
    sizes = [0] * world
    for entry in os.scandir(path):
        match = pattern.match(entry.name)
        if match:
            sizes[int(match.group(1))] += entry.stat().st_size
    return sizes


def remove_together(path: str) -> None:
    """Delete a checkpoint collectively: rank 0 deletes it between barriers, so no rank still reads it."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def save(c: Contender, state: Any, path: str, log: RankLog) -> float | None:
    """Save; on rank 0 note the bytes each rank wrote. None (and the error logged) if it failed."""
    seconds, error = call(c.save, state, path)
    if error:
        log.errors[c.save_op] = error
        return None
    if dist.get_rank() == 0:
        log.written[c.name] = bytes_by_rank(path, c.data_file, dist.get_world_size())
    return seconds


def warm_up(
    c: Contender, state: Any, target: Any, expected: list[torch.Tensor], path: str, log: RankLog
) -> None:
    """One untimed save, then each load into the zeroed target, which must come back as it was."""
    if save(c, state, path, log) is not None:
        plan_s = c.plan_s()
        if plan_s is not None:
            log.plan_s.setdefault("first", []).append(plan_s)
        for op, load in c.loads.items():
            fill(target, None)
            _, error = call(load, target, path)
            error = error or first_error(mismatch(target, expected))
            fill(target, expected)
            if error:
                log.errors[op] = error
    remove_together(path)


def timed_rep(
    c: Contender, state: Any, target: Any, expected: list[torch.Tensor], path: str, log: RankLog
) -> None:
    """One timed save and each timed load of it, in place into the touched target."""
    if c.save_op in log.errors:
        return
    seconds = save(c, state, path, log)
    if seconds is not None:
        log.seconds.setdefault(c.save_op, []).append(seconds)
        plan_s = c.plan_s()
        if plan_s is not None:
            log.plan_s.setdefault("resave", []).append(plan_s)
        for op, load in c.loads.items():
            if op in log.errors:
                continue
            before = rchar()
            seconds, error = call(load, target, path)
            read = rchar() - before
            if error:
                log.errors[op] = error
                fill(target, expected)
                continue
            log.seconds.setdefault(op, []).append(seconds)
            log.read_bytes.setdefault(op, []).append(read)
    remove_together(path)


def run_case(name: str, state: Any, cs: list[Contender], root: str, reps: int, target: Any = None) -> RankLog:
    """Save ``state`` and load it into ``target`` (the same global values in another layout; by
    default ``state`` itself) with every contender, warmed once, then ``reps`` interleaved reps."""
    rank = dist.get_rank()
    target = state if target is None else target
    log = RankLog(state_bytes=logical_bytes(state), tensors=sum(1 for _ in tensors(state)))
    expected = snapshot(target)
    for c in cs:
        if rank == 0:
            progress(f"{name}: warming {c.name}")
        warm_up(c, state, target, expected, os.path.join(root, f"{name}-{c.name}-warm"), log)
    for rep in range(1, reps + 1):
        for c in cs:
            timed_rep(c, state, target, expected, os.path.join(root, f"{name}-{c.name}-{rep}"), log)
        if rank == 0:
            done = {op: round(s[-1], 3) for op, s in log.seconds.items() if len(s) == rep}
            progress(f"{name}: rep {rep}/{reps} rank 0 seconds {done}")
    return log


# --- summarizing on rank 0 ------------------------------------------------------------------


def summarize_case(logs: list[RankLog], cs: list[Contender]) -> dict[str, Any]:
    """Medians over reps of the max (times) or sum (bytes read) over ranks, from every rank's log."""
    rank0 = logs[0]
    owner = {op: c.name for c in cs for op in c.loads}
    checkpoint_bytes = {name: sum(sizes) for name, sizes in rank0.written.items()}
    per_rep = {
        op: [max(v) for v in zip(*(log.seconds[op] for log in logs))] for op in rank0.seconds
    }
    read_ratio = {
        op: statistics.median(map(sum, zip(*(log.read_bytes[op] for log in logs))))
        / checkpoint_bytes[owner[op]]
        for op in rank0.read_bytes
    }
    return {
        "state_bytes": rank0.state_bytes,
        "tensors": rank0.tensors,
        "seconds": {op: round(statistics.median(s), 4) for op, s in per_rep.items()},
        "seconds_per_rep": {op: [round(s, 4) for s in v] for op, v in per_rep.items()},
        "read_bytes_ratio": {op: round(r, 3) for op, r in read_ratio.items()},
        "checkpoint_bytes": checkpoint_bytes,
        "bytes_written_per_rank": rank0.written,
        "write_imbalance": {
            name: round(max(sizes) / statistics.mean(sizes), 3)
            for name, sizes in rank0.written.items()
            if sum(sizes)
        },
    }


def min_over_ranks(values: list[list[float]]) -> float | None:
    """Median over saves of the min over ranks: the rank that reaches the planning collective last
    waits for no one, so its figure is the planning cost without the ranks' arrival skew."""
    per_save = [min(v) for v in zip(*values)]
    return round(statistics.median(per_save), 4) if per_save else None


# --- one rank -------------------------------------------------------------------------------


def worker(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    torch.set_num_threads(1)  # one thread per rank
    warnings.filterwarnings("ignore", category=FutureWarning)
    init_group(rank, args.world, port, GROUP_TIMEOUT)  # the only place a process group is made
    try:
        total_bytes = args.size_mb << 20
        logs: dict[str, RankLog] = {}
        cs = contenders(broadcast=False)
        logs["fsdp"] = run_case("fsdp", fsdp_state(total_bytes, args.world, args.fsdp_model), cs, root, args.reps)
        rep_cs = contenders(broadcast=True)
        logs["replicated"] = run_case(
            "replicated", build_state(total_bytes), rep_cs, root, args.reps
        )
        by_rows, by_cols = reshard_states(total_bytes, args.world)
        logs["reshard"] = run_case("reshard", by_rows, cs, root, args.reps, target=by_cols)
        gathered: list[dict[str, RankLog]] | None = [{}] * args.world if rank == 0 else None
        dist.gather_object(logs, gathered, dst=0)
        if gathered is not None:
            result = {
                "cases": {
                    "fsdp": summarize_case([g["fsdp"] for g in gathered], cs),
                    "replicated": summarize_case([g["replicated"] for g in gathered], rep_cs),
                    "reshard": summarize_case([g["reshard"] for g in gathered], cs),
                },
                "plan_s": {
                    f"{when}{suffix(case)}": min_over_ranks([g[case].plan_s.get(when, []) for g in gathered])
                    for when in ("first", "resave")
                    for case in CASES
                },
                "errors": {
                    f"{op}{suffix(case)}": error
                    for case in CASES
                    for op, error in logs[case].errors.items()
                },
            }
            with open(os.path.join(root, RESULT_FILE), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


# --- the report -----------------------------------------------------------------------------


def suffix(case: str) -> str:
    return "" if case == "fsdp" else f"_{case}"


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def headline(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The flat JSON keys of the issue, then the detail."""
    out: dict[str, Any] = {"world": args.world}
    for case in CASES:
        seconds = result["cases"][case]["seconds"]
        for op in ("zerostall_save", "dcp_save", "zerostall_load", "dcp_load"):
            out[f"{op}_s{suffix(case)}"] = seconds.get(op)
        for kind in ("save", "load"):
            out[f"{kind}_speedup{suffix(case)}"] = ratio(
                seconds.get(f"dcp_{kind}"), seconds.get(f"zerostall_{kind}")
            )
    replicated = result["cases"]["replicated"]
    reads = replicated["read_bytes_ratio"]
    out |= {
        "zerostall_first_plan_s": result["plan_s"]["first"],
        "zerostall_resave_plan_s": result["plan_s"]["resave"],
        "zerostall_first_plan_s_replicated": result["plan_s"]["first_replicated"],
        "zerostall_resave_plan_s_replicated": result["plan_s"]["resave_replicated"],
        "write_imbalance": replicated["write_imbalance"].get("zerostall"),
        "dcp_write_imbalance": replicated["write_imbalance"].get("dcp"),
        "broadcast_load_s": replicated["seconds"].get("zerostall_broadcast_load"),
        "broadcast_read_bytes_ratio": reads.get("zerostall_broadcast_load"),
        "zerostall_read_bytes_ratio": reads.get("zerostall_load"),
        "dcp_read_bytes_ratio": reads.get("dcp_load"),
        "errors": result["errors"],
        "notes": ["plan_s: SaveInfo.plan_s of the warm-up (first) save and of the timed (cached) saves"],
        "size_mb": args.size_mb,
        "fsdp_model": args.fsdp_model,
        "reps": args.reps,
        "dir": args.dir,
        "torch_version": torch.__version__,
        "cases": result["cases"],
    }
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"{'case':11s} {'operation':26s} {'s':>8s} {'GB/s':>7s} {'read x':>7s} {'imbal':>6s}")
    for case, detail in result["cases"].items():
        for op, seconds in detail["seconds"].items():
            read = detail["read_bytes_ratio"].get(op)
            imbalance = detail["write_imbalance"].get(op.removesuffix("_save"))
            print(
                f"{case:11s} {op:26s} {seconds:8.3f} {detail['state_bytes'] / seconds / 1e9:7.2f}"
                f" {'' if read is None else f'{read:.2f}':>7s}"
                f" {'' if imbalance is None else f'{imbalance:.2f}':>6s}"
            )
    for op, error in result["errors"].items():
        print(f"failed: {op}: {error}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn (2)")
    parser.add_argument(
        "--size-mb", type=int, default=256, help="state size in MiB, all ranks (256)"
    )
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (3)")
    parser.add_argument("--fsdp-model", choices=("transformer", "linear"), default="transformer",
                        help="the fsdp case's model: transformer blocks (default) or a Linear stack")
    parser.add_argument("--dir", default="/dev/shm", help="where to save (a fresh dir under it)")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    root = tempfile.mkdtemp(prefix="zerostall-bench-dist-", dir=args.dir)
    try:
        progress(
            f"spawning {args.world} ranks; fsdp {args.fsdp_model} (width, layers) = "
            f"{fsdp_shape(args.size_mb << 20, args.fsdp_model)}"
        )
        mp.spawn(worker, args=(args, free_port(), root), nprocs=args.world)
        with open(os.path.join(root, RESULT_FILE)) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(result)
    if args.json:
        print_json(headline(result, args))


if __name__ == "__main__":
    main()
