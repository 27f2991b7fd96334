"""bench/incremental.py: a tiny run reports every figure of both kinds of save, loads every step back
equal, and its incremental saves write fewer bytes than full ones from the second save on."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "incremental.py"
KINDS = {"incremental", "full"}


def test_a_tiny_run_reports_every_figure_and_writes_less_incrementally(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(BENCH), "--base-gib", "0.004", "--layers", "2", "--saves", "5",
                           "--steps", "1", "--load-reps", "1", "--dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["errors"] == {}
    assert result["config"]["saves"] == 5 and result["config"]["base_bytes"] > 0
    figures_of = {"sync": {"bytes_written", "save_s"}, "async": {"bytes_written", "stall_s", "committed_s"}}
    for mode, figures in figures_of.items():
        assert set(result[mode]) == KINDS, mode
        for kind in KINDS:
            got = result[mode][kind]
            assert set(got["first"]) == set(got["median_later"]) == set(got["each"]) == figures, (mode, kind)
            assert all(len(values) == 5 for values in got["each"].values()), (mode, kind)
        inc, full = result[mode]["incremental"]["each"]["bytes_written"], result[mode]["full"]["each"]["bytes_written"]
        assert inc[0] == full[0]  # the first save is a full one for both
        assert all(i < f for i, f in zip(inc[1:], full[1:])), (mode, inc, full)
        assert all(i < inc[0] for i in inc[1:]), (mode, inc)  # the frozen base is not written again
    for which, step in (("newest", 5), ("old", 3)):
        load = result["load"][which]
        assert load["step"] == step and load["loads_equal"] == {"incremental": True, "full": True}, which
        assert load["incremental_s"] > 0 and load["full_s"] > 0, which
    assert result["load"]["old"]["deleted_steps"] == [1, 2, 4]
    assert set(result["ratios"]) == {"bytes_x", "save_x", "stall_ratio", "committed_x", "load_newest_ratio",
                                     "load_old_ratio"}
    assert result["ratios"]["bytes_x"] > 1
    acceptance = result["acceptance"]
    assert acceptance["loads_equal"] is True and isinstance(acceptance["met"], bool)
    assert any(line.startswith("acceptance") for line in lines[:-1])  # the table before the JSON
    assert not list(tmp_path.iterdir())  # the checkpoints are deleted
