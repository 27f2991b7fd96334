"""Reads of single entries into memory the caller gives (``out=``, with or without a box) and of
several entries at once (``read_many``), every block checked as by any read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerostall as zs


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict]:
    state = {"a": torch.arange(3000.0), "b": {"c": torch.randn(7, 5), "n": 4}, "d": torch.arange(10, dtype=torch.int16)}
    zs.save(state, str(tmp_path / "ck"), block_size=4096)
    return str(tmp_path / "ck"), state


def test_a_tensor_is_read_into_the_tensor_given_whole_or_a_box_of_it(saved) -> None:
    path, state = saved
    with zs.open(path) as ck:
        out = torch.empty(3000)
        assert ck.read("a", out=out) is out and torch.equal(out, state["a"])
        part = torch.empty(1000)
        assert torch.equal(ck.read("a", box=((1500,), (1000,)), out=part), state["a"][1500:2500])
        for start in (0, 1024, 3000):  # an empty box, at a block's start or the end, reads nothing and checks nothing
            assert ck.read("a", box=((start,), (0,)), out=torch.empty(0)).shape == (0,)
        with pytest.raises(ValueError, match=r"cannot receive a .*shape \[3000\]"):
            ck.read("a", out=torch.empty(2999))
        with pytest.raises(ValueError, match="cannot receive b.c"):
            ck.read("b.c", out=torch.empty(7, 5, dtype=torch.float64))


def test_several_entries_are_read_at_once_in_order(saved) -> None:
    path, state = saved
    with zs.open(path) as ck:
        a, c, n, d = ck.read_many(["a", ("b", "c"), "b.n", "d"])
    assert torch.equal(a, state["a"]) and torch.equal(c, state["b"]["c"]) and n == 4 and torch.equal(d, state["d"])


def test_read_many_reads_into_given_tensors_that_fit_and_share_no_memory(saved) -> None:
    path, state = saved
    a, d = torch.zeros(3000), torch.zeros(10, dtype=torch.int16)
    wide, side_by_side = torch.zeros(4500), torch.zeros(6000)
    with zs.open(path) as ck:
        got = ck.read_many(["a", ("b", "c"), "b.n", "d"], into=[a, torch.zeros(5, 7), None, d])
        assert got[0] is a and got[3] is d and got[1].shape == (7, 5)  # the second does not fit: new memory
        assert torch.equal(a, state["a"]) and torch.equal(d, state["d"]) and torch.equal(got[1], state["b"]["c"])
        a.zero_()
        twice = ck.read_many(["a", "a"], into=[a, a])  # two reads into one place would race: neither goes there
        overlapping = ck.read_many(["a", "a"], into=[wide[:3000], wide[1500:]])
        apart = ck.read_many(["a", "a"], into=[side_by_side[:3000], side_by_side[3000:]])
    for t in twice + overlapping + apart:
        assert torch.equal(t, state["a"])
    assert not a.any() and not wide.any() and all(t.data_ptr() not in (a.data_ptr(), wide.data_ptr())
                                                   for t in twice + overlapping)
    assert apart[0].data_ptr() == side_by_side.data_ptr() and torch.equal(side_by_side, state["a"].repeat(2))


def test_a_flipped_byte_is_found_by_reads_into_given_memory_and_by_read_many(saved) -> None:
    path, state = saved
    with zs.open(path) as ck:
        chunk = ck.entries["a"].chunks[0]
    data = Path(path) / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.offset + 5000] ^= 0x10  # inside a's second block
    data.write_bytes(bytes(raw))
    with zs.open(path) as ck:
        with pytest.raises(zs.CorruptCheckpointError, match=data.name):
            ck.read_many(["d", "a"])
        with pytest.raises(zs.CorruptCheckpointError, match=data.name):
            ck.read("a", box=((1100,), (100,)), out=torch.empty(100))
        assert torch.equal(ck.read("a", box=((0,), (1000,)), out=torch.empty(1000)), state["a"][:1000])  # block 0 whole
        with pytest.raises(zs.CorruptCheckpointError, match="block 1"):  # a run of whole blocks, read as it is
            ck.read("a", box=((1024,), (1024,)), out=torch.empty(1024))
        assert torch.equal(ck.read("a", box=((2048,), (952,)), out=torch.empty(952)), state["a"][2048:])


def test_the_first_read_builds_its_index_with_the_cyclic_collector_paused(tmp_path: Path) -> None:
    """The index by name (an object per entry) is built at the first read: collections over it
    would walk every object of the process."""
    import gc

    zs.save({"t": [torch.zeros(2) for _ in range(5000)]}, str(tmp_path / "ck"))
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    with zs.open(str(tmp_path / "ck")) as ck:
        gc.callbacks.append(count)
        try:
            ck.read(("t", 7))  # by key path: an index of (path, rank) tuples
        finally:
            gc.callbacks.remove(count)
    assert len(collections) <= 1  # at most the one its objects start once collection resumes
