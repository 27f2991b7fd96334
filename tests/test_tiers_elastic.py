"""The local tier under torchrun: a worker SIGKILLed, the elastic agent restarts the job, which
resumes from the local tier and a peer's replica as if it had never stopped.

Two runs of tests/elastic_train.py under ``torchrun --nproc-per-node 2 --max-restarts 1`` (CPU,
gloo, a c10d rendezvous on loopback), one worker per simulated node: one run where rank 1 loses
its node's directory and kills itself after step STOP, and one never interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from distributed import SRC_DIR, TESTS_DIR
from test_tiers import END, EVERY, STOP

SCRIPT = os.path.join(TESTS_DIR, "elastic_train.py")
TIMEOUT_S = 150  # each torchrun; a run takes seconds, a hang fails the test instead of holding it


def torchrun(tmp: str, name: str, *extra: str) -> subprocess.Popen[str]:
    out = os.path.join(tmp, name)
    os.makedirs(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROSTALL_", "TORCHELASTIC_"))}
    env |= {"PYTHONPATH": os.pathsep.join([SRC_DIR, TESTS_DIR]), "OMP_NUM_THREADS": "1",
            # the workers' own store, not the agent's: with the shared one a restarted worker may read its peer's
            # address from the attempt before and never connect (pytorch/pytorch#135712, torch's workaround)
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--monitor-interval", "0.1",
           SCRIPT, out, os.path.join(tmp, f"{name}-root"), os.path.join(tmp, f"{name}-nodes"), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], tmp: str, name: str) -> list[dict]:
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"torchrun ({name}) did not finish in {TIMEOUT_S} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, f"torchrun ({name}) failed ({proc.returncode}):\n{output[-4000:]}"
    results = []
    for rank in range(2):
        with open(os.path.join(tmp, name, f"rank-{rank}.json")) as f:
            results.append(json.load(f))
    return results


def test_a_worker_killed_under_torchrun_resumes_from_the_local_tier_and_its_peer_bit_exactly(tmp_path):
    tmp = str(tmp_path)
    killed = torchrun(tmp, "killed", "--kill-at", str(STOP))  # the two runs at once: half the wall time
    whole = torchrun(tmp, "whole")
    after, reference = finish(killed, tmp, "killed"), finish(whole, tmp, "whole")
    restored = STOP // EVERY * EVERY  # the local tier's newest step before the kill
    for rank, (got, ref) in enumerate(zip(after, reference)):
        assert ref["restarts"] == 0 and ref["start"] == 0
        assert got["restarts"] == 1, "the elastic agent did not restart the workers"
        assert got["start"] == got["step"] == restored
        assert got["sources"] == ["local", "peer"] and got["source"] == got["sources"][rank]
        assert got["fallbacks"] == []
        assert got["losses"] == {s: ref["losses"][s] for s in map(str, range(restored + 1, END + 1))}, f"rank {rank}"
        assert got["digest"] == ref["digest"], f"rank {rank}"
