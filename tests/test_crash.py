"""A save into an existing checkpoint that dies at any stage leaves a loadable checkpoint.

Each crash runs in a real child process that SIGKILLs itself at one stage of ``zs.save`` (a
:class:`faults.FaultyStorage` around the path crashes at one storage operation; the save itself
is the real one). The
parent then checks that the path holds exactly the old state (before the manifest rename) or
exactly the new one (after it), that it verifies, and that the next save cleans up the debris.
Failed saves (exceptions, not kills) are checked in-process, with faults injected the same way.
"""

from __future__ import annotations

import errno
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zerostall as zs
from faults import FaultyStorage
from zerostall.storage import LocalStorage

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
    import sys

    import torch

    sys.path.insert(0, {tests!r})
    import zerostall as zs
    from faults import FaultyStorage
    from zerostall.storage import LocalStorage

    {make_state}

    path, stage = sys.argv[1], sys.argv[2]
    storage = FaultyStorage(LocalStorage(path))
    if stage == "writing":  # a data file is partly written
        storage.crash("write", name="*.safetensors", after_bytes={crash_bytes})
    elif stage == "before_manifest":  # every data file written, no manifest temp file yet
        storage.crash("publish", name="manifest.json")
    elif stage == "before_rename":  # the manifest temp file written and fsync'd, the switch not made
        storage.crash("publish", name="manifest.json", at="before_replace")
    elif stage == "after_rename":
        storage.crash("publish", name="manifest.json", at="after")
    elif stage == "cleanup":  # one file of the old generation deleted
        storage.crash("delete", at="after")
    else:
        raise SystemExit("unknown stage " + stage)

    zs.save(make_state(2), storage, block_size={block}, overwrite=True)
    sys.stderr.write("child: save returned\\n")
    sys.exit(3)
