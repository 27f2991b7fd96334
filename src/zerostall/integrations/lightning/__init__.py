"""zerostall under Lightning (``pip install zerostall[lightning]``):
``Trainer(plugins=[ZeroStallCheckpointIO()])`` makes the Trainer's checkpoints (``ModelCheckpoint``'s
top-k and ``last``, ``trainer.save_checkpoint``, ``ckpt_path=`` resumes) zerostall checkpoints."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("lightning") is None:
    raise ImportError("zerostall.integrations.lightning needs Lightning: pip install 'zerostall[lightning]'")

from .checkpoint_io import LightningOptions, ZeroStallCheckpointIO, last_checkpoint

__all__ = ["LightningOptions", "ZeroStallCheckpointIO", "last_checkpoint"]
