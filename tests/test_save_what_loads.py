"""What a save commits, its own verify and load accept: what they would call corrupt (a quantized
dtype reached through ``.view()``, a key that does not equal itself once stored, an int too long
for JSON) is refused at save with an UnsupportedValueError naming the key, and nothing is committed.
A property test holds the rule over hostile keys, values, metadata and steps: saved means readable, bit for bit."""

from __future__ import annotations

import math
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerostall as zs
from test_subclass import ScaledTensor
from zerostall.format.codec import MAX_INT_BITS

DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
QUANTIZED = [torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4]
NAN = float("nan")


def bytes_as(dtype: torch.dtype, n: int = 16, seed: int = 0) -> torch.Tensor:
    """``n`` random bytes seen as ``dtype`` (as ``.view()`` reaches any dtype)."""
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return (data & 1 if dtype == torch.bool else data).view(dtype)


def assert_refused(state, tmp_path, *words: str) -> None:
    with pytest.raises(zs.UnsupportedValueError) as refused:
        zs.save(state, tmp_path / "ck")
    assert all(w in str(refused.value) for w in words), refused.value
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir()), "a refused save left files"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_is_refused_at_save_or_verified_and_loaded(tmp_path, dtype):
    """Quantized dtypes reached through ``.view()`` were committed, then called corrupt by verify."""
    saved = bytes_as(dtype)
    if dtype in QUANTIZED:
        assert_refused({"model": {"w": saved}}, tmp_path, "model.w", str(dtype), "dequantize")
        return
    zs.save({"model": {"w": saved}}, tmp_path / "ck")
    zs.verify(tmp_path / "ck")
    target = {"model": {"w": torch.zeros(16, dtype=torch.uint8).view(dtype)}}
    assert torch.equal(zs.load(target, tmp_path / "ck")["model"]["w"].view(torch.uint8), saved.view(torch.uint8))


def test_a_quantized_dtype_inside_a_tensor_subclass_is_refused_naming_it(tmp_path):
    meta = {"dtype": torch.float32}
    inner = ScaledTensor(torch.zeros(4, 6, dtype=torch.int8).view(torch.qint8), torch.tensor(1.0), meta)
    assert_refused({"s": inner}, tmp_path, "s.qdata", "torch.qint8")
    outer = ScaledTensor(torch.zeros(4, 6, dtype=torch.int8), torch.tensor(1.0), {"dtype": torch.quint8})
    assert_refused({"s": outer}, tmp_path, "s:", "torch.quint8")


@pytest.mark.parametrize("key", [NAN, (1, NAN), complex(NAN, 0.0), frozenset([NAN]), np.float32(NAN)], ids=repr)
def test_a_key_that_does_not_equal_itself_is_refused_at_save(tmp_path, key):
    """A tensor below a NaN key was committed, then verify called the tree corrupt (its key path
    did not match the entry's); a load could not have matched the key either."""
    assert_refused({"m": {key: torch.ones(2), "b": 1}}, tmp_path, "does not equal itself", "m.")
    assert_refused({"m": {key: 1, "b": torch.ones(2)}}, tmp_path, "does not equal itself")  # a value beside a tensor


def test_keys_that_equal_themselves_save_and_load(tmp_path):
    """The rule refuses only what a checkpoint cannot give back: infinities, tuples, frozensets,
    numpy scalars, a NaN inside a python value (no key path runs through it) are all fine."""
    state = {"m": {math.inf: torch.ones(1), (1, "a"): torch.ones(2), frozenset([2.5]): torch.ones(3),
                   np.int64(4): torch.ones(4), -0.0: torch.ones(5)}, "v": {NAN: 1, (NAN,): 2}}
    zs.save(state, tmp_path / "ck")
    zs.verify(tmp_path / "ck")
    out = zs.load({"m": {k: torch.zeros_like(t) for k, t in state["m"].items()}, "v": None}, tmp_path / "ck")
    assert all(torch.equal(out["m"][k], t) for k, t in state["m"].items())
    assert [repr(v) for v in out["v"].items()] == [repr(v) for v in state["v"].items()]


def test_an_int_too_long_for_json_is_refused_naming_it(tmp_path):
    """It raised a bare ValueError from the JSON encoder (or, with the interpreter's digit limit
    raised, wrote a manifest that a reader with the default limit cannot parse)."""
    longest = (1 << MAX_INT_BITS) - 1
    zs.save({"t": torch.ones(1), "n": longest, "k": {longest: torch.ones(1)}}, tmp_path / "fits")
    assert zs.load({"t": torch.zeros(1), "n": None, "k": {longest: torch.zeros(1)}}, tmp_path / "fits")["n"] == longest
    assert_refused({"t": torch.ones(1), "opts": {"n": [1 << MAX_INT_BITS]}}, tmp_path, "opts.n[0]", "bits")
    assert_refused({"t": torch.ones(1), "k": {-(1 << MAX_INT_BITS): torch.ones(1)}}, tmp_path, "k (a key)", "bits")


