"""Planning at scale, no processes: zerostall's save planner, manifest and load routing against DCP's
global save plan and metadata, on synthetic FSDP, FSDP + TP and HSDP layouts of N ranks (issue 31).

    python bench/plan_scale.py --ranks N [--ranks-after N'] [--params P] [--layout fsdp|fsdp_tp|hsdp|all]
                               [--max-rows R] [--timeout S] [--sample K] [--reps 3] [--json]

The state of each rank: P parameters shaped like a Llama-7B-style transformer (embedding, per layer two
norms, q/k/v/o, gate/up/down; a final norm and the output layer; hidden 4,096, FFN 11,008, vocabulary
32,000), fp32, with two Adam moments each sharded like their parameter, and one python value (the
optimizer step): ``{"model": {name: p}, "optim": {"state": {name: {"exp_avg", "exp_avg_sq"}}, "step": 7}}``.
Layouts (boxes follow DTensor's ``torch.chunk`` rule; a dimension shorter than the ranks leaves empty boxes,
which DTensor places at the dimension's end):

- fsdp: every tensor dim-0 sharded over all N ranks;
- fsdp_tp: TP degree 8 (colwise q/k/v/gate/up/embedding/output shard dim 0, rowwise o/down shard dim 1,
  norms replicated over TP) and FSDP over N/8 on dim 0 within each TP shard (FSDP2's strided shard);
- hsdp: N/8 replicas of 8-way dim-0 sharding.

zerostall, driven as the pure functions the save runs (``saving/plan.py``, ``saving/commit.py``): each
rank's ``Row`` list built as ``collect()`` builds it (with each DTensor box's ``grid``), ``structure_digest``
and the plan each rank makes alone (``regular_digest`` + ``grid_plan``, sampled ranks: all ranks run it
at once, so it is the global plan's time), each rank's ``done`` record (its chunks in data-file order, one
file per rank, checksums one per 4 MiB block), ``assemble`` of the manifest, ``Manifest.to_bytes`` and
``parse_manifest`` (the loader's one parse), then a load on N' ranks: ``LoadPlanner.plan`` (key
matching, one rank) and the fetch stage's routing of each target box over the entry's chunks
(``Fetcher._route``, sampled ranks of N'). For comparison, ``build_plan`` over all ranks' rows: the
plan of a layout that ranks cannot plan alone (``rows_plan_s``). Planning traffic per rank, computed from
the encodings sent: the planning all-reduce (11 int64) and the replica check's all-reduce (two int64 a
replicated box), each about twice its size for a ring all-reduce; apart, ``all_gather_object(rows)``
that an irregular layout adds (pickled, padded to the largest rank's: each rank sends it once and
receives it N times); the load's manifest broadcast and its all-reduce of one int64
per entry. DCP, on the same layouts: a ``SavePlan`` per rank as ``create_default_local_save_plan`` and
``DefaultSavePlanner.create_local_plan`` make it (DTensor write items, the step as BYTE_IO on the
coordinator, ``planner_data`` mappings), ``DefaultSavePlanner.create_global_plan`` timed, the pickled
local plan (gathered to the coordinator), global plan (scattered) and ``Metadata`` with its
``storage_data`` (broadcast to every rank after the write, and written as ``.metadata``), and its
unpickling time (DCP's load reads it so).

Global stages need all N ranks' rows in this one process. When N × rows exceed --max-rows, they run on
the largest n = N / 2**k that fits and are marked ``"scaled_from": n``: their figures are the smaller
run's, scaled linearly (an estimate, low where sorts are n log n): the global plans (zerostall's and
DCP's) by N / n, since they go over every rank's rows; the manifest, records, metadata, their parses and
the load routing by the ratio of the chunk counts (``chunks`` itself is exact: counted from the layout).
Per-rank figures (digest, payloads, traffic) are always measured at N. A stage past --timeout seconds
stops and is reported under ``"timeouts"`` with what was measured before it. Times are CPU seconds of
this process (each stage is single-threaded), so a busy machine does not inflate them. Human lines,
then with --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import pickle
import resource
import signal
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan as DcpSavePlan
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem as DcpWriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from zerostall.format import codec
from zerostall.gcpause import gc_paused
from zerostall.format.layout import DEFAULT_BLOCK_SIZE, Chunk, Entry, dump_json, load_json
from zerostall.format.safetensors_file import FileItem, safetensors_header
from zerostall.format.manifest_check import max_manifest_bytes, parse_manifest
from zerostall.loading.fetch import Fetcher
from zerostall.loading.load_plan import LoadPlanner
from zerostall.options import LoadOptions
from zerostall.saving.collect import Collected, Row, path_key
from zerostall.saving.commit import assemble
from zerostall.saving.plan import build_plan, grid_plan, regular_digest, structure_digest
from zerostall.state import flatten, fqn

HIDDEN, FFN, VOCAB, TP = 4096, 11008, 32000, 8
ITEMSIZE = 4  # fp32
GENERATION = "0000018c2e4a5f00-1a2b3c4d"
LAYER = [("attention_norm.weight", "h", None), ("attention.wq.weight", "hh", 0), ("attention.wk.weight", "hh", 0),
         ("attention.wv.weight", "hh", 0), ("attention.wo.weight", "hh", 1), ("ffn_norm.weight", "h", None),
         ("feed_forward.w1.weight", "fh", 0), ("feed_forward.w3.weight", "fh", 0), ("feed_forward.w2.weight", "hf", 1)]
Spec = tuple[str, tuple[int, ...], "int | None"]  # a parameter's name, global shape, TP shard dim (None: replicated)


class StageTimeout(Exception):
    """A stage ran past --timeout."""


def transformer(params: int, hidden: int = HIDDEN, ffn: int = FFN, vocab: int = VOCAB) -> list[Spec]:
    """``params`` parameter specs in a transformer's order: embedding, layers, final norm, output."""
    dims = {"h": hidden, "f": ffn}
    specs: list[Spec] = [("tok_embeddings.weight", (vocab, hidden), 0)]
    layer = 0
    while len(specs) < params - 2:
        specs += [(f"layers.{layer}.{name}", tuple(dims[d] for d in shape), tp) for name, shape, tp in LAYER]
        layer += 1
    specs = specs[:max(params - 2, 1)] + [("norm.weight", (hidden,), None), ("output.weight", (vocab, hidden), 0)]
    return specs[:params]


