"""Tensor subclasses: wrapper subclasses (``__tensor_flatten__``) are stored as their inner tensors
plus a safely encoded description, single-process and as DTensor local shards over real gloo
process groups; other subclasses and unencodable flatten contexts are refused with a clear error."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_map

import zerostall as zs
from distributed import RankError
from hostile import read_body as manifest_body
from zerostall.format import codec
from zerostall.format import layout as fmt
from zerostall.cli import cli

aten = torch.ops.aten

# -- subclasses ------------------------------------------------------------------------------------

CONTEXT = {"dtype": torch.float32, "block": (2, 3), "recipe": "tensorwise", "history": [1.5, float("inf")],
           "flags": {1: True}, "size": torch.Size([4, 6])}  # tuple vs list, inf, non-string keys, dtype, Size


class ScaledTensor(torch.Tensor):
    """``qdata * scale``: int8 data of the outer shape and a per-tensor float32 scale (a 0-d inner
    tensor, which does not follow a shard's box), with a flatten context of plain values."""

    @staticmethod
    def __new__(cls, qdata, scale, meta, outer_size=None, outer_stride=None):
        size = qdata.shape if outer_size is None else outer_size
        stride = qdata.stride() if outer_stride is None else outer_stride
        return torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=meta["dtype"], device=qdata.device)

    def __init__(self, qdata, scale, meta, outer_size=None, outer_stride=None):
        self.qdata, self.scale, self.meta = qdata, scale, meta

    def __repr__(self):
        return f"ScaledTensor({self.qdata}, scale={self.scale})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], self.meta

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ScaledTensor(inner["qdata"], inner["scale"], meta, outer_size, outer_stride)

    def dequantize(self):
        return self.qdata.to(self.meta["dtype"]) * self.scale

    @classmethod
    def quantize(cls, x, meta=CONTEXT):
        scale = (x.abs().max() / 127).clamp(min=1e-12).to(torch.float32)
        return cls((x / scale).round().clamp(-127, 127).to(torch.int8), scale, meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.view.default):
            t = args[0]
            return ScaledTensor(func(t.qdata, *args[1:], **kwargs), t.scale, t.meta)
        if func is aten.copy_.default and isinstance(args[0], ScaledTensor):
            dst, src = args[0], args[1]
            if not isinstance(src, ScaledTensor):
                src = ScaledTensor.quantize(src, dst.meta)
            dst.qdata.copy_(src.qdata)
            dst.scale.copy_(src.scale)
            return dst
        def unwrap(x):
            return x.dequantize() if isinstance(x, ScaledTensor) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


@dataclasses.dataclass
class Recipe:
    scaling: str


class OpaqueContextTensor(TwoTensor):
    """A wrapper subclass whose flatten context is an arbitrary object: only pickle could store it."""

    def __tensor_flatten__(self):
        return ["a", "b"], Recipe("dynamic")


class Tagged(torch.Tensor):
    """A plain (non-wrapper) subclass without __tensor_flatten__."""


