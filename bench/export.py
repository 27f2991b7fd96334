"""Export to Hugging Face safetensors: zerostall's streamed export against what users do today, in
one run, on the same tensors and the same target.

    python bench/export.py [--size-mb N] [--shard-mb S] [--dir D] [--reps R] [--json]

One deterministic state (default 2 GiB of fp32/bf16 tensors of mixed sizes, bench/common.py's
``build_state``) is saved once with ``zs.save`` into D (default a fresh directory under /dev/shm, so
software overhead shows), then exported to HF safetensors files of at most S MB (default 256) by:

- zerostall: ``zs.export(ckpt, out, max_shard_size=S)``, streamed: every block's checksum verified,
  files fsync'd;
- anchor: the state in memory (``zs.load`` into a state dict, timed separately as ``load_s``), split
  as ``save_pretrained`` splits it (``huggingface_hub.split_torch_state_dict_into_shards``) and
  written with ``safetensors.torch.save_file`` per shard (``write_s``; not fsync'd, its default).

Each contender runs in a fresh process (a child of this script), so its peak resident memory
(VmHWM) is its own: ``peak_rss_mb`` is that peak, ``peak_rss_growth_mb`` the peak over the
process's resident memory after its imports. The outputs are checked equal (file names, index, every tensor) once. Reps are
interleaved, their order rotated; figures are medians. GB/s = tensor bytes / seconds / 1e9.
Progress goes to stderr, a table to stdout; with --json the last line is one JSON object.
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

import zerostall as zs
from zerostall.options import default_threads
from common import build_state, print_json, progress, remove, rotated, state_bytes

MB = 10**6


def status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(which: str, ckpt: str, out: str, shard_bytes: int) -> dict:
    """One export in this (fresh) process: seconds and peak resident memory growth."""
    import safetensors.torch
    from huggingface_hub import split_torch_state_dict_into_shards

    base = status("VmRSS")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=2048)
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
    try:
        state = build_state(args.size_mb << 20)
        nbytes = state_bytes(state)
        zs.save({k: v for k, v in state.items()}, os.path.join(root, "ck"))
        del state
        progress(f"saved {nbytes / 1e9:.2f} GB in {root}")
        names = ["zerostall", "anchor"]
        runs: dict[str, list[dict]] = {n: [] for n in names}
        checked = None
        for rep in range(args.reps):
            for name in rotated(names, rep):
                out = os.path.join(root, f"out-{name}")
                remove(out)
                runs[name].append(run_child(name, os.path.join(root, "ck"), out, shard_bytes))
                progress(f"rep {rep} {name}: {runs[name][-1]}")
            if checked is None:
                checked = same_output(os.path.join(root, "out-zerostall"), os.path.join(root, "out-anchor"))
    finally:
        remove(root)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    result = {
        "bench": "export", "bytes": nbytes, "runs": runs, "shard_bytes": shard_bytes, "reps": args.reps, "dir": args.dir,
        "threads": default_threads(), "outputs_equal": checked,
        "zerostall": {"seconds": med("zerostall", "seconds"), "gb_s": nbytes / med("zerostall", "seconds") / 1e9,
                      "peak_rss_growth_mb": med("zerostall", "peak_rss_growth") / MB,
                      "peak_rss_mb": med("zerostall", "peak_rss") / MB,
                      "peak_vs_two_shards": med("zerostall", "peak_rss_growth") / (2 * shard_bytes)},
        "anchor_save_file": {"seconds": med("anchor", "seconds"), "load_s": med("anchor", "load_s"),
                             "write_s": med("anchor", "write_s"),
                             "write_gb_s": nbytes / med("anchor", "write_s") / 1e9,
                             "peak_rss_growth_mb": med("anchor", "peak_rss_growth") / MB,
                             "peak_rss_mb": med("anchor", "peak_rss") / MB},
    }
    result["time_vs_anchor_write"] = result["zerostall"]["seconds"] / result["anchor_save_file"]["write_s"]
    result["time_vs_anchor_load_and_write"] = result["zerostall"]["seconds"] / result["anchor_save_file"]["seconds"]
    result["peak_rss_vs_anchor"] = result["zerostall"]["peak_rss_growth_mb"] / result["anchor_save_file"][
        "peak_rss_growth_mb"]
    z, a = result["zerostall"], result["anchor_save_file"]
    print(f"{'contender':<22}{'seconds':>9}{'GB/s':>7}{'peak RSS growth MB':>20}")
    print(f"{'zerostall export':<22}{z['seconds']:>9.2f}{z['gb_s']:>7.2f}{z['peak_rss_growth_mb']:>20.0f}")
    print(f"{'load + save_file':<22}{a['seconds']:>9.2f}{nbytes / a['seconds'] / 1e9:>7.2f}"
          f"{a['peak_rss_growth_mb']:>20.0f}")
    print(f"{'  save_file alone':<22}{a['write_s']:>9.2f}{a['write_gb_s']:>7.2f}")
    print(f"outputs equal: {checked}; zerostall peak = {z['peak_vs_two_shards']:.2f} x two shards")
    if args.json:
        print_json(result)


if __name__ == "__main__":
    main()
