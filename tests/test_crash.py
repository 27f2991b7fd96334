"""A save into an existing checkpoint that dies at any stage leaves a loadable checkpoint.

Each crash runs in a real child process that SIGKILLs itself at one stage of ``zs.save`` (the
library function at that stage is wrapped in the child, the save itself is the real one). The
parent then checks that the path holds exactly the old state (before the manifest rename) or
exactly the new one (after it), that it verifies, and that the next save cleans up the debris.
Failed saves (exceptions, not kills) are checked in-process.
"""

from __future__ import annotations

import errno
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zerostall as zs
import zerostall.storage.local as local

N = 1 << 20  # 4 MiB float32 tensors: with 4 KiB blocks each data file takes several writev calls
BLOCK = 4096


def make_state(tag: int) -> dict:
    """Deterministic state; different ``tag`` values differ in every leaf."""
    n = 1 << 20
    return {
        "model": {
            "w1": torch.arange(n, dtype=torch.float32) + tag * 1000,
            "w2": torch.full((n,), float(tag)),
            "b": torch.arange(10, dtype=torch.int64) * tag,
        },
        "step": tag,
        "tag": f"state-{tag}",
    }


def empty_state() -> dict:
    return {
        "model": {"w1": torch.zeros(N), "w2": torch.zeros(N), "b": torch.zeros(10, dtype=torch.int64)},
        "step": None,
        "tag": None,
    }


def load_fresh(path) -> dict:
    target = empty_state()
    out = zs.load(target, path)
    # python values come back through the return value, tensors are filled in place
    assert out["model"]["w1"] is target["model"]["w1"]
    return {"model": target["model"], "step": out["step"], "tag": out["tag"]}


def assert_is_state(got: dict, tag: int) -> None:
    want = make_state(tag)
    assert got["step"] == tag and got["tag"] == f"state-{tag}", f"expected state {tag}, got {got['tag']}"
    for k in ("w1", "w2", "b"):
        assert torch.equal(got["model"][k], want["model"][k]), f"model.{k} is not state {tag}'s"


def manifest_files(path) -> set[str]:
    with zs.open(path) as ck:
        return set(ck.manifest.files)


def assert_only_current_generation(path) -> None:
    assert set(os.listdir(path)) == manifest_files(path) | {"manifest.json"}


CHILD = textwrap.dedent('''
    import os, signal, sys, threading

    import torch

    import zerostall as zs
    import zerostall.engine as engine
    import zerostall.storage.local as local

    {make_state}

    def die(where):
        sys.stderr.write("child: SIGKILL at " + where + "\\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    path, stage = sys.argv[1], sys.argv[2]
    state = make_state(2)

    if stage == "writing":
        original = local._writev_all
        lock = threading.Lock()
        calls = [0]

        def _writev_all(fd, parts):
            with lock:
                calls[0] += 1
                n = calls[0]
            if n >= 3:
                die("writev call " + str(n))
            return original(fd, parts)

        local._writev_all = _writev_all
    elif stage == "before_manifest":
        def commit(storage, manifest, previous):
            die("commit entry")

        engine.commit = commit
    elif stage == "before_rename":
        def publish(self, name, tmp_name, data, before_replace=None):
            # what LocalStorage.publish does up to the rename: the temp file, written and fsync'd
            fd = os.open(self._path(tmp_name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            local._writev_all(fd, [memoryview(data)])
            os.fsync(fd)
            os.close(fd)
            die("just before the manifest rename")

        local.LocalStorage.publish = publish
    elif stage == "after_rename":
        original_publish = local.LocalStorage.publish

        def publish(self, name, tmp_name, data, before_replace=None):
            original_publish(self, name, tmp_name, data, before_replace)
            die("just after the manifest rename")

        local.LocalStorage.publish = publish
    elif stage == "cleanup":
        original_delete = local.LocalStorage.delete

        def delete(self, name):
            original_delete(self, name)
            die("after deleting " + name)

        local.LocalStorage.delete = delete
    else:
        raise SystemExit("unknown stage " + stage)

    zs.save(state, path, block_size={block})
    sys.stderr.write("child: save returned\\n")
    sys.exit(3)
''')

