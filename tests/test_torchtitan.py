"""torchtitan's checkpoint-manager contract over zerostall (zerostall.integrations.torchtitan), with
torchtitan 0.3.0's own optimizer and lr-scheduler containers and model wrapper, on CPU with gloo."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed: ./dev setup installs it")

import zerostall as zs  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter  # noqa: E402
from zerostall.cli import cli  # noqa: E402
from zerostall.integrations.torchtitan import ZeroStallCheckpointManager  # noqa: E402
from zerostall.loading.opening import read_manifest  # noqa: E402
from zerostall.roots.root import step_tag  # noqa: E402
from zerostall.storage import storage_for  # noqa: E402


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class Data(torch.utils.data.IterableDataset):
    """Each data-parallel rank's own samples, in order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Any:
        for i in range(10_000):
            yield torch.full((8,), (i + 1000 * self.rank) / 1000)


class Adapter(BaseStateDictAdapter):
    """A model's HF key mapping, as torchtitan's models define one."""

    fqn_to_index_mapping = None

    def __init__(self, model_config: Any = None, hf_assets_path: str | None = None) -> None:
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.layers.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model.layers."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
        raise NotImplementedError


class Run:
    """A small model, torchtitan's optimizer and scheduler containers, its train state, and the manager."""

    def __init__(self, folder: str, base: str = "", sd_adapter: Any = None, fsdp: bool = False, **config: Any) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.fsdp = fsdp
        if fsdp:  # torchtitan's data parallelism: FSDP2, parameters sharded as DTensors
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in (self.model[0], self.model[2], self.model):
                fully_shard(layer, mesh=mesh)
        self.optim = OptimizersContainer(OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop"), model_parts=[self.model])
        self.sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optim, training_steps=20)
        self.train = TrainState()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.loader = ParallelAwareDataloader(Data(rank), rank, world, batch_size=4)  # torchtitan's, per dp rank
        self.batches: Any = None
        cfg = ZeroStallCheckpointManager.Config(folder=folder, **{"enable": True, "interval": 2, **config})
        self.ckpt = cfg.build(dataloader=self.loader, model_parts=[self.model], optimizers=self.optim,
                              lr_schedulers=self.sched, states={"train_state": self.train}, sd_adapter=sd_adapter,
                              base_folder=base)

    def steps(self, first: int, last: int, total: int) -> list[float]:
        losses = []
        if self.batches is None:  # after load(): from the restored position
            self.batches = iter(self.loader)
        for step in range(first, last + 1):
            x = next(self.batches) + torch.randn(4, 8)  # and the global RNG, restored with the checkpoint
            loss = self.model(x).square().mean()
            loss.backward()
            if dist.is_initialized() and not self.fsdp:  # replicas stay equal, as data parallelism keeps them
                for p in self.model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            self.ckpt.maybe_wait_for_staging()
            self.optim.step()
            self.sched.step()
            self.optim.zero_grad()
            self.train.step, self.train.ntokens_seen = step, self.train.ntokens_seen + 32
            self.ckpt.save(step, last_step=step == total)
            losses.append(loss.item())
        return losses

    def snapshot(self) -> dict[str, Any]:
        return {"model": {k: local(v) for k, v in self.model.state_dict().items()},
                "optim": {k: local(v) for k, v in self.optim.state_dict().items()},
                "sched": self.sched.state_dict(), "train": self.train.state_dict(),
                "lr": [g["lr"] for o in self.optim.optimizers for g in o.param_groups]}


