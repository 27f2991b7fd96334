"""zerostall under torchtitan (``pip install 'zerostall[torchtitan]'``, tested with torchtitan 0.3.0):
``ZeroStallCheckpointManager.Config(...)`` in a torchtitan config's ``checkpoint`` field makes its
trainer save and load zerostall checkpoints (asynchronous, verified, retained, local or ``s3://``)."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torchtitan") is None:
    raise ImportError("zerostall.integrations.torchtitan needs torchtitan: pip install 'zerostall[torchtitan]'")

from .manager import ZeroStallCheckpointManager

__all__ = ["ZeroStallCheckpointManager"]
