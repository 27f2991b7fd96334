"""Save → load round trips: every dtype, odd tensors, python values, stateful objects."""

from __future__ import annotations

import gc
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

import zerostall as zs
from zerostall.format.layout import load_json

QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype) and d not in QUANTIZED}, key=str)


def random_bytes_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaN/Inf patterns included)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype):
    state = {"t": random_bytes_tensor(dtype, (3, 5)), "scalar": random_bytes_tensor(dtype, (), 1),
             "empty": torch.empty(0, 4, dtype=dtype)}
    zs.save(state, tmp_path / "ck")
    target = {k: torch.empty_like(v) for k, v in state.items()}
    for t in target.values():
        t.reshape(-1).view(torch.uint8).zero_()
    zs.load(target, tmp_path / "ck")
    for k in state:
        assert same_bytes(target[k], state[k]), k
    with zs.open(tmp_path / "ck") as ck:
        assert same_bytes(ck.read("t"), state["t"])
        assert ck.entries["t"].dtype == str(dtype).removeprefix("torch.")


def test_data_files_are_valid_safetensors(tmp_path):
    from safetensors import safe_open

    state = {"a": torch.randn(7, 3), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(9, dtype=torch.int16),
             "z": torch.randn(2, 2, dtype=torch.complex64), "f8": torch.randn(4).to(torch.float8_e4m3fn)}
    zs.save(state, tmp_path / "ck")
    found = {}
    for name in os.listdir(tmp_path / "ck"):
        if name.endswith(".safetensors"):
            with open(tmp_path / "ck" / name, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
            assert (8 + header_len) % 4096 == 0
            with safe_open(str(tmp_path / "ck" / name), framework="pt") as f:
                for key in f.keys():
                    found[key] = f.get_tensor(key)
    for key in ("a", "b", "c", "f8"):
        assert same_bytes(found[key], state[key])
    assert found["z"].dtype == torch.uint8 and same_bytes(found["z"].view(torch.complex64).reshape(2, 2), state["z"])


def test_non_contiguous_views_store_only_their_bytes(tmp_path):
    base = torch.randn(512, 512)
    state = {"t": base.t(), "strided": base[::4, 1::3], "conj": torch.randn(8, dtype=torch.complex64).conj()}
    zs.save(state, tmp_path / "ck")
    data = sum(os.path.getsize(tmp_path / "ck" / n) for n in os.listdir(tmp_path / "ck") if n.endswith(".safetensors"))
    assert data < 2 * base.nbytes  # the transpose is the full base once; the strided view is a small part
    target = {"t": torch.empty(512, 512), "strided": torch.empty(128, 171), "conj": torch.empty(8, dtype=torch.complex64)}
    zs.load(target, tmp_path / "ck")
    assert torch.equal(target["t"], base.t())
    assert torch.equal(target["strided"], base[::4, 1::3])
    assert torch.equal(target["conj"], state["conj"].resolve_conj())


def test_load_into_non_contiguous_target(tmp_path):
    src = torch.randn(6, 4)
    zs.save({"x": src}, tmp_path / "ck")
    holder = torch.zeros(4, 6)
    zs.load({"x": holder.t()}, tmp_path / "ck")
    assert torch.equal(holder.t(), src)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_shared_storage_is_stored_once_and_ties_survive(tmp_path):
    model = Tied()
    halves = torch.randn(10)
    waves = torch.randn(4, dtype=torch.complex64)
    # Views that start at one address but differ in shape, stride or conjugation are not aliases.
    state = {"model": model, "lo": halves[:5], "hi": halves[5:], "again": halves[:5], "head": halves[:3],
             "grid": halves.view(2, 5), "every2": halves[::2], "waves": waves, "conj": waves.conj()}
    zs.save(state, tmp_path / "ck")
    with zs.open(tmp_path / "ck") as ck:
        kinds = {k: e.kind for k, e in ck.entries.items()}
        assert kinds["model.head.weight"] == "alias" and kinds["model.emb.weight"] == "tensor"
        assert kinds["again"] == "alias" and kinds["lo"] == kinds["hi"] == "tensor"
        assert kinds["head"] == kinds["grid"] == kinds["every2"] == kinds["waves"] == kinds["conj"] == "tensor"
        for key in ("head", "grid", "every2", "waves", "conj"):
            assert torch.equal(ck.read(key), state[key].resolve_conj()), key
        whole = ck.state()
        assert whole["model"]["head.weight"] is whole["model"]["emb.weight"]
    fresh = Tied()
    target = {"model": fresh, "lo": torch.empty(5), "hi": torch.empty(5), "again": torch.empty(5),
              "head": torch.empty(3), "grid": torch.empty(2, 5), "every2": torch.empty(5),
              "waves": torch.empty(4, dtype=torch.complex64), "conj": torch.empty(4, dtype=torch.complex64)}
    zs.load(target, tmp_path / "ck")
    for key in ("head", "grid", "every2", "waves", "conj"):
        assert torch.equal(target[key], state[key].resolve_conj()), key
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    assert torch.equal(target["again"], halves[:5]) and torch.equal(target["hi"], halves[5:])


def test_python_values_keep_their_types(tmp_path):
    values = {
        "tuple": (1, 2.5, "x"), "list": [1, [2, 3]], "nan": float("nan"), "inf": -float("inf"),
        "bytes": b"\x00\xff", "int_keys": {1: "a", (2, 3): "b", None: 0, 1.5: True}, "dollar": {"$tuple": 1},
        "set": {1, 2}, "complex": 1 + 2j, "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
        "device": torch.device("cpu"), "np": np.arange(6, dtype=np.int32).reshape(2, 3), "np_scalar": np.float64(0.5),
        "big": 2**100, "none": None, "empty": {}, "u64": 2**64 - 1, "past_u64": 2**64, "i64": -2**63,
        "past_i64": -2**63 - 1, "surrogate\ud800": "\udfff",
    }
    zs.save({"v": values}, tmp_path / "ck")
    with zs.open(tmp_path / "ck") as ck:
        back = ck.state()["v"]
    for key, value in values.items():
        if key == "nan":
            assert math.isnan(back[key])
        elif key == "np":
            assert back[key].dtype == np.int32 and np.array_equal(back[key], value)
        else:
            assert back[key] == value and type(back[key]) is type(value), key


def test_load_returns_state_with_rebuilt_tuples(tmp_path):
    zs.save({"pair": (torch.ones(2), 7), "n": 3}, tmp_path / "ck")
    target = {"pair": (torch.zeros(2), 0), "n": 0}
    out = zs.load(target, tmp_path / "ck")
    assert out is target and out["pair"][1] == 7 and out["n"] == 3
    assert torch.equal(out["pair"][0], torch.ones(2))


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_resume_into_fresh_optimizer_is_bit_exact(tmp_path):
    model, opt, sched = make_training()
    train(model, opt, sched, 3, seed=1)
    zs.save({"model": model, "optim": opt, "sched": sched, "step": 3}, tmp_path / "ck")
    expected = train(model, opt, sched, 3, seed=2)

    model2, opt2, sched2 = make_training(seed=99)
    assert not opt2.state
    out = zs.load({"model": model2, "optim": opt2, "sched": sched2, "step": 0}, tmp_path / "ck")
    assert out["step"] == 3 and sched2.last_epoch == 3
    assert train(model2, opt2, sched2, 3, seed=2) == expected
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_dtype_conversion_and_strict_dtype(tmp_path):
    src = torch.randn(4, 4)
    zs.save({"w": src}, tmp_path / "ck")
    half = {"w": torch.zeros(4, 4, dtype=torch.float16)}
    zs.load(half, tmp_path / "ck")
    assert torch.equal(half["w"], src.half())
    with pytest.raises(zs.StateMismatchError, match="w.*dtype float32"):
        zs.load({"w": torch.zeros(4, 4, dtype=torch.float16)}, tmp_path / "ck", strict_dtype=True)


def test_strict_mismatch_names_keys_and_touches_nothing(tmp_path):
    zs.save({"a": torch.ones(3), "b": torch.ones(2, 2), "extra": torch.ones(1)}, tmp_path / "ck")
    target = {"a": torch.zeros(3), "b": torch.zeros(3, 3), "missing": torch.zeros(1)}
    with pytest.raises(zs.StateMismatchError) as err:
        zs.load(target, tmp_path / "ck")
    message = str(err.value)
    assert "missing" in message and "extra" in message and "b (shape [2, 2]" in message
    assert torch.equal(target["a"], torch.zeros(3))  # validated before any byte moved

    out, mismatch = zs.load(target, tmp_path / "ck", strict=False)
    assert out is target and torch.equal(target["a"], torch.ones(3))
    assert mismatch.missing == ["missing"] and mismatch.unexpected == ["extra"]
    assert len(mismatch.mismatched) == 1 and mismatch.mismatched[0].startswith("b ")


class Wrapper(torch.nn.Module):
    """Names parameters like DDP (``module.``) or torch.compile (``_orig_mod.``) do."""

    def __init__(self, inner: torch.nn.Module, attr: str) -> None:
        super().__init__()
        setattr(self, attr, inner)


@pytest.mark.parametrize("attr", ["module", "_orig_mod"])
def test_prefix_filter_and_strip(tmp_path, attr):
    model, opt, _ = make_training()
    train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1), 1, seed=0)
    zs.save({"model": Wrapper(model, attr), "optim": opt}, tmp_path / "ck")

    plain, _, _ = make_training(seed=5)
    zs.load(plain, tmp_path / "ck", prefix="model", strip=("module", "_orig_mod"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))

    partial, _, _ = make_training(seed=6)
    first_layer = {"0.weight": partial[0].weight.detach()}
    zs.load(first_layer, tmp_path / "ck", prefix="model", strip=(attr,), keys=["0.weight"])
    assert torch.equal(partial[0].weight, model[0].weight)
    assert not torch.equal(partial[2].weight, model[2].weight)


