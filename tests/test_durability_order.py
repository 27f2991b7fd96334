"""The commit's durability order on POSIX, observed at the system-call boundary.

tmpfs and the page cache hide a missing or misplaced fsync, so the order is recorded instead:
``os.fsync``, ``os.replace`` and ``os.unlink`` (which zerostall.storage.local calls through the
``os`` module) are wrapped with recorders that call the originals. Required order:
every data file fsync'd < manifest temp fsync'd < rename onto manifest.json < directory fsync'd
< any file of the old generation deleted.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import zerostall as zs
import zerostall.storage.local as local


def make_state(tag: int) -> dict:
    return {
        "model": {f"w{i}": torch.full((1000 * (i + 1),), float(tag + i)) for i in range(5)},
        "ints": torch.arange(33, dtype=torch.int64) * tag,
        "step": tag,
    }


class Recorder:
    """Records (op, path) for fsync (fd resolved through /proc), replace and unlink, in call order."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        fsync, replace, unlink = os.fsync, os.replace, os.unlink
        assert local.os is os  # the storage module calls these through the os module

        def rec_fsync(fd):
            target = os.readlink(f"/proc/self/fd/{fd}")
            fsync(fd)
            self._add("fsync", target)

        def rec_replace(src, dst, *args, **kwargs):
            replace(src, dst, *args, **kwargs)
            self._add("replace", f"{os.path.realpath(src)} -> {os.path.realpath(dst)}")

        def rec_unlink(path, *args, **kwargs):
            self._add("unlink", os.path.realpath(path))
            unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", rec_fsync)
        monkeypatch.setattr(os, "replace", rec_replace)
        monkeypatch.setattr(os, "unlink", rec_unlink)

    def _add(self, op: str, path: str) -> None:
        with self._lock:
            self.events.append((op, path))

    def dir_syncs(self, root: str, rename: int) -> tuple[int, int]:
        """The directory fsync just before the rename (data entries durable) and the one after it."""
        hits = [i for i, e in enumerate(self.events) if e == ("fsync", root)]
        before = [i for i in hits if i < rename]
        after = [i for i in hits if i > rename]
        assert before and len(after) == 1, f"expected directory fsyncs around the rename, got {self.events}"
        return before[-1], after[0]

    def index(self, op: str, path: str) -> int:
        hits = [i for i, e in enumerate(self.events) if e == (op, path)]
        assert len(hits) == 1, f"expected exactly one {op} of {path}, got {len(hits)} in {self.events}"
        return hits[0]


def manifest_info(path):
    with zs.open(path) as ck:
        return ck.manifest.generation, sorted(ck.manifest.files)


@pytest.mark.parametrize("threads", [1, 3])
def test_commit_order_into_existing_checkpoint(tmp_path, monkeypatch, threads):
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path, overwrite=True)
    root = os.path.realpath(path)
    _, old_files = manifest_info(path)
    assert old_files

    rec = Recorder(monkeypatch)
    zs.save(make_state(2), path, threads=threads, overwrite=True)
    monkeypatch.undo()
    events = rec.events

    generation, new_files = manifest_info(path)
    assert len(new_files) == min(threads, 6)
    manifest = os.path.join(root, "manifest.json")
    tmp = os.path.join(root, f"manifest.json.{generation}.tmp")

    data_syncs = [rec.index("fsync", os.path.join(root, f)) for f in new_files]
    tmp_sync = rec.index("fsync", tmp)
    rename = rec.index("replace", f"{tmp} -> {manifest}")
    pre_sync, dir_sync = rec.dir_syncs(root, rename)
    deletes = [rec.index("unlink", os.path.join(root, f)) for f in old_files]

    assert max(data_syncs) < tmp_sync, events
    assert max(data_syncs) < pre_sync < rename < dir_sync, events
    assert tmp_sync < rename, events
    assert dir_sync < min(deletes), events

    # nothing of the new generation is deleted, nothing is fsync'd or renamed after the deletes
    # start except further deletes, and the old files are really gone
    assert not [e for e in events if e[0] == "unlink" and generation in e[1]], events
    assert all(op == "unlink" for op, _ in events[min(deletes):]), events
    assert sorted(os.listdir(path)) == sorted(new_files + ["manifest.json"])

    target = make_state(0)
    out = zs.load(target, path)
    assert out["step"] == 2
    assert torch.equal(target["model"]["w3"], make_state(2)["model"]["w3"])


def test_first_save_makes_the_directory_durable_before_writing(tmp_path, monkeypatch):
    """A new checkpoint directory is fsync'd into its parent before data lands in it."""
    parent = tmp_path / "runs"
    parent.mkdir()
    path = parent / "step-10"
    rec = Recorder(monkeypatch)
    zs.save(make_state(1), path, threads=2)
    monkeypatch.undo()
    root = os.path.realpath(path)
    generation, files = manifest_info(path)

    parent_sync = rec.index("fsync", os.path.realpath(parent))
    data_syncs = [rec.index("fsync", os.path.join(root, f)) for f in files]
    tmp_sync = rec.index("fsync", os.path.join(root, f"manifest.json.{generation}.tmp"))
    rename = rec.index("replace", f"{os.path.join(root, f'manifest.json.{generation}.tmp')} -> "
                                  f"{os.path.join(root, 'manifest.json')}")
    pre_sync, dir_sync = rec.dir_syncs(root, rename)
    assert parent_sync < min(data_syncs) and max(data_syncs) < tmp_sync < rename < dir_sync, rec.events
    assert max(data_syncs) < pre_sync < rename, rec.events
    assert not [e for e in rec.events if e[0] == "unlink"], rec.events



def test_every_directory_a_first_save_makes_is_durable_in_its_parent_before_writing(tmp_path, monkeypatch):
    """Only the checkpoint's own entry was fsync'd: the new folders above it could vanish in a
    power loss, and the committed checkpoint with them."""
    path = tmp_path / "new1" / "new2" / "step-10"
    rec = Recorder(monkeypatch)
    zs.save(make_state(1), path)
    monkeypatch.undo()
    _, files = manifest_info(path)
    syncs = [rec.index("fsync", os.path.realpath(p)) for p in (tmp_path, tmp_path / "new1", tmp_path / "new1" / "new2")]
    first_data = min(rec.index("fsync", os.path.join(os.path.realpath(path), f)) for f in files)
    assert syncs == sorted(syncs) and syncs[-1] < first_data, rec.events

def test_fsync_false_never_fsyncs(tmp_path, monkeypatch):
    path = tmp_path / "scratch" / "ckpt"
    zs.save(make_state(1), path, fsync=False, overwrite=True)
    rec = Recorder(monkeypatch)
    zs.save(make_state(2), path, fsync=False, overwrite=True)
    monkeypatch.undo()

    assert not [e for e in rec.events if e[0] == "fsync"], rec.events
    # the commit itself is unchanged: rename, then the old generation goes
    renames = [i for i, e in enumerate(rec.events) if e[0] == "replace"]
    unlinks = [i for i, e in enumerate(rec.events) if e[0] == "unlink"]
    assert len(renames) == 1 and unlinks and renames[0] < min(unlinks), rec.events

    target = make_state(0)
    out = zs.load(target, path)
    assert out["step"] == 2
    assert torch.equal(target["ints"], make_state(2)["ints"])
    assert zs.verify(path) > 0


def test_fsync_false_first_save_never_fsyncs(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    zs.save(make_state(1), tmp_path / "a" / "b", fsync=False)
    monkeypatch.undo()
    assert not [e for e in rec.events if e[0] == "fsync"], rec.events
