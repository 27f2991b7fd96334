"""CheckpointManager: lifecycle, latest, retention on disk, leases, crashes, resume, ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import zerostall as zs
from faults import FaultyStorage, wait_for
from zerostall.format.layout import MANIFEST_NAME, SUPERSEDED_NAME
from zerostall.roots.resaving import RESAVING_NAME
from zerostall.roots.root import LEASE_NAME, step_tag
from zerostall.storage import LocalStorage


def part(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def saved_w(path) -> torch.Tensor:
    with zs.open(path) as ck:
        return ck.read("w")


def steps_on_disk(root) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_"))


def test_save_commit_latest_and_retention(tmp_path):
    with zs.CheckpointManager(tmp_path, keep_last=2, keep_every=5) as mgr:
        for step in range(1, 13):
            mgr.save(step, part(step))
            mgr.wait()
            assert json.loads((tmp_path / "latest").read_text())["tag"] == step_tag(step)
        assert steps_on_disk(tmp_path) == [5, 10, 11, 12]
        assert mgr.latest() == step_tag(12)


def test_each_manifest_is_parsed_once_while_it_stays_the_same(tmp_path):
    """Retention lists the checkpoints after every save: without a cache, a long run that keeps
    every N-th step parses every kept manifest again each time. Reads of manifests are seen
    through the root's storage."""
    root = FaultyStorage(LocalStorage(str(tmp_path)))

    def parsed() -> list[str]:
        return [name.split("/")[0] for name in root.names("read_bytes") if name.endswith("/manifest.json")]

    with zs.CheckpointManager(root, keep_every=2) as mgr:
        for step in range(1, 9):
            mgr.save(step, part(step))
            mgr.wait()
        assert steps_on_disk(tmp_path) == [2, 4, 6, 8]
        assert sorted(set(parsed())) == [step_tag(s) for s in range(1, 9)] and len(parsed()) == 8
        mgr.save(8, part(80))  # the same tag again: a new manifest, parsed anew
        mgr.wait()
        assert parsed()[-1] == step_tag(8) and len(parsed()) == 9
        assert mgr.latest() == step_tag(8) and len(parsed()) == 9
    target = part(0)
    with zs.CheckpointManager(tmp_path) as again:
        again.restore(target)
    assert torch.equal(target["w"], part(80)["w"])


def test_open_resolves_latest_named_and_missing(tmp_path):
    with zs.CheckpointManager(tmp_path) as mgr:
        assert mgr.open() is None and mgr.restore(part(0)) is None
        mgr.save(3, part(3))
        mgr.save(7, part(7), tag="best-so-far")
        with mgr.open() as ck:
            assert ck.tag == "best-so-far" and ck.step == 7
        with mgr.open(step_tag(3)) as ck:
            assert ck.tag == step_tag(3) and torch.equal(ck.read("w"), torch.full((4,), 3.0))
        with pytest.raises(zs.CheckpointNotFoundError, match="nope"):
            mgr.open("nope")



def test_a_tag_names_its_own_directory_never_a_root_of_checkpoints_inside_it(tmp_path):
    """zs.open of a root opens its newest; a manager's tag is one directory of its root: a directory
    that holds a root of checkpoints (here made after the manager started) is no checkpoint."""
    with zs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, part(1))
        zs.save(part(9), tmp_path / "nested" / step_tag(9), step=9)
        with pytest.raises(zs.CheckpointNotFoundError, match="no checkpoint 'nested' under"):
            mgr.open("nested")
        with pytest.raises(zs.CheckpointNotFoundError, match="no checkpoint 'nested' under"):
            mgr.restore(part(0), tag="nested")
        assert mgr.last_restore.step is None

def test_restore_resumes_model_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    with zs.CheckpointManager(tmp_path) as mgr:
        random.seed(11)
        mgr.save(1, {"model": model, "optim": optim})
        expected = (torch.rand(3), random.random())
    fresh = torch.nn.Linear(4, 2)
    fresh_optim = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(99)
    random.seed(99)
    with zs.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore({"model": fresh, "optim": fresh_optim}) == 1
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_optim.state[fresh.weight]["momentum_buffer"], optim.state[model.weight]["momentum_buffer"])


def test_best_never_evicts_the_newest_and_nan_is_never_best(tmp_path):
    with zs.CheckpointManager(tmp_path, keep_best=1, metric="loss") as mgr:
        for step, loss in [(1, 0.5), (2, 0.1), (3, float("nan")), (4, 0.9)]:
            mgr.save(step, part(step), metrics={"loss": loss})
            mgr.wait()
        assert steps_on_disk(tmp_path) == [2, 4]


