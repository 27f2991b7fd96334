"""The load plan is pure: built from a manifest and a target state with no storage at all."""

from __future__ import annotations

import pytest
import torch

import zerostall as zs
from zerostall.format.layout import Chunk, Entry, Manifest
from zerostall.loading.load_plan import LoadPlanner, relative


def manifest(world: int = 1) -> Manifest:
    w = Entry("model.w", ("model", "w"), "tensor", "float32", (4, 2),
              [Chunk((0, 0), (2, 2), "f0", 4096, 16, ["x"]), Chunk((2, 0), (2, 2), "f1", 4096, 16, ["y"])])
    tied = Entry("model.tied", ("model", "tied"), "alias", alias_of=0)
    step = Entry("step", ("step",), "object", value=7)
    rng = [Entry("rng", ("rng",), "object", value=r, rank=r) for r in range(world)]
    rng_entry = Entry("__rng__.torch", ("__rng__", "torch"), "object", value=1, rank=0)  # a manager's own entry
    return Manifest("1-1", [w, tied, step, *rng, rng_entry], {"f0": 4128, "f1": 4128}, None, world_size=world)


def plan(state, world=1, rank=0, wanted=None, **options):
    planner = LoadPlanner(manifest(world), "ck", rank, world, zs.LoadOptions(**options))
    flat, p = planner.plan(state)
    planner.check(p, wanted)
    return flat, p


def test_targets_get_their_entry_and_box_and_values_their_decoded_value():
    w, tied = torch.zeros(4, 2), torch.zeros(4, 2)
    _, p = plan({"model": {"w": w, "tied": tied}, "step": 0, "rng": 0})
    assert [(t is w or t is tied, box, e.fqn) for t, box, e in p.tensors] == [
        (True, ((0, 0), (4, 2)), "model.w"), (True, ((0, 0), (4, 2)), "model.w")]  # the alias resolves
    assert p.replacements == {("step",): 7, ("rng",): 0}


def test_rank_local_entries_match_by_rank():
    _, p = plan({"rng": None, "model": {"w": torch.zeros(4, 2)}}, world=3, rank=2, keys=["rng"])
    assert p.replacements == {("rng",): 2} and not p.tensors


def test_a_strict_mismatch_names_every_key_before_any_byte_moves():
    with pytest.raises(zs.StateMismatchError, match=r"missing from the checkpoint: model\.b; unexpected in the "
                                                     r"checkpoint: model\.tied, step, rng; mismatched: model\.w"):
        plan({"model": {"w": torch.zeros(3), "b": torch.zeros(1)}})


def test_prefix_filter_and_strip_select_and_rename():
    w = torch.zeros(4, 2)
    _, p = plan({"module.w": w}, prefix="model", keys=["w"], strip=("module",))
    assert [e.fqn for _, _, e in p.tensors] == ["model.w"] and not p.mismatch


def test_an_empty_container_is_filled_from_the_subtree_later():
    _, p = plan({"model": {}, "step": 0, "rng": 0, "x": torch.zeros(1)}, strict=False)
    assert p.mismatch.missing == ["x"]
    assert [(path, [rel for rel, _ in found]) for path, found in p.subtrees] == [(("model",), [("w",), ("tied",)])]


def test_in_a_collective_load_unexpected_means_wanted_by_no_rank():
    w = torch.zeros(4, 2)
    _, p = plan({"model": {"w": w, "tied": w}, "rng": 0}, world=2, rank=1, wanted={2}, strict=False)
    assert p.mismatch.unexpected == []  # "step" (entry 2) is another rank's: not unexpected here
    _, p = plan({"model": {"w": w, "tied": w}, "rng": 0}, world=2, rank=1, wanted=set(), strict=False)
    assert p.mismatch.unexpected == ["step"]


def test_entries_zerostall_adds_for_itself_are_never_unexpected():
    _, p = plan({"model": {"w": torch.zeros(4, 2), "tied": torch.zeros(4, 2)}, "step": 0, "rng": 0})
    assert not p.mismatch  # the checkpoint also holds __rng__.torch (a manager's), which nobody asked for



def test_a_prefix_that_matches_nothing_says_so():
    with pytest.raises(zs.StateMismatchError, match=r"nothing in checkpoint ck lies under the prefix 'modle'; its "
                                                     r"top-level keys are: model, rng, step$"):
        plan({"w": torch.zeros(4, 2)}, prefix="modle")


def test_rank_local_values_across_world_sizes_suggest_strict_false():
    with pytest.raises(zs.StateMismatchError, match=r"rng \(rank-local, saved by 2 ranks, loading on 1: load with "
                                                     r"strict=False to skip it\)"):
        planner = LoadPlanner(manifest(2), "ck", 0, 1, zs.LoadOptions(keys=["rng"]))
        planner.check(planner.plan({"rng": zs.rank_local(0), "x": torch.zeros(1)})[1])


