"""zerostall on S3 against the raw parallel transfer, DCP through fsspec/s3fs and s3torchconnector's DCP.

    python bench/s3.py [--mib 256] [--ranks 4] [--reps 5] [--part-mib 16] [--concurrency 8] [--slow-s 2] [--dir D] [--json]

One SeaweedFS server on loopback (tests/s3server.py), its data in ``--dir`` (memory by default, so
the disk's noise is not measured; the space of deleted objects is freed between reps), serves every
contender. Two phases: one process
saving and loading a ``--mib`` state, then ``--ranks`` gloo ranks saving and loading a ``--mib``
state sharded over them (DTensor, ``Shard(0)``). Contenders, each into a fresh prefix per rep:

- ``zerostall``: ``zs.save`` / ``zs.load`` of ``s3://`` (S3Options from the environment, defaults:
  16 MiB parts, 8 requests in flight per process);
- ``raw``: the same number of bytes per process as parallel multipart PUTs and ranged GETs into
  preallocated buffers with the client zerostall uses (boto3, our own pool, bench/s3_clients.py's
  ``Boto3Client``) at the same part size and concurrency, over as many objects as zerostall writes
  data files per process: the ceiling of any checkpointer built on that client;
- ``dcp_fsspec``: ``torch.distributed.checkpoint`` with ``FsspecWriter``/``FsspecReader`` on
  ``s3://`` (s3fs, endpoint and keys as storage options), ``--dcp-threads`` writer threads;
- ``s3connector_dcp``: s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` with its file
  system's client pointed at the server (``S3Client(endpoint=..., force_path_style=True)``): its
  DCP classes take no endpoint, so the bench replaces their ``fs``; null with the reason if it
  cannot be imported or cannot reach the server.

Every contender is warmed (one save and load, the bytes checked) before ≥ ``--reps`` interleaved
reps (rotated order); GB/s = state bytes / median seconds (multi-rank: the slowest rank, between
barriers). Control requests (LIST, GET, HEAD: ``ListObjectsV2``, ``ListMultipartUploads``,
``GetObject``, ``HeadObject``) of zerostall's saves are counted with botocore event hooks in every
process and summed over ranks; with ranks, one more save has its last rank slowed by ``--slow-s``
seconds before it writes, to show whether the count grows with the slowest rank. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types
import warnings
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from common import build_state, describe, free_port, init_group, median, print_json, progress, rnd, rotated
from s3_clients import Boto3Client
from s3server import SeaweedS3, vacuum  # s3_clients put tests/ on sys.path

import zerostall as zs
from zerostall.options import default_threads
from zerostall.storage.s3client import Connection, S3Options

CONTENDERS = ("zerostall", "raw", "dcp_fsspec", "s3connector_dcp")
CONTROL = ("ListObjectsV2", "ListMultipartUploads", "GetObject", "HeadObject")
RESULT_FILE = "result.json"


# --- the state ------------------------------------------------------------------------------


def make_state(total: int, world: int) -> dict[str, Any]:
    """``total`` bytes of tensors; with ranks, each one a DTensor sharded on dim 0 over all of them."""
    state: dict[str, Any] = build_state(total)
    if world > 1:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state.items()}
    return state


def local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(state: dict[str, Any]) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in state.values())


def zeroed(state: dict[str, Any]) -> dict[str, Any]:
    """A load target shaped like ``state``: its tensors (DTensors) filled with zeros."""
    out = {}
    for k, v in state.items():
        t = v.detach().clone()
        local(t).zero_()
        out[k] = t
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(local(a[k]), local(b[k])) for k in a)


# --- the contenders: save(path), load(path), check() ----------------------------------------


class Contender:
    """One way to move this process's share of the state to and from ``s3://bucket/<prefix>``."""

    def __init__(self, state: dict[str, Any], server: Any, args: argparse.Namespace) -> None:
        self.state, self.server, self.args = state, server, args
        self.target = zeroed(state)

    def url(self, prefix: str) -> str:
        return f"s3://{self.server.bucket}/{prefix}"

    def check(self) -> bool:
        """Whether the last load brought back the saved bytes (then the target is zeroed again)."""
        ok = same(self.state, self.target)
        for t in self.target.values():
            local(t).zero_()
        return ok


