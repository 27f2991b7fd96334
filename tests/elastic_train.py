"""A training script for torchrun with a local tier, which tests/test_tiers_elastic.py runs.

    torchrun --nproc-per-node 2 --max-restarts 1 ... tests/elastic_train.py OUT ROOT BASE [--kill-at K]

The loop, model and schedule are tests/test_tiers.py's (gradients averaged over the ranks, a
per-rank data-loader state, the global RNG used; the local tier every EVERY steps, the root every
SAVE_EVERY). Each worker is a simulated node (``ZEROSTALL_NODE_ID`` "a" or "b" from LOCAL_RANK,
a directory each under BASE). With ``--kill-at K``, on the first attempt only
(TORCHELASTIC_RESTART_COUNT 0), every rank waits at step K for the saves and replication in flight
(so the step to be restored is known), then rank 1 deletes its node's directory and SIGKILLs
itself: its node is lost, and the elastic agent restarts both workers, which restore (rank 0 from
its own node, rank 1 from the replica on node a) and train to END. Each rank writes OUT/rank-R.json:
the restart count it saw, what ``mgr.restore`` restored, its losses by step, its final state's digest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

import zerostall as zs
from test_tiers import END, EVERY, SAVE_EVERY, digest, make_state, train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("root")
    ap.add_argument("base")
    ap.add_argument("--kill-at", type=int, default=None, help="rank 1 dies after this step on the first attempt")
    args = ap.parse_args()
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    node = "ab"[int(os.environ["LOCAL_RANK"])]
    os.environ["ZEROSTALL_NODE_ID"] = node
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    directory = os.path.join(args.base, f"node-{node}")
    state = make_state()
    tier = zs.LocalTier(directory, every=EVERY, keep=1, replicas=2, timeout_s=20)
    with zs.CheckpointManager(args.root, save_every=SAVE_EVERY, local=tier, fsync=False) as mgr:
        start = mgr.restore(state) or 0
        info = mgr.last_restore
        losses = {}
        for step in range(start + 1, END + 1):
            losses[step] = train_step(state, step)
            if mgr.should_save(step):
                mgr.save(step, state)
            if step == args.kill_at and restarts == 0:
                mgr.wait()
                dist.barrier()  # every copy saved so far is committed and replicated on every rank
                if rank == 1:
                    shutil.rmtree(directory)  # the node is lost, and its directory with it
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.barrier()  # rank 0 waits for a peer that never comes: gloo raises, the agent restarts
        mgr.wait()
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"restarts": restarts, "start": start, "step": info.step, "source": info.source,
                   "sources": list(info.sources), "fallbacks": [list(x) for x in info.fallbacks],
                   "losses": losses, "digest": digest(state)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