def tensor(name: str, path: tuple) -> Entry:
    return Entry(name, path, "tensor", "float32", (2,), [Chunk((0,), (2,), "f0", 4096, 8, ["x"])])


def flat_manifest() -> Manifest:
    """Flat dotted keys, as a Hugging Face checkpoint or a saved ``module.state_dict()`` holds them."""
    return Manifest("1-1", [tensor(name, (name,)) for name in ["model.w", "model.b", "lm_head.w"]], {"f0": 4104}, None)


def planned(manifest: Manifest, state, **options):
    planner = LoadPlanner(manifest, "ck", 0, 1, zs.LoadOptions(**options))
    _, p = planner.plan(state)
    planner.check(p)
    return p


def two() -> torch.Tensor:
    return torch.zeros(2)


@pytest.mark.parametrize("prefix", ["model", "model.", ("model",)])
def test_a_dotted_prefix_is_the_key_path_it_spells(prefix):
    _, p = plan({"w": torch.zeros(4, 2), "tied": torch.zeros(4, 2)}, prefix=prefix)
    assert [e.fqn for _, _, e in p.tensors] == ["model.w", "model.w"] and not p.mismatch


@pytest.mark.parametrize("prefix", ["model", "model."])
def test_a_str_prefix_also_selects_flat_dotted_keys(prefix):
    p = planned(flat_manifest(), {"w": two(), "b": two()}, prefix=prefix)
    assert [e.fqn for _, _, e in p.tensors] == ["model.w", "model.b"] and not p.mismatch


def test_relative_is_the_one_reading_of_a_prefix():
    assert relative(("model", "w"), "model") == relative(("model", "w"), "model.") == ("w",)
    assert relative(("model.layers.0.w",), "model.layers") == ("0.w",)
    assert relative(("model", "layers", 0, "w"), "model.layers.0") == ("w",)
    assert relative(("model", "layers.0.w"), "model.layers") == ("0.w",)
    assert relative(("modelx", "w"), "model") is None and relative(("model.x",), ("model",)) is None
    assert relative(("a.b", "c"), ("a.b",)) == ("c",) and relative(("a", "b"), ()) == ("a", "b")


def test_a_key_holding_a_dot_is_reached_alone_by_the_tuple_form():
    both = Manifest("1-1", [tensor("a.b.c", ("a.b", "c")), tensor("a.b.c", ("a", "b.c"))], {"f0": 4104}, None)
    assert [e.path for _, _, e in planned(both, {"c": two()}, prefix=("a.b",)).tensors] == [("a.b", "c")]
    with pytest.raises(zs.StateMismatchError, match=r"collide: both load as 'c'; the prefix 'a.b' selects both as a "
                                                     r"dotted name; pass it as a key path .* prefix=\('a', 'b'\)"):
        planned(both, {"c": two()}, prefix="a.b")


def test_a_load_that_misses_every_key_suggests_the_prefix_they_lie_under():
    with pytest.raises(zs.StateMismatchError, match=r"does not match the target state: did you mean prefix='model'\? "):
        plan({"w": torch.zeros(4, 2), "tied": torch.zeros(4, 2)})
    with pytest.raises(zs.StateMismatchError, match=r"did you mean prefix='model'\?"):
        planned(flat_manifest(), {"w": two(), "b": two()})
    with pytest.raises(zs.StateMismatchError) as err:  # some key matched: no prefix would serve them all
        plan({"w": torch.zeros(4, 2), "step": 0})
    assert "did you mean" not in str(err.value)


def test_missing_and_unexpected_keys_share_one_spelling_and_the_closest_are_paired():
    entries = [tensor(f"model.{k}", ("model", k)) for k in ("module.encoder.weight", "head.bias")]
    p = planned(Manifest("1-1", entries, {"f0": 4104}, None), {"encoder.weight": two(), "head.bias": two()},
                prefix="model", strict=False)
    assert p.mismatch.missing == ["encoder.weight"] and p.mismatch.unexpected == ["module.encoder.weight"]
    assert p.mismatch.describe().endswith("closest (missing ~ unexpected): encoder.weight ~ module.encoder.weight")


def test_the_closest_pairs_find_each_key_among_many_alike():
    names = [f"layers.{i}.self_attn.q_proj.weight" for i in range(300)]
    mismatch = zs.Mismatch(missing=names, unexpected=[f"module.{n}" for n in reversed(names)])
    assert mismatch.closest(20) == [(n, f"module.{n}") for n in names[:20]]