def test_best_ranks_numpy_scalars_and_infinities_as_numbers(tmp_path):
    """The best loss was an np.float64 (what np.mean returns): stored encoded, it used to count as
    no metric, and retention deleted it; an infinite loss counts as the worst."""
    with zs.CheckpointManager(tmp_path, keep_best=1, metric="loss") as mgr:
        for step, loss in [(1, 0.9), (2, np.float64(0.1)), (3, np.float32(0.5)), (4, float("inf")), (5, 0.7)]:
            mgr.save(step, part(step), metrics={"loss": loss})
            mgr.wait()
        assert steps_on_disk(tmp_path) == [2, 5]
        assert [record.metrics["loss"] for _, record in mgr.checkpoints()] == [0.1, 0.7]


@pytest.mark.parametrize("async_save", [False, True])
def test_saving_after_a_rollback_sets_the_later_steps_aside(tmp_path, async_save, caplog):
    """Roll back to step 25 while 30 exists, then train on: retention and restore pick by step, so
    30 would evict each new checkpoint (keep_last=2) and a restart would resume the abandoned run.
    30 goes to .superseded/ at the first save after the rollback, whole and loadable."""
    with zs.CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in (20, 25, 30):
            mgr.save(step, part(step))
        mgr.wait()
    with zs.CheckpointManager(tmp_path, keep_last=2, async_save=async_save) as mgr:
        state = part(0)
        assert mgr.restore(state, step_tag(25)) == 25 and steps_on_disk(tmp_path) == [25, 30]
        for step in (26, 27, 28):
            state["w"].fill_(float(step))
            mgr.save(step, state)
            mgr.wait()
        assert steps_on_disk(tmp_path) == [25, 27, 28]  # 25: resumed from; 27, 28: the last two
        assert mgr.latest() == step_tag(28)
    assert "step_000000030 moved to" in caplog.text
    aside = tmp_path / ".superseded" / step_tag(30)
    assert torch.equal(saved_w(aside), part(30)["w"])
    zs.verify(aside)
    with zs.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(part(0)) == 28


def test_a_rollback_loses_no_committed_checkpoint_and_never_overwrites_what_was_set_aside(tmp_path):
    """A re-save of an existing step sets the old one aside too, as it does later steps; a second
    rollback past a step already set aside keeps both copies."""
    with zs.CheckpointManager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, part(step))
        mgr.save(2, part(20))  # steps 3 and the first 2 go aside
        assert steps_on_disk(tmp_path) == [1, 2]
        mgr.save(3, part(30))
        mgr.save(1, part(10))  # steps 1, 2 (20) and 3 (30) go aside; the earlier 2 and 3 are still there
        assert steps_on_disk(tmp_path) == [1]
    aside = sorted(os.listdir(tmp_path / ".superseded"))
    assert [name.split(".")[0] for name in aside] == [step_tag(1), step_tag(2), step_tag(2), step_tag(3), step_tag(3)]
    loaded = sorted(saved_w(tmp_path / ".superseded" / name)[0].item() for name in aside)
    assert loaded == [1.0, 2.0, 3.0, 20.0, 30.0]
    assert saved_w(tmp_path / step_tag(1))[0].item() == 10.0


def test_async_manager_commits_then_updates_latest_and_prunes(tmp_path):
    with zs.CheckpointManager(tmp_path, keep_last=1, async_save=True) as mgr:
        state = part(1)
        for step in range(1, 5):
            state["w"].fill_(float(step))
            handle = mgr.save(step, state)
            handle.wait_staged()
        mgr.wait()
        assert steps_on_disk(tmp_path) == [4]
        assert json.loads((tmp_path / "latest").read_text())["step"] == 4


def test_two_managers_on_one_root_are_refused(tmp_path):
    first = zs.CheckpointManager(tmp_path)
    with pytest.raises(zs.CheckpointError, match="being written by"):
        zs.CheckpointManager(tmp_path)
    first.close()
    zs.CheckpointManager(tmp_path).close()


