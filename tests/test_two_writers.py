"""Two processes saving into one path: one commits, the other is refused, and the checkpoint left
there is whole (its data files were never deleted by the other writer)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zerostall as zs
from faults import FaultyStorage, wait_for
from zerostall.storage import LocalStorage

WAIT = 120.0  # a condition that never comes fails the test instead of hanging it (not a timing bound)

WRITER = textwrap.dedent('''
    import os, sys, time
    import torch
    sys.path.insert(0, {tests!r})
    import zerostall as zs
    from faults import FaultyStorage
    from zerostall.storage import LocalStorage

    path, fill, gate = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    storage = FaultyStorage(LocalStorage(path))

    def checked_then_wait(op, name):  # right after the commit's last-moment check, before the switch
        open(gate + ".reached", "w").close()
        deadline = time.monotonic() + {wait}
        while not os.path.exists(gate + ".open"):
            if time.monotonic() > deadline:
                raise SystemExit("the gate was never opened")
            time.sleep(0.01)

    if gate != "-":  # the 1st read of the manifest's head is the save's start, the 2nd its commit check
        storage.call("read_head", checked_then_wait, name="manifest.json", from_call=2, at="after")
    try:
        zs.save({{"w": torch.full((1 << 16,), fill), "b": torch.full((64,), fill)}}, storage, overwrite=True)
    except zs.CheckpointError as exc:
        print("refused:", exc)
    else:
        print("committed")
''')



def waiting_for_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked waiting for a file lock (a ``->`` line of /proc/locks)."""
    with open("/proc/locks") as f:
        return any("->" in line and f" {pid} " in line for line in f)


def writer(script: Path, path: Path, fill: float, gate: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(path), str(fill), gate],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux /proc/locks to see a blocked writer")
def test_a_second_writer_cannot_commit_between_the_first_ones_check_and_switch(tmp_path):
    """A passes its last-moment check and stops before its switch; B saves meanwhile. Without the
    commit lock, B commits and its clean-up deletes A's (older) files, so A's switch fails or
    publishes a manifest naming deleted files. With it, B waits for A's switch, then is refused."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=os.path.dirname(__file__), wait=WAIT))
    path = tmp_path / "ck"
    zs.save({"w": torch.zeros(1 << 16), "b": torch.zeros(64)}, path)
    gate = str(tmp_path / "gate")
    a = writer(script, path, 1.0, gate)
    wait_for(lambda: os.path.exists(gate + ".reached") or a.poll() is not None, "writer A at its switch")
    b = writer(script, path, 2.0, "-")
    wait_for(lambda: b.poll() is not None or waiting_for_a_lock(b.pid), "writer B to finish or wait for the lock")
    Path(gate + ".open").touch()
    out_a, err_a = a.communicate(timeout=WAIT)
    out_b, err_b = b.communicate(timeout=WAIT)
    assert a.returncode == 0 and b.returncode == 0, err_a + err_b
    assert out_a.strip() == "committed", out_a + err_a
    assert out_b.startswith("refused:") and "another checkpoint" in out_b, out_b + err_b
    zs.verify(path)
    got = zs.load({"w": torch.empty(1 << 16), "b": torch.empty(64)}, path)
    assert torch.equal(got["w"], torch.full((1 << 16,), 1.0)) and torch.equal(got["b"], torch.full((64,), 1.0))


def test_a_manifest_in_place_that_cannot_be_read_stops_the_save_not_blaming_another_writer(tmp_path):
    """Its first read failed (an I/O error) and was taken for "no checkpoint here": the commit's
    check, reading the checkpoint in place, then refused the save as one racing another writer."""
    zs.save({"w": torch.zeros(8)}, tmp_path, fsync=False)
    storage = FaultyStorage(LocalStorage(str(tmp_path), fsync=False))
    failed = storage.fail("read_head", OSError(errno.EIO, "Input/output error"), name="manifest.json", times=1)
    with pytest.raises(zs.CheckpointError, match="cannot be read.*Input/output error.*untouched"):
        zs.save({"w": torch.ones(8)}, storage, overwrite=True)
    assert failed.count == 1 and torch.equal(zs.load({"w": torch.full((8,), 5.0)}, tmp_path)["w"], torch.zeros(8))
