"""``zerostall diff``: entries only in one side, kind/dtype/shape/value changes, tensor values
compared a slab at a time within a tolerance, and diff(1)'s exit statuses."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

import zerostall as zs
from zerostall.cli import cli, comparing


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, ["diff", *map(str, args)])


def base_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.zeros(7), "n": 3,
            "h": torch.ones(4, dtype=torch.bfloat16), "i": torch.arange(10), "nan": torch.tensor([math.nan, 1.0])}


def test_equal_checkpoints_exit_0_and_every_byte_is_compared(tmp_path):
    zs.save(base_state(), tmp_path / "a")
    zs.save(base_state(), tmp_path / "b")  # another generation, other files: equal all the same
    result = run(tmp_path / "a", tmp_path / "b", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    tensors = [t for t in base_state().values() if isinstance(t, torch.Tensor)]
    assert report["equal"] and report["compared"] == 6
    assert report["bytes_compared"] == 2 * sum(t.nbytes for t in tensors)


def test_every_kind_of_difference_is_named_and_exits_1(tmp_path):
    zs.save(base_state(), tmp_path / "a")
    changed = base_state()
    changed["w"][299, 69] += 0.25
    changed["n"] = 4
    changed["h"] = torch.ones(4)
    changed["i"] = torch.arange(11)
    changed["extra"] = torch.ones(1)
    del changed["b"]
    zs.save(changed, tmp_path / "b")
    result = run(tmp_path / "a", tmp_path / "b", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["only_in_a"] == ["b"] and report["only_in_b"] == ["extra"] and not report["equal"]
    found = {d["key"]: d for d in report["differences"]}
    assert set(found) == {"w", "n", "h", "i"}
    assert found["w"]["what"] == "values" and found["w"]["max_abs"] == pytest.approx(0.25, rel=1e-6)
    assert found["n"] == {"key": "n", "what": "value", "a": "3", "b": "4", "max_abs": None, "max_rel": None}
    assert found["h"]["what"] == "dtype" and found["h"]["max_abs"] == 0.0  # bf16 ones vs f32 ones: same values
    assert found["i"]["what"] == "shape"
    text = run(tmp_path / "a", tmp_path / "b")
    assert text.exit_code == 1 and "only in A" in text.output and "different: 4 of 5 common entries" in text.output


def test_a_difference_in_the_last_slab_of_a_tensor_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(comparing, "SLAB_BYTES", 1000)  # 70x300 floats: many slabs, partial rows between them
    zs.save(base_state(), tmp_path / "a")
    changed = base_state()
    changed["w"][299, 69] = changed["w"][299, 69] * 1.5 + 1.0
    zs.save(changed, tmp_path / "b")
    report = json.loads(run(tmp_path / "a", tmp_path / "b", "--json").output)
    [w] = report["differences"]
    want = abs(float(changed["w"][299, 69]) - float(base_state()["w"][299, 69]))
    assert w["key"] == "w" and w["max_abs"] == pytest.approx(want, rel=1e-6)
    assert report["bytes_compared"] == 2 * sum(t.nbytes for t in base_state().values() if isinstance(t, torch.Tensor))


def test_tolerances_decide_what_is_equal(tmp_path):
    zs.save({"w": torch.full((5,), 100.0)}, tmp_path / "a")
    zs.save({"w": torch.full((5,), 100.01)}, tmp_path / "b")
    assert run(tmp_path / "a", tmp_path / "b").exit_code == 1
    assert run(tmp_path / "a", tmp_path / "b", "--atol", "0.02").exit_code == 0
    assert run(tmp_path / "a", tmp_path / "b", "--rtol", "1e-3").exit_code == 0
    assert run(tmp_path / "a", tmp_path / "b", "--rtol", "1e-6").exit_code == 1
    assert run(tmp_path / "a", tmp_path / "b", "--atol", "-1").exit_code == 2


def test_integers_that_differ_past_2_to_the_53_differ(tmp_path):
    """They were compared as float64, where 2**53 and 2**53 + 1 are one number: "equal", exit 0."""
    zs.save({"ids": torch.tensor([2**53, 7], dtype=torch.int64)}, tmp_path / "a")
    zs.save({"ids": torch.tensor([2**53 + 1, 7], dtype=torch.int64)}, tmp_path / "b")
    result = run(tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 1 and "ids" in result.output


def test_tolerances_hold_for_integer_tensors_too(tmp_path):
    """--atol was ignored for integers: [1, 2] against [1, 3] differed (exit 1) at --atol 5."""
    zs.save({"n": torch.tensor([1, 2]), "ids": torch.tensor([2**60, 7])}, tmp_path / "a")
    zs.save({"n": torch.tensor([1, 3]), "ids": torch.tensor([2**60 + 2, 7])}, tmp_path / "b")
    assert run(tmp_path / "a", tmp_path / "b").exit_code == 1
    assert run(tmp_path / "a", tmp_path / "b", "--atol", "5").exit_code == 0
    result = run(tmp_path / "a", tmp_path / "b", "--atol", "1", "--json")  # "ids" differs by 2, exactly
    assert result.exit_code == 1
    assert [(d["key"], d["max_abs"]) for d in json.loads(result.output)["differences"]] == [("ids", 2.0)]


def test_nan_on_one_side_only_differs(tmp_path):
    zs.save({"x": torch.tensor([math.nan, 1.0])}, tmp_path / "a")
    zs.save({"x": torch.tensor([0.0, 1.0])}, tmp_path / "b")
    output = run(tmp_path / "a", tmp_path / "b", "--json", "--atol", "1e9").output

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    report = json.loads(output, parse_constant=refuse)  # as strict parsers read it (Infinity used to be there)
    assert [d["key"] for d in report["differences"]] == ["x"] and report["differences"][0]["max_abs"] == "inf"


def test_trouble_exits_2_never_1(tmp_path):
    zs.save({"w": torch.ones(3)}, tmp_path / "a")
    missing = run(tmp_path / "a", tmp_path / "nothing")
    assert missing.exit_code == 2 and "no checkpoint" in missing.output
    zs.save({"w": torch.ones(3)}, tmp_path / "b")
    [data] = [p for p in (tmp_path / "b").iterdir() if p.suffix == ".safetensors"]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    corrupt = run(tmp_path / "a", tmp_path / "b")
    assert corrupt.exit_code == 2 and "checksum" in corrupt.output


def test_a_manager_checkpoint_equals_itself_rng_states_included(tmp_path):
    with zs.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(5, {"w": torch.ones(3), "meta": {"arr": np.arange(4), "t": torch.zeros(2)}})
    result = run(tmp_path / "ckpt" / "5", tmp_path / "ckpt" / "step_000000005")
    assert result.exit_code == 0, result.output


def test_entries_whose_dotted_names_coincide_are_each_compared(tmp_path):
    """The key "a.b" and ``a`` → ``b`` share the dotted name a.b: one hid the other, and a difference
    in the hidden one was reported as equal."""
    zs.save({"a.b": torch.zeros(4), "a": {"b": torch.ones(4)}}, tmp_path / "A")
    zs.save({"a.b": torch.full((4,), 7.0), "a": {"b": torch.ones(4)}}, tmp_path / "B")
    result = run(tmp_path / "A", tmp_path / "B", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["compared"] == 2 and [d["key"] for d in report["differences"]] == ["['a.b']"]