def local(value: Any) -> Any:
    """A copy of this rank's part of a tensor (its shard, for a DTensor)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.clone() if isinstance(value, torch.Tensor) else value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def resume_bit_exact(base: str, async_mode: str, fsdp: bool = False) -> bool:
    """Runs 6 steps straight, then 4 steps, a fresh process state, ``load()`` and 2 more: the same
    losses and the same model, optimizer, scheduler and train state at the end."""
    straight = Run("straight", base, async_mode=async_mode, last_save_model_only=False, fsdp=fsdp)
    losses = straight.steps(1, 6, 6)
    expected = straight.snapshot()
    straight.ckpt.close()

    first = Run("resumed", base, async_mode=async_mode, last_save_model_only=False, fsdp=fsdp)
    assert first.ckpt.load() is False  # nothing saved yet: a fresh start
    head = first.steps(1, 4, 6)
    first.ckpt.close()
    torch.manual_seed(123)  # the checkpoint's RNG states must win
    second = Run("resumed", base, async_mode=async_mode, last_save_model_only=False, fsdp=fsdp)
    assert second.ckpt.load(step=-1) is True
    assert second.train.step == 4
    tail = second.steps(5, 6, 6)
    second.ckpt.close()
    return head + tail == losses and same(second.snapshot(), expected)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("async_mode", ["async", "disabled"])
def test_a_resume_is_bit_exact_on_gloo_ranks(ranks, tmp_path, world, async_mode):
    assert ranks(world).run(resume_bit_exact, str(tmp_path), async_mode, timeout=240) == [True] * world


@pytest.mark.parametrize("async_mode", ["async", "disabled"])
def test_an_fsdp_sharded_resume_is_bit_exact_on_2_ranks(ranks, tmp_path, async_mode):
    assert ranks(2).run(resume_bit_exact, str(tmp_path), async_mode, True, timeout=240) == [True, True]


def retention(base: str, model_only: bool) -> list[list[str]]:
    """Saves every step with keep_latest_k=2, asynchronously: the two newest stay, and the last
    step's save (the model alone, with ``model_only``) deletes none, as torchtitan's DCP manager's."""
    run = Run("ckpt", base, interval=1, keep_latest_k=2, async_mode="async", last_save_model_only=model_only)
    run.steps(1, 5, 5)
    run.ckpt.maybe_wait_for_saving()  # on rank 0, which deletes, retention has run too
    if dist.is_initialized():
        dist.barrier()
    tags = [tag for tag, _ in run.ckpt.manager.checkpoints()]
    run.ckpt.close()
    return [tags, sorted(n for n in os.listdir(os.path.join(base, "ckpt")) if n.startswith("step"))]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model_only", [False, True])
def test_keep_latest_k_keeps_the_newest_k(ranks, tmp_path, world, model_only):
    """The last step's save counted for keep_latest_k: with the model alone saved there, one
    checkpoint left to resume training from, where torchtitan's own manager leaves k."""
    kept = [step_tag(3), step_tag(4), step_tag(5)]
    assert ranks(world).run(retention, str(tmp_path), model_only, timeout=240) == [[kept, kept]] * world


def test_an_async_save_is_committed_once_waited_for(tmp_path):
    run = Run("ckpt", str(tmp_path), async_mode="async", last_save_model_only=False)
    run.steps(1, 2, 10)
    assert run.ckpt.save_future is not None
    run.ckpt.maybe_wait_for_saving()
    assert run.ckpt.save_future is None
    with zs.open_latest(str(tmp_path / "ckpt")) as ck:
        assert ck.step == 2
        assert ck.verify() > 0
    run.ckpt.close()


def test_load_step_names_a_step_or_raises(tmp_path):
    run = Run("ckpt", str(tmp_path), interval=2, async_mode="disabled", last_save_model_only=False)
    run.steps(1, 4, 10)
    at_2 = None
    with zs.open(str(tmp_path / "ckpt" / step_tag(2))) as ck:
        at_2 = ck.read("model.0.weight")
    with pytest.raises(zs.CheckpointNotFoundError, match="load_step=3"):
        run.ckpt.load(step=3)
    assert run.ckpt.load(step=2) is True
    assert run.train.step == 2 and torch.equal(run.model[0].weight, at_2)
    run.ckpt.close()


def test_a_disabled_manager_does_nothing(tmp_path):
    run = Run("ckpt", str(tmp_path), enable=False)
    assert run.ckpt.save(2) is False and run.ckpt.load() is False
    run.ckpt.close()
    assert not (tmp_path / "ckpt").exists()


def hf_export(base: str) -> bool:
    """The last step's model, cast to bfloat16, as safetensors under the adapter's names; read back
    by ``initial_load_in_hf`` into a fresh run."""
    tmp_path = Path(base)
    run = Run("ckpt", base, sd_adapter=Adapter(), async_mode="async", last_save_model_only=True,
              last_save_in_hf=True, export_dtype="bfloat16")
    run.steps(1, 3, 3)
    weights = load_file(str(tmp_path / "hf" / "step-3" / "model.safetensors"))
    expected = {f"model.layers.{k}": v.to(torch.bfloat16) for k, v in run.model.state_dict().items()}
    assert same(weights, expected)
    assert not (tmp_path / "hf" / "step-3.zerostall-staging").exists()
    with zs.open_latest(str(tmp_path / "ckpt")) as ck:  # the last checkpoint holds the model only
        assert ck.step == 3
        assert {k for k in ck.entries if not k.startswith("__rng__")} == {f"model.{k}" for k in run.model.state_dict()}
    run.ckpt.close()

    fresh = Run("fresh", base, sd_adapter=Adapter(), initial_load_in_hf=True,
                initial_load_path=str(tmp_path / "hf" / "step-3"))
    assert fresh.ckpt.load() is True
    assert same({k: v.to(torch.bfloat16) for k, v in fresh.model.state_dict().items()},
                {k.removeprefix("model.layers."): v for k, v in expected.items()})
    fresh.ckpt.close()
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_the_last_step_exports_hf_safetensors_through_the_sd_adapter(ranks, tmp_path, world):
    assert ranks(world).run(hf_export, str(tmp_path), timeout=240) == [True] * world


