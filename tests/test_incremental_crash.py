"""Incremental saves and the retention of checkpoints that share data, killed at every step: each
committed checkpoint still loads bit-exactly, a restarted manager goes on, and nothing leaks.

Each crash runs in a real child process that SIGKILLs itself at one storage operation (a
:class:`faults.FaultyStorage` around the root) while a ``CheckpointManager(incremental=True,
keep_last=2, full_save_every=3)`` saves steps 1 to 6: step 1 is full, 2 and 3 refer to it, 4 is
full, 5 and 6 refer to 4; retention retires 1 (its base data kept for 2 and 3), deletes 2 and 3,
collects what 1 kept once nothing refers to it, and retires 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zerostall as zs
from zerostall.roots.root import CheckpointRoot, step_tag
from zerostall.storage import LocalStorage

N = 1 << 14


def make_state(step: int) -> dict:
    """Step ``step``'s state: a frozen base, a big scratch tensor and a small one that change every
    step (the scratch tensor fills a data file of its own, which retention can delete alone)."""
    return {"base": torch.arange(N, dtype=torch.float32), "scratch": torch.full((2 * N,), float(step)),
            "lora": torch.full((64,), float(step))}


CHILD = textwrap.dedent('''
    import sys

    import torch

    sys.path.insert(0, {tests!r})
    import zerostall as zs
    from faults import FaultyStorage
    from zerostall.storage import LocalStorage

    N = {n}

    {make_state}

    path, op, name, at = sys.argv[1:]
    root = FaultyStorage(LocalStorage(path, fsync=False))
    root.crash(op, name=name, at=at)
    with zs.CheckpointManager(root, incremental=True, keep_last=2, full_save_every=3, fsync=False,
                              threads=2) as mgr:
        for step in range(1, 7):
            mgr.save(step, make_state(step))
            mgr.wait()
    sys.stderr.write("child: every save returned\\n")
    sys.exit(3)
''')

# stage -> the storage operation the child dies at: (op, file name under the root, before/after it)
STAGES = {
    "retire: record written": ("publish", f"{step_tag(1)}/retained.json", "after"),
    "retire: manifest deleted": ("delete", f"{step_tag(1)}/manifest.json", "after"),
    "retire: a data file deleted": ("delete", f"{step_tag(1)}/*.safetensors", "after"),
    "collect: record deleted": ("delete", f"{step_tag(1)}/retained.json", "after"),
    "incremental save: writing": ("write", f"{step_tag(5)}/*.safetensors", "before"),
    "incremental save: committed": ("publish", f"{step_tag(5)}/manifest.json", "after"),
    "retire a full save: record written": ("publish", f"{step_tag(4)}/retained.json", "after"),
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Run every stage at once, each in its own child process and root."""
    import inspect

    work = tmp_path_factory.mktemp("incremental-crash")
    script = work / "child.py"
    script.write_text(CHILD.format(tests=os.path.dirname(__file__), n=N, make_state=inspect.getsource(make_state)))
    procs = {}
    for n, (stage, (op, name, at)) in enumerate(STAGES.items()):
        root = work / f"root{n}"
        procs[stage] = (root, subprocess.Popen([sys.executable, str(script), str(root), op, name, at],
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for stage, (root, proc) in procs.items():
        out, err = proc.communicate(timeout=300)
        results[stage] = (root, proc.returncode, out + err)
    return results


def fresh() -> dict:
    return {"base": torch.zeros(N), "scratch": torch.zeros(2 * N), "lora": torch.zeros(64)}


def assert_every_committed_checkpoint_loads(root) -> list[int]:
    steps = []
    for info in CheckpointRoot(LocalStorage(str(root))).checkpoints():
        got = zs.load(fresh(), os.path.join(root, info.name))
        expected = make_state(info.step)
        assert all(torch.equal(got[k], expected[k]) for k in expected), info.name
        assert zs.verify(os.path.join(root, info.name)) > 0
        steps.append(info.step)
    return steps


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_kill_leaves_every_committed_checkpoint_loadable(killed, stage):
    root, returncode, output = killed[stage]
    assert returncode == -9, f"the child did not die by SIGKILL (rc={returncode}):\n{output[-3000:]}"
    assert "faults: SIGKILL at" in output
    steps = assert_every_committed_checkpoint_loads(root)
    assert steps, "no committed checkpoint survived"

    # a restarted manager (it removes the dead writer's attempts) restores the newest and goes on
    with zs.CheckpointManager(str(root), incremental=True, keep_last=2, full_save_every=3, fsync=False,
                              threads=2) as mgr:
        state = fresh()
        assert mgr.restore(state) == max(steps)
        assert torch.equal(state["lora"], make_state(max(steps))["lora"])
        for step in (7, 8, 9):
            mgr.save(step, make_state(step))
        mgr.wait()
    assert set(assert_every_committed_checkpoint_loads(root)) == {max(steps), 8, 9}  # restored: pinned

    # deleting every checkpoint leaves no data behind: nothing leaked, nothing stays referenced
    checkpoints = CheckpointRoot(LocalStorage(str(root)))
    for info in checkpoints.checkpoints():
        checkpoints.delete(info.name)
    checkpoints.collect_retained()
    assert [n for n in os.listdir(root) if n.startswith("step_")] == []
