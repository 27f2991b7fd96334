"""Save/load throughput of zerostall against its anchors, in one run, on the same data and target.

    python bench/save_load.py [--size-mb N] [--tensors T] [--dir D] [--reps R] [--json]

One deterministic state (default 1 GiB of fp32/bf16 CPU tensors of mixed sizes, 256 tensors;
--tensors for more, to show per-tensor costs) is saved and loaded back by every contender into the
same directory (default a fresh one under /dev/shm, so software overhead is what shows; pass --dir
for a disk):

- zerostall: ``zs.save`` / ``zs.load`` (in place, checksums verified, fsync on: its defaults);
- DCP at its defaults, and tuned (``FileSystemWriter`` with ``default_threads()`` threads and
  ``sync_files`` matching zerostall's fsync), in one process without a process group;
- ``torch.save`` / ``torch.load`` + ``copy_`` into the target;
- safetensors ``save_file`` / ``load_file`` + ``copy_`` into the target (``load_file`` memory-maps);
  neither of these two fsyncs (their defaults): on a disk their saves return before the data is
  durable, so they are not comparable with the fsync'd saves above (JSON ``unsynced_saves``);
- raw: plain ``os.write`` of the tensor bytes (fsync'd per file, as zerostall fsyncs, the write-back of every
  8 MiB started as it is written, as zerostall does) and
  ``os.preadv`` back into the target, with 1 thread and with ``default_threads()`` threads
  (one file per thread, bytes balanced): the floor no library can beat;
- raw hashed: the same raw writes and reads with default_threads() threads, each 512 KiB piece
  also hashed with xxh3-64 right before it is written or right after it is read: the floor for any
  library that checksums every byte it saves and verifies every byte it loads, as zerostall does
  (JSON ``raw_hashed_read_vs_dcp``: the load ratio against DCP such a library could reach at best).

Every load goes into an already-allocated, already-touched target state of the same structure.
Method: every contender is warmed once (and its load checked for equality) before timing; the
repetitions are interleaved (rep 1: every contender, rep 2: every contender, ..., each rep's order
rotated by one so that no contender always runs first or after the same neighbour); each save goes
to a fresh path and the previous output is deleted outside the timed region; the figure is the
median of the reps. GB/s = state bytes / seconds / 1e9. Progress goes to stderr; a table to stdout;
with --json the last line of stdout is one JSON object.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
import xxhash

import zerostall as zs
from zerostall.options import default_threads
from common import N_TENSORS, build_state, print_json, progress, remove, rotated, state_bytes, write_all

HASH_PIECE = 512 << 10  # the raw_hashed anchor hashes what it moves in pieces of this size, as zerostall does
FSYNC = zs.SaveOptions().fsync  # tuned DCP and raw writes match zerostall's default


@dataclass
class Contender:
    """One way to save a state to a path and load it back into a target state."""

    save_key: str  # JSON prefix of the save figure, e.g. "zerostall_save"
    load_key: str
    save: Callable[[dict, str], None]
    load: Callable[[dict, str], None]


# --- the state ------------------------------------------------------------------------------


def touched_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A target of the same structure, its memory already written (zeros_like fills every byte)."""
    return {key: torch.zeros_like(t) for key, t in state.items()}


def copy_into(target: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    for key, t in target.items():
        t.copy_(loaded[key])


# --- raw bandwidth: the floor ---------------------------------------------------------------


def byte_views(state: dict[str, torch.Tensor]) -> list[memoryview]:
    """Zero-copy views of every tensor's bytes."""
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in state.values()]


