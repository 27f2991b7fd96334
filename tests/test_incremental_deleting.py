"""Incremental checkpoints and every path that moves or replaces one: a named checkpoint saved
again, a rollback onto a step whose data was retained, a reference scan that cannot read a
manifest, an overwrite with referrers set aside. A committed checkpoint never loses what it refers to."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import pytest

import zerostall as zs
from hostile import read_body
import test_incremental
from test_incremental import load, make_state, manager, same, snapshot
from zerostall.roots.increments import Increments
from zerostall.roots.root import step_tag
from zerostall.storage import local

chain = test_incremental.chain  # the fixture: steps 1 and 2, step 2 referring to step 1


def test_a_named_checkpoint_is_saved_whole_so_saving_its_name_again_breaks_nothing(tmp_path):
    """``best`` was the base of the next step's save; saving ``best`` again set the old one aside,
    and the step referring to it stopped loading (or the new ``best`` referred to itself and was
    refused)."""
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(10, state, tag="best")
        state["model"]["lora"].add_(1)
        mgr.save(20, state)
        step_20 = snapshot(state)
        state["model"]["lora"].add_(1)
        mgr.save(30, state, tag="best")
        state["model"]["lora"].add_(1)
        mgr.save(40, state)
    assert read_body(tmp_path / "best").get("refs", {}) == {}
    assert set(read_body(tmp_path / step_tag(40))["refs"].values()) == {step_tag(20)}  # not the named one
    assert same(load(tmp_path, 20, state), step_20) and same(load(tmp_path, 40, state), state)


def test_a_save_that_would_set_aside_what_a_staying_checkpoint_refers_to_moves_nothing(tmp_path, monkeypatch):
    """A root written when a named checkpoint could be a base (an earlier version): saving that
    name again moved it aside under a step that refers to it. Now refused first, naming both."""
    def any_base(self, step, tag):  # the earlier rule: the last save, named or not, is the next one's base
        last, self._last = self._last, None
        return None if last is None or last.tag == tag or last.step >= step else last

    def any_committed(self, info):
        self._last = info.reuse

    monkeypatch.setattr(Increments, "base", any_base)
    monkeypatch.setattr(Increments, "committed", any_committed)
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(10, state)
        state["model"]["frozen"].add_(1)
        mgr.save(20, state, tag="best")
        state["model"]["lora"].add_(1)
        mgr.save(30, state)
        step_30 = snapshot(state)
        assert "best" in read_body(tmp_path / step_tag(30))["refs"].values()
        with pytest.raises(zs.CheckpointError, match=f"{step_tag(30)} refers to data files of best.*nothing was moved"):
            mgr.save(40, state, tag="best")
    assert not (tmp_path / ".superseded").exists() and same(load(tmp_path, 30, state), step_30)


def test_a_rollback_onto_a_step_whose_data_was_retained_sets_it_aside_with_its_referrers(tmp_path):
    """Retention left step 2's data behind a retained record (step 3 refers to it); saving step 2
    again set step 3 aside, then refused the retained directory: the root held no later step, and a
    new run's restore started from scratch."""
    state = make_state()
    with manager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, state)
        state["model"]["frozen"].add_(1)
        mgr.save(2, state)
        state["model"]["lora"].add_(1)
        mgr.save(3, state)
        step_3 = snapshot(state)
        mgr.wait()
        assert "retained.json" in os.listdir(tmp_path / step_tag(2))
        state["model"]["lora"].add_(1)
        mgr.save(2, state)
    with manager(tmp_path) as mgr:
        assert mgr.restore(make_state()) == 2
    assert sorted(os.listdir(tmp_path / ".superseded")) == [step_tag(2), step_tag(3)]
    os.rename(tmp_path / step_tag(2), tmp_path / "new")  # move both back, as the warnings say
    for step in (2, 3):
        os.rename(tmp_path / ".superseded" / step_tag(step), tmp_path / step_tag(step))
    assert same(load(tmp_path, 3, state), step_3)


def test_a_manifest_that_cannot_be_read_during_retention_keeps_everything_it_may_refer_to(tmp_path, monkeypatch):
    """Retention counted references only from the manifests it could read: one read error (an
    NFS or object store hiccup) on the newest step's manifest made what it refers to look
    unreferenced, and retention deleted it: the only checkpoint left did not load."""
    stat = local.LocalStorage.stat
    calls = []

    def flaky(self, name):
        if name == "manifest.json" and self.location.endswith(step_tag(3)) \
                and threading.current_thread().name.startswith("zerostall-retention"):
            calls.append(name)
            if len(calls) >= 2:  # the listing that chose what to delete read it; the next one cannot
                raise OSError(errno.EIO, "Input/output error")
        return stat(self, name)

    state = make_state()
    with manager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, state)
        state["model"]["frozen"].add_(1)
        mgr.save(2, state)
        mgr.wait()
        monkeypatch.setattr(local.LocalStorage, "stat", flaky)
        state["model"]["lora"].add_(1)
        mgr.save(3, state)
        with pytest.raises(zs.CheckpointError, match=f"cannot read the manifest of .*{step_tag(3)}"):
            mgr.wait()  # that retention round deleted nothing
        assert same(load(tmp_path, 3, state), state)
        monkeypatch.setattr(local.LocalStorage, "stat", stat)
        state["model"]["lora"].add_(1)
        mgr.save(4, state)  # the next round retires what it may
    assert same(load(tmp_path, 4, state), state)