def test_a_lease_of_another_host_is_taken_over_once_it_lapses_and_refused_once_renewed(tmp_path):
    """A job restarted on other nodes found its dead predecessor's lease (another host's) not yet
    past its ttl and failed at once, again at every restart until the ttl ran out. It now waits
    for the lease to lapse, or to be renewed by a holder that lives (refused then)."""
    gone = {"host": "a-node-that-died", "boot_id": "-", "pid": 1, "token": "gone", "ttl": 1.5, "renewed": time.time()}
    (tmp_path / LEASE_NAME).write_text(json.dumps(gone))
    with zs.CheckpointManager(tmp_path):
        assert json.loads((tmp_path / LEASE_NAME).read_text())["pid"] == os.getpid()
    alive = {**gone, "host": "a-node-alive", "token": "alive", "ttl": 30.0, "renewed": time.time()}
    (tmp_path / LEASE_NAME).write_text(json.dumps(alive))
    renewing = threading.Timer(0.5, lambda: (tmp_path / LEASE_NAME).write_text(json.dumps(
        {**alive, "renewed": time.time()})))
    renewing.start()
    with pytest.raises(zs.CheckpointError, match="being written by a-node-alive"):
        zs.CheckpointManager(tmp_path)
    renewing.join()


def test_lease_of_a_dead_process_is_taken_over(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    with zs.CheckpointManager(tmp_path) as mgr:
        lease = json.loads((tmp_path / LEASE_NAME).read_text())
    lease.update(pid=dead_pid, renewed=time.time(), token="someone-else")
    (tmp_path / LEASE_NAME).write_text(json.dumps(lease))
    with zs.CheckpointManager(tmp_path) as mgr:
        assert json.loads((tmp_path / LEASE_NAME).read_text())["pid"] == os.getpid()
        assert mgr.latest() is None


def crash_script(root, stage: str) -> str:
    """The second save of a manager on a fault-injecting root SIGKILLs itself while writing a data
    file, or just before ``latest`` is switched to it."""
    return textwrap.dedent(f"""
        import sys, torch, zerostall as zs
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from faults import FaultyStorage
        from zerostall.storage import LocalStorage

        root = FaultyStorage(LocalStorage({str(root)!r}))
        mgr = zs.CheckpointManager(root)
        mgr.save(1, {{"w": torch.ones(4)}})
        mgr.wait()
        if {stage!r} == "between_save_and_commit":
            root.crash("publish", name="latest", at="before_replace")
        else:
            root.crash("write", name="step_000000002/*", times=1)
        mgr.save(2, {{"w": torch.full((4,), 2.0)}})
    """)


@pytest.mark.parametrize("stage", ["between_save_and_commit", "while_writing"])
def test_crash_leaves_a_resumable_root(tmp_path, stage):
    proc = subprocess.run([sys.executable, "-c", crash_script(tmp_path, stage)], capture_output=True, timeout=120)
    where = "before_replace publish of latest" if stage == "between_save_and_commit" else "before write of step_000000002/"
    assert proc.returncode == -9 and f"faults: SIGKILL at {where}" in proc.stderr.decode(), proc.stderr.decode()
    target = {"w": torch.zeros(4)}
    with zs.CheckpointManager(tmp_path) as mgr:  # the dead writer's lease is stale: taken over
        step = mgr.restore(target)
    if stage == "between_save_and_commit":  # the manifest committed, `latest` was never updated
        assert step == 2 and json.loads((tmp_path / "latest").read_text())["step"] == 1
    else:  # the half-written step 2 never existed and is cleaned up at start
        assert step == 1 and steps_on_disk(tmp_path) == [1]
    assert torch.equal(target["w"], torch.full((4,), float(step)))


def uncommitted_step(root, step: int) -> tuple[str, bytes]:
    """A whole checkpoint of ``step`` whose manifest is held back: a writer just before its commit."""
    path = os.path.join(root, step_tag(step))
    zs.save(part(step), path, step=step, fsync=False)
    manifest = os.path.join(path, MANIFEST_NAME)
    with open(manifest, "rb") as f:
        data = f.read()
    os.unlink(manifest)
    return path, data


def on_first_rename(monkeypatch, before=None, after=None) -> None:
    """Run ``before``/``after`` around the first ``os.rename`` (the manager's cleanup moving a directory)."""
    real = os.rename
    calls = []

    def rename(src, dst, *args, **kwargs):
        calls.append(src)
        if len(calls) == 1 and before:
            before()
        real(src, dst, *args, **kwargs)
        if len(calls) == 1 and after:
            after()

    monkeypatch.setattr(os, "rename", rename)


def test_a_commit_racing_the_start_up_cleanup_is_kept_whole(tmp_path, monkeypatch):
    path, manifest = uncommitted_step(tmp_path, 1)

    def writer_commits() -> None:
        with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
            f.write(manifest)

    on_first_rename(monkeypatch, before=writer_commits)
    with zs.CheckpointManager(tmp_path) as mgr:
        assert mgr.latest() == step_tag(1)
    monkeypatch.undo()
    assert zs.verify(path) and torch.equal(zs.load(part(0), path)["w"], part(1)["w"])
    assert os.listdir(tmp_path) == [step_tag(1)]  # no trace of the cleanup; the lease went with close()


def test_a_commit_after_the_start_up_cleanup_moved_the_attempt_fails(tmp_path, monkeypatch):
    path, manifest = uncommitted_step(tmp_path, 1)
    failed = []

    def writer_commits() -> None:
        with pytest.raises(OSError):
            LocalStorage(path, fsync=False).publish(MANIFEST_NAME, "manifest.tmp", manifest)
        failed.append(True)

    on_first_rename(monkeypatch, after=writer_commits)
    with zs.CheckpointManager(tmp_path) as mgr:
        assert failed and mgr.latest() is None
    assert os.listdir(tmp_path) == []


def test_start_up_removes_attempts_and_interrupted_cleanups(tmp_path):
    uncommitted_step(tmp_path, 1)
    zs.save(part(2), os.path.join(tmp_path, step_tag(2)), step=2)
    os.makedirs(tmp_path / ".deleting-step_000000003.1234abcd" / "deep")
    for name in ("latest.1234abcd.tmp", ".writer-lease.5678ef01.tmp", "latest.9abc0123.tmp"):
        (tmp_path / name).write_text("{")  # publishes a crash interrupted...
        os.utime(tmp_path / name, (time.time() - 3600,) * 2)
    (tmp_path / "latest.fresh000.tmp").write_text("{")  # ...and one that may be another writer's, in flight
    with zs.CheckpointManager(tmp_path) as mgr:
        assert mgr.latest() == step_tag(2)
    assert sorted(os.listdir(tmp_path)) == ["latest.fresh000.tmp", step_tag(2)]


def open_while_a_commit_lands(root: str, ready: str) -> tuple[str, bool]:
    """Open the newest checkpoint while step 2 commits (the whole checkpoint ``ready`` renamed into
    place) right after rank 0 listed the root; any other rank that lists the root for itself does
    so only once step 2 is there. Returns the tag this rank opened and whether step 2 had landed."""
    storage = FaultyStorage(LocalStorage(root))
    mgr = zs.CheckpointManager(storage, lease_ttl=5.0)
    landed = os.path.join(root, step_tag(2))
    if dist.get_rank() == 0:
        storage.call("children", lambda op, name: os.rename(ready, landed), times=1, at="after")
    else:
        storage.call("children", lambda op, name: wait_for(lambda: os.path.exists(landed), f"{landed} to appear"), times=1)
    try:
        with mgr.open() as ck:
            ck.load({"w": torch.zeros(4)})
            tag = ck.tag
    finally:
        mgr.close()
    return tag, os.path.isdir(landed)


def test_ranks_agree_on_open_while_a_commit_lands(ranks, tmp_path):
    """Rank 0 resolves the checkpoint and every rank opens that one: a rank that listed the root
    itself would see step 2, committed after rank 0 looked, and open another checkpoint."""
    root = tmp_path / "root"
    zs.save(part(1), root / step_tag(1), step=1, fsync=False)
    zs.save(part(2), tmp_path / "ready", step=2, fsync=False)
    assert ranks(2).run(open_while_a_commit_lands, str(root), str(tmp_path / "ready")) == [(step_tag(1), True)] * 2


def test_retention_is_one_policy_given_whole_or_by_keywords(tmp_path):
    with zs.CheckpointManager(tmp_path, retention=zs.RetentionPolicy(keep_last=1), fsync=False) as mgr:
        assert mgr.policy == zs.RetentionPolicy(keep_last=1)
        for step in (1, 2, 3):
            mgr.save(step, part(step))
        mgr.wait()
        assert steps_on_disk(tmp_path) == [3]
    with zs.CheckpointManager(tmp_path, keep_best=2, metric="loss", mode="max", fsync=False) as mgr:
        assert mgr.policy == zs.RetentionPolicy(keep_best=2, metric="loss", mode="max")
    with pytest.raises(ValueError, match="retention=.*keep_last=.*mode="):
        zs.CheckpointManager(tmp_path, retention=zs.RetentionPolicy(keep_last=1), keep_last=2, mode="min")
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        zs.CheckpointManager(tmp_path, keep_last=0)
    zs.CheckpointManager(tmp_path, fsync=False).close()  # the refused ones took no lease


@pytest.mark.parametrize("async_save", [False, True])
def test_wait_staged_returns_once_the_state_is_captured(tmp_path, async_save):
    with zs.CheckpointManager(tmp_path, async_save=async_save, fsync=False) as mgr:
        mgr.wait_staged()  # nothing in flight
        state = part(1)
        mgr.save(1, state)
        mgr.wait_staged()
        state["w"].fill_(99.0)  # after staging: the checkpoint keeps what was captured
        mgr.wait()
    assert torch.equal(saved_w(tmp_path / step_tag(1)), part(1)["w"])


def test_restore_waits_for_the_asynchronous_save_in_flight(tmp_path):
    """It restored the step before (the one in flight not committed yet) into the state that save
    was still capturing: the state went back a step while ``latest`` named the newer one, or the
    save failed on the changed state."""
    gate = threading.Event()
    with zs.CheckpointManager(tmp_path, async_save=True, before_commit=gate.wait) as mgr:
        state = {"w": torch.zeros(1000)}
        gate.set()
        mgr.save(1, state).result()
        gate.clear()
        state["w"].fill_(2.0)
        handle = mgr.save(2, state)
        threading.Timer(0.5, gate.set).start()  # the commit of step 2 lands after restore is called
        assert mgr.restore(state) == 2 and torch.equal(state["w"], torch.full((1000,), 2.0))
        handle.result()
        assert mgr.latest() == step_tag(2)


def test_a_step_names_its_checkpoint_and_a_path_is_no_tag(tmp_path):
    """restore(state, 100) and open(100) (Orbax passes steps) raised TypeError from os.path.join;
    restore(state, "../other/step_…") loaded a checkpoint outside the root."""
    zs.save({"w": torch.ones(2)}, tmp_path / "other" / step_tag(7), step=7)
    with zs.CheckpointManager(tmp_path / "ck", fsync=False) as mgr:
        mgr.save(100, {"w": torch.full((2,), 3.0)})
        state = {"w": torch.zeros(2)}
        assert mgr.restore(state, 100) == 100 and torch.equal(state["w"], torch.full((2,), 3.0))
        with mgr.open(100) as ck:
            assert ck.step == 100
        for bad in (f"../other/{step_tag(7)}", -1):
            with pytest.raises(zs.InvalidPathError, match="invalid checkpoint tag"):
                mgr.restore(state, bad)
            with pytest.raises(zs.InvalidPathError, match="invalid checkpoint tag"):
                mgr.open(bad)


def test_a_root_given_as_a_storage_is_used_for_every_checkpoint(tmp_path):
    """A wrapper around the root (to inject faults, say) sees each checkpoint through child(tag)."""
    children = []

    class Watched(LocalStorage):
        def child(self, name: str) -> LocalStorage:
            children.append(name)
            return super().child(name)

    with zs.CheckpointManager(Watched(str(tmp_path), fsync=False), keep_last=1) as mgr:
        assert mgr.root == str(tmp_path)
        mgr.save(1, part(1))
        mgr.save(2, part(2), tag="two")
        with mgr.open() as ck:
            assert ck.tag == "two" and ck.path == str(tmp_path / "two")
    assert {step_tag(1), "two"} <= set(children)
    assert sorted(os.listdir(tmp_path)) == ["latest", "two"]


def test_a_manager_checkpoint_opened_and_loaded_is_not_unexpected_for_its_own_rng_entries(tmp_path):
    with zs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, part(1))
        with mgr.open() as ck:
            target = ck.load({"w": torch.zeros(4)})  # strict: the manager's __rng__ entries are not the user's
    assert torch.equal(target["w"], part(1)["w"])


