"""A DeepSpeed training run for tests/test_deepspeed.py and bench/deepspeed.py: one rank of a gloo
job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) on the CPU.

It trains a two-layer model with ZeRO ``--stage`` (and ``--offload PARAM/OPTIMIZER`` devices, ``none``,
``cpu`` or ``nvme``), saves with zerostall (``attach``) or DeepSpeed's own engine after
each step of ``--save-at``, writes each step's loss to ``--losses``, and, with ``--kill-at N``, SIGKILLs
itself after step N. With ``--resume`` it first loads the checkpoint that ``--tag`` names (default:
latest) and goes on from its step; with ``--rollback``, it loads that checkpoint again after its last step,
in the same process, and trains the steps after it again. The batch of a step is drawn from a seed of that step, so a
resumed run sees the data an uninterrupted one saw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import deepspeed  # noqa: E402
import torch  # noqa: E402


def config(args: argparse.Namespace) -> dict:
    zero: dict = {"stage": args.stage}
    if args.stage == 3 and not args.persist_small:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned (and swapped, with nvme)
    param, optimizer = args.offload.split("/")
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": args.nvme}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": args.nvme}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _optimizer_swap_files(engine: Any) -> dict[str, bytes]:
    """The bytes of each file in the optimizer's NVMe swap folder (none without one)."""
    swapper = getattr(engine.optimizer, "optimizer_swapper", None)
    if swapper is None:
        return {}
    folder = swapper.swap_folder
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload", default="none/none")
    p.add_argument("--dir", required=True)
    p.add_argument("--nvme", default="")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int, nargs="*", default=[3])
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tag", default=None)
    p.add_argument("--weights-only", action="store_true", help="resume with load_optimizer_states=False")
    p.add_argument("--first-layer-only", action="store_true",
                   help="resume the module alone through a custom_load_fn that loads its first layer only")
    p.add_argument("--engine", choices=["zerostall", "deepspeed"], default="zerostall")
    p.add_argument("--asynchronous", action="store_true")
    p.add_argument("--persist-small", action="store_true",
                   help="ZeRO-3's default persistence threshold: small parameters (the biases) whole on every rank")
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--losses", required=True)
    p.add_argument("--check-open", default="", help="first open() latest, a tag, this empty directory, a missing tag")
    p.add_argument("--bump-ids", action="store_true", help="build another ZeRO-3 model first: later ds_ids move")
    p.add_argument("--rollback", action="store_true",
                   help="after the last step, load --tag in this process and train its later steps again")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    if args.bump_ids:
        with deepspeed.zero.Init(config_dict_or_path=config(args)):
            torch.nn.Linear(8, 8)
    torch.manual_seed(0)
    w = args.width
    # ZeRO-3 partitions built under zero.Init take their dtype from the config (float32): partitioned by
    # deepspeed.initialize instead, DeepSpeed 0.19.8 makes them bfloat16 on a CPU without mkldnn fp16 (an operator
    # precedence slip in Init._set_dtype), too small then to be swapped to NVMe (under its 1 MiB minimum)
    with deepspeed.zero.Init(config_dict_or_path=config(args), enabled=args.stage == 3):
        model = torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.Tanh(), torch.nn.Linear(2 * w, w))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(args))
    if args.engine == "zerostall":
        from zerostall.integrations.deepspeed import attach

        attach(engine, asynchronous=args.asynchronous, allow_pickle=args.allow_pickle)
    start = 0
    losses: dict[int, float] = {}
    if args.check_open:
        losses["open"] = check_open(engine.checkpoint_engine, args.dir, args.check_open)
    if args.resume:
        live, returned = _watch_loads(engine)
        head = engine.module[2].weight.detach().clone()
        extra = dict(load_module_only=True, custom_load_fn=_first_layer_only) if args.first_layer_only else {}
        swapped = _optimizer_swap_files(engine)
        try:
            path, client = engine.load_checkpoint(args.dir, args.tag, load_optimizer_states=not args.weights_only,
                                                  **extra)
        except Exception as exc:  # what was refused, and whether the optimizer's swap files stayed as they were
            result = {"refused": f"{type(exc).__name__}: {exc}", "swap_kept": _optimizer_swap_files(engine) == swapped}
            with open(f"{args.losses}.rank{rank}", "w") as f:
                json.dump(result, f)
            _tear_down(engine)
            return
        losses["head_kept"] = torch.equal(engine.module[2].weight.detach(), head)
        assert path is not None, f"nothing to resume in {args.dir}"
        start = client["step"]
        losses["resumed_from"] = start
        losses["read_in_place"] = len(live & returned), len(live)
    for step in range(start + 1, args.steps + 1):
        losses[step] = _step(engine, step, rank, w)
        if step in args.save_at:
            engine.save_checkpoint(args.dir, f"step{step}", client_state={"step": step})
        if step == args.kill_at:
            if args.engine == "zerostall" and args.asynchronous:
                engine.checkpoint_engine.wait()
            torch.distributed.barrier()
            _write(args.losses, rank, losses)
            os.kill(os.getpid(), signal.SIGKILL)
    if args.engine == "zerostall":
        engine.checkpoint_engine.wait()
    if args.rollback:
        _, client = engine.load_checkpoint(args.dir, args.tag)
        for step in range(client["step"] + 1, args.steps + 1):
            losses[f"again{step}"] = _step(engine, step, rank, w)
    _write(args.losses, rank, losses)
    _tear_down(engine)