def test_a_failed_retention_round_is_raised_by_wait_even_after_a_later_save_committed(tmp_path, monkeypatch):
    """A later save's round replaced the failed round's future, so wait() raised nothing and the
    failure went unseen; now every round after it fails too (having run) until a wait() raises it."""
    stat = local.LocalStorage.stat
    calls = []

    def failing(self, name):  # the second read only: the round's listing reads it, its reference scan cannot
        if name == "manifest.json" and self.location.endswith(step_tag(2)) \
                and threading.current_thread().name.startswith("zerostall-retention"):
            calls.append(name)
            if len(calls) == 2:
                raise OSError(errno.EIO, "Input/output error")
        return stat(self, name)

    state = make_state()
    with manager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, state)
        mgr.wait()
        monkeypatch.setattr(local.LocalStorage, "stat", failing)
        state["model"]["lora"].add_(1)
        mgr.save(2, state)  # its round cannot read step 2's manifest
        state["model"]["lora"].add_(1)
        mgr.save(3, state)  # its round works, and retires steps 1 and 2
        with pytest.raises(zs.CheckpointError, match=f"cannot read the manifest of .*{step_tag(2)}"):
            mgr.wait()
        mgr.save(4, state)
        mgr.wait()  # raised once
        assert [name for name, _ in mgr.checkpoints()] == [step_tag(4)]
    assert same(load(tmp_path, 4, state), state)

def three_steps_then_a_rollback(mgr: zs.CheckpointManager, state: dict) -> dict:
    """Steps 1 to 3 (only the small tensor changes), then step 2 again: steps 2 and 3 set aside, each
    referring to step 1. Returns step 3's state."""
    for step in (1, 2, 3):
        state["model"]["lora"].add_(1)
        mgr.save(step, state)
    step_3 = snapshot(state)
    state["model"]["lora"].add_(1)
    mgr.save(2, state)
    return step_3


def test_replacing_a_checkpoint_that_one_set_aside_refers_to_is_refused(tmp_path):
    """Only the checkpoints in the root were asked: one set aside by a rollback (which the warning
    says to move back to resume from) referred to step 1, and ``overwrite=True`` replaced it."""
    state = make_state()
    with manager(tmp_path) as mgr:
        step_3 = three_steps_then_a_rollback(mgr, state)
    assert step_tag(1) in read_body(tmp_path / ".superseded" / step_tag(3))["refs"].values()
    with pytest.raises(zs.CheckpointError, match=f".superseded/{step_tag(3)}.*refer to"):
        zs.save(make_state(), tmp_path / step_tag(1), overwrite=True)
    os.rename(tmp_path / step_tag(2), tmp_path / "new")  # move the set-aside steps back
    for step in (2, 3):
        os.rename(tmp_path / ".superseded" / step_tag(step), tmp_path / step_tag(step))
    assert same(load(tmp_path, 3, state), step_3)


def test_an_overwrite_checks_for_referrers_again_just_before_it_commits(tmp_path):
    """The check ran when the overwrite began: a manager's save that committed meanwhile, referring
    to the checkpoint being replaced, lost those bytes when the overwrite committed."""
    state = make_state()
    mgr = manager(tmp_path)
    mgr.save(1, state)
    saved = {}

    def meanwhile() -> None:  # just before the overwrite commits, another writer commits step 2
        state["model"]["lora"].add_(1)
        mgr.save(2, state)
        saved[2] = snapshot(state)

    with pytest.raises(zs.CheckpointError, match=f"{step_tag(2)}.*refer to"):
        zs.save(make_state(), tmp_path / step_tag(1), overwrite=True, fsync=False, before_commit=meanwhile)
    mgr.close()
    assert same(load(tmp_path, 2, state), saved[2])


def test_a_referenced_file_that_is_missing_is_named_where_it_lies(chain):
    """The error named the referring checkpoint's directory, where the file never was."""
    tmp_path, body = chain  # step 2 refers to step 1
    state = make_state()
    name = next(iter(body["refs"]))
    os.remove(tmp_path / step_tag(1) / name)
    with pytest.raises(zs.CorruptCheckpointError, match=f"{name} of .*{step_tag(2)} \\(it lies in {step_tag(1)}"):
        load(tmp_path, 2, state)


def test_a_named_save_below_the_last_step_leaves_no_base_it_set_aside(tmp_path):
    """``save(50, tag="best")`` set step 100 aside, yet the next step's save still referred to it
    and failed (its data was gone from the root)."""
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(100, state)
        mgr.save(50, state, tag="best")
        state["model"]["lora"].add_(1)
        mgr.save(150, state)
    assert same(load(tmp_path, 150, state), state)