def two(shape=(4, 6), seed=0, dtype=torch.float32) -> TwoTensor:
    g = torch.Generator().manual_seed(seed)
    return TwoTensor(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def zeros_two(shape=(4, 6), dtype=torch.float32) -> TwoTensor:
    return TwoTensor(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-exact equality of two plain tensors (dtype, shape and bytes)."""
    return (x.dtype == y.dtype and x.shape == y.shape
            and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))


def same_inner(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same class, same flatten context and bit-exact inner tensors."""
    if type(x) is not type(y):
        return False
    if not hasattr(x, "__tensor_flatten__") or type(x) is torch.Tensor:
        return same(x, y)
    (attrs, ctx), (attrs_y, ctx_y) = x.__tensor_flatten__(), y.__tensor_flatten__()
    return attrs == attrs_y and ctx == ctx_y and all(same_inner(getattr(x, a), getattr(y, a)) for a in attrs)


# -- single process -----------------------------------------------------------------------------------


def test_two_tensor_and_scaled_tensor_round_trip_bit_exactly_and_verify(tmp_path):
    tied = two(seed=1)
    state = {"model": {"w": two(seed=0), "bf16": two((3, 5), seed=2, dtype=torch.bfloat16),
                       "param": torch.nn.Parameter(two((2, 2), seed=3)), "tied": tied, "tied2": tied,
                       "nested": TwoTensor(two((5,), seed=4), two((5,), seed=5)),
                       "scaled": ScaledTensor.quantize(torch.randn(4, 6))},
             "plain": torch.arange(6.0), "step": 3}
    zs.save(state, tmp_path / "ck", step=3)
    assert zs.verify(tmp_path / "ck") > 0
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "ck")])
    assert result.exit_code == 0 and result.stdout.startswith("OK"), result.output

    target = {"model": {"w": zeros_two(), "bf16": zeros_two((3, 5), torch.bfloat16),
                        "param": torch.nn.Parameter(zeros_two((2, 2))), "tied": zeros_two(), "tied2": None,
                        "nested": TwoTensor(zeros_two((5,)), zeros_two((5,))),
                        "scaled": ScaledTensor(torch.zeros(4, 6, dtype=torch.int8), torch.zeros(()), CONTEXT)},
              "plain": torch.zeros(6), "step": 0}
    target["model"]["tied2"] = target["model"]["tied"]
    kept = dict(target["model"])
    out = zs.load(target, tmp_path / "ck")
    for key, value in state["model"].items():
        assert out["model"][key] is kept[key]  # filled in place
        assert same_inner(out["model"][key], value), key
    assert out["model"]["param"].requires_grad and same(out["plain"], state["plain"]) and out["step"] == 3


def test_the_manifest_holds_inner_tensors_as_entries(tmp_path):
    zs.save({"w": two(), "s": ScaledTensor.quantize(torch.randn(4, 6)), "p": torch.ones(2)}, tmp_path / "ck")
    body = manifest_body(tmp_path / "ck")
    assert body["version"] == fmt.FORMAT_VERSION >= fmt.SUBCLASS_VERSION
    entries = {e["fqn"]: e for e in body["entries"]}
    w, s = entries["w"], entries["s"]
    assert w["kind"] == s["kind"] == "subclass" and w["class"] == "torch.testing._internal.two_tensor:TwoTensor"
    assert s["class"] == f"{__name__}:ScaledTensor" and (s["dtype"], s["shape"]) == ("float32", [4, 6])
    (shard,) = s["shards"]
    assert shard["offsets"] == [0, 0] and shard["sizes"] == [4, 6] and shard["stride"] == [6, 1]
    assert codec.decode(shard["context"]) == CONTEXT and "$pickle" not in json.dumps(body)
    qdata, scale = (body["entries"][shard["inner"][k]["entry"]] for k in ("qdata", "scale"))
    assert (qdata["fqn"], qdata["kind"], qdata["dtype"], qdata["shape"]) == ("s.qdata", "tensor", "int8", [4, 6])
    assert (scale["fqn"], scale["dtype"], scale["shape"]) == ("s.scale", "float32", [])
    assert qdata["inner_of"] == scale["inner_of"] == body["entries"].index(s)
    assert shard["inner"]["qdata"]["box"] is True and shard["inner"]["scale"]["box"] is False

    # an older reader (one that knows version 1) refuses the checkpoint instead of misreading it
    old = fmt.FORMAT_VERSION
    fmt.FORMAT_VERSION = 1
    try:
        with pytest.raises(zs.CorruptCheckpointError, match="format version 4; this zerostall reads <= 1"):
            zs.open(tmp_path / "ck")
    finally:
        fmt.FORMAT_VERSION = old


