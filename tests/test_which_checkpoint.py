"""One vocabulary for "which checkpoint": ``zs.load``, ``zs.open``, ``zs.verify``, ``zs.export`` and
the command line take a checkpoint, a root or ``ROOT/latest`` (its newest committed checkpoint) and
``ROOT/<step>`` (the newest of that step), decided once for every rank; and one reading of a prefix."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import zerostall as zs
from faults import FaultyStorage, wait_for
from zerostall.cli import cli
from zerostall.format.layout import MANIFEST_NAME
from zerostall.roots.naming import Naming
from zerostall.roots.root import step_tag
from zerostall.storage import LocalStorage


def model(value: float) -> dict[str, torch.Tensor]:
    return {"encoder.weight": torch.full((3, 2), value), "head.bias": torch.full((2,), value)}


def blank() -> dict[str, torch.Tensor]:
    return model(-1.0)


@pytest.fixture
def root(tmp_path):
    """A root with steps 1 and 2 (each a training checkpoint: model and step) and nothing else."""
    for step in (1, 2):
        zs.save({"model": model(float(step)), "step": step}, tmp_path / "root" / step_tag(step), step=step,
                fsync=False)
    return tmp_path / "root"


@pytest.mark.parametrize("name, step", [("", 2), ("/latest", 2), ("/1", 1), ("/2", 2)])
def test_load_open_and_verify_take_a_root_its_latest_and_a_step(root, name, step):
    where = f"{root}{name}"
    loaded = zs.load(blank(), where, prefix="model")
    assert torch.equal(loaded["head.bias"], torch.full((2,), float(step)))
    with zs.open(where) as ck:
        assert ck.step == step and ck.path.endswith(step_tag(step)) and ck.tag == step_tag(step)
    assert zs.verify(where) > 0


def test_a_root_passed_as_storage_opens_its_newest(root):
    with zs.open(LocalStorage(str(root))) as ck:
        assert ck.step == 2


def test_a_step_or_root_that_names_nothing_says_what_there_is(root, tmp_path):
    with pytest.raises(zs.CheckpointNotFoundError, match=r"no committed checkpoint of step 7 under .*root "
                                                         r"\(steps there: 1, 2\)"):
        zs.load(blank(), f"{root}/7", prefix="model")
    os.mkdir(tmp_path / "empty")
    for where in (tmp_path / "empty", f"{tmp_path / 'empty'}/latest"):
        with pytest.raises(zs.CheckpointNotFoundError):
            zs.open(where)


def test_a_checkpoint_saved_at_a_digit_path_is_itself(tmp_path):
    zs.save({"model": model(5.0)}, tmp_path / "5")  # ROOT/<step> names a step only where nothing is there
    assert torch.equal(zs.load(blank(), tmp_path / "5", prefix="model")["head.bias"], torch.full((2,), 5.0))


def test_opening_by_a_root_says_which_checkpoint_it_opened(root, caplog):
    with caplog.at_level(logging.INFO, logger="zerostall"):
        with zs.open(f"{root}/latest"):
            pass
    assert f"{root}/latest names checkpoint {root / step_tag(2)} (step 2)" in caplog.text


def test_export_and_the_command_line_name_checkpoints_the_same_way(root, tmp_path):
    info = zs.export(f"{root}/1", tmp_path / "hf", prefix="model")
    assert sorted(info.keys) == ["encoder.weight", "head.bias"]
    result = CliRunner().invoke(cli, ["inspect", f"{root}/1", "--json"])
    assert result.exit_code == 0 and '"step": 1' in result.output


def test_a_root_on_s3_is_named_the_same_way(s3_url):
    for step in (1, 2):
        zs.save({"model": model(float(step))}, f"{s3_url}/{step_tag(step)}", step=step)
    for where, step in ((s3_url, 2), (f"{s3_url}/latest", 2), (f"{s3_url}/1", 1)):
        assert torch.equal(zs.load(blank(), where, prefix="model")["head.bias"], torch.full((2,), float(step)))
    assert zs.verify(f"{s3_url}/1") > 0


# -- one reading of a prefix, everywhere -----------------------------------------------------------


@pytest.mark.parametrize("prefix", ["model", "model.", ("model",)])
def test_a_prefix_means_the_same_in_load_open_load_export_and_the_command_line(root, tmp_path, prefix):
    where = root / step_tag(2)
    assert torch.equal(zs.load(blank(), where, prefix=prefix)["encoder.weight"], torch.full((3, 2), 2.0))
    with zs.open(where) as ck:
        assert torch.equal(ck.load(blank(), prefix=prefix)["head.bias"], torch.full((2,), 2.0))
    name = "_".join(prefix) if isinstance(prefix, tuple) else prefix
    assert sorted(zs.export(where, tmp_path / f"hf-{name}", prefix=prefix).keys) == ["encoder.weight", "head.bias"]
    if isinstance(prefix, str):
        result = CliRunner().invoke(cli, ["export", str(where), str(tmp_path / f"cli-{name}"), "--prefix", prefix,
                                          "--json"])
        assert result.exit_code == 0 and '"encoder.weight"' in result.output, result.output


def test_a_flat_dotted_checkpoint_loads_and_exports_under_a_prefix(tmp_path):
    """Keys saved flat with their dots (a ``module.state_dict()`` of a wrapper, a Hugging Face file)."""
    zs.save({f"model.{k}": v for k, v in model(3.0).items()} | {"lm_head.w": torch.zeros(1)}, tmp_path / "ck")
    assert torch.equal(zs.load(blank(), tmp_path / "ck", prefix="model")["encoder.weight"], torch.full((3, 2), 3.0))
    assert sorted(zs.export(tmp_path / "ck", tmp_path / "hf", prefix="model.").keys) == ["encoder.weight", "head.bias"]


def test_a_load_that_misses_every_key_says_which_prefix_they_lie_under(root, caplog):
    with pytest.raises(zs.StateMismatchError, match=r"did you mean prefix='model'\?"):
        zs.load(blank(), f"{root}/latest")
    with caplog.at_level(logging.WARNING, logger="zerostall"):
        zs.load(blank(), f"{root}/latest", strict=False)
    assert "did you mean prefix='model'?" in caplog.text


def test_missing_and_unexpected_keys_are_spelled_alike_and_paired(tmp_path):
    zs.save({"model": {"module.encoder.weight": torch.ones(3, 2), "head.bias": torch.ones(2)}}, tmp_path / "ck")
    with pytest.raises(zs.StateMismatchError) as err:
        zs.load(blank(), tmp_path / "ck", prefix="model.")
    assert ("missing from the checkpoint: encoder.weight; unexpected in the checkpoint: module.encoder.weight; "
            "closest (missing ~ unexpected): encoder.weight ~ module.encoder.weight") in str(err.value)


# -- distributed: rank 0 decides which checkpoint, every rank opens that one ----------------------


def load_while_a_commit_lands(root: str, ready: str) -> tuple[int | None, float, bool]:
    """Load the root's newest checkpoint while step 2 lands (``ready`` renamed into place) right
    after rank 0 listed the root; any other rank that lists the root for itself does so only once
    step 2 is there. Returns the step this rank opened, the value it loaded, and whether step 2 landed."""
    storage = FaultyStorage(LocalStorage(root))
    landed = os.path.join(root, step_tag(2))
    if dist.get_rank() == 0:
        storage.call("children", lambda op, name: os.rename(ready, landed), times=1, at="after")
    else:
        storage.call("children", lambda op, name: wait_for(lambda: os.path.exists(landed), f"{landed} to appear"), times=1)
    with zs.open(storage) as ck:
        loaded = ck.load(blank(), prefix="model")
        return ck.step, float(loaded["head.bias"][0]), os.path.isdir(landed)


def load_missing(where: str) -> str:
    try:
        zs.load(blank(), where, prefix="model")
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_ranks_agree_on_the_checkpoint_a_root_names_while_a_commit_lands(ranks, tmp_path):
    root = tmp_path / "root"
    zs.save({"model": model(1.0)}, root / step_tag(1), step=1, fsync=False)
    zs.save({"model": model(2.0)}, tmp_path / "ready", step=2, fsync=False)
    assert ranks(2).run(load_while_a_commit_lands, str(root), str(tmp_path / "ready")) == [(1, 1.0, True)] * 2
    said = ranks(2).run(load_missing, f"{root}/7")  # what rank 0 found is raised on every rank
    assert said == [f"CheckpointNotFoundError: no committed checkpoint of step 7 under {root} (steps there: 1, 2)"] * 2


def load_damaged(where: str) -> str:
    try:
        zs.load(blank(), where, prefix="model")
    except Exception as exc:  # noqa: BLE001 - the type is what the test asserts
        return type(exc).__name__
    return "loaded"


@pytest.mark.parametrize("damage", ["first byte", "empty"])
def test_a_manifest_damaged_at_its_start_is_the_same_typed_error_on_every_rank(ranks, root, damage):
    """Rank 0 sends the manifest's bytes with marks before them when it opened another checkpoint than
    the path (a root's newest): damaged bytes must not be taken for such marks by the other ranks."""
    manifest = root / step_tag(2) / MANIFEST_NAME
    raw = manifest.read_bytes()
    manifest.write_bytes(b"X" + raw[1:] if damage == "first byte" else b"")
    assert ranks(2).run(load_damaged, str(root / step_tag(2))) == ["CorruptCheckpointError"] * 2


@pytest.mark.parametrize("ops", [("read_bytes", "read_head"), ("stat",)], ids=["read", "looked-up"])
def test_an_unreadable_newest_manifest_is_raised_not_passed_over_for_an_older_checkpoint(root, ops):
    """An I/O error says nothing about the checkpoint: opening the one before it instead would
    silently load an older step (as a restore never does). It is a CheckpointError naming it."""
    storage = FaultyStorage(LocalStorage(str(root)))
    for op in ops:
        storage.fail(op, OSError(errno.EIO, "Input/output error"), name=f"{step_tag(2)}/{MANIFEST_NAME}")
    with zs.CheckpointManager(storage) as mgr:
        for open_newest in (lambda: zs.open(storage), lambda: zs.open_latest(storage), mgr.open):
            with pytest.raises(zs.CheckpointError, match=f"manifest of {root / step_tag(2)}: .*Input/output error") \
                    as exc:
                open_newest()
            assert not isinstance(exc.value, zs.CorruptCheckpointError)
    with zs.open_latest(storage, step=1) as ck:  # a step it is not: not in the way
        assert ck.step == 1


def test_a_root_that_cannot_be_listed_is_a_checkpoint_error_naming_it(root):
    storage = FaultyStorage(LocalStorage(str(root)))
    storage.fail("children", OSError(errno.EIO, "Input/output error"))
    with pytest.raises(zs.CheckpointError, match=f"cannot list the checkpoints under {root}: .*Input/output error"):
        zs.open(storage)


def test_a_damaged_newest_manifest_is_passed_over_with_a_warning_naming_it(root, caplog):
    manifest = root / step_tag(2) / MANIFEST_NAME
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 1
    manifest.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="zerostall"):
        with zs.open(root) as ck:
            assert ck.step == 1
    assert f"{root / step_tag(2)} is damaged (" in caplog.text and "fails its checksum" in caplog.text
    assert f"passed over for {step_tag(1)}" in caplog.text


@pytest.mark.parametrize("path, root, step", [("/latest", "/", None), ("/7", "/", 7), ("latest", ".", None),
                                              ("ckpts/7", "ckpts", 7), ("s3://bucket/latest", "s3://bucket", None)])
def test_a_name_resolves_under_the_root_it_spells(path, root, step):
    naming = Naming(path)
    assert (naming.path, naming.named, naming.step) == (root, True, step)