def test_a_folder_set_aside_that_holds_nothing_refers_to_nothing(tmp_path):
    """An empty folder under ``.superseded/`` (left by moving a checkpoint back by hand) failed
    every save's retention as a manifest that cannot be read."""
    state = make_state()
    (tmp_path / ".superseded" / step_tag(9)).mkdir(parents=True)
    with manager(tmp_path, keep_last=1) as mgr:
        for step in (1, 2, 3):
            state["model"]["lora"].add_(1)
            mgr.save(step, state)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step_")) == [step_tag(1), step_tag(3)]


def test_a_step_whose_data_was_retained_is_saved_again_with_no_later_step_left(tmp_path):
    """Steps 10, 20, 30 (keep_last=1: step 20 retained for 30); ``save(15)`` set 30 aside; then
    ``save(20)`` was refused (the folder held retained data), and the run could not go past step 20."""
    state = make_state()
    with manager(tmp_path, keep_last=1) as mgr:
        for step in (10, 20, 30):
            state["model"]["frozen" if step == 20 else "lora"].add_(1)
            mgr.save(step, state)
        mgr.wait()
        assert "retained.json" in os.listdir(tmp_path / step_tag(20))
        for step in (15, 20):
            state["model"]["lora"].add_(1)
            mgr.save(step, state)
    assert same(load(tmp_path, 20, state), state)
    assert sorted(os.listdir(tmp_path / ".superseded")) == [step_tag(20), step_tag(30)]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_saved_again_is_replaced_once_the_new_one_commits(tmp_path, async_save):
    """A tag saved again at every improvement, and the step a run resumed from saved again, each
    set the old one aside for good: ``.superseded/`` grew by a whole checkpoint each time."""
    state = make_state()
    with manager(tmp_path, async_save=async_save) as mgr:
        for step in (10, 20, 30):
            mgr.wait_staged()
            state["model"]["lora"].add_(1)
            mgr.save(step, state)
            mgr.save(step, state, tag="best")
        mgr.save(30, state)
    assert sorted(os.listdir(tmp_path / ".superseded")) == []
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["best", "latest", *map(
        step_tag, (10, 20, 30))]
    assert same(load(tmp_path, 30, state), state) and same(zs.load(make_state(), tmp_path / "best"), state)


def test_a_replaced_checkpoint_that_one_set_aside_refers_to_stays(tmp_path):
    """Steps 2 and 3, set aside by a rollback, refer to step 1's files: step 1 saved again keeps the
    old one set aside, so all three can be moved back and load."""
    state = make_state()
    with manager(tmp_path) as mgr:
        step_3 = three_steps_then_a_rollback(mgr, state)
        shutil.rmtree(tmp_path / step_tag(2))
        state["model"]["frozen"].add_(1)
        mgr.save(1, state)  # saved again alone: the old step 1 goes aside, and stays there
    assert sorted(os.listdir(tmp_path / ".superseded")) == [step_tag(1), step_tag(2), step_tag(3)]
    os.rename(tmp_path / step_tag(1), tmp_path / "new")
    for step in (1, 3):
        os.rename(tmp_path / ".superseded" / step_tag(step), tmp_path / step_tag(step))
    assert same(load(tmp_path, 3, state), step_3)


def test_the_base_of_a_save_in_flight_stays_while_a_tag_commits_and_retention_runs(tmp_path, monkeypatch):
    """keep_last=1: step 3's save took step 1 as its base, then ``best`` (step 2) committed and its
    retention round, no longer seeing step 1 pinned, deleted it: step 3 failed, or committed
    referring to deleted files (nothing under the root loaded any more)."""
    import zerostall.saving.pipeline as pipeline
    state = make_state()
    real = pipeline.split_unchanged
    with manager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, state)
        state["model"]["lora"].add_(1)
        mgr.save(2, state, tag="best")

        def after_the_retention_round(*args, **kwargs):
            mgr._pending_delete.result()  # best's round, run while step 3 is being saved
            return real(*args, **kwargs)

        monkeypatch.setattr(pipeline, "split_unchanged", after_the_retention_round)
        state["model"]["lora"].add_(1)
        info = mgr.save(3, state)
        assert set(read_body(tmp_path / step_tag(3))["refs"].values()) == {step_tag(1)} and info.step == 3
    assert same(load(tmp_path, 3, state), state)


def test_a_reference_through_a_link_to_another_directory_is_refused(tmp_path):
    """A copy of step 2 beside a link to another root's step 1 was read through the link: an
    incremental checkpoint read, and its manager then deleted, files outside its root."""
    state = make_state()
    with manager(tmp_path / "a") as mgr:
        mgr.save(1, state)
        state["model"]["lora"].add_(1)
        mgr.save(2, state)
    shutil.copytree(tmp_path / "a" / step_tag(2), tmp_path / "b" / step_tag(2))
    os.symlink(tmp_path / "a" / step_tag(1), tmp_path / "b" / step_tag(1))
    with pytest.raises(zs.CorruptCheckpointError, match=f"checkpoint {step_tag(1)} beside it, which is a link"):
        zs.load(make_state(), tmp_path / "b" / step_tag(2))
    assert same(load(tmp_path / "a", 2, state), state)
