"""zerostall under Lightning (issue 32): ``ZeroStallCheckpointIO`` and
``ZeroStallModelParallelStrategy``, tested with the real ``lightning`` on the CPU.

The training runs are jobs of tests/lightning_train.py in fresh processes (one process, and DDP or
FSDP2 on two gloo ranks that Lightning starts): each is SIGKILLed mid-epoch, and a new job resumes
with ``ckpt_path="last"``; what it restores, its losses, its end state and the checkpoints
``ModelCheckpoint`` kept must be those of the same two jobs under Lightning's own checkpointing
(``TorchCheckpointIO``; ``ModelParallelStrategy``'s DCP). The plugin's rules (Lightning's objects,
pickle, asynchronous saves and removals, links, S3) are tested in this process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter, OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed (pip install 'zerostall[lightning]')")

import zerostall as zs  # noqa: E402
from zerostall.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError  # noqa: E402
from zerostall.format.layout import MANIFEST_NAME  # noqa: E402
from zerostall.integrations.lightning import (LightningOptions, ZeroStallCheckpointIO,  # noqa: E402
                                             ZeroStallModelParallelStrategy, last_checkpoint)
from zerostall.integrations.lightning import staging, values  # noqa: E402
from zerostall.saving import asynchronous  # noqa: E402
from zerostall.storage import storage_for  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.fabric.utilities.data import AttributeDict  # noqa: E402

from s3server import free_ports  # noqa: E402

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "lightning_train.py"
STEPS_PER_EPOCH = {1: 8, 2: 4}  # 64 samples in batches of 8, split over the ranks


# -- training jobs ----------------------------------------------------------------------------------
def job(tmp: Path, name: str, io: str, devices: int, strategy: str, *args: str, expect_kill: bool = False,
        timeout: float = 240, folder: str = "") -> dict[str, Any]:
    """Run tests/lightning_train.py (Lightning starts the other ranks), checkpointing into ``folder``
    (default: the io's own); each rank's losses and what rank 0 wrote of its state."""
    folder = folder or f"{io}-ck"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), OMP_NUM_THREADS="1",
               PYTHONPATH=str(HERE.parent / "src"), PYTHONFAULTHANDLER="1", PYTHONWARNINGS="ignore")
    out = tmp / f"{io}-{name}"
    proc = subprocess.Popen([sys.executable, str(TRAIN), "--io", io, "--devices", str(devices), "--strategy", strategy,
                             "--dir", str(tmp / folder), "--out", str(out), "--epochs", "5", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # the ranks Lightning starts are killed with it on a time-out
    try:
        log = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    want = -signal.SIGKILL if expect_kill else 0
    assert proc.returncode == want, f"{name} ended with {proc.returncode}, not {want}:\n{log[-6000:]}"
    run: dict[str, Any] = {f"rank{r}": json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)}
    for what in ("restored", "final"):
        if Path(f"{out}.{what}").exists():
            run[what] = torch.load(f"{out}.{what}", weights_only=False)
    run["kept"] = sorted(os.listdir(tmp / folder))
    return run


def killed_and_resumed(tmp: Path, io: str, devices: int, strategy: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Kill a job half-way through its fourth epoch (after three epoch-end saves, one top-k
    removal), then resume it from ``last``."""
    kill_at = str(3 * STEPS_PER_EPOCH[devices] + STEPS_PER_EPOCH[devices] // 2)
    first = job(tmp, "first", io, devices, strategy, "--kill-at", kill_at, expect_kill=True)
    return first, job(tmp, "resumed", io, devices, strategy, "--resume")


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal, tensors bit for bit, containers of the same types."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, str], tuple[dict, dict]]:
    """The killed and resumed jobs under Lightning's own checkpointing (TorchCheckpointIO, or
    ModelParallelStrategy's DCP), per device count and strategy."""
    runs: dict[tuple[int, str], tuple[dict, dict]] = {}

    def get(devices: int, strategy: str) -> tuple[dict, dict]:
        if (devices, strategy) not in runs:
            tmp = tmp_path_factory.mktemp(f"torch-{devices}-{strategy}")
            runs[devices, strategy] = killed_and_resumed(tmp, "torch", devices, strategy)
        return runs[devices, strategy]

    return get


@pytest.mark.parametrize("devices,strategy,io", [(1, "ddp", "zerostall-async"),  # one process: as two, but async
                                                 (2, "ddp", "zerostall"), (2, "ddp", "zerostall-async"),
                                                 (2, "model-parallel", "zerostall")])
def test_a_killed_run_resumes_from_last_as_under_lightnings_own_checkpointing(
        tmp_path: Path, reference: Callable[[int, str], tuple[dict, dict]], devices: int, strategy: str,
        io: str) -> None:
    first, resumed = killed_and_resumed(tmp_path, io, devices, strategy)
    torch_first, torch_resumed = reference(devices, strategy)
    resumed_at = 3 * STEPS_PER_EPOCH[devices]
    assert torch_resumed["restored"]["global_step"] == resumed_at  # the end of the third epoch
    same(resumed["restored"], torch_resumed["restored"], "restored")  # weights, optimizer, scheduler, loops
    for rank in range(devices):
        same(first[f"rank{rank}"], torch_first[f"rank{rank}"], f"first rank{rank}")
        assert min(map(int, resumed[f"rank{rank}"])) == resumed_at + 1
        same(resumed[f"rank{rank}"], torch_resumed[f"rank{rank}"], f"resumed rank{rank}")
    same(resumed["final"], torch_resumed["final"], "final")
    # ModelCheckpoint kept the same top 2 and last, each a whole zerostall checkpoint
    assert resumed["kept"] == torch_resumed["kept"] and "last.ckpt" in resumed["kept"] and len(resumed["kept"]) == 3
    for name in resumed["kept"]:
        assert zs.verify(str(tmp_path / f"{io}-ck" / name)) > 0
    # the last save holds the final state; the plugin reads even a sharded one back whole, on one process
    last = ZeroStallCheckpointIO().load_checkpoint(tmp_path / f"{io}-ck" / "last.ckpt")
    same(dict(last["state_dict"]), dict(resumed["final"]["weights"]), "last.ckpt")


def test_a_run_killed_with_saves_in_flight_resumes_from_a_committed_last(tmp_path: Path) -> None:
    job(tmp_path, "first", "zerostall-async", 1, "ddp", "--kill-at-epoch", "3", expect_kill=True)
    resumed = job(tmp_path, "resumed", "zerostall-async", 1, "ddp", "--resume")
    # last.ckpt was being replaced: it holds the old epoch's state or the new one's, never a torn one
    assert resumed["restored"]["global_step"] in (2 * STEPS_PER_EPOCH[1], 3 * STEPS_PER_EPOCH[1])
    assert resumed["final"]["global_step"] == 5 * STEPS_PER_EPOCH[1]


def test_a_model_parallel_run_switched_to_zerostall_resumes_and_replaces_lightnings_checkpoints(
        tmp_path: Path) -> None:
    """A ``ModelParallelStrategy`` run (Lightning's DCP folders) resumed under
    ``ZeroStallModelParallelStrategy``: its first save of last.ckpt, over Lightning's folder, was
    refused and training died. Now it replaces it, as Lightning would."""
    kill_at = str(3 * STEPS_PER_EPOCH[1] + STEPS_PER_EPOCH[1] // 2)
    job(tmp_path, "first", "torch", 1, "model-parallel", "--kill-at", kill_at, expect_kill=True, folder="ck")
    resumed = job(tmp_path, "resumed", "zerostall", 1, "model-parallel", "--resume", folder="ck")
    assert resumed["restored"]["global_step"] == 3 * STEPS_PER_EPOCH[1]
    assert resumed["final"]["global_step"] == 5 * STEPS_PER_EPOCH[1] and len(resumed["kept"]) == 3
    for name in resumed["kept"]:  # last.ckpt and the new top-k, each a committed zerostall checkpoint now
        assert name.startswith(("last", "epoch=3", "epoch=4")) and zs.verify(str(tmp_path / "ck" / name)) > 0


def test_a_model_parallel_save_that_never_committed_is_not_taken_for_lightnings_checkpoint(tmp_path: Path) -> None:
    """A folder of data files and no manifest (a first save killed half-way, from before such saves
    were staged) went to ``ModelParallelStrategy``'s own load, which failed saying nothing of it."""
    ZeroStallCheckpointIO().save_checkpoint({"w": torch.ones(2), "global_step": 4}, tmp_path / "epoch=0-step=4.ckpt")
    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / "last.ckpt" / "18ec66c29e286132-61646dbf-r00000-000.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(zs.CheckpointNotFoundError, match=r"last\.ckpt holds no committed checkpoint.*resume from "
                                                         r".*epoch=0-step=4\.ckpt \(step 4\)"):
        ZeroStallModelParallelStrategy().load_checkpoint(tmp_path / "last.ckpt")


# -- the checkpoint dict ----------------------------------------------------------------------------
class Tiny(L.LightningModule):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.save_hyperparameters(config)
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fitted(tmp: Path, config: Any, io: ZeroStallCheckpointIO, **trainer: Any) -> Any:
    """A Trainer that fitted ``Tiny(config)`` for a few steps, checkpointing through ``io``."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    keep = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ck", monitor="loss", save_top_k=2, save_last=True,
                                               every_n_train_steps=1)
    t = L.Trainer(accelerator="cpu", max_steps=4, callbacks=[keep], plugins=[io], logger=False,
                  enable_progress_bar=False, enable_model_summary=False, **trainer)
    t.fit(Tiny(config), torch.utils.data.DataLoader(data, batch_size=4))
    return t


def test_lightnings_checkpoint_dict_comes_back_with_its_objects_and_no_pickle(tmp_path: Path) -> None:
    from omegaconf import DictConfig, OmegaConf

    config = OmegaConf.create({"width": 4, "optim": {"lr": 0.01}, "name": "${optim.lr}"})
    io = ZeroStallCheckpointIO()
    trainer = fitted(tmp_path, config, io)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    assert checkpoint["hparams_type"] is DictConfig and isinstance(checkpoint["hyper_parameters"], DictConfig)
    checkpoint["datamodule_hyper_parameters"] = AttributeDict(args=argparse.Namespace(seed=3, scale=(1.5, 2)))
    io.save_checkpoint(checkpoint, tmp_path / "all.ckpt")
    loaded = io.load_checkpoint(tmp_path / "all.ckpt")
    hp = loaded.pop("hyper_parameters")
    assert isinstance(hp, DictConfig) and OmegaConf.to_container(hp) == OmegaConf.to_container(config)
    assert hp.name == 0.01  # the interpolation was stored unresolved, and resolves as before
    expected = dict(checkpoint)
    expected.pop("hyper_parameters")
    same(loaded, expected)  # OrderedDict state_dict, AttributeDict, Namespace, the class, path->tensor maps
    assert loaded["state_dict"]._metadata == checkpoint["state_dict"]._metadata  # module versions
    callbacks = next(v for k, v in loaded["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert all(isinstance(v, torch.Tensor) for v in callbacks["best_k_models"].values())
    with zs.open(str(tmp_path / "all.ckpt")) as ck:
        assert ck.step == 4 and "state_dict.net.weight" in ck.entries  # tensors stored natively


class Custom:
    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.n == self.n


@pytest.mark.parametrize("bad,key", [(Custom(3), "hyper_parameters.loss.fn"),
                                     (torch.nn.Linear(2, 2), "hyper_parameters.loss.fn"),
                                     (OrderedDict(a=Custom(1)), "hyper_parameters.loss.fn.a")])
def test_an_object_our_encoding_cannot_hold_is_named_or_pickled_on_request(tmp_path: Path, bad: Any,
                                                                           key: str) -> None:
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"loss": {"fn": bad}}}
    with pytest.raises(UnsupportedValueError, match=rf"{key}\b.*allow_pickle=True"):
        ZeroStallCheckpointIO().save_checkpoint(checkpoint, tmp_path / "refused.ckpt")
    assert not (tmp_path / "refused.ckpt" / MANIFEST_NAME).exists()
    io = ZeroStallCheckpointIO(allow_pickle=True)
    io.save_checkpoint(checkpoint, tmp_path / "pickled.ckpt")
    loaded = io.load_checkpoint(tmp_path / "pickled.ckpt")
    assert type(loaded["hyper_parameters"]["loss"]["fn"]) is type(bad)
    with pytest.raises(UnsupportedValueError, match="pickle"):  # weights_only never unpickles
        io.load_checkpoint(tmp_path / "pickled.ckpt", weights_only=True)
    with pytest.raises(UnsupportedValueError, match="pickle"):
        ZeroStallCheckpointIO().load_checkpoint(tmp_path / "pickled.ckpt")


def _no_items() -> list:
    return []


def test_collections_dicts_and_parameters_come_back_as_they_were(tmp_path: Path) -> None:
    """A callback's ``defaultdict`` and ``Counter`` came back plain dicts (its next ``d[k] += 1``
    raised KeyError), with or without allow_pickle; an ``nn.Parameter`` a plain tensor."""
    state = {"seen": defaultdict(int, a=1), "hist": Counter(x=2), "groups": defaultdict(list),
             "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
             "trained": torch.nn.Parameter(torch.zeros(3))}
    io = ZeroStallCheckpointIO()
    io.save_checkpoint({"callbacks": {"Counting": state}}, tmp_path / "c.ckpt")
    back = io.load_checkpoint(tmp_path / "c.ckpt")["callbacks"]["Counting"]
    for key, value in state.items():
        assert type(back[key]) is type(value), key
        assert getattr(back[key], "default_factory", None) is getattr(value, "default_factory", None), key
    back["seen"]["b"] += 1
    assert back["seen"] == {"a": 1, "b": 1} and back["hist"] == Counter(x=2)
    assert not back["frozen"].requires_grad and back["trained"].requires_grad
    assert torch.equal(back["trained"], state["trained"])
    own = {"d": defaultdict(_no_items)}  # a factory of its own: pickled on request, else refused by its key
    with pytest.raises(UnsupportedValueError, match=r"callbacks\.d\.default_factory.*allow_pickle"):
        io.save_checkpoint({"callbacks": own}, tmp_path / "own.ckpt")
    pickling = ZeroStallCheckpointIO(allow_pickle=True)
    pickling.save_checkpoint({"callbacks": own}, tmp_path / "own.ckpt")
    assert pickling.load_checkpoint(tmp_path / "own.ckpt")["callbacks"]["d"].default_factory is _no_items


@dataclasses.dataclass
class StructuredConfig:
    lr: float = 0.1
    layers: int = 2


def test_omegaconf_configs_keep_their_flags_and_structured_class(tmp_path: Path) -> None:
    """Hydra's struct mode, a read-only config and a structured (typed) one came back as plain
    configs: a misspelt key was then accepted, a wrong type too."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ReadonlyConfigError, ValidationError

    struct, readonly = OmegaConf.create({"a": 1, "b": {"c": "${a}"}}), OmegaConf.create({"a": 1})
    OmegaConf.set_struct(struct, True)
    OmegaConf.set_readonly(readonly, True)
    io = ZeroStallCheckpointIO()
    io.save_checkpoint({"hyper_parameters": {"struct": struct, "readonly": readonly,
                                             "typed": OmegaConf.structured(StructuredConfig(lr=0.5))}},
                       tmp_path / "h.ckpt")
    back = io.load_checkpoint(tmp_path / "h.ckpt")["hyper_parameters"]
    assert back["struct"].b.c == 1 and OmegaConf.is_struct(back["struct"])
    with pytest.raises(ConfigAttributeError):
        back["struct"].misspelt = 2
    with pytest.raises(ReadonlyConfigError):
        back["readonly"].a = 2
    assert OmegaConf.get_type(back["typed"]) is StructuredConfig and back["typed"].lr == 0.5
    with pytest.raises(ValidationError):
        back["typed"].layers = "many"


def test_stored_classes_are_rebuilt_only_from_modules_already_imported(tmp_path: Path) -> None:
    tree, objects = values.split({"t": OrderedDict(a=1), "k": torch.optim.Adam}, allow_pickle=False)
    assert values.join(tree, objects, allow_pickle=False, where="x") == {"t": OrderedDict(a=1), "k": torch.optim.Adam}
    forged = [[("t",), "dict", ["os", "_Environ", None]]]
    with pytest.raises(CorruptCheckpointError, match="refusing to rebuild os._Environ"):
        values.join(tree, forged, allow_pickle=False, where="x")
    with pytest.raises(CheckpointError, match="not_imported_anywhere is not imported"):
        values.join(tree, [[("k",), "type", ["not_imported_anywhere", "Thing"]]], allow_pickle=False, where="x")
    local = type("Local", (), {})  # a class its module does not name: the pickle policy decides
    with pytest.raises(UnsupportedValueError, match=r"type at \.?k: .*allow_pickle"):
        ZeroStallCheckpointIO().save_checkpoint({"k": local}, tmp_path / "local.ckpt")
    with pytest.raises(CorruptCheckpointError, match="unknown kind"):
        values.join(tree, [[("k",), "exec", None]], allow_pickle=False, where="x")


# -- asynchronous saves and removals ----------------------------------------------------------------
@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Hold every asynchronous save's write until ``gate["open"]`` is set; ``gate["fail"]`` makes it fail."""
    state: dict[str, Any] = {"open": threading.Event(), "fail": None}
    persist = asynchronous.persist

    def held(prepared: Any) -> Any:
        state["open"].wait(60)
        if state["fail"] is not None:
            raise state["fail"]
        return persist(prepared)

    monkeypatch.setattr(asynchronous, "persist", held)
    return state


def test_an_asynchronous_save_returns_once_captured_and_commits_later(tmp_path: Path, gate: dict[str, Any]) -> None:
    io = ZeroStallCheckpointIO(asynchronous=True)
    weight = torch.arange(4.0)
    io.save_checkpoint({"state_dict": {"w": weight}, "global_step": 7}, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt" / MANIFEST_NAME).exists()  # returned before it was written
    weight.add_(100)  # the next optimizer step: the save holds its own copy
    gate["open"].set()
    io.teardown()
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4.0)) and loaded["global_step"] == 7


