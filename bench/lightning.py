"""Lightning: how long ``trainer.save_checkpoint`` blocks the fit loop, by checkpoint plugin (issue 32).

    python bench/lightning.py [--params-mb 512] [--reps 3] [--dir DIR] [--json]

One process on the CPU: a Lightning ``Trainer`` fits a stack of square Linear layers (--params-mb
MiB of fp32 parameters, AdamW, so a checkpoint holds about three times that: weights, exp_avg,
exp_avg_sq) on random batches. A callback calls ``trainer.save_checkpoint(path)`` from
``on_train_batch_end``, one save per training step, and times the call itself: what the fit loop
waits for. The Trainer's ``strategy.checkpoint_io`` is switched before each save, so the contenders
save the same model in the same run:

- ``default``: Lightning's ``TorchCheckpointIO`` (torch.save into memory, then the file; no fsync);
- ``lightning_async``: Lightning's ``AsyncCheckpointIO`` wrapping it (clones every tensor on the
  calling thread, then writes in its thread);
- ``zerostall_async``: ``ZeroStallCheckpointIO(asynchronous=True)`` (returns once the state is
  captured; commits in the background);
- ``zerostall``: ``ZeroStallCheckpointIO()``, synchronous, for context.

Each rep, in an order rotated by one per rep, each contender saves once (rep 0 warms up: the
asynchronous plugins allocate their buffers and threads there; it is not counted). Right after
each call, outside the blocking time, the bench waits for the save with the plugin's own means
(``AsyncCheckpointIO.teardown``, ``ZeroStallCheckpointIO.wait``; the synchronous ones are done at
return): ``done_s`` is the time from the call until then. Then, outside every timing, it fsyncs
the checkpoint's files (``fsync_s``: what ``TorchCheckpointIO`` skips; zerostall's saves are
fsynced already) and deletes that contender's checkpoint of the rep before; ``durable_s`` is
``done_s + fsync_s``. Figures are medians of the timed reps. The parameters' gradients are freed
before each save (they are not in a checkpoint), to leave memory for the clones and buffers.

After ``fit``, each contender's last checkpoint is loaded back with its own plugin and compared
with the state it was saved from (an xxh3-64 of every tensor of ``state_dict`` and
``optimizer_states``, plus ``global_step`` and ``epoch``, taken at the save, outside the timing).

A table on stdout, progress on stderr; with --json one JSON object as the last stdout line, whose
``acceptance`` says whether zerostall_async blocks at most 1/5 as long as the default, and less
than ``lightning_async``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
# This file is named lightning: import the real package with bench/ off the path, then put it back.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != BENCH]
sys.path.insert(0, os.path.join(BENCH, "..", "src"))
import lightning as L  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO  # noqa: E402

sys.path.insert(0, BENCH)

import torch  # noqa: E402
import xxhash  # noqa: E402
from common import describe, median, print_json, progress, remove, rnd, rotated  # noqa: E402
from torch import nn  # noqa: E402

from zerostall.integrations.lightning import ZeroStallCheckpointIO  # noqa: E402

CONTENDERS = ("default", "lightning_async", "zerostall_async", "zerostall")
WIDTH = 2048  # the layers are WIDTH x WIDTH
BATCH = 4
TARGET = 5  # zerostall_async must block at most 1/TARGET as long as the default


class Stack(L.LightningModule):
    """Square Linear layers trained with AdamW to shrink their output."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def plugins() -> dict[str, Any]:
    """A fresh plugin of each contender."""
    return {"default": TorchCheckpointIO(), "lightning_async": AsyncCheckpointIO(TorchCheckpointIO()),
            "zerostall_async": ZeroStallCheckpointIO(asynchronous=True), "zerostall": ZeroStallCheckpointIO()}


def finish(name: str, io: Any) -> None:
    """Wait, with the plugin's own means, until its save in flight is done."""
    if name == "lightning_async":
        io.teardown()  # shuts its thread down once the queued save is written; the next save starts another
    elif name == "zerostall_async":
        io.wait()