def test_a_reader_follows_a_writing_run_and_learns_when_its_checkpoint_was_pruned(tmp_path):
    with zs.CheckpointManager(tmp_path, keep_last=1) as mgr:  # the writer holds the lease throughout
        mgr.save(1, part(1))
        with zs.open_latest(tmp_path) as ck:  # read-only: takes no lease
            assert ck.step == 1 and ck.tag == step_tag(1)
            mgr.save(2, part(2))
            mgr.wait()  # retention deleted step 1 under the open session
            with pytest.raises(zs.CheckpointError, match="was deleted: pruned by retention") as err:
                ck.load({"w": torch.zeros(4)})
            assert not isinstance(err.value, zs.CorruptCheckpointError)
        with zs.open_latest(tmp_path) as ck:
            assert ck.step == 2 and torch.equal(ck.read("w"), part(2)["w"])
        with pytest.raises(zs.CheckpointNotFoundError, match=r"no committed checkpoint of step 1 .*steps there: 2"):
            zs.open_latest(tmp_path, step=1)
    with pytest.raises(zs.CheckpointNotFoundError, match="no committed checkpoint under"):
        zs.open_latest(tmp_path / "empty")


def test_restore_puts_python_values_and_tuples_back_into_the_state(tmp_path):
    with zs.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(5, {"w": torch.ones(2), "epoch": 7, "pair": (1, torch.zeros(1)), "nested": {"e": 3}})
        state = {"w": torch.zeros(2), "epoch": 0, "pair": (0, torch.ones(1)), "nested": {"e": 0}}
        assert m.restore(state) == 5
    assert state["epoch"] == 7 and state["nested"] == {"e": 3}
    assert state["pair"][0] == 1 and torch.equal(state["pair"][1], torch.zeros(1))
    assert torch.equal(state["w"], torch.ones(2))