class Zerostall(Contender):
    def save(self, prefix: str) -> None:
        zs.save(self.state, self.url(prefix))

    def load(self, prefix: str) -> None:
        zs.load(self.target, self.url(prefix))


class Raw(Contender):
    """The same bytes per process as ``files`` objects, with bench/s3_clients.py's boto3 client."""

    def __init__(self, state: dict[str, Any], server: Any, args: argparse.Namespace) -> None:
        self.state, self.server = state, server
        files = default_threads()
        each = local_bytes(state) // files
        self.source = memoryview(bytearray(os.urandom(1 << 20)) * -(-each >> 20))[:each]
        self.outs = [memoryview(bytearray(len(self.source))) for _ in range(files)]
        self.client = Boto3Client(server, args.part_mib << 20, args.concurrency)
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def keys(self, prefix: str) -> list[str]:
        return [f"{prefix}/r{self.rank}-{n}" for n in range(len(self.outs))]

    def save(self, prefix: str) -> None:
        self.client.put_all({key: self.source for key in self.keys(prefix)})

    def load(self, prefix: str) -> None:
        self.client.get_all(dict(zip(self.keys(prefix), self.outs)))

    def check(self) -> bool:
        ok = all(out == self.source for out in self.outs)
        for out in self.outs:
            out[:] = bytes(len(out))
        return ok


class DcpFsspec(Contender):
    def options(self) -> dict[str, Any]:
        s = self.server
        return {"key": s.access_key, "secret": s.secret_key,
                "client_kwargs": {"endpoint_url": s.endpoint, "region_name": s.region}}

    def save(self, prefix: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(self.state, storage_writer=FsspecWriter(self.url(prefix), thread_count=self.args.dcp_threads,
                                                         **self.options()))

    def load(self, prefix: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(self.target, storage_reader=FsspecReader(self.url(prefix), **self.options()))


class S3ConnectorDcp(Contender):
    def __init__(self, state: dict[str, Any], server: Any, args: argparse.Namespace) -> None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter

        super().__init__(state, server, args)
        self.writer_cls, self.reader_cls = S3StorageWriter, S3StorageReader
        config = S3ClientConfig(part_size=args.part_mib << 20, force_path_style=True)
        self.fs = lambda **kw: S3FileSystem(server.region, s3_client=S3Client(
            server.region, endpoint=server.endpoint, s3client_config=config), **kw)

    def save(self, prefix: str) -> None:
        writer = self.writer_cls(self.server.region, self.url(prefix), thread_count=self.args.dcp_threads)
        writer.fs = self.fs()  # its constructor takes no endpoint
        writer.path = writer.fs.init_path(self.url(prefix))
        dcp.save(self.state, storage_writer=writer)

    def load(self, prefix: str) -> None:
        reader = self.reader_cls(self.server.region, self.url(prefix))
        reader.fs = self.fs(reader_constructor=reader._reader_constructor)
        reader.path = reader.fs.init_path(self.url(prefix))
        dcp.load(self.target, storage_reader=reader)


MAKERS: dict[str, Callable[..., Contender]] = {"zerostall": Zerostall, "raw": Raw, "dcp_fsspec": DcpFsspec,
                                               "s3connector_dcp": S3ConnectorDcp}


# --- one process's part ---------------------------------------------------------------------


def count_requests() -> Counter[str]:
    """S3 operations zerostall's client sends in this process, by name (botocore ``before-call``)."""
    calls: Counter[str] = Counter()

    def seen(model: Any, **_: Any) -> None:
        calls[model.name] += 1

    Connection.get(S3Options()).client.meta.events.register("before-call.s3", seen)
    return calls


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], None]) -> float:
    """Seconds of ``fn`` on every rank: from a barrier to the barrier after the slowest rank."""
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def summed(calls: Counter[str]) -> dict[str, int]:
    """This process's counts summed over ranks."""
    out = [dict(calls)]
    if dist.is_initialized():
        out = [{}] * dist.get_world_size()
        dist.all_gather_object(out, dict(calls))
    total: Counter[str] = Counter()
    for c in out:
        total.update(c)
    return dict(total)