''')
CRASH_BYTES = 5 << 19  # into a 4 MiB data file: a few writev calls of it are on disk

# stage -> the state the path must hold after the kill (1 = the old state A, 2 = the new one B)
STAGES = {"writing": 1, "before_manifest": 1, "before_rename": 1, "after_rename": 2, "cleanup": 2}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Run every crash stage at once (each in its own child process and directory)."""
    root = tmp_path_factory.mktemp("crash")
    script = root / "child.py"
    script.write_text(CHILD.format(tests=os.path.dirname(__file__), make_state=inspect.getsource(make_state),
                                   block=BLOCK, crash_bytes=CRASH_BYTES))
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
        sizes = {name: os.path.getsize(path / name) for name in os.listdir(path)}  # as the kill left them
        results[stage] = (path, before, proc.returncode, out + err, sizes)
    shutil.copytree(root / "before_rename", root / "before_rename.as-killed")  # the tests below save into it
    return results


@pytest.mark.parametrize("stage", list(STAGES))
def test_killed_save_leaves_old_or_new_checkpoint(killed, stage):
    path, before, returncode, output, _ = killed[stage]
    assert returncode == -9, f"child did not die by SIGKILL (rc={returncode}):\n{output}"
    assert "faults: SIGKILL at" in output
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
    zs.save(make_state(3), path, overwrite=True)
    assert_is_state(load_fresh(path), 3)
    assert zs.verify(path) > 0
    assert_only_current_generation(path)


def test_kill_before_the_rename_left_the_new_manifest_whole_beside_the_old(killed, tmp_path):
    """Stage "before_rename" died at the switch: the new manifest is complete in its temp file (put in
    place, it loads the new state) and the old one is still in place. A publish that wrote the
    manifest in place, with no temp file and rename, would leave no such file."""
    path, before, returncode, output, _ = killed["before_rename"]
    assert returncode == -9 and "SIGKILL at before_replace publish of manifest.json" in output, output
    as_killed = path.parent / "before_rename.as-killed"
    temps = [name for name in os.listdir(as_killed) if name.startswith("manifest.json.") and name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0] not in before, sorted(os.listdir(as_killed))
    switched = shutil.copytree(as_killed, tmp_path / "switched")
    assert_is_state(load_fresh(switched), 1)
    os.replace(switched / temps[0], switched / "manifest.json")  # the rename the kill prevented
    assert_is_state(load_fresh(switched), 2)
    assert zs.verify(switched) > 0


def test_kill_while_writing_died_mid_data(killed):
    """Stage "writing" died inside a data file: it exists, partly written, when the child dies."""
    _, before, returncode, output, sizes = killed["writing"]
    assert returncode == -9
    match = re.search(rf"SIGKILL at write of (\S+) after {CRASH_BYTES} bytes", output)
    assert match and match.group(1) not in before, output
    assert 0 < sizes[match.group(1)] <= CRASH_BYTES


# -- failed saves (exceptions) -----------------------------------------------------------------------

def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device (injected)")


@pytest.mark.parametrize("how", ["enospc_first_write", "enospc_later_write", "enospc_manifest", "rename_fails"])
def test_failed_save_keeps_old_and_leaves_nothing(tmp_path, monkeypatch, how):
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path, overwrite=True)
    before = set(os.listdir(path))

    storage = FaultyStorage(LocalStorage(str(path)))
    data = "*.safetensors"
    if how == "enospc_first_write":  # the first data file fails as it starts
        fault = storage.fail("write", enospc(), name=data, times=1, after_bytes=0)
    elif how == "enospc_later_write":  # one data file is complete, the next fails part-way
        first_written = storage.call("write", lambda op, name: None, name=data, times=1, at="after")
        storage.block("write", first_written.fired, name=data, from_call=2)  # starts once the first is whole
        fault = storage.fail("write", enospc(), name=data, from_call=2, times=1, after_bytes=3 << 20)
    elif how == "enospc_manifest":  # the manifest temp file is written, the switch fails
        fault = storage.fail("publish", enospc(), name="manifest.json", at="before_replace")
    else:  # a real rename failure, in the os call the local backend makes
        renames = []

        def replace(src, dst, **kw):
            renames.append(dst)
            raise OSError(errno.EIO, "rename failed (injected)")

        monkeypatch.setattr(os, "replace", replace)

    with pytest.raises(zs.CheckpointError) as exc:
        zs.save(make_state(2), storage, block_size=BLOCK, threads=2, overwrite=True)  # two data files of 4 MiB
    assert "injected" in str(exc.value)
    monkeypatch.undo()
    if how == "rename_fails":
        assert [os.path.basename(dst) for dst in renames] == ["manifest.json"]
    else:
        assert fault.count == 1
    if how == "enospc_later_write":  # it happened as described: a whole file, then another one's failure
        first, failed = storage.names("write")[:2]
        assert first_written.count == 1 and first != failed and os.path.basename(failed) in str(exc.value)

    assert set(os.listdir(path)) == before, "files of the failed generation were left behind"
    assert_is_state(load_fresh(path), 1)
    assert zs.verify(path) > 0


def test_failed_first_save_leaves_no_checkpoint(tmp_path):
    path = tmp_path / "new"
    storage = FaultyStorage(LocalStorage(str(path)))
    fault = storage.fail("write", enospc(), after_bytes=1 << 20)
    with pytest.raises(zs.CheckpointError, match="injected"):
        zs.save(make_state(1), storage, block_size=BLOCK)
    assert fault.count >= 1
    assert not path.exists() or os.listdir(path) == []
    with pytest.raises((zs.CheckpointNotFoundError, zs.IncompleteCheckpointError)):
        zs.open(path)


def test_failure_after_the_rename_does_not_destroy_the_committed_checkpoint(tmp_path):
    """The step right after the manifest rename fails (the directory fsync, say): the new manifest
    is in place, so the save may report the error, but it must not delete the data that manifest
    references: the new state loads and verifies, and the next save removes the old one's files."""
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path, overwrite=True)
    old = set(os.listdir(path)) - {"manifest.json"}

    storage = FaultyStorage(LocalStorage(str(path)))
    fault = storage.fail("publish", OSError(errno.EIO, "directory fsync failed (injected)"), name="manifest.json",
                         at="after")
    with pytest.raises(zs.CheckpointError, match="injected"):
        zs.save(make_state(2), storage, overwrite=True)
    assert fault.count == 1

    assert_is_state(load_fresh(path), 2)  # must not raise CorruptCheckpointError (data file missing)
    assert zs.verify(path) > 0
    zs.save(make_state(3), path, overwrite=True)
    assert not old & set(os.listdir(path))
    assert_only_current_generation(path)


def test_a_failed_writer_stops_the_other_writers(tmp_path):
    """Without the stop, a save whose first data file fails writes every other file whole before
    raising. The other writer is held at its start until the failure, then what it streams is
    counted: nothing past its header."""
    path = tmp_path / "ck"
    storage = FaultyStorage(LocalStorage(str(path)))
    failure = storage.fail("write", OSError(errno.EIO, "write failed (injected)"), name="*-000.safetensors")
    storage.block("write", failure.fired, name="*-001.safetensors")
    streamed = storage.call("write", lambda op, name: None, name="*-001.safetensors", after_bytes=1 << 20)
    with pytest.raises(zs.CheckpointError, match=r"write failed \(injected\)") as exc:
        zs.save({"a": torch.randn(1 << 20), "b": torch.randn(1 << 20)}, storage, threads=2)  # 2 files of 4 MiB
    assert "another writer" not in str(exc.value)  # the cause is reported, not the stop it caused
    assert failure.count == 1
    assert streamed.count == 0  # of the other file's 4 MiB, not even 1 MiB was taken after the failure
    assert not [n for n in os.listdir(path) if n.endswith(".safetensors")]


def test_failed_cleanup_does_not_fail_the_save(tmp_path):
    """Deleting the old generation is best effort: the new checkpoint is committed regardless,
    and the next save removes what was left."""
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path, overwrite=True)
    old = set(os.listdir(path)) - {"manifest.json"}

    storage = FaultyStorage(LocalStorage(str(path)))
    fault = storage.fail("delete", PermissionError(errno.EACCES, "cannot delete (injected)"))
    zs.save(make_state(2), storage, overwrite=True)
    assert fault.count == len(old)
    assert old <= set(os.listdir(path))
    assert_is_state(load_fresh(path), 2)
    assert zs.verify(path) > 0

    zs.save(make_state(3), path, overwrite=True)
    assert_is_state(load_fresh(path), 3)
    assert_only_current_generation(path)


def test_a_write_that_makes_no_progress_fails_the_save(tmp_path, monkeypatch):
    """The local backend's own check: a ``writev`` that returns 0 (the os call it makes) fails the
    save instead of leaving a short file behind a committed manifest."""
    path = tmp_path / "ckpt"
    zs.save(make_state(1), path, overwrite=True)
    stalls = []
    monkeypatch.setattr(os, "writev", lambda fd, buffers: stalls.append(fd) or 0)
    with pytest.raises(zs.CheckpointError, match="stalled"):
        zs.save(make_state(2), path, overwrite=True)
    monkeypatch.undo()
    assert stalls
    assert_is_state(load_fresh(path), 1)


@pytest.mark.parametrize("when", ["before_its_writes", "after_its_writes"])
def test_an_older_save_does_not_commit_over_a_newer_one(tmp_path, when):
    """Two writers on one path (no manager to refuse the second): save B starts later than save A
    and commits while A is in flight, removing older generations' files on its way out (A's, when A
    had written them). A must then be refused, not commit a manifest over B's whose data files may
    be gone; B's checkpoint stays whole and A's files are removed."""
    path = tmp_path / "ck"
    zs.save(make_state(1), path, overwrite=True)
    storage = FaultyStorage(LocalStorage(str(path)))  # A's view of the path

    def save_b(op, name):
        zs.save(make_state(3), path, overwrite=True)

    if when == "before_its_writes":  # A has its generation and begins writing: B runs and commits now
        b_saved = storage.call("create", save_b, times=1)
    else:  # A has written its data and is about to commit: B runs and commits now (B cannot commit
        # between A's last-moment check and A's switch: see tests/test_two_writers.py)
        b_saved = storage.call("publish", save_b, name="manifest.json", at="before")
    with pytest.raises(zs.CheckpointError, match="another checkpoint .* was committed there while it was in flight"):
        zs.save(make_state(2), storage, overwrite=True)
    assert b_saved.count == 1 and storage.names("write")
    assert_is_state(load_fresh(path), 3)
    assert zs.verify(path) > 0
    assert_only_current_generation(path)  # B's files only: A's are removed


def test_a_save_over_a_checkpoint_from_a_clock_ahead_commits(tmp_path, monkeypatch):
    """Generations carry the writer's clock; a checkpoint written by a machine whose clock ran an
    hour ahead (copied here, or before an NTP step back) must not make later saves into its path
    look older than it and be refused."""
    path = tmp_path / "ck"
    ahead = time.time_ns() + 3600 * 10**9
    monkeypatch.setattr(time, "time_ns", lambda: ahead)
    zs.save(make_state(1), path, overwrite=True)
    monkeypatch.undo()
    ahead_files = set(os.listdir(path)) - {"manifest.json"}
    zs.save(make_state(2), path, overwrite=True)
    assert_is_state(load_fresh(path), 2)
    assert zs.verify(path) > 0
    assert not ahead_files & set(os.listdir(path)), "the replaced checkpoint's files must not outlive it"

