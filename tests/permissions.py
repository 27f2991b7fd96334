"""Saves and loads that the file system refuses; run by tests/test_permissions.py in a process that
cannot override file permissions (root with CAP_DAC_OVERRIDE dropped, or any other user), under
the directory ``sys.argv[1]``. Prints one JSON report: per case, the exception and what was left.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import torch
from click.testing import CliRunner

import zerostall as zs
from zerostall.cli import cli

N = 1000


def state(tag: int) -> dict:
    return {"w": torch.arange(N, dtype=torch.float32) + tag, "step": tag}


def outcome(call: Callable[[], Any]) -> dict:
    try:
        call()
    except Exception as exc:
        return {"error": type(exc).__name__, "typed": isinstance(exc, zs.CheckpointError), "message": str(exc)}
    return {"error": None}


def loads_as(path: str) -> int | None:
    """The step ``path`` holds if it loads bit-exactly and verifies, else None."""
    target = {"w": torch.zeros(N), "step": None}
    out = zs.load(target, path)
    return out["step"] if torch.equal(target["w"], state(out["step"])["w"]) and zs.verify(path) else None


def main() -> None:
    root = sys.argv[1]
    report: dict[str, dict] = {}

    locked = os.path.join(root, "locked")
    os.makedirs(locked)
    os.chmod(locked, 0o555)
    report["save_into_read_only_dir"] = outcome(lambda: zs.save(state(1), os.path.join(locked, "ck")))
    report["save_into_read_only_dir"]["created"] = os.path.exists(os.path.join(locked, "ck"))

    ckpt = os.path.join(root, "ckpt")
    zs.save(state(1), ckpt)
    before = sorted(os.listdir(ckpt))
    os.chmod(ckpt, 0o555)
    report["save_over_read_only_ckpt"] = outcome(lambda: zs.save(state(2), ckpt, overwrite=True))
    report["save_over_read_only_ckpt"].update(unchanged=sorted(os.listdir(ckpt)) == before, holds=loads_as(ckpt))
    os.chmod(ckpt, 0o755)

    data = [os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors")]
    for name in data:
        os.chmod(name, 0)
    report["load_unreadable_data"] = outcome(lambda: zs.load({"w": torch.zeros(N), "step": None}, ckpt))
    report["verify_unreadable_data"] = outcome(lambda: zs.verify(ckpt))
    report["verify_unreadable_data"]["corrupt"] = report["verify_unreadable_data"]["error"] == "CorruptCheckpointError"

    def read() -> None:
        with zs.open(ckpt) as ck:
            ck.read("w")

    report["read_unreadable_data"] = outcome(read)
    report["read_unreadable_data"]["corrupt"] = report["read_unreadable_data"]["error"] == "CorruptCheckpointError"
    report["cli_verify_unreadable_data"] = {"exit_code": CliRunner().invoke(cli, ["verify", ckpt]).exit_code}
    for name in data:
        os.chmod(name, 0o644)

    manifest = os.path.join(ckpt, "manifest.json")
    os.chmod(manifest, 0)
    report["load_unreadable_manifest"] = outcome(lambda: zs.load({"w": torch.zeros(N), "step": None}, ckpt))
    os.chmod(manifest, 0o644)
    report["readable_again"] = {"holds": loads_as(ckpt)}

    report["manager_on_read_only_dir"] = outcome(lambda: zs.CheckpointManager(os.path.join(locked, "run")))

    run = os.path.join(root, "incremental")  # step 2 refers to step 1's data files
    with zs.CheckpointManager(run, incremental=True) as mgr:
        mgr.save(1, {"frozen": torch.arange(float(N)), "w": torch.zeros(10)})
        mgr.save(2, {"frozen": torch.arange(float(N)), "w": torch.ones(10)})
    referred = os.path.join(run, "step_000000001", "manifest.json")
    os.chmod(referred, 0)
    report["open_referring_to_unreadable"] = outcome(lambda: zs.open(os.path.join(run, "step_000000002")).close())
    report["cli_verify_referring_to_unreadable"] = {
        "exit_code": CliRunner().invoke(cli, ["verify", os.path.join(run, "step_000000002")]).exit_code}
    os.chmod(referred, 0o644)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
