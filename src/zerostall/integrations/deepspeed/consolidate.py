"""The fp32 weights of a DeepSpeed checkpoint saved through :func:`attach`, consolidated from every
rank's ZeRO partitions as DeepSpeed's ``zero_to_fp32`` does it: its own code runs, reading the
files it asks for from the zerostall checkpoint, every block verified. DeepSpeed's
``load_checkpoint`` runs the same code under ZeRO-3 when it loads weights only (see
:func:`reading_through`)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import torch

from ...errors import CheckpointNotFoundError
from .engine import ZeroStallCheckpointEngine

_ONE_AT_A_TIME = threading.Lock()  # the files' reader is swapped into zero_to_fp32 for the call


def fp32_state_dict(checkpoint_dir: str, tag: str | None = None, *,
                    exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The model's consolidated fp32 state dict, by parameter name (ZeRO 1, 2 and 3), from tag
    ``tag`` of ``checkpoint_dir`` (None or ``"latest"``: the tag ``latest`` names); DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint`` for a checkpoint whose tags are zerostall's.
    Reads every rank's files in this process: no process group is needed."""
    from deepspeed.utils import zero_to_fp32

    ours = ZeroStallCheckpointEngine()
    opened = ours.open(os.fspath(checkpoint_dir), tag)
    if opened is None:
        raise CheckpointNotFoundError(f"no DeepSpeed checkpoint saved by zerostall in {checkpoint_dir}")
    try:
        session = ours.session
        assert session is not None
        with reading_through(ours):
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                session.view, tag=opened, exclude_frozen_parameters=exclude_frozen_parameters)
    finally:
        ours.close()


class _Torch:
    """``torch`` as ``zero_to_fp32`` sees it during the call: ``load`` reads through the engine."""

    def __init__(self, ours: ZeroStallCheckpointEngine) -> None:
        self._ours = ours

    def load(self, f: Any, map_location: Any = None, **_: Any) -> Any:
        return self._ours.load(os.fspath(f), map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def reading_through(ours: ZeroStallCheckpointEngine) -> Iterator[None]:
    """``zero_to_fp32`` reading its files through ``ours`` (its open session) for the duration."""
    from deepspeed.utils import zero_to_fp32

    with _ONE_AT_A_TIME:
        zero_to_fp32.torch = _Torch(ours)
        try:
            yield
        finally:
            zero_to_fp32.torch = torch