def hf_export_fails_then_succeeds(base: str) -> list[str]:
    """Rank 0's export fails (a file where it goes, as a full disk would fail it), then a rerun
    exports; what each rank's last save said each time."""
    said = []
    for attempt in range(2):
        if dist.get_rank() == 0:
            blocker = Path(base) / "hf" / "step-3"
            if attempt == 0:
                blocker.parent.mkdir(parents=True, exist_ok=True)
                blocker.write_text("in the way")
            else:
                blocker.unlink()
        dist.barrier()
        run = Run(f"ckpt{attempt}", base, sd_adapter=Adapter(), async_mode="disabled", last_save_model_only=True,
                  last_save_in_hf=True)
        try:
            run.steps(1, 3, 3)
            said.append("exported")
        except zs.CheckpointError as exc:
            said.append(f"{type(exc).__name__}: {exc}")
        run.ckpt.close()
    return said


def test_a_failed_hf_export_is_raised_on_every_rank_and_a_rerun_exports(ranks, tmp_path):
    """Rank 0 exports alone: its failure left the other rank in a barrier until the process group's
    timeout; and the staging checkpoint it left behind refused every later export of that step."""
    said = ranks(2).run(hf_export_fails_then_succeeds, str(tmp_path), timeout=240)
    for rank in said:
        assert rank[0].startswith("ExportError: ") and "step-3 is a file" in rank[0], rank
        assert rank[1] == "exported", rank
    assert sorted(os.listdir(tmp_path / "hf")) == ["step-3"]


class Unencodable(TrainState):
    """A train state holding a value zerostall's encoding does not hold."""

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "out_dir": Path("/data/run1")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.out_dir = state_dict["out_dir"]


def test_allow_pickle_reaches_the_managers_saves_and_loads(tmp_path):
    """It reached ``initial_load_path`` only: the saves refused the value, saying to pass allow_pickle=True."""
    cfg = ZeroStallCheckpointManager.Config(folder="ck", enable=True, interval=1, async_mode="disabled",
                                            allow_pickle=True)
    model = nn.Linear(2, 2)
    mgr = cfg.build(dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None,
                    states={"train_state": Unencodable()}, sd_adapter=None, base_folder=str(tmp_path))
    mgr.save(1)
    mgr.close()
    state = Unencodable()
    again = cfg.build(dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None,
                      states={"train_state": state}, sd_adapter=None, base_folder=str(tmp_path))
    assert again.load() is True and state.out_dir == Path("/data/run1")
    again.close()


def test_saves_and_loads_on_s3(s3_url):
    run = Run(s3_url, async_mode="async", interval=2, keep_latest_k=2, last_save_model_only=False)
    run.steps(1, 6, 10)
    run.ckpt.maybe_wait_for_saving()
    assert [tag for tag, _ in run.ckpt.manager.checkpoints()] == [step_tag(4), step_tag(6)]
    expected = run.snapshot()
    run.ckpt.close()
    again = Run(s3_url, async_mode="async", last_save_model_only=False)
    assert again.ckpt.load() is True
    assert same(again.snapshot(), expected)
    again.ckpt.close()


def test_initial_load_path_reads_a_zerostall_or_a_torchtitan_dcp_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    source = Run("source", str(tmp_path), async_mode="disabled", last_save_model_only=False)
    source.steps(1, 4, 10)
    expected = source.snapshot()
    source.ckpt.close()
    flat = {**source.model.state_dict(), "optimizer": source.optim.state_dict(),
            "lr_scheduler": source.sched.state_dict(), "train_state": source.train.state_dict(),
            "dataloader": source.loader.state_dict()}
    dcp.save(flat, checkpoint_id=str(tmp_path / "dcp" / "step-4"))  # torchtitan's DCP manager's layout
    imported = CliRunner().invoke(cli, ["import", "--allow-pickle", str(tmp_path / "dcp" / "step-4"),
                                        str(tmp_path / "imported")])  # DCP's layout in a checkpoint of ours
    assert imported.exit_code == 0, imported.output

    for path, allow_pickle in ((tmp_path / "source" / step_tag(4), False), (tmp_path / "dcp" / "step-4", True),
                               (tmp_path / "imported", True)):
        fresh = Run(f"fresh-{path.name}", str(tmp_path), initial_load_path=str(path), initial_load_model_only=False,
                    allow_pickle=allow_pickle)
        assert fresh.ckpt.load() is True
        got = fresh.snapshot()
        assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
        assert got["sched"] == expected["sched"] and got["train"] == expected["train"]
        fresh.ckpt.close()


