"""``ZeroStallCheckpointManager``: torchtitan's checkpoint-manager contract (``BaseCheckpointManager``,
torchtitan 0.3.0) over zerostall's ``CheckpointManager``, selected by a config's ``checkpoint`` field."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch
from torchtitan.components.checkpointer import (DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, BaseCheckpointManager,
                                                ModelWrapper)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from ... import api
from ...errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from ...format.layout import RNG_KEY
from ...manager import CheckpointManager
from ...options import LoadOptions
from ...roots.described import DAMAGE
from ...roots.retention import RetentionPolicy
from ...roots.root import step_tag
from .hf import export_hf, load_hf

log = logging.getLogger(__name__)


class ZeroStallCheckpointManager(BaseCheckpointManager):
    """torchtitan's trainer saves through this as through its DCP manager (same policy fields,
    same ``step-N`` numbering, ``load(step=-1)`` = the newest), into a zerostall root: checkpoints
    committed atomically and verified on load, saved in the background, the ``keep_latest_k``
    newest kept, on a local path or ``s3://``. Collective: every rank builds it and calls it."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint policy fields, plus how zerostall writes."""

        async_mode: Literal["disabled", "async"] = "async"
        """"async": ``save`` returns once the state is captured, the write and commit go on in the
        background (the trainer's ``maybe_wait_for_staging`` before the optimizer step waits for
        the capture only); "disabled": ``save`` returns once the checkpoint is committed."""

        fsync: bool = True
        """Flush each file to stable storage before the commit; False is faster but a power loss
        may lose checkpoints already reported committed."""

        allow_pickle: bool = False
        """Let ``initial_load_path`` name a PyTorch DCP checkpoint (torchtitan's own manager writes
        those): its metadata is a pickle, which can run code when read, so only one you trust."""

        hf_folder: str = "hf"
        """With ``last_save_in_hf``, where the final model's safetensors go (``<hf_folder>/step-N``),
        relative to the dump folder: outside ``folder``, which holds only zerostall checkpoints."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async"):
                raise ValueError(f"checkpoint.async_mode must be 'disabled' or 'async', not {self.async_mode!r}")
            if not self.hf_folder.strip():
                raise ValueError("The 'hf_folder' field cannot be empty.")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.hf_folder = filesystem.join(base_folder, config.hf_folder)
        self.sd_adapter = sd_adapter
        if (config.last_save_in_hf or config.initial_load_in_hf) and sd_adapter is None:
            raise UnsupportedValueError("checkpoint.last_save_in_hf / initial_load_in_hf need the model's "
                                        "state_dict_adapter (sd_adapter), and this model has none")
        if config.initial_load_in_hf_quantized:
            raise UnsupportedValueError("checkpoint.initial_load_in_hf_quantized is not supported by "
                                        "ZeroStallCheckpointManager: load quantized weights with torchtitan's "
                                        "CheckpointManager, or dequantize them first")
        self.states = dict(states)
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.states = {k: v for k, v in self.states.items() if v is not None}
        self.manager = CheckpointManager(self.folder, keep_last=config.keep_latest_k or None,
                                         async_save=config.async_mode == "async", fsync=config.fsync,
                                         allow_pickle=config.allow_pickle,
                                         load_options=LoadOptions(allow_pickle=config.allow_pickle),
                                         rank_local_keys=(DATALOADER,))
        log.info("checkpoints are saved to and loaded from %s (zerostall)", self.folder)

    # -- saving --------------------------------------------------------------------------------
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        """As torchtitan's manager decides: every ``interval`` steps, the first step if asked, the last."""
        if self.config.load_only:
            return False
        return (curr_step == 1 and self.config.enable_first_step_checkpoint) or last_step \
            or curr_step % self.config.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save the training state as step ``curr_step``; the last step, when ``last_save_model_only``,
        only the model in ``export_dtype`` (and its safetensors, with ``last_save_in_hf``). The last
        step's save is waited for, and deletes no older checkpoint (``keep_latest_k`` as torchtitan's own)."""
        if not self._should_save(curr_step, last_step):
            return False
        if last_step:  # as torchtitan's own manager: the last step's save deletes no older checkpoint
            with self._keeping_all():
                if self.config.last_save_model_only:
                    self._save_model_only(curr_step)
                else:
                    self.manager.save(curr_step, self.states)
            self.save_future = None
            return True
        handle = self.manager.save(curr_step, self.states)
        if self.config.async_mode == "async":
            self.save_future = handle.committed
        return True

    @contextlib.contextmanager
    def _keeping_all(self) -> Iterator[None]:
        """Retention keeps every checkpoint for the saves inside, waited for (the saves before it
        run their rounds first, as they always did)."""
        self.manager.wait()
        policy, self.manager.policy = self.manager.policy, RetentionPolicy()
        try:
            yield
            self.manager.wait()
        finally:
            self.manager.policy = policy

    def _save_model_only(self, step: int) -> None:
        """The end of training: the model alone, cast; then its safetensors, once committed."""
        dtype = TORCH_DTYPE_MAP[self.config.export_dtype]
        model = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for k, v in self.states[MODEL].state_dict().items()}
        self.manager.save(step, {MODEL: model})
        self.manager.wait()
        if self.config.last_save_in_hf:
            export_hf(model, self.sd_adapter, filesystem.join(self.hf_folder, f"step-{step}"), self.manager.group)

    # -- loading -------------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Restore the checkpoint of ``step`` (-1: the newest committed, or the previous one if the
        newest is damaged; a missing ``step`` raises ``CheckpointNotFoundError``), else the
        ``initial_load_path``; False on a fresh start. As torchtitan's own manager: step 0 (a seed
        checkpoint) restores the model only, on any number of ranks; a later checkpoint of the model
        alone (``last_save_model_only``) cannot resume training and raises; ``exclude_from_loading``
        keys stay as they are. On another number of ranks there is no per-rank state to restore (the
        RNG states stay each rank's own), so the data loader must be excluded."""
        unknown = set(self.config.exclude_from_loading) - set(self.states)
        if unknown:
            raise UnsupportedValueError(f"checkpoint.exclude_from_loading names {sorted(unknown)}, which the "
                                        f"state does not hold (it holds {sorted(self.states)})")
        tag, passed = None if step == -1 else step_tag(step), []  # the damaged checkpoints passed over
        asked: set[str] = set()  # what their attempts may have loaded into (in place) before failing
        while True:
            try:
                ck = self.manager.open(tag)  # every rank agrees on the newest
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(f"checkpoint.load_step={step}: no checkpoint {tag} under {self.folder}; "
                                              "load_step=-1 loads the newest") from None
            if ck is None:
                return self._initial_load()
            with ck:
                keep = [MODEL] if ck.step == 0 else [k for k in self.states if k not in self.config.exclude_from_loading]
                try:
                    resharded = self._resharded(ck, keep)
                except CheckpointError as exc:
                    if not passed:
                        raise
                    raise CheckpointError(f"{passed[-1]}, and the one before it cannot be resumed from: {exc}") from exc
                name, at = ck.tag, ck.step
            if asked - set(keep):
                raise CheckpointError(f"{passed[-1]}; the checkpoint before it, {name}, cannot restore "
                                      f"{sorted(asked - set(keep))}, which that load may have filled in part: set "
                                      f"checkpoint.load_step={at} to resume from {name} in a new process")
            try:  # through the manager's restore on any number of ranks (the restored step kept from retention)
                restored = self.manager.restore({k: self.states[k] for k in keep}, name, fallback=False,
                                                keys=keep if resharded else keep + [RNG_KEY])
            except DAMAGE as exc:  # on every rank alike: the one before it, with its own rules (step 0, resharded)
                if step != -1 or at is None:
                    raise
                passed.append(f"{name} is damaged ({dict(self.manager.last_restore.fallbacks).get(name, exc)})")
                asked |= set(keep)
                tag = self._before(at)
                if tag is None:
                    raise CorruptCheckpointError(f"every checkpoint under {self.folder} is damaged: "
                                                 f"{'; '.join(passed)}") from exc
                log.warning("%s: loading the checkpoint before it, %s", passed[-1], tag)
                continue
            log.info("restored %s of step %s from %s", ", ".join(keep), restored, self.folder)
            return True

    def _resharded(self, ck: Any, keep: list[str]) -> bool:
        """Whether ``keep`` (state keys) loads from ``ck`` without per-rank state (saved by another
        number of ranks, or the model alone asked for); raises where training cannot resume so."""
        if keep != [MODEL] and all(k.split(".")[0] in (MODEL, RNG_KEY) for k in ck.entries):
            raise CheckpointError(f"{ck.path} holds the model alone (checkpoint.last_save_model_only, the end of "
                                  "a run), so training cannot resume from it: set checkpoint.load_step to an "
                                  f"earlier step that holds the training state (`zerostall ls {self.folder}` "
                                  "lists them), or train a new run from it with checkpoint.initial_load_path "
                                  "and initial_load_model_only")
        resharded = keep == [MODEL] or ck.manifest.world_size != self.manager.group.size
        if resharded and DATALOADER in keep:
            raise CheckpointError(f"{ck.path} was saved by {ck.manifest.world_size} rank(s) and is loaded on "
                                  f"{self.manager.group.size}: each rank's data-loader position cannot be given "
                                  "to these ranks one to one; add 'dataloader' to checkpoint.exclude_from_loading "
                                  "to resume the rest (each rank's data loader and RNG states then start as they "
                                  "are)")
        return resharded

    def _before(self, step: Any) -> str | None:
        """The newest committed checkpoint of a step below ``step``, the same on every rank (None: none)."""
        def newest() -> bytes:
            below = [t for t, record in self.manager.checkpoints() if 0 <= record.step < step]  # step-less: -1
            return (below[-1] if below else "").encode()

        return self.manager.group.agree(newest).decode() or None

    def _initial_load(self) -> bool:
        """The first run's load: ``initial_load_path`` (a zerostall or DCP checkpoint, or Hugging
        Face safetensors with ``initial_load_in_hf``), else the model's HF assets with
        ``initial_load_in_hf``; False when there is none."""
        path = self.config.initial_load_path
        if self.config.initial_load_in_hf:
            path = path or getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise UnsupportedValueError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path "
                                            "or the model's hf_assets_path")
            load_hf(self.states[MODEL], self.sd_adapter, path, self.manager.group)
            return True
        if not path:
            log.info("no checkpoint under %s and no initial_load_path: a fresh start", self.folder)
            return False
        keep = [MODEL] if self.config.initial_load_model_only else \
            [k for k in self.states if k not in self.config.exclude_from_loading]
        model = self.states[MODEL]
        with api.open(path, process_group=self.manager.process_group, allow_pickle=self.config.allow_pickle) as ck:
            if ck.manifest.foreign is None and any(name.split(".")[0] == MODEL for name in ck.entries):
                # ours, the model under "model" (not a DCP checkpoint imported as it was)
                self._resharded(ck, keep)
                ck.load({k: self.states[k] for k in keep}, keys=keep)
                return True
            # torchtitan's DCP layout: the model's keys at the top, beside "optimizer", "lr_scheduler"...
            flat = {**model.state_dict(), **{k: self.states[k] for k in keep if k != MODEL}}
            loaded = ck.load(flat, keys=list(flat))
        model.load_state_dict({k: loaded[k] for k in model.state_dict()})
        return True

    # -- waiting and closing -------------------------------------------------------------------
    def _maybe_wait_for_staging(self) -> None:
        self.manager.wait_staged()

    def _wait_for_saving(self) -> None:
        """Wait until the last save committed and its retention ran; raises what failed."""
        self.save_future = None
        self.manager.wait()

    def _close(self) -> None:
        self.manager.close()
