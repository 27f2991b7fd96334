"""CheckpointRoot: listing (cached per manifest), latest, classification, deletion manifest first,
setting aside, and removing what a dead writer left, all through the root's Storage."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import zerostall as zs
from faults import FaultyStorage
from zerostall.format.layout import MANIFEST_NAME
from zerostall.roots.described import COMMITTED, CORRUPT, INCOMPLETE, UNREADABLE
from zerostall.roots.root import LATEST_NAME, LEASE_NAME, SUPERSEDED_NAME, CheckpointRoot, step_tag, validate_tag
from zerostall.storage import LocalStorage, storage_for


def save(path, step: int | None, **kwargs) -> None:
    zs.save({"w": torch.full((4,), float(step or 0))}, path, step=step, fsync=False, **kwargs)


def uncommitted(path, step: int) -> bytes:
    """A whole checkpoint whose manifest is held back (returned): a writer just before its commit."""
    save(path, step)
    manifest = path / MANIFEST_NAME
    data = manifest.read_bytes()
    manifest.unlink()
    return data


class Recording(LocalStorage):
    """A LocalStorage that records deletes and moves (and can run something before a move)."""

    def __init__(self, location: str, events: list, before_move=None) -> None:
        super().__init__(location, fsync=False)
        self.events = events
        self.before_move = before_move

    def child(self, name: str) -> Recording:
        return Recording(os.path.join(self.location, name), self.events, self.before_move)

    def delete(self, name: str) -> None:
        self.events.append(("delete", os.path.basename(self.location), name))
        super().delete(name)

    def delete_tree(self, name: str) -> None:
        manifest_left = os.path.exists(os.path.join(self.location, name, MANIFEST_NAME))
        self.events.append(("delete_tree", name, manifest_left))
        super().delete_tree(name)

    def move(self, src: str, dst: str) -> None:
        if self.before_move is not None:
            self.before_move, run = None, self.before_move
            run()
        self.events.append(("move", src, dst.rsplit(".", 1)[0]))  # without the random suffix
        super().move(src, dst)


@pytest.fixture
def ckroot(tmp_path) -> CheckpointRoot:
    return CheckpointRoot(LocalStorage(str(tmp_path), fsync=False))


def test_tags():
    assert step_tag(100) == "step_000000100"
    validate_tag("best-so-far")
    for bad in ("a/b", LATEST_NAME, LEASE_NAME, ".hidden", 7):
        with pytest.raises(zs.InvalidPathError, match="invalid checkpoint tag .*: a tag is one plain name"):
            validate_tag(bad)


def test_checkpoints_lists_the_committed_ones_by_step(ckroot, tmp_path):
    for step in (30, 4, 200):
        save(tmp_path / step_tag(step), step)
    save(tmp_path / "best", 50, metadata={"metrics": {"loss": 0.5, "note": "x"}})
    save(tmp_path / "no-step", None)
    uncommitted(tmp_path / step_tag(300), 300)
    save(tmp_path / ".superseded" / step_tag(400), 400)
    save(tmp_path / ".hidden", 500)
    (tmp_path / "plain-dir").mkdir()
    (tmp_path / "a-file").write_text("{}")
    save(tmp_path / "broken", 7)
    (tmp_path / "broken" / MANIFEST_NAME).write_text("{")
    found = ckroot.checkpoints()
    assert [(i.name, i.step) for i in found] == [("no-step", None), (step_tag(4), 4), (step_tag(30), 30),
                                                 ("best", 50), (step_tag(200), 200)]
    best = found[3]
    assert best.status == COMMITTED and best.metrics == {"loss": 0.5, "note": "x"} and best.bytes > 0
    assert best.location == str(tmp_path / "best") and best.created <= time.time()
    assert ckroot.latest() == step_tag(200)
    assert CheckpointRoot(LocalStorage(str(tmp_path / "missing"))).checkpoints() == []


def test_each_manifest_is_parsed_once_until_it_is_replaced(tmp_path):
    storage = FaultyStorage(LocalStorage(str(tmp_path)))
    ckroot = CheckpointRoot(storage)
    save(tmp_path / "a", 1, overwrite=True)
    save(tmp_path / "b", 2, overwrite=True)
    ckroot.checkpoints()
    ckroot.checkpoints()
    assert sorted(storage.names("read_bytes")) == ["a/manifest.json", "b/manifest.json"]
    save(tmp_path / "a", 3, overwrite=True)  # a new manifest in the same place
    assert [(i.name, i.step) for i in ckroot.checkpoints()] == [("b", 2), ("a", 3)]
    assert sorted(storage.names("read_bytes")) == ["a/manifest.json", "a/manifest.json", "b/manifest.json"]


def test_a_manifest_that_cannot_be_read_is_listed_as_unreadable_not_corrupt(tmp_path):
    """A read error (an S3 server's 500, a failing disk) was listed as ``corrupt``: damage, which it
    is not known to be (``zerostall ls`` said so)."""
    storage = FaultyStorage(LocalStorage(str(tmp_path)))
    save(tmp_path / "good", 10)
    save(tmp_path / "flaky", 20)
    storage.fail("read_bytes", OSError(5, "Input/output error"), name="flaky/manifest.json")
    rows = {r.name: r for r in CheckpointRoot(storage).scan()}
    assert rows["good"].status == COMMITTED
    assert rows["flaky"].status == UNREADABLE and "Input/output error" in rows["flaky"].error, rows["flaky"]


def test_latest_pointer_round_trip(ckroot, tmp_path):
    assert ckroot.read_latest() is None
    ckroot.write_latest("step_000000010", 10)
    assert json.loads((tmp_path / LATEST_NAME).read_text()) == {"tag": "step_000000010", "step": 10}
    assert ckroot.read_latest() == "step_000000010"
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
    for junk in ("{", "[1]", '{"tag": 3}', "../x", ".hidden"):
        (tmp_path / LATEST_NAME).write_text(junk)
        assert ckroot.read_latest() is None
    (tmp_path / LATEST_NAME).write_text("global_step10")  # DeepSpeed's: the tag alone
    assert ckroot.read_latest() == "global_step10"


def test_scan_classifies_committed_incomplete_and_corrupt(ckroot, tmp_path):
    save(tmp_path / "good", 10)
    uncommitted(tmp_path / "half", 5)
    save(tmp_path / "bad", 30)
    raw = bytearray((tmp_path / "bad" / MANIFEST_NAME).read_bytes())
    raw[60] ^= 0xFF
    (tmp_path / "bad" / MANIFEST_NAME).write_bytes(bytes(raw))
    (tmp_path / "empty").mkdir()
    rows = {r.name: r for r in ckroot.scan()}
    assert [r.name for r in ckroot.scan()] == ["good", "bad", "half"]
    assert rows["good"].status == COMMITTED and rows["good"].step == 10
    assert rows["half"].status == INCOMPLETE and rows["half"].bytes > 0 and rows["half"].step is None
    assert rows["bad"].status == CORRUPT and "checksum" in rows["bad"].error
    one = CheckpointRoot(LocalStorage(str(tmp_path / "good")))
    assert [(r.name, r.location) for r in one.scan(include_self=True)] == [("good", str(tmp_path / "good"))]
    assert ckroot.scan(include_self=True) == ckroot.scan()  # the root itself is no checkpoint


def test_delete_removes_the_manifest_first(tmp_path):
    save(tmp_path / "a", 1)
    events: list = []
    ckroot = CheckpointRoot(Recording(str(tmp_path), events))
    assert ckroot.delete("a") and not (tmp_path / "a").exists()
    assert events == [("delete", "a", MANIFEST_NAME), ("delete_tree", "a", False)]
    assert ckroot.delete("a")  # already gone


def test_set_aside_moves_whole_checkpoints_and_never_over_an_earlier_one(ckroot, tmp_path, caplog):
    for step in (2, 3):
        save(tmp_path / step_tag(step), step)
    ckroot.set_aside([step_tag(2), step_tag(3), "gone"], step=1, target=step_tag(1))
    save(tmp_path / step_tag(3), 33)
    ckroot.set_aside([step_tag(3)], step=1, target=step_tag(1))
    aside = sorted(os.listdir(tmp_path / SUPERSEDED_NAME))
    assert aside[:2] == [step_tag(2), step_tag(3)] and aside[2].startswith(step_tag(3) + ".") and len(aside) == 3
    assert ckroot.checkpoints() == []
    assert zs.verify(tmp_path / SUPERSEDED_NAME / aside[2]) and f"{step_tag(2)} moved to" in caplog.text


def test_clean_stale_attempts(tmp_path):
    uncommitted(tmp_path / step_tag(1), 1)
    save(tmp_path / step_tag(2), 2)
    uncommitted(tmp_path / "my-tag", 3)  # not a step: left alone
    (tmp_path / ".deleting-step_000000004.0123abcd" / "deep").mkdir(parents=True)
    for name in ("latest.1234abcd.tmp", ".writer-lease.5678ef01.tmp"):
        (tmp_path / name).write_text("{")
        os.utime(tmp_path / name, (time.time() - 3600,) * 2)
    (tmp_path / "latest.fresh000.tmp").write_text("{")
    events: list = []
    CheckpointRoot(Recording(str(tmp_path), events)).clean_stale_attempts(temp_age=60)
    assert sorted(os.listdir(tmp_path)) == ["latest.fresh000.tmp", "my-tag", step_tag(2)]
    assert ("move", step_tag(1), ".deleting-step_000000001") in events  # moved aside before it was deleted


def test_an_attempt_that_commits_while_it_is_moved_aside_is_put_back(tmp_path, caplog):
    manifest = uncommitted(tmp_path / step_tag(1), 1)
    events: list = []
    storage = Recording(str(tmp_path), events, before_move=lambda: (tmp_path / step_tag(1) / MANIFEST_NAME)
                        .write_bytes(manifest))
    ckroot = CheckpointRoot(storage)
    ckroot.clean_stale_attempts(temp_age=60)
    assert [e[0] for e in events] == ["move", "move"] and events[1][2] == step_tag(1)
    assert os.listdir(tmp_path) == [step_tag(1)] and zs.verify(tmp_path / step_tag(1))
    assert ckroot.latest() == step_tag(1) and "outlived its lease" in caplog.text


def test_a_manager_refuses_a_root_holding_unrelated_files_and_writes_nothing_there(tmp_path):
    """zs.save refuses a directory of other files; a manager root must too, or the manager takes it
    over: its start-up clean-up removes a ``step_*`` directory without a manifest (here another
    tool's), whatever it holds."""
    (tmp_path / "train.py").write_text("print('hi')")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "step_100").mkdir()
    (tmp_path / "step_100" / "model.pt").write_bytes(b"not ours")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(zs.CheckpointError) as exc:
        zs.CheckpointManager(tmp_path)
    message = str(exc.value)
    assert "neither checkpoints nor a checkpoint manager's own (notes.txt, train.py, runs/, step_100/)" in message
    assert "give the manager an empty directory or one of its own roots, or move those files out" in message
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "step_100") == ["model.pt"]


