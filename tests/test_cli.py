"""The ``zerostall`` command line over real checkpoints: ls, inspect, verify, errors and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import zerostall as zs
from zerostall.cli import cli


def small_state(step: int) -> dict[str, object]:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "model": {"weight": weight, "tied": weight, "bias": torch.zeros(4, dtype=torch.bfloat16)},
        "step": step,
        "sched": {"betas": (0.9, 0.999)},
    }


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Four checkpoints: steps 10 and 200 committed, step 5 incomplete, step 30 corrupt."""
    for step in (200, 10, 5, 30):
        zs.save(small_state(step), tmp_path / f"ckpt-{step}", step=step)
    (tmp_path / "ckpt-5" / "manifest.json").unlink()
    flip_byte(tmp_path / "ckpt-30" / "manifest.json", 60)
    (tmp_path / "not-a-checkpoint").mkdir()
    return tmp_path


def test_ls_table(root: Path) -> None:
    result = run("ls", root)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if "ckpt-" in line]
    assert [line.split()[1] for line in lines] == ["ckpt-10", "ckpt-200", "ckpt-30", "ckpt-5"]
    status = {line.split()[1]: line for line in lines}
    assert "committed" in status["ckpt-10"] and " 10 " in status["ckpt-10"]
    assert "committed" in status["ckpt-200"] and " 200 " in status["ckpt-200"]
    assert "incomplete" in status["ckpt-5"]
    assert "corrupt" in status["ckpt-30"]
    assert "not-a-checkpoint" not in result.stdout


def test_ls_json(root: Path) -> None:
    result = run("ls", root, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)["checkpoints"]}
    assert set(rows) == {"ckpt-10", "ckpt-200", "ckpt-5", "ckpt-30"}
    good = rows["ckpt-200"]
    assert good["status"] == "committed" and good["step"] == 200
    files = [p for p in (root / "ckpt-200").iterdir() if p.suffix == ".safetensors"]
    assert good["bytes"] == sum(p.stat().st_size for p in files) > 0
    assert isinstance(good["created"], float) and good["path"] == str(root / "ckpt-200")
    assert rows["ckpt-5"]["status"] == "incomplete" and rows["ckpt-5"]["bytes"] > 0
    assert rows["ckpt-30"]["status"] == "corrupt" and "checksum" in rows["ckpt-30"]["error"]


def test_ls_of_a_checkpoint_itself_and_of_nothing(root: Path, tmp_path: Path) -> None:
    rows = json.loads(run("ls", root / "ckpt-10", "--json").stdout)["checkpoints"]
    assert [(r["name"], r["step"]) for r in rows] == [("ckpt-10", 10)]
    result = run("ls", tmp_path / "missing")
    assert result.exit_code == 2 and "no such directory" in result.stderr
    assert "Traceback" not in result.output


def test_inspect(root: Path) -> None:
    result = run("inspect", root / "ckpt-10")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "format version" in out and "generation" in out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert "float32" in rows["model.weight"] and "[3, 4]" in rows["model.weight"]
    assert "bfloat16" in rows["model.bias"] and "[4]" in rows["model.bias"]
    assert "alias" in rows["model.tied"] and "model.weight" in rows["model.tied"]
    assert "object" in rows["sched"] and "(0.9, 0.999)" in rows["sched"]


def test_inspect_json(root: Path) -> None:
    result = run("inspect", root / "ckpt-10", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["format_version"] == zs.FORMAT_VERSION and info["step"] == 10 and info["world_size"] == 1
    assert info["files"] >= 1 and info["total_bytes"] > 0 and info["generation"]
    entries = {e["fqn"]: e for e in info["entries"]}
    assert entries["model.weight"] == {"fqn": "model.weight", "kind": "tensor", "dtype": "float32",
                                       "shape": [3, 4], "chunks": 1, "bytes": 48}
    assert entries["model.tied"] == {"fqn": "model.tied", "kind": "alias", "alias_of": "model.weight"}
    assert entries["step"]["value"] == "10"


def test_inspect_errors(root: Path) -> None:
    missing = run("inspect", root / "nope")
    assert missing.exit_code == 2 and "no checkpoint" in missing.stderr
    incomplete = run("inspect", root / "ckpt-5")
    assert incomplete.exit_code == 1 and "never committed" in incomplete.stderr
    corrupt = run("inspect", root / "ckpt-30")
    assert corrupt.exit_code == 1 and "checksum" in corrupt.stderr
    for result in (missing, incomplete, corrupt):
        assert "Traceback" not in result.output and result.stdout == ""


def test_verify_good_then_flipped_byte(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    zs.save(small_state(1), path, step=1)
    result = run("verify", path)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK") and "GB/s" in result.stdout
    report = json.loads(run("verify", path, "--json").stdout)
    assert report["ok"] is True and report["bytes_checked"] == 48 + 8 and report["faults"] == []

    with zs.open(path) as ck:
        chunk = ck.entries["model.bias"].chunks[0]
    flip_byte(path / chunk.file, chunk.offset + 1)
    result = run("verify", path)
    assert result.exit_code == 1
    assert "FAILED" in result.stderr and "model.bias" in result.stderr and "Traceback" not in result.output
    report = json.loads(run("verify", path, "--json").stdout)
    assert report["ok"] is False and any("model.bias" in f for f in report["faults"])


def test_verify_lists_every_fault(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    zs.save(small_state(1), path, step=1, threads=1)
    with zs.open(path) as ck:
        chunks = [ck.entries[name].chunks[0] for name in ("model.weight", "model.bias")]
    for chunk in chunks:
        flip_byte(path / chunk.file, chunk.offset)
    result = run("verify", path)
    assert result.exit_code == 1
    assert "2 fault(s)" in result.stderr and "model.weight" in result.stderr and "model.bias" in result.stderr


def test_verify_missing_and_incomplete(root: Path) -> None:
    missing = run("verify", root / "nope")
    assert missing.exit_code == 2 and "no checkpoint" in missing.stderr
    incomplete = run("verify", root / "ckpt-5", "--json")
    assert incomplete.exit_code == 1
    report = json.loads(incomplete.stdout)
    assert report["ok"] is False and "never committed" in report["faults"][0]


def test_console_script(root: Path) -> None:
    script = Path(sys.executable).parent / "zerostall"
    done = subprocess.run([script, "inspect", root / "ckpt-10"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "model.weight" in done.stdout and "float32" in done.stdout
