"""The ``zerostall`` command line over real checkpoints: ls, inspect, verify, errors and exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import zerostall as zs
from zerostall.cli import cli
from zerostall.roots.lease import WriterLease


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


def test_ls_of_a_local_tier_lists_each_steps_copies(tmp_path: Path) -> None:
    """A node directory of the local tier holds runs, steps and one copy a rank: ls lists them
    (a node directory is not a root of checkpoints), a copy that never committed or is damaged as such."""
    node = tmp_path / "node"
    mgr = zs.CheckpointManager(tmp_path / "root", save_every=100, local=zs.LocalTier(str(node), every=1, keep=2))
    for step in (1, 2, 3):
        mgr.save(step, small_state(step))
    mgr.wait()
    mgr.close()
    (run_dir,) = node.iterdir()
    flip_byte(run_dir / "step_000000003" / "rank_00000" / "manifest.json", 60)
    shutil.copytree(run_dir / "step_000000002" / "rank_00000", run_dir / "step_000000002" / "rank_00001")
    (run_dir / "step_000000002" / "rank_00001" / "manifest.json").unlink()  # a copy whose save never committed
    shutil.copytree(run_dir / "step_000000003" / "rank_00000", run_dir / "step_000000003" / ".incoming-rank_00001-0a1b")
    shutil.copytree(run_dir / "step_000000002" / "rank_00000", run_dir / "step_000000002" / ".dropped-rank_00002-0a1b")
    for where in (node, run_dir):
        rows = json.loads(run("ls", where, "--json").stdout)["local_tier"]
        assert [(r["run"], r["step"], r["copy"], r["status"]) for r in rows] == [
            (run_dir.name, 2, ".dropped-rank_00002-0a1b", "dropped"), (run_dir.name, 2, "rank_00000", "committed"),
            (run_dir.name, 2, "rank_00001", "incomplete"),
            (run_dir.name, 3, ".incoming-rank_00001-0a1b", "arriving"), (run_dir.name, 3, "rank_00000", "corrupt")]
        assert rows[1]["bytes"] > 0 and rows[1]["path"] == str(run_dir / "step_000000002" / "rank_00000")
        result = run("ls", where)
        assert result.exit_code == 0, result.output
        lines = [line for line in result.stdout.splitlines() if "rank_" in line]
        assert len(lines) == 5 and "corrupt" in lines[4] and "arriving" in lines[3] and "dropped" in lines[0]
    assert "local_tier" not in json.loads(run("ls", tmp_path / "root", "--json").stdout)


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
    no_file = run("inspect", root / "nope.safetensors")  # was: "a Hugging Face checkpoint with a file missing"
    assert no_file.exit_code == 2 and "no such file" in no_file.stderr
    for result in (missing, incomplete, corrupt, no_file):
        assert "Traceback" not in result.output and result.stdout == ""


def test_an_s3_path_without_the_s3_extra_is_one_line_not_a_traceback(monkeypatch, tmp_path: Path) -> None:
    from zerostall.storage.s3client import Connection

    for name in ("boto3", "botocore"):  # as after pip install zerostall, without [s3]
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(Connection, "_cache", {})  # no client an earlier test made in this process
    for args in (("inspect", "s3://bucket/ck"), ("cp", "s3://bucket/ck", tmp_path / "copy")):
        result = run(*args)
        assert result.exit_code == 2 and "need boto3: pip install 'zerostall[s3]'" in result.stderr, result.output
        assert "Traceback" not in result.output


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
    assert report["bytes_checked"] == 48  # the blocks that passed (model.weight); the damaged one is a fault


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


# -- ls with metrics and retention, prune ------------------------------------------------------
LOSSES = {100: 0.9, 200: 0.3, 300: 0.5, 400: 0.6, 500: 0.7}


@pytest.fixture
def managed(tmp_path: Path) -> Path:
    """A CheckpointManager root: steps 100..500 with a loss (best at 200), then closed."""
    root = tmp_path / "run"
    mgr = zs.CheckpointManager(root, fsync=False)
    try:
        for step, loss in LOSSES.items():
            mgr.save(step, {"w": torch.ones(3) * step}, metrics={"loss": loss, "acc": 1 - loss})
    finally:
        mgr.close()
    return root


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.iterdir() if (p / "manifest.json").exists())


def ls_rows(*args: object) -> dict[int, dict]:
    result = run("ls", *args, "--json")
    assert result.exit_code == 0, result.output
    return {r["step"]: r for r in json.loads(result.stdout)["checkpoints"]}


def test_ls_json_shows_metrics_latest_and_kept_by(managed: Path) -> None:
    rows = ls_rows(managed)
    assert sorted(rows) == sorted(LOSSES)
    for step, loss in LOSSES.items():
        assert rows[step]["metrics"]["loss"] == loss and rows[step]["status"] == "committed"
        assert rows[step]["latest"] is (step == 500)
        assert rows[step]["kept_by"] == (["newest", "all"] if step == 500 else ["all"])
    assert json.loads(run("ls", managed, "--json").stdout)["latest"] == "step_000000500"


def test_ls_table_shows_metrics_and_latest(managed: Path) -> None:
    result = run("ls", managed)
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if "step_" in line}
    assert "loss=0.3" in lines["step_000000200"] and "acc=0.7" in lines["step_000000200"]
    assert "latest" in lines["step_000000500"] and "latest" not in lines["step_000000400"]
    assert "newest" in lines["step_000000500"]


def test_ls_keep_best_marks_the_best_step(managed: Path) -> None:
    rows = ls_rows(managed, "--keep-best", 1, "--metric", "loss")
    assert rows[200]["kept_by"] == ["best"]
    assert rows[500]["kept_by"] == ["newest"]
    assert all(rows[s]["kept_by"] == [] for s in (100, 300, 400))
    rows = ls_rows(managed, "--keep-best", 1, "--metric", "loss", "--mode", "max")
    assert "best" in rows[100]["kept_by"] and "best" not in rows[200]["kept_by"]
    table = run("ls", managed, "--keep-best", 1, "--metric", "loss").stdout
    best = [line for line in table.splitlines() if "best" in line]
    assert len(best) == 1 and "step_000000200" in best[0]


def test_ls_rule_options_are_checked(managed: Path) -> None:
    result = run("ls", managed, "--keep-best", 1)
    assert result.exit_code == 2 and "--metric" in result.stderr
    result = run("ls", managed, "--keep-last", 0)
    assert result.exit_code == 2


def test_ls_of_a_plain_root_keeps_everything(root: Path) -> None:
    rows = {r["name"]: r for r in json.loads(run("ls", root, "--json").stdout)["checkpoints"]}
    assert rows["ckpt-200"]["kept_by"] == ["newest", "all"] and rows["ckpt-10"]["kept_by"] == ["all"]
    assert rows["ckpt-5"]["kept_by"] == [] and rows["ckpt-30"]["kept_by"] == []
    assert not any(r["latest"] for r in rows.values()) and rows["ckpt-10"]["metrics"] == {}


def test_prune_dry_run_deletes_nothing(managed: Path) -> None:
    result = run("prune", managed, "--keep-last", 2, "--dry-run")
    assert result.exit_code == 0, result.output
    assert committed_steps(managed) == sorted(LOSSES)
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if "step_" in line}
    assert all("would delete" in lines[f"step_{s:09d}"] for s in (100, 200, 300))
    assert "keep" in lines["step_000000400"] and "last" in lines["step_000000400"]
    assert "would delete 3 checkpoint(s)" in result.stdout
    report = json.loads(run("prune", managed, "--keep-last", 2, "--dry-run", "--json").stdout)
    assert report["dry_run"] is True and report["deleted"] == []
    assert [r["step"] for r in report["would_delete"]] == [100, 200, 300]
    assert {r["step"]: r["kept_by"] for r in report["kept"]} == {400: ["last"], 500: ["newest", "last"]}
    assert committed_steps(managed) == sorted(LOSSES)


def test_prune_keep_last(managed: Path) -> None:
    result = run("prune", managed, "--keep-last", 2)
    assert result.exit_code == 0, result.output
    assert "deleted 3 checkpoint(s)" in result.stdout
    assert sorted(p.name for p in managed.iterdir() if p.is_dir()) == ["step_000000400", "step_000000500"]
    for step in (400, 500):
        assert zs.verify(managed / f"step_{step:09d}") > 0
    with zs.CheckpointManager(managed, fsync=False) as mgr:
        assert mgr.latest() == "step_000000500"


def test_prune_rules_combine(managed: Path) -> None:
    result = run("prune", managed, "--keep-last", 2, "--keep-best", 1, "--metric", "loss", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["step"] for r in report["deleted"]] == [100, 300] and report["bytes_freed"] > 0
    assert committed_steps(managed) == [200, 400, 500]
    assert not (managed / "step_000000100").exists()


def test_prune_keep_best_never_deletes_the_newest(managed: Path) -> None:
    result = run("prune", managed, "--keep-best", 1, "--metric", "loss")
    assert result.exit_code == 0, result.output
    assert committed_steps(managed) == [200, 500]
    zs.verify(managed / "step_000000500")


def test_prune_needs_a_rule(managed: Path) -> None:
    result = run("prune", managed)
    assert result.exit_code == 2 and "nothing to prune by" in result.stderr
    assert committed_steps(managed) == sorted(LOSSES)


def test_prune_refuses_an_unknown_metric(managed: Path) -> None:
    result = run("prune", managed, "--keep-best", 1, "--metric", "los")
    assert result.exit_code == 2 and "'los'" in result.stderr and "loss" in result.stderr
    assert committed_steps(managed) == sorted(LOSSES)


def test_prune_refuses_while_a_manager_writes(managed: Path) -> None:
    mgr = zs.CheckpointManager(managed, fsync=False)
    try:
        result = run("prune", managed, "--keep-last", 1)
        assert result.exit_code == 1 and "being written" in result.stderr and "--force" in result.stderr
        assert "Traceback" not in result.output
        assert committed_steps(managed) == sorted(LOSSES)
        forced = run("prune", managed, "--keep-last", 1, "--force")
        assert forced.exit_code == 0, forced.output
        assert committed_steps(managed) == [500]
    finally:
        mgr.close()


def test_cp_and_import_into_a_root_a_manager_writes_are_refused_unless_forced(managed: Path, tmp_path: Path) -> None:
    """A copy or import into a live manager's root could be taken for one of its steps (its retention
    then deletes real ones): refused like prune, nothing written; --force goes on, with a warning."""
    from safetensors.torch import save_file
    save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    source = managed / "step_000000200"
    mgr = zs.CheckpointManager(managed, fsync=False)
    try:
        for command in (["cp", source, managed / "step_000000900"],
                        ["import", tmp_path / "model.safetensors", managed / "step_000000900"]):
            result = run(*command)
            assert result.exit_code == 1 and "being written" in result.stderr and "--force" in result.stderr, \
                result.output
            assert not (managed / "step_000000900").exists() and committed_steps(managed) == sorted(LOSSES)
        assert run("cp", source, tmp_path / "elsewhere").exit_code == 0  # another directory: no lease there
        forced = run("cp", source, managed / "step_000000900", "--force")
        assert forced.exit_code == 0 and "holds the writer lease (--force)" in forced.stderr, forced.output
        assert committed_steps(managed) == [*sorted(LOSSES), 900]
    finally:
        mgr.close()


def test_prune_ignores_a_stale_lease(managed: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    me = WriterLease(str(managed), ttl=60, fsync=False).me  # this host and boot, a pid that has exited
    lease = {**me, "pid": int(dead.stdout), "renewed": time.time()}
    (managed / ".writer-lease").write_text(json.dumps(lease))
    result = run("prune", managed, "--keep-last", 1)
    assert result.exit_code == 0, result.output
    assert committed_steps(managed) == [500]


def test_prune_leaves_incomplete_checkpoints_alone(managed: Path) -> None:
    attempt = managed / "step_000000600"
    zs.save({"w": torch.ones(3)}, attempt, step=600)
    (attempt / "manifest.json").unlink()
    result = run("prune", managed, "--keep-last", 1, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(r["name"], r["status"]) for r in report["skipped"]] == [("step_000000600", "incomplete")]
    assert attempt.is_dir() and committed_steps(managed) == [500]
    table = run("prune", managed, "--keep-last", 1, "--dry-run").stdout
    assert "leave alone" in table and "incomplete" in table


def test_prune_keeps_what_latest_points_at(managed: Path) -> None:
    (managed / "latest").write_text(json.dumps({"tag": "step_000000300", "step": 300}))
    report = json.loads(run("prune", managed, "--keep-last", 1, "--json").stdout)
    assert {r["step"]: r["kept_by"] for r in report["kept"]} == {300: ["pinned"], 500: ["newest", "last"]}
    assert committed_steps(managed) == [300, 500]


def test_prune_of_a_checkpoint_or_nothing(managed: Path, tmp_path: Path) -> None:
    result = run("prune", managed / "step_000000500", "--keep-last", 1)
    assert result.exit_code == 2 and "is a checkpoint" in result.stderr
    result = run("prune", tmp_path / "missing", "--keep-last", 1)
    assert result.exit_code == 2 and "no such directory" in result.stderr
    assert committed_steps(managed) == sorted(LOSSES)


def test_commands_that_take_a_checkpoint_take_a_root_latest_or_a_step_while_a_manager_writes(tmp_path: Path) -> None:
    with zs.CheckpointManager(tmp_path / "run") as mgr:  # holds the writer lease throughout
        for step in (10, 20):
            mgr.save(step, small_state(step))
        newest = str(tmp_path / "run" / "step_000000020")
        for ckpt, step, path in [(tmp_path / "run", 20, newest), (tmp_path / "run" / "latest", 20, newest),
                                 (tmp_path / "run" / "10", 10, str(tmp_path / "run" / "step_000000010"))]:
            report = json.loads(run("inspect", ckpt, "--json").stdout)
            assert (report["step"], report["path"]) == (step, path)
            report = json.loads(run("verify", ckpt, "--json").stdout)
            assert report["ok"] and report["path"] == path
        result = run("inspect", tmp_path / "run" / "30")
        assert result.exit_code == 2 and "no committed checkpoint of step 30" in result.stderr
        assert "steps there: 10, 20" in result.stderr
        assert run("verify", tmp_path / "nothing-here").exit_code == 2