def test_reading_without_a_target_never_imports_the_class(tmp_path):
    state = {"w": two(), "s": ScaledTensor.quantize(torch.randn(4, 6)),
             "n": TwoTensor(two((3,), seed=1), two((3,), seed=2))}
    zs.save(state, tmp_path / "ck")
    with zs.open(tmp_path / "ck") as ck:
        flat = ck.read("s")
        assert isinstance(flat, zs.FlattenedTensor) and flat.cls.endswith(":ScaledTensor")
        assert flat.context == CONTEXT and type(flat.context["block"]) is tuple and flat.dtype == torch.float32
        assert flat.shape == flat.sizes == (4, 6) and flat.offsets == (0, 0) and flat.stride == (6, 1)
        assert same(flat.inner["qdata"], state["s"].qdata) and same(flat.inner["scale"], state["s"].scale)
        assert same_inner(flat.unflatten(ScaledTensor), state["s"])
        with pytest.raises(zs.UnsupportedValueError, match="needs that class"):
            flat.unflatten(TwoTensor)
        nested = ck.read("n")
        assert isinstance(nested.inner["a"], zs.FlattenedTensor) and same_inner(nested.unflatten(TwoTensor), state["n"])
        assert same(ck.read("w.a"), state["w"].a)  # inner tensors are entries of their own
        whole = ck.state()
        assert set(whole) == {"w", "s", "n"} and isinstance(whole["w"], zs.FlattenedTensor)
    with zs.open(tmp_path / "ck", tensor_subclasses=[TwoTensor, ScaledTensor]) as ck:
        whole = ck.state()
        assert all(same_inner(whole[k], v) for k, v in state.items())
    out = zs.load({}, tmp_path / "ck", tensor_subclasses=(ScaledTensor,))  # an empty container: read whole
    assert isinstance(out["w"], zs.FlattenedTensor) and same_inner(out["s"], state["s"])
    zs.save({**state, "p": torch.ones(2)}, tmp_path / "ck", overwrite=True)
    out = zs.load({"w": None, "s": None, "n": 0, "p": torch.zeros(2)}, tmp_path / "ck", tensor_subclasses=[TwoTensor])
    assert same_inner(out["w"], state["w"]) and isinstance(out["s"], zs.FlattenedTensor) and out["p"].all()


def test_plain_and_subclass_sides_copy_values_as_load_state_dict_does(tmp_path):
    scaled = ScaledTensor.quantize(torch.randn(4, 6))
    zs.save({"w": two(), "s": scaled}, tmp_path / "sub")
    plain_target = {"w": torch.zeros(4, 6), "s": torch.zeros(4, 6)}
    with pytest.raises(zs.StateMismatchError, match=r"w \(the checkpoint holds a torch.testing._internal.two_tensor"
                                                     r":TwoTensor tensor subclass, the target a plain tensor"):
        zs.load(plain_target, tmp_path / "sub")
    assert not plain_target["w"].any() and not plain_target["s"].any()  # refused before anything moved
    out = zs.load(plain_target, tmp_path / "sub", tensor_subclasses=[TwoTensor, ScaledTensor])
    assert same(out["w"], two().b)  # TwoTensor's own copy_ into a plain tensor: what load_state_dict does
    assert same(out["s"], scaled.dequantize())

    values = torch.randn(4, 6)
    zs.save({"w": values, "s": values}, tmp_path / "plain")
    target = {"w": zeros_two(), "s": ScaledTensor(torch.zeros(4, 6, dtype=torch.int8), torch.zeros(()), CONTEXT)}
    out = zs.load(target, tmp_path / "plain")
    assert same(out["w"].a, values) and same(out["w"].b, values)  # the subclass's copy_ from a plain tensor
    assert same_inner(out["s"], ScaledTensor.quantize(values))


