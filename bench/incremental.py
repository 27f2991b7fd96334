"""Incremental checkpoints against full ones on a LoRA-style fine-tuning state, in one run (issue 33).

    python bench/incremental.py [--base-gib 1.0] [--saves 10] [--old-step 3] [--load-reps 3] [--dir D] [--json]

The state: a frozen base of --base-gib GiB of fp32 weights (--layers layers of four bias-free
square Linear layers, ``requires_grad=False``), a rank-8 LoRA adapter (A, B) on each of them,
and a ``torch.optim.AdamW`` over the adapters alone; saved as ``{"model": model, "optim": optim}``.
Between two saves, --steps forward/backward/optimizer steps on random input change the adapters and
the optimizer state, never the base.

Two passes, each with two managers under the same fresh directory of --dir (default: the system's
temporary directory, so page cache and disk, fsync on: the default durability), every step kept:
``CheckpointManager(root, incremental=True)`` and ``CheckpointManager(root2, incremental=False)``,
the same state saved by both after the same steps, the order alternating from save to save.

- sync: per save, ``SaveInfo.bytes_written`` and the wall time of ``manager.save``. Then the
  newest step is restored (``manager.restore``) into a fresh model and optimizer (built on the meta
  device, then ``to_empty``: no initialization outside the timing), --load-reps timed reps after an
  untimed one, interleaved; then every step but --old-step and the newest is deleted
  (``CheckpointRoot.delete`` then ``collect_retained``, as retention does: the incremental root keeps
  the first save's base files behind a retained record) and --old-step is restored the same way.
  Every restore is checked equal (xxh3-64 of every tensor of the model and optimizer state dicts)
  to the state saved at that step, outside the timing. The sync roots are deleted after this.
- async: the same saves with ``async_save=True``: the time until ``manager.save`` returns (the
  stall) and until the save has committed.

Per figure: the first save (a full one for both) and the median of saves 2..N. Ratios: full over
incremental bytes and save time (target >= 10 from the second save on), incremental over full stall
(target <= 1) and load time (target <= 1.1, i.e. within 10%), each reported met or not. A table on
stdout, progress on stderr; with --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import xxhash
from common import describe, median, print_json, progress, remove, rnd, rotated, time_save
from torch import nn

import zerostall as zs

KINDS = ("incremental", "full")
LINEARS = 4  # square Linear layers per layer (q, k, v, o-like)
RANK = 8
BATCH = 8
TARGETS = {"bytes_x": 10.0, "save_x": 10.0, "stall_ratio": 1.0, "load_ratio": 1.1}


# --- the state ------------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen square Linear layer plus a trainable low-rank update B @ A."""

    def __init__(self, width: int, rank: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False, device=device)
        self.base.weight.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, width, device=device) / math.sqrt(width))
        self.B = nn.Parameter(torch.zeros(width, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


class Model(nn.Module):
    """``layers`` residual layers of LINEARS LoRA Linear layers each (scaled so activations stay bounded)."""

    def __init__(self, layers: int, width: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList(LoRALinear(width, RANK, device) for _ in range(LINEARS))
                                    for _ in range(layers))
        self.scale = 1.0 / math.sqrt(layers * LINEARS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            for linear in layer:
                x = x + self.scale * linear(x)
        return x


def optimizer(model: Model) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def width_for(base_bytes: float, layers: int) -> int:
    """The width whose layers * LINEARS fp32 square weights hold about base_bytes (at least 16)."""
    return max(16, round(math.sqrt(base_bytes / (4 * layers * LINEARS)) / 8) * 8)


def train(model: Model, optim: torch.optim.Optimizer, steps: int, width: int) -> None:
    """A few steps on random input: only the adapters and the optimizer state change."""
    for _ in range(steps):
        model(torch.randn(BATCH, width)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def fresh(layers: int, width: int) -> dict[str, Any]:
    """A model and optimizer to load into: allocated, not initialized; the optimizer without state."""
    model = Model(layers, width, device="meta").to_empty(device="cpu")
    return {"model": model, "optim": optimizer(model)}


def digest(state: dict[str, Any]) -> str:
    """xxh3-64 of every tensor of the model's and the optimizer's state dicts, in order."""
    h = xxhash.xxh3_64()
    optim_state = state["optim"].state_dict()["state"]
    tensors = list(state["model"].state_dict().items())
    tensors += [(f"{i}.{k}", v) for i in sorted(optim_state) for k, v in sorted(optim_state[i].items())]
    for name, t in tensors:
        t = t.detach().contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def du(path: str) -> int:
    """Bytes of the regular files under path."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


# --- the passes -----------------------------------------------------------------------------


def managers(tmp: str, pass_name: str, async_save: bool) -> dict[str, zs.CheckpointManager]:
    return {kind: zs.CheckpointManager(os.path.join(tmp, f"{pass_name}-{kind}"), incremental=kind == "incremental",
                                       async_save=async_save) for kind in KINDS}


def sync_pass(args: argparse.Namespace, tmp: str, width: int) -> dict[str, Any]:
    """Sync saves of both kinds, then the loads of the newest and of an old step after pruning."""
    torch.manual_seed(0)
    model = Model(args.layers, width)
    state = {"model": model, "optim": optimizer(model)}
    mgrs = managers(tmp, "sync", async_save=False)
    saves: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    digests: dict[int, str] = {}
    try:
        for step in range(1, args.saves + 1):
            train(model, state["optim"], args.steps, width)
            digests[step] = digest(state)
            for kind in rotated(list(KINDS), step):
                start = time.perf_counter()
                info = mgrs[kind].save(step, state)
                seconds = time.perf_counter() - start
                saves[kind].append({"bytes_written": info.bytes_written, "save_s": seconds})
                progress(f"sync save {step:2d} {kind:11s} {info.bytes_written / 2**20:9.2f} MiB  {seconds:7.3f} s")
        del model, state
        disk = {kind: du(m.root) for kind, m in mgrs.items()}
        newest = load_reps(mgrs, args, width, args.saves, digests[args.saves])
        tags = {record.step: tag for tag, record in mgrs["full"].checkpoints()}  # the same tags in both roots
        deleted = [s for s in range(1, args.saves) if s != args.old_step]
        prune_s = {}
        for kind, m in mgrs.items():
            start = time.perf_counter()
            for s in deleted:
                m.checkpoint_root.delete(tags[s])
            m.checkpoint_root.collect_retained()
            prune_s[kind] = rnd(time.perf_counter() - start)
        pruned_disk = {kind: du(m.root) for kind, m in mgrs.items()}
        old = load_reps(mgrs, args, width, args.old_step, digests[args.old_step])
    finally:
        for m in mgrs.values():
            m.close()
            remove(m.root)
    return {"saves": saves, "disk_bytes": disk, "newest": newest,
            "old": {**old, "deleted_steps": deleted, "prune_s": prune_s, "disk_bytes_after": pruned_disk}}


def load_reps(mgrs: dict[str, zs.CheckpointManager], args: argparse.Namespace, width: int, step: int,
              expected: str) -> dict[str, Any]:
    """Restore ``step`` into a fresh model and optimizer: an untimed rep, then --load-reps timed, interleaved."""
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    equal = {kind: True for kind in KINDS}
    for rep in range(args.load_reps + 1):
        for kind in rotated(list(KINDS), rep):
            target = fresh(args.layers, width)
            tag = next(t for t, record in mgrs[kind].checkpoints() if record.step == step)
            start = time.perf_counter()
            got = mgrs[kind].restore(target, tag, fallback=False)
            seconds = time.perf_counter() - start
            equal[kind] = equal[kind] and got == step and digest(target) == expected
            del target
            if rep:
                times[kind].append(seconds)
            progress(f"load step {step} {kind:11s} {seconds:7.3f} s{' (warm-up)' if rep == 0 else ''}")
    return {"step": step, **{f"{kind}_s": rnd(median(times[kind])) for kind in KINDS},
            "reps": {kind: [rnd(t) for t in ts] for kind, ts in times.items()}, "loads_equal": equal}


def async_pass(args: argparse.Namespace, tmp: str, width: int) -> dict[str, list[dict[str, float]]]:
    """The same saves with async_save=True: the stall and the time to committed of each."""
    torch.manual_seed(0)
    model = Model(args.layers, width)
    state = {"model": model, "optim": optimizer(model)}
    mgrs = managers(tmp, "async", async_save=True)
    saves: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    try:
        for step in range(1, args.saves + 1):
            train(model, state["optim"], args.steps, width)
            for kind in rotated(list(KINDS), step):
                handles = []

                def start(kind: str = kind, handles: list = handles) -> tuple[Any, Any]:
                    handles.append(mgrs[kind].save(step, state))
                    return handles[0].staged, handles[0].committed

                t = time_save(start)
                mgrs[kind].wait()  # its commit step (latest, retention) too, before the next save
                written = handles[0].committed.result().bytes_written
                saves[kind].append({"bytes_written": written, "stall_s": t.stall_s, "committed_s": t.committed_s})
                progress(f"async save {step:2d} {kind:11s} {written / 2**20:9.2f} MiB  stall {t.stall_s:.4f} s  "
                         f"committed {t.committed_s:.3f} s")
    finally:
        for m in mgrs.values():
            m.close()
            remove(m.root)
    return saves


# --- the summary ----------------------------------------------------------------------------


def split(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Each figure of the first save, the median of the later ones, and every save's."""
    figures = list(runs[0]) if runs else []
    return {"first": {f: rnd(runs[0][f]) for f in figures},
            "median_later": {f: rnd(median([r[f] for r in runs[1:]])) for f in figures},
            "each": {f: [rnd(r[f]) for r in runs] for f in figures}}


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else round(num / den, 3)


def summarize(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, Any]:
    s = {kind: split(sync["saves"][kind]) for kind in KINDS}
    a = {kind: split(asyn[kind]) for kind in KINDS}
    later = {kind: s[kind]["median_later"] for kind in KINDS}
    alater = {kind: a[kind]["median_later"] for kind in KINDS}
    ratios = {
        "bytes_x": ratio(later["full"]["bytes_written"], later["incremental"]["bytes_written"]),
        "save_x": ratio(later["full"]["save_s"], later["incremental"]["save_s"]),
        "stall_ratio": ratio(alater["incremental"]["stall_s"], alater["full"]["stall_s"]),
        "committed_x": ratio(alater["full"]["committed_s"], alater["incremental"]["committed_s"]),
        "load_newest_ratio": ratio(sync["newest"]["incremental_s"], sync["newest"]["full_s"]),
        "load_old_ratio": ratio(sync["old"]["incremental_s"], sync["old"]["full_s"]),
    }
    equal = all(sync[which]["loads_equal"][kind] for which in ("newest", "old") for kind in KINDS)
    met = {
        "bytes_x": ratios["bytes_x"] is not None and ratios["bytes_x"] >= TARGETS["bytes_x"],
        "save_x": ratios["save_x"] is not None and ratios["save_x"] >= TARGETS["save_x"],
        "stall_ratio": ratios["stall_ratio"] is not None and ratios["stall_ratio"] <= TARGETS["stall_ratio"],
        "load_newest_ratio": ratios["load_newest_ratio"] is not None
        and ratios["load_newest_ratio"] <= TARGETS["load_ratio"],
        "load_old_ratio": ratios["load_old_ratio"] is not None and ratios["load_old_ratio"] <= TARGETS["load_ratio"],
        "loads_equal": equal,
    }
    return {"sync": s, "async": a, "ratios": ratios, "targets": TARGETS,
            "acceptance": {"met": all(met.values()), **met}}


def print_table(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"{c['saves']} saves of a {c['base_bytes'] / 2**30:.2f} GiB frozen base + {c['adapter_bytes'] / 2**20:.1f} "
          f"MiB of adapters and AdamW state ({c['layers']} layers x {LINEARS} Linear {c['width']}x{c['width']}, "
          f"rank {RANK}), {c['steps']} steps between saves; dir {c['dir']}, fsync on; {c['cores']} cores, load "
          f"average {c['loadavg_start']} -> {c['loadavg_end']}")
    print(f"{'':18s} {'MiB written':>12s} {'save s':>8s} {'stall s':>8s} {'committed s':>11s}   (first save; "
          f"median of saves 2..{c['saves']})")
    for kind in KINDS:
        s, a = r["sync"][kind], r["async"][kind]
        for label, which in (("first", "first"), ("later", "median_later")):
            print(f"{kind + ' ' + label:18s} {s[which]['bytes_written'] / 2**20:12.2f} {s[which]['save_s']:8.3f} "
                  f"{a[which]['stall_s']:8.4f} {a[which]['committed_s']:11.3f}")
    for which in ("newest", "old"):
        ld = r["load"][which]
        print(f"load step {ld['step']:<3d} ({which}): incremental {ld['incremental_s']} s, full {ld['full_s']} s, "
              f"equal {ld['loads_equal']}")
    q, t, m = r["ratios"], r["targets"], r["acceptance"]
    print(f"full/incremental bytes x{q['bytes_x']} (target >= {t['bytes_x']}: {m['bytes_x']}), save time "
          f"x{q['save_x']} (target >= {t['save_x']}: {m['save_x']}); stall incremental/full {q['stall_ratio']} "
          f"(target <= {t['stall_ratio']}: {m['stall_ratio']}); load incremental/full newest {q['load_newest_ratio']} "
          f"({m['load_newest_ratio']}), old {q['load_old_ratio']} ({m['load_old_ratio']}) (target <= "
          f"{t['load_ratio']})")
    print(f"acceptance {'met' if m['met'] else 'NOT met'}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-gib", type=float, default=1.0, help="frozen fp32 base weights, GiB")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3, help="training steps between two saves")
    ap.add_argument("--old-step", type=int, default=3, help="the old step loaded after the others were deleted")
    ap.add_argument("--load-reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint roots go (a fresh dir in it)")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    args = ap.parse_args()
    if args.saves < 3 or not 1 <= args.old_step < args.saves:
        ap.error("need --saves >= 3 and 1 <= --old-step < --saves")
    return args


def main() -> None:
    args = parse_args()
    width = width_for(args.base_gib * 2**30, args.layers)
    probe = Model(args.layers, width, device="meta")
    base_bytes = sum(p.numel() * 4 for p in probe.parameters() if not p.requires_grad)
    adapter_bytes = 3 * sum(p.numel() * 4 for p in probe.parameters() if p.requires_grad)  # + exp_avg, exp_avg_sq
    config = {"base_bytes": base_bytes, "adapter_bytes": adapter_bytes, "layers": args.layers, "width": width,
              "rank": RANK, "saves": args.saves, "steps": args.steps, "dir": args.dir, "cores": os.cpu_count(),
              "load_reps": args.load_reps, "torch_version": torch.__version__,
              "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    tmp = tempfile.mkdtemp(prefix="zs-incremental-", dir=args.dir)
    progress(f"{args.layers} layers x {LINEARS} of {width}x{width}: base {base_bytes / 2**30:.3f} GiB, adapters + "
             f"AdamW {adapter_bytes / 2**20:.2f} MiB; checkpoints in {tmp}")
    errors: dict[str, str] = {}
    try:
        sync = sync_pass(args, tmp, width)
        asyn = async_pass(args, tmp, width)
    except Exception as exc:  # noqa: BLE001 (reported in the JSON, then raised for the exit status)
        errors["run"] = describe(exc)
        if args.json:
            print_json({"config": config, "errors": errors})
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {"config": config, **summarize(sync, asyn),
              "load": {"newest": sync["newest"], "old": sync["old"]}, "disk_bytes": sync["disk_bytes"],
              "errors": errors}
    print_table(result)
    if args.json:
        print_json(result)


if __name__ == "__main__":
    main()
