"""A manager resume repeats the uninterrupted run with the common data loaders (issue 28).

A torch DataLoader without a ``generator`` draws a seed from the global RNG at each ``iter()``: a
run resumed mid-epoch made one such draw more than the run it repeats, which shifted dropout from
the first step after the checkpoint on. The manager now has the loaders in the state make their
next iterator before it restores (or captures) the RNG states. Set-ups no checkpoint can replay
(a plain DataLoader shuffling with the global RNG) are named in one warning at the first save.
"""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

pytest.importorskip("torchdata")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13

from torch.utils.data import DataLoader, RandomSampler, TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

import zerostall as zs  # noqa: E402
from distributed import RankError, RankPool  # noqa: E402

STEPS, EVERY, KILL_AFTER = 12, 4, 10  # 5 batches an epoch: the checkpoint restored (step 8) is mid-epoch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.drop, self.out = torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.inp(x))))


class Weights:
    """Model and optimizer as one Stateful (FSDP2's DTensors through torch's own state-dict helpers)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def make_loader(setup: str, rank: int, world: int) -> DataLoader:
    """The loader set-ups users have, none with a generator of its own."""
    data = torch.Generator().manual_seed(7)
    n = 20 * world if setup == "distributed_sampler" else 20
    dataset = TensorDataset(torch.randn(n, 8, generator=data), torch.randn(n, 1, generator=data))
    if setup == "shuffle":
        return StatefulDataLoader(dataset, batch_size=4, shuffle=True)
    if setup == "distributed_sampler":
        sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=3)
        return StatefulDataLoader(dataset, batch_size=4, sampler=sampler)
    if setup == "plain":
        return DataLoader(dataset, batch_size=4, shuffle=True)
    raise ValueError(setup)


def build(setup: str, rank: int = 0, world: int = 1, fsdp: bool = False) -> tuple[Net, dict]:
    torch.manual_seed(0)
    model = Net()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # dropout and the loader's order differ by rank
    return model, {"weights": Weights(model, optim), "dataloader": make_loader(setup, rank, world)}


def train(model: Net, state: dict, start: int, *, mgr: zs.CheckpointManager | None = None,
          kill_after: int | None = None) -> dict[int, torch.Tensor]:
    """The usual loop: epochs of the loader, an optimizer step a batch, a save when due."""
    loader, optim = state["dataloader"], state["weights"].optim
    losses, step = {}, start
    while step < STEPS:
        if isinstance(loader.sampler, StatefulDistributedSampler):
            loader.sampler.set_epoch(step // len(loader))
        for x, y in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses[step] = loss.detach()
            if mgr is not None and mgr.should_save(step):
                mgr.save(step, state)
            if step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == STEPS:
                break
    return losses


def job(setup: str, root: str | None = None, *, resume: bool = False, kill_after: int | None = None) -> dict:
    """One rank of a 2-rank FSDP2 job: uninterrupted (no root), killed, or resumed from ``root``."""
    import torch.distributed as dist

    model, state = build(setup, dist.get_rank(), dist.get_world_size(), fsdp=True)
    mgr = None if root is None else zs.CheckpointManager(root, save_every=EVERY, fsync=False)
    start = (mgr.restore(state) or 0) if resume else 0
    losses = train(model, state, start, mgr=mgr, kill_after=kill_after)
    if mgr is not None:
        mgr.close()
    return {"start": start, "losses": losses, "weights": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def _records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("zerostall") and r.levelno == logging.WARNING]


@pytest.fixture(scope="module")
def pools():
    """A live 2-rank pool on demand: a killed job takes its pool down with it."""
    held: list[RankPool] = []

    def get() -> RankPool:
        if not held or not held[-1].alive:
            held.append(RankPool(2))
        return held[-1]

    yield get
    for pool in held:
        pool.close()


@pytest.mark.parametrize("setup", ["shuffle", "distributed_sampler"])
def test_a_resume_after_sigkill_repeats_the_uninterrupted_run(pools, tmp_path, setup):
    """2 FSDP2 ranks with dropout; StatefulDataLoader(shuffle=True), or over a StatefulDistributedSampler,
    neither with a generator: both ranks SIGKILLed after step 10, resumed from step 8, equal to the end."""
    root = str(tmp_path / "root")
    reference = pools().run(job, setup)
    with pytest.raises(RankError) as killed:
        pools().run(job, setup, root, kill_after=KILL_AFTER)
    assert killed.value.dead and not killed.value.failures, killed.value
    resumed = pools().run(job, setup, root, resume=True)
    for rank, (ref, res) in enumerate(zip(reference, resumed)):
        assert res["start"] == 8, res["start"]
        assert sorted(res["losses"]) == list(range(9, STEPS + 1))
        differ = [s for s, loss in res["losses"].items() if not torch.equal(loss, ref["losses"][s])]
        assert not differ, f"rank {rank}: losses differ from step {differ[0]} on"
        assert all(torch.equal(w, ref["weights"][k]) for k, w in res["weights"].items()), f"rank {rank}: weights"


def test_a_resume_from_each_checkpoint_repeats_the_run(tmp_path, caplog):
    """One process: checkpoints at step 0 (before the first batch), 4 and 8 of a StatefulDataLoader(shuffle=True)
    run; a fresh model, loader and RNG restored from each goes on exactly as the run did. Nothing warns."""
    model, state = build("shuffle")
    with caplog.at_level(logging.WARNING), zs.CheckpointManager(tmp_path, save_every=EVERY, fsync=False) as mgr:
        mgr.save(0, state)
        reference = train(model, state, 0, mgr=mgr)
    assert not _records(caplog)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    for tag in ("step_000000000", "step_000000004", "step_000000008"):
        model, state = build("shuffle")
        torch.manual_seed(12345)  # a restarted process: whatever its RNG was, the restore sets it
        with zs.CheckpointManager(tmp_path, fsync=False) as mgr:
            start = mgr.restore(state, tag)
        losses = train(model, state, start)
        differ = [s for s, loss in losses.items() if not torch.equal(loss, reference[s])]
        assert not differ, f"resumed from {tag}: losses differ from step {differ[0]} on"
        assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items()), tag


def test_a_plain_dataloader_shuffling_with_the_global_rng_is_named_once_at_the_first_save(tmp_path, caplog):
    """Its position is in no checkpoint and its order comes from the global RNG at each epoch: no resume
    can continue the epoch. The warning names the loader and the fix, once; a loader that does not shuffle
    (validation) is not named."""
    model, state = build("plain")
    loader = state.pop("dataloader")  # a save refuses a plain DataLoader in the state
    val_loader = DataLoader(loader.dataset, batch_size=4)
    optim = state["weights"].optim
    with caplog.at_level(logging.WARNING), zs.CheckpointManager(tmp_path, save_every=2, fsync=False) as mgr:
        for step, (x, y) in enumerate(loader, 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            if mgr.should_save(step):
                mgr.save(step, state)
    assert len(mgr.checkpoints()) == 2 and val_loader is not None
    warned = _records(caplog)
    assert len(warned) == 1, warned
    assert "loader (in test_a_plain_dataloader" in warned[0], warned[0]
    assert "global RNG" in warned[0] and "StatefulDataLoader" in warned[0], warned[0]
    assert "val_loader" not in warned[0], warned[0]


def test_stateful_loaders_over_torchs_random_sampler_or_outside_the_state_are_named_at_the_first_save(tmp_path,
                                                                                                        caplog):
    """torch's RandomSampler keeps no state (a StatefulDataLoader fast-forwards a new order on resume); a shuffling
    StatefulDataLoader outside the state keeps no position and its draws are not kept in step."""
    model, state = build("shuffle")
    dataset = state["dataloader"].dataset
    state["dataloader"] = StatefulDataLoader(dataset, batch_size=4, sampler=RandomSampler(dataset))
    held = {"other": StatefulDataLoader(dataset, batch_size=4, shuffle=True)}
    with caplog.at_level(logging.WARNING), zs.CheckpointManager(tmp_path, fsync=False) as mgr:
        next(iter(state["dataloader"]))
        mgr.save(1, state)
        mgr.save(2, state)
    warned = _records(caplog)
    assert len(warned) == 1 and "state['dataloader'] is a StatefulDataLoader over torch's RandomSampler" in warned[0]
    assert "shuffle=True" in warned[0], warned[0]
    assert "held['other'] (in test_stateful_loaders" in warned[0] and "not at the top level" in warned[0], warned[0]
    assert held
