"""CheckpointManager.restore: falling back from a damaged checkpoint (on every rank together), and
never from an I/O error; last_restore; resuming on another world size."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
import torch.distributed as dist

import zerostall as zs
from faults import FaultyStorage
from zerostall.format.layout import MANIFEST_NAME
from zerostall.roots.root import SUPERSEDED_NAME, step_tag
from zerostall.storage import LocalStorage

N = 3000  # elements of each tensor


def state_of(step: float) -> dict:
    return {"a": torch.full((N,), float(step)), "b": torch.full((N,), 10.0 * step), "epoch": step}


def saved_steps(root, steps=(1, 2, 3)) -> dict[int, torch.Tensor]:
    """Save ``steps`` under ``root`` (RNG seeded by the step); the RNG state each one saved."""
    rng = {}
    with zs.CheckpointManager(root, fsync=False) as mgr:
        for step in steps:
            torch.manual_seed(step)
            rng[step] = torch.get_rng_state()
            mgr.save(step, state_of(step))
    return rng


def data_file_of(root, tag: str, fqn: str) -> tuple[str, int]:
    """The data file holding entry ``fqn`` of checkpoint ``tag`` and the entry's first byte in it."""
    with zs.open(os.path.join(root, tag)) as ck:
        chunk = ck.entries[fqn].chunks[0]
    return os.path.join(root, tag, chunk.file), chunk.offset


