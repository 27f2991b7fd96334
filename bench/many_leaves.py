"""Many small tensors in one process: zerostall's per-tensor costs against PyTorch DCP's, in one run (issue 31).

    python bench/many_leaves.py [--tensors 20000 100000] [--reps 3] [--dcp-large-reps 1] [--dir /dev/shm]
                                [--profile] [--json]

For each count N in --tensors, two states of N fp32 CPU tensors in all, sizes drawn log-uniform
between 16 and 4,096 elements (fixed seed) plus a few large ones (LARGE of 2**20 elements):

- "moe": an optimizer state dict as ``Optimizer.state_dict()`` nests it, N/3 parameters:
  ``{"state": {i: {"exp_avg", "exp_avg_sq", "step"}}, "param_groups": [...]}`` (``step`` a 0-d tensor);
- "nested": ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)`` of a model of
  N/4 parameters of those sizes after one AdamW step, as ``{"model": ..., "optim": ...}``: FQN-keyed
  nested dicts, N tensors (parameters, exp_avg, exp_avg_sq, step).

Per state, zerostall and DCP (one process, no process group; same state, same directory) each do,
in every rep (interleaved, the order rotated from rep to rep; figures are medians):

- async: an asynchronous save of the unchanged structure after a first, untimed one (zerostall's
  ``AsyncSaver().save``; DCP's ``async_save`` in its default thread mode): the time until the call
  returns (the stall), until staged (DCP: staged inside the call), until committed. DCP's default
  planner keeps nothing between calls (its plan caching is off), so its untimed first call is made
  once per process, on the first state; zerostall's once per state;
- save: a synchronous save (``zs.save``; ``dcp.save``), to a fresh path;
- open: ``with zs.open(path)`` entered and closed; DCP: ``FileSystemReader(path).read_metadata()``;
- read: one tensor (a middle ``exp_avg``): ``ck.read(key)`` in an open session (``read_s``) and
  with the open included (``open_read_s``); DCP: ``dcp.load`` of a one-key state dict (which reads
  the metadata itself, so it compares with ``open_read_s``);
- load: ``zs.load`` / ``dcp.load`` in place into a zeroed target of the same structure, checked
  equal to the state afterwards (outside the timing), as the read tensor is.

DCP at 100,000 tensors takes minutes per rep: at counts above 20,000 it runs --dcp-large-reps reps
(default 1), zerostall --reps. Once per state, outside the timed reps, bookkeeping memory: with
tracemalloc (Python allocations only; tensor data is not traced) and ``gc.get_objects()``, the bytes,
gc-tracked objects and allocated blocks (``sys.getallocatedblocks``) an open zerostall session holds,
against DCP's metadata object; what an ``AsyncSaver`` keeps between saves of the state, and the
peak its second ``save()`` call allocates; each divided by N. Then "same bytes in 100 tensors":
sync save and load of a flat state of 100 fp32 tensors holding the same bytes, both libraries, the
same reps. Then the floors of per-tensor work, for the state and for those 100 tensors: walking it
in plain Python for each tensor's key path, dtype and shape (``describe_s``, the least any manifest
records), and torch's own batched copies of every tensor into one buffer and back (``pack_s``,
``unpack_s``: one ``flatten_dense_tensors`` call, one ``unflatten_dense_tensors`` and
``_foreach_copy_``), which say what per-tensor work costs below any design. --profile: cProfile of one more zerostall async ``save()`` call per state, top functions
to stderr and the JSON.

Acceptance (issue 31): async ``save()`` returns within 30 ms at 20,000 tensors and 150 ms at
100,000; opening 100,000 entries within 100 ms; sync save and load of 100,000 tensors each within
3x the 100-tensor time; every figure at least 5x better than DCP's (zerostall/DCP <= 0.2). Each is
reported met or not (``acceptance`` in the JSON) for the counts it names. Progress goes to stderr;
tables to stdout; with --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import math
import os
import pstats
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

import zerostall as zs
from common import (Futures, build_state, dcp_default_start, describe, median, print_json, progress, remove, rnd,
                    rotated, time_save, zerostall_start)

SMALL = (16, 4096)  # elements of the small tensors, drawn log-uniform
LARGE = 4  # parameters with LARGE_NUMEL elements each (the rest small)
LARGE_NUMEL = 1 << 20
BASE_TENSORS = 100  # the "same bytes in few tensors" baseline
EXPERTS_PER_LIST = 64  # parameters per ParameterList of the nested state's model: FQNs "layers.L.E"
STALL_TARGET = {20_000: 0.030, 100_000: 0.150}  # issue 31: async save() blocks at most this long
OPEN_TARGET = {100_000: 0.100}
FEW_TENSORS_FACTOR = {100_000: 3.0}  # sync save and load at most this times the 100-tensor time
DCP_FACTOR = 5.0  # every figure at least this much better than DCP's
FIGURES = ("stall_s", "staged_s", "committed_s", "save_s", "open_s", "read_s", "open_read_s", "load_s")
# zerostall's figure -> DCP's figure it is compared with (DCP's one-key load reads its metadata itself)
AGAINST = {"stall_s": "stall_s", "staged_s": "staged_s", "committed_s": "committed_s", "save_s": "save_s",
           "open_s": "open_s", "open_read_s": "read_s", "load_s": "load_s",
           "open_bytes_per_tensor": "open_bytes_per_tensor", "open_objects_per_tensor": "open_objects_per_tensor",
           "open_blocks_per_tensor": "open_blocks_per_tensor"}


# --- the states -----------------------------------------------------------------------------


def sizes(n: int, seed: int) -> list[int]:
    """n tensor sizes: log-uniform in SMALL, LARGE of them (evenly spread) LARGE_NUMEL."""
    rng = random.Random(seed)
    lo, hi = math.log(SMALL[0]), math.log(SMALL[1])
    out = [int(math.exp(rng.uniform(lo, hi))) for _ in range(n)]
    for k in range(min(LARGE, n)):
        out[k * n // min(LARGE, n)] = LARGE_NUMEL
    return out


def moe_state(n: int, seed: int = 0) -> dict[str, Any]:
    """An optimizer state dict of n tensors in all: n/3 parameters, each exp_avg, exp_avg_sq and a 0-d step."""
    gen = torch.Generator().manual_seed(seed)
    params = n // 3
    state = {i: {"exp_avg": torch.randn(s, generator=gen), "exp_avg_sq": torch.rand(s, generator=gen),
                 "step": torch.tensor(3.0)} for i, s in enumerate(sizes(params, seed))}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "params": list(range(params))}]
    return {"state": state, "param_groups": groups}


def nested_state(n: int, seed: int = 0) -> dict[str, Any]:
    """get_state_dict(model, optim) of n/4 parameters after one AdamW step: n tensors in FQN-keyed nested dicts."""
    gen = torch.Generator().manual_seed(seed)
    drawn = sizes(n // 4, seed)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen)) for s in drawn[i:i + EXPERTS_PER_LIST])
        for i in range(0, len(drawn), EXPERTS_PER_LIST))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optim.step()
    optim.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


STATES: dict[str, Callable[[int], dict[str, Any]]] = {"moe": moe_state, "nested": nested_state}


def read_key(kind: str, state: dict[str, Any]) -> tuple[Any, ...]:
    """The key path of the tensor read alone: the exp_avg of the middle parameter."""
    prefix = ("state",) if kind == "moe" else ("optim", "state")
    keys = list(at(state, prefix))
    return (*prefix, keys[len(keys) // 2], "exp_avg")


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of a nesting of dicts, lists and tuples, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []


def zeros_like_tree(tree: Any) -> Any:
    """A target of the same structure: every tensor a fresh zeroed one, other values kept."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [zeros_like_tree(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(zeros_like_tree(v) for v in tree)
    return tree