def test_mismatches_are_named(tmp_path):
    zs.save({"w": two(), "s": ScaledTensor.quantize(torch.randn(4, 6))}, tmp_path / "ck")
    other = dict(CONTEXT, recipe="rowwise")
    target = {"w": ScaledTensor(torch.zeros(4, 6, dtype=torch.int8), torch.zeros(()), CONTEXT),
              "s": ScaledTensor(torch.zeros(4, 6, dtype=torch.int8), torch.zeros(()), other)}
    with pytest.raises(zs.StateMismatchError) as exc:
        zs.load(target, tmp_path / "ck")
    message = str(exc.value)
    assert "w (the checkpoint holds a torch.testing._internal.two_tensor:TwoTensor tensor subclass, the target a " \
           f"{__name__}:ScaledTensor)" in message
    assert "s (the flatten context of" in message and "'rowwise'" in message and "'tensorwise'" in message
    _, mismatch = zs.load(target, tmp_path / "ck", strict=False)
    assert [m.split(" ")[0] for m in mismatch.mismatched] == ["w", "s"] and not target["s"].qdata.any()
    with pytest.raises(zs.StateMismatchError, match=r"w \(shape \[4, 6\] in the checkpoint, \[2, 2\]"):
        zs.load({"w": zeros_two((2, 2))}, tmp_path / "ck", keys=["w"])
    wide = {"s": ScaledTensor(torch.zeros(4, 6, dtype=torch.int16), torch.zeros(()), CONTEXT)}
    with pytest.raises(zs.StateMismatchError, match=r"s \(inner tensor qdata has dtype int8 in the checkpoint, int16"):
        zs.load(wide, tmp_path / "ck", keys=["s"], strict_dtype=True)
    assert wide["s"].qdata.abs().max() == 0
    zs.load(wide, tmp_path / "ck", keys=["s"])  # values convert, as load_state_dict's copy_ does
    assert wide["s"].qdata.abs().max() == 127


def test_unencodable_contexts_and_plain_subclasses_are_refused_by_name(tmp_path):
    opaque = OpaqueContextTensor(torch.ones(2), torch.ones(2))
    with pytest.raises(zs.UnsupportedValueError) as exc:
        zs.save({"model": {"w": opaque}}, tmp_path / "ck", allow_pickle=True)  # no pickle for contexts, even so
    message = str(exc.value)
    assert message.startswith("model.w: tensor subclass") and "OpaqueContextTensor" in message
    assert f"a {__name__}.Recipe" in message and "without pickle" in message
    with pytest.raises(zs.UnsupportedValueError, match=r"x: tensor subclass test_subclass.Tagged is not supported.*"
                                                       r"__tensor_flatten__.*as_subclass\(torch.Tensor\)"):
        zs.save({"x": torch.ones(3).as_subclass(Tagged)}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()  # refused before anything was written


def test_async_saves_round_trip_and_a_change_through_the_subclass_is_caught(tmp_path):
    state = {"w": two(), "s": ScaledTensor.quantize(torch.randn(4, 6)), "step": 1}
    zs.async_save(state, tmp_path / "a").result()
    with zs.AsyncSaver(writer="process") as saver:
        saver.save(state, tmp_path / "b").result()
    for name in ("a", "b"):
        zs.verify(tmp_path / name)
        target = {"w": zeros_two(), "s": ScaledTensor(torch.zeros(4, 6, dtype=torch.int8), torch.zeros(()), CONTEXT),
                  "step": 0}
        out = zs.load(target, tmp_path / name)
        assert same_inner(out["w"], state["w"]) and same_inner(out["s"], state["s"])

    saver = zs.AsyncSaver()
    release = threading.Event()
    saver._worker.submit(release.wait, 60)  # the capture cannot start before the change below
    handle = saver.save(state, tmp_path / "torn")
    state["w"].add_(1)  # through the subclass: its inner tensors' version counters do not move
    release.set()
    with pytest.raises(zs.StateChangedError, match="w.a was changed in place"):
        handle.result()
    saver.close()
    assert not (tmp_path / "torn" / fmt.MANIFEST_NAME).exists()


def test_verify_and_load_catch_a_damaged_inner_tensor(tmp_path):
    zs.save({"s": ScaledTensor.quantize(torch.randn(64, 64))}, tmp_path / "ck")
    with zs.open(tmp_path / "ck") as ck:
        chunk = ck.entries["s.qdata"].chunks[0]
    data = bytearray((tmp_path / "ck" / chunk.file).read_bytes())
    data[chunk.offset + 5] ^= 0xFF
    (tmp_path / "ck" / chunk.file).write_bytes(bytes(data))
    with pytest.raises(zs.CorruptCheckpointError, match="s.qdata"):
        zs.verify(tmp_path / "ck")
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "ck")])
    assert result.exit_code == 1 and "s.qdata" in result.stderr
    target = {"s": ScaledTensor(torch.zeros(64, 64, dtype=torch.int8), torch.zeros(()), CONTEXT)}
    with pytest.raises(zs.CorruptCheckpointError, match="s.qdata"):
        zs.load(target, tmp_path / "ck")


