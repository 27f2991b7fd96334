"""Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel: DTensor weights) with sharded
zerostall checkpoints.

That strategy saves and loads by itself on every rank (DCP plus a pickle of the rest on rank 0),
never through a ``CheckpointIO``; this subclass makes its checkpoints zerostall checkpoints
instead: one collective save, each rank writing its shards of the weights and of the
optimizer state, committed once; a load reshards from any saved layout. The rest of Lightning's
dict (loops, callbacks, schedulers...) is rank 0's, as in Lightning, stored by the policy of
:mod:`~zerostall.integrations.lightning.values` as one python value plus its few tensors, so a load
reads it without touching the weights.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ... import api
from ...collectives import Group
from ...errors import CheckpointError, CheckpointNotFoundError
from ...format.layout import MANIFEST_NAME
from ...loading.checkpoint import Checkpoint
from ...storage import storage_for
from . import values
from .checkpoint_io import LightningOptions, ZeroStallCheckpointIO, resume_instead
from .staging import place, staging_path


class ZeroStallModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints are sharded zerostall checkpoints
    (``Trainer(strategy=ZeroStallModelParallelStrategy(...))``; its arguments are
    ``ModelParallelStrategy``'s, plus ``options``). Saves are synchronous and always sharded: a
    consolidated copy is a read away (:meth:`ZeroStallCheckpointIO.load_checkpoint` on one
    process, or ``zerostall.export``). Checkpoints are removed through :class:`ZeroStallCheckpointIO`."""

    def __init__(self, *args: Any, options: LightningOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = LightningOptions.of(options)
        if self.options.asynchronous:
            raise ValueError("ZeroStallModelParallelStrategy saves synchronously: pass options without "
                             "asynchronous=True")
        if not self._save_distributed_checkpoint:
            raise ValueError("ZeroStallModelParallelStrategy always saves sharded (each rank its shards, one "
                             "checkpoint): drop save_distributed_checkpoint=False; ZeroStallCheckpointIO()."
                             "load_checkpoint(path) reads one back whole")
        self.checkpoint_io = ZeroStallCheckpointIO(self.options)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Save ``checkpoint`` (every rank calls this) as the zerostall checkpoint ``filepath``,
        replacing one there once this one commits. Where none is there yet (a first save, or
        Lightning's own checkpoint of a run that switched strategies), it is saved beside it first
        and moved into place once committed: a save killed half-way leaves nothing at ``filepath``."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options: pass "
                            "options=LightningOptions(save=SaveOptions(...)) to the strategy")
        path = self.broadcast(os.fspath(filepath))
        rest = dict(checkpoint)
        state: dict[str, Any] = {"state_dict": rest.pop("state_dict"),
                                 "optimizer_states": rest.pop("optimizer_states", [])}
        apart: dict[str, Any] = {}
        tree, objects = values.split(rest, allow_pickle=self.options.allow_pickle, apart=apart)  # refused everywhere
        # rank 0's rest on every rank (Lightning keeps rank 0's): replicated, written once
        state[values.REST], objects, state[values.REST_TENSORS] = self.broadcast((tree, objects, apart))
        step = rest.get("global_step")
        options = self.options.save_options()
        group = Group(None)
        staged = group.agree(lambda: (staging_path(path, lightnings_dcp=True) or "").encode()).decode() or None
        if staged is not None:  # what killed saves left beside it, as ZeroStallCheckpointIO sweeps
            group.agree(lambda: self.checkpoint_io._sweep(os.path.dirname(staged)) or b"")
        api.save(state, staged or path, options, step=step if type(step) is int else None,
                 metadata={values.METADATA_KEY: {"objects": objects, "layout": values.SHARDED}})
        if staged is not None:  # into place once committed, as ZeroStallCheckpointIO does; failing on every rank
            group.agree(lambda: place(staged, path, options.fsync, lightnings_dcp=True) or b"")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the weights (and, when fitting, the optimizer states) of the checkpoint at
        ``checkpoint_path`` into the model in place, resharded; return the rest of Lightning's dict.
        A checkpoint of Lightning's own (DCP or a file) is loaded by ``ModelParallelStrategy``."""
        path = self.broadcast(os.fspath(checkpoint_path))
        if "://" not in path and not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            if os.path.isdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
                raise CheckpointNotFoundError(f"{path} holds no committed checkpoint (a save there did not commit, "
                                              f"or it is no checkpoint at all): {resume_instead(path)}")
            return super().load_checkpoint(checkpoint_path, weights_only)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        assert self.model is not None and self.lightning_module is not None
        target: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
            target["optimizer_states"] = [get_optimizer_state_dict(self.model, o) for o in self.optimizers]
        options = self.options.load_options(weights_only)
        with Checkpoint(storage_for(path), options, process_group=None) as ck:
            stored = ck.metadata.get(values.METADATA_KEY)
            if not isinstance(stored, dict) or stored.get("layout") != values.SHARDED:
                raise CheckpointError(f"{ck.path} is not a sharded checkpoint of {type(self).__name__} (saved "
                                          "with save_distributed_checkpoint=False?): load it with "
                                          "ZeroStallCheckpointIO().load_checkpoint and the model's load_state_dict")
            ck.load(target, keys=list(target))
            objects = stored.get("objects", [])
            names = [data for _, kind, data in objects if kind == "tensor"]
            tensors = dict(zip(names, ck.read_many([(values.REST_TENSORS, n) for n in names]))) if names else {}
            rest = ck.read((values.REST,))
        set_model_state_dict(self.model, target["state_dict"],
                             options=StateDictOptions(strict=self.lightning_module.strict_loading))
        for optimizer, osd in zip(self.optimizers, target.get("optimizer_states", [])):
            set_optimizer_state_dict(self.model, optimizer, osd)
        return values.join(rest, objects, allow_pickle=options.allow_pickle, where=ck.path, apart=tensors)
