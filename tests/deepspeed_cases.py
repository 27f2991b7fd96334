"""Two-rank DeepSpeed jobs for tests/test_deepspeed.py that check how the engine ``attach`` installs
meets DeepSpeed's own calls; one rank of a gloo job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in
the environment) on the CPU, writing what it saw as JSON to ``--losses``.rank<r> (the name
tests/deepspeed_train.py uses).

``--case reload``: asynchronous saves (each held back a moment before it writes, as on a slow
disk) loaded back at once: a tag saved again and ``latest``, which must be the checkpoints just
saved; DeepSpeed's positional ``load_checkpoint`` arguments; a tag that reads as a number; and
``destroy`` with a save in flight. ``--case unencodable``: a save whose ``client_state`` holds a
value zerostall cannot encode (only rank 0 writes it), then a step. ``--case bookends``: loads
inside the caller's ``open``/``close``, and a load after rank 0 failed to update ``latest``.
``--case damaged``: ZeRO-3 with its small parameters whole on every rank, a load that one rank finds damaged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from deepspeed_train import _step, config  # noqa: E402


def reload(engine: Any, directory: str) -> dict[str, Any]:
    from zerostall.saving import asynchronous

    persist = asynchronous.persist
    asynchronous.persist = lambda prepared: (time.sleep(0.5), persist(prepared))[1]  # a slow disk
    seen: dict[str, Any] = {}
    rank = torch.distributed.get_rank()
    for step, tag in ((1, "best"), (2, "best")):
        _step(engine, step, rank, 64)
        engine.save_checkpoint(directory, tag, client_state={"step": step})
    seen["best"] = engine.load_checkpoint(directory, "best")[1]["step"]
    _step(engine, 3, rank, 64)
    engine.save_checkpoint(directory, 100, client_state={"step": 3})
    _step(engine, 4, rank, 64)
    engine.save_checkpoint(directory, "other", client_state={"step": 4}, save_latest=False)
    seen["latest"] = engine.load_checkpoint(directory)[1]["step"]
    seen["latest_file"] = open(os.path.join(directory, "latest")).read()
    seen["positional"] = engine.load_checkpoint(directory, "best", True, True, True, False, None)[1]["step"]
    _step(engine, 5, rank, 64)
    engine.save_checkpoint(directory, "last", client_state={"step": 5})
    saver = engine.checkpoint_engine.saver
    engine.destroy()
    seen["after_destroy"] = {"committed": os.path.exists(os.path.join(directory, "last", "manifest.json")),
                             "saver_closed": saver._closed,
                             "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("zerostall"))}
    return seen


def bookends(engine: Any, directory: str) -> dict[str, Any]:
    """``load_checkpoint`` inside the caller's own ``open``/``close``; then, asynchronously, a load
    after rank 0 failed to point ``latest`` at the save in flight, and the save after it."""
    import shutil

    from zerostall import CheckpointError

    rank, ours, seen = torch.distributed.get_rank(), engine.checkpoint_engine, {}
    for step, tag in ((1, "t1"), (2, "t2")):
        _step(engine, step, rank, 64)
        engine.save_checkpoint(directory, tag, client_state={"step": step})
    ours.wait()
    seen["opened"] = ours.open(directory, "t1")
    seen["held"] = engine.load_checkpoint(directory)[1]["step"]  # the open one, not the one latest names
    try:
        engine.load_checkpoint(directory, "t2")
    except CheckpointError as exc:
        seen["other"] = str(exc)
    seen["still_open"] = ours.session is not None and ours.session.tag
    ours.close()
    torch.distributed.barrier()
    if rank == 0:  # rank 0 cannot replace latest (as on a full or read-only disk)
        os.unlink(os.path.join(directory, "latest"))
        os.makedirs(os.path.join(directory, "latest", "in the way"))
    torch.distributed.barrier()
    _step(engine, 3, rank, 64)
    engine.save_checkpoint(directory, "t3", client_state={"step": 3})
    seen["loaded"] = engine.load_checkpoint(directory, "t3")[1]["step"]
    _step(engine, 4, rank, 64)
    try:
        engine.save_checkpoint(directory, "t4", client_state={"step": 4})
        ours.wait()
        seen["next_save"] = "saved"
    except CheckpointError as exc:
        seen["next_save"] = str(exc)
    if rank == 0:
        shutil.rmtree(os.path.join(directory, "latest"))
    engine.destroy()
    return seen


def damaged(engine: Any, directory: str) -> dict[str, Any]:
    """ZeRO-3 keeping its small parameters whole on every rank (DeepSpeed's default threshold): a
    load whose optimizer file rank 1 finds damaged, and then a step on both ranks."""
    import zerostall as zs
    from zerostall.collectives import ALONE

    rank, seen = torch.distributed.get_rank(), {}
    _step(engine, 1, rank, 64)
    engine.save_checkpoint(directory, "t1")
    seen["persistent"] = len(engine.optimizer.persistent_parameters)
    if rank == 1:  # one byte of a tensor only rank 1 reads
        with zs.open(os.path.join(directory, "t1"), process_group=ALONE) as ck:
            entry = next(e for e in ck.manifest.entries if e.kind == "tensor" and e.nbytes > 0
                         and str(e.path[0]).startswith("zero_pp_rank_1"))
            chunk = entry.chunks[0]
        with open(os.path.join(directory, "t1", chunk.file), "r+b") as f:
            f.seek(chunk.offset)
            byte = f.read(1)
            f.seek(chunk.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()
    try:
        engine.load_checkpoint(directory, "t1")
        seen["load"] = "loaded"
    except zs.CheckpointError as exc:
        seen["load"] = f"{type(exc).__name__}: {exc}"
    seen["loss"] = _step(engine, 2, rank, 64)  # the ranks go on together
    engine.destroy()
    return seen


class Unencodable:
    """A value of the user's own class in client_state."""


def unencodable(engine: Any, directory: str) -> dict[str, Any]:
    from zerostall import CheckpointError

    rank = torch.distributed.get_rank()
    _step(engine, 1, rank, 64)
    seen: dict[str, Any] = {}
    try:
        engine.save_checkpoint(directory, "s1", client_state={"mine": Unencodable()})
        seen["said"] = "saved"
    except CheckpointError as exc:
        seen["said"] = f"{type(exc).__name__}: {exc}"
    seen["loss"] = _step(engine, 2, rank, 64)  # the ranks go on together
    seen["tags"] = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    engine.destroy()
    return seen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=["reload", "unencodable", "bookends", "damaged"], required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--losses", dest="out", required=True)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    damage = args.case == "damaged"  # ZeRO-3 at DeepSpeed's default persistence threshold
    settings = config(argparse.Namespace(stage=3 if damage else 2, offload="none/none", nvme="", persist_small=damage))
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=settings)
    from zerostall.integrations.deepspeed import attach

    attach(engine, asynchronous=args.case in ("reload", "bookends"))
    seen = {"reload": reload, "unencodable": unencodable, "bookends": bookends, "damaged": damaged}[args.case](
        engine, args.dir)
    with open(f"{args.out}.rank{torch.distributed.get_rank()}", "w") as f:
        json.dump(seen, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
