"""A writer paused past its lease's ttl (SIGSTOP) and then resumed must not commit, move, delete or
renew anything under the root another manager has taken over meanwhile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zerostall as zs
from faults import FaultyStorage, wait_for
from zerostall.roots.lease import WriterLease
from zerostall.roots.root import LEASE_NAME
from zerostall.storage import LocalStorage

WAIT = 120.0  # a condition that never comes fails the test instead of hanging it (not a timing bound)
TTL = 1.0

PAUSED_WRITER = textwrap.dedent('''
    import os, signal, sys
    import torch
    sys.path.insert(0, {tests!r})
    import zerostall as zs
    from faults import FaultyStorage
    from zerostall.storage import LocalStorage

    root = FaultyStorage(LocalStorage(sys.argv[1]))
    mgr = zs.CheckpointManager(root, lease_ttl={ttl}, keep_last=1)
    mgr.save(1, {{"w": torch.full((8,), 1.0)}})
    # stop itself with step 2's data written, before its commit; the test takes the root meanwhile
    root.call("write", lambda op, name: os.kill(os.getpid(), signal.SIGSTOP), name="step_000000002/*", at="after",
              times=1)
    try:
        mgr.save(2, {{"w": torch.full((8,), 2.0)}})
        print("step 2: committed", flush=True)
    except zs.CheckpointError as exc:
        print("step 2: refused:", exc, flush=True)
    try:
        mgr.save(0, {{"w": torch.full((8,), 0.0)}})  # a rollback would set the new writer's steps aside
        print("step 0: committed", flush=True)
    except zs.CheckpointError as exc:
        print("step 0: refused:", exc, flush=True)
    mgr.close()
''')



def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def take_over(root) -> WriterLease:
    """The root's writer lease, once the paused writer's has gone stale (as a new manager takes it,
    without the clean-up a manager would also do, so the paused writer's attempt stays)."""
    lease = WriterLease(str(root), ttl=60.0)
    deadline = time.monotonic() + WAIT
    while True:
        try:
            lease.acquire()
            return lease
        except zs.CheckpointError as exc:
            if "is being written by" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc to see a stopped process")
def test_a_writer_resumed_after_losing_its_lease_commits_moves_and_renews_nothing(tmp_path):
    root = tmp_path / "ckpt"
    script = tmp_path / "writer.py"
    script.write_text(PAUSED_WRITER.format(tests=os.path.dirname(__file__), ttl=TTL))
    paused = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: paused.poll() is not None or stopped(paused.pid), "the writer to stop itself")
        assert paused.poll() is None, paused.communicate()
        lease = take_over(root)  # the paused writer's lease is stale after its ttl
        os.kill(paused.pid, signal.SIGCONT)
        out, err = paused.communicate(timeout=WAIT)
    finally:
        if paused.poll() is None:
            paused.kill()
    assert paused.returncode == 0, err
    assert "step 2: refused: this process no longer holds the writer lease" in out, out + err
    assert "step 0: refused: this process no longer holds the writer lease" in out, out + err
    assert json.loads((root / LEASE_NAME).read_text())["token"] == lease.me["token"]  # never renewed over ours
    assert not (root / "step_000000002" / "manifest.json").exists()  # its commit was refused
    assert json.loads((root / "latest").read_text())["tag"] == "step_000000001"
    assert not (root / ".superseded").exists()  # step 1 was not set aside by the rollback to step 0
    lease.release()
    with zs.CheckpointManager(root) as mgr:  # the next writer finds step 1 as it was
        state = {"w": torch.empty(8)}
        assert mgr.restore(state) == 1 and torch.equal(state["w"], torch.full((8,), 1.0))


def test_renewal_stops_once_another_process_holds_the_lease(tmp_path):
    lease = WriterLease(str(tmp_path), ttl=0.3)
    lease.acquire()
    theirs = {**json.loads((tmp_path / LEASE_NAME).read_text()), "pid": 1, "token": "another-writer"}
    (tmp_path / LEASE_NAME).write_text(json.dumps(theirs))  # taken over while this one was not looking
    lease._thread.join(timeout=WAIT)
    assert not lease._thread.is_alive(), "the renewal thread went on renewing a lease that is not its own"
    assert json.loads((tmp_path / LEASE_NAME).read_text()) == theirs
    lease.release()  # not ours: left in place
    assert json.loads((tmp_path / LEASE_NAME).read_text()) == theirs


def test_a_takeover_refused_at_the_switch_leaves_the_rival_s_lease_and_no_temp_file(tmp_path):
    dead = {"host": "elsewhere", "boot_id": "-", "pid": 1, "token": "dead-writer", "ttl": 1.0, "renewed": 0.0}
    rival = {**dead, "host": "rival", "token": "rival", "ttl": 60.0, "renewed": time.time()}
    (tmp_path / LEASE_NAME).write_text(json.dumps(dead))  # stale: this writer may take it over
    storage = FaultyStorage(LocalStorage(str(tmp_path)))
    storage.call("publish", lambda op, name: (tmp_path / LEASE_NAME).write_text(json.dumps(rival)),  # just before
                 name=LEASE_NAME, times=1)
    lease = WriterLease(storage, ttl=60.0)
    with pytest.raises(zs.CheckpointError, match="another manager took"):
        lease.acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text()) == rival
    assert sorted(os.listdir(tmp_path)) == [LEASE_NAME]  # the refused takeover's temp file is gone


def test_a_lease_that_cannot_be_read_for_a_while_is_neither_lost_nor_free(tmp_path):
    """Reads of the lease failing (an object store's 500s) were taken for "no lease": the writer
    stopped renewing for good, another manager took the root of a live writer over, and ``prune``
    deleted under it."""
    from click.testing import CliRunner

    from zerostall.cli import cli

    storage = FaultyStorage(LocalStorage(str(tmp_path)))
    lease = WriterLease(storage, ttl=0.3)
    lease.acquire()
    fault = storage.fail("read_bytes", OSError(5, "the store answered 500"), name=LEASE_NAME)
    time.sleep(1.0)  # three renewals come and go unable to read it
    assert lease._thread.is_alive(), "the renewal gave up on a lease it could not read"
    with pytest.raises(zs.StorageError, match="cannot read the writer lease"):
        WriterLease(storage, ttl=0.3).acquire()
    with pytest.raises(zs.StorageError, match="cannot read the writer lease"):
        lease.fence()()
    for step in (1, 2):
        zs.save({"w": torch.ones(2)}, str(tmp_path / f"step_00000000{step}"), step=step)
    from zerostall.cli import common

    real = common.live_holder
    common.live_holder = lambda root: real(storage)  # the command's view of the root, its lease reads failing
    try:
        result = CliRunner().invoke(cli, ["prune", str(tmp_path), "--keep-last", "1"])
    finally:
        common.live_holder = real
    assert result.exit_code != 0 and "an unknown writer" in result.output, result.output
    assert os.path.exists(tmp_path / "step_000000001" / "manifest.json")
    storage._faults.remove(fault)
    time.sleep(0.5)
    assert json.loads((tmp_path / LEASE_NAME).read_text())["renewed"] > time.time() - 0.3  # renewed again
    lease.release()
