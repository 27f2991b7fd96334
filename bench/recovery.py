"""Recovery with the node-local tier: restore from the own tier, from peers, from the persistent tier.

    python bench/recovery.py [--rank-mib 256] [--reps 3] [--every 5] [--save-every 20] [--stop 39]
                             [--step-s 0.5] [--stall-steps 7] [--stall-every 1] [--dir /dev/shm] [--no-s3] [--json]

Four gloo ranks (spawned as bench/distributed.py does, OMP_NUM_THREADS=1) on two simulated nodes
(``ZEROSTALL_NODE_ID``: ranks 0-1 on node a, 2-3 on node b), a directory per node under --dir. Each
rank holds --rank-mib (256 MiB: 1 GiB over the four ranks, what the local tier stores per copy of
every rank): a model of 4 square Linear layers and its AdamW state (3/4 of it, the same on every
rank) and 1/4 of its own under the rank-local key ``dataloader`` (1/4 GiB over the ranks).

1. Train: ``CheckpointManager(root, save_every=S, local=LocalTier(node dir, every=E, keep=1,
   replicas=2))`` (and a second manager on S3 saving the same steps to the root on S3) for steps
   1..--stop, a step being a small change of every tensor plus --step-s of simulated device compute
   (a sleep: the CPU is free, as while a GPU computes). At --stop every rank dies (``os._exit``:
   saves and replication in flight are lost, as in a crash). Each rank records its state's digest at
   every saved step, when each local save committed and when each replication ended.
2. Restore, by fresh managers in fresh processes, every rep interleaving (rotated order):
   ``local`` (the same nodes), ``peer`` (ranks 2-3 under a spare node id with an empty directory:
   node b lost), ``persistent`` and ``persistent_s3`` (every rank on a spare node: both nodes lost;
   the root a local directory, or S3 on a SeaweedFS server on loopback, tests/s3server.py), and the
   raw gloo transfer of the same bytes (``raw``: ranks 0->2 and 1->3 at once, the pairs a peer restore
   uses, preallocated uint8 tensors; and one pair alone). A time is the slowest rank's, from a
   barrier to the end of ``mgr.restore``; every restored state's digest must equal the saved one.
   The peer restore's exchange (its transfer and the check of every block on arrival) is timed apart
   from the restore by wrapping the functions it calls (``exchange``, and ``verify_all``, which the
   transfer runs file by file beside the receiving), so the table says where the time goes: as a
   window from the first rank's call to the last one's end (``peer_vs_raw``: counts the ranks'
   skew in reaching the exchange), and per pair from the moment both its ends were in the exchange
   to its receiver's end, the slowest pair (``peer_pair_vs_raw``: timed as raw is, from a barrier).
3. Stall: the same state trained for real (forward, backward, gradients all-reduced, AdamW), in
   blocks of --stall-steps steps with a local save every --stall-every steps (1: every step) and blocks
   without saves, interleaved;
   ``mgr.wait_staged()`` before each optimizer step, as the docs say. ``save()`` time (median over
   steps of the slowest rank, the first save apart), the capture (staged) time, the step time of
   both arms and their difference, and how many local saves were dropped before their
   replication (``stall_steps_dropped``: replication slower than the saves).

``steps_lost``: --stop minus the step each failure scenario restored. Progress goes to stderr, a
table to stdout, and with --json one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import types
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from common import describe, free_port, init_group, median, print_json, progress, rnd, rotated  # noqa: E402
from s3server import SeaweedS3, weed_runs  # noqa: E402

import zerostall as zs  # noqa: E402
from zerostall.tiers import sources, transfer  # noqa: E402
from zerostall.tiers.nodes import NODE_ENV  # noqa: E402

WORLD = 4
GROUP_TIMEOUT = timedelta(minutes=5)
LAYERS = 4
NODES = {"train": "aabb", "local": "aabb", "peer": "aacc", "persistent": "ddee", "persistent_s3": "ffgg"}
SPARE = "cdefg"  # node directories emptied before every restore
SCENARIOS = ("local", "peer", "persistent", "persistent_s3", "raw")
FAILURES = {"trainer_crash": "local", "one_node_lost": "peer", "two_nodes_lost": "persistent"}
RAW_CHUNK = 16 << 20
RAW_PAIRS = {"pairs": [(0, 2), (1, 3)], "one_pair": [(0, 2)]}  # the pairs a peer restore uses; one alone


# --- the state ------------------------------------------------------------------------------


def make_state(rank: int, rank_mib: int) -> dict[str, Any]:
    """3/4 of ``rank_mib`` replicated (a model and its AdamW state after one step), 1/4 this rank's own."""
    width = math.isqrt((rank_mib << 20) // 4 // LAYERS // 4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    optim.step()
    optim.zero_grad(set_to_none=True)
    own = torch.randn(LAYERS * width * width, generator=torch.Generator().manual_seed(100 + rank))
    return {"model": model, "optim": optim, "dataloader": {"pos": 0, "buffer": own}}


def state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    optim_state = [v for s in state["optim"].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [*state["model"].parameters(), *optim_state, state["dataloader"]["buffer"]]


def digest(state: dict[str, Any]) -> str:
    """Every tensor's bytes, the loader position and the global RNG: what a restore must give back."""
    h = xxhash.xxh3_128()
    for t in state_tensors(state):
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    h.update(repr(state["dataloader"]["pos"]).encode())
    h.update(torch.get_rng_state().numpy())
    return h.hexdigest()


@torch.no_grad()
def change(state: dict[str, Any], step: int, rank: int) -> None:
    """One simulated training step's change: a row of every tensor, the loader position, the RNG."""
    for t in state_tensors(state):
        if t.dim():  # the replicated tensors alike on every rank, the rank's own buffer its own way
            t.view(-1)[step * 4099 % t.numel()] += 1.0 + (rank if t is state["dataloader"]["buffer"] else 0)
    for s in state["optim"].state.values():
        s["step"] += 1
    state["dataloader"]["pos"] = step
    torch.rand(1)  # the global RNG moves, as a data loader's shuffling does


@torch.no_grad()
def scramble(state: dict[str, Any]) -> None:
    """Make the state unlike any saved one, so a restore that skips anything shows in the digest."""
    for t in state_tensors(state):
        t.fill_(-3.0)
    state["dataloader"]["pos"] = -1
    torch.manual_seed(12345)


def node_dir(base: str, node: str) -> str:
    return os.path.join(base, f"node-{node}")


def manager(root: str, base: str, node: str, args: argparse.Namespace) -> zs.CheckpointManager:
    os.environ[NODE_ENV] = node
    tier = zs.LocalTier(node_dir(base, node), every=args.every, keep=1, replicas=2, timeout_s=60)
    return zs.CheckpointManager(root, save_every=args.save_every, local=tier)


def write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


# --- 1. train, then crash -------------------------------------------------------------------


def train(rank: int, args: argparse.Namespace, port: int, run: dict[str, str]) -> None:
    torch.set_num_threads(1)
    init_group(rank, WORLD, port, GROUP_TIMEOUT)
    state = make_state(rank, args.rank_mib)
    mgr = manager(run["root"], run["base"], NODES["train"][rank], args)
    on_s3 = zs.CheckpointManager(run["s3"], save_every=args.save_every) if run.get("s3") else None
    called: dict[int, float] = {}
    commits: dict[int, float] = {}
    replicated: dict[int, float] = {}
    tier, replicator = mgr.tier, mgr.tier.replicator
    tier_save, replicate = tier.save, replicator._replicate

    def timed_save(step: int, *a: Any) -> Any:
        called[step] = time.monotonic()
        handle = tier_save(step, *a)
        handle.committed.add_done_callback(lambda f: commits.setdefault(step, time.monotonic()))
        return handle

    def timed_replicate(step: int) -> bool:
        done = replicate(step)
        if done:
            replicated[step] = time.monotonic()
        return done

    tier.save, replicator._replicate = timed_save, timed_replicate  # bench instrumentation only
    digests: dict[int, str] = {}
    for step in range(1, args.stop + 1):
        start = time.monotonic()
        mgr.wait_staged()  # before the state changes
        change(state, step, rank)
        saved = False
        if mgr.should_save(step):
            mgr.save(step, state)
            saved = True
        if on_s3 is not None and on_s3.should_save(step):
            on_s3.save(step, state)
            saved = True
        if saved:
            digests[step] = digest(state)
        time.sleep(max(0.0, args.step_s - (time.monotonic() - start)))
    write_json(os.path.join(run["out"], f"train-{rank}.json"),
               {"digests": digests, "called": called, "commits": commits, "replicated": replicated, "holders": replicator.holders,
                "failures": replicator.failures, "crashed_at": time.monotonic()})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the crash: nothing in flight is finished


# --- 2. restore -----------------------------------------------------------------------------


class Timed:
    """Wrap ``module.name`` so each call's (start, end, ``keep(result)``) is recorded, and its
    positional arguments in ``args`` (bench instrumentation)."""

    def __init__(self, module: types.ModuleType, name: str, keep: Callable[[Any], Any] = lambda r: r) -> None:
        self.calls: list[tuple[float, float, Any]] = []
        self.args: list[tuple[Any, ...]] = []
        inner = getattr(module, name)

        def timed(*a: Any, **kw: Any) -> Any:
            start = time.monotonic()
            result = inner(*a, **kw)
            self.calls.append((start, time.monotonic(), keep(result)))
            self.args.append(a)
            return result

        setattr(module, name, timed)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def received_bytes(got: list[Any]) -> list[int]:
    """The bytes of each copy an exchange received (those it put into memory included: the folder
    left for the rest holds every file at its full size), taken before the restore removes it."""
    return [tree_bytes(str(p.folder)) for p in got if p is not None]


def restore_once(scenario: str, rank: int, state: dict[str, Any], run: dict[str, str], args: argparse.Namespace,
                 exchanges: Timed, verifies: Timed) -> dict[str, Any]:
    root = run["s3"] if scenario == "persistent_s3" else run["root"]
    scramble(state)
    opened = time.monotonic()
    mgr = manager(root, run["base"], NODES[scenario][rank], args)
    opened = time.monotonic() - opened
    del exchanges.calls[:], exchanges.args[:], verifies.calls[:], verifies.args[:]
    dist.barrier()
    start = time.monotonic()
    try:
        step = mgr.restore(state)
        end = time.monotonic()
        info = mgr.last_restore
    finally:
        mgr.close()
    received = sum(n for _, _, sizes in exchanges.calls for n in sizes)
    return {"seconds": end - start, "open_s": opened, "step": step, "source": info.source,
            "sources": list(info.sources), "fallbacks": [list(f) for f in info.fallbacks],
            "digest": digest(state), "exchange": [(s, e) for s, e, _ in exchanges.calls],
            "exchange_peers": [([r for r, _ in sends], [r for r, _ in receives]) for _, sends, receives in exchanges.args],
            "received": received,
            "verify_s": sum(e - s for s, e, _ in verifies.calls)}


def raw_once(pg: Any, rank: int, pairs: list[tuple[int, int]], buf: torch.Tensor, whole: bool) -> float:
    """Send ``buf`` from each pair's first rank to its second, all pairs at once; this rank's seconds."""
    works = []
    chunks = [buf] if whole else list(buf.split(RAW_CHUNK))
    dist.barrier()
    start = time.monotonic()
    for src, dst in pairs:
        if rank == src:
            works += [dist.isend(c, dst, group=pg) for c in chunks]
        elif rank == dst:
            works += [dist.irecv(c, src, group=pg) for c in chunks]
    for w in works:
        w.wait()
    return time.monotonic() - start


def slowest_pair(recs: list[dict[str, Any]]) -> float | None:
    """Of one peer restore (a record per rank): each receiving rank's exchange from the moment it
    and its sender had both entered theirs to its end; the longest, or None without a pair."""
    if any("error" in r or len(r["exchange"]) > 1 for r in recs):  # a second attempt: no pairs to time
        return None
    starts = {rank: r["exchange"][0][0] for rank, r in enumerate(recs) if r["exchange"]}
    spans = [end - max(start, starts[src]) for r in recs if r["exchange"]
             for (start, end), (_, sources) in [(r["exchange"][0], r["exchange_peers"][0])] for src in sources]
    return max(spans) if spans else None


def restore(rank: int, args: argparse.Namespace, port: int, run: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    init_group(rank, WORLD, port, GROUP_TIMEOUT)
    state = make_state(rank, args.rank_mib)
    exchanges, verifies = Timed(sources, "exchange", received_bytes), Timed(transfer, "verify_all")
    pg = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)  # the raw transfers' own, as the tier has its own
    buf = torch.zeros(run["copy_bytes"], dtype=torch.uint8)
    buf.fill_(rank)  # touched before any timing
    log: dict[str, list[Any]] = {}
    scenarios = [s for s in SCENARIOS if s != "persistent_s3" or run.get("s3")]
    for rep in range(args.reps):
        for scenario in rotated(scenarios, rep):
            dist.barrier()
            if rank == 0:
                for node in SPARE:
                    shutil.rmtree(node_dir(run["base"], node), ignore_errors=True)
            dist.barrier()
            if scenario == "raw":
                log.setdefault(scenario, []).append(
                    {f"{name}_{'whole' if whole else 'chunked'}": raw_once(pg, rank, pairs, buf, whole)
                     for name, pairs in RAW_PAIRS.items() for whole in (False, True)})
            else:
                try:
                    got = restore_once(scenario, rank, state, run, args, exchanges, verifies)
                except Exception as exc:  # noqa: BLE001 (one scenario failing must not stop the others)
                    got = {"error": describe(exc)}
                log.setdefault(scenario, []).append(got)
            if rank == 0:
                progress(f"rep {rep + 1}/{args.reps} {scenario}: rank 0 {json.dumps(log[scenario][-1])[:160]}")
    write_json(os.path.join(run["out"], f"restore-{rank}.json"), log)
    dist.destroy_process_group()


# --- 3. the stall of save() with local saves every step --------------------------------------


def train_step(state: dict[str, Any], step: int, rank: int, mgr: zs.CheckpointManager) -> None:
    model, optim = state["model"], state["optim"]
    width = model[0].in_features
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1000 * step + rank))
    loss = model(x).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= WORLD
    mgr.wait_staged()  # the capture of the last save must end before the state changes
    optim.step()
    optim.zero_grad(set_to_none=False)
    with torch.no_grad():
        state["dataloader"]["buffer"][step] += 1
    state["dataloader"]["pos"] = step
    torch.rand(1)


