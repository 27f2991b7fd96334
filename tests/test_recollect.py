"""Collecting again from the last collection (saving/recollect.py): whatever changed between two
saves, the cache's collection equals a full one; and it is reused only when nothing but bytes and
python values changed."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import zerostall as zs
from zerostall.format import codec
from zerostall.saving.collect import Collected, collect
from zerostall.saving.recollect import CollectCache


def described(c: Collected) -> dict:
    """Everything a save takes from a collection, tensors by view (their bytes are the caller's)."""
    def view(t):  # a copy (of a non-contiguous leaf) is another copy each time: compared by value
        return None if t is None else (t.dtype, tuple(t.shape), t.stride(), t.requires_grad, t.is_conj(),
                                       t.detach().resolve_conj().tolist())

    return {
        "entries": [(k, dataclasses.asdict(e)) for k, e in c.entries.items()],
        "rank_local": [dataclasses.asdict(e) for e in c.rank_local],
        "rows": list(c.rows),
        "items": [(dataclasses.asdict(i.entry), i.name, view(i.tensor), i.offsets, i.key, i.rank_local, id(i.watch))
                  for i in c.items],
        "objects": list(c.objects.items()),
        "shards": list(c.shards.items()),
        "skeleton": codec.encode(c.skeleton),
        "refs": list(c.refs),
        "keys": [(p, tuple(map(type, p)), k) for p, k in c.keys.items()],
        "optimizers": [id(o) for o in c.optimizers],
    }


def base_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    return {"model": model, "opt": opt, "sched": sched, "extra": {"t": torch.arange(6.0).reshape(2, 3), 1: torch.zeros(0),
                                                  "pair": (torch.ones(2), 3), "lr": 0.1},
            "mine": zs.rank_local(torch.full((2,), 7.0)), "note": zs.rank_local("rank note"), "step": 5}


def grow(s):  # a parameter's shape changes under the same object (.data replaced)
    s["model"][0].weight.data = torch.randn(5, 4)


def retype(s):
    s["extra"]["t"].data = s["extra"]["t"].data.double()


def replace(s):  # a new tensor object of the same shape, other memory
    s["extra"]["t"] = torch.randn(2, 3)


def transpose(s):  # same shape, not contiguous
    s["extra"]["t"] = torch.randn(3, 2).t()


def tie(s):  # two leaves become the same view
    s["extra"]["u"] = s["extra"]["t"]


def bool_key(s):  # True == 1, but not the same key (in the same place)
    s["extra"] = {True if k == 1 else k: v for k, v in s["extra"].items()}


def to_value(s):
    s["extra"]["pair"] = (2.0, 3)


def add_leaf(s):
    s["extra"]["new"] = torch.ones(1)


def drop_leaf(s):
    del s["extra"]["lr"]


def grad_on(s):
    s["extra"]["t"].requires_grad_(True)


def conj(s):
    s["extra"]["c"] = torch.randn(2, dtype=torch.complex64).conj()


def local(s):
    s["extra"]["t"] = zs.rank_local(s["extra"]["t"])


def value_change(s):
    s["extra"]["lr"] = 0.2
    s["step"] = 6


def in_place(s):
    with torch.no_grad():
        s["extra"]["t"].add_(1)


def optimizer_step(s):
    s["model"](torch.randn(2, 4)).sum().backward()
    s["opt"].step()
    s["sched"].step()


def subclass(s):  # a wrapper subclass: collected in full, as its inner tensors
    from torch.testing._internal.two_tensor import TwoTensor

    s["extra"]["t"] = TwoTensor(torch.ones(2, 3), torch.zeros(2, 3))


def parameter(s):
    s["extra"]["t"] = torch.nn.Parameter(s["extra"]["t"])


def local_value(s):
    s["extra"]["lr"] = zs.rank_local(0.1)


def reorder(s):
    s["extra"] = dict(reversed(list(s["extra"].items())))


def to_list(s):
    s["extra"]["pair"] = list(s["extra"]["pair"])


def value_to_tensors(s):
    s["extra"]["lr"] = {"x": torch.ones(1)}


def tensor_to_dict(s):
    s["extra"]["t"] = {"y": torch.ones(2)}


def tensor_free(s):  # a container that held a tensor holds none: one python value now
    s["extra"]["pair"] = (1, 3)


def unwrap_stateful(s):
    s["model"] = s["model"].state_dict()


def unwrap_local(s):
    s["mine"] = s["mine"].value


def local_to_value(s):  # a rank-local tensor becomes a rank-local python value
    s["mine"] = zs.rank_local(3)


CHANGES = [local_value, local_to_value, reorder, to_list, value_to_tensors, tensor_to_dict, tensor_free, unwrap_stateful, unwrap_local,
           grow, retype, replace, transpose, tie, bool_key, to_value, add_leaf, drop_leaf, grad_on, conj, local,
           value_change, in_place, optimizer_step, subclass, parameter]
REUSED = {replace, transpose, grad_on, value_change, in_place, optimizer_step}  # bytes, memory, grad or values


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_the_cached_collection_equals_a_full_one_whatever_changed(change) -> None:
    state = base_state()
    cache = CollectCache()
    assert described(cache.collect(state, 0, allow_pickle=False)) == described(collect(state, 0, allow_pickle=False))
    assert described(cache.collect(state, 0, allow_pickle=False)) == described(collect(state, 0, allow_pickle=False))
    assert cache.hits == 1
    change(state)
    assert described(cache.collect(state, 0, allow_pickle=False)) == described(collect(state, 0, allow_pickle=False))
    assert cache.hits == 1 + (change in REUSED), "reused only when the structure is unchanged"
    assert described(cache.collect(state, 0, allow_pickle=False)) == described(collect(state, 0, allow_pickle=False))


def test_shared_memory_and_odd_keys_are_collected_in_full_every_time() -> None:
    t = torch.ones(3)
    for state in ({"a": t, "b": t}, {"a": torch.ones(2), 2.5: torch.ones(2)}):
        cache = CollectCache()
        for _ in range(3):
            assert described(cache.collect(state, 0, allow_pickle=False)) == described(
                collect(state, 0, allow_pickle=False))
        assert cache.hits == 0


def test_an_async_saver_reuses_its_collection_and_every_save_loads_back(tmp_path) -> None:
    """A shape change between saves of one saver: the save after it holds the new shape."""
    state = base_state()
    saves = collections.OrderedDict()
    with zs.AsyncSaver() as saver:
        for n, change in enumerate([None, in_place, grow, None, retype]):
            if change is not None:
                change(state)
            saver.save(state, tmp_path / f"s{n}").result()
            saves[n] = {"w": state["model"][0].weight.detach().clone(), "t": state["extra"]["t"].detach().clone()}
        assert saver.collections.hits == 2  # after in_place, and after grow's first (full) collection
    for n, want in saves.items():
        with zs.open(tmp_path / f"s{n}") as ck:
            assert torch.equal(ck.read("model.0.weight"), want["w"]) and ck.read("model.0.weight").shape == want["w"].shape
            got = ck.read("extra.t")
            assert got.dtype == want["t"].dtype and torch.equal(got, want["t"])
