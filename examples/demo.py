"""A real training run that checkpoints asynchronously, is killed mid-run, resumes, bit for bit.

Three processes train the same small transformer on CPU: a reference run with no interruption,
a run that saves asynchronously every few steps (training goes on while the checkpoint is
written; the loop waits for the capture only before the optimizer step) and is SIGKILLed in the
middle, and a run that resumes from the newest committed checkpoint. The demo passes when the
resumed losses and final weights are bit-identical to the reference.

    python examples/demo.py [--steps 60] [--every 10] [--kill-at 37] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

import zerostall as zs


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def build(seed: int = 0) -> dict:
    """Model, optimizer, schedule and data stream: everything a resume must restore."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=1000)
    data = torch.Generator().manual_seed(seed + 1)
    return {"model": model, "optim": optim, "sched": sched, "data": data}


def train_step(parts: dict, before_update=lambda: None) -> float:
    tokens = torch.randint(0, 256, (8, 33), generator=parts["data"])
    logits = parts["model"](tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    parts["optim"].zero_grad()
    loss.backward()
    before_update()  # an asynchronous save may still be copying the state: let it finish first
    parts["optim"].step()
    parts["sched"].step()
    return loss.item()


def checkpoint_state(parts: dict, step: int) -> dict:
    return {"model": parts["model"], "optim": parts["optim"], "sched": parts["sched"], "step": step,
            "rng": zs.rank_local({"torch": torch.get_rng_state(), "data": parts["data"].get_state()})}


def latest_committed(root: str) -> str | None:
    """The newest step directory with a committed manifest (uncommitted ones do not exist)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        try:
            with zs.open(os.path.join(root, name)) as ck:
                found.append((ck.step, name))
        except zs.CheckpointError:
            continue
    return os.path.join(root, max(found)[1]) if found else None


def run(args: argparse.Namespace) -> None:
    """One training process: optionally resume, train, save every N steps, optionally die."""
    parts = build()
    start, restore_s = 0, 0.0
    if args.resume and (path := latest_committed(args.dir)):
        t0 = time.perf_counter()
        state = zs.load(checkpoint_state(parts, 0), path)
        torch.set_rng_state(state["rng"].value["torch"])
        parts["data"].set_state(state["rng"].value["data"])
        start, restore_s = state["step"], time.perf_counter() - t0
    losses, saves, handles = {}, [], []
    saver = zs.AsyncSaver()
    for step in range(start + 1, args.steps + 1):
        losses[step] = train_step(parts, saver.wait_staged)
        if args.every and step % args.every == 0:
            t0 = time.perf_counter()
            path = os.path.join(args.dir, f"step_{step:06d}")
            handles.append(saver.save(checkpoint_state(parts, step), path, step=step))
            saves.append({"step": step, "blocked_s": time.perf_counter() - t0})
        print(json.dumps({"step": step, "loss": losses[step]}), flush=True)
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    saver.close()
    for save, handle in zip(saves, handles):
        info = handle.result()
        save.update(bytes=info.bytes_written, committed_s=info.total_s)
    weights = {k: v.view(-1)[:4].tolist() for k, v in parts["model"].state_dict().items()}
    print(json.dumps({"done": True, "start": start, "restore_s": restore_s, "saves": saves,
                      "losses": losses, "weights": weights}), flush=True)


def child(*extra: str, steps: int, dir: str) -> tuple[int, list[dict]]:
    cmd = [sys.executable, __file__, "--child", "--steps", str(steps), "--dir", dir, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, -signal.SIGKILL):
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"child {cmd} failed with {proc.returncode}")
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=37)
    parser.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run(args)
        return 0

    root = args.dir or tempfile.mkdtemp(prefix="zerostall-demo-")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    scratch = os.path.join(root, "reference")
    print(f"1/3 reference run, {args.steps} steps, no interruption")
    _, ref = child("--every", "0", "--kill-at", "-1", steps=args.steps, dir=scratch)
    print(f"2/3 training with a checkpoint every {args.every} steps, SIGKILLed at step {args.kill_at}")
    code, killed = child("--every", str(args.every), "--kill-at", str(args.kill_at), steps=args.steps,
                         dir=os.path.join(root, "run"))
    print(f"    the process died with signal {-code} after step {killed[-1]['step']}")
    print("3/3 restarting: resume from the newest committed checkpoint")
    _, resumed = child("--resume", "--every", str(args.every), "--kill-at", "-1", steps=args.steps,
                       dir=os.path.join(root, "run"))
    ref_done, res_done = ref[-1], resumed[-1]
    start = res_done["start"]
    same_losses = all(ref_done["losses"][k] == v for k, v in res_done["losses"].items())
    same_weights = ref_done["weights"] == res_done["weights"]
    lost = killed[-1]["step"] - start
    saves = res_done["saves"]

    print()
    print(f"{'step':>6} {'reference loss':>16} {'resumed loss':>16}")
    for step in sorted(res_done["losses"], key=int)[:: max(1, len(res_done['losses']) // 6)]:
        print(f"{step:>6} {ref_done['losses'][step]:>16.10f} {res_done['losses'][step]:>16.10f}")
    print()
    print(f"resumed from step {start} (lost {lost} steps of work), restore took {res_done['restore_s'] * 1e3:.1f} ms")
    if saves:
        blocked = sum(s["blocked_s"] for s in saves) / len(saves)
        committed = sum(s["committed_s"] for s in saves) / len(saves)
        print(f"{len(saves)} asynchronous saves after the restart, {saves[0]['bytes'] / 1e6:.2f} MB each: "
              f"{blocked * 1e3:.1f} ms blocked per save, {committed * 1e3:.1f} ms until committed")
    print(f"losses bit-identical: {same_losses}; final weights bit-identical: {same_weights}")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if same_losses and same_weights and start > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
