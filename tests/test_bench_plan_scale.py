"""bench/plan_scale.py: a smoke run on a few ranks gives every figure in its JSON, and the rows it
plans with are the rows ``collect()`` lists for the same state."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import torch

from zerostall.saving.collect import collect

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "plan_scale.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("plan_scale", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_small_run_reports_every_figure_for_every_layout():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(BENCH), "--ranks", "16", "--params", "12", "--reps", "1", "--json"],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["results"]) == {"fsdp", "fsdp_tp", "hsdp"}
    for layout, res in result["results"].items():
        assert res["ranks"] == 16 and res["ranks_after"] == 8 and res["params"] == 12 and "timeouts" not in res
        zs, dcp = res["zerostall"], res["dcp"]
        for key in ("rows", "digest_s", "plan_s", "gather_payload", "rows_plan_s", "chunks", "replica_slots", "assemble_s",
                    "to_bytes_s", "manifest_bytes", "parse_s", "record_bytes_total"):
            assert zs[key] >= 0, (layout, key)
        assert zs["rows"] == 3 * 12 + 1  # a parameter, its two moments; the step
        assert set(zs["traffic"]) == {"send", "recv"} and zs["traffic"]["recv"] > 0
        assert {"match_s", "route_s", "staged_reads", "used_mask_allreduce_bytes"} <= set(zs["load"])
        for key in ("global_plan_s", "local_plan_bytes", "global_plan_bytes", "metadata_bytes", "metadata_unpickle_s"):
            assert dcp[key] >= 0, (layout, key)
        assert set(dcp["traffic"]) == {"send", "recv", "coordinator_recv"}


def test_the_rows_planned_are_those_collect_lists():
    bench = load_bench()
    specs = bench.transformer(12, hidden=8, ffn=16, vocab=32)
    lay = bench.Layout("fsdp", specs, 1)
    state = {"model": {name: torch.randn(shape) for name, shape, _ in specs},
             "optim": {"state": {name: {"exp_avg": torch.randn(shape), "exp_avg_sq": torch.randn(shape)}
                                 for name, shape, _ in specs}, "step": 7}}
    assert [dataclasses.replace(row, grid=None) for row in lay.rows(0)] == collect(state, 0, allow_pickle=False).rows


def test_boxes_follow_torch_chunk_and_nest_tp_outside_fsdp():
    bench = load_bench()
    assert [bench.split(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert bench.split(2, 4, 3) == (2, 0)  # an empty piece sits at the dimension's end, as DTensor puts it
    # FSDP+TP on 16 ranks: TP rank 1 of 8 holds rows 4-7 of a colwise 32-row weight, FSDP rank 1 of 2 the second half
    assert bench.box("fsdp_tp", (32, 8), 0, 1 * 8 + 1, 16) == ((6, 0), (2, 8))
    assert bench.box("fsdp_tp", (32, 8), 1, 1 * 8 + 1, 16) == ((16, 1), (16, 1))
    assert bench.box("fsdp_tp", (8, 4), 0, 1 * 8 + 3, 16) == ((8, 0), (0, 4))  # empty: at the end, as DTensor has it
    assert bench.box("hsdp", (32, 8), 0, 9, 16) == bench.box("hsdp", (32, 8), 0, 1, 16) == ((4, 0), (4, 8))