@pytest.mark.parametrize("step, metrics, message", [
    ("2", None, r"step='2' is not a training step"), (True, None, r"step=True is not a training step"),
    (-1, None, r"step=-1 is not a training step"), (3, "fast", r"metrics='fast' is not a dict"),
    (3, {"loss": "low"}, r"metrics 'loss' \(= 'low'\) is not a number")])
def test_a_step_or_metrics_listing_could_not_rank_are_refused_at_save(tmp_path, step, metrics, message):
    with zs.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(1, {"w": torch.ones(2)})
        with pytest.raises(zs.UnsupportedValueError, match=message):
            m.save(step, {"w": torch.ones(2)}, metrics=metrics)
        with pytest.raises(zs.UnsupportedValueError, match=r"step='2'"):
            zs.save({"w": torch.ones(2)}, tmp_path / "ckpt" / "other", step="2")
        m.save(np.int64(4), {"w": torch.ones(2)}, metrics={"loss": 1})
        assert m.latest() == "step_000000004" and [r.step for _, r in m.checkpoints()] == [1, 4]


def start_then_roll_back_without_the_lease(root: str) -> list[str]:
    """Rank 0's lease is taken by another writer, then every rank saves an earlier step (a rollback,
    which sets later steps aside on rank 0 first); also a second manager on the held root. Returns
    what each attempt raised on this rank."""
    seen = []
    mgr = zs.CheckpointManager(root, lease_ttl=60.0)
    try:
        for step in (1, 2):
            mgr.save(step, part(step))
        mgr.wait()  # step 2's retention done while this process still holds the lease (it would fail after)
        dist.barrier()
        if dist.get_rank() == 0:
            lease = json.loads((Path(root) / LEASE_NAME).read_text())
            (Path(root) / LEASE_NAME).write_text(json.dumps({**lease, "token": "another-writer"}))
        dist.barrier()
        try:
            mgr.save(1, part(1))
        except zs.CheckpointError as exc:
            seen.append(str(exc))
        try:
            zs.CheckpointManager(root)
        except zs.CheckpointError as exc:
            seen.append(str(exc))
    finally:
        mgr.close()
    return seen


