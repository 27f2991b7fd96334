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

from ...collectives import ALONE, Group
from ...errors import CheckpointError, CheckpointNotFoundError
from . import swap
from .engine import ZeroStallCheckpointEngine

_ROUTES: dict[int, list[ZeroStallCheckpointEngine]] = {}  # by thread: the engines it reads through, innermost last
_GUARD = threading.Lock()  # over _ROUTES and the swap of zero_to_fp32's torch


def fp32_state_dict(checkpoint_dir: str, tag: str | None = None, *,
                    exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The model's consolidated fp32 state dict, by parameter name (ZeRO 1, 2 and 3), from tag
    ``tag`` of ``checkpoint_dir`` (None or ``"latest"``: the tag ``latest`` names); DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint`` for a checkpoint whose tags are zerostall's.
    Reads every rank's files in this process: no process group is needed."""
    from deepspeed.utils import zero_to_fp32

    ours = ZeroStallCheckpointEngine()
    ours.group = Group(ALONE)  # this process alone, also inside a job (rank 0 consolidating, say)
    opened = ours.open(os.fspath(checkpoint_dir), tag)
    if opened is None:
        raise CheckpointNotFoundError(f"no DeepSpeed checkpoint saved by zerostall in {checkpoint_dir}")
    try:
        session = ours.session
        assert session is not None
        if any(e.path[:2] == (swap.KEY, swap.OPTIMIZER) for e in session.checkpoint.manifest.entries):
            raise CheckpointError(f"checkpoint {opened} in {checkpoint_dir} holds optimizer state offloaded to NVMe: "
                                  "its fp32 partitions lie in the optimizer's swap files, which DeepSpeed's "
                                  "consolidation does not read; load the checkpoint into an engine instead")
        with reading_through(ours):
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                session.view, tag=opened, exclude_frozen_parameters=exclude_frozen_parameters)
    finally:
        ours.close()


class _Torch:
    """``torch`` as ``zero_to_fp32`` sees it while some thread reads through an engine: that
    thread's ``load`` reads through its innermost engine; every other call is torch's own."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def load(self, f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        routes = _ROUTES.get(threading.get_ident())
        if not routes:
            return self.real.load(f, map_location, *args, **kwargs)
        return routes[-1].load(os.fspath(f), map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@contextlib.contextmanager
def reading_through(ours: ZeroStallCheckpointEngine) -> Iterator[None]:
    """``zero_to_fp32`` reading its files through ``ours`` (its open session) in this thread for the
    duration; other threads' uses of it are left alone, and calls may nest."""
    from deepspeed.utils import zero_to_fp32

    me = threading.get_ident()
    with _GUARD:
        if not isinstance(zero_to_fp32.torch, _Torch):
            zero_to_fp32.torch = _Torch(zero_to_fp32.torch)
        _ROUTES.setdefault(me, []).append(ours)
    try:
        yield
    finally:
        with _GUARD:
            routes = _ROUTES[me]
            routes.pop()
            if not routes:
                del _ROUTES[me]
            if not _ROUTES and isinstance(zero_to_fp32.torch, _Torch):
                zero_to_fp32.torch = zero_to_fp32.torch.real
