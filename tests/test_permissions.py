"""Permission denied, for real: the file system refuses, and zerostall says so with a typed error
that names the file, and loses nothing.

tests/permissions.py runs in a child process that cannot override file modes (as root: with
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped by ``setpriv``; as any other user: as is);
these tests check its report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("permissions"))
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "permissions.py"), root]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, needs setpriv (util-linux) to drop the capability to override file modes")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    for dirpath, dirnames, filenames in os.walk(root):  # let pytest clean up what was locked
        for name in dirnames + filenames:
            os.chmod(os.path.join(dirpath, name), 0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _refused(case: dict, *names: str) -> None:
    assert case["typed"], case
    assert "Permission denied" in case["message"]
    for name in names:
        assert name in case["message"], case["message"]


def test_a_save_into_a_read_only_directory_is_refused_and_creates_nothing(report):
    case = report["save_into_read_only_dir"]
    _refused(case, "locked/ck")
    assert not case["created"]


def test_a_save_over_a_read_only_checkpoint_is_refused_and_leaves_it_whole(report):
    case = report["save_over_read_only_ckpt"]
    _refused(case, ".safetensors")
    assert case["unchanged"] and case["holds"] == 1


def test_an_unreadable_data_file_is_named_and_is_not_called_corrupt(report):
    _refused(report["load_unreadable_data"], ".safetensors", "entry w")
    verify = report["verify_unreadable_data"]
    _refused(verify, "could not be verified", ".safetensors")
    assert not verify["corrupt"]  # a tool that deletes corrupt checkpoints must not delete this one
    assert report["cli_verify_unreadable_data"]["exit_code"] == 3  # could not verify: not "damaged" (1)
    assert report["readable_again"]["holds"] == 1


def test_reading_an_unreadable_data_file_raises_a_typed_error(report):
    """``Checkpoint.read`` maps the file: the PermissionError of opening it was let through."""
    _refused(report["read_unreadable_data"], ".safetensors")
    assert not report["read_unreadable_data"]["corrupt"]


def test_an_unreadable_manifest_is_named(report):
    _refused(report["load_unreadable_manifest"], "manifest.json")


def test_a_manager_on_a_read_only_directory_raises_a_typed_error(report):
    _refused(report["manager_on_read_only_dir"], "locked/run")


def test_an_unreadable_manifest_of_a_checkpoint_referred_to_is_named(report):
    """A bare PermissionError, and verify called the incremental step damaged (exit 1)."""
    _refused(report["open_referring_to_unreadable"], "step_000000001/manifest.json")
    assert report["cli_verify_referring_to_unreadable"]["exit_code"] == 3