# -- the property: whatever save accepts, verify, state() and load give back --------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(), st.text(max_size=4), st.binary(max_size=4),
    st.complex_numbers(), st.sampled_from(DTYPES), st.sampled_from([torch.device("cpu"), torch.device("cuda", 3),
                                                                     torch.device("meta")]),
    st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=3).map(torch.Size),
    st.sampled_from([np.float32, np.int8, np.uint64, np.complex64, np.float16]).flatmap(
        lambda kind: st.binary(min_size=np.dtype(kind).itemsize, max_size=np.dtype(kind).itemsize).map(
            lambda raw: np.frombuffer(raw, dtype=kind)[0])),
)
arrays = st.sampled_from(["<f4", ">i8", "|b1", "<c16", "<M8[D]", "<m8[s]", "<f2", "|u1"]).flatmap(
    lambda d: st.binary(min_size=np.dtype(d).itemsize * 2, max_size=np.dtype(d).itemsize * 2).map(
        lambda raw: np.frombuffer(raw, dtype=d).reshape(2, 1)))
hashables = st.recursive(scalars, lambda inner: st.one_of(st.tuples(inner, inner), st.frozensets(inner, max_size=2)),
                         max_leaves=3)
keys = st.one_of(st.text(alphabet="a$.", min_size=1, max_size=3), hashables)
values = st.recursive(st.one_of(scalars, arrays),
                      lambda inner: st.one_of(st.lists(inner, max_size=2), st.tuples(inner),
                                              st.dictionaries(keys, inner, max_size=2), st.sets(hashables, max_size=2)),
                      max_leaves=6)
tensors = st.builds(bytes_as, st.sampled_from(DTYPES), st.integers(0, 2).map(lambda n: 16 * n), st.integers(0, 99))
states = st.dictionaries(keys, st.one_of(tensors, values, st.dictionaries(keys, st.one_of(tensors, values),
                                                                          max_size=3)), min_size=1, max_size=3)


def canon(value) -> str:
    """``value`` as text that two values share when they are equal in type, structure and contents:
    tensors and arrays by their bytes, NaN equal to NaN, dicts in their order, sets in any order."""
    kind = type(value).__qualname__
    if isinstance(value, torch.Tensor):
        return f"{kind}({value.dtype}, {list(value.shape)}, {value.reshape(-1).view(torch.uint8).tolist()})"
    if isinstance(value, (np.ndarray, np.generic)):
        return f"{kind}({value.dtype.str}, {value.shape}, {value.tobytes()!r})"
    if isinstance(value, dict):
        return f"{kind}({', '.join(f'{canon(k)}: {canon(v)}' for k, v in value.items())})"
    if isinstance(value, (list, tuple)):
        return f"{kind}({', '.join(map(canon, value))})"
    if isinstance(value, (set, frozenset)):
        return f"{kind}({', '.join(sorted(map(canon, value)))})"
    return f"{kind}({value!r})"


def same(a, b) -> bool:
    return canon(a) == canon(b)


def blank(node, tensor=lambda t: torch.zeros(t.numel() * t.dtype.itemsize, dtype=torch.uint8).view(t.dtype)):
    """``node`` with each tensor zeroed (1-D, any dtype): the target of a load; or ``tensor(t)``."""
    if isinstance(node, torch.Tensor):
        return tensor(node)
    if isinstance(node, dict):
        return {k: blank(v, tensor) for k, v in node.items()}
    return node


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(state=states, metadata=st.dictionaries(st.text(max_size=3), values, max_size=2),
       step=st.none() | st.integers(-1, 1 << 64))
def test_whatever_save_accepts_verify_and_load_accept(state, metadata, step):
    with tempfile.TemporaryDirectory() as root:
        try:
            zs.save(state, f"{root}/ck", metadata=metadata, step=step)
        except zs.UnsupportedValueError:
            return  # refused, naming the key: nothing committed
        zs.verify(f"{root}/ck")
        with zs.open(f"{root}/ck") as ck:
            whole, shown = ck.state(), ck.metadata
            assert ck.step == step
        repr(blank(whole, lambda t: None)), repr(shown)  # what inspect shows: every value can be printed
        assert same(state, whole) and same(metadata, shown)
        assert same(state, zs.load(blank(state), f"{root}/ck"))


def test_a_step_beyond_64_bits_is_refused_at_save(tmp_path):
    """``step=2**70`` was committed, then verify called the manifest's step corrupt."""
    zs.save({"t": torch.ones(1)}, tmp_path / "last", step=(1 << 63) - 1)
    zs.verify(tmp_path / "last")
    with pytest.raises(zs.UnsupportedValueError, match=r"step=9223372036854775808 .*\[0, 2\*\*63\)"):
        zs.save({"t": torch.ones(1)}, tmp_path / "ck", step=1 << 63)
    assert not (tmp_path / "ck").exists()


def save_with_metadata_on_rank_0_only(path: str, metadata) -> str:
    try:
        zs.save({"w": torch.ones(2)}, path, metadata=metadata if dist.get_rank() == 0 else None, commit_timeout=10)
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.parametrize("metadata", [{"n": 1 << MAX_INT_BITS}, {"f": open}, "not a dict"], ids=repr)
def test_metadata_one_rank_cannot_save_is_refused_on_every_rank_before_any_writes(ranks, tmp_path, metadata):
    """Only the coordinator's metadata is recorded, so a script may pass it on rank 0 alone. It was
    encoded after the planning collective: rank 0 raised, rank 1 wrote its data files and waited
    for a commit that never came (``commit_timeout``, ten minutes by default)."""
    rank0, rank1 = ranks(2).run(save_with_metadata_on_rank_0_only, str(tmp_path / "ck"), metadata, timeout=60)
    assert rank0.startswith("UnsupportedValueError: ") and "metadata" in rank0, rank0
    assert rank1.startswith("CheckpointError: 1 other rank(s) could not prepare this save"), rank1
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