def digest(checkpoint: dict[str, Any]) -> str:
    """xxh3-64 of every tensor of the checkpoint's weights and optimizer states (in a fixed order),
    its step and epoch."""
    h = xxhash.xxh3_64()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                h.update(repr(key).encode())
                walk(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        else:
            h.update(repr(obj).encode())

    walk({k: checkpoint[k] for k in ("state_dict", "optimizer_states", "global_step", "epoch")})
    return h.hexdigest()


def files_under(path: str) -> list[str]:
    """path itself if a file, else every regular file below it."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]


def fsync_all(path: str) -> float:
    """fsync every file of a checkpoint (and its directory); the seconds that took."""
    start = time.perf_counter()
    for name in files_under(path) + [os.path.dirname(path)]:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - start


class Saves(L.Callback):
    """Saves with each contender in turn from ``on_train_batch_end``, timing the call."""

    def __init__(self, ios: dict[str, Any], reps: int, root: str) -> None:
        self.ios, self.root = ios, root
        self.schedule = [(rep, name) for rep in range(reps + 1) for name in rotated(list(CONTENDERS), rep)]
        self.times: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
        self.last: dict[str, tuple[str, str]] = {}  # contender -> (its last checkpoint, the digest saved there)
        self.errors: dict[str, str] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx >= len(self.schedule):
            return
        rep, name = self.schedule[batch_idx]
        if name in self.errors:
            return
        module.zero_grad(set_to_none=True)
        io = trainer.strategy.checkpoint_io = self.ios[name]
        path = os.path.join(self.root, f"{name}-rep{rep}.ckpt")
        expected = digest(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
        try:
            start = time.perf_counter()
            trainer.save_checkpoint(path, weights_only=False)
            blocking = time.perf_counter() - start
            finish(name, io)
            done = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 (the others run without it)
            self.errors[name] = describe(exc)
            progress(f"rep {rep} {name} failed: {self.errors[name]}")
            return
        fsync = fsync_all(path)
        nbytes = sum(os.path.getsize(f) for f in files_under(path))
        if name in self.last:
            remove(self.last[name][0])
        self.last[name] = (path, expected)
        if rep:
            self.times[name].append({"blocking_s": blocking, "done_s": done, "fsync_s": fsync, "bytes": nbytes})
        progress(f"rep {rep}{' (warm-up)' if rep == 0 else ''} {name:16s} blocked {blocking:7.3f} s  "
                 f"done {done:7.3f} s  +fsync {fsync:6.3f} s  {nbytes / 2**30:.2f} GiB")


def check(io: Any, path: str, expected: str) -> bool:
    """Whether the checkpoint at path, loaded by its own plugin, holds the state it was saved from."""
    loaded = io.load_checkpoint(path, weights_only=False)
    return digest(loaded) == expected


def summarize(saves: Saves, loads: dict[str, bool], args: argparse.Namespace, model: Stack) -> dict[str, Any]:
    """Medians by contender, the load checks and the acceptance verdict."""
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"params": params, "params_bytes": params * 4, "layers": len(model.net), "width": WIDTH,
                           "reps": args.reps, "dir": args.dir, "cores": os.cpu_count(),
                           "torch_version": torch.__version__, "lightning_version": L.__version__,
                           "contenders": {}, "errors": dict(saves.errors)}
    for name in CONTENDERS:
        runs = saves.times[name]
        if not runs:
            continue
        res: dict[str, Any] = {what: rnd(median([r[what] for r in runs])) for what in ("blocking_s", "done_s", "fsync_s")}
        res["durable_s"] = rnd(median([r["done_s"] + r["fsync_s"] for r in runs]))
        res["bytes"] = runs[-1]["bytes"]
        res["loads_equal"] = loads.get(name)
        res["seconds"] = [{k: rnd(v) for k, v in r.items()} for r in runs]
        out["contenders"][name] = res
    got = {name: out["contenders"].get(name, {}).get("blocking_s") for name in CONTENDERS}
    zs_async, default, lightning_async = got["zerostall_async"], got["default"], got["lightning_async"]
    known = None not in (zs_async, default, lightning_async)
    vs_default = rnd(default / zs_async, 2) if known and zs_async else None
    vs_async = rnd(lightning_async / zs_async, 2) if known and zs_async else None
    out["acceptance"] = {
        "met": bool(known and zs_async * TARGET <= default and zs_async < lightning_async
                    and all(loads.get(n) for n in CONTENDERS)),
        "zerostall_async_blocking_s": zs_async, "default_blocking_s": default,
        "lightning_async_blocking_s": lightning_async, "shorter_than_default_x": vs_default, "target_x": TARGET,
        "shorter_than_lightning_async_x": vs_async, "all_load_back_equal": all(loads.get(n) for n in CONTENDERS)}
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"Lightning {r['lightning_version']}, one process on {r['cores']} CPU cores: {r['layers']} Linear "
          f"{r['width']}x{r['width']}, {r['params']:,} fp32 parameters ({r['params_bytes'] / 2**30:.2f} GiB) + AdamW; "
          f"{r['reps']} reps, medians; dir {r['dir']}")
    print(f"{'plugin':16s} {'GiB':>6s} {'blocking s':>10s} {'done s':>8s} {'+fsync s':>8s} {'durable s':>9s} "
          f"{'loads equal':>11s}")
    for name in CONTENDERS:
        if name in r["errors"]:
            print(f"{name:16s} failed: {r['errors'][name][:150]}")
        c = r["contenders"].get(name)
        if c is not None:
            print(f"{name:16s} {c['bytes'] / 2**30:6.2f} {c['blocking_s']:10.3f} {c['done_s']:8.3f} "
                  f"{c['fsync_s']:8.3f} {c['durable_s']:9.3f} {str(c['loads_equal']):>11s}")
    a = r["acceptance"]
    print(f"acceptance {'met' if a['met'] else 'NOT met'}: zerostall_async blocks {a['zerostall_async_blocking_s']} s, "
          f"x{a['shorter_than_default_x']} shorter than default ({a['default_blocking_s']} s, target x{TARGET}) and "
          f"x{a['shorter_than_lightning_async_x']} shorter than lightning_async ({a['lightning_async_blocking_s']} s, "
          f"target > x1); every checkpoint loads back equal: {a['all_load_back_equal']}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-mb", type=float, default=512, help="fp32 parameters, MiB (a checkpoint is ~3x)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    nbytes = args.params_mb * 2**20
    width = WIDTH if nbytes >= 4 * WIDTH * WIDTH else max(8, int((nbytes / 4) ** 0.5))  # a tiny run: one layer
    layers = max(1, round(nbytes / (4 * (width * width + width))))
    L.seed_everything(0, verbose=False)
    model = Stack(layers, width)
    ios = plugins()
    tmp = tempfile.mkdtemp(prefix="zs-lightning-", dir=args.dir)
    try:
        saves = Saves(ios, args.reps, tmp)
        steps = len(saves.schedule)
        data = torch.utils.data.TensorDataset(torch.randn(steps * BATCH, width))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[saves], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        progress(f"{layers} layers of {width}x{width}, {args.params_mb} MiB of parameters; {steps} steps "
                 f"({args.reps} reps + a warm-up), checkpoints in {tmp}")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))
        loads: dict[str, bool] = {}
        for name, io in ios.items():
            io.teardown()
            if name in saves.last:
                try:
                    loads[name] = check(io, *saves.last[name])
                except Exception as exc:  # noqa: BLE001
                    saves.errors[f"{name}_load"] = describe(exc)
                    loads[name] = False
                progress(f"{name} loads back equal: {loads[name]}")
        result = summarize(saves, loads, args, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(result)
    if args.json:
        print_json(result)


if __name__ == "__main__":
    main()