# stage -> the state the path must hold after the kill (1 = the old state A, 2 = the new one B)
STAGES = {"writing": 1, "before_manifest": 1, "before_rename": 1, "after_rename": 2, "cleanup": 2}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Run every crash stage at once (each in its own child process and directory)."""
    root = tmp_path_factory.mktemp("crash")
    script = root / "child.py"
    script.write_text(CHILD.format(make_state=inspect.getsource(make_state), block=BLOCK))
    runs = {}
    for stage in STAGES:
        path = root / stage
        zs.save(make_state(1), path)
        before = set(os.listdir(path))
        proc = subprocess.Popen([sys.executable, str(script), str(path), stage],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs[stage] = (path, before, proc)
    results = {}
    for stage, (path, before, proc) in runs.items():
        out, err = proc.communicate(timeout=120)
        results[stage] = (path, before, proc.returncode, out + err)
    return results


@pytest.mark.parametrize("stage", list(STAGES))
def test_killed_save_leaves_old_or_new_checkpoint(killed, stage):
    path, before, returncode, output = killed[stage]
    assert returncode == -9, f"child did not die by SIGKILL (rc={returncode}):\n{output}"
    assert "child: SIGKILL at" in output
    after = set(os.listdir(path))
    assert after != before, "the killed save left no trace: it did not die where intended"
    if stage == "cleanup":
        assert len(before - after) == 1, "exactly one file of the old generation was deleted before the kill"

    expected = STAGES[stage]
    assert_is_state(load_fresh(path), expected)
    assert zs.verify(path) > 0
    if expected == 1:
        assert manifest_files(path) | {"manifest.json"} == before, "the old manifest must be untouched"

    # the next normal save commits and removes every stale file of both earlier generations
    zs.save(make_state(3), path)
    assert_is_state(load_fresh(path), 3)
    assert zs.verify(path) > 0
    assert_only_current_generation(path)


def test_kill_while_writing_died_mid_data(killed):
    """Stage "writing" died on a writev of the data, not before it started or after it ended."""
    _, _, returncode, output = killed["writing"]
    assert returncode == -9
    # two writer threads race to the third call: whichever gets there first kills the process
    match = re.search(r"SIGKILL at writev call (\d+)", output)
    assert match and int(match.group(1)) >= 3, output


# -- failed saves (exceptions) -----------------------------------------------------------------------

def _fail_writev_from(monkeypatch, first_failing: int) -> None:
    original = local._writev_all
    calls = [0]

    def _writev_all(fd, parts):
        calls[0] += 1
        if calls[0] >= first_failing:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(fd, parts)

    monkeypatch.setattr(local, "_writev_all", _writev_all)


@pytest.mark.parametrize("how", ["enospc_first_write", "enospc_later_write", "enospc_manifest", "rename_fails"])
def test_failed_save_keeps_old_and_leaves_nothing(tmp_path, monkeypatch, how):
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path)
    before = set(os.listdir(path))

    if how == "enospc_first_write":
        _fail_writev_from(monkeypatch, 1)
    elif how == "enospc_later_write":
        _fail_writev_from(monkeypatch, 4)  # some data files are complete, one is not
    elif how == "enospc_manifest":
        original = local._writev_all

        def _writev_all(fd, parts):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return original(fd, parts)

        monkeypatch.setattr(local, "_writev_all", _writev_all)
    else:
        def replace(src, dst, **kw):
            raise OSError(errno.EIO, "rename failed (injected)")

        monkeypatch.setattr(local.os, "replace", replace)

    with pytest.raises(zs.CheckpointError) as exc:
        zs.save(make_state(2), path, block_size=BLOCK)
    assert "injected" in str(exc.value)
    monkeypatch.undo()

    assert set(os.listdir(path)) == before, "files of the failed generation were left behind"
    assert_is_state(load_fresh(path), 1)
    assert zs.verify(path) > 0


def test_failed_first_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "new"
    _fail_writev_from(monkeypatch, 2)
    with pytest.raises(zs.CheckpointError):
        zs.save(make_state(1), path, block_size=BLOCK)
    monkeypatch.undo()
    assert not path.exists() or os.listdir(path) == []
    with pytest.raises((zs.CheckpointNotFoundError, zs.IncompleteCheckpointError)):
        zs.open(path)


def test_failure_after_the_rename_does_not_destroy_the_committed_checkpoint(tmp_path, monkeypatch):
    """The directory fsync after the manifest rename fails: the new manifest is already in place,
    so the save may report the error, but it must not delete the data that manifest references
    (nor is the old state's manifest coming back): the path must still load and verify."""
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path)

    def fsync_dir(p):
        raise OSError(errno.EIO, "directory fsync failed (injected)")

    monkeypatch.setattr(local, "fsync_dir", fsync_dir)
    with pytest.raises(zs.CheckpointError):
        zs.save(make_state(2), path)
    monkeypatch.undo()

    got = load_fresh(path)  # must not raise CorruptCheckpointError (data file missing)
    assert got["step"] in (1, 2)
    assert_is_state(got, got["step"])
    assert zs.verify(path) > 0