def split(length: int, n: int, i: int) -> tuple[int, int]:
    """Offset and size of piece ``i`` of ``n`` of a dimension, as ``torch.chunk`` (and DTensor's Shard) cut it."""
    step = -(-length // n)
    start = min(step * i, length)
    return start, max(0, min(length, start + step) - start)


@functools.lru_cache(maxsize=None)
def box(layout: str, shape: tuple[int, ...], tp_dim: int | None, rank: int, n: int) -> tuple[tuple[int, ...], ...]:
    """Rank ``rank``'s box (offsets, sizes) of a tensor of ``shape`` in ``layout`` over ``n`` ranks."""
    offsets, sizes = [0] * len(shape), list(shape)
    cuts: list[tuple[int, int, int]] = []  # (dim, pieces, index), outermost first
    if layout == "fsdp":
        cuts = [(0, n, rank)]
    elif layout == "fsdp_tp":
        if tp_dim is not None:
            cuts.append((tp_dim, TP, rank % TP))
        cuts.append((0, n // TP, rank // TP))
    else:  # hsdp
        cuts = [(0, TP, rank % TP)]
    for dim, pieces, index in cuts:
        start, size = split(sizes[dim], pieces, index)
        offsets[dim], sizes[dim] = offsets[dim] + start, size
    for dim, size in enumerate(sizes):
        if not size:
            offsets[dim] = shape[dim]  # DTensor puts an empty box at the dimension's end, even a nested one
    return tuple(offsets), tuple(sizes)


class Layout:
    """The state's keys (shared by every rank) and each rank's rows, as ``collect()`` lists them."""

    def __init__(self, layout: str, specs: list[Spec], ranks: int) -> None:
        self.layout, self.specs, self.ranks = layout, specs, ranks
        self.state = {"model": {name: torch.empty(0) for name, _, _ in specs},
                      "optim": {"state": {name: {"exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0)}
                                          for name, _, _ in specs}, "step": 7}}
        self.flat = flatten(self.state, skeleton=True)  # the placeholders give the keys, tree and refs
        self.keys = {path: path_key(path) for path in self.flat.leaves}
        self.fqns = {key: fqn(path) for path, key in self.keys.items()}
        shape_of = {name: (shape, tp) for name, shape, tp in specs}
        self.leaves = [(path, self.keys[path], *shape_of.get(path[-2] if path[0] == "optim" else path[-1], ((), None)))
                       for path in self.flat.leaves]

    def rows(self, rank: int) -> list[Row]:
        out = []
        for path, key, shape, tp in self.leaves:
            if path == ("optim", "step"):
                out.append(Row(key, "object"))
                continue
            offsets, sizes = box(self.layout, shape, tp, rank, self.ranks)
            out.append(Row(key, "tensor", "float32", shape, offsets, sizes, math.prod(sizes) * ITEMSIZE,
                           grid=self.grid(tp, rank)))
        return out

    def grid(self, tp: int | None, rank: int) -> tuple[int, int, int, int, int]:
        """``Row.grid`` as ``format.boxes.grid_of`` gives it for the DTensor: a layout id (a small int here:
        the planner only compares them), the copies of the box (the ranks along its replicated mesh
        dimensions), this rank's position among them, the ranks in the mesh, the box's index (this
        rank's coordinates along the other mesh dimensions)."""
        n = self.ranks
        if self.layout == "fsdp":
            return 1, 1, 0, n, rank
        if self.layout == "fsdp_tp":  # mesh (dp, tp): a norm is Replicate on tp, the rest Shard on tp (dim 0 or 1)
            return (2 + tp, 1, 0, n, rank) if tp is not None else (4, TP, rank % TP, n, rank // TP)
        return 5, n // TP, rank // TP, n, rank % TP  # hsdp: mesh (replica, shard), Replicate on the first


def distinct_chunks(lay: Layout) -> int:
    """The chunks of the global state (distinct boxes of every tensor, the python value's one), from the layout alone."""
    boxes = {(shape, tp): len({box(lay.layout, shape, tp, r, lay.ranks) for r in range(lay.ranks)})
             for _, _, shape, tp in lay.leaves if shape}
    return sum(boxes[(shape, tp)] if shape else 1 for _, _, shape, tp in lay.leaves)


def timed(fn: Callable[[], Any], reps: int = 1, budget: float = 20.0) -> tuple[Any, float]:
    """``fn()``'s result and the median CPU time of ``reps`` calls (fewer once they took ``budget``
    seconds): every stage is single-threaded Python, so CPU time is its time on a core of its own,
    whatever else the machine runs."""
    times, result, start = [], None, time.process_time()
    for _ in range(reps):
        t0 = time.process_time()
        result = fn()
        times.append(time.process_time() - t0)
        if time.process_time() - start > budget:
            break
    return result, statistics.median(times)


def deadline(seconds: float) -> None:
    """Raise :class:`StageTimeout` in ``seconds`` (0: cancel)."""
    def expire(*_: Any) -> None:
        raise StageTimeout(f"over {seconds:.0f} s")
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def gathered(payload: int, ranks: int) -> dict[str, int]:
    """Bytes one rank sends and receives in ``all_gather_object`` of a ``payload``-byte pickle (the
    largest rank's): the sizes are all-gathered as int64, then every rank's padded pickle."""
    return {"send": 8 + payload, "recv": 8 * ranks + payload * ranks}


def sample_ranks(n: int, k: int) -> list[int]:
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def per_rank(lay: Layout, sample: list[int]) -> dict[str, Any]:
    """The per-rank costs, measured on sampled ranks: digest time; the plan each rank makes alone
    (``regular_digest`` and ``grid_plan``: the global plan of a regular layout, all ranks at once);
    the pickled payload of the rows gather that an irregular layout needs instead, and those rows as
    compact JSON arrays (what a non-pickled encoding of them would send)."""
    digest_s, payloads, plan_s, slots = [], [], [], []
    for r in sample:
        rows = lay.rows(r)
        _, t = timed(lambda: structure_digest(rows), reps=3)
        digest_s.append(t)
        payloads.append(len(pickle.dumps(rows)))
        plan, t = timed(lambda: grid_plan(rows, r, lay.ranks, regular_digest(rows, lay.ranks)), reps=3)
        plan_s.append(t)
        slots.append(plan.slot_count)
    rows = lay.rows(sample[0])
    compact = dump_json([[row.key, row.dtype, row.shape, row.offsets, row.sizes] for row in rows])
    return {"rows": len(rows), "digest_s": statistics.median(digest_s), "gather_payload": max(payloads),
            "json_rows_bytes": len(compact), "plan_s": max(plan_s), "replica_slots": max(slots)}


def records(lay: Layout, plans: list[Any], structures: list[list[Row]]) -> tuple[dict[int, dict[str, Any]], list[Chunk]]:
    """Each rank's ``done`` record as ``commit.record`` writes it (one data file per rank), and rank 0's chunks."""
    out, seq = {}, 0
    own: list[Chunk] = []
    step_key = lay.keys[("optim", "step")]
    for rank, rows in enumerate(structures):
        plan = plans[rank]
        mine = [r for r in rows if r.kind == "tensor" and plan.writes(rank, (r.key, r.offsets))]
        name = f"{GENERATION}-r{rank:05d}-000.safetensors"
        names = [lay.fqns[r.key] + ("" if r.sizes == r.shape else "@" + ",".join(map(str, r.offsets))) for r in mine]
        header, offsets = safetensors_header((FileItem(n, torch.float32, r.sizes, r.nbytes) for n, r in zip(names, mine)),
                                             {"format": "zerostall", "generation": GENERATION})
        chunks = []
        for r, off in zip(mine, offsets):
            blocks = max(1, -(-r.nbytes // DEFAULT_BLOCK_SIZE))
            chunks.append(Chunk(r.offsets, r.sizes, name, off, r.nbytes,
                                [f"{(seq + b) * 0x9E3779B97F4A7C15 % 2 ** 64:016x}" for b in range(blocks)]))
            seq += blocks
        files, headers = {name: len(header) + sum(r.nbytes for r in mine)}, {name: f"{seq:016x}"}
        if rank == 0:
            own = chunks
            out[0] = {"files": files, "headers": headers, "rows": mine}
            continue
        out[rank] = {"rank": rank, "files": files, "headers": headers,
                     "chunks": [[r.key, c.to_array({name: 0})] for r, c in zip(mine, chunks)],
                     "objects": [[step_key, codec.encode(7)]] if plan.writes(rank, (step_key, ())) else [],
                     "shards": [], "rank_local": []}
    return out, own


def manifest_stage(lay: Layout, plans: list[Any], structures: list[list[Row]], res: dict[str, Any]) -> Any:
    """Records, ``assemble``, ``to_bytes`` and ``parse_manifest``: what the coordinator and every loader do."""
    recs, own = records(lay, plans, structures)
    plan = plans[0]
    mine = recs.pop(0)
    t0 = time.process_time()
    raw_records = {r: dump_json(rec) for r, rec in recs.items()}
    others = {r: load_json(b) for r, b in raw_records.items()}
    res["records_roundtrip_s"] = time.process_time() - t0
    sizes = [len(b) for b in raw_records.values()] or [0]
    res["record_bytes_max"], res["record_bytes_total"] = max(sizes), sum(sizes)
    del raw_records
    collected = Collected(rows=structures[0], keys=lay.keys, refs=lay.flat.refs, skeleton=lay.flat.skeleton)
    for path, key, shape, _ in lay.leaves:
        if path != ("optim", "step"):
            collected.entries[key] = Entry(fqn(path), path, "tensor", dtype="float32", shape=shape)
    collected.objects[lay.keys[("optim", "step")]] = codec.encode(7)
    for row, chunk in zip(mine["rows"], own):
        collected.entries[row.key].chunks.append(chunk)
    manifest, res["assemble_s"] = timed(functools.partial(  # once: it adds the chunks to rank 0's entries
        assemble, collected, plan, mine["files"], mine["headers"], others, GENERATION, lay.ranks, 100,
        codec.encode({}), DEFAULT_BLOCK_SIZE, {}))
    del others
    raw, res["to_bytes_s"] = timed(manifest.to_bytes)
    del manifest
    res["manifest_bytes"], res["over_reader_limit"] = len(raw), len(raw) > max_manifest_bytes()
    parsed, res["parse_s"] = timed(lambda: parse_manifest(raw, "synthetic/manifest.json"))
    res["load_broadcast"] = {"send_root": 8 + len(raw) + 1, "recv": 8 + len(raw) + 1}  # agree(): b"V" + manifest
    return parsed


class _Remote:
    """A storage stand-in for routing only: remote (no file sizes looked up), nothing read."""
    remote, location, read_grid, requests_in_flight = True, "synthetic", 0, 1


def load_stage(lay: Layout, manifest: Any, after: int, sample: list[int], res: dict[str, Any]) -> None:
    """A load on ``after`` ranks: key matching (one rank, its targets whole), then routing of each
    sampled rank's boxes over the chunks of every entry it loads."""
    planner = LoadPlanner(manifest, "synthetic", 0, after, LoadOptions())
    target = {"model": {n: torch.empty(1).expand(s) for n, s, _ in lay.specs},
              "optim": {"state": {n: {"exp_avg": torch.empty(1).expand(s), "exp_avg_sq": torch.empty(1).expand(s)}
                                  for n, s, _ in lay.specs}, "step": 0}}
    (_, plan), res["match_s"] = timed(lambda: planner.plan(target))
    by_key = {lay.keys[entry.path]: entry for entry in manifest.entries}
    fetcher = Fetcher(_Remote(), manifest, 1)  # type: ignore[arg-type]
    route_s, staged = [], []
    for r in sample:
        targets = []
        for path, key, shape, tp in lay.leaves:
            if path != ("optim", "step"):
                b = box(lay.layout, shape, tp, r, after)
                targets.append((torch.empty(1).expand(b[1]), b, by_key[key]))
        (_, stage), t = timed(lambda: fetcher._route(targets, set()))
        route_s.append(t)
        staged.append(len(stage))
    res.update(route_s=statistics.median(route_s), staged_reads=max(staged), matched=len(plan.used),
               used_mask_allreduce_bytes=8 * len(manifest.entries))


def dcp_plans(lay: Layout, structures: list[list[Row]]) -> list[DcpSavePlan]:
    """Each rank's local DCP save plan, as ``create_default_local_save_plan`` builds it from DTensors."""
    props = TensorProperties(dtype=torch.float32)
    sizes = {key: torch.Size(shape) for _, key, shape, _ in lay.leaves}
    names = {key: fqn(path) for path, key in lay.keys.items()}
    mappings = {fqn(path): path for path in lay.flat.leaves}
    plans = []
    for rank, rows in enumerate(structures):
        items = []
        for r in rows:
            if r.kind == "object":
                if rank == 0:
                    items.append(DcpWriteItem(index=MetadataIndex(names[r.key]), type=WriteItemType.BYTE_IO))
                continue
            offsets = torch.Size(r.offsets)
            items.append(DcpWriteItem(index=MetadataIndex(names[r.key], offsets), type=WriteItemType.SHARD,
                                      tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, torch.Size(r.sizes)),
                                                                  props, sizes[r.key])))
        plans.append(DcpSavePlan(items, planner_data=mappings))
    return plans


def dcp_global_plan(plans: list[DcpSavePlan]) -> tuple[list[DcpSavePlan], Any]:
    """What DCP's coordinator computes from the gathered local plans (a fresh planner: no plan cache)."""
    return DefaultSavePlanner().create_global_plan(plans)


def dcp_stage(lay: Layout, structures: list[list[Row]], sample: list[int], reps: int, res: dict[str, Any],
              timeout: float) -> None:
    """DCP's global save plan, its pickled plans and metadata (with ``storage_data``) and its unpickling
    (collection on, as DCP runs; the global plan and the metadata each under ``timeout``)."""
    plans = dcp_plans(lay, structures)
    res["local_plan_bytes"] = max(len(pickle.dumps(plans[r])) for r in sample)
    deadline(timeout)
    (global_plan, metadata), res["global_plan_s"] = timed(functools.partial(dcp_global_plan, plans), reps=reps)
    deadline(timeout)
    res["global_plan_bytes"] = max(len(pickle.dumps(global_plan[r])) for r in sample)
    storage, results = {}, []
    for rank, plan in enumerate(global_plan):
        offset, mine = 0, []
        for item in plan.items:
            length = item.tensor_storage_size() or 8
            info = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            storage[item.index] = info
            mine.append(WriteResult(item.index, length, info))
            offset += length
        if rank in sample:
            results.append(len(pickle.dumps(mine)))
    metadata.storage_data = storage
    raw = pickle.dumps(metadata)
    res["write_results_bytes"], res["metadata_bytes"] = max(results), len(raw)
    del plans, global_plan, metadata, storage
    gc.collect()  # a loading process holds no plans: its collections walk only what unpickling builds
    _, res["metadata_unpickle_s"] = timed(lambda: pickle.loads(raw))
    n = lay.ranks
    res["traffic"] = {  # gather_object (sizes all-gathered) + scatter of global plans + metadata broadcast
        "send": 2 * 8 + res["local_plan_bytes"] + res["write_results_bytes"],
        "recv": 2 * 8 * n + res["global_plan_bytes"] + 8 + len(raw),
        "coordinator_recv": 2 * 8 * n + n * (res["local_plan_bytes"] + res["write_results_bytes"])}


def global_stages(layout: str, specs: list[Spec], n: int, after: int, sample: list[int], args: argparse.Namespace,
                  res: dict[str, Any]) -> None:
    """The stages that need every rank's rows, each under --timeout (a timeout ends the rest)."""
    lay = Layout(layout, specs, n)
    zs, dcp = res.setdefault("zerostall", {}), res.setdefault("dcp", {})
    stage = "rows"
    try:
        deadline(args.timeout)
        with gc_paused():  # zerostall plans, assembles and parses with collection paused, as its save and load do
            structures = [lay.rows(r) for r in range(n)]
            stage = "plans"
            plans = [grid_plan(rows, r, n, 0) for r, rows in enumerate(structures)]
            zs["entries"] = len(plans[0].entries)
            stage = "rows_plan"
            digests = [structure_digest(structures[r]) if r in sample else r for r in range(n)]
            _, zs["rows_plan_s"] = timed(lambda: build_plan(structures, digests), reps=args.reps)
            stage = "manifest"
            deadline(args.timeout)
            manifest = manifest_stage(lay, plans, structures, zs)
            stage = "load"
            deadline(args.timeout)
            load_stage(lay, manifest, after, sample_ranks(after, len(sample)), zs.setdefault("load", {}))
            del manifest, plans
        gc.collect()
        gc.freeze()  # the rows are the bench's, not DCP's: its collections walk only what DCP holds
        stage = "dcp"
        deadline(args.timeout)
        dcp_stage(lay, structures, sample, args.reps, dcp, args.timeout)
    except StageTimeout as exc:
        res.setdefault("timeouts", []).append(f"{stage}: {exc}")
    finally:
        deadline(0)
        gc.unfreeze()


def run_layout(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    specs = transformer(args.params)
    n, after = args.ranks, args.ranks_after
    sample = sample_ranks(n, args.sample)
    lay = Layout(layout, specs, n)
    res: dict[str, Any] = {"layout": layout, "ranks": n, "ranks_after": after, "params": len(specs)}
    zs = res["zerostall"] = per_rank(lay, sample)
    rows = zs["rows"]
    fit = n
    while fit * rows > args.max_rows and fit > 8:
        fit //= 2
    if fit != n:
        res["scaled_from"] = fit
        progress(f"{layout}: {n} x {rows} rows over --max-rows: global stages run at {fit} ranks, scaled by {n // fit}")
    after_fit = max(after * fit // n // TP * TP, TP) if layout != "fsdp" else max(after * fit // n, 1)
    global_stages(layout, specs, fit, after_fit, sample_ranks(fit, args.sample), args, res)
    zs["chunks"] = distinct_chunks(lay)
    if fit != n:  # work over every rank's rows grows with N x rows, the rest with the chunks
        by_rows, by_chunks = n / fit, zs["chunks"] / distinct_chunks(Layout(layout, specs, fit))
        for part, fields, factor in (("zerostall", ("rows_plan_s",), by_rows), ("dcp", ("global_plan_s",), by_rows),
                                     ("zerostall", ("assemble_s", "to_bytes_s", "manifest_bytes", "parse_s",
                                                    "record_bytes_total", "records_roundtrip_s"), by_chunks),
                                     ("dcp", ("metadata_bytes", "metadata_unpickle_s"), by_chunks)):
            for f in fields:
                if f in res[part]:
                    res[part][f] = res[part][f] * factor
        load = res["zerostall"].get("load", {})
        if "route_s" in load:  # each rank routes its boxes over every chunk of the entries it loads
            load["route_s"] *= by_chunks
        if "manifest_bytes" in res["zerostall"]:
            size = int(res["zerostall"]["manifest_bytes"])
            res["zerostall"]["over_reader_limit"] = size > max_manifest_bytes()
            res["zerostall"]["load_broadcast"] = {"send_root": 9 + size, "recv": 9 + size}
    zs = res["zerostall"]
    gather = gathered(zs["gather_payload"], n)
    # the planning all-reduce (11 int64) and the replica check's (two int64 a replicated box), as a ring
    # all-reduce moves them: about twice the vector, sent and received by every rank
    lanes = 2 * 8 * (11 + 2 * zs["replica_slots"])
    zs["traffic"] = {"send": lanes, "recv": lanes}
    zs["rows_gather_traffic"] = {"send": gather["send"], "recv": gather["recv"]}  # what an irregular layout adds
    if "dcp" in res and "traffic" in res["dcp"] and fit != n:
        t = res["dcp"]["traffic"]
        t["recv"] = 2 * 8 * n + res["dcp"]["global_plan_bytes"] + 8 + res["dcp"]["metadata_bytes"]
        t["coordinator_recv"] = 2 * 8 * n + n * (res["dcp"]["local_plan_bytes"] + res["dcp"]["write_results_bytes"])
    return res


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def show(res: dict[str, Any]) -> None:
    zs, dcp = res["zerostall"], res.get("dcp", {})
    mb = 1 / 1e6
    scaled = f" (global stages scaled from {res['scaled_from']} ranks)" if "scaled_from" in res else ""
    print(f"== {res['layout']}: {res['ranks']} ranks x {res['params']} params, load on {res['ranks_after']}{scaled}")
    print(f"  zerostall: {zs['rows']} rows/rank, digest {zs['digest_s'] * 1e3:.1f} ms/rank, gather payload "
          f"{zs['gather_payload'] * mb:.2f} MB/rank (as JSON rows {zs['json_rows_bytes'] * mb:.2f} MB)")
    print(f"  zerostall: plan {zs['plan_s'] * 1e3:.1f} ms/rank (each rank alone)")
    if "rows_plan_s" in zs:
        print(f"  zerostall: build_plan from gathered rows (irregular layouts) {zs['rows_plan_s']:.2f} s over "
              f"{zs['chunks']:.0f} chunks")
    if "manifest_bytes" in zs:
        print(f"  zerostall: manifest {zs['manifest_bytes'] * mb:.1f} MB (assemble {zs['assemble_s']:.2f} s, "
              f"to_bytes {zs['to_bytes_s']:.2f} s, parse {zs['parse_s']:.2f} s), records "
              f"{zs['record_bytes_total'] * mb:.1f} MB in all")
    if "route_s" in zs.get("load", {}):
        ld = zs["load"]
        print(f"  zerostall load: match {ld['match_s']:.2f} s, routing {ld['route_s']:.2f} s/rank")
    t = zs["traffic"]
    print(f"  zerostall traffic/rank: send {t['send'] * mb:.2f} MB, recv {t['recv'] * mb:.1f} MB")
    if "global_plan_s" in dcp:
        print(f"  dcp: create_global_plan {dcp['global_plan_s']:.2f} s, local plan {dcp['local_plan_bytes'] * mb:.2f} MB")
    if "traffic" in dcp:
        t = dcp["traffic"]
        print(f"  dcp: metadata {dcp['metadata_bytes'] * mb:.1f} MB (unpickle {dcp['metadata_unpickle_s']:.2f} s)")
        print(f"  dcp traffic/rank: send {t['send'] * mb:.2f} MB, recv {t['recv'] * mb:.1f} MB, "
              f"coordinator recv {t['coordinator_recv'] * mb:.1f} MB")
    for line in res.get("timeouts", []):
        print(f"  timeout: {line}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, required=True, help="simulated ranks N (a multiple of 8 for fsdp_tp, hsdp)")
    parser.add_argument("--ranks-after", type=int, default=0, help="ranks N' of the load (default N/2)")
    parser.add_argument("--params", type=int, default=2000, help="parameters P (2000)")
    parser.add_argument("--layout", choices=["fsdp", "fsdp_tp", "hsdp", "all"], default="all")
    parser.add_argument("--max-rows", type=int, default=4_000_000,
                        help="most rows (N x rows per rank) held at once; above, global stages are scaled (4e6)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a global stage may run (120)")
    parser.add_argument("--sample", type=int, default=4, help="ranks sampled for per-rank figures (4)")
    parser.add_argument("--reps", type=int, default=3, help="reps of the timed global plans (3; fewer past 20 s)")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    args = parser.parse_args(argv)
    layouts = ["fsdp", "fsdp_tp", "hsdp"] if args.layout == "all" else [args.layout]
    args.ranks_after = args.ranks_after or max(args.ranks // 2, 1)
    if any(lay != "fsdp" for lay in layouts) and any(n < TP or n % TP for n in (args.ranks, args.ranks_after)):
        parser.error(f"--ranks and --ranks-after must be multiples of {TP} for fsdp_tp and hsdp")
    args.layouts = layouts
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = {}
    for layout in args.layouts:
        results[layout] = run_layout(layout, args)
        results[layout]["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # so far, any layout
        show(results[layout])
        gc.collect()
    if args.json:
        print(json.dumps({"results": results, "ranks": args.ranks, "params": args.params, "max_rows": args.max_rows,
                          "timeout_s": args.timeout, "torch_version": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