def test_a_removal_runs_after_the_save_in_flight_commits(tmp_path: Path, gate: dict[str, Any]) -> None:
    gate["open"].set()
    io = ZeroStallCheckpointIO(asynchronous=True)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "old.ckpt")
    io.wait()
    gate["open"].clear()
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")  # top-k drops it while its replacement is in flight
    io.remove_checkpoint(tmp_path / "new.ckpt")  # and one can remove the very checkpoint in flight
    assert (tmp_path / "old.ckpt" / MANIFEST_NAME).exists()  # kept until the replacement is durable
    gate["open"].set()
    io.wait()
    assert not (tmp_path / "old.ckpt").exists() and not (tmp_path / "new.ckpt").exists()


def test_a_removal_behind_a_failed_save_keeps_the_checkpoint(tmp_path: Path, gate: dict[str, Any]) -> None:
    gate["open"].set()
    io = ZeroStallCheckpointIO(asynchronous=True)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "old.ckpt")
    io.wait()
    gate["open"].clear()
    gate["fail"] = OSError("disk on fire")
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")
    gate["open"].set()
    with pytest.raises(CheckpointError, match="disk on fire"):
        io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "old.ckpt")["w"], torch.ones(2))


def test_top_k_and_last_with_asynchronous_saves(tmp_path: Path) -> None:
    io = ZeroStallCheckpointIO(asynchronous=True)
    trainer = fitted(tmp_path, {"width": 4}, io)
    keep = trainer.checkpoint_callback
    kept = sorted(os.listdir(tmp_path / "ck"))
    assert kept == sorted(os.path.basename(p) for p in [*keep.best_k_models, keep.last_model_path])
    assert len(kept) == 3
    for name in kept:
        zs.verify(str(tmp_path / "ck" / name))
    resumed = L.Trainer(accelerator="cpu", max_steps=5, plugins=[ZeroStallCheckpointIO()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)])
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    resumed.fit(Tiny({"width": 4}), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path="last")
    assert resumed.ckpt_path == str(tmp_path / "ck" / "last.ckpt") and resumed.global_step == 5
    # its ModelCheckpoint found last.ckpt there and wrote its own last as last-v1.ckpt: the newest
    assert last_checkpoint(tmp_path / "ck") == str(tmp_path / "ck" / "last-v1.ckpt")


