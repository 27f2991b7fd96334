"""Round trips between formats, end to end: a zerostall checkpoint written by FSDP2 ranks, exported
to Hugging Face safetensors, imported back, loads bit-exactly into one process and into FSDP2 ranks."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from test_foreign import fsdp_mlp, full, mlp, same_bits

import zerostall as zs
from zerostall.cli import cli


def save_fsdp2(path: str) -> dict[str, torch.Tensor]:
    """A model and its optimizer after one step, under FSDP2, saved by every rank; the full weights."""
    model, optim = fsdp_mlp(seed=5)
    model(torch.randn(4, 16)).square().mean().backward()
    optim.step()
    zs.save({"model": model, "optim": optim}, path, step=1)
    return {k: full(v).detach().clone() for k, v in model.state_dict().items()}


def load_fsdp2(path: str, ref: dict[str, torch.Tensor]) -> list[str]:
    """Load the bare model's weights from ``path`` under FSDP2 on every rank: the keys that differ."""
    model, _ = fsdp_mlp(seed=11)
    zs.load(model, path)
    return [k for k, v in model.state_dict().items() if not same_bits(full(v), ref[k])]


def test_zerostall_to_hf_to_zerostall_is_bit_exact(ranks, tmp_path):
    ck, hf, back = tmp_path / "ck", tmp_path / "hf", tmp_path / "back"
    ref = ranks(2).run(save_fsdp2, str(ck))[0]
    info = zs.export(ck, hf, prefix="model.", max_shard_size=1024)  # several shards and an index
    assert len(info.files) > 1 and (hf / "model.safetensors.index.json").exists()
    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == sorted(ref)
    done = CliRunner().invoke(cli, ["import", str(hf), str(back)])
    assert done.exit_code == 0, done.output
    zs.verify(back)
    for source in (hf, back):  # the export itself, and its import with checksums
        model = mlp(seed=9)
        zs.load(model, source)
        assert all(same_bits(v, ref[k]) for k, v in model.state_dict().items()), source
        assert ranks(2).run(load_fsdp2, str(source), ref) == [[], []]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
def test_the_command_line_exports_diffs_and_inspects_foreign_checkpoints(tmp_path):
    """DCP → HF in one command (`export --allow-pickle`), then `diff` between the HF export and its
    import, and `inspect`: the read-only commands take DCP and safetensors checkpoints as they are."""
    import torch.distributed.checkpoint as dcp

    model = mlp(seed=4)
    dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=str(tmp_path / "dcp"))
    refused = CliRunner().invoke(cli, ["export", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--prefix", "model."])
    assert refused.exit_code == 2 and "--allow-pickle" in refused.output and not (tmp_path / "hf").exists()
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--prefix", "model.",
                                    "--allow-pickle", "--json"])
    assert done.exit_code == 0, done.output
    assert sorted(json.loads(done.output)["keys"]) == sorted(model.state_dict())
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(same_bits(got[k], v) for k, v in model.state_dict().items())
    assert CliRunner().invoke(cli, ["import", str(tmp_path / "hf"), str(tmp_path / "zs")]).exit_code == 0
    same = CliRunner().invoke(cli, ["diff", str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "zs"), "--json"])
    assert same.exit_code == 0 and json.loads(same.output)["equal"], same.output
    other = CliRunner().invoke(cli, ["diff", str(tmp_path / "dcp"), str(tmp_path / "zs"), "--allow-pickle", "--json"])
    assert other.exit_code == 1 and "step" in json.loads(other.output)["only_in_a"], other.output
    assert CliRunner().invoke(cli, ["inspect", str(tmp_path / "dcp")]).exit_code == 2  # needs --allow-pickle
    for source, flags in ((tmp_path / "dcp", ["--allow-pickle"]), (tmp_path / "hf" / "model.safetensors", [])):
        shown = CliRunner().invoke(cli, ["inspect", str(source), "--json", *flags])
        assert shown.exit_code == 0, shown.output
        header = json.loads(shown.output)
        assert header["checksums"] == "none" and header["foreign"] in ("dcp", "safetensors")
        assert {e["fqn"].removeprefix("model.") for e in header["entries"]} >= set(model.state_dict())