def test_a_last_model_only_checkpoint_is_not_taken_for_a_resume(tmp_path):
    """A finished run started again restored the final model alone and trained on from step 0,
    optimizer and data loader fresh (torchtitan's own manager refuses it too)."""
    run = Run("ckpt", str(tmp_path), async_mode="async", last_save_model_only=True)
    run.steps(1, 3, 3)
    run.ckpt.close()
    again = Run("ckpt", str(tmp_path), async_mode="async")
    with pytest.raises(zs.CheckpointError, match=f"{step_tag(3)} holds the model alone.*load_step"):
        again.ckpt.load()
    assert again.ckpt.load(step=2) is True and again.train.step == 2
    again.ckpt.close()


def load_elsewhere(base: str, step: int = -1, **config: Any) -> tuple[bool, Any, int] | str:
    """Load what one process saved under ``base`` on these ranks (``step``: as the trainer passes
    checkpoint.load_step): the model, and the train state's step."""
    run = Run("ckpt", base, **config)
    try:
        loaded = run.ckpt.load(step)
    except zs.CheckpointError as exc:
        return str(exc)
    finally:
        run.ckpt.close()
    return loaded, run.snapshot()["model"], run.train.step


def test_a_seed_checkpoint_of_one_process_loads_on_two_ranks(ranks, tmp_path):
    """torchtitan's create_seed_checkpoint saves step 0 on one process; the job then failed on
    every rank, the seed's one RNG state refused on two ranks."""
    seed = Run("ckpt", str(tmp_path), last_save_model_only=True)
    seed.ckpt.save(0, last_step=True)
    seed.ckpt.close()
    expected = seed.snapshot()["model"]
    for loaded, model, step in ranks(2).run(load_elsewhere, str(tmp_path), timeout=240):
        assert loaded is True and same(model, expected) and step == 0


def test_a_checkpoint_of_one_process_resumes_on_two_ranks_without_the_data_loader(ranks, tmp_path):
    """Refused with advice a torchtitan user cannot follow (``mgr.restore(strict=False)``); DCP
    reshards it when the data loader is excluded."""
    run = Run("ckpt", str(tmp_path))
    run.steps(1, 2, 10)
    run.ckpt.close()
    refused = ranks(2).run(load_elsewhere, str(tmp_path), timeout=240)
    assert all("exclude_from_loading" in r for r in refused), refused
    out = ranks(2).run(load_elsewhere, str(tmp_path), exclude_from_loading=["dataloader"], timeout=240)
    for loaded, model, step in out:
        assert loaded is True and same(model, run.snapshot()["model"]) and step == 2


def test_a_damaged_newest_checkpoint_of_another_world_size_falls_back_to_the_previous(ranks, tmp_path):
    """Loaded on another number of ranks, a checkpoint was read outside the manager's restore: a
    damaged newest one failed the load instead of falling back to the one before it."""
    run = Run("ckpt", str(tmp_path))
    run.steps(1, 2, 10)
    at_2 = run.snapshot()["model"]
    run.steps(3, 4, 10)
    run.ckpt.close()
    newest = tmp_path / "ckpt" / step_tag(4)
    chunk = next(e for e in read_manifest(storage_for(newest)).entries if e.fqn == "model.0.weight").chunks[0]
    data = bytearray((newest / chunk.file).read_bytes())
    data[chunk.offset + 5] ^= 0xFF
    (newest / chunk.file).write_bytes(bytes(data))
    for loaded, model, step in ranks(2).run(load_elsewhere, str(tmp_path), exclude_from_loading=["dataloader"],
                                            timeout=240):
        assert loaded is True and step == 2 and same(model, at_2)