def test_meta_targets_need_materialize(tmp_path):
    model, _, _ = make_training()
    zs.save(model, tmp_path / "ck")
    with torch.device("meta"):
        lazy = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with pytest.raises(zs.StateMismatchError, match="meta device.*0.weight"):
        zs.load(lazy, tmp_path / "ck")
    zs.load(lazy, tmp_path / "ck", materialize=True)
    assert lazy[0].weight.device.type == "cpu" and torch.equal(lazy[0].weight, model[0].weight)


def test_tied_meta_targets_materialize_as_one_tensor(tmp_path):
    """Weights tied in the model built on the meta device stay tied (each used to get a tensor of its own)."""
    def tied() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        return model

    saved = tied()
    zs.save({"model": saved}, tmp_path / "ck")
    with torch.device("meta"):
        lazy = tied()
    zs.load({"model": lazy}, tmp_path / "ck", materialize=True)
    assert lazy[0].weight.data_ptr() == lazy[1].weight.data_ptr() and torch.equal(lazy[0].weight, saved[0].weight)


def test_a_load_bumps_the_version_of_what_it_fills_as_load_state_dict_does(tmp_path):
    """Tensors filled in place (read straight into their memory, or broadcast) count as changed in
    place: autograd refuses a backward through the old values, and an asynchronous save in flight
    fails instead of committing a mixture."""
    zs.save({"w": torch.full((1000,), 2.0)}, tmp_path / "ck")
    w = torch.ones(1000, requires_grad=True)
    loss = (w * w).sum()  # saves w for the backward
    with torch.no_grad():
        zs.load({"w": w}, tmp_path / "ck")
    assert torch.equal(w, torch.full((1000,), 2.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    into = torch.zeros(1000)
    before = into._version
    with zs.open(tmp_path / "ck") as ck:
        ck.read_many(["w"], into=[into])
    assert into._version > before and torch.equal(into, torch.full((1000,), 2.0))


def test_an_optimizer_of_other_parameter_groups_is_refused_before_anything_is_loaded(tmp_path):
    """Optimizer.load_state_dict refuses other groups, but only once every tensor was filled: the
    model and the optimizer's state used to be overwritten, then a bare ValueError raised. A
    refused load also leaves a fresh optimizer fresh (it was stepped to make its state)."""
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}])
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    zs.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh = torch.nn.Linear(4, 4)
    before = fresh.weight.detach().clone()
    one_group = torch.optim.Adam(fresh.parameters())
    with pytest.raises(zs.StateMismatchError, match=r"optim.param_groups \(the checkpoint's groups hold \[1, 1\]"):
        zs.load({"model": fresh, "optim": one_group}, tmp_path / "ck")
    assert torch.equal(fresh.weight, before) and not one_group.state
    with pytest.raises(zs.StateMismatchError, match="optim: its load_state_dict refused"):  # loads what matches
        zs.load({"model": fresh, "optim": one_group}, tmp_path / "ck", strict=False)