def clear(server: Any, prefix: str) -> None:
    """Delete every object under ``prefix`` and free their space (rank 0, between barriers): the server's data stays small."""
    barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        client = Connection.get(S3Options()).client
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if keys:
                client.delete_objects(Bucket=server.bucket, Delete={"Objects": keys, "Quiet": True})
        vacuum(server.master)
    barrier()


def phase(rank: int, world: int, port: int, server: Any, args: argparse.Namespace, out: str) -> None:
    """Warm and time every contender in this process (one of ``world`` ranks); rank 0 writes the result."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if world > 1:
        init_group(rank, world, port)
    try:
        state = make_state(args.mib << 20, world)
        calls = count_requests()
        errors: dict[str, str] = {}
        contenders: dict[str, Contender] = {}
        for name in CONTENDERS:
            try:
                contenders[name] = MAKERS[name](state, server, args)
            except Exception as exc:  # not importable: the same on every rank
                errors[name] = describe(exc)
        seconds: dict[str, list[float]] = {f"{n}_{op}": [] for n in contenders for op in ("save", "load")}
        control: list[dict[str, int]] = []
        for rep in range(-1, args.reps):  # rep -1 warms every contender and checks its bytes
            for name in rotated(list(contenders), max(rep, 0)):
                if name in errors:
                    continue
                c, prefix = contenders[name], f"w{world}/{name}/{rep}"
                try:
                    before = Counter(calls)
                    save_s = timed(lambda: c.save(prefix))
                    if name == "zerostall" and rep >= 0:
                        control.append(summed(calls - before))
                    load_s = timed(lambda: c.load(prefix))
                    if rep < 0 and summed(Counter(ok=int(c.check()))).get("ok", 0) != world:
                        raise RuntimeError("the bytes loaded differ from those saved")
                except Exception as exc:  # the same contender fails on every rank (gloo errors surface too)
                    errors[name] = describe(exc)
                    continue
                finally:
                    clear(server, prefix)
                if rep >= 0:
                    seconds[f"{name}_save"].append(save_s)
                    seconds[f"{name}_load"].append(load_s)
                progress(f"w{world} rep {rep:2d} {name:16s} save {save_s:6.3f} s  load {load_s:6.3f} s")
        slow = slow_save(state, server, args, calls, world) if world > 1 else None
        if rank == 0:
            result = {"bytes": args.mib << 20, "seconds": seconds, "control": control, "slow": slow,
                      "errors": errors}
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        if world > 1:
            dist.destroy_process_group()


def slow_save(state: dict[str, Any], server: Any, args: argparse.Namespace, calls: Counter[str],
              world: int) -> dict[str, Any]:
    """One zerostall save whose last rank starts writing ``--slow-s`` seconds late: its control requests."""
    import zerostall.saving.pipeline as saving

    write_data = saving.write_data
    if dist.get_rank() == world - 1:
        def late(*a: Any, **kw: Any) -> Any:
            time.sleep(args.slow_s)
            return write_data(*a, **kw)

        saving.write_data = late
    prefix = f"w{world}/slow"
    before = Counter(calls)
    try:
        s = timed(lambda: zs.save(state, f"s3://{server.bucket}/{prefix}"))
    finally:
        saving.write_data = write_data
    counts = summed(calls - before)
    clear(server, prefix)
    return {"seconds": s, "calls": counts}


# --- the report -----------------------------------------------------------------------------


def gbps(total: int, seconds: list[float]) -> float | None:
    m = median(seconds)
    return rnd(total / m / 1e9 if m else None)


def ratio(a: float | None, b: float | None) -> float | None:
    return rnd(a / b if a and b else None, 3)


def control_count(calls: dict[str, int]) -> int:
    return sum(calls.get(op, 0) for op in CONTROL)


def report(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The flat keys of the issue (1 process; ``_{ranks}r`` for the ranks), the ratios, then the detail."""
    out: dict[str, Any] = {}
    for world, r in results.items():
        sfx = "" if world == 1 else f"_{world}r"
        g = {k: gbps(r["bytes"], v) for k, v in r["seconds"].items()}
        out |= {f"zerostall_s3_save_gbps{sfx}": g.get("zerostall_save"),
                f"zerostall_s3_load_gbps{sfx}": g.get("zerostall_load"),
                f"raw_s3_put_gbps{sfx}": g.get("raw_save"), f"raw_s3_get_gbps{sfx}": g.get("raw_load")}
        for name in ("dcp_fsspec", "s3connector_dcp"):
            out |= {f"{name}_save_gbps{sfx}": g.get(f"{name}_save"), f"{name}_load_gbps{sfx}": g.get(f"{name}_load")}
        for op, raw_op in (("save", "put"), ("load", "get")):
            z = out[f"zerostall_s3_{op}_gbps{sfx}"]
            out[f"zerostall_vs_raw_{op}{sfx}"] = ratio(z, out[f"raw_s3_{raw_op}_gbps{sfx}"])
            out[f"zerostall_vs_dcp_fsspec_{op}{sfx}"] = ratio(z, out[f"dcp_fsspec_{op}_gbps{sfx}"])
            out[f"zerostall_vs_s3connector_dcp_{op}{sfx}"] = ratio(z, out[f"s3connector_dcp_{op}_gbps{sfx}"])
        per_save = [control_count(c) for c in r["control"]]
        out[f"control_requests_per_save{sfx}"] = median(per_save)
        out[f"control_requests_detail{sfx}"] = r["control"][0] if r["control"] else None
        if r["slow"] is not None:
            out[f"control_requests_per_save{sfx}_slow_rank"] = control_count(r["slow"]["calls"])
            out[f"control_requests_detail{sfx}_slow_rank"] = r["slow"]["calls"]
            out[f"slow_rank_save_s{sfx}"] = rnd(r["slow"]["seconds"], 3)
        out |= {f"{k}{sfx}": v for k, v in {"errors": r["errors"], "seconds": r["seconds"]}.items()}
    out |= {"bytes": args.mib << 20, "ranks": args.ranks, "part_bytes": args.part_mib << 20,
            "concurrency": args.concurrency, "dcp_threads": args.dcp_threads, "reps": args.reps,
            "slow_s": args.slow_s, "dir": args.dir, "weed_args": args.weed_arg, "loadavg": os.getloadavg()[0], "torch_version": torch.__version__}
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of state saved and loaded per rep (all ranks)")
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks of the second phase (0: skip it)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--part-mib", type=int, default=16, help="multipart part size (zerostall's default)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight per process (zerostall's default)")
    ap.add_argument("--dcp-threads", type=int, default=1, help="DCP writer threads (files per rank; DCP's default)")
    ap.add_argument("--slow-s", type=float, default=2.0, help="delay of the slow rank's writes")
    ap.add_argument("--dir", default="/dev/shm", help="where the server keeps its data (memory: no disk noise)")
    ap.add_argument("--weed-arg", action="append", default=[], help="one more `weed server` flag (repeatable)")
    ap.add_argument("--json", action="store_true", help="(always) print the JSON result line last")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = tempfile.mkdtemp(prefix="zs-s3bench-", dir=args.dir)
    results: dict[int, dict[str, Any]] = {}
    try:
        with SeaweedS3(tmp, extra_args=args.weed_arg) as server:
            os.environ.update(server.env())  # zerostall (and s3torchconnector's credentials) read it; spawned ranks too
            info = types.SimpleNamespace(endpoint=server.endpoint, bucket=server.bucket, region=server.region,
                                         access_key=server.access_key, secret_key=server.secret_key,
                                         master=server.master)
            progress(f"SeaweedFS at {server.endpoint}; {args.mib} MiB, {args.reps} reps")
            for world in (1, args.ranks) if args.ranks > 1 else (1,):
                out = os.path.join(tmp, f"w{world}-{RESULT_FILE}")
                if world == 1:
                    phase(0, 1, 0, info, args, out)
                else:
                    mp.spawn(phase, args=(world, free_port(), info, args, out), nprocs=world)
                with open(out) as f:
                    results[world] = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_json(report(results, args))


if __name__ == "__main__":
    sys.exit(main())