def test_inspect_shows_the_class_and_the_parts(tmp_path):
    zs.save({"w": two()}, tmp_path / "ck")
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ck"), "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["fqn"]: row for row in json.loads(result.stdout)["entries"]}
    assert rows["w"]["kind"] == "subclass" and rows["w"]["value"].endswith(":TwoTensor") and rows["w"]["chunks"] == 1
    assert rows["w.a"]["inner_of"] == rows["w.b"]["inner_of"] == "w"


# -- DTensors whose local tensors are subclasses, over real gloo process groups -----------------------


def full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def local_part(value: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's box of ``value`` for a 1-D mesh."""
    placement = placements[0]
    if isinstance(placement, Replicate):
        return value.clone()
    return value.chunk(mesh.size(), dim=placement.dim)[dist.get_rank()].contiguous()


def two_dtensor(shape, placements, seed=None) -> DTensor:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if seed is None:
        a, b = torch.zeros(shape), torch.zeros(shape)
    else:
        a, b = full(shape, seed), full(shape, seed + 1)
    local = TwoTensor(local_part(a, mesh, placements), local_part(b, mesh, placements))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


def scaled_dtensor(shape, placements, seed=None) -> DTensor:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    part = local_part(full(shape, seed) if seed is not None else torch.zeros(shape), mesh, placements)
    local = ScaledTensor.quantize(part) if seed is not None else \
        ScaledTensor(torch.zeros(part.shape, dtype=torch.int8), torch.zeros(()), CONTEXT)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


def save_subclass_dtensors(path: str, asynchronous: bool) -> bool:
    """Save twice (the second save reuses the cached plan); returns whether it did."""
    for seed in (11, 1):
        state = {"w": two_dtensor((8, 6), [Shard(0)], seed=seed),
                 "r": two_dtensor((3, 4), [Replicate()], seed=seed + 2),
                 "s": scaled_dtensor((8, 6), [Shard(0)], seed=seed + 4), "step": 7}
        info = zs.async_save(state, path, overwrite=True).result() if asynchronous else \
            zs.save(state, path, overwrite=True)
    return not info.replanned


def load_two_dtensors(path: str, placements, broadcast: bool = False) -> dict:
    target = {"w": two_dtensor((8, 6), placements), "r": two_dtensor((3, 4), placements)}
    out = zs.load(target, path, keys=["w", "r"], broadcast=broadcast)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    checks = {}
    for key, shape, seed in (("w", (8, 6), 1), ("r", (3, 4), 3)):
        local = out[key].to_local()
        checks[key] = (type(local) is TwoTensor and same(local.a, local_part(full(shape, seed), mesh, placements))
                       and same(local.b, local_part(full(shape, seed + 1), mesh, placements)))
    return checks


def load_scaled_dtensor(path: str, placements) -> str:
    target = {"s": scaled_dtensor((8, 6), placements)}
    try:
        out = zs.load(target, path, keys=["s"])
    except zs.StateMismatchError as exc:
        return f"StateMismatchError: {exc}"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    expected = ScaledTensor.quantize(local_part(full((8, 6), 5), mesh, placements))
    return "same" if same_inner(out["s"].to_local(), expected) else "different"


def test_dtensors_of_subclasses_save_per_box_and_reshard_what_follows_the_box(ranks, tmp_path):
    path = str(tmp_path / "ck")
    assert ranks(2).run(save_subclass_dtensors, path, False) == [True, True]
    zs.verify(path)
    body = manifest_body(tmp_path / "ck")
    entries = {e["fqn"]: e for e in body["entries"]}
    assert [s["offsets"] for s in entries["w"]["shards"]] == [[0, 0], [4, 0]] and len(entries["r"]["shards"]) == 1
    assert [c["offsets"] for c in entries["w.a"]["chunks"]] == [[0, 0], [4, 0]]  # one tensor, a chunk per box
    assert {"s.scale@0,0", "s.scale@4,0"} <= set(entries)  # per-box inner tensors, stored whole
    assert all(len(entries[k]["chunks"]) == 1 for k in ("r.a", "r.b"))  # the replicated box is written once

    # the same sharding, another sharding (TwoTensor's inner tensors follow the box), one process
    assert ranks(2).run(load_two_dtensors, path, [Shard(0)]) == [{"w": True, "r": True}] * 2
    assert ranks(2).run(load_two_dtensors, path, [Shard(1)]) == [{"w": True, "r": True}] * 2
    assert ranks(2).run(load_two_dtensors, path, [Replicate()], True) == [{"w": True, "r": True}] * 2
    single = zs.load({"w": zeros_two((8, 6)), "r": zeros_two((3, 4))}, path, keys=["w", "r"])
    assert same(single["w"].a, full((8, 6), 1)) and same(single["w"].b, full((8, 6), 2))
    assert same(single["r"].b, full((3, 4), 4))

    # a per-tensor scale is per box: the same sharding loads, another one is refused on every rank
    assert ranks(2).run(load_scaled_dtensor, path, [Shard(0)]) == ["same", "same"]
    refused = ranks(2).run(load_scaled_dtensor, path, [Shard(1)])
    assert all(r.startswith("StateMismatchError") and "s (inner tensor scale of" in r
               and "load it with the sharding it was saved with" in r for r in refused), refused
    with zs.open(path) as ck:
        boxes = ck.read("s")  # no single tensor: one FlattenedTensor per saved box
        assert [b.offsets for b in boxes] == [(0, 0), (4, 0)] and all(b.sizes == (4, 6) for b in boxes)
        assert same(boxes[1].inner["qdata"], ScaledTensor.quantize(full((8, 6), 5)[4:]).qdata)
        joined = ck.read("w")  # inner tensors that follow the box join into one tensor
        assert joined.sizes == (8, 6) and same(joined.inner["a"], full((8, 6), 1))


def test_async_save_of_subclass_dtensors_and_a_plain_target(ranks, tmp_path):
    path = str(tmp_path / "ck")
    assert ranks(2).run(save_subclass_dtensors, path, True) == [True, True]
    zs.verify(path)
    out = zs.load({"w": torch.zeros(8, 6)}, path, keys=["w"], tensor_subclasses=[TwoTensor])
    assert same(out["w"], full((8, 6), 2))  # TwoTensor's copy_ into a plain tensor keeps b
    assert ranks(2).run(load_plain_dtensor, path, True) == [True, True]
    with pytest.raises(RankError, match="StateMismatchError.*pass that class in tensor_subclasses="):
        ranks(2).run(load_plain_dtensor, path, False)


def load_plain_dtensor(path: str, trusted: bool) -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    target = {"w": DTensor.from_local(torch.zeros(8, 3), mesh, [Shard(1)], run_check=False)}
    out = zs.load(target, path, keys=["w"], tensor_subclasses=[TwoTensor] if trusted else [])
    return same(out["w"].to_local(), local_part(full((8, 6), 2), mesh, [Shard(1)]))


def fsdp_style(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A layer whose weight is a row-sharded DTensor with a TwoTensor local shard (the layout FSDP2
    gives float8 or NF4 weights) and whose bias is a plain sharded DTensor, with AdamW."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    layer = torch.nn.Linear(6, 8)
    rows = layer.weight.detach().chunk(dist.get_world_size())[dist.get_rank()]
    layer.weight = torch.nn.Parameter(DTensor.from_local(TwoTensor(rows.clone(), rows * 2), mesh, [Shard(0)],
                                                         run_check=False))
    bias = layer.bias.detach().chunk(dist.get_world_size())[dist.get_rank()].clone()
    layer.bias = torch.nn.Parameter(DTensor.from_local(bias, mesh, [Shard(0)], run_check=False))
    return layer, torch.optim.AdamW(layer.parameters(), lr=0.1)


def resume_fsdp_style(path: str) -> list[bool]:
    rank = dist.get_rank()
    model, optim = fsdp_style(0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    own = TwoTensor(torch.full((2,), float(rank)), torch.full((2,), rank + 0.5))
    zs.async_save({"model": model, "optim": optim, "own": zs.rank_local(own)}, path).result()
    fresh, fresh_optim = fsdp_style(1)  # other values, no optimizer state yet
    out = zs.load({"model": fresh, "optim": fresh_optim, "own": zs.rank_local(zeros_two((2,)))}, path)
    saved, loaded = optim.state[model.weight], fresh_optim.state[fresh.weight]
    return [same_inner(fresh.weight.to_local(), model.weight.to_local()),
            same(fresh.bias.to_local(), model.bias.to_local()),
            type(loaded["exp_avg"].to_local()) is TwoTensor,
            all(same_inner(loaded[k].to_local(), saved[k].to_local()) for k in ("exp_avg", "exp_avg_sq")),
            same_inner(out["own"].value, own)]


def test_an_fsdp_style_model_and_optimizer_with_subclass_shards_resume_exactly(ranks, tmp_path):
    path = str(tmp_path / "ck")
    assert ranks(2).run(resume_fsdp_style, path) == [[True] * 5] * 2
    result = CliRunner().invoke(cli, ["verify", path])
    assert result.exit_code == 0, result.output
    with zs.open(path) as ck:
        own = [e for e in ck.manifest.entries if e.path == ("own",)]
        assert [(e.kind, e.rank) for e in own] == [("subclass", 0), ("subclass", 1)]  # rank-local, one per rank


def change_a_dtensor_during_capture(path: str, subclass_local: bool) -> str:
    """Change a DTensor in place after an asynchronous save was requested, before its capture: the
    local tensor's own version counter does not move (the change goes through the DTensor)."""
    if subclass_local:
        value = two_dtensor((8, 6), [Shard(0)], seed=1)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        value = DTensor.from_local(torch.ones(4, 6), mesh, [Shard(0)], run_check=False)
    saver = zs.AsyncSaver()
    release = threading.Event()
    saver._worker.submit(release.wait, 60)
    handle = saver.save({"w": value}, path, commit_timeout=30)
    value.mul_(2)
    release.set()
    try:
        handle.result()
    except zs.CheckpointError as exc:
        return type(exc).__name__
    finally:
        saver.close()
    return "committed"


@pytest.mark.parametrize("subclass_local", [True, False], ids=["subclass-local", "plain-local"])
def test_a_dtensor_changed_before_its_capture_is_never_committed(ranks, tmp_path, subclass_local):
    outcomes = ranks(2).run(change_a_dtensor_during_capture, str(tmp_path / "ck"), subclass_local)
    assert "StateChangedError" in outcomes and "committed" not in outcomes, outcomes
    assert not (tmp_path / "ck" / fmt.MANIFEST_NAME).exists()
