"""Install zerostall on a DeepSpeed engine after ``deepspeed.initialize``: the checkpoint engine,
and the engine's own ``save_checkpoint``/``load_checkpoint`` wrapped on the instance (DeepSpeed's
source is not patched), so that the user's calls stay as they are."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, Iterator

import torch

from ...errors import CheckpointError
from . import swap
from .consolidate import reading_through
from .engine import DeepSpeedOptions, ZeroStallCheckpointEngine
from .swap import SwapFolders

log = logging.getLogger(__name__)


def attach(engine: Any, options: DeepSpeedOptions | None = None, **overrides: Any) -> ZeroStallCheckpointEngine:
    """Make ``engine`` (a ``DeepSpeedEngine``) save and load its checkpoints as zerostall checkpoints;
    returns the installed :class:`ZeroStallCheckpointEngine`. ``options`` and keyword overrides are
    :class:`DeepSpeedOptions` fields. Call it on every rank, before the first save or load."""
    if isinstance(engine.checkpoint_engine, ZeroStallCheckpointEngine):
        raise ValueError("zerostall is already attached to this DeepSpeed engine")
    ours = ZeroStallCheckpointEngine(getattr(engine, "_config", None), options, **overrides)
    previous = engine.checkpoint_engine
    if previous is not None and previous.is_decoupled():
        previous.cleanup()  # its writer process
    engine.checkpoint_engine = ours
    _decide_writers(engine, ours)
    save, load, destroy = engine.save_checkpoint, engine.load_checkpoint, engine.destroy
    engine.save_checkpoint = functools.wraps(save)(functools.partial(_save_checkpoint, engine, ours, save))
    engine.load_checkpoint = functools.wraps(load)(functools.partial(_load_checkpoint, engine, ours, load))
    engine.destroy = functools.wraps(destroy)(functools.partial(_destroy, ours, destroy))
    if ours.saver is not None:
        ours.saver.hold_steps(_torch_optimizers(engine.optimizer))
    return ours


def _destroy(ours: ZeroStallCheckpointEngine, original: Any) -> None:
    """DeepSpeed's ``destroy``, after the save in flight committed and the saver was closed (DeepSpeed
    cleans up only a decoupled checkpoint engine); a failure of that save is raised once destroyed."""
    try:
        ours.cleanup()
    finally:
        original()


def _decide_writers(engine: Any, ours: ZeroStallCheckpointEngine) -> None:
    """Which rank writes the model file is decided at set-up with the engine of then: decide again
    with ours, as DeepSpeed's ``_configure_checkpointing`` does."""
    from deepspeed.utils import groups

    rank = engine.local_rank if engine.use_node_local_storage() else groups._get_sequence_data_parallel_rank()
    engine.save_non_zero_checkpoint = bool(
        ours.is_data_parallel_writer(rank)
        or (engine.zero_optimization_partition_weights() and engine.is_first_weights_partition_group()))


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside DeepSpeed's wrappers, whose steps wait for a capture in flight."""
    found = []
    while optimizer is not None and len(found) < 8:
        if isinstance(optimizer, torch.optim.Optimizer):
            found.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def _save_checkpoint(engine: Any, ours: ZeroStallCheckpointEngine, original: Any, save_dir: str, tag: Any = None,
                     client_state: Any = None, save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """DeepSpeed's ``save_checkpoint``, its files gathered into one zerostall checkpoint; its copy
    of the NVMe swap folder (``copytree``) is skipped, the swap files saved with the rest."""
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    ours.begin(save_dir, tag, step=engine.global_steps, save_latest=save_latest, swap=SwapFolders.of(engine))
    try:
        with _without(engine, "zero_nvme_offload_optimizer", lambda: False):
            return original(save_dir, tag, client_state={} if client_state is None else client_state,
                            save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
    finally:
        ours.end()


def _load_checkpoint(engine: Any, ours: ZeroStallCheckpointEngine, original: Any, load_dir: str, tag: Any = None,
                     load_module_strict: bool = True, load_optimizer_states: bool = True,
                     load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                     custom_load_fn: Any = None) -> tuple[Any, Any]:
    """DeepSpeed's ``load_checkpoint`` (its arguments), once the asynchronous save in flight has
    committed (it may be the checkpoint asked for, and the load overwrites what it captures), between
    ``open`` and ``close``: swap files restored in place first (DeepSpeed then resets its swap buffers
    from them), every file read through the session. A session the caller opened is used, and left
    open. A checkpoint of DeepSpeed's own engine is loaded by that engine (see :func:`_load_deepspeeds_own`)."""
    kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                  load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                  custom_load_fn=custom_load_fn)
    ours.settle()
    held = ours.session
    if held is not None:
        opened: str | None = _held(held.load_dir, held.tag, load_dir, tag)
    elif (own := ours.deepspeeds_own(load_dir, None if tag is None else str(tag))) is not None:
        return _load_deepspeeds_own(engine, ours, original, load_dir, own, **kwargs)
    else:
        opened = ours.open(load_dir, None if tag is None else str(tag))
    if opened is None:
        return None, None
    try:
        session = ours.session
        assert session is not None
        # a load that fails on some ranks fails on all: no rank trains on from a checkpoint the others refused;
        # under ZeRO-3 also before DeepSpeed's own collective at the end of its load (a rank that failed before it
        # would never join it)
        with ours.group.failing_together(
                f"loading checkpoint {opened} from {load_dir} failed on {{failed}} other rank(s) (their errors name "
                "the file)" + ("; this rank's own tensors may hold what it loaded in place: load another checkpoint "
                               "before training on" if ours.options.in_place else ""), points=2) as files_read:
            epilogue = getattr(engine.optimizer, "checkpoint_event_epilogue", None)
            with (_without(engine.optimizer, "checkpoint_event_epilogue", lambda: (files_read(), epilogue())[1])
                  if epilogue is not None else contextlib.nullcontext()):
                path, client_state = _load_opened(engine, ours, original, load_dir, opened, session, kwargs)
        if path is not None:
            path = os.path.join(load_dir, opened, os.path.relpath(path, session.directory))
        return path, client_state
    finally:
        if held is None:
            ours.close()


def _held(held_dir: str, held_tag: str, load_dir: str, tag: Any) -> str:
    """The tag of the session the caller opened, when ``load_checkpoint(load_dir, tag)`` asks for
    it (``tag`` None or ``"latest"``: whatever was opened); else a :class:`CheckpointError` naming both."""
    if os.path.abspath(os.fspath(load_dir)) == os.path.abspath(held_dir) and (tag is None
                                                                               or str(tag) in ("latest", held_tag)):
        return held_tag  # a tag DeepSpeed is given as a number is its name as text, as open() takes it
    raise CheckpointError(f"load_checkpoint({os.fspath(load_dir)!r}, {tag!r}) while checkpoint {held_tag!r} of "
                          f"{held_dir} is open: load that one, or close() it first; nothing was loaded")


def _load_opened(engine: Any, ours: ZeroStallCheckpointEngine, original: Any, load_dir: str, opened: str,
                 session: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The swap files restored in place, then DeepSpeed's load of tag ``opened`` through ``session``."""
    folders = SwapFolders.of(engine)
    if ours.options.in_place:
        session.into.update(_live_files(engine, session.view, opened, kwargs))
    optimizer = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
    if folders or any(e.path[:1] == (swap.KEY,) for e in session.checkpoint.manifest.entries):
        written = folders.restore(session.checkpoint, ours.group.rank, optimizer)
        log.info("restored %d bytes of offloaded state into %s", written, ", ".join(folders.folders.values()))
    with reading_through(ours):  # under ZeRO-3, a load of weights alone consolidates them with zero_to_fp32
        try:
            path, client_state = original(session.view, opened, **kwargs)
        except ValueError as exc:
            if optimizer or not engine.zero_nvme_offload_optimizer():
                raise
            raise CheckpointError(
                f"checkpoint {opened} in {load_dir}: DeepSpeed cannot load the weights alone of a ZeRO-3 "
                "checkpoint whose optimizer state was offloaded to NVMe (it rebuilds them from the optimizer's "
                "fp32 partitions, which lie in the swap files): load it whole (load_optimizer_states=True); "
                f"the optimizer's swap files were left as they were ({exc})") from exc
    if path is not None and engine.zero_nvme_offload_optimizer() and optimizer:
        _restore_optimizer_state(engine, ours.load(engine._get_zero_ckpt_name(session.view, opened)))
    return path, client_state


def _load_deepspeeds_own(engine: Any, ours: ZeroStallCheckpointEngine, original: Any, load_dir: str, tag: str,
                         **kwargs: Any) -> tuple[Any, Any]:
    """Resume from a checkpoint that DeepSpeed's own engine wrote (a run that switched to zerostall):
    DeepSpeed loads it with its ``torch.load`` engine, which unpickles, so only with ``allow_pickle``."""
    if not ours.options.allow_pickle:
        raise CheckpointError(
            f"checkpoint {tag} in {load_dir} was written by DeepSpeed's own engine, whose files are pickles: to "
            "resume from it, attach(engine, allow_pickle=True) (unpickling runs code: only for files you trust); "
            "the saves that follow are zerostall checkpoints")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    log.warning("loading %s/%s, a checkpoint of DeepSpeed's own engine, with that engine (no blocks to verify)",
                load_dir, tag)
    engine.checkpoint_engine = TorchCheckpointEngine(getattr(engine, "_config", None))
    try:
        return original(load_dir, tag, **kwargs)
    finally:
        engine.checkpoint_engine = ours


def _live_files(engine: Any, view: str, tag: str, load: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The files whose loads read into the engine's own tensors, each with the state dict that
    DeepSpeed would save in it now: the model file unless a ``custom_load_fn`` decides what of it
    goes where, and this rank's ZeRO optimizer file when it is loaded and its state is not swapped
    to NVMe (the swap files hold it then). ``load``: the keywords of ``load_checkpoint``."""
    directory = os.path.join(view, tag)
    into: dict[str, Callable[[], Any]] = {}
    if load.get("custom_load_fn") is None:
        into[os.path.relpath(engine._get_ckpt_name(view, tag), directory)] = \
            lambda: {"module": engine.module_state_dict()}
    optimizer = load.get("load_optimizer_states", True) and not load.get("load_module_only", False)
    if optimizer and engine.zero_optimization() and engine.optimizer is not None \
            and not engine.zero_nvme_offload_optimizer():
        into[os.path.relpath(engine._get_zero_ckpt_name(view, tag), directory)] = \
            lambda: {"optimizer_state_dict": engine.optimizer.state_dict()}
    return into


def _restore_optimizer_state(engine: Any, saved: Any) -> None:
    """With the optimizer swapped to NVMe, DeepSpeed reads the swap files back but skips the rest
    of the rank's optimizer file, so its optimizer starts again from empty state (Adam's moments
    zeroed, its ``step`` reset) and a resumed run drifts from an uninterrupted one. Give the
    optimizer its saved state: the values too small to swap as saved, and the swapped ones as
    tensors registered with the swapper (kept where it has them already: a rollback in the same
    process), which reads them from the restored files at the next step."""
    zero = engine.optimizer
    base, swapper = zero.optimizer, zero.optimizer_swapper
    zero._set_fp32_optimizer_param_groups()  # the base optimizer holds its parameters only around a step
    try:
        params = [p for group in base.param_groups for p in group["params"]]
        for index, state in saved["optimizer_state_dict"]["optimizer_state_dict"]["state"].items():
            param = params[index]
            info = swapper.swap_params_info.get(param.ds_id)
            live = base.state[param]
            known = {id(t) for t in info.get_compute_tensors()} if info is not None else set()
            swapped = []
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() == 0 and info is not None:
                    if id(live.get(key)) in known:
                        continue  # the swapper's already (a load in the same process): it reads the restored file
                    tensor = torch.empty(0, dtype=param.dtype)  # its data comes from its swap file
                    tensor.ds_id = f"{key}-{param.ds_id}"
                    live[key] = tensor
                    swapped.append(tensor)
                else:
                    live[key] = value
            if swapped and not info.has_state_tensors:
                info.add_state_tensors(swapped)
    finally:
        zero._clear_fp32_optimizer_param_groups()


@contextlib.contextmanager
def _without(engine: Any, name: str, replacement: Any) -> Iterator[None]:
    """``engine.name`` replaced on the instance for the duration."""
    setattr(engine, name, replacement)
    try:
        yield
    finally:
        delattr(engine, name)
