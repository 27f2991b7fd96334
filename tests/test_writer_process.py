"""``AsyncSaver(writer="process")`` when things end badly: the script's exit (an exception, sys.exit,
Ctrl-C, its end) with a save in the writer, a writer killed mid-save, a /dev/shm too small.

Each runs tests/writer_process.py in a child process of its own session, under a timeout (a hang
fails the test and kills the session, the writer included); /dev/shm is made small for real, in a
private mount namespace (tests/small_tmpfs.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import zerostall as zs
from small_tmpfs import in_small_tmpfs, unavailable

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_process.py")
HANG = 180  # seconds; only ever reached by a child that hangs


def run(*command: str) -> tuple[int, list[dict], str]:
    """Run ``command`` in a new session: its exit status, its JSON lines and its stderr. A child
    still running after HANG seconds hangs: its session is killed and the test fails."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=HANG)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"the training process did not exit: it hangs\n{err[-3000:]}")
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


@pytest.mark.parametrize("how, status", [("exception", 1), ("exit", 3), ("interrupt", -signal.SIGINT), ("end", 0)])
def test_the_script_exits_with_its_own_status_once_the_save_in_the_writer_commits(tmp_path, how, status):
    """Nothing closes the saver; the writer process holds the save when the script ends. The exit
    used to hang (the interpreter joined the writer, which waited for its next job), and Ctrl-C
    (SIGINT to the process group) killed the save in the writer."""
    code, lines, err = run(sys.executable, SCRIPT, how, str(tmp_path / "ck"))
    assert code == status, err[-3000:]
    assert lines == [{"held": True}]
    with zs.open(tmp_path / "ck") as ck:
        assert ck.step == 4
    assert zs.verify(tmp_path / "ck") > 0


def test_options_that_cannot_reach_the_writer_and_errors_that_cannot_come_back_are_typed(tmp_path):
    """A lambda as before_commit raised pickle's own PicklingError; an error that pickles but cannot
    be unpickled came back as an unrelated TypeError from the pipe, the real error lost."""
    code, lines, err = run(sys.executable, SCRIPT, "errors", str(tmp_path))
    assert code == 0, err[-3000:]
    said = {k: v for line in lines for k, v in line.items()}
    assert said["lambda"].startswith("CheckpointError: this save cannot be handed to a writer process: "), said
    assert said["lambda"].endswith("use writer='thread'")
    assert said["unpicklable"] == "CheckpointError: TwoArguments: 1-2" and said["none"] == "saved", said


@pytest.mark.parametrize("then", ["save", "close"])
def test_a_writer_killed_mid_save_fails_the_next_save_or_close_with_a_typed_error(tmp_path, then):
    code, lines, err = run(sys.executable, SCRIPT, f"killed-writer-{then}", str(tmp_path))
    assert code == 0, err[-3000:]
    assert lines[0]["error"] == "CheckpointError"
    assert "the writer process died" in lines[0]["message"]
    if then == "save":
        assert lines[1:] == [{"committed": 3}]  # a new writer process took over
        with zs.open(tmp_path / "c") as ck:
            assert ck.step == 3
    assert not (tmp_path / "a" / "manifest.json").exists()


@pytest.fixture(scope="module")
def small_shm(tmp_path_factory) -> tuple[int, list[dict], str]:
    if reason := unavailable("/dev/shm"):
        pytest.skip(reason)
    path = str(tmp_path_factory.mktemp("small-shm"))
    return run(*in_small_tmpfs("/dev/shm", "16m", sys.executable, SCRIPT, "small-shm", path))


@pytest.mark.parametrize("check", ["statvfs", "allocation"])
def test_too_little_shared_memory_is_a_typed_error_that_says_what_to_do(small_shm, check):
    """The up-front check (free space in /dev/shm) and the allocation itself (the kernel's ENOSPC)
    raise the same typed error and leave nothing in /dev/shm. It used to be torch's RuntimeError,
    leaving its file behind."""
    _, lines, err = small_shm
    (got,) = [line for line in lines if line.get("check") == check]
    assert got["error"] == "SharedMemoryError", err[-3000:]
    assert f"need {32 << 20} bytes (32.0 MiB) of shared memory in /dev/shm" in got["message"]
    assert 'AsyncSaver(writer="thread")' in got["message"] and "--shm-size=1g" in got["message"]
    assert got["shm"] == []
    if check == "allocation":
        assert got["cause"] == 28  # ENOSPC from posix_fallocate: before any page is touched, no SIGBUS


def test_saves_that_fit_in_a_small_shm_commit_and_release_their_buffers(small_shm):
    """8 MiB, then another structure of 10 MiB, in 16 MiB: the writer process unmaps the first
    pool's buffers after its save, not when the next job comes."""
    _, lines, err = small_shm
    assert [line for line in lines if "mib" in line] == [{"mib": 8, "committed": 1}, {"mib": 10, "committed": 2}], \
        err[-3000:]


def test_the_script_exits_promptly_with_the_shared_memory_error(small_shm):
    code, _, err = small_shm
    assert code == 1 and "zerostall.errors.SharedMemoryError" in err, err[-3000:]