def test_unsupported_tensors_are_refused_with_their_key(tmp_path):
    with pytest.raises(zs.UnsupportedValueError, match="weights.sparse"):
        zs.save({"weights": {"sparse": torch.eye(3).to_sparse()}}, tmp_path / "a")
    with pytest.raises(zs.UnsupportedValueError, match="m.*meta"):
        zs.save({"m": torch.empty(2, device="meta")}, tmp_path / "b")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_metadata_step_and_entries(tmp_path):
    zs.save({"w": torch.ones(3)}, tmp_path / "ck", step=42, metadata={"loss": 0.5, "tags": ("a", "b")})
    with zs.open(tmp_path / "ck") as ck:
        assert ck.step == 42 and ck.metadata == {"loss": 0.5, "tags": ("a", "b")}
        entry = ck.entries["w"]
        assert entry.kind == "tensor" and entry.shape == (3,) and entry.nbytes == 12
        assert entry.chunks[0].offsets == (0,) and entry.chunks[0].sizes == (3,)


def test_resave_replaces_generation_and_cleans_old_files(tmp_path):
    zs.save({"w": torch.ones(3)}, tmp_path / "ck")
    first = set(os.listdir(tmp_path / "ck"))
    zs.save({"w": torch.full((3,), 2.0)}, tmp_path / "ck", overwrite=True)
    second = set(os.listdir(tmp_path / "ck"))
    assert first & second == {"manifest.json"}
    target = {"w": torch.zeros(3)}
    zs.load(target, tmp_path / "ck")
    assert torch.equal(target["w"], torch.full((3,), 2.0))


