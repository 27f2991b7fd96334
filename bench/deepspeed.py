"""DeepSpeed checkpointing: DeepSpeed's own engines against zerostall's (issue 30), and the copy of
an NVMe swap folder against ``shutil.copytree`` and the raw copy rate.

    python bench/deepspeed.py [--json] [--reps 3] [--dir DIR] [--model-mib 256] [--swap-gib 4]
                              [--swap-data sparse|real] [--part both|engines|swap]

1. Engines. Two gloo ranks (spawned, OMP_NUM_THREADS=1, DeepSpeed on its cpu accelerator) each
   build one ZeRO-3 engine per contender from the same seed (a stack of square Linear layers, every
   parameter partitioned, AdamW with ``torch_adam``) and train each one step on the same batch, so
   every engine holds the same state (checked: a digest of each engine's optimizer state and weight
   partitions, equal across contenders). DeepSpeed picks its checkpoint engine at set-up and
   zerostall installs itself with ``attach`` for good, so a contender is an engine of its own:
   ``default`` (DeepSpeed's ``TorchCheckpointEngine``: torch.save of each file), ``fast`` (its
   ``FastCheckpointEngine``: config ``checkpoint.writer`` of type ``fast``, not decoupled; torch.save
   into DeepSpeed's O_DIRECT writer through the aio op; on a CPU it needs three settings of this
   bench, see :func:`fast_writer_on_cpu` and the two ``environ`` calls), ``zerostall`` (``attach(engine)``) and
   ``zerostall_async`` (``attach(engine, asynchronous=True)``: ``save_checkpoint`` returns once the
   state is captured, ``engine.checkpoint_engine.wait()`` returns once it is committed) and
   ``zerostall_unsynced`` (``attach(engine, save=SaveOptions(fsync=False))``: durable only as far as
   DeepSpeed's default engine is, to set its save against that engine's alone). Each rep,
   in an order rotated by one per rep, each contender saves (``engine.save_checkpoint(dir, tag)``)
   and loads the same tag back into the same engine (``engine.load_checkpoint(dir, tag)``; the
   checkpoints of the last two are zerostall's, so they are not loaded again; before a load the
   optimizer's state is dropped, as a new process that resumes has none until its first step,
   while its weight and fp32 partitions exist), and ``raw``
   writes a file of the rank's bytes (those of its files in the default engine's checkpoint) with
   ``os.write`` from a preallocated buffer, starting the write-back of every 8 MiB written as
   zerostall does (the best a plain write does), and fsyncs it, then reads it back with ``os.preadv``
   into that buffer (``load_s``) and into a new one (``load_fresh_s``: memory not touched yet, as
   an engine's ``load`` must return new tensors; ``load_fresh_huge_s``: the same into memory
   offered for huge pages, as zerostall allocates what it reads into; the pages are dropped again
   in between). A
   time is the slowest rank's, from a barrier to the end of its call; the figure is the median of
   the timed reps. A warm-up rep runs first and checks every load: the engine's state is zeroed
   after the save and must equal the saved digest once loaded. A load's ``read_s`` is the part of it
   spent in the checkpoint engine's own calls (``open``, ``load``, ``close``: the files read into
   memory, checked where the engine checks); the rest is DeepSpeed putting the state in place, the
   same work for every engine, which a raw read does not do.
   Durability and the page cache: zerostall and raw fsync what they write; DeepSpeed's default
   engine does not (its save ends with the data in the page cache), and its fast engine writes with
   O_DIRECT without an fsync. After every save, outside the timing, rank 0 fsyncs every file of the
   tag (its time is reported as ``<name>_fsync_s``: what the default engine skips) and drops its
   pages from the page cache (``posix_fadvise DONTNEED``), so every load reads from the storage,
   not from memory. On a tmpfs (/dev/shm) loads always read memory, the fsyncs cost nothing, and
   the fast engine needs a kernel whose tmpfs takes O_DIRECT (6.6 or newer; else it is reported
   as failed).
2. Swap folder copy (this process, no process group). A folder of swap files named as DeepSpeed
   names an optimizer's (``exp_avg-0_1.tensor.swp``...: fp32, exp_avg and exp_avg_sq per sub-group)
   totalling --swap-gib, sparse (``truncate`` plus a few written blocks) or, with --swap-data real,
   random bytes throughout. Each rep, rotated: ``zerostall_save`` (the files as rank-local entries
   memory-mapped by ``SwapFolders.tensors()``, as the engine saves them, with ``zs.save``),
   ``zerostall_restore`` (``SwapFolders.restore`` from the ``zs.open``'ed checkpoint into an empty
   folder, every block verified), ``copytree`` (``shutil.copytree``, what DeepSpeed does), ``raw``
   (every file read into one reused buffer and written to a new file, fsynced: what a durable
   verified copy minimally costs), ``raw_unsynced`` (the same without fsync) and ``raw_restore``
   (the same copy, unsynced, of the checkpoint's files: what the restore reads, which holds every
   byte even when the swap files are sparse, whose holes cost no reads). zerostall's save fsyncs;
   its restore and copytree do not; each is set against the raw copy that reads what it reads and
   syncs as it does: save / raw, restore / raw_restore, copytree / raw_unsynced. Every output is
   fsynced and dropped from the page cache outside the timing, so a copy does not pay for the
   write-back of the one before. After the reps, the xxh3-64 of every restored file
   must equal the original's.
3. A table on stdout, progress on stderr; with --json one JSON object as the last stdout line
   (``engines``: bytes, seconds, GB/s, ratios; ``swap``: the same for the copies; ``errors``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

BENCH = os.path.dirname(os.path.abspath(__file__))
# This file is named deepspeed: import the real package with bench/ off the path, then put it back.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != BENCH]
sys.path.insert(0, os.path.join(BENCH, "..", "src"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; the results go there
    import deepspeed
sys.path.insert(0, BENCH)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import xxhash  # noqa: E402
from common import describe, free_port, median, print_json, progress, remove, rnd, rotated, write_all  # noqa: E402

import zerostall as zs  # noqa: E402
from zerostall.integrations.deepspeed import attach, swap  # noqa: E402
from zerostall.integrations.deepspeed.swap import SwapFolders  # noqa: E402
from zerostall.memory import host_empty  # noqa: E402

WORLD = 2
WIDTH = 2048  # the layers are WIDTH x WIDTH
BYTES_PER_PARAM = 12  # fp32 weights, exp_avg, exp_avg_sq, partitioned over the ranks
ENGINES = ("default", "fast", "zerostall", "zerostall_async", "zerostall_unsynced", "raw")
LOADED = ("default", "fast", "zerostall", "raw")
SWAPS = ("zerostall_save", "zerostall_restore", "copytree", "raw", "raw_unsynced", "raw_restore")
SWAP_STATES = ("", "exp_avg-", "exp_avg_sq-")  # DeepSpeed's swap files of one optimizer sub-group
SWAP_GROUPS = 8
CHUNK = 64 << 20  # the raw copy's buffer, and the block written at a time into a real-data swap file
FSYNC = zs.SaveOptions().fsync


# --- the page cache -------------------------------------------------------------------------


def files_under(path: str) -> list[str]:
    """Every regular file below path."""
    return [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]


def settle(path: str) -> float:
    """fsync the file path, or every file below the directory path, and drop its pages from the page
    cache; the seconds that took."""
    start = time.perf_counter()
    for name in files_under(path) if os.path.isdir(path) else [path]:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - start


# --- part 1: the engines --------------------------------------------------------------------


def config(name: str) -> dict[str, Any]:
    """The DeepSpeed config of a contender: ZeRO-3, every parameter partitioned, torch's AdamW."""
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if name == "fast":
        cfg["checkpoint"] = {"writer": {"type": "fast", "decoupled": False}}
    return cfg