def at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The value at a key path."""
    for part in path:
        tree = tree[part]
    return tree


def nest(path: tuple[Any, ...], value: Any) -> dict[Any, Any]:
    """A one-key nested dict holding value at path (what DCP's load takes to read one tensor)."""
    for part in reversed(path):
        value = {part: value}
    return value


def check_equal(name: str, state: Any, target: Any) -> None:
    """The target holds the state's values (its tensors in order)."""
    ours, theirs = tensors(state), tensors(target)
    bad = sum(1 for a, b in zip(ours, theirs) if not torch.equal(a, b)) + abs(len(ours) - len(theirs))
    if bad:
        raise AssertionError(f"{name} loaded wrong data into {bad} of {len(ours)} tensors")


# --- the contenders -------------------------------------------------------------------------


@dataclass
class Contender:
    """One library: an asynchronous save's futures, and timed save, open, read and load."""

    name: str
    per_structure: bool  # keeps state per structure between async saves: its untimed first save is made per state
    start: Callable[[Any, str], Futures]
    save: Callable[[Any, str], None]
    open: Callable[[str], None]
    read: Callable[[str, tuple[Any, ...], torch.Tensor], tuple[torch.Tensor, float, float]]  # tensor, read_s, total
    load: Callable[[Any, str], None]


def zs_open(path: str) -> None:
    with zs.open(path):
        pass


def zs_read(path: str, key: tuple[Any, ...], like: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    start = time.perf_counter()
    with zs.open(path) as ck:
        begun = time.perf_counter()
        tensor = ck.read(key)
        read_s = time.perf_counter() - begun
    return tensor, read_s, time.perf_counter() - start


def dcp_save(state: Any, path: str) -> None:
    dcp.save(state, checkpoint_id=path)


def dcp_open(path: str) -> None:
    FileSystemReader(path).read_metadata()


def dcp_read(path: str, key: tuple[Any, ...], like: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    target = torch.zeros_like(like)
    start = time.perf_counter()
    dcp.load(nest(key, target), checkpoint_id=path)
    took = time.perf_counter() - start
    return target, took, took


def dcp_load(target: Any, path: str) -> None:
    dcp.load(target, checkpoint_id=path)


def contenders(saver: zs.AsyncSaver) -> list[Contender]:
    return [Contender("zerostall", True, zerostall_start(saver), lambda s, p: zs.save(s, p), zs_open, zs_read,
                      lambda t, p: zs.load(t, p)),
            Contender("dcp", False, dcp_default_start, dcp_save, dcp_open, dcp_read, dcp_load)]


def timed(fn: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def one_rep(c: Contender, state: Any, target: Any, key: tuple[Any, ...], path: str, keep: bool) -> dict[str, float]:
    """Every figure of one rep: an async save (to path-async), a sync save (path), open, read and load of it; the
    saved checkpoint is deleted unless ``keep``."""
    out: dict[str, float] = {}
    gc.collect()
    timing = time_save(lambda: c.start(state, path + "-async"))
    remove(path + "-async")
    out.update(stall_s=timing.stall_s, staged_s=timing.staged_s, committed_s=timing.committed_s)
    gc.collect()
    out["save_s"] = timed(c.save, state, path)
    gc.collect()
    out["open_s"] = timed(c.open, path)
    like = at(state, key)
    tensor, out["read_s"], out["open_read_s"] = c.read(path, key, like)
    if not torch.equal(tensor, like):
        raise AssertionError(f"{c.name} read {key} wrong")
    del tensor
    torch._foreach_zero_(tensors(target))
    gc.collect()
    out["load_s"] = timed(c.load, target, path)
    check_equal(c.name, state, target)
    if not keep:
        remove(path)
    gc.collect()
    return out


# --- bookkeeping memory ---------------------------------------------------------------------


def held(make: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """What make() returns, and the Python bytes (tracemalloc), gc-tracked objects and allocated blocks it added."""
    gc.collect()
    tracemalloc.start()
    try:
        before = (tracemalloc.get_traced_memory()[0], len(gc.get_objects()), sys.getallocatedblocks())
        kept = make()
        gc.collect()
        after = (tracemalloc.get_traced_memory()[0], len(gc.get_objects()), sys.getallocatedblocks())
    finally:
        tracemalloc.stop()
    return kept, {"bytes": after[0] - before[0], "objects": after[1] - before[1], "blocks": after[2] - before[2]}


def per_tensor(prefix: str, counts: dict[str, int], n: int) -> dict[str, float]:
    return {f"{prefix}_{what}_per_tensor": round(v / n, 2) for what, v in counts.items()}


def open_bookkeeping(paths: dict[str, str], n: int) -> dict[str, dict[str, float]]:
    """Per tensor: what an open zerostall session holds; what DCP's metadata holds (of the checkpoints at paths)."""
    ck, ours = held(lambda: zs.open(paths["zerostall"]).__enter__())
    ck.close()
    metadata, theirs = held(lambda: FileSystemReader(paths["dcp"]).read_metadata())
    del metadata
    return {"zerostall": per_tensor("open", ours, n), "dcp": per_tensor("open", theirs, n)}


def saver_bookkeeping(state: Any, root: str, n: int) -> dict[str, float]:
    """Per tensor: what an AsyncSaver keeps between saves of state, and the peak its second save() call allocates."""
    path = os.path.join(root, "mem-saver")

    def first() -> zs.AsyncSaver:
        saver = zs.AsyncSaver()
        saver.save(state, path).result()
        return saver

    saver, kept = held(first)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        handle = saver.save(state, path, overwrite=True)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    handle.result()
    saver.close()
    remove(path)
    return {**per_tensor("saver_kept", kept, n), "second_save_call_peak_bytes_per_tensor": round(peak / n, 2)}


def profile_save(saver: zs.AsyncSaver, state: Any, path: str, top: int = 12) -> dict[str, Any]:
    """cProfile of one async save() call of the unchanged structure: its top functions by own and by cumulative time,
    each as [function, calls, own s, cumulative s, share of the call's time under the profiler]."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    handle = saver.save(state, path, overwrite=True)
    profiler.disable()
    total = time.perf_counter() - start
    handle.result()
    remove(path)
    stats = pstats.Stats(profiler)
    out: dict[str, Any] = {"profiled_s": round(total, 4)}
    for order, field in (("by_own", 2), ("by_cumulative", 3)):
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][field], reverse=True)[:top]
        out[order] = [[f"{os.path.basename(file)}:{line}:{func}", calls, round(own, 4), round(cum, 4),
                       round((own, cum)[field - 2] / total, 3)] for (file, line, func), (_, calls, own, cum, _) in rows]
        progress(f"profile of one save() call ({total:.3f} s under cProfile), {order}: "
                 "own s, cumulative s, share, calls")
        for name, calls, own, cum, share in out[order]:
            progress(f"  {own:8.4f} {cum:8.4f} {100 * share:5.1f}% {calls:8d}  {name}")
    return out


# --- one state ------------------------------------------------------------------------------


def few_tensors(nbytes: int, root: str, reps: int) -> dict[str, dict[str, float]]:
    """Sync save and load of BASE_TENSORS fp32 tensors holding nbytes, both libraries, medians of reps."""
    state = build_state(nbytes, n=BASE_TENSORS, dtypes=(torch.float32,))
    target = zeros_like_tree(state)
    funcs = {"zerostall": (lambda s, p: zs.save(s, p), lambda t, p: zs.load(t, p)), "dcp": (dcp_save, dcp_load)}
    seconds: dict[str, dict[str, list[float]]] = {name: {"save_s": [], "load_s": []} for name in funcs}
    for rep in range(reps + 1):  # rep 0 warms up
        for name in rotated(list(funcs), rep):
            save, load = funcs[name]
            path = os.path.join(root, f"few-{name}-{rep}")
            save_s = timed(save, state, path)
            torch._foreach_zero_(tensors(target))
            load_s = timed(load, target, path)
            check_equal(name, state, target)
            remove(path)
            if rep:
                seconds[name]["save_s"].append(save_s)
                seconds[name]["load_s"].append(load_s)
    return {name: {k: rnd(median(v)) for k, v in s.items()} for name, s in seconds.items()}


def describe_tensors(tree: Any, path: tuple[Any, ...], out: list[tuple[Any, ...]]) -> None:
    """Each tensor's key path, dtype and shape: the least any manifest records of it, walked in plain Python."""
    if isinstance(tree, torch.Tensor):
        out.append((path, tree.dtype, tuple(tree.shape)))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            describe_tensors(v, (*path, k), out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            describe_tensors(v, (*path, i), out)


def floors(state: Any, nbytes: int, reps: int) -> dict[str, dict[str, float]]:
    """What per-tensor work costs at its least, for this state and for the same bytes in BASE_TENSORS
    tensors: ``describe_s`` (:func:`describe_tensors`, CPython's share of any save or load), ``pack_s`` (every
    tensor copied into one buffer by one call into torch, ``flatten_dense_tensors``, per dtype) and
    ``unpack_s`` (copied back out: ``unflatten_dense_tensors`` and one ``_foreach_copy_``). Medians of reps."""
    few = build_state(nbytes, n=BASE_TENSORS, dtypes=(torch.float32,))
    out = {}
    for name, tree in (("state", state), (f"{BASE_TENSORS}_tensors", few)):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors(tree):
            by_dtype.setdefault(t.dtype, []).append(t)
        groups = list(by_dtype.values())
        packed = [torch._C._nn.flatten_dense_tensors(ts) for ts in groups]

        def unpack() -> None:
            for flat, ts in zip(packed, groups):
                torch._foreach_copy_(ts, torch._C._nn.unflatten_dense_tensors(flat, ts))

        figures: dict[str, list[float]] = {"describe_s": [], "pack_s": [], "unpack_s": []}
        for _ in range(reps):
            figures["describe_s"].append(timed(describe_tensors, tree, (), []))
            figures["pack_s"].append(timed(lambda: [torch._C._nn.flatten_dense_tensors(ts) for ts in groups]))
            figures["unpack_s"].append(timed(unpack))
        out[name] = {f: rnd(median(v)) for f, v in figures.items()}
    return out


def run_state(kind: str, n: int, args: argparse.Namespace, root: str, errors: dict[str, str],
              warmed: set[str]) -> dict[str, Any]:
    """Every figure of one state: timed reps of both contenders, bookkeeping memory, the 100-tensor baseline;
    ``warmed`` names the contenders whose first async save in this process is done."""
    progress(f"{kind} {n}: building")
    state = STATES[kind](n)
    target = zeros_like_tree(state)
    ts = tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    key = read_key(kind, state)
    saver = zs.AsyncSaver()
    cs = contenders(saver)
    reps = {"zerostall": args.reps, "dcp": args.reps if n <= 20_000 else min(args.reps, args.dcp_large_reps)}
    seconds: dict[str, dict[str, list[float]]] = {c.name: {f: [] for f in FIGURES} for c in cs}
    paths = {c.name: os.path.join(root, c.name) for c in cs}  # the last rep's checkpoint stays for bookkeeping
    live = []
    for c in cs:
        if c.name in warmed and not c.per_structure:
            live.append(c)
            continue
        progress(f"{kind} {n}: {c.name} first async save (untimed)")
        try:
            c.start(state, os.path.join(root, f"{c.name}-first"))[1].result()
            live.append(c)
            warmed.add(c.name)
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
            errors[f"{kind}_{n}_{c.name}"] = describe(exc)
        remove(os.path.join(root, f"{c.name}-first"))
    for rep in range(1, args.reps + 1):
        for c in rotated(list(live), rep - 1):
            if rep > reps[c.name]:
                continue
            try:
                figures = one_rep(c, state, target, key, paths[c.name], keep=rep == reps[c.name])
            except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
                errors[f"{kind}_{n}_{c.name}"] = f"rep {rep}: {describe(exc)}"
                live.remove(c)
                continue
            for f, v in figures.items():
                seconds[c.name][f].append(v)
            progress(f"{kind} {n} rep {rep} {c.name:9s} " + "  ".join(f"{f[:-2]} {v:.4f}" for f, v in figures.items()))
    out: dict[str, Any] = {"n_tensors": len(ts), "state_bytes": nbytes, "reps": reps}
    for c in cs:
        failed = f"{kind}_{n}_{c.name}" in errors
        out[c.name] = {f: None if failed else rnd(median(v)) for f, v in seconds[c.name].items()}
    if args.profile:
        out["profile"] = profile_save(saver, state, os.path.join(root, "profiled"))
    saver.close()
    del target
    progress(f"{kind} {n}: bookkeeping memory")
    try:
        for name, figures in open_bookkeeping(paths, len(ts)).items():
            out[name].update(figures)
        out["zerostall"].update(saver_bookkeeping(state, root, len(ts)))
    except Exception as exc:  # noqa: BLE001 - reported in errors
        errors[f"{kind}_{n}_bookkeeping"] = describe(exc)
    for path in paths.values():
        remove(path)
    progress(f"{kind} {n}: the same bytes in {BASE_TENSORS} tensors")
    try:
        out[f"same_bytes_{BASE_TENSORS}_tensors"] = few_tensors(nbytes, root, args.reps)
    except Exception as exc:  # noqa: BLE001 - reported in errors
        errors[f"{kind}_{n}_same_bytes"] = describe(exc)
    progress(f"{kind} {n}: the floors of per-tensor work")
    out["floors"] = floors(state, nbytes, args.reps)
    out["zerostall_over_dcp"] = {f: ratio(out["zerostall"].get(f), out["dcp"].get(g)) for f, g in AGAINST.items()}
    out["seconds"] = {name: {f: [round(v, 4) for v in s] for f, s in fs.items()} for name, fs in seconds.items()}
    return out


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else round(ours / theirs, 4)


# --- the acceptance targets and the report --------------------------------------------------


def check(name: str, value: float | None, limit: float) -> dict[str, Any]:
    return {"target": name, "value": value, "limit": limit, "met": value is not None and value <= limit}


def acceptance(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 31's targets, each with its value and whether it is met, for the counts this run measured."""
    out = []
    for label, r in results.items():
        n, ours = r["n"], r["zerostall"]
        if n in STALL_TARGET:
            out.append(check(f"{label}: async save() stall s", ours.get("stall_s"), STALL_TARGET[n]))
        if n in OPEN_TARGET:
            out.append(check(f"{label}: open s", ours.get("open_s"), OPEN_TARGET[n]))
        few = r.get(f"same_bytes_{BASE_TENSORS}_tensors", {}).get("zerostall", {})
        if n in FEW_TENSORS_FACTOR:
            for f in ("save_s", "load_s"):
                value = ratio(ours.get(f), few.get(f))
                out.append(check(f"{label}: {f[:-2]} / {BASE_TENSORS}-tensor {f[:-2]}", value, FEW_TENSORS_FACTOR[n]))
        for f, value in r["zerostall_over_dcp"].items():
            out.append(check(f"{label}: zerostall/DCP {f}", value, round(1 / DCP_FACTOR, 4)))
    return out


def print_tables(results: dict[str, dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    for label, r in results.items():
        print(f"\n{label}: {r['n_tensors']} tensors, {r['state_bytes'] / 1e6:.1f} MB, reps {r['reps']}")
        print(f"{'figure':36s} {'zerostall':>12s} {'dcp':>12s} {'zs/dcp':>8s}")
        for f in [*FIGURES, *(k for k in r["zerostall"] if k not in FIGURES)]:
            ours, theirs = r["zerostall"].get(f), r["dcp"].get(AGAINST.get(f, f))
            rat = r["zerostall_over_dcp"].get(f)
            print(f"{f:36s} {fmt(ours):>12s} {fmt(theirs):>12s} {fmt(rat):>8s}")
        few = r.get(f"same_bytes_{BASE_TENSORS}_tensors")
        if few:
            for name, figs in few.items():
                print(f"{f'{name} same bytes in {BASE_TENSORS} tensors':36s} save {fmt(figs['save_s'])} s"
                      f"  load {fmt(figs['load_s'])} s")
        for name, figs in r.get("floors", {}).items():
            print(f"{f'floor, {name}':36s} describe {fmt(figs['describe_s'])} s  pack {fmt(figs['pack_s'])} s"
                  f"  unpack {fmt(figs['unpack_s'])} s")
    print("\nacceptance (issue 31)")
    for t in targets:
        print(f"  {'met    ' if t['met'] else 'NOT met'} {t['target']}: {fmt(t['value'])} (limit {t['limit']})")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[20_000, 100_000],
                        help="tensor counts, one state of each kind per count (20000 100000)")
    parser.add_argument("--reps", type=int, default=3, help="timed reps per contender (3)")
    parser.add_argument("--dcp-large-reps", type=int, default=1,
                        help="DCP's reps at counts above 20,000 (1: a DCP rep at 100,000 tensors takes minutes)")
    parser.add_argument("--kinds", nargs="+", choices=list(STATES), default=list(STATES), help="states (moe nested)")
    parser.add_argument("--dir", default="/dev/shm", help="where to save (a fresh dir under it)")
    parser.add_argument("--profile", action="store_true", help="cProfile one more zerostall async save() per state")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    warnings.filterwarnings("ignore", message=".*process group.*")
    root = tempfile.mkdtemp(prefix="zerostall-bench-leaves-", dir=args.dir)
    errors: dict[str, str] = {}
    results: dict[str, dict[str, Any]] = {}
    warmed: set[str] = set()
    try:
        for n in args.tensors:
            for kind in args.kinds:
                results[f"{kind}_{n}"] = {"kind": kind, "n": n, **run_state(kind, n, args, root, errors, warmed)}
                gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    targets = acceptance(results)
    print_tables(results, targets)
    if args.json:
        print_json({
            "results": results,
            "acceptance": targets,
            "acceptance_met": all(t["met"] for t in targets),
            "reps": args.reps,
            "dcp_large_reps": args.dcp_large_reps,
            "dir": args.dir,
            "torch_version": torch.__version__,
            "zerostall_version": getattr(zs, "__version__", None),
            "errors": errors,
        })


if __name__ == "__main__":
    main()