def test_many_blocks_and_threads(tmp_path):
    state = {f"t{i}": torch.randn(1000 + i) for i in range(50)}
    state["big"] = torch.randn(3, 100_000)
    zs.save(state, tmp_path / "ck", block_size=4096, threads=3)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    zs.load(target, tmp_path / "ck", threads=3)
    assert all(torch.equal(target[k], state[k]) for k in state)
    zs.verify(tmp_path / "ck")


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("target_kind", ["float64", "transposed"])
def test_staged_loads_copy_each_read_as_it_arrives(tmp_path, verify, target_kind):
    """Loads that cannot read straight into the target (dtype conversion, non-contiguous targets)
    copy every staged read of 4 KiB (blocks of 4 KiB, a staging bound of 8 KiB on 2 threads) as
    it arrives: reads start and end in the middle of rows at every level of these shapes."""
    state = {"a": torch.randn(37, 53, 3), "b": torch.randn(1000), "c": torch.randn(5, 7), "d": torch.tensor(2.5)}
    zs.save(state, tmp_path / "ck", block_size=4096)
    if target_kind == "float64":
        target = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}
    else:
        target = {k: torch.zeros(tuple(reversed(v.shape))).permute(tuple(reversed(range(v.dim()))))
                  for k, v in state.items()}
        assert not target["a"].is_contiguous()
    zs.load(target, tmp_path / "ck", verify=verify, threads=2, max_staging_bytes=8192)
    assert all(torch.equal(target[k], state[k].to(target[k].dtype)) for k in state)


def test_read_is_memory_mapped_and_state_round_trips(tmp_path):
    state = {"w": torch.randn(64, 64), "n": {"k": [1, 2]}}
    zs.save(state, tmp_path / "ck")
    with zs.open(tmp_path / "ck") as ck:
        w = ck.read("w")
        assert torch.equal(w, state["w"])
        assert ck.entries["n"].kind == "object" and ck.read("n") == {"k": [1, 2]}
    assert torch.equal(w * 1, state["w"])  # still valid after close


def test_colliding_dotted_names_stay_distinct(tmp_path):
    inner = torch.ones(3)
    state = {"a.b": torch.zeros(3), "a": {"b": inner}, "c": inner}
    zs.save(state, tmp_path / "ck")
    target = {"a.b": torch.full((3,), 5.0), "a": {"b": torch.full((3,), 5.0)}, "c": torch.full((3,), 5.0)}
    zs.load(target, tmp_path / "ck")
    assert torch.equal(target["a.b"], torch.zeros(3))
    assert torch.equal(target["a"]["b"], inner) and torch.equal(target["c"], inner)
    with zs.open(tmp_path / "ck") as ck:
        assert torch.equal(ck.read(("c",)), inner) and torch.equal(ck.read(("a", "b")), inner)
        assert torch.equal(ck.read(("a.b",)), torch.zeros(3))


@pytest.mark.parametrize("text", [
    "[18446744073709551615]", "[18446744073709551616]", "[-9223372036854775808]", "[-9223372036854775809]",
    '{"k\\ud800": "\\udfff", "n": 123456789012345678901234567890}', '[0.1, 1e-300, 1.7976931348623157e308, -0.0]',
    '{"a": 1, "a": 2}'])
def test_manifest_json_parses_exactly_like_the_standard_library(text):
    data = text.encode()
    parsed = load_json(data)
    assert parsed == json.loads(data) and repr(parsed) == repr(json.loads(data))