def test_a_refusal_on_rank_0_before_a_save_is_raised_on_every_rank(ranks, tmp_path):
    """Setting steps aside and taking the lease happen on rank 0 only; when rank 0 refuses (the lease
    was taken over, the root is held), every rank raises at once instead of waiting in the save's
    first collective for a rank that will never come."""
    seen = ranks(2).run(start_then_roll_back_without_the_lease, str(tmp_path / "root"), timeout=60)
    for rank_seen in seen:
        assert len(rank_seen) == 2, seen
        assert "is being written by" in rank_seen[1]
    assert "no longer holds the writer lease" in seen[0][0]
    assert "1 other rank(s) could not prepare this save" in seen[1][0]  # told in the save's own first collective
    assert steps_on_disk(tmp_path / "root") == [1, 2]  # nothing was set aside or saved over


def collectives_of_a_save(root: str, plain: str) -> tuple[dict[str, int], dict[str, int]]:
    """The zerostall collectives (Group methods) this rank runs in a manager's save and in a plain
    zs.save, each a save after the first (its plan then cached)."""
    from zerostall.collectives import Group

    counts: dict[str, int] = {}
    originals = {name: getattr(Group, name) for name in
                 ("broadcast_bytes", "all_reduce_ints", "all_gather_object", "broadcast_tensor")}

    def counting(name, method):
        def run(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return method(self, *args, **kwargs)
        return run

    def counted(save) -> dict[str, int]:
        counts.clear()
        for name, method in originals.items():
            setattr(Group, name, counting(name, method))
        try:
            save()
        finally:
            for name, method in originals.items():
                setattr(Group, name, method)
        return dict(counts)

    with zs.CheckpointManager(root, fsync=False) as mgr:
        mgr.save(1, part(1))
        in_manager = counted(lambda: mgr.save(2, part(2)))
    zs.save(part(1), f"{plain}/1", fsync=False)
    in_plain = counted(lambda: zs.save(part(2), f"{plain}/2", fsync=False))
    return in_manager, in_plain


def test_a_manager_save_runs_no_collective_beyond_its_saves_own(ranks, tmp_path):
    """The manager's checks before a save (set steps aside, settle the last commit) run on rank 0
    inside the save's own first collective: a manager save costs what a plain save does."""
    for in_manager, in_plain in ranks(2).run(collectives_of_a_save, str(tmp_path / "root"), str(tmp_path / "plain")):
        assert in_manager == in_plain, (in_manager, in_plain)


RESAVE = textwrap.dedent("""
    import functools, os, signal, sys, torch, zerostall as zs
    root, value, call = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    kill = functools.partial(os.kill, os.getpid(), signal.SIGKILL)
    mgr = zs.CheckpointManager(root, fsync=False, before_commit=kill if value < 0 else None)
    step, _, tag = call.partition(":")
    mgr.save(int(step), {"w": torch.full((4,), value)}, tag=tag or None)
    mgr.close()
""")


@pytest.mark.parametrize("call, restores, then", [
    ("200", 2.0, {"root": [100, 200, "best"], "aside": []}),  # saved over: the old one is back
    ("200:best", 2.0, {"root": [100, 200, "best"], "aside": []}),
    ("300:first", None, {"root": [100, 200, "best"], "aside": []}),  # a new tag's attempt is removed
    ("150", None, {"root": [100], "aside": [200, "best"]}),  # a rollback: the run forked, later ones stay aside
])
def test_a_save_killed_before_it_commits_leaves_the_root_as_it_was(tmp_path, call, restores, then):
    """A save SIGKILLed just before its commit, over a committed checkpoint or under a tag: the next
    manager puts back what the save set aside and removes its attempt, so restore finds the same
    checkpoint as before the save (a rollback's later steps stay set aside)."""
    def run(value: float, what: str) -> int:
        return subprocess.run([sys.executable, "-c", RESAVE, str(tmp_path), str(value), what], timeout=120).returncode

    assert [run(v, w) for v, w in [(1.0, "100"), (2.0, "200"), (2.0, "200:best")]] == [0, 0, 0]
    assert run(-1.0, call) == -signal.SIGKILL
    target = {"w": torch.zeros(4)}
    with zs.CheckpointManager(tmp_path) as mgr:
        tag = call.partition(":")[2] or step_tag(int(call))
        if restores is None:
            with pytest.raises(zs.CheckpointNotFoundError):
                mgr.restore(target, tag)
        else:
            assert mgr.restore(target, tag) in (100, 200) and torch.equal(target["w"], torch.full((4,), restores))
        assert mgr.restore(target) == max(s for s in then["root"] if isinstance(s, int))
        names = sorted(n for n in os.listdir(tmp_path) if not n.startswith(".") and n != "latest")
        assert names == sorted(step_tag(s) if isinstance(s, int) else s for s in then["root"])
        aside = sorted(os.listdir(tmp_path / SUPERSEDED_NAME)) if (tmp_path / SUPERSEDED_NAME).exists() else []
        assert aside == sorted(step_tag(s) if isinstance(s, int) else s for s in then["aside"])
        assert not (tmp_path / RESAVING_NAME).exists()


def resaves_of_300_that_fail(mgr: zs.CheckpointManager):
    """Save steps 100, 200, 300 and ``best`` (300), then fail to save step 300 and ``best`` again
    (at their commit); returns the commit fence the manager had."""
    def fail() -> None:
        raise OSError(5, "the disk went away")

    for step in (100, 200, 300):
        mgr.save(step, part(step))
    mgr.save(300, part(300), tag="best")
    fence = mgr._save_options.before_commit
    mgr._save_options = dataclasses.replace(mgr._save_options, before_commit=fail)
    for tag in (None, "best"):
        with pytest.raises((OSError, zs.CheckpointError), match="the disk went away"):
            mgr.save(300, part(301), tag=tag)
            mgr.wait()  # an asynchronous save's failure
    return fence


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_over_a_checkpoint_that_failed_is_undone_at_once(tmp_path, async_save):
    """The failed re-save of step 300 and of ``best`` left them set aside until the next save: the
    root listed step 200 as its newest (``latest`` named a folder with no manifest), a restore took
    step 200, and ``best`` was not found."""
    with zs.CheckpointManager(tmp_path, fsync=False, async_save=async_save) as mgr:
        resaves_of_300_that_fail(mgr)
        assert mgr.latest() == step_tag(300) and saved_w(tmp_path / step_tag(300))[0] == 300
        assert saved_w(tmp_path / "best")[0] == 300 and not os.listdir(tmp_path / SUPERSEDED_NAME)
        target = part(0)
        assert mgr.restore(target, "best") == 300 and torch.equal(target["w"], part(300)["w"])
        assert mgr.restore(target) == 300 and torch.equal(target["w"], part(300)["w"])
    assert not (tmp_path / SUPERSEDED_NAME).exists() or os.listdir(tmp_path / SUPERSEDED_NAME) == []


def test_a_save_over_a_checkpoint_that_failed_is_undone_before_the_next_save(tmp_path):
    """A re-save of step 300 failed and the run went on: its journal entry stayed. After a rollback
    to 100 and a save of 150, the next manager moved the old step 300 back, and restore resumed the
    abandoned run. A tag whose re-save failed kept its old copy set aside for good."""
    with zs.CheckpointManager(tmp_path, fsync=False) as mgr:
        fence = resaves_of_300_that_fail(mgr)
        mgr._save_options = dataclasses.replace(mgr._save_options, before_commit=fence)
        assert mgr.restore(part(0), 100) == 100
        mgr.save(150, part(150))
        mgr.save(150, part(150), tag="best")
    with zs.CheckpointManager(tmp_path) as mgr:
        target = part(0)
        assert mgr.restore(target) == 150 and saved_w(tmp_path / "best")[0].item() == 150.0
    aside = sorted(os.listdir(tmp_path / SUPERSEDED_NAME))  # the rollback's: the run forked at 150
    assert aside == ["best", step_tag(200), step_tag(300)] and saved_w(tmp_path / SUPERSEDED_NAME / "best")[0] == 300


UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]  # a process in a PID namespace of its own, as in a container
HOLD = """
import sys, time, torch, zerostall as zs
mgr = zs.CheckpointManager(sys.argv[1], lease_ttl=6.0, fsync=False)  # longer than an import of torch
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _unshare_works() -> bool:
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (a PID namespace of its own)")
def test_a_lease_from_another_pid_namespace_is_judged_by_its_renewals_not_its_pid(tmp_path):
    """Containers share the host's name and boot: a container restarted at once after its writer
    was killed found the lease naming pid 1, its own pid, alive, and was refused until the ttl ran
    out. A pid of another PID namespace names nothing here: only the lease's renewals say whether
    its writer lives."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent / "src"))
    writer = subprocess.Popen([*UNSHARE, sys.executable, "-c", HOLD, str(tmp_path), "60"], stdout=subprocess.PIPE,
                              text=True, env=env, start_new_session=True)
    try:
        assert writer.stdout.readline().strip() == "holding"
        with pytest.raises(zs.CheckpointError, match="being written by"):  # it renews: alive
            zs.CheckpointManager(tmp_path, lease_ttl=6.0)
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()
    restarted = subprocess.run([*UNSHARE, sys.executable, "-c", HOLD, str(tmp_path), "0"], capture_output=True,
                               text=True, env=env, timeout=60)
    assert restarted.returncode == 0 and restarted.stdout.strip() == "holding", restarted.stderr[-2000:]


def test_a_manager_dropped_without_close_gives_up_the_root(tmp_path):
    """A manager dropped without ``close()`` (a notebook cell run again, an exception before the
    close) went on renewing its lease from a daemon thread: no manager could open the root again
    in that process."""
    import gc

    def saved_and_dropped() -> None:
        mgr = zs.CheckpointManager(tmp_path, fsync=False)
        mgr.save(1, part(1))
        mgr.wait()  # its retention round done: nothing in the background refers to it

    saved_and_dropped()
    gc.collect()
    with zs.CheckpointManager(tmp_path) as again:
        target = part(0)
        assert again.restore(target) == 1 and torch.equal(target["w"], part(1)["w"])
