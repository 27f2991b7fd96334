"""zerostall under Lightning (``pip install zerostall[lightning]``):
``Trainer(plugins=[ZeroStallCheckpointIO()])`` makes the Trainer's checkpoints (``ModelCheckpoint``'s
top-k and ``last``, ``trainer.save_checkpoint``, ``ckpt_path=`` resumes) zerostall checkpoints;
``ZeroStallModelParallelStrategy`` does the same for the sharded checkpoints of FSDP2 / tensor
parallel training, which bypass the CheckpointIO."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("lightning") is None:
    raise ImportError("zerostall.integrations.lightning needs Lightning: pip install 'zerostall[lightning]'")

from .checkpoint_io import LightningOptions, ZeroStallCheckpointIO, last_checkpoint
from .model_parallel import ZeroStallModelParallelStrategy

__all__ = ["LightningOptions", "ZeroStallCheckpointIO", "ZeroStallModelParallelStrategy", "last_checkpoint"]