def cyclic_garbage(action) -> list[str]:
    """What ``action`` leaves behind that only the cyclic collector could free (type names)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        action()
        gc.collect()
        return sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_save_load_and_read_leave_no_reference_cycles(tmp_path):
    # Per-leaf objects caught in a cycle live on until a cyclic collection walks them all (~200 ms
    # for 20,000 leaves), and an open checkpoint caught in one keeps its files mapped.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    state = {"model": model, "t": (torch.ones(2), [torch.zeros(3), 5]), "tied": {"a": model[0].weight}, "step": 4}
    path = tmp_path / "ck"
    assert cyclic_garbage(lambda: zs.save(state, path, step=1, overwrite=True)) == []
    assert cyclic_garbage(lambda: zs.async_save(state, path, step=2, overwrite=True).result()) == []
    assert cyclic_garbage(lambda: zs.load(state, path)) == []

    def read_all() -> None:
        with zs.open(path) as ck:
            ck.state()
            ck.read("t.0")

    assert cyclic_garbage(read_all) == []
    assert cyclic_garbage(lambda: zs.verify(path)) == []


def test_a_closed_async_checkpoint_manager_leaves_no_reference_cycles(tmp_path):
    # The commit callback on each save's future held the manager, and the manager's saver holds
    # the last handle: manager, saver, buffer pool and threads lived until a cyclic collection.
    state = {"w": torch.ones(4), "step": 1}

    def run() -> None:
        manager = zs.CheckpointManager(tmp_path / "run", async_save=True, keep_last=2)
        for step in (1, 2, 3):
            manager.save(step, state)
        manager.close()
        assert [record.step for _, record in manager.checkpoints()] == [2, 3]

    assert cyclic_garbage(run) == []


def test_a_plain_data_loader_is_refused_at_the_first_save_saying_what_works(tmp_path):
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=2)
    with pytest.raises(zs.UnsupportedValueError, match=r"^dataloader: a torch DataLoader has no state_dict\(\).*"
                                                        r"StatefulDataLoader"):
        zs.save({"w": torch.ones(2), "dataloader": loader}, tmp_path / "ck", allow_pickle=True)
    assert not (tmp_path / "ck").exists()


def test_a_directory_of_foreign_files_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "run").mkdir()
    with pytest.raises(zs.CheckpointError, match=r"holds files that are not part of a zerostall checkpoint "
                                                  r"\(config.json, run\); nothing was written"):
        zs.save({"w": torch.ones(2)}, tmp_path, overwrite=True)  # overwrite is about checkpoints only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "run"]
    zs.save({"w": torch.ones(2)}, tmp_path / "ck")
    zs.save({"w": torch.full((2,), 2.0)}, tmp_path / "ck", overwrite=True)  # an existing checkpoint: replaced
    assert torch.equal(zs.load({"w": torch.zeros(2)}, tmp_path / "ck")["w"], torch.full((2,), 2.0))


def test_saving_over_a_checkpoint_needs_overwrite_and_keeps_it_otherwise(tmp_path):
    path = tmp_path / "ck"
    zs.save({"w": torch.ones(3)}, path, step=1)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(zs.CheckpointExistsError, match=r"ck already holds a committed checkpoint; nothing was "
                                                       r"written: save with overwrite=True"):
        zs.save({"w": torch.full((3,), 2.0)}, path, step=2)
    with pytest.raises(zs.CheckpointExistsError):
        zs.async_save({"w": torch.full((3,), 2.0)}, path, step=2)  # refused at the call, before any capture
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    zs.save({"w": torch.full((3,), 2.0)}, path, step=2, overwrite=True)
    with zs.open(path) as ck:
        assert ck.step == 2 and torch.equal(ck.read("w"), torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="overwrite must be True or False"):
        zs.SaveOptions(overwrite="yes")


def test_every_data_file_stays_valid_safetensors_whatever_the_keys(tmp_path):
    """Tensor names in data files are the keys, except where safetensors cannot hold them: its
    reserved ``__metadata__`` and strings that are not UTF-8 (lone surrogates)."""
    from safetensors.torch import load_file

    state = {"__metadata__": torch.ones(2), "x\udc80y": torch.full((3,), 2.0), "b": torch.zeros(4)}
    zs.save(state, tmp_path / "ck", threads=1)
    [data] = [p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors"]
    tensors = load_file(str(data))
    assert sorted(tensors) == ["__metadata__#", "b", "x\\udc80y"]
    assert torch.equal(tensors["__metadata__#"], state["__metadata__"])
    out = zs.load({k: torch.empty_like(v) for k, v in state.items()}, tmp_path / "ck")
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize("value, message", [
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensors are not supported"),
    (lambda: torch.nn.LazyLinear(3), "uninitialized lazy parameter"),
])
def test_tensors_without_a_plain_shape_are_refused_with_a_typed_error(tmp_path, value, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API, and say so
        made = value()
    with pytest.raises(zs.UnsupportedValueError, match=message):
        zs.save({"x": made}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