def stall(rank: int, args: argparse.Namespace, port: int, run: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    init_group(rank, WORLD, port, GROUP_TIMEOUT)
    state = make_state(rank, args.rank_mib)
    args = argparse.Namespace(**{**vars(args), "every": args.stall_every, "save_every": None})
    mgr = manager(os.path.join(run["base"], "stall-root"), os.path.join(run["base"], "stall"), "aabb"[rank], args)
    log: dict[str, Any] = {"save": [], "none": [], "save_s": [], "staged_s": [], "committed_s": [], "first": None,
                           "saves": 0}
    step, handle = 0, None
    for rep in range(args.reps + 1):  # block 0: warm-up (the first save allocates and checks the space)
        for arm in rotated(["save", "none"], rep):
            for _ in range(args.stall_steps):
                step += 1
                dist.barrier()
                start = time.monotonic()
                train_step(state, step, rank, mgr)
                if arm == "save" and mgr.should_save(step):
                    busy = handle is not None and not handle.committed.done()  # save() then waits for it
                    called = time.monotonic()
                    handle = mgr.save(step, state)
                    returned = time.monotonic()
                    log["saves"] += 1
                    times = {"save_s": returned - called, "busy": busy}
                    handle.staged.add_done_callback(lambda f, t=times: t.setdefault("staged_s", time.monotonic()))
                    handle.committed.add_done_callback(lambda f, t=times: t.setdefault("committed_s", time.monotonic()))
                    if log["first"] is None:
                        log["first"] = returned - called
                    elif rep:
                        log["pending"] = log.get("pending", []) + [(called, times)]
                seconds = time.monotonic() - start
                if rep:
                    log[arm].append(seconds)
    mgr.wait()
    for called, times in log.pop("pending", []):
        for what in ("save_s", "staged_s", "committed_s"):
            log.setdefault(what, []).append(times[what] - (called if what in ("staged_s", "committed_s") else 0.0))
        log.setdefault("busy", []).append(times["busy"])
    log["replication_s"] = [s for _, s in mgr.tier.replicator.replicated]
    log["dropped"] = mgr.tier.replicator.dropped
    mgr.close()
    write_json(os.path.join(run["out"], f"stall-{rank}.json"), log)
    dist.destroy_process_group()


# --- the report -----------------------------------------------------------------------------


def load_all(out: str, phase: str) -> list[Any]:
    ranks = []
    for rank in range(WORLD):
        with open(os.path.join(out, f"{phase}-{rank}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def per_rep(ranks: list[dict[str, Any]], scenario: str, fn: Callable[[list[Any]], Any]) -> list[Any]:
    """``fn`` of every rank's record, one value per rep of ``scenario``."""
    return [fn(list(recs)) for recs in zip(*(r.get(scenario, []) for r in ranks))]


def gbps(nbytes: float, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def summarize(args: argparse.Namespace, run: dict[str, Any], trained: list[dict[str, Any]],
              restored: list[dict[str, Any]], stalled: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": {}, "notes": []}
    steps: dict[str, int | None] = {}
    for scenario in ("local", "peer", "persistent", "persistent_s3"):
        reps = [recs for recs in zip(*(r.get(scenario, []) for r in restored))]
        good = []
        for recs in reps:
            errors = [f"rank {i}: {r['error']}" for i, r in enumerate(recs) if "error" in r]
            step = recs[0].get("step")
            wrong = [i for i, r in enumerate(recs) if "error" not in r and
                     r["digest"] != trained[i]["digests"].get(str(step))]
            if errors or wrong:
                out["errors"][scenario] = errors[0] if errors else f"ranks {wrong} restored a state unlike step {step}'s"
                continue
            good.append(recs)
            steps[scenario] = step
        out[f"restore_{scenario}_s"] = rnd(median([max(r["seconds"] for r in recs) for recs in good]))
        out[f"restore_{scenario}_open_s"] = rnd(median([max(r["open_s"] for r in recs) for recs in good]))
        out[f"restore_{scenario}_sources"] = good[0][0]["sources"] if good else None
        out[f"restore_{scenario}_step"] = steps.get(scenario)
    # the peer restore: bytes moved / the window from the first exchange call to the last one's end
    # and, as raw gloo is timed (every pair from a barrier, the slowest), each pair from the moment both its ends
    # were in the exchange to the end of its receiver's call: the slowest pair
    windows, paired, moved, verify = [], [], [], []
    for recs in zip(*(r.get("peer", []) for r in restored)):
        calls = [c for r in recs if "error" not in r for c in r["exchange"]]
        if calls:
            windows.append(max(e for _, e in calls) - min(s for s, _ in calls))
            moved.append(sum(r.get("received", 0) for r in recs))
            verify.append(max(r.get("verify_s", 0.0) for r in recs))
            paired.append(slowest_pair(recs))
    exchange_s = median(windows)
    pair_s = median([p for p in paired if p is not None]) if any(p is not None for p in paired) else None
    peer_bytes = median(moved) or 0
    raw_pairs, raw_one = (per_rep(restored, "raw", lambda recs, n=name: min(max(r[f"{n}_{v}"] for r in recs)
                                                                            for v in ("chunked", "whole")))
                          for name in RAW_PAIRS)  # each variant's slowest rank; the best variant
    raw_gbps = gbps(2 * run["copy_bytes"], median(raw_pairs))
    peer_gbps = gbps(peer_bytes, exchange_s)
    out |= {
        "raw_transport_gbps": rnd(raw_gbps), "raw_one_pair_gbps": rnd(gbps(run["copy_bytes"], median(raw_one))),
        "peer_bytes": peer_bytes, "peer_exchange_s": rnd(exchange_s), "peer_verify_s": rnd(median(verify)),
        "peer_transfer_gbps": rnd(peer_gbps), "peer_vs_raw": rnd(peer_gbps / raw_gbps if peer_gbps and raw_gbps else None, 3),
        "peer_pair_s": rnd(pair_s), "peer_pair_vs_raw": rnd(gbps(peer_bytes, pair_s) / raw_gbps if pair_s and raw_gbps
                                                            else None, 3),
    }
    s3, local = out.get("restore_persistent_s3_s"), out.get("restore_local_s")
    out["local_vs_persistent_s3"] = rnd(s3 / local, 2) if s3 and local else None
    # the stall: median over steps of the slowest rank
    for what in ("save_s", "staged_s", "committed_s"):
        out[f"local_{what}"] = rnd(median([max(v) for v in zip(*(r[what] for r in stalled))]))
    out["local_save_stall_s"] = out.pop("local_save_s")
    out["local_save_stall_last_rank_s"] = rnd(median([min(v) for v in zip(*(r["save_s"] for r in stalled))]))
    idle = [max(v) for v, *busy in zip(zip(*(r["save_s"] for r in stalled)), *(r["busy"] for r in stalled))
            if not any(busy)]  # saves called when no rank's previous save was still being written
    out["local_save_stall_idle_s"] = rnd(median(idle))
    out["local_saves_behind_previous"] = f"{len(stalled[0]['save_s']) - len(idle)} of {len(stalled[0]['save_s'])}"
    out["local_first_save_s"] = rnd(max(r["first"] for r in stalled))
    with_saves = median([max(v) for v in zip(*(r["save"] for r in stalled))])
    without = median([max(v) for v in zip(*(r["none"] for r in stalled))])
    out |= {"step_s_with_local_saves": rnd(with_saves), "step_s_without_saves": rnd(without),
            "step_overhead": rnd(with_saves / without - 1, 3) if with_saves and without else None,
            "stall_replication_s": rnd(median([s for r in stalled for s in r["replication_s"]])),
            "stall_steps_dropped": max(r["dropped"] for r in stalled),
            "stall_steps_saved": max(r["saves"] for r in stalled)}
    # replication: from rank r's commit of a step to the last of its holders' replication of that step
    delays = []
    for rank, rec in enumerate(trained):
        for step, committed in rec["commits"].items():
            ends = [trained[h]["replicated"].get(step) for h in rec["holders"]]
            if ends and all(e is not None for e in ends):
                delays.append(max(ends) - committed)
    out["replication_s"] = rnd(median(delays))
    out["train_commit_s"] = rnd(median([rec["commits"][s] - t for rec in trained for s, t in rec["called"].items()
                                        if s in rec["commits"]]))  # a local save's call to its commit, while training
    out["replications_measured"] = len(delays)
    out["steps_lost"] = {failure: (args.stop - steps[s] if steps.get(s) is not None else None)
                         for failure, s in FAILURES.items()}
    if "persistent_s3" in steps:
        out["steps_lost"]["two_nodes_lost_s3"] = args.stop - steps["persistent_s3"]
    out |= {"every": args.every, "save_every": args.save_every, "stall_every": args.stall_every, "stop": args.stop,
            "step_s": args.step_s,
            "rank_mib": args.rank_mib, "world": WORLD, "copy_bytes": run["copy_bytes"], "reps": args.reps,
            "torch_version": torch.__version__}
    if not run.get("s3"):
        out["notes"].append(f"no S3 server: {run.get('s3_missing')}")
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"{'restore from':16s} {'s':>8s} {'step':>5s}  sources")
    for s in ("local", "peer", "persistent", "persistent_s3"):
        seconds = r.get(f"restore_{s}_s")
        print(f"{s:16s} {'' if seconds is None else f'{seconds:8.3f}':>8s} {str(r.get(f'restore_{s}_step')):>5s}  "
              f"{r.get(f'restore_{s}_sources')}")
    print(f"peer: {r['peer_bytes']} bytes in {r['peer_exchange_s']} s of exchange ({r['peer_verify_s']} s verifying, overlapped) = "
          f"{r['peer_transfer_gbps']} GB/s; raw gloo (same pairs) {r['raw_transport_gbps']} GB/s, one pair "
          f"{r['raw_one_pair_gbps']} GB/s; peer/raw {r['peer_vs_raw']}; the slowest pair timed from when both its ends "
          f"were in the exchange (as raw is timed from a barrier): {r['peer_pair_s']} s, {r['peer_pair_vs_raw']} of raw")
    print(f"local save every {r['stall_every']} step(s): save() {r['local_save_stall_s']} s ({r['local_save_stall_idle_s']} s when the previous "
          f"save had committed; {r['local_saves_behind_previous']} saves waited for it; first {r['local_first_save_s']} s), staged "
          f"{r['local_staged_s']} s, committed {r['local_committed_s']} s; step {r['step_s_without_saves']} -> "
          f"{r['step_s_with_local_saves']} s ({r['step_overhead']}); the last rank to call save() "
          f"{r['local_save_stall_last_rank_s']} s; {r['stall_steps_dropped']} of {r['stall_steps_saved']} local saves "
          "dropped before their replication (it was slower than the saves)")
    print(f"while training: a local save commits {r['train_commit_s']} s after save(), its replicas are published "
          f"{r['replication_s']} s after its commit")
    print(f"steps lost (every={r['every']}, save_every={r['save_every']}, crash after step {r['stop']}): "
          f"{r['steps_lost']}")
    for what, error in r["errors"].items():
        print(f"failed: {what}: {error}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-mib", type=int, default=256, help="state of each rank, MiB (256: 1 GiB in all)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--every", type=int, default=5, help="LocalTier.every")
    ap.add_argument("--save-every", type=int, default=20, help="the persistent tier's save_every")
    ap.add_argument("--stop", type=int, default=39, help="the step after which every rank crashes")
    ap.add_argument("--step-s", type=float, default=0.5, help="simulated device time of a training step")
    ap.add_argument("--stall-steps", type=int, default=7, help="steps of each block of the stall measurement")
    ap.add_argument("--stall-every", type=int, default=1, help="a local save every this many steps there")
    ap.add_argument("--dir", default="/dev/shm", help="where the node directories and roots go (memory)")
    ap.add_argument("--no-s3", action="store_true", help="skip the root on S3")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = tempfile.mkdtemp(prefix="zs-recovery-", dir=args.dir)
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    run: dict[str, Any] = {"root": os.path.join(tmp, "root"), "base": os.path.join(tmp, "nodes"), "out": out}
    server = None
    try:
        missing = "--no-s3" if args.no_s3 else weed_runs()
        if missing is None:
            try:
                server = SeaweedS3(os.path.join(tmp, "s3"))
                server.start()
                os.environ.update(server.env())  # the spawned ranks inherit it
                run["s3"] = f"s3://{server.bucket}/recovery"
            except Exception as exc:  # noqa: BLE001 (the rest runs without S3)
                missing, server = describe(exc), None
        run["s3_missing"] = missing
        progress(f"train: 4 ranks, {args.rank_mib} MiB each, crash after step {args.stop}; S3: {missing or 'yes'}")
        mp.spawn(train, args=(args, free_port(), run), nprocs=WORLD)
        trained = load_all(out, "train")
        last = max(int(s) for s in trained[2]["digests"])
        copy = os.path.join(run["base"], "node-b")
        copies = [os.path.join(d, "rank_00002") for d, _, _ in os.walk(copy) if os.path.isdir(os.path.join(d, "rank_00002"))]
        run["copy_bytes"] = max((tree_bytes(c) for c in copies), default=args.rank_mib << 20)
        progress(f"restore: {args.reps} reps of {SCENARIOS}; a rank's copy {run['copy_bytes']} bytes (last save {last})")
        mp.spawn(restore, args=(args, free_port(), run), nprocs=WORLD)
        restored = load_all(out, "restore")
        for node in os.listdir(run["base"]):
            shutil.rmtree(os.path.join(run["base"], node), ignore_errors=True)
        progress(f"stall: {args.reps} reps x {args.stall_steps} steps with local saves every {args.stall_every} "
                 "step(s), and without")
        mp.spawn(stall, args=(args, free_port(), run), nprocs=WORLD)
        result = summarize(args, run, trained, restored, load_all(out, "stall"))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(result)
    if args.json:
        print_json(result)


if __name__ == "__main__":
    main()
