"""Export to Hugging Face safetensors: zerostall's streamed export against what users do today, in
one run, on the same tensors and the same target, for a checkpoint of one process and one of many ranks.

    python bench/export.py [--size-mb N] [--ranks K] [--sharded-mb M] [--shard-mb S] [--dir D] [--reps R] [--json]

Two checkpoints are saved once into D (default a fresh directory under /dev/shm, so software
overhead shows):

- plain: one deterministic state (default 2 GiB of fp32/bf16 tensors of mixed sizes, bench/common.py's
  ``build_state``) saved with ``zs.save`` by one process;
- sharded: matrices of 4096 rows (default 1 GiB in all; fp32 and bf16 in turn, 64 MiB each) saved by K
  ranks (default 16; 0 skips it) as DTensors split by columns (``Shard(1)``), so every row of the
  exported tensor is assembled from a piece of every rank's chunk. The K ranks are K gloo processes
  of this machine (forked, one thread each); each makes its own column block from a seed, and the
  parent checks the first exported matrix against the blocks joined.

Each is exported to HF safetensors files of at most S MB (default 256) by:

- zerostall: ``zs.export(ckpt, out, max_shard_size=S)``, streamed: every block's checksum verified,
  files fsync'd;
- anchor: the state in memory (``zs.load`` into a state dict, timed separately as ``load_s``), split
  as ``save_pretrained`` splits it (``huggingface_hub.split_torch_state_dict_into_shards``) and
  written with ``safetensors.torch.save_file`` per shard (``write_s``; not fsync'd, its default).

Each contender runs in a fresh process (a child of this script), so its peak resident memory
(VmHWM) is its own: ``peak_rss_mb`` is that peak, ``peak_rss_growth_mb`` the peak over the
process's resident memory after its imports. ``read_ratio`` is the bytes the process read through
read syscalls while it ran (the ``rchar`` delta of /proc/self/io: manifests and data files) per
tensor byte exported. The outputs are checked equal (file names, index, every tensor) once. Reps are
interleaved, their order rotated; figures are medians. GB/s = tensor bytes / seconds / 1e9.
Progress goes to stderr, a table per checkpoint to stdout; with --json the last line is one JSON object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import zerostall as zs
from zerostall.options import default_threads
from common import build_state, free_port, init_group, print_json, progress, remove, rotated, state_bytes

MB = 10**6
ROWS = 4096  # of every sharded matrix
SHARDED_COLUMNS = {torch.float32: 4096, torch.bfloat16: 8192}  # 64 MiB matrices, in turn


def status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rchar() -> int:
    """Bytes this process has read through read syscalls, all threads together."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def child(which: str, ckpt: str, out: str, shard_bytes: int) -> dict:
    """One export in this (fresh) process: seconds, bytes read and peak resident memory growth."""
    import safetensors.torch
    from huggingface_hub import split_torch_state_dict_into_shards

    base = status("VmRSS")
    read = rchar()
    result = {}
    if which == "zerostall":
        start = time.perf_counter()
        zs.export(ckpt, out, max_shard_size=shard_bytes)
        result["seconds"] = time.perf_counter() - start
    else:
        start = time.perf_counter()
        with zs.open(ckpt) as ck:
            state = {key: torch.empty(e.shape, dtype=e.torch_dtype) for key, e in ck.entries.items()}
            ck.load(state)
        result["load_s"] = time.perf_counter() - start
        start = time.perf_counter()
        split = split_torch_state_dict_into_shards(state, max_shard_size=shard_bytes)
        os.makedirs(out)
        for name, keys in split.filename_to_tensors.items():
            safetensors.torch.save_file({k: state[k] for k in keys}, os.path.join(out, name), metadata={"format": "pt"})
        if split.is_sharded:
            with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
        result["write_s"] = time.perf_counter() - start
        result["seconds"] = result["load_s"] + result["write_s"]
    result["read_bytes"] = rchar() - read
    result["peak_rss"] = status("VmHWM")
    result["peak_rss_growth"] = result["peak_rss"] - base
    return result