def damage_model_weight(folder: Path) -> None:
    chunk = next(e for e in read_manifest(storage_for(folder)).entries if e.fqn == "model.0.weight").chunks[0]
    data = bytearray((folder / chunk.file).read_bytes())
    data[chunk.offset + 5] ^= 0xFF
    (folder / chunk.file).write_bytes(bytes(data))


def train_on(base: str, first: int, last: int) -> dict[str, Any]:
    """Resume what is under ``base`` (of any world size, the data loader excluded), train ``first``..``last``."""
    run = Run("ckpt", base, async_mode="disabled", exclude_from_loading=["dataloader"])
    run.ckpt.load()
    run.steps(first, last, 10)
    run.ckpt.close()
    return run.snapshot()["model"]


def test_a_fallback_takes_the_older_checkpoints_own_world_size_and_seed_rules(ranks, tmp_path):
    """The rules for what to load (per-rank state, the seed's model alone) were taken from the newest
    checkpoint: falling back from a damaged one of 2 ranks to one of 1 rank asked for its RNG states
    and was refused with advice a torchtitan user cannot follow; a damaged step after the seed
    checkpoint fell back to the seed asking for the optimizer it does not hold."""
    run = Run("ckpt", str(tmp_path), async_mode="disabled")
    run.steps(1, 2, 10)
    run.ckpt.close()
    at_2 = run.snapshot()["model"]
    pool = ranks(2)
    pool.run(train_on, str(tmp_path), 3, 4, timeout=240)  # step 4 on 2 ranks
    damage_model_weight(tmp_path / "ckpt" / step_tag(4))
    for loaded, model, step in pool.run(load_elsewhere, str(tmp_path), exclude_from_loading=["dataloader"],
                                        timeout=240):
        assert loaded is True and step == 2 and same(model, at_2)
    for refused in pool.run(load_elsewhere, str(tmp_path), timeout=240):  # each rank's data loader asked for
        assert refused.startswith(f"{step_tag(4)} is damaged (") and "exclude_from_loading" in refused, refused

    seeded = tmp_path / "seeded"
    seed = Run("ckpt", str(seeded), last_save_model_only=True)
    seed.ckpt.save(0, last_step=True)
    seed.ckpt.close()
    pool.run(train_on, str(seeded), 1, 2, timeout=240)
    damage_model_weight(seeded / "ckpt" / step_tag(2))
    for refused in pool.run(load_elsewhere, str(seeded), timeout=240):
        assert "the checkpoint before it, step_000000000, cannot restore ['dataloader', 'lr_scheduler', " in refused \
            and "checkpoint.load_step=0 to resume from step_000000000 in a new process" in refused, refused
    for got in pool.run(load_elsewhere, str(seeded), 0, timeout=240):
        assert not isinstance(got, str), got
        loaded, model, step = got
        assert loaded is True and same(model, seed.snapshot()["model"]) and step == 0


def test_initial_load_path_errors_name_the_keys_and_the_fix(ranks, tmp_path):
    """A model grown by a layer was taken for a DCP checkpoint, its error naming every key without
    the "model." prefix; a 1-process checkpoint loaded whole on 2 ranks said the data loader was missing."""
    source = Run("source", str(tmp_path), async_mode="disabled")
    source.steps(1, 2, 10)
    source.ckpt.close()
    path = str(tmp_path / "source" / step_tag(2))
    grown = Run("grown", str(tmp_path), initial_load_path=path)
    grown.model.add_module("3", nn.Linear(4, 4))
    with pytest.raises(zs.StateMismatchError) as exc:
        grown.ckpt.load()
    grown.ckpt.close()
    assert "model.3.weight" in str(exc.value) and "model.0.weight" not in str(exc.value)
    refused = ranks(2).run(initial_elsewhere, path, str(tmp_path), timeout=240)
    assert all("saved by 1 rank(s)" in r and "exclude_from_loading" in r for r in refused), refused
    for loaded in ranks(2).run(initial_elsewhere, path, str(tmp_path), exclude_from_loading=["dataloader"],
                               timeout=240):
        assert loaded is True


def initial_elsewhere(path: str, base: str, **config: Any) -> bool | str:
    run = Run("fresh", base, initial_load_path=path, initial_load_model_only=False, **config)
    try:
        return run.ckpt.load()
    except zs.CheckpointError as exc:
        return str(exc)
    finally:
        run.ckpt.close()


def test_exclude_from_loading_must_name_a_state_key(tmp_path):
    run = Run("ckpt", str(tmp_path), exclude_from_loading=["dataset"])
    with pytest.raises(zs.UnsupportedValueError, match="dataset"):
        run.ckpt.load()
    run.ckpt.close()