def test_a_checkpoint_given_as_a_manager_root_is_refused(tmp_path):
    save(tmp_path / "ckpt", 1)
    with pytest.raises(zs.CheckpointError, match="is a checkpoint itself, not a root of checkpoints"):
        zs.CheckpointManager(tmp_path / "ckpt")
    assert zs.verify(tmp_path / "ckpt") and not (tmp_path / "ckpt" / LEASE_NAME).exists()


def test_a_root_with_the_managers_own_and_a_frameworks_files_is_accepted(tmp_path):
    """What a manager leaves (lease, latest, set-aside checkpoints, an interrupted clean-up, temp
    files, attempts a dead writer left, an empty tag directory) and what DeepSpeed keeps in its
    save directory (``latest`` as plain text, ``zero_to_fp32.py``) are not unrelated."""
    with zs.CheckpointManager(tmp_path, fsync=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        mgr.save(1, {"w": torch.full((4,), 10.0)})  # a rollback: step 2 is set aside
    uncommitted(tmp_path / step_tag(3), 3)
    uncommitted(tmp_path / "global_step4", 4)
    save(tmp_path / "global_step5", 5)
    (tmp_path / "empty-tag").mkdir()
    (tmp_path / ".deleting-step_000000007.0123abcd").mkdir()
    (tmp_path / "latest.0123abcd.tmp").write_text("{")
    (tmp_path / ".nfs0000000000001234").write_bytes(b"")
    (tmp_path / "zero_to_fp32.py").write_text("# DeepSpeed's conversion script")
    (tmp_path / LATEST_NAME).write_text("global_step5")
    assert sorted(os.listdir(tmp_path / SUPERSEDED_NAME)) == [step_tag(1), step_tag(2)]
    with zs.CheckpointManager(tmp_path) as mgr:
        target = {"w": torch.zeros(4)}
        assert mgr.latest() == "global_step5"
        assert mgr.restore(target, tag=step_tag(1)) == 1 and torch.equal(target["w"], torch.full((4,), 10.0))


def test_an_s3_root_holding_unrelated_objects_is_refused(s3_url):
    root = storage_for(s3_url)
    root.put("notes.txt", b"")
    root.child("runs").put("a.bin", b"x")
    root.put("zero_to_fp32.py", b"")
    with pytest.raises(zs.CheckpointError, match=r"neither checkpoints nor a checkpoint manager's own \(notes.txt, runs/\)"):
        zs.CheckpointManager(s3_url)
    assert LEASE_NAME not in root.list()


def test_a_link_to_a_checkpoint_directory_is_neither_taken_over_nor_deleted_through(tmp_path):
    """A pretrained checkpoint linked into a manager's root as step 0 had its manifest deleted by
    retention, where it really lies: it loaded no more, from anywhere."""
    shared = tmp_path / "pretrained"
    save(shared, 0)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(shared, root / step_tag(0))
    with pytest.raises(zs.CheckpointError, match=rf"holds links to directories \({step_tag(0)}\).*nothing was written"):
        zs.CheckpointManager(str(root), keep_last=1)
    with pytest.raises(zs.CheckpointError, match="is a link to a directory: not deleted"):
        CheckpointRoot(LocalStorage(str(root))).delete(step_tag(0))  # as `zerostall prune` deletes
    assert sorted(os.listdir(root)) == [step_tag(0)] and zs.verify(shared)


def test_a_damaged_re_save_journal_is_ignored_once_and_removed(tmp_path, caplog):
    """The journal is read before every save: a damaged one warned at each, and stayed."""
    (tmp_path / ".resaving").write_text('{"../escape": 1}')
    with zs.CheckpointManager(str(tmp_path), fsync=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        mgr.save(2, {"w": torch.ones(2)})
    assert caplog.text.count("is not a re-save journal zerostall wrote") == 1
    assert not (tmp_path / ".resaving").exists() and sorted(os.listdir(tmp_path / step_tag(2)))


def test_a_folder_named_like_a_step_holding_other_files_is_left_and_uploads_deeper_down_are_not_ours(tmp_path,
                                                                                                       caplog):
    """A manager's start-up deleted ``step_000000007/`` whole, the user's README and eval results in
    it, and aborted another program's upload to ``other-app/model/<a data file's name>``."""
    from zerostall.roots.stale import _owned

    folder = tmp_path / "step_000000007"
    (folder / "eval").mkdir(parents=True)
    (folder / "README.txt").write_text("mine")
    (folder / "eval" / "results.csv").write_text("1,2")
    zs.save({"w": torch.ones(2)}, str(tmp_path / "step_000000001"), step=1)
    data = next(n for n in os.listdir(tmp_path / "step_000000001") if n != MANIFEST_NAME)
    with zs.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.latest() == "step_000000001"
    assert (folder / "README.txt").read_text() == "mine" and (folder / "eval" / "results.csv").exists()
    assert "step_000000007 holds no checkpoint's files but others" in caplog.text
    assert _owned(f"step_000000009/{data}") and _owned(f".superseded/step_000000009/{data}")
    assert not _owned(f"other-app/model/{data}") and not _owned(f"other-app/{data}/x")


@pytest.mark.parametrize("tag", ["a\\b", "a\x01b", "tab\there", "del\x7f"])
def test_a_tag_with_a_backslash_or_a_control_character_is_refused(tmp_path, tag):
    """On S3 a backslash became '/' (the checkpoint landed elsewhere) and a control character made
    every later deletion fail (DeleteObjects' XML cannot carry it): the root was unusable."""
    with zs.CheckpointManager(str(tmp_path)) as mgr, pytest.raises(zs.InvalidPathError, match="control character"):
        mgr.save(1, {"w": torch.ones(2)}, tag=tag)
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == []  # nothing written
