"""zerostall under DeepSpeed (``pip install zerostall[deepspeed]``): ``attach(engine)`` after
``deepspeed.initialize`` makes ``engine.save_checkpoint``/``load_checkpoint`` write and read
zerostall checkpoints, NVMe-offloaded ZeRO state included."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("deepspeed") is None:
    raise ImportError("zerostall.integrations.deepspeed needs DeepSpeed: pip install 'zerostall[deepspeed]' "
                      "(with DS_BUILD_OPS=0 its ops are built just in time)")

from .attach import attach
from .consolidate import fp32_state_dict
from .engine import DeepSpeedOptions, ZeroStallCheckpointEngine

__all__ = ["attach", "DeepSpeedOptions", "ZeroStallCheckpointEngine", "fp32_state_dict"]
