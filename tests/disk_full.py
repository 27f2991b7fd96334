"""Saves on a file system that really fills up; run by tests/test_disk_full.py inside a private
mount namespace, on a small tmpfs mounted at ``sys.argv[1]``, and prints one JSON report.

Each scenario leaves a fixed number of free pages by writing a filler file, so the save fails at a
chosen stage: in the data files, in the manifest, or (for a manager) in the ``latest`` mirror.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

import zerostall as zs

PAGE = 4096
N = 3 << 18  # 3 MiB of float32 per tensor


def state(tag: int) -> dict:
    return {"w": torch.arange(N, dtype=torch.float32) + tag, "step": tag}


def loaded(path: str) -> dict:
    """What ``path`` holds now: its step, whether its tensor is exactly that step's, whether it verifies."""
    target = {"w": torch.zeros(N), "step": None}
    out = zs.load(target, path)
    return {"step": out["step"], "exact": torch.equal(target["w"], state(out["step"])["w"]),
            "verified": zs.verify(path) > 0}


def leave_free(root: str, pages: int) -> None:
    """Fill the file system until exactly ``pages`` pages are free."""
    vfs = os.statvfs(root)
    free = vfs.f_bavail * vfs.f_frsize
    with open(os.path.join(root, "filler"), "wb") as f:
        f.write(b"\0" * (free - pages * PAGE))
    vfs = os.statvfs(root)
    assert vfs.f_bavail * vfs.f_frsize == pages * PAGE, "the filler did not leave the free space asked for"


def pages(path: str, suffix: str = "") -> int:
    """Pages taken by the files in directory ``path`` whose names end with ``suffix``."""
    return sum(os.stat(e.path).st_blocks * 512 // PAGE for e in os.scandir(path) if e.name.endswith(suffix))


def failed_save(path: str, new: dict) -> dict:
    try:
        zs.save(new, path, overwrite=True)
    except zs.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def scenario(root: str, name: str, free_pages: int, first: bool = False) -> dict:
    """Save step 1, leave ``free_pages`` free, save step 2 into the same path (or, ``first``, into
    a new one), then free the space and save step 3: report each outcome and what was left."""
    path = os.path.join(root, name)
    if not first:
        zs.save(state(1), path)
    leave_free(root, free_pages)
    report = failed_save(path, state(2))
    report["files"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
    report["after"] = loaded(path) if not first else None
    os.remove(os.path.join(root, "filler"))
    zs.save(state(3), path, overwrite=True)
    report["files_after_next_save"] = sorted(os.listdir(path))
    report["next"] = loaded(path)
    shutil.rmtree(path)
    return report


def manager_scenario(root: str, async_save: bool) -> dict:
    """A manager (keeping the last one) whose second save commits but cannot update the
    ``latest`` file (one page short): the error reaches the caller, nothing is deleted while
    ``latest`` names the first; a third save with space again catches up; restore finds it."""
    path = os.path.join(root, f"mgr-async{int(async_save)}")
    mgr = zs.CheckpointManager(path, keep_last=1, async_save=async_save)
    mgr.save(1, state(1))
    mgr.wait()
    leave_free(root, pages(os.path.join(path, "step_000000001")))  # step 2's files fit, `latest` does not
    report: dict = {"error": None}
    try:
        mgr.save(2, state(2))
        mgr.wait()
    except Exception as exc:
        report = {"error": type(exc).__name__, "message": str(exc)}
    mgr.wait()  # retention runs in the background: let whatever the failed commit set off finish first
    report["files"] = sorted(os.listdir(path))
    report["latest"] = Path(path, "latest").read_text()
    os.remove(os.path.join(root, "filler"))
    mgr.save(3, state(3))  # with space again: `latest` moves on and retention catches up
    mgr.close()
    report["files_after_next_save"] = sorted(os.listdir(path))
    report["latest_after_next_save"] = Path(path, "latest").read_text()
    target = {"w": torch.zeros(N), "step": None}
    with zs.CheckpointManager(path) as again:
        report["restored"] = again.restore(target)
        report["exact"] = torch.equal(target["w"], state(report["restored"])["w"])
    return report


def main() -> None:
    root = sys.argv[1]
    zs.save(state(0), os.path.join(root, "probe"))
    one_file = pages(os.path.join(root, "probe"), ".safetensors")
    shutil.rmtree(os.path.join(root, "probe"))
    report = {
        "data": scenario(root, "data", free_pages=one_file // 2),
        "manifest": scenario(root, "manifest", free_pages=one_file),
        "first": scenario(root, "first", free_pages=one_file // 2, first=True),
        "manager_sync": manager_scenario(root, async_save=False),
        "manager_async": manager_scenario(root, async_save=True),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