@contextlib.contextmanager
def environ(on: bool, **values: str) -> Iterator[None]:
    """The environment variables ``values`` set while on (and unset after)."""
    if on:
        os.environ.update(values)
    try:
        yield
    finally:
        for key in values if on else ():
            del os.environ[key]


def fast_writer_on_cpu() -> None:
    """DeepSpeed's cpu accelerator lists no ``UtilsBuilder`` (the fast writer's plain C++ op that views
    tensors as bytes), so its fast writer fails on a CPU: give the writer DeepSpeed's generic builder."""
    from deepspeed.io import fast_file_writer
    from deepspeed.ops.op_builder.utils import UtilsBuilder

    fast_file_writer.UtilsBuilder = UtilsBuilder


def build(name: str, layers: int, rank: int) -> Any:
    """A contender's engine, trained one step: the same model, batch and state for every contender."""
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config(name)):  # float32 partitions on any CPU (see
        # tests/deepspeed_train.py: partitioned by initialize, DeepSpeed makes them bfloat16 on some)
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    # the fast engine pins its I/O buffer when built, which torch without an accelerator refuses:
    # DeepSpeed's own page-locked memory pins it instead
    with environ(name == "fast", DS_PIN_MEMORY_BACKEND="native"):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(name))
    if name.startswith("zerostall"):
        attach(engine, asynchronous=name == "zerostall_async", save=zs.SaveOptions(fsync=name != "zerostall_unsynced"))
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return engine