def _tear_down(engine: Any) -> None:
    """Close the engine and the process group on every rank together: a rank that exits with its
    group still up can abort in gloo's threads at interpreter exit."""
    torch.distributed.barrier()  # no rank tears down while another still talks to it
    engine.destroy()
    torch.distributed.destroy_process_group()


def _step(engine: Any, step: int, rank: int, width: int) -> float:
    """One training step on the batch of ``step``; its loss."""
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(1000 * step + rank))
    loss = (engine(x) - x.flip(-1)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def check_open(ours, directory: str, empty: str) -> dict:
    """What open() returns for latest, a named tag, an empty directory, and the error of a missing tag."""
    from zerostall import CheckpointNotFoundError

    seen = {}
    for name, where, tag in [("latest", directory, None), ("named", directory, "step3"), ("empty", empty, None)]:
        seen[name] = ours.open(where, tag)
        seen[f"{name}_view"] = ours.session is not None and os.path.isdir(ours.session.view)
        view = ours.session.view if ours.session is not None else None
        ours.close()
        seen[f"{name}_closed"] = view is None or not os.path.exists(view)
    try:
        ours.open(directory, "step999")
    except CheckpointNotFoundError as exc:
        seen["missing"] = str(exc)
    return seen


def _first_layer_only(src: dict, dst: torch.nn.Module) -> None:
    """A custom_load_fn: the saved first layer, this run's own last layer."""
    dst.load_state_dict({k: v for k, v in src.items() if k.startswith("0.")}, strict=False)


def _watch_loads(engine) -> tuple[set, set]:
    """Where the tensors of the state dicts DeepSpeed would save now lie (the model's and this rank's
    optimizer's), and a set the checkpoint engine's loads add the places of what they return to:
    a load that reads into the engine's own tensors returns them."""
    def places(tree) -> set:
        if isinstance(tree, torch.Tensor):
            return {tree.data_ptr()} if tree.numel() > 1 else set()
        if isinstance(tree, dict):
            tree = list(tree.values())
        return set().union(*map(places, tree)) if isinstance(tree, (list, tuple)) else set()

    live = places([engine.module_state_dict(), engine.optimizer.state_dict()])
    returned: set = set()
    load = engine.checkpoint_engine.load

    def watched(path, map_location=None):
        value = load(path, map_location)
        returned.update(places(value))
        return value

    engine.checkpoint_engine.load = watched
    return live, returned


def _write(path: str, rank: int, losses: dict) -> None:
    with open(f"{path}.rank{rank}", "w") as f:
        json.dump({str(k): v for k, v in losses.items()}, f)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is written and torn down; native threads of gloo and DeepSpeed's shm op can abort in
    # the interpreter's own exit (seen: "terminate called without an active exception", then SIGSEGV)
