"""The rate of a copy sent between two ranks with ``zerostall.tiers.transfer.exchange``, against
the raw gloo send/recv rate of the same bytes (the transport's limit).

    python bench/transfer_rate.py [--size-mb N] [--reps R] [--dir D] [--chunk-mb C] [--json]

A state of --size-mb (``build_state``: 256 tensors of mixed sizes and dtypes) is saved once as a
one-rank checkpoint under --dir (default /dev/shm). Two processes are spawned (gloo over loopback,
OMP_NUM_THREADS=1) and, rep after rep:

- raw: rank 0 sends the same number of bytes to rank 1 from preallocated uint8 tensors, in chunks of
  each size of RAW_CHUNKS (two sends or receives in flight) and in one message; the best median of
  these is the transport's limit;
- exchange: rank 0 sends the checkpoint to rank 1 in chunks of --chunk-mb (default: exchange's
  own), which receives it into --dir, checks every block as it arrives and publishes it (deleted
  between reps, outside the timing), as a replication does;
- restore_exchange: the same copy sent as a restore sends it (``cut=True``) and received as a
  restore receives it: each large tensor straight into rank 1's state (the same tensors, zeroed,
  allocated before the reps), checked there, the rest into a folder; ``restore`` adds loading that
  rest into the state (``load_copy``): the whole restore of the copy;
- verify: the last received copy checked again alone (``zs.verify``, in this process, after the
  ranks are done), to show what checking costs.

A time is rank 1's wall time from a barrier to the end of its call; figures are medians over
reps. Beside them, each side's CPU time (all its threads) per GB: what the exchange spends beyond
the raw transport (the receiver hashes every block and writes the files), which a machine with
few cores cannot overlap: where both are bound by CPU, the ratio comes near raw CPU / exchange CPU.
Progress goes to stderr, a table to stdout; with --json the last line of stdout is one JSON
object (keys raw_transport_gbps, exchange_gbps, ratio, ...).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import build_state, free_port, init_group, median, print_json, progress, rnd

import zerostall as zs
from zerostall.options import LoadOptions
from zerostall.tiers.copies import LAYOUT_KEY, load_copy, placements, view
from zerostall.tiers.transfer import Landed, exchange

RAW_CHUNKS = (4 << 20, 16 << 20, 64 << 20)


def raw(rank: int, nbytes: int, chunk: int, buffers: list[torch.Tensor]) -> None:
    """Send (rank 0) or receive (rank 1) ``nbytes`` in chunks, two in flight."""
    works: list[dist.Work] = []
    for i, offset in enumerate(range(0, nbytes, chunk)):
        buf = buffers[i % 2][:min(chunk, nbytes - offset)]
        if len(works) == 2:
            works.pop(0).wait()
        works.append(dist.isend(buf, 1) if rank == 0 else dist.irecv(buf, 0))
    for work in works:
        work.wait()


def timed(fn, cpu: dict[str, list[float]], name: str) -> float:
    """The wall time of ``fn()`` from a barrier; this process's CPU time in it (all threads) goes to ``cpu[name]``."""
    dist.barrier()
    start, used = time.perf_counter(), time.process_time()
    fn()
    cpu.setdefault(name, []).append(time.process_time() - used)
    return time.perf_counter() - start


def restore(rank: int, copy: str, held: Path, state: dict[str, torch.Tensor], chunk: dict[str, int],
            load: bool) -> None:
    """Rank 0 sends ``copy`` as a restore's sender does; rank 1 receives it into ``state`` where it
    can (``load``: then loads the rest), and removes what is left of it."""
    target = view(state, restoring=True)
    got = exchange(dist.group.WORLD, [(1, Path(copy))] if rank == 0 else [], [(0, held)] if rank == 1 else [],
                   cut=True, place=functools.partial(placements, target), **chunk)
    if rank == 1:
        assert isinstance(got[0], Landed), got
        if load:
            load_copy(state, target, got[0].folder, options=LoadOptions(verify=False), placed=got[0].placed,
                      manifest=got[0].manifest)
        shutil.rmtree(got[0].folder)