def state_tensors(engine: Any) -> list[torch.Tensor]:
    """What a checkpoint must bring back: this rank's weight partitions, fp32 partitions and AdamW state."""
    zero = engine.optimizer
    found = [p.ds_tensor for p in engine.module.parameters()] + list(zero.fp32_partitioned_groups_flat)
    for state in zero.optimizer.state.values():
        found += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return found


def digest(engine: Any) -> str:
    """xxh3-64 over every tensor of :func:`state_tensors`."""
    h = xxhash.xxh3_64()
    for t in state_tensors(engine):
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of fn() from a barrier (this rank's)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine_rep(name: str, engine: Any, root: str, rep: int, rank: int, check: bool) -> dict[str, float]:
    """One contender's save and load of tag ``rep{rep}`` under root/name; the times of this rank."""
    save_dir, tag = os.path.join(root, name), f"rep{rep}"
    out: dict[str, float] = {}
    before = digest(engine) if check else None
    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(save_dir, tag, client_state={"rep": rep})
    out["save_s"] = time.perf_counter() - start
    if name == "zerostall_async":
        engine.checkpoint_engine.wait()
        out["commit_s"] = time.perf_counter() - start
    dist.barrier()
    if rank == 0:
        out["fsync_s"] = settle(os.path.join(save_dir, tag))
        out["bytes"] = sum(os.path.getsize(f) for f in files_under(os.path.join(save_dir, tag)))
    if name in LOADED:
        if check:
            for t in state_tensors(engine):
                t.detach().zero_()
        engine.optimizer.optimizer.state.clear()  # as in a new process: AdamW's moments come with its first step
        # the fast engine loads with torch.load's default weights_only=True, which refuses DeepSpeed's
        # own objects in its files (the default engine passes weights_only=False): lift it, as torch allows
        with environ(name == "fast", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1"), engine_reads(engine) as spent:
            out["load_s"] = timed(lambda: engine.load_checkpoint(save_dir, tag))
        out["read_s"] = spent[0]
        if check and digest(engine) != before:
            raise AssertionError(f"{name}: the state loaded back differs from the state saved")
    dist.barrier()
    if rank == 0:
        remove(save_dir)
    return out


@contextlib.contextmanager
def engine_reads(engine: Any) -> Iterator[list[float]]:
    """The seconds a load spends in the checkpoint engine's own calls (``open``, ``load``,
    ``close``: reading the files into memory), apart from DeepSpeed putting the state in place,
    which is the same work whichever engine read the files."""
    ce, spent = engine.checkpoint_engine, [0.0]
    names = [n for n in ("open", "load", "close") if callable(getattr(ce, n, None))]
    own = {n: vars(ce)[n] for n in names if n in vars(ce)}

    def timing(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    for n in names:
        setattr(ce, n, timing(getattr(ce, n)))
    try:
        yield spent
    finally:
        for n in names:
            if n in own:
                setattr(ce, n, own[n])
            else:
                delattr(ce, n)


def raw_rep(root: str, rank: int, buffer: torch.Tensor) -> dict[str, float]:
    """Write buffer to a file, fsync it, drop it from the page cache and read it back."""
    path = os.path.join(root, f"raw-rank{rank}")
    view = memoryview(buffer.numpy())

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, view, writeback=FSYNC)
            if FSYNC:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(into: memoryview) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while offset < into.nbytes:
                got = os.preadv(fd, [into[offset:]], offset)
                if got == 0:
                    raise EOFError(f"{path} is short at offset {offset}")
                offset += got
        finally:
            os.close(fd)

    out = {"save_s": timed(write)}
    settle(path)
    out["load_s"] = timed(lambda: read(view))
    settle(path)
    out["load_fresh_s"] = timed(lambda: read(memoryview(torch.empty(view.nbytes, dtype=torch.uint8).numpy())))
    settle(path)
    out["load_fresh_huge_s"] = timed(lambda: read(memoryview(host_empty(view.nbytes).numpy())))
    dist.barrier()
    remove(path)
    return out


def rank_bytes(root: str, rank: int) -> int:
    """This rank's bytes in the default engine's checkpoint: its files (``zero_pp_rank_N_...``), and
    rank 0 those of no rank."""
    mine = re.compile(rf"zero_pp_rank_{rank}_.*" if rank else r"(?!zero_pp_rank_[1-9]).*")
    return sum(os.path.getsize(os.path.join(root, n)) for n in os.listdir(root) if mine.fullmatch(n))


def engines_worker(rank: int, args: argparse.Namespace, port: int, root: str, out: str) -> None:
    os.dup2(2, 1)  # DeepSpeed's logs: stdout is the parent's table
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CROSS_RANK="0", CROSS_SIZE="1")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    fast_writer_on_cpu()
    layers = max(1, round(args.model_mib * WORLD * (1 << 20) / (BYTES_PER_PARAM * (WIDTH * WIDTH + WIDTH))))
    result: dict[str, Any] = {"layers": layers, "errors": {}, "reps": [], "digests": {}}
    engines: dict[str, Any] = {}
    for name in ENGINES[:-1]:
        try:
            engines[name] = build(name, layers, rank)
            result["digests"][name] = digest(engines[name])
        except Exception as exc:  # noqa: BLE001 (the others run without it)
            result["errors"][name] = describe(exc)
    if rank == 0:
        progress(f"engines built: {layers} layers of {WIDTH}x{WIDTH}; failed: {sorted(result['errors']) or 'none'}")
    buffer = None
    for rep in range(args.reps + 1):  # rep 0 warms up and checks every load
        times: dict[str, dict[str, float]] = {}
        for name in rotated(list(ENGINES), rep):
            if name in result["errors"] or (name == "raw" and buffer is None):
                continue
            try:
                times[name] = (raw_rep(root, rank, buffer) if name == "raw"
                               else engine_rep(name, engines[name], root, rep, rank, check=rep == 0))
            except Exception as exc:  # noqa: BLE001
                result["errors"][name] = describe(exc)
                dist.barrier()
            if name == "default" and buffer is None:
                engines["default"].save_checkpoint(os.path.join(root, "sizes"), "sizes")
                dist.barrier()
                result["raw_bytes"] = rank_bytes(os.path.join(root, "sizes", "sizes"), rank)
                buffer = torch.full((result["raw_bytes"],), 7, dtype=torch.uint8)
                dist.barrier()
                if rank == 0:
                    remove(os.path.join(root, "sizes"))
        result["reps"].append(times)
        if rank == 0:
            progress(f"engines rep {rep}{' (warm-up)' if rep == 0 else ''}: " + ", ".join(
                f"{n} save {t['save_s']:.2f} load {t.get('load_s', float('nan')):.2f}" for n, t in times.items()))
    for engine in engines.values():
        if hasattr(engine.checkpoint_engine, "cleanup"):
            engine.checkpoint_engine.cleanup()
    with open(os.path.join(out, f"engines{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def summarize_engines(ranks: list[dict[str, Any]], reps: int) -> dict[str, Any]:
    """Medians over the timed reps of the slowest rank; bytes, GB/s and the ratios the issue asks for."""
    errors = {n: e for r in ranks for n, e in r["errors"].items()}
    digests = {n: d for n, d in ranks[0]["digests"].items()}
    out: dict[str, Any] = {"layers": ranks[0]["layers"], "width": WIDTH, "world": WORLD,
                           "same_state": len(set(digests.values())) == 1 and all(
                               len(set(r["digests"].values())) == 1 for r in ranks),
                           "raw_bytes": sum(r.get("raw_bytes", 0) for r in ranks), "errors": errors}
    for name in ENGINES:
        runs = [[r["reps"][k].get(name) for r in ranks] for k in range(1, reps + 1)]
        runs = [run for run in runs if all(run)]
        if name in errors or not runs:
            continue
        for what in ("save_s", "commit_s", "load_s", "load_fresh_s", "load_fresh_huge_s", "read_s"):
            if what in runs[0][0]:
                out[f"{name}_{what}"] = rnd(median([max(t[what] for t in run) for run in runs]))
        if "fsync_s" in runs[0][0]:
            out[f"{name}_fsync_s"] = rnd(median([run[0]["fsync_s"] for run in runs]))
            out[f"{name}_bytes"] = ranks[0]["reps"][0][name]["bytes"]
    out["raw_bytes_per_rank"] = [r.get("raw_bytes") for r in ranks]
    for name in ENGINES:
        nbytes = out["raw_bytes"] if name == "raw" else out.get(f"{name}_bytes")
        for what in ("save", "commit", "load"):
            seconds = out.get(f"{name}_{what}_s")
            if seconds and nbytes:
                out[f"{name}_{what}_gbps"] = rnd(nbytes / seconds / 1e9, 3)

    def ratio(a: str | None, b: str | None) -> float | None:
        return rnd(out[b] / out[a], 3) if a in out and b in out and out[a] else None

    for what in ("save", "load"):
        out[f"zerostall_vs_default_{what}"] = ratio(f"zerostall_{what}_s", f"default_{what}_s")
        out[f"zerostall_vs_fast_{what}"] = ratio(f"zerostall_{what}_s", f"fast_{what}_s")
        out[f"zerostall_vs_raw_{what}"] = ratio("raw_" + what + "_gbps", f"zerostall_{what}_gbps")
    out["zerostall_read_vs_raw_read"] = ratio("zerostall_read_s", "raw_load_s")  # the files read, placing apart
    out["zerostall_read_vs_raw_fresh_read"] = ratio("zerostall_read_s", "raw_load_fresh_s")  # into new memory
    out["zerostall_read_vs_raw_fresh_huge_read"] = ratio("zerostall_read_s", "raw_load_fresh_huge_s")
    out["zerostall_read_vs_default_read"] = ratio("zerostall_read_s", "default_read_s")
    if "default_save_s" in out and "default_fsync_s" in out and "zerostall_save_s" in out:
        out["zerostall_vs_default_save_with_fsync"] = rnd(
            (out["default_save_s"] + out["default_fsync_s"]) / out["zerostall_save_s"], 3)
    out["zerostall_async_vs_default_save"] = ratio("zerostall_async_save_s", "default_save_s")
    out["zerostall_unsynced_vs_default_save"] = ratio("zerostall_unsynced_save_s", "default_save_s")
    out["seconds"] = {name: [[{k: rnd(v) for k, v in r["reps"][k].get(name, {}).items()} for r in ranks]
                             for k in range(1, reps + 1)] for name in ENGINES}
    return out


# --- part 2: the swap folder ----------------------------------------------------------------


def make_swap_folder(folder: str, total: int, real: bool) -> dict[int, str]:
    """DeepSpeed-named optimizer swap files of ``total`` bytes in all; the parameter names by ds_id."""
    os.makedirs(folder)
    size = total // (SWAP_GROUPS * len(SWAP_STATES)) // 4096 * 4096
    gen = torch.Generator().manual_seed(0)
    names = {}
    for g in range(SWAP_GROUPS):
        first, last = 2 * g, 2 * g + 1
        names[first], names[last] = f"layers.{g}.weight", f"layers.{g}.bias"
        for state in SWAP_STATES:
            with open(os.path.join(folder, f"{state}{first}_{last}.tensor.swp"), "wb") as f:
                f.truncate(size)
                blocks = range(0, size, CHUNK) if real else sorted({0, size // 2 // 4096 * 4096, max(0, size - 65536)})
                for offset in blocks:
                    n = min(CHUNK if real else 65536, size - offset)
                    f.seek(offset)
                    f.write(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes())
                os.fsync(f.fileno())
    return names


def raw_copy(src: str, dst: str, buffer: memoryview, fsync: bool) -> None:
    """Every byte of every file of src read into buffer and written to a new file in dst."""
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        fin = os.open(os.path.join(src, name), os.O_RDONLY)
        fout = os.open(os.path.join(dst, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while got := os.readv(fin, [buffer]):
                write_all(fout, buffer[:got], writeback=fsync)
            if fsync:
                os.fsync(fout)
        finally:
            os.close(fin)
            os.close(fout)


def file_digests(folder: str) -> dict[str, str]:
    """xxh3-64 of every file in folder, by name."""
    out = {}
    buffer = bytearray(CHUNK)
    for name in sorted(os.listdir(folder)):
        h = xxhash.xxh3_64()
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while got := f.readinto(buffer):
                h.update(memoryview(buffer)[:got])
        out[name] = h.hexdigest()
    return out


def swap_bench(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """The swap folder copies (part 2): medians, GB/s, ratios and the round-trip check."""
    src, saved = os.path.join(root, "swap"), os.path.join(root, "swap-checkpoint")
    progress(f"swap folder: {args.swap_gib} GiB of {args.swap_data} files in {src}")
    names = make_swap_folder(src, int(args.swap_gib * (1 << 30)), args.swap_data == "real")
    nbytes = sum(os.path.getsize(f) for f in files_under(src))
    buffer = memoryview(bytearray(CHUNK))

    def save() -> None:
        zs.save({swap.KEY: zs.rank_local(SwapFolders({swap.OPTIMIZER: src}, names).tensors())}, saved)

    def restore(dst: str) -> None:
        os.makedirs(dst)
        with zs.open(saved) as ck:
            SwapFolders({swap.OPTIMIZER: dst}, names).restore(ck, 0)

    def output(name: str) -> str:
        return saved if name == "zerostall_save" else os.path.join(root, f"swap-{name}")

    run: dict[str, Callable[[], Any]] = {
        "zerostall_save": save, "zerostall_restore": lambda: restore(output("zerostall_restore")),
        "copytree": lambda: shutil.copytree(src, output("copytree")),
        "raw": lambda: raw_copy(src, output("raw"), buffer, fsync=True),
        "raw_unsynced": lambda: raw_copy(src, output("raw_unsynced"), buffer, fsync=False),
        "raw_restore": lambda: raw_copy(saved, output("raw_restore"), buffer, fsync=False)}
    seconds: dict[str, list[float]] = {name: [] for name in SWAPS}
    errors: dict[str, str] = {}
    save()  # the restores read it; each rep's zerostall_save replaces it
    settle(saved)
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name in rotated(list(SWAPS), rep):
            if name in errors:
                continue
            settle(src)
            remove(output(name))  # zerostall_save's: the restores read the last one
            try:
                start = time.perf_counter()
                run[name]()
                took = time.perf_counter() - start
            except Exception as exc:  # noqa: BLE001
                errors[name] = describe(exc)
                continue
            settle(output(name))
            if rep:
                seconds[name].append(took)
        progress(f"swap rep {rep}{' (warm-up)' if rep == 0 else ''}: " + ", ".join(
            f"{n} {nbytes / s[-1] / 1e9:.2f} GB/s" for n, s in seconds.items() if rep and s))
    restored = output("zerostall_restore")
    same = os.path.isdir(restored) and file_digests(restored) == file_digests(src)
    out: dict[str, Any] = {"bytes": nbytes, "files": len(os.listdir(src)), "data": args.swap_data,
                           "round_trip_equal": same, "errors": errors}
    for name in SWAPS:
        s = median(seconds[name]) if name not in errors else None
        out[f"{name}_s"] = rnd(s)
        out[f"{name}_gbps"] = rnd(nbytes / s / 1e9, 3) if s else None
    for name, raw in (("zerostall_save", "raw"), ("zerostall_restore", "raw_restore"), ("copytree", "raw_unsynced")):
        a, b = out[f"{name}_gbps"], out[f"{raw}_gbps"]
        out[f"{name}_vs_{raw}"] = rnd(a / b, 3) if a and b else None
    out["seconds"] = {name: [rnd(s) for s in v] for name, v in seconds.items()}
    for path in (src, saved, *(output(n) for n in SWAPS)):
        remove(path)
    return out


# --- reporting ------------------------------------------------------------------------------


def print_table(r: dict[str, Any]) -> None:
    if "engines" in r:
        print_engines(r["engines"], r)
    if "swap" in r:
        print_swap(r["swap"])


def print_engines(e: dict[str, Any], r: dict[str, Any]) -> None:
    print(f"ZeRO-3 engines, 2 ranks, {e['layers']} layers of {e['width']}x{e['width']}, AdamW; {r['reps']} reps, "
          f"medians of the slowest rank; dir {r['dir']}; same state in every engine: {e['same_state']}")
    print(f"{'contender':18s} {'bytes':>11s} {'save s':>8s} {'GB/s':>6s} {'+fsync s':>8s} {'commit s':>8s} "
          f"{'load s':>8s} {'GB/s':>6s} {'read s':>8s}")

    def cell(key: str, fmt: str, width: int) -> str:
        v = e.get(key)
        return f"{'' if v is None else format(v, fmt):>{width}s}"

    for name in ENGINES:
        if name in e["errors"]:
            print(f"{name:18s} failed: {e['errors'][name][:150]}")
            continue
        nbytes = e["raw_bytes"] if name == "raw" else e.get(f"{name}_bytes")
        print(f"{name:18s} {'' if nbytes is None else nbytes:>11} {cell(f'{name}_save_s', '.3f', 8)} "
              f"{cell(f'{name}_save_gbps', '.2f', 6)} {cell(f'{name}_fsync_s', '.3f', 8)} "
              f"{cell(f'{name}_commit_s', '.3f', 8)} {cell(f'{name}_load_s', '.3f', 8)} "
              f"{cell(f'{name}_load_gbps', '.2f', 6)} {cell(f'{name}_read_s', '.3f', 8)}")
    print("read s: the part of a load spent in the checkpoint engine's own calls (open, load, close), the files "
          f"read into memory; the rest is DeepSpeed putting the state in place. zerostall's read vs raw read: "
          f"x{e.get('zerostall_read_vs_raw_read')} (into new memory, {cell('raw_load_fresh_s', '.3f', 0)} s: "
          f"x{e.get('zerostall_read_vs_raw_fresh_read')}; offered huge pages, "
          f"{cell('raw_load_fresh_huge_s', '.3f', 0)} s: "
          f"x{e.get('zerostall_read_vs_raw_fresh_huge_read')}), vs the default engine's read: "
          f"x{e.get('zerostall_read_vs_default_read')}")
    print(f"zerostall vs default: save x{e.get('zerostall_vs_default_save')} (default + its fsync: "
          f"x{e.get('zerostall_vs_default_save_with_fsync')}), load x{e.get('zerostall_vs_default_load')}; vs fast: "
          f"save x{e.get('zerostall_vs_fast_save')}, load x{e.get('zerostall_vs_fast_load')}; of raw: save "
          f"{e.get('zerostall_vs_raw_save')}, load {e.get('zerostall_vs_raw_load')}; asynchronous save() vs default "
          f"save x{e.get('zerostall_async_vs_default_save')}; unsynced vs default save "
          f"x{e.get('zerostall_unsynced_vs_default_save')}")


def print_swap(s: dict[str, Any]) -> None:
    print(f"\nswap folder: {s['bytes']} bytes in {s['files']} {s['data']} files; round trip equal: "
          f"{s['round_trip_equal']}")
    print(f"{'copy':18s} {'s':>8s} {'GB/s':>6s}")
    for name in SWAPS:
        if name in s["errors"]:
            print(f"{name:18s} failed: {s['errors'][name][:150]}")
        elif s[f"{name}_s"] is not None:
            print(f"{name:18s} {s[f'{name}_s']:8.3f} {s[f'{name}_gbps']:6.2f}")
    print(f"zerostall save / raw (both fsynced) {s['zerostall_save_vs_raw']}; zerostall restore / raw copy of the "
          f"checkpoint's files {s['zerostall_restore_vs_raw_restore']}; copytree / raw unsynced "
          f"{s['copytree_vs_raw_unsynced']}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints and swap files go "
                    "(a disk; on a tmpfs every load reads memory)")
    ap.add_argument("--model-mib", type=float, default=256, help="model + optimizer state of each rank, MiB")
    ap.add_argument("--swap-gib", type=float, default=4, help="the swap folder, GiB")
    ap.add_argument("--swap-data", choices=("sparse", "real"), default="sparse",
                    help="sparse files (truncate + a few blocks) or random bytes throughout")
    ap.add_argument("--part", choices=("both", "engines", "swap"), default="both", help="run one part only")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = tempfile.mkdtemp(prefix="zs-deepspeed-", dir=args.dir)
    try:
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        result: dict[str, Any] = {}
        if args.part != "swap":
            progress(f"engines: 2 ranks, ~{args.model_mib} MiB of state each, {args.reps} reps in {tmp}")
            mp.spawn(engines_worker, args=(args, free_port(), tmp, out), nprocs=WORLD)
            ranks = []
            for rank in range(WORLD):
                with open(os.path.join(out, f"engines{rank}.json")) as f:
                    ranks.append(json.load(f))
            result["engines"] = summarize_engines(ranks, args.reps)
        if args.part != "engines":
            result["swap"] = swap_bench(args, tmp)
        result |= {"reps": args.reps, "dir": args.dir, "cores": os.cpu_count(), "torch_version": torch.__version__,
                  "deepspeed_version": deepspeed.__version__, "fsync": FSYNC}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(result)
    if args.json:
        print_json(result)


if __name__ == "__main__":
    main()