def balanced_shards(views: list[memoryview], n: int) -> list[list[memoryview]]:
    """Cut the concatenated bytes of views into n runs of (nearly) equal length."""
    total = sum(v.nbytes for v in views)
    ends = [(k + 1) * total // n for k in range(n)]  # end offset of each shard; the last is total
    shards: list[list[memoryview]] = [[] for _ in range(n)]
    shard, offset = 0, 0  # current shard, global offset of the next byte
    for view in views:
        pos = 0
        while pos < view.nbytes:
            while offset >= ends[shard]:
                shard += 1
            take = min(view.nbytes - pos, ends[shard] - offset)
            shards[shard].append(view[pos : pos + take])
            pos += take
            offset += take
    return shards


def hashed_pieces(views: list[memoryview]) -> list[memoryview]:
    """The views cut into cache-sized pieces, each hashed (xxh3-64) when it is written or read."""
    return [view[lo : lo + HASH_PIECE] for view in views for lo in range(0, view.nbytes, HASH_PIECE)]


def write_file(path: str, views: list[memoryview], fsync: bool, hashed: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in hashed_pieces(views) if hashed else views:
            if hashed:
                xxhash.xxh3_64_intdigest(view)
            write_all(fd, view, writeback=fsync)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str, views: list[memoryview], hashed: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for piece in hashed_pieces(views) if hashed else views:
            view = piece
            while view.nbytes:
                got = os.preadv(fd, [view], offset)
                if got == 0:
                    raise EOFError(f"{path} is short at offset {offset}")
                offset += got
                view = view[got:]
            if hashed:
                xxhash.xxh3_64_intdigest(piece)
    finally:
        os.close(fd)


def raw_write(state: dict, path: str, threads: int, hashed: bool = False) -> None:
    os.mkdir(path)
    shards = balanced_shards(byte_views(state), threads)
    with ThreadPoolExecutor(threads) as pool:
        jobs = [
            pool.submit(write_file, os.path.join(path, f"shard{k}.bin"), views, FSYNC, hashed)
            for k, views in enumerate(shards)
        ]
        for job in jobs:
            job.result()


def raw_read(target: dict, path: str, threads: int, hashed: bool = False) -> None:
    shards = balanced_shards(byte_views(target), threads)
    with ThreadPoolExecutor(threads) as pool:
        jobs = [
            pool.submit(read_file, os.path.join(path, f"shard{k}.bin"), views, hashed)
            for k, views in enumerate(shards)
        ]
        for job in jobs:
            job.result()


# --- the contenders -------------------------------------------------------------------------


def torch_load(target: dict, path: str) -> None:
    copy_into(target, torch.load(path, weights_only=True, mmap=False))


def safetensors_load(target: dict, path: str) -> None:
    copy_into(target, safetensors.torch.load_file(path))


def dcp_tuned_save(state: dict, path: str, threads: int) -> None:
    writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=FSYNC)
    dcp.save(state, storage_writer=writer)


def dcp_tuned_load(target: dict, path: str) -> None:
    dcp.load(target, storage_reader=dcp.FileSystemReader(path))


def contenders(threads: int) -> list[Contender]:
    return [
        Contender("zerostall_save", "zerostall_load", zs.save, zs.load),
        Contender(
            "dcp_save",
            "dcp_load",
            lambda s, p: dcp.save(s, checkpoint_id=p),
            lambda t, p: dcp.load(t, checkpoint_id=p),
        ),
        Contender(
            "dcp_tuned_save",
            "dcp_tuned_load",
            lambda s, p: dcp_tuned_save(s, p, threads),
            dcp_tuned_load,
        ),
        Contender("torch_save", "torch_load", torch.save, torch_load),
        Contender(
            "safetensors_save", "safetensors_load", safetensors.torch.save_file, safetensors_load
        ),
        Contender(
            "raw_write",
            "raw_read",
            lambda s, p: raw_write(s, p, threads),
            lambda t, p: raw_read(t, p, threads),
        ),
        Contender(
            "raw_hashed_write",
            "raw_hashed_read",
            lambda s, p: raw_write(s, p, threads, hashed=True),
            lambda t, p: raw_read(t, p, threads, hashed=True),
        ),
        Contender(
            "raw_write_1t",
            "raw_read_1t",
            lambda s, p: raw_write(s, p, 1),
            lambda t, p: raw_read(t, p, 1),
        ),
    ]


# --- the method -----------------------------------------------------------------------------


def timed(fn: Callable, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def check_loaded(name: str, state: dict, target: dict) -> None:
    bad = [key for key in state if not torch.equal(state[key], target[key])]
    if bad:
        raise AssertionError(f"{name} loaded wrong data into {len(bad)} tensors, e.g. {bad[0]}")


def warm_up(contender: Contender, state: dict, target: dict, root: str) -> None:
    """One untimed save and load; the load must reproduce the state in a zeroed target."""
    path = os.path.join(root, f"{contender.save_key}-warm")
    contender.save(state, path)
    for t in target.values():
        t.zero_()
    contender.load(target, path)
    check_loaded(contender.save_key, state, target)
    remove(path)


def run_reps(
    cs: list[Contender], state: dict, target: dict, root: str, reps: int
) -> dict[str, list[float]]:
    """Interleaved reps, the order rotated by one each rep (no contender always runs first or after
    the same neighbour); each save to a fresh path, deleted after its load, outside the timing."""
    seconds: dict[str, list[float]] = {key: [] for c in cs for key in (c.save_key, c.load_key)}
    for rep in range(1, reps + 1):
        for c in rotated(cs, rep - 1):
            path = os.path.join(root, f"{c.save_key}-{rep}")
            save_s = timed(c.save, state, path)
            load_s = timed(c.load, target, path)
            remove(path)
            seconds[c.save_key].append(save_s)
            seconds[c.load_key].append(load_s)
            progress(f"rep {rep}/{reps}  {c.save_key} {save_s:.3f} s  {c.load_key} {load_s:.3f} s")
    return seconds


# --- the report -----------------------------------------------------------------------------


def summarize(seconds: dict[str, list[float]], nbytes: int) -> dict[str, float]:
    gbps = {f"{key}_gbps": nbytes / statistics.median(s) / 1e9 for key, s in seconds.items()}
    ratio_of = {
        "save_vs_dcp": ("zerostall_save", "dcp_save"),
        "save_vs_dcp_tuned": ("zerostall_save", "dcp_tuned_save"),
        "save_vs_raw": ("zerostall_save", "raw_write"),
        "load_vs_dcp": ("zerostall_load", "dcp_load"),
        "load_vs_dcp_tuned": ("zerostall_load", "dcp_tuned_load"),
        "load_vs_raw": ("zerostall_load", "raw_read"),
        "save_vs_raw_hashed": ("zerostall_save", "raw_hashed_write"),
        "load_vs_raw_hashed": ("zerostall_load", "raw_hashed_read"),
        # the most any library that verifies every byte it loads could reach against DCP in this run
        "raw_hashed_read_vs_dcp": ("raw_hashed_read", "dcp_load"),
    }
    ratios = {
        name: gbps[f"{ours}_gbps"] / gbps[f"{theirs}_gbps"]
        for name, (ours, theirs) in ratio_of.items()
    }
    return {key: round(v, 3) for key, v in (gbps | ratios).items()}


def print_table(cs: list[Contender], seconds: dict[str, list[float]], nbytes: int) -> None:
    print(f"{'contender':18s} {'save GB/s':>10s} {'load GB/s':>10s} {'save s':>8s} {'load s':>8s}")
    for c in cs:
        save_s = statistics.median(seconds[c.save_key])
        load_s = statistics.median(seconds[c.load_key])
        name = c.save_key.removesuffix("_save").replace("_write", "")
        print(
            f"{name:18s} {nbytes / save_s / 1e9:10.2f} {nbytes / load_s / 1e9:10.2f}"
            f" {save_s:8.3f} {load_s:8.3f}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="state size in MiB (1024)")
    parser.add_argument("--dir", default="/dev/shm", help="where to save (a fresh dir under it)")
    parser.add_argument(
        "--reps", type=int, default=7, help="timed repetitions (7: each contender once in each place)"
    )
    parser.add_argument("--tensors", type=int, default=N_TENSORS,
                        help=f"number of tensors ({N_TENSORS}); thousands show per-tensor costs")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    threads = default_threads()
    progress(f"building a {args.size_mb} MiB state of {args.tensors} tensors")
    state = build_state(args.size_mb << 20, n=args.tensors)
    target = touched_like(state)
    nbytes = state_bytes(state)
    cs = contenders(threads)
    root = tempfile.mkdtemp(prefix="zerostall-bench-", dir=args.dir)
    try:
        for c in cs:
            progress(f"warming {c.save_key} / {c.load_key}")
            warm_up(c, state, target, root)
        seconds = run_reps(cs, state, target, root, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print_table(cs, seconds, nbytes)
    if args.json:
        result = {
            **summarize(seconds, nbytes),
            "threads": threads,
            "state_bytes": nbytes,
            "n_tensors": len(state),
            "reps": args.reps,
            "dir": args.dir,
            "fsync": FSYNC,
            "raw_fsync": FSYNC,
            "unsynced_saves": ["torch", "safetensors"],
            "torch_version": torch.__version__,
            "seconds": {key: [round(s, 4) for s in v] for key, v in seconds.items()},
        }
        print_json(result)


if __name__ == "__main__":
    main()
