"""Random states round-trip bit-exactly through save → load, whatever their nesting, views, sharing,
block size, staging budget and target layout: one property over the paths the hand-picked cases
of test_roundtrip.py cover one at a time (direct reads, staged reads, strided targets, conversion)."""

from __future__ import annotations

import math
import tempfile

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import zerostall as zs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int64,
          torch.bool, torch.complex64, torch.float8_e4m3fn]
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def raw_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaN patterns included): compared byte for byte."""
    n = math.prod(shape) * dtype.itemsize
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        data &= 1
    return data.view(dtype).reshape(shape)


@st.composite
def tensors(draw, seed=st.integers(0, 2**31 - 1)):
    """A tensor, a non-contiguous view of a larger one, or a tensor whose bytes span several blocks."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    kind = draw(st.sampled_from(["plain", "transposed", "strided", "narrowed", "large"]))
    if kind == "large":
        return raw_tensor(dtype, (draw(st.integers(1, 40_000)),), draw(seed))
    if kind == "transposed" and len(shape) >= 2:
        return raw_tensor(dtype, shape[::-1], draw(seed)).transpose(0, -1)
    if kind == "strided" and shape:
        return raw_tensor(dtype, (shape[0] * 2 + 1, *shape[1:]), draw(seed))[::2][: shape[0]]
    if kind == "narrowed" and shape:
        return raw_tensor(dtype, (shape[0] + 3, *shape[1:]), draw(seed))[2: 2 + shape[0]]
    return raw_tensor(dtype, shape, draw(seed))


python_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                          st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=8))
keys = st.text(alphabet="ab.c/_", min_size=1, max_size=4)


def states():
    leaves = st.one_of(tensors(), python_values)
    tree = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.tuples(inner, inner),
                                                         st.dictionaries(keys, inner, max_size=3)),
                        max_leaves=12)
    return st.dictionaries(keys, tree, min_size=1, max_size=4)


def tensor_leaves(node, found=None):
    found = [] if found is None else found
    if isinstance(node, torch.Tensor):
        found.append(node)
    elif isinstance(node, dict):
        for v in node.values():
            tensor_leaves(v, found)
    elif isinstance(node, (list, tuple)):
        for v in node:
            tensor_leaves(v, found)
    return found


def blank_like(node, layout: str):
    """The target for ``node``: same structure, tensors zeroed; ``layout="transposed"`` gives 2-D
    tensors a column-major target (the staged path's strided copies), python values stay as is."""
    if isinstance(node, torch.Tensor):
        flip = layout == "transposed" and node.dim() == 2
        base = torch.empty(node.shape[::-1] if flip else node.shape, dtype=node.dtype)
        base.reshape(-1).view(torch.uint8).zero_()
        return base.t() if flip else base
    if isinstance(node, dict):
        return {k: blank_like(v, layout) for k, v in node.items()}
    if isinstance(node, list):
        return [blank_like(v, layout) for v in node]
    if isinstance(node, tuple):
        return tuple(blank_like(v, layout) for v in node)
    return node


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def same(a, b) -> bool:
    """Equal structure, python values and tensor bytes (NaN patterns compare as bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(as_bytes(a), as_bytes(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(state=states(), block_size=st.sampled_from([4096, 16384, 4 << 20]),
       staging=st.sampled_from([4096, 1 << 20, 256 << 20]), layout=st.sampled_from(["same", "transposed"]),
       tie=st.booleans())
def test_random_states_round_trip_bit_exactly(state, block_size, staging, layout, tie):
    leaves = tensor_leaves(state)
    if tie and leaves:
        state["tied"] = leaves[0]  # the same tensor under two keys: stored once, loaded into both
    with tempfile.TemporaryDirectory() as root:
        path = f"{root}/ck"
        zs.save(state, path, block_size=block_size)
        target = blank_like(state, layout)
        loaded = zs.load(target, path, max_staging_bytes=staging)
        assert same(state, loaded)
        for got in tensor_leaves(target):  # tensors were filled in place, in their own layout
            assert any(got is t for t in tensor_leaves(loaded))
        with zs.open(path) as ck:
            assert same(state, ck.state())
        zs.verify(path)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=st.sampled_from(FLOATS), target=st.sampled_from(FLOATS),
       shape=st.lists(st.integers(1, 70), min_size=1, max_size=3), block_size=st.sampled_from([4096, 4 << 20]),
       staging=st.sampled_from([4096, 256 << 20]), transposed=st.booleans())
def test_dtype_conversion_on_load_matches_copy(source, target, shape, block_size, staging, transposed):
    """A load into a target of another dtype gives exactly what ``target.copy_(saved)`` gives."""
    saved = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(source)
    out = torch.zeros(shape[::-1], dtype=target).t() if transposed and len(shape) == 2 else torch.zeros(shape, dtype=target)
    with tempfile.TemporaryDirectory() as root:
        zs.save({"w": saved}, f"{root}/ck", block_size=block_size)
        zs.load({"w": out}, f"{root}/ck", max_staging_bytes=staging)
    assert torch.equal(out, torch.empty_like(out).copy_(saved))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=st.dictionaries(st.text(alphabet="abc_", min_size=1, max_size=3), tensors(), min_size=1, max_size=6),
       drop=st.sets(st.integers(0, 5)), extra=st.booleans())
def test_partial_loads_name_exactly_what_did_not_match(state, drop, extra):
    """``strict=True`` refuses before touching the target; ``strict=False`` loads the rest and
    names exactly the keys missing on either side."""
    dropped = {k for i, k in enumerate(sorted(state)) if i in drop}
    assume(len(dropped) < len(state))  # an empty target dict is filled with the whole checkpoint instead
    target = {k: blank_like(v, "same") for k, v in state.items() if k not in dropped}
    if extra:
        target["extra"] = torch.zeros(2)
    with tempfile.TemporaryDirectory() as root:
        zs.save(state, f"{root}/ck")
        if dropped or extra:
            untouched = {k: v.clone() for k, v in target.items()}
            try:
                zs.load(target, f"{root}/ck")
            except zs.StateMismatchError as exc:
                assert all(k in str(exc) for k in sorted(dropped)[:5] + (["extra"] if extra else []))
            else:
                raise AssertionError("a strict load with unmatched keys must raise")
            assert same(untouched, target)
        loaded, mismatch = zs.load(target, f"{root}/ck", strict=False)
    assert set(mismatch.unexpected) == dropped
    assert mismatch.missing == (["extra"] if extra else [])
    assert same({k: v for k, v in state.items() if k not in dropped}, {k: v for k, v in loaded.items() if k != "extra"})