def worker(rank: int, port: int, copy: str, out: str, nbytes: int, reps: int, chunk: dict[str, int],
           size: int) -> None:
    torch.set_num_threads(1)
    init_group(rank, 2, port, timeout=timedelta(seconds=300))
    state = {k: v.zero_() for k, v in build_state(size).items()}  # rank 1 restores into it
    largest = max(RAW_CHUNKS)
    buffers = [torch.ones(largest, dtype=torch.uint8) for _ in range(2)]
    whole = torch.ones(nbytes, dtype=torch.uint8)
    held = Path(out) / "held" / "rank_00000"
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for rep in range(reps + 1):  # the first is a warm-up
        times = {f"raw_{c >> 20}MiB": timed(lambda c=c: raw(rank, nbytes, c, buffers), cpu, f"raw_{c >> 20}MiB")
                 for c in RAW_CHUNKS}
        times["raw_one_message"] = timed(lambda: raw(rank, nbytes, nbytes, [whole, whole]), cpu, "raw_one_message")
        times["exchange"] = timed(lambda: exchange(dist.group.WORLD, [(1, Path(copy))] if rank == 0 else [],
                                                   [(0, held)] if rank == 1 else [], **chunk), cpu, "exchange")
        if rank == 1 and rep < reps:  # the last copy stays for the verify timing
            shutil.rmtree(held.parent)
        dist.barrier()
        restored = Path(out) / "restored" / "rank_00000"
        times["restore_exchange"] = timed(lambda: restore(rank, copy, restored, state, chunk, False), cpu,
                                          "restore_exchange")
        times["restore"] = timed(lambda: restore(rank, copy, restored, state, chunk, True), cpu, "restore")
        if rep:
            for name, s in times.items():
                seconds.setdefault(name, []).append(s)
            progress(f"rank {rank} rep {rep}: " + ", ".join(f"{k} {nbytes / v / 1e9:.2f} GB/s" for k, v in times.items()))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "cpu": {k: v[1:] for k, v in cpu.items()}}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--chunk-mb", type=float, default=None, help="exchange's chunk_bytes, in MiB")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = Path(args.dir) / f"zs-transfer-bench-{os.getpid()}"
    out.mkdir(parents=True)
    try:
        copy = out / "own"
        progress(f"saving a {args.size_mb} MiB state into {copy}")
        saved = build_state(args.size_mb << 20)
        zs.save(saved, str(copy), metadata={LAYOUT_KEY: view(saved).digest})  # as the local tier saves a copy
        nbytes = sum(f.stat().st_size for f in copy.iterdir())
        chunk = {} if args.chunk_mb is None else {"chunk_bytes": int(args.chunk_mb * (1 << 20))}
        mp.spawn(worker, args=(free_port(), str(copy), str(out), nbytes, args.reps, chunk, args.size_mb << 20),
                 nprocs=2)
        sender, receiver = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
        seconds = receiver["seconds"]
        held = str(out / "held" / "rank_00000")
        seconds["verify"] = []
        for _ in range(args.reps):
            start = time.perf_counter()
            zs.verify(held)
            seconds["verify"].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rates = {name: nbytes / median(s) / 1e9 for name, s in seconds.items()}
    cpu = {side: {k: median(v) / nbytes * 1e9 for k, v in ranks["cpu"].items()}
           for side, ranks in (("sender", sender), ("receiver", receiver))}
    raw_best = max(v for k, v in rates.items() if k.startswith("raw_"))
    print(f"{'':<18}{'GB/s':>8}{'median s':>10}{'CPU s/GB':>20}   ({nbytes / 1e9:.3f} GB, {args.reps} reps, "
          f"{os.cpu_count()} cores)")
    print(f"{'':<36}{'sender':>10}{'receiver':>10}")
    for name, s in seconds.items():
        used = "".join(f"{cpu[side][name]:>10.3f}" for side in ("sender", "receiver")) if name in cpu["sender"] else ""
        print(f"{name:<18}{rates[name]:>8.2f}{median(s):>10.3f}{used}")
    print(f"exchange / best raw: {rates['exchange'] / raw_best:.2f}; restore_exchange / best raw: "
          f"{rates['restore_exchange'] / raw_best:.2f}; restore / best raw: {rates['restore'] / raw_best:.2f}")
    if args.json:
        print_json({"bytes": nbytes, "reps": args.reps, "cores": os.cpu_count(), "dir": args.dir,
                    "chunk_mb": args.chunk_mb,
                    "raw_transport_gbps": rnd(raw_best, 3), "exchange_gbps": rnd(rates["exchange"], 3),
                    "ratio": rnd(rates["exchange"] / raw_best, 3), "verify_gbps": rnd(rates["verify"], 3),
                    "restore_exchange_gbps": rnd(rates["restore_exchange"], 3),
                    "restore_exchange_ratio": rnd(rates["restore_exchange"] / raw_best, 3),
                    "restore_ratio": rnd(rates["restore"] / raw_best, 3),
                    "rates_gbps": {k: rnd(v, 3) for k, v in rates.items()},
                    "cpu_s_per_gb": {side: {k: rnd(v, 3) for k, v in c.items()} for side, c in cpu.items()},
                    "seconds": {k: [rnd(x) for x in v] for k, v in seconds.items()}})


if __name__ == "__main__":
    sys.exit(main())
