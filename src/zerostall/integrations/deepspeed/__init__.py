"""zerostall under DeepSpeed (``pip install zerostall[deepspeed]``): ``attach(engine)`` after
``deepspeed.initialize`` makes ``engine.save_checkpoint``/``load_checkpoint`` write and read
zerostall checkpoints, NVMe-offloaded ZeRO state included."""

from __future__ import annotations

try:
    import deepspeed  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("zerostall.integrations.deepspeed needs DeepSpeed: pip install 'zerostall[deepspeed]'") from exc

from .attach import attach
from .engine import DeepSpeedOptions, ZeroStallCheckpointEngine

__all__ = ["attach", "DeepSpeedOptions", "ZeroStallCheckpointEngine"]
