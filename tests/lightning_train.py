"""A Lightning training run for tests/test_lightning.py: a tiny model fitted by a ``Trainer`` on the
CPU, in one process or on two gloo ranks that Lightning starts itself (``--devices 2``), under DDP
or, with ``--strategy model-parallel``, FSDP2 (``ModelParallelStrategy``, or zerostall's subclass).

``ModelCheckpoint`` keeps the top 2 epochs by training loss and ``last.ckpt``, saved through
``--io`` (``zerostall``, ``zerostall-async`` or Lightning's default ``torch``). Each rank writes
each step's loss to ``--out``.rankN as it goes. With ``--kill-at N`` every rank SIGKILLs itself
after step N (an asynchronous save in flight is let commit first); with ``--kill-at-epoch N``, as
epoch N starts (the saves of the epoch before may be in flight). With ``--resume`` the run
starts from ``ckpt_path="last"`` and rank 0 writes what it restored (weights, optimizer and
scheduler state) to ``--out``.restored; at the end rank 0 writes the final state to ``--out``.final.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                                     get_optimizer_state_dict)

from zerostall.integrations.lightning import ZeroStallCheckpointIO, ZeroStallModelParallelStrategy  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):  # FSDP2: each layer sharded over the ranks
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


class Record(L.Callback):
    """Writes each step's loss as it goes, the restored and final state, and kills at ``kill_at``."""

    def __init__(self, args: argparse.Namespace, io: ZeroStallCheckpointIO | None) -> None:
        self.args, self.io, self.losses = args, io, {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.args.resume:
            restored = state(trainer)  # collective under FSDP2
            if trainer.is_global_zero:
                torch.save(restored, f"{self.args.out}.restored")

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == self.args.kill_at_epoch:  # the last epoch's saves may be in flight
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: dict, batch: list,
                           batch_idx: int) -> None:
        self.losses[trainer.global_step] = outputs["loss"].item()
        with open(f"{self.args.out}.rank{trainer.global_rank}", "w") as f:
            json.dump(self.losses, f)
        if trainer.global_step == self.args.kill_at:
            if self.io is not None:
                self.io.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        final = state(trainer)
        if trainer.is_global_zero:
            torch.save(final, f"{self.args.out}.final")


def state(trainer: L.Trainer) -> dict:
    """Weights, optimizer and scheduler state, whole (gathered on rank 0 under FSDP2), and the step."""
    if isinstance(trainer.strategy, ModelParallelStrategy):
        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(trainer.strategy.model, options=whole)
        optimizer = get_optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], options=whole)
    else:
        weights = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}
        optimizer = trainer.optimizers[0].state_dict()
    return {"weights": weights, "optimizer": optimizer,
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step, "epoch": trainer.current_epoch}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--io", choices=("torch", "zerostall", "zerostall-async"), required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", choices=("ddp", "model-parallel"), default="ddp")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-at-epoch", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    model = Tiny()
    io = None if args.io == "torch" else ZeroStallCheckpointIO(asynchronous=args.io == "zerostall-async")
    strategy: object = "ddp" if args.devices > 1 else "auto"
    if args.strategy == "model-parallel":
        kind = ModelParallelStrategy if args.io == "torch" else ZeroStallModelParallelStrategy
        strategy, io = kind(data_parallel_size=args.devices, tensor_parallel_size=1), None
    keep = ModelCheckpoint(dirpath=args.dir, monitor="train_loss", save_top_k=2, save_last=True, every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                        max_epochs=args.epochs, callbacks=[keep, Record(args, io)], plugins=[io] if io else None,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(model, loader, ckpt_path="last" if args.resume else None)
    if torch.distributed.is_initialized():  # end as a well-kept job does: no process group left to exit
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