def test_last_checkpoint_is_the_newest_committed_last(tmp_path: Path) -> None:
    io = ZeroStallCheckpointIO()
    assert last_checkpoint(tmp_path / "nothing-yet") is None
    io.save_checkpoint({"global_step": 2}, tmp_path / "last-v1.ckpt")
    io.save_checkpoint({"global_step": 3}, tmp_path / "epoch=0-step=3.ckpt")
    io.save_checkpoint({"global_step": 1}, tmp_path / "last.ckpt")  # the newest last, whatever its name
    (tmp_path / "last-v2.ckpt").mkdir()  # a save that never committed (killed before its manifest)
    assert last_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 5}, tmp_path / "last-v1.ckpt")  # ModelCheckpoint's second run in one folder
    assert last_checkpoint(tmp_path) == str(tmp_path / "last-v1.ckpt")
    io.save_checkpoint({"global_step": 4}, tmp_path / "final.ckpt")
    assert last_checkpoint(tmp_path, name="final") == str(tmp_path / "final.ckpt")
    io.save_checkpoint({"global_step": 6}, tmp_path / "last-epoch=2.ckpt")  # CHECKPOINT_NAME_LAST = "last-{epoch}"
    assert last_checkpoint(tmp_path) == str(tmp_path / "last-epoch=2.ckpt")  # as Lightning's "last" finds it