def run_child(which: str, ckpt: str, out: str, shard_bytes: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", which, ckpt, out, str(shard_bytes)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{which} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def open_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def same_output(a: str, b: str) -> bool:
    """Whether two exported directories hold the same files, index and tensors."""
    from safetensors.torch import load_file

    names = sorted(n for n in os.listdir(a) if n.endswith(".safetensors"))
    if names != sorted(n for n in os.listdir(b) if n.endswith(".safetensors")):
        return False
    index = "model.safetensors.index.json"
    if os.path.exists(os.path.join(a, index)):
        left, right = (json.loads(open_text(os.path.join(d, index))) for d in (a, b))
        if (left["weight_map"], left["metadata"]["total_size"]) != (right["weight_map"],
                                                                    right["metadata"]["total_size"]):
            return False
    for name in names:
        x, y = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


# --- the checkpoint of many ranks ----------------------------------------------------------


def sharded_shapes(total_bytes: int) -> list[tuple[str, torch.dtype, tuple[int, int]]]:
    """The sharded checkpoint's matrices: (key, dtype, shape), 64 MiB each, fp32 and bf16 in turn."""
    dtypes = list(SHARDED_COLUMNS)
    count = max(1, total_bytes // (64 << 20))
    return [(f"layers.{i}.weight", dtypes[i % 2], (ROWS, SHARDED_COLUMNS[dtypes[i % 2]])) for i in range(count)]


def column_block(i: int, dtype: torch.dtype, shape: tuple[int, int], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s columns of matrix ``i``, made from a seed."""
    g = torch.Generator().manual_seed(i * 1000 + rank)
    return torch.randn(shape[0], shape[1] // world, generator=g).to(dtype)


def save_rank(rank: int, world: int, port: int, path: str, total_bytes: int) -> None:
    """One rank of the sharded save: its column block of every matrix, as DTensors, one ``zs.save``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    init_group(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    state = {key: DTensor.from_local(column_block(i, dtype, shape, rank, world), mesh, [Shard(1)], run_check=False)
             for i, (key, dtype, shape) in enumerate(sharded_shapes(total_bytes))}
    zs.save(state, path)
    torch.distributed.destroy_process_group()


def save_sharded(path: str, world: int, total_bytes: int) -> int:
    """Save the sharded checkpoint at ``path`` from ``world`` gloo processes; its tensor bytes."""
    mp.start_processes(save_rank, (world, free_port(), path, total_bytes), nprocs=world, start_method="fork")
    return sum(dtype.itemsize * shape[0] * shape[1] for _, dtype, shape in sharded_shapes(total_bytes))


def first_matrix_exact(out: str, world: int, total_bytes: int) -> bool:
    """Whether the first exported matrix is every rank's column block, joined."""
    from safetensors import safe_open

    key, dtype, shape = sharded_shapes(total_bytes)[0]
    index = os.path.join(out, "model.safetensors.index.json")
    name = json.loads(open_text(index))["weight_map"][key] if os.path.exists(index) else "model.safetensors"
    with safe_open(os.path.join(out, name), framework="pt") as f:
        got = f.get_tensor(key)
    want = torch.cat([column_block(0, dtype, shape, r, world) for r in range(world)], dim=1)
    return torch.equal(got, want)


# --- one checkpoint, both contenders -------------------------------------------------------


def compare(root: str, case: str, ckpt: str, nbytes: int, shard_bytes: int, reps: int) -> dict:
    """Export ``ckpt`` with both contenders ``reps`` times, interleaved; the case's summary."""
    names = ["zerostall", "anchor"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        for name in rotated(names, rep):
            out = os.path.join(root, f"out-{case}-{name}")
            remove(out)
            runs[name].append(run_child(name, ckpt, out, shard_bytes))
            progress(f"{case} rep {rep} {name}: {runs[name][-1]}")
    checked = same_output(os.path.join(root, f"out-{case}-zerostall"), os.path.join(root, f"out-{case}-anchor"))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    result = {
        "bytes": nbytes, "runs": runs, "outputs_equal": checked,
        "zerostall": {"seconds": med("zerostall", "seconds"), "gb_s": nbytes / med("zerostall", "seconds") / 1e9,
                      "read_ratio": med("zerostall", "read_bytes") / nbytes,
                      "peak_rss_growth_mb": med("zerostall", "peak_rss_growth") / MB,
                      "peak_rss_mb": med("zerostall", "peak_rss") / MB,
                      "peak_vs_two_shards": med("zerostall", "peak_rss_growth") / (2 * shard_bytes)},
        "anchor_save_file": {"seconds": med("anchor", "seconds"), "load_s": med("anchor", "load_s"),
                             "write_s": med("anchor", "write_s"),
                             "write_gb_s": nbytes / med("anchor", "write_s") / 1e9,
                             "read_ratio": med("anchor", "read_bytes") / nbytes,
                             "peak_rss_growth_mb": med("anchor", "peak_rss_growth") / MB,
                             "peak_rss_mb": med("anchor", "peak_rss") / MB},
    }
    z, a = result["zerostall"], result["anchor_save_file"]
    result["time_vs_anchor_write"] = z["seconds"] / a["write_s"]
    result["time_vs_anchor_load_and_write"] = z["seconds"] / a["seconds"]
    result["peak_rss_vs_anchor"] = z["peak_rss_growth_mb"] / a["peak_rss_growth_mb"]
    return result


def print_table(case: str, result: dict) -> None:
    z, a, nbytes = result["zerostall"], result["anchor_save_file"], result["bytes"]
    print(f"{case}: {nbytes / 1e9:.2f} GB")
    print(f"{'contender':<22}{'seconds':>9}{'GB/s':>7}{'read/exported':>15}{'peak RSS growth MB':>20}")
    print(f"{'zerostall export':<22}{z['seconds']:>9.2f}{z['gb_s']:>7.2f}{z['read_ratio']:>15.3f}"
          f"{z['peak_rss_growth_mb']:>20.0f}")
    print(f"{'load + save_file':<22}{a['seconds']:>9.2f}{nbytes / a['seconds'] / 1e9:>7.2f}{a['read_ratio']:>15.3f}"
          f"{a['peak_rss_growth_mb']:>20.0f}")
    print(f"{'  save_file alone':<22}{a['write_s']:>9.2f}{a['write_gb_s']:>7.2f}")
    print(f"outputs equal: {result['outputs_equal']}; zerostall peak = {z['peak_vs_two_shards']:.2f} x two shards")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--sharded-mb", type=int, default=1024)
    parser.add_argument("--shard-mb", type=int, default=256)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("WHICH", "CKPT", "OUT", "SHARD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        which, ckpt, out, shard = args.child
        print(json.dumps(child(which, ckpt, out, int(shard))))
        return

    root = tempfile.mkdtemp(prefix="zs-bench-export-", dir=args.dir)
    shard_bytes = args.shard_mb * MB
    result = {"bench": "export", "shard_bytes": shard_bytes, "reps": args.reps, "dir": args.dir,
              "threads": default_threads(), "ranks": args.ranks}
    try:
        if args.ranks:  # first: the ranks are forked from a process that has run no torch work yet
            ckpt = os.path.join(root, "sharded")
            nbytes = save_sharded(ckpt, args.ranks, args.sharded_mb << 20)
            progress(f"saved {nbytes / 1e9:.2f} GB from {args.ranks} ranks in {root}")
            result["sharded"] = compare(root, "sharded", ckpt, nbytes, shard_bytes, args.reps)
            result["sharded"]["first_matrix_exact"] = first_matrix_exact(
                os.path.join(root, "out-sharded-zerostall"), args.ranks, args.sharded_mb << 20)
            remove(ckpt)
        state = build_state(args.size_mb << 20)
        nbytes = state_bytes(state)
        zs.save(state, os.path.join(root, "ck"))
        del state
        progress(f"saved {nbytes / 1e9:.2f} GB in {root}")
        result["plain"] = compare(root, "plain", os.path.join(root, "ck"), nbytes, shard_bytes, args.reps)
    finally:
        remove(root)

    print_table("plain (one process)", result["plain"])
    if args.ranks:
        print_table(f"sharded ({args.ranks} ranks, Shard(1))", result["sharded"])
        print(f"first matrix equals the ranks' blocks joined: {result['sharded']['first_matrix_exact']}")
    if args.json:
        print_json(result)


if __name__ == "__main__":
    main()
