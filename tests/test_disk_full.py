"""Saves on a disk that really fills up: the kernel's own ENOSPC and short writes, not injected ones.

tests/disk_full.py runs in a child process with a private mount namespace (tests/small_tmpfs.py) on a
16 MiB tmpfs, fills it to a chosen number of free pages before each save and reports what
happened; these tests check that report. (tests/test_crash.py injects the same failures into
the write calls, on any machine.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from small_tmpfs import in_small_tmpfs, unavailable


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    directory = str(tmp_path_factory.mktemp("small-disk"))
    if reason := unavailable(directory):
        pytest.skip(reason)
    script = os.path.join(os.path.dirname(__file__), "disk_full.py")
    done = subprocess.run(in_small_tmpfs(directory, "16m", sys.executable, script, directory),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _generation_files(files: list[str]) -> set[str]:
    return {name.split("-r")[0] for name in files if name.endswith(".safetensors")}


@pytest.mark.parametrize("stage", ["data", "manifest"])
def test_a_save_that_fills_the_disk_keeps_the_old_checkpoint(report, stage):
    got = report[stage]
    assert got["error"] == "CheckpointError"
    assert "No space left on device" in got["message"]
    if stage == "data":
        assert ".safetensors" in got["message"]  # names the data file that did not fit
    else:
        assert "committing the manifest" in got["message"]
    assert got["after"] == {"step": 1, "exact": True, "verified": True}
    assert len(_generation_files(got["files"])) == 1 and "manifest.json" in got["files"]
    assert not [f for f in got["files"] if f.endswith(".tmp")]


def test_a_first_save_that_fills_the_disk_leaves_no_checkpoint(report):
    got = report["first"]
    assert got["error"] == "CheckpointError" and "No space left on device" in got["message"]
    assert got["files"] == []


@pytest.mark.parametrize("stage", ["data", "manifest", "first"])
def test_the_next_save_after_space_is_freed_commits_and_leaves_one_generation(report, stage):
    got = report[stage]
    assert got["next"] == {"step": 3, "exact": True, "verified": True}
    assert len(_generation_files(got["files_after_next_save"])) == 1
    assert sorted(got["files_after_next_save"])[-1] == "manifest.json"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_manager_that_cannot_update_latest_says_so_and_deletes_nothing(report, mode):
    got = report[f"manager_{mode}"]
    assert got["error"] == "CheckpointError"
    assert "step_000000002 is committed" in got["message"] and "No space left on device" in got["message"]
    # `latest` still names step 1, so retention (keep the last one) must not have deleted it
    assert json.loads(got["latest"]) == {"tag": "step_000000001", "step": 1}
    assert {"step_000000001", "step_000000002"} <= set(got["files"])
    assert not [f for f in got["files"] if f.endswith(".tmp")]
    assert json.loads(got["latest_after_next_save"]) == {"tag": "step_000000003", "step": 3}
    assert got["files_after_next_save"] == ["latest", "step_000000003"]
    assert got["restored"] == 3 and got["exact"]