def test_an_asynchronous_first_save_makes_its_folder_before_it_returns(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_last="link")`` links last.ckpt into the folder of the checkpoint just
    saved once the save returns (TorchCheckpointIO makes it then); an asynchronous save made it
    later, in the background, and the first link failed (FileNotFoundError), ending training."""
    io = ZeroStallCheckpointIO(asynchronous=True)
    folder = tmp_path / "new" / "checkpoints"
    io.save_checkpoint({"w": torch.ones(2), "global_step": 2}, folder / "epoch=0-step=2.ckpt")
    os.symlink("epoch=0-step=2.ckpt", folder / "last.ckpt")  # what Lightning does next, at once
    io.teardown()
    assert io.load_checkpoint(folder / "last.ckpt")["global_step"] == 2



@pytest.mark.parametrize("asynchronous,exchange", [(False, True), (True, True), (False, False)])
def test_a_save_over_lightnings_own_file_replaces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     asynchronous: bool, exchange: bool) -> None:
    """A run switched to the plugin found last.ckpt, a file of Lightning's own checkpointing, and
    its first save over it failed ("Not a directory"): training died. (``exchange=False``: a file
    system without an atomic exchange.)"""
    if not exchange:
        monkeypatch.setattr(staging, "_exchange", lambda a, b: False)
    TorchCheckpointIO().save_checkpoint({"w": torch.zeros(3)}, tmp_path / "last.ckpt")
    io = ZeroStallCheckpointIO(asynchronous=asynchronous)
    io.save_checkpoint({"w": torch.ones(3), "global_step": 7}, tmp_path / "last.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["w"], torch.ones(3))
    io.teardown()
    assert os.listdir(tmp_path) == ["last.ckpt"] and zs.verify(str(tmp_path / "last.ckpt")) > 0


def test_a_first_save_killed_half_way_leaves_nothing_lightning_would_resume_from(tmp_path: Path) -> None:
    """Its folder was written in place: Lightning's lookup of "last" (any name with "last" in it)
    picked the uncommitted last.ckpt, and every restart failed loading it."""
    script = ("import os, sys, torch, zerostall as zs\n"
              "from zerostall.integrations.lightning import ZeroStallCheckpointIO\n"
              "io = ZeroStallCheckpointIO(save=zs.SaveOptions(before_commit=lambda: os._exit(9)))\n"
              "io.save_checkpoint({'w': torch.ones(3)}, sys.argv[1])\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "last.ckpt")], timeout=120)
    assert done.returncode == 9
    assert [n for n in os.listdir(tmp_path) if "last" in n] == [] and last_checkpoint(tmp_path) is None
    io = ZeroStallCheckpointIO()
    io.save_checkpoint({"w": torch.full((3,), 2.0)}, tmp_path / "last.ckpt")  # the next run's first save
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["w"], torch.full((3,), 2.0))
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_staging_folders_left_by_killed_saves_are_removed_by_the_next_run(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A top-k save killed before its commit left its hidden staging folder, and top-k names are
    never saved again: every crash left one (a whole checkpoint's bytes) for good. The next run's
    first save there removes those; one that committed but was never moved into place is kept, and named."""
    script = ("import os, sys, torch, zerostall as zs\n"
              "from zerostall.integrations.lightning import ZeroStallCheckpointIO\n"
              "io = ZeroStallCheckpointIO(save=zs.SaveOptions(before_commit=lambda: os._exit(9)))\n"
              "io.save_checkpoint({'w': torch.ones(3)}, sys.argv[1])\n")
    for name in ("epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt"):  # the second run's save removes the first's
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], timeout=120)
        assert done.returncode == 9
        assert os.listdir(tmp_path) == [os.path.basename(staging.staging_path(str(tmp_path / name)))]
    unplaced = staging.staging_path(str(tmp_path / "epoch=2-step=15.ckpt"))
    zs.save({"w": torch.zeros(3)}, unplaced)  # committed, the run killed before the move
    io = ZeroStallCheckpointIO()
    with caplog.at_level("WARNING", logger=staging.__name__):
        io.save_checkpoint({"w": torch.full((3,), 2.0)}, tmp_path / "epoch=3-step=20.ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted(["epoch=3-step=20.ckpt", os.path.basename(unplaced)])
    assert unplaced in caplog.text and zs.verify(unplaced) > 0


KILLED_BEFORE_COMMIT = ("import os, sys, torch, zerostall as zs\n"
                        "from zerostall.integrations.lightning import ZeroStallCheckpointIO\n"
                        "io = ZeroStallCheckpointIO(asynchronous=sys.argv[2] == 'async',\n"
                        "                           save=zs.SaveOptions(before_commit=lambda: os._exit(9)))\n"
                        "io.save_checkpoint({'w': torch.ones(3)}, sys.argv[1])\n"
                        "io.wait()\n")


def test_an_asynchronous_save_killed_before_its_commit_leaves_nothing_after_the_next_runs_first_save(
        tmp_path: Path) -> None:
    """The folder an asynchronous save makes at its name before it returns (for a link Lightning may
    make to it) stayed empty for good when the run was killed before the commit."""
    done = subprocess.run([sys.executable, "-c", KILLED_BEFORE_COMMIT, str(tmp_path / "epoch=1-step=8.ckpt"), "async"],
                          timeout=120)
    assert done.returncode == 9
    staged = os.path.basename(staging.staging_path(str(tmp_path / "epoch=1-step=8.ckpt")))
    assert sorted(os.listdir(tmp_path)) == sorted(["epoch=1-step=8.ckpt", staged])
    ZeroStallCheckpointIO(asynchronous=True).save_checkpoint({"w": torch.zeros(3)}, tmp_path / "epoch=2-step=12.ckpt")
    assert os.listdir(tmp_path) == ["epoch=2-step=12.ckpt"]


def test_an_empty_stand_in_under_another_last_name_names_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    """``ModelCheckpoint.CHECKPOINT_NAME_LAST = "latest"``: the killed asynchronous save's empty
    folder was what Lightning's lookup found, and loading it said only that no checkpoint was there."""
    ZeroStallCheckpointIO().save_checkpoint({"w": torch.ones(2), "global_step": 4}, tmp_path / "epoch=0-step=4.ckpt")
    done = subprocess.run([sys.executable, "-c", KILLED_BEFORE_COMMIT, str(tmp_path / "latest.ckpt"), "async"],
                          timeout=120)
    assert done.returncode == 9 and os.listdir(tmp_path / "latest.ckpt") == []
    with pytest.raises(zs.CheckpointNotFoundError, match=r"latest\.ckpt holds no committed checkpoint.*resume from "
                                                         r".*epoch=0-step=4\.ckpt \(step 4\)"):
        ZeroStallCheckpointIO().load_checkpoint(tmp_path / "latest.ckpt")


def test_a_model_parallel_run_removes_what_killed_saves_left(tmp_path: Path) -> None:
    """``ZeroStallModelParallelStrategy`` never swept: a staging folder (a whole checkpoint's
    bytes) left by a save killed before its commit stayed for good."""
    (tmp_path / "ck").mkdir()
    done = subprocess.run([sys.executable, "-c", KILLED_BEFORE_COMMIT, str(tmp_path / "ck" / "epoch=9-step=99.ckpt"),
                           "sync"], timeout=120)
    assert done.returncode == 9 and [n for n in os.listdir(tmp_path / "ck") if n.startswith(staging.STAGING)]
    run = job(tmp_path, "first", "zerostall", 1, "model-parallel", folder="ck")
    assert not [n for n in run["kept"] if n.startswith(staging.STAGING)] and "last.ckpt" in run["kept"]


def test_a_last_link_to_an_asynchronous_save_that_never_committed_is_not_passed_over(tmp_path: Path) -> None:
    """``save_last="link"``, the run killed before the asynchronous save that last.ckpt links to
    committed: the link pointed at nothing, which Lightning's ``ckpt_path="last"`` passes over (it
    keeps only paths that exist), so the next run started afresh beside a committed checkpoint. Now
    it points at the save's folder, and loading it says what to resume from."""
    script = ("import os, sys, torch, zerostall as zs\n"
              "from zerostall.integrations.lightning import ZeroStallCheckpointIO\n"
              "io = ZeroStallCheckpointIO(asynchronous=True)\n"
              "d = sys.argv[1]\n"
              "io.save_checkpoint({'w': torch.ones(2), 'global_step': 2}, d + '/epoch=0-step=2.ckpt')\n"
              "io.wait()\n"
              "io.save_checkpoint({'w': torch.ones(2), 'global_step': 4}, d + '/epoch=0-step=4.ckpt',\n"
              "                   storage_options=zs.SaveOptions(before_commit=lambda: os._exit(9)))\n"
              "os.symlink('epoch=0-step=4.ckpt', d + '/last.ckpt')  # what ModelCheckpoint does once it returns\n"
              "io.wait()\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=120)
    assert done.returncode == 9
    assert os.path.exists(tmp_path / "last.ckpt")  # Lightning's "last" lookup keeps it
    with pytest.raises(zs.CheckpointNotFoundError, match=r"epoch=0-step=4.ckpt, which holds no committed checkpoint"
                       r".*resume from .*epoch=0-step=2.ckpt \(step 2\)"):
        ZeroStallCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")


def test_a_last_link_to_a_save_that_never_committed_names_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    """``save_last="link"`` links last.ckpt to a top-k checkpoint as soon as its asynchronous save
    returns; a run stopped before that save committed left a link to nothing, and resuming from
    "last" failed without saying what could be resumed from."""
    io = ZeroStallCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2), "global_step": 4}, tmp_path / "epoch=0-step=4.ckpt")
    os.symlink("epoch=0-step=8.ckpt", tmp_path / "last.ckpt")
    with pytest.raises(zs.CheckpointNotFoundError, match=r"epoch=0-step=8.ckpt, which holds no committed checkpoint"
                       r".*resume from .*epoch=0-step=4.ckpt \(step 4\)"):
        io.load_checkpoint(tmp_path / "last.ckpt")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_to_a_link_replaces_the_link_not_the_checkpoint_it_names(tmp_path: Path, asynchronous: bool) -> None:
    """``save_last="link"``, resumed: Lightning's first save of last.ckpt went through the link into
    the best checkpoint it named, which then silently held the newest state."""
    io = ZeroStallCheckpointIO(asynchronous=asynchronous)
    io.save_checkpoint({"w": torch.ones(2), "global_step": 8}, tmp_path / "epoch=1-step=8.ckpt")
    io.wait()
    os.symlink("epoch=1-step=8.ckpt", tmp_path / "last.ckpt")
    io.save_checkpoint({"w": torch.zeros(2), "global_step": 12}, tmp_path / "last.ckpt")
    io.teardown()
    assert io.load_checkpoint(tmp_path / "epoch=1-step=8.ckpt")["global_step"] == 8
    assert not os.path.islink(tmp_path / "last.ckpt") and io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 12
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=8.ckpt", "last.ckpt"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_over_a_folder_that_is_not_a_checkpoint_is_refused_and_deletes_nothing(
        tmp_path: Path, asynchronous: bool) -> None:
    """``trainer.save_checkpoint(callback.dirpath)``: the folder, taken for a save that never
    committed, was deleted with the checkpoints and files in it to make room."""
    io = ZeroStallCheckpointIO(asynchronous=asynchronous)
    folder = tmp_path / "checkpoints"
    io.save_checkpoint({"w": torch.ones(2)}, folder / "epoch=0-step=4.ckpt")
    io.wait()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(zs.CheckpointError, match=r"checkpoints is a folder that is not a zerostall checkpoint.*"
                                                 r"notes\.txt.*save under another name"):
        io.save_checkpoint({"w": torch.zeros(2)}, folder)
    io.teardown()
    assert sorted(os.listdir(folder)) == ["epoch=0-step=4.ckpt", "notes.txt"]
    assert torch.equal(io.load_checkpoint(folder / "epoch=0-step=4.ckpt")["w"], torch.ones(2))


