"""bench/lightning.py: a tiny run times every plugin's save inside ``fit``, loads each checkpoint
back equal and ends with one JSON object holding the acceptance verdict and its numbers."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install 'zerostall[lightning]')")

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "lightning.py"
CONTENDERS = {"default", "lightning_async", "zerostall_async", "zerostall"}


def test_a_tiny_run_reports_every_plugin_and_the_acceptance(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(BENCH), "--params-mb", "1", "--reps", "2", "--dir", str(tmp_path),
                           "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["errors"] == {}
    assert set(result["contenders"]) == CONTENDERS
    for name, c in result["contenders"].items():
        assert c["loads_equal"] is True, name
        assert len(c["seconds"]) == 2, name  # the warm-up rep is not counted
        assert 0 <= c["blocking_s"] <= c["done_s"] <= c["durable_s"], name
        assert c["bytes"] > 3 * result["params_bytes"] * 0.9, name  # weights + AdamW's two moments
    acceptance = result["acceptance"]
    assert acceptance["all_load_back_equal"] is True and isinstance(acceptance["met"], bool)
    assert acceptance["zerostall_async_blocking_s"] == result["contenders"]["zerostall_async"]["blocking_s"]
    assert acceptance["default_blocking_s"] == result["contenders"]["default"]["blocking_s"]
    assert acceptance["lightning_async_blocking_s"] == result["contenders"]["lightning_async"]["blocking_s"]
    assert any(line.startswith("acceptance") for line in lines[:-1])  # the table before the JSON
    assert not list(tmp_path.iterdir())  # the checkpoints are deleted