def flip(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        (b,) = f.read(1)
        f.seek(offset)
        f.write(bytes([b ^ 0x01]))


def damage(root, tag: str, how: str) -> None:
    file, offset = data_file_of(root, tag, "b")
    if how == "flipped":
        flip(file, offset + 17)
    elif how == "missing":
        os.remove(file)
    elif how == "truncated":
        os.truncate(file, offset + 8)
    else:  # the manifest
        manifest = os.path.join(root, tag, MANIFEST_NAME)
        flip(manifest, os.path.getsize(manifest) // 2)


WHAT_FAILED = {"flipped": "checksum mismatch", "missing": "is missing", "truncated": "is truncated",
               "manifest": "fails its checksum"}


@pytest.mark.parametrize("how", sorted(WHAT_FAILED))
def test_a_damaged_newest_checkpoint_restores_the_previous_one_whole_with_a_warning(tmp_path, how, caplog):
    rng = saved_steps(tmp_path)
    damage(tmp_path, step_tag(3), how)
    target = state_of(0)
    with zs.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 2
        info = mgr.last_restore
    # every target filled again from step 2, whatever the attempt at step 3 had filled before it failed
    assert torch.equal(target["a"], state_of(2)["a"]) and torch.equal(target["b"], state_of(2)["b"])
    assert target["epoch"] == 2 and torch.equal(torch.get_rng_state(), rng[2])
    assert (info.step, info.tag, info.source, info.sources) == (2, step_tag(2), "persistent", ("persistent",))
    [(tag, reason)] = info.fallbacks
    assert tag == step_tag(3) and WHAT_FAILED[how] in reason
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "damaged" in r.getMessage())
    assert f"{tmp_path / step_tag(3)} is damaged" in warning and WHAT_FAILED[how] in warning
    assert f"restoring the previous committed one, {step_tag(2)}" in warning


def test_fallback_false_refuses_and_names_the_checkpoint_it_would_restore(tmp_path):
    saved_steps(tmp_path)
    damage(tmp_path, step_tag(3), "flipped")
    with zs.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(zs.CorruptCheckpointError) as exc:
            mgr.restore(state_of(0), fallback=False)
        assert "checksum mismatch" in str(exc.value)
        assert f"restore(..., fallback=True) restores the previous committed checkpoint, {step_tag(2)}" in str(exc.value)
        assert mgr.last_restore.step is None and [t for t, _ in mgr.last_restore.fallbacks] == [step_tag(3)]


def test_a_checkpoint_asked_for_by_tag_is_never_fallen_back_from(tmp_path):
    saved_steps(tmp_path)
    damage(tmp_path, step_tag(2), "flipped")
    with zs.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(zs.CorruptCheckpointError, match=f"asked for by tag='{step_tag(2)}', so no other is "
                                                            "restored in its place"):
            mgr.restore(state_of(0), tag=step_tag(2))
        assert mgr.last_restore.step is None
        assert mgr.restore(state_of(0)) == 3  # the newest is whole


def test_every_checkpoint_damaged_is_a_typed_error_listing_what_was_tried(tmp_path):
    saved_steps(tmp_path, (1, 2))
    damage(tmp_path, step_tag(2), "missing")
    damage(tmp_path, step_tag(1), "flipped")
    with zs.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(zs.CorruptCheckpointError) as exc:
            mgr.restore(state_of(0))
        message = str(exc.value)
        assert f"every checkpoint tried under {tmp_path} is damaged" in message
        assert f"{step_tag(2)} (CorruptCheckpointError: data file" in message and "is missing" in message
        assert f"{step_tag(1)} (CorruptCheckpointError: checksum mismatch" in message
        assert [t for t, _ in mgr.last_restore.fallbacks] == [step_tag(2), step_tag(1)]


@pytest.mark.parametrize("error", [zs.StorageError("GET step_3 failed: 503 SlowDown (after 5 tries)"),
                                   OSError(errno.EIO, "Input/output error")], ids=["storage", "io"])
@pytest.mark.parametrize("where", ["data", "manifest", "listing"])
def test_an_io_error_is_raised_and_never_falls_back(tmp_path, error, where):
    """A transient failure says nothing about the checkpoint: resuming an older step over it would
    silently lose the steps in between."""
    saved_steps(tmp_path)
    storage = FaultyStorage(LocalStorage(str(tmp_path)))
    if where == "data":
        for op in ("memory_map", "read_into", "read_into_many"):
            storage.fail(op, error, name=f"{step_tag(3)}/*.safetensors")
    elif where == "manifest":
        for op in ("read_bytes", "read_head"):
            storage.fail(op, error, name=f"{step_tag(3)}/{MANIFEST_NAME}")
    else:  # the listing looks the manifest up
        storage.fail("stat", error, name=f"{step_tag(3)}/{MANIFEST_NAME}")
    with zs.CheckpointManager(storage) as mgr:
        with pytest.raises(zs.CheckpointError) as exc:
            mgr.restore(state_of(0))
        assert not isinstance(exc.value, zs.CorruptCheckpointError)
        assert isinstance(exc.value, OSError) or isinstance(exc.value.__cause__, OSError)
        assert mgr.last_restore == zs.RestoreInfo(None, None, (), ())


def test_a_fresh_root_restores_nothing(tmp_path):
    with zs.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(state_of(0)) is None
        assert mgr.last_restore == zs.RestoreInfo(None, None, (), ())


def test_saving_on_after_a_fallback_sets_the_damaged_checkpoint_aside(tmp_path):
    """The run goes on from step 2: saving step 3 again must not be refused by the damaged step 3
    (its manifest unreadable, so not listed) nor lose it."""
    saved_steps(tmp_path)
    damage(tmp_path, step_tag(3), "manifest")
    with zs.CheckpointManager(tmp_path, fsync=False) as mgr:
        assert mgr.restore(state_of(0)) == 2
        mgr.save(3, state_of(33))
        assert mgr.restore(state_of(0)) == 3 and mgr.last_restore.fallbacks == ()
    assert os.listdir(tmp_path / SUPERSEDED_NAME) == [step_tag(3)]


# -- ranks ---------------------------------------------------------------------------------------
def rank_state(step: int) -> dict:
    return {"w": torch.full((N,), float(step)), "dataloader": {"pos": torch.full((N,), 100.0 * step + dist.get_rank())}}


def save_on_ranks(root: str, steps: list[int]) -> None:
    with zs.CheckpointManager(root, fsync=False) as mgr:
        for step in steps:
            mgr.save(step, rank_state(step))


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def restore_on_ranks(root: str, fail_reads_of: str | None = None, **load_options) -> tuple:
    """Restore on every rank; rank 1 fails every read of data files of ``fail_reads_of`` with an I/O
    error. Returns the step (or the error), last_restore, the loader position and the warnings."""
    storage = FaultyStorage(LocalStorage(root))
    if fail_reads_of is not None and dist.get_rank() == 1:
        for op in ("memory_map", "read_into", "read_into_many"):
            storage.fail(op, OSError(errno.EIO, "Input/output error"), name=f"{fail_reads_of}/*.safetensors")
    handler = Warnings()
    logging.getLogger("zerostall").addHandler(handler)
    target = rank_state(0)
    try:
        with zs.CheckpointManager(storage, load_options=zs.LoadOptions(**load_options)) as mgr:
            try:
                outcome: object = mgr.restore(target)
            except zs.CheckpointError as exc:
                outcome = (type(exc).__name__, str(exc))
            return outcome, mgr.last_restore, target["dataloader"]["pos"][0].item(), handler.seen
    finally:
        logging.getLogger("zerostall").removeHandler(handler)


def test_damage_that_only_one_rank_reads_makes_every_rank_fall_back_together(ranks, tmp_path):
    """Rank 1 alone reads its own data-loader state: the checksum it finds wrong sends rank 0 back
    too, or the ranks would resume from different steps."""
    root = str(tmp_path / "root")
    pool = ranks(2)
    pool.run(save_on_ranks, root, [1, 2])
    file, offset = data_file_of(root, step_tag(2), "dataloader.pos@rank1")
    flip(file, offset + 5)
    (step0, info0, pos0, seen0), (step1, info1, pos1, seen1) = pool.run(restore_on_ranks, root)
    assert (step0, step1) == (1, 1) and (pos0, pos1) == (100.0, 101.0)
    assert info0 == info1 and info0.step == 1 and info0.sources == ("persistent", "persistent")
    [(tag, reason)] = info0.fallbacks
    assert tag == step_tag(2) and reason.startswith("rank 1: CorruptCheckpointError: checksum mismatch")
    assert any(f"{step_tag(2)} is damaged (rank 1: " in w for w in seen0) and not seen1  # said once


def test_damage_found_by_the_rank_that_reads_for_both_makes_every_rank_fall_back(ranks, tmp_path):
    """With broadcast loads one rank reads ``w`` for both: the other learns only that a rank failed."""
    root = str(tmp_path / "root")
    pool = ranks(2)
    pool.run(save_on_ranks, root, [1, 2])
    file, offset = data_file_of(root, step_tag(2), "w")
    flip(file, offset + 5)
    (step0, info0, _, _), (step1, info1, _, _) = pool.run(restore_on_ranks, root, broadcast=True)
    assert (step0, step1) == (1, 1) and info0 == info1 and [t for t, _ in info0.fallbacks] == [step_tag(2)]
    assert "CorruptCheckpointError: checksum mismatch" in info0.fallbacks[0][1]


def test_an_io_error_on_one_rank_is_raised_on_every_rank_without_falling_back(ranks, tmp_path):
    root = str(tmp_path / "root")
    pool = ranks(2)
    pool.run(save_on_ranks, root, [1, 2])
    (out0, info0, _, _), (out1, info1, _, _) = pool.run(restore_on_ranks, root, step_tag(2))
    assert out1[0] == "CheckpointError" and "Input/output error" in out1[1]
    assert out0[0] == "CheckpointError" and f"restoring {root}/{step_tag(2)} failed on rank 1: " in out0[1]
    assert info0 == info1 == zs.RestoreInfo(None, None, (), ())


def test_a_checkpoint_of_another_world_size_names_the_call_that_restores_it(ranks, tmp_path, caplog):
    root = str(tmp_path / "root")
    ranks(2).run(save_on_ranks, root, [1])
    target = {"w": torch.zeros(N), "dataloader": {"pos": torch.zeros(N)}}
    with zs.CheckpointManager(root) as mgr:
        with pytest.raises(zs.StateMismatchError) as exc:
            mgr.restore(target)
        assert "saved by 2 rank(s) and is restored on 1" in str(exc.value)
        assert "the RNG states, 'dataloader'" in str(exc.value)
        assert "call mgr.restore(state, strict=False)" in str(exc.value)
        rng = torch.get_rng_state()
        assert mgr.restore(target, strict=False) == 1
    assert torch.equal(target["w"], torch.ones(N)) and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(target["dataloader"]["pos"], torch.zeros(N))  # this rank's own, not another rank's
    assert "its per-rank state (the RNG states, 'dataloader') is not restored, each rank keeps its own" in caplog.text
    assert "load with strict=False" not in caplog.text  # the call that works was made: no advice to make it


class Position:
    """A per-rank object restored through its own ``load_state_dict`` (a sampler's position)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, sd: dict) -> None:
        self.at = sd["at"]


def loader_state(step: int) -> dict:
    rank = dist.get_rank()
    return {"w": torch.full((N,), float(step)),
            "dataloader": {"pos": torch.full((N,), 100.0 * step + rank), "epoch": step, "order": Position(step),
                           "seen": (step, [step])}}


def save_loader_steps(root: str, steps: list[int]) -> None:
    with zs.CheckpointManager(root, fsync=False) as mgr:
        for step in steps:
            mgr.save(step, loader_state(step))


def restore_non_strict(root: str) -> tuple:
    target = loader_state(0)
    with zs.CheckpointManager(root) as mgr:
        step = mgr.restore(target, strict=False)
    loader = target["dataloader"]
    return (step, [t for t, _ in mgr.last_restore.fallbacks], target["w"][0].item(), loader["pos"][0].item(),
            loader["epoch"], loader["order"].at, loader["seen"])


def test_a_fallback_to_another_world_size_leaves_per_rank_state_as_given_not_as_the_failed_attempt_left_it(
        ranks, tmp_path):
    """Step 2 (2 ranks) loaded on rank 0 and failed its checksum on rank 1; both fell back to step 1,
    saved by 1 rank, whose per-rank state a non-strict restore leaves as it is: rank 0 kept step 2's
    loader position, epoch and sampler beside step 1's weights."""
    root = str(tmp_path / "root")
    ranks(1).run(save_loader_steps, root, [1])
    pool = ranks(2)
    pool.run(save_loader_steps, root, [2])
    file, offset = data_file_of(root, step_tag(2), "dataloader.pos@rank1")
    flip(file, offset + 5)
    for rank, got in enumerate(pool.run(restore_non_strict, root)):
        assert got == (1, [step_tag(2)], 1.0, float(rank), 0, 0, (0, [0])), (rank, got)