def test_a_failed_writer_stops_the_other_writers(tmp_path, monkeypatch, task_log):
    # Without the stop, a save whose first data file fails writes every other file whole before
    # raising. Wrappers around the thread pool and the write call only order the threads (the other
    # writer goes on once the failing task has ended) and count what it wrote afterwards.
    from zerostall import engine

    log, original, written_after = task_log(engine), local._writev_all, []

    def _writev_all(fd, parts):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith("-000.safetensors"):
            raise OSError(errno.EIO, "write failed (injected)", name)
        log.wait_for_a_failure()
        written_after.append(name)
        return original(fd, parts)

    monkeypatch.setattr(local, "_writev_all", _writev_all)
    path = tmp_path / "ck"
    with pytest.raises(zs.CheckpointError, match=r"write failed \(injected\)") as exc:
        zs.save({"a": torch.randn(1 << 20), "b": torch.randn(1 << 20)}, path, threads=2)  # 2 files of 4 MiB
    assert not isinstance(exc.value, engine._Stopped)  # the cause is reported, not the stop it caused
    assert len(written_after) <= 1  # of the other file's 4 writes: the one it had begun, if any
    assert not [n for n in os.listdir(path) if n.endswith(".safetensors")]


def test_failed_cleanup_does_not_fail_the_save(tmp_path, monkeypatch):
    """Deleting the old generation is best effort: the new checkpoint is committed regardless,
    and the next save removes what was left."""
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path)
    old = set(os.listdir(path)) - {"manifest.json"}

    def delete(self, name):
        raise PermissionError(errno.EACCES, "cannot delete (injected)", name)

    monkeypatch.setattr(local.LocalStorage, "delete", delete)
    zs.save(make_state(2), path)
    monkeypatch.undo()
    assert old <= set(os.listdir(path))
    assert_is_state(load_fresh(path), 2)
    assert zs.verify(path) > 0

    zs.save(make_state(3), path)
    assert_is_state(load_fresh(path), 3)
    assert_only_current_generation(path)


def test_a_write_that_makes_no_progress_fails_the_save(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path)
    monkeypatch.setattr(local.os, "writev", lambda fd, buffers: 0)
    with pytest.raises(zs.CheckpointError, match="stalled"):
        zs.save(make_state(2), path)
    monkeypatch.undo()
    assert_is_state(load_fresh(path), 1)


@pytest.mark.parametrize("when", ["before_its_writes", "after_its_writes"])
def test_an_older_save_does_not_commit_over_a_newer_one(tmp_path, monkeypatch, when):
    """Two writers on one path (no manager to refuse the second): save B starts later than save A
    and commits while A is in flight, removing older generations' files on its way out (A's, when A
    had written them). A must then be refused, not commit a manifest over B's whose data files may
    be gone; B's checkpoint stays whole and A's files are removed."""
    from zerostall import engine

    path = tmp_path / "ck"
    zs.save(make_state(1), path)
    prepared = engine.prepare(make_state(2), path)  # A: its generation is taken now
    if when == "before_its_writes":
        original_create = engine._create

        def _create(storage):  # A begins writing: B runs and commits now
            monkeypatch.setattr(engine, "_create", original_create)
            zs.save(make_state(3), path)
            original_create(storage)

        monkeypatch.setattr(engine, "_create", _create)
    else:
        original = engine.commit

        def commit(storage, manifest, previous):  # A has written its data files: B runs and commits now
            monkeypatch.setattr(engine, "commit", original)
            zs.save(make_state(3), path)
            original(storage, manifest, previous)

        monkeypatch.setattr(engine, "commit", commit)
    with pytest.raises(zs.CheckpointError, match="another save .* committed there while it was in flight"):
        engine.persist(prepared)
    assert_is_state(load_fresh(path), 3)
    assert zs.verify(path) > 0
    assert not [n for n in os.listdir(path) if n.startswith(prepared.generation)]


def test_a_save_over_a_checkpoint_from_a_clock_ahead_commits(tmp_path, monkeypatch):
    """Generations carry the writer's clock; a checkpoint written by a machine whose clock ran an
    hour ahead (copied here, or before an NTP step back) must not make later saves into its path
    look older than it and be refused."""
    from zerostall import engine

    path = tmp_path / "ck"
    ahead = time.time_ns() + 3600 * 10**9
    monkeypatch.setattr(engine.time, "time_ns", lambda: ahead)
    zs.save(make_state(1), path)
    monkeypatch.undo()
    ahead_files = set(os.listdir(path)) - {"manifest.json"}
    zs.save(make_state(2), path)
    assert_is_state(load_fresh(path), 2)
    assert zs.verify(path) > 0
    assert not ahead_files & set(os.listdir(path)), "the replaced checkpoint's files must not outlive it"