# -- paths Lightning hands over ---------------------------------------------------------------------
def test_links_and_lightnings_own_files_are_removed_as_files_and_loaded_with_torch(tmp_path: Path) -> None:
    io = ZeroStallCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "epoch=0-step=1.ckpt")
    os.symlink("epoch=0-step=1.ckpt", tmp_path / "last.ckpt")  # ModelCheckpoint(save_last="link")
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["w"], torch.ones(2))
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert not os.path.lexists(tmp_path / "last.ckpt") and zs.verify(str(tmp_path / "epoch=0-step=1.ckpt")) > 0
    TorchCheckpointIO().save_checkpoint({"w": torch.zeros(3)}, tmp_path / "torch.ckpt")  # from before the plugin
    assert torch.equal(io.load_checkpoint(tmp_path / "torch.ckpt")["w"], torch.zeros(3))
    io.remove_checkpoint(tmp_path / "torch.ckpt")
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")  # already gone is not an error
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=1.ckpt"]


def test_saving_again_replaces_and_loads_move_tensors_where_asked(tmp_path: Path) -> None:
    io = ZeroStallCheckpointIO(save=zs.SaveOptions(fsync=False))
    shared = torch.ones(2)
    io.save_checkpoint({"a": shared, "b": shared}, tmp_path / "last.ckpt")
    io.save_checkpoint({"a": shared * 2, "b": shared * 3}, tmp_path / "last.ckpt")  # last.ckpt, every save
    loaded = io.load_checkpoint(str(tmp_path / "last.ckpt"), map_location="cpu")
    assert torch.equal(loaded["a"], shared * 2) and torch.equal(loaded["b"], shared * 3)
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint(tmp_path / "last.ckpt", map_location=lambda storage, loc: storage)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"a": shared}, tmp_path / "x.ckpt", storage_options={"fsync": False})
    with pytest.raises(ValueError, match="asynchronous"):
        LightningOptions(asynchronous="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="did you mean 'allow_pickle'"):
        ZeroStallCheckpointIO(allow_pickles=True)
    with pytest.raises(ValueError, match="synchronously"):
        ZeroStallModelParallelStrategy(options=LightningOptions(asynchronous=True))
    with pytest.raises(ValueError, match="always saves sharded"):
        ZeroStallModelParallelStrategy(save_distributed_checkpoint=False)
    assert isinstance(ZeroStallModelParallelStrategy().checkpoint_io, ZeroStallCheckpointIO)  # removals are ours


@pytest.mark.parametrize("asynchronous", [False, True])
def test_saves_loads_and_removals_on_s3(s3_url: str, asynchronous: bool) -> None:
    io = ZeroStallCheckpointIO(asynchronous=asynchronous)
    io.save_checkpoint({"state_dict": OrderedDict(w=torch.ones(3)), "global_step": 1}, f"{s3_url}/epoch=0-step=1.ckpt")
    io.save_checkpoint({"state_dict": OrderedDict(w=torch.zeros(3)), "global_step": 2}, f"{s3_url}/last.ckpt")
    io.save_checkpoint({"state_dict": OrderedDict(w=torch.full((3,), 2.0)), "global_step": 3}, f"{s3_url}/last.ckpt")
    io.remove_checkpoint(f"{s3_url}/epoch=0-step=1.ckpt")
    loaded = io.load_checkpoint(f"{s3_url}/last.ckpt")
    assert type(loaded["state_dict"]) is OrderedDict and torch.equal(loaded["state_dict"]["w"], torch.full((3,), 2.0))
    io.teardown()
    assert not storage_for(f"{s3_url}/epoch=0-step=1.ckpt").exists()  # no object left under it
    assert last_checkpoint(s3_url) == f"{s3_url}/last.ckpt"  # ckpt_path="last" does not look on s3://
    assert zs.verify(f"{s3_url}/last.ckpt") > 0
    root = storage_for(s3_url)
    root.put("epoch=0-step=0.ckpt", b"a file of Lightning's own TorchCheckpointIO, from before the plugin")
    io.remove_checkpoint(f"{s3_url}/epoch=0-step=0.ckpt")  # top-k drops it: it was left in place
    assert "epoch=0-step=0.ckpt" not in root.list()
