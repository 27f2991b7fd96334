"""A Lightning ``CheckpointIO`` whose checkpoints are zerostall checkpoints.

Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only, so they run
without any collective (this process alone, even under DDP); ``load_checkpoint`` runs on every
rank that resumes, each reading on its own. The path Lightning names (``epoch=0-step=10.ckpt``,
``last.ckpt``) becomes a checkpoint directory, replaced atomically when saved again. Where no
committed checkpoint is there yet (a first save; Lightning's own file, from before the plugin), a
local save is written beside it under a hidden name and moved into place once committed, so that a
save killed half-way leaves nothing Lightning's lookup of ``"last"`` would pick (see :mod:`.staging`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ... import api
from ...collectives import ALONE
from ...errors import CheckpointError, CheckpointNotFoundError
from ...format.layout import MANIFEST_NAME
from ...loading.checkpoint import Checkpoint
from ...options import LoadOptions, SaveOptions, _Options
from ...roots.root import CheckpointRoot
from ...saving.asynchronous import AsyncSaver
from ...saving.handles import OneShot, SaveHandle
from ...storage import storage_for
from . import staging, values
from .staging import is_url, place, staging_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LightningOptions(_Options):
    """How :class:`ZeroStallCheckpointIO` saves and loads."""

    asynchronous: bool = False
    """Return from ``save_checkpoint`` once the state is captured (copied aside); the checkpoint
    commits in the background. The next save, a load, :meth:`ZeroStallCheckpointIO.wait` and
    Lightning's ``teardown`` wait for it; a removal Lightning asks for meanwhile runs after it commits."""
    allow_pickle: bool = False
    """Store (and load) with pickle the values neither our encoding nor the Lightning policy (see
    :mod:`zerostall.integrations.lightning.values`) holds; otherwise such a value is refused with
    the key that holds it. Lightning's own objects never need it. A load with ``weights_only=True``
    never unpickles."""
    save: SaveOptions | None = None
    """Options of the saves (threads, fsync, block size...); ``allow_pickle`` above wins, and a
    save always replaces what is at its path (Lightning rewrites ``last.ckpt`` at every save)."""
    load: LoadOptions | None = None
    """Options of the loads (threads, verify...); ``allow_pickle`` above wins."""

    def __post_init__(self) -> None:
        self._check_bools("asynchronous", "allow_pickle")
        self._check("save", self.save is None or isinstance(self.save, SaveOptions), "None or a SaveOptions")
        self._check("load", self.load is None or isinstance(self.load, LoadOptions), "None or a LoadOptions")

    def save_options(self, given: SaveOptions | None = None) -> SaveOptions:
        """The options of one save: ``given`` (Lightning's ``storage_options``), else :attr:`save`."""
        return dataclasses.replace(given or self.save or SaveOptions(), allow_pickle=self.allow_pickle, overwrite=True)

    def load_options(self, weights_only: bool | None) -> LoadOptions:
        """The options of one load: Lightning's ``weights_only=True`` never unpickles."""
        unpickle = self.allow_pickle and weights_only is not True
        return dataclasses.replace(self.load or LoadOptions(), allow_pickle=unpickle)


class ZeroStallCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through zerostall: ``Trainer(plugins=[ZeroStallCheckpointIO()])``.
    Saves are atomic and verified on load; ``asynchronous=True`` returns once the state is captured."""

    def __init__(self, options: LightningOptions | None = None, **overrides: Any) -> None:
        self.options = LightningOptions.of(options, overrides)
        self._saver: AsyncSaver | None = None  # made at the first asynchronous save (a Trainer may be pickled before)
        self._pending: SaveHandle | None = None
        self._placing: Future | None = None  # the save in flight's move into place, when it was staged
        self._removals: list[Future] = []
        self._swept: set[str] = set()  # the folders whose leftover staging folders are gone

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Save ``checkpoint`` as the zerostall checkpoint ``path`` (replacing one there once this
        one commits). ``storage_options``: None, or a :class:`SaveOptions` for this save."""
        if storage_options is not None and not isinstance(storage_options, SaveOptions):
            raise TypeError(f"storage_options must be None or a zerostall.SaveOptions, not "
                            f"{type(storage_options).__name__}")
        options = self.options.save_options(storage_options)
        tree, objects = values.split(checkpoint, allow_pickle=options.allow_pickle)
        step = checkpoint.get("global_step")
        kwargs: dict[str, Any] = dict(process_group=ALONE, step=step if type(step) is int else None,
                                      metadata={values.METADATA_KEY: {"objects": objects}})
        self._settle_removals()  # a removal into this path must not run after this save began
        self._settle_placing()  # the last save's move out of the staging folder this one may use
        target = _plain(path)
        staged = staging_path(target)
        if staged is not None:
            self._sweep(os.path.dirname(staged))
        if not self.options.asynchronous:
            api.save(tree, staged or target, options, **kwargs)
            if staged is not None:
                place(staged, target, options.fsync)
            return
        if not is_url(target):  # Lightning may link last.ckpt into the folder once this returns, as after
            # TorchCheckpointIO, and to the save's own folder: to a save that has not committed, not to nothing
            # (which ckpt_path="last" would pass over, starting afresh); the save is moved over it at its commit
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            if staged is not None and not os.path.lexists(target) and not _looked_up(target):
                os.mkdir(target)
        if self._saver is None:
            self._saver = AsyncSaver()
        handle = self._saver.save(tree, staged or target, options, **kwargs)
        assert handle is not None
        self._pending = handle
        if staged is not None:
            self._placing = placing = Future()
            handle.committed.add_done_callback(OneShot(functools.partial(_place_after, staged, target, options.fsync,
                                                                         placing)))
        handle.wait_staged()

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``, tensors on the CPU or on ``map_location`` (a
        device or its name), every block verified. A file written by Lightning's own
        ``TorchCheckpointIO`` is read by it (``torch.load``); a sharded checkpoint of
        :class:`ZeroStallModelParallelStrategy` comes back whole, its optimizer states keyed by
        parameter name (as ``torch.distributed.checkpoint.state_dict`` gives them)."""
        target = _plain(path)
        self.wait()  # a save in flight may be this very checkpoint (or replace Lightning's own file there)
        if not is_url(target) and os.path.isfile(target):
            return TorchCheckpointIO().load_checkpoint(target, map_location, weights_only)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"map_location must be None, a torch.device or a device name for a zerostall checkpoint "
                            f"(its tensors load on the CPU and are moved there), not {type(map_location).__name__}")
        if not is_url(target) and (os.path.islink(target) or os.path.isdir(target)) and \
                not os.path.isfile(os.path.join(target, MANIFEST_NAME)):
            raise _dangling(target) if os.path.islink(target) else CheckpointNotFoundError(
                f"{target} holds no committed checkpoint (a save there did not commit before the run stopped, or it "
                f"is no checkpoint at all): {resume_instead(target)}")
        options = self.options.load_options(weights_only)
        with Checkpoint(storage_for(target), options, process_group=ALONE) as ck:
            tree = ck.state()
            stored = ck.metadata.get(values.METADATA_KEY)
        device = torch.device(map_location) if map_location is not None else None
        move = None if device is None or device.type == "cpu" else functools.partial(torch.Tensor.to, device=device)
        objects = stored.get("objects", []) if isinstance(stored, dict) else []  # none: saved by zs.save itself
        if isinstance(stored, dict) and stored.get("layout") == values.SHARDED:  # whole tensors, names for keys
            rest = values.join(tree.pop(values.REST, {}), objects, allow_pickle=options.allow_pickle, where=ck.path,
                               tensor=move, apart=tree.pop(values.REST_TENSORS, {}))
            return {**rest, **values.join(tree, [], allow_pickle=False, where=ck.path, tensor=move)}
        return values.join(tree, objects, allow_pickle=options.allow_pickle, where=ck.path, tensor=move)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint ``path`` (its manifest first, so it never looks whole half-way).
        After an asynchronous save, the removal runs once that save has committed (the replacement
        is durable before anything is deleted); if that save failed, ``path`` is kept."""
        target = _plain(path)
        if self._pending is None:
            _remove(target)
            return
        removal: Future = Future()
        self._pending.committed.add_done_callback(OneShot(functools.partial(_remove_after, target, removal)))
        if removal.done():  # that save was done: removed (or kept) at once
            removal.result()
        else:
            self._removals.append(removal)

    def wait(self) -> None:
        """Block until the asynchronous save in flight has committed and the removals queued behind
        it are done; raises what failed."""
        try:
            if self._saver is not None:
                self._saver.wait()
            self._settle_placing()
        finally:
            self._settle_removals()

    def teardown(self) -> None:
        """Finish the save in flight and the removals behind it, and free the capture buffers
        (Lightning calls this at the end of ``fit``, ``validate``, ``test``...)."""
        saver, self._saver, self._pending = self._saver, None, None
        try:
            if saver is not None:
                saver.close()
            self._settle_placing()
        finally:
            self._settle_removals()

    def _sweep(self, folder: str) -> None:
        """Once per folder: :func:`~.staging.sweep` it."""
        if folder not in self._swept:
            self._swept.add(folder)
            staging.sweep(folder)

    def _settle_placing(self) -> None:
        """Wait for the last staged save's move into place; raise if it failed."""
        placing, self._placing = self._placing, None
        if placing is not None:
            placing.result()

    def _settle_removals(self) -> None:
        """Wait for the queued removals; raise the first that failed."""
        removals, self._removals = self._removals, []
        futures.wait(removals)
        for removal in removals:
            removal.result()


def last_checkpoint(dirpath: Any, name: str = "last") -> str | None:
    """The newest committed ``last.ckpt`` (``name``: ``ModelCheckpoint``'s ``CHECKPOINT_NAME_LAST``)
    under ``dirpath``, or None: ``ckpt_path="last"`` for an ``s3://`` ``dirpath``, where Lightning's
    own lookup finds nothing. Matched as Lightning does: a ``.ckpt`` whose name begins with it
    (``last-v1.ckpt``, ``last-epoch=3.ckpt``). A save that never committed is skipped."""
    found = [i for i in CheckpointRoot(storage_for(_plain(dirpath))).checkpoints()
             if i.name.endswith(".ckpt") and i.name.startswith(name)]  # ModelCheckpoint._find_last_checkpoints' rule
    return max(found, key=lambda i: i.created or 0.0).location if found else None


def _dangling(link: str) -> CheckpointNotFoundError:
    """The error for a link (``ModelCheckpoint(save_last="link")``) to no committed checkpoint:
    Lightning links right after an asynchronous save returns, and the run stopped before that
    save committed. Names the newest committed checkpoint beside it, to resume from instead."""
    return CheckpointNotFoundError(
        f"{link} links to {os.readlink(link)}, which holds no committed checkpoint: its asynchronous save did not "
        f"commit before the run stopped; {resume_instead(link)}")


def resume_instead(path: str) -> str:
    """What to resume from instead of ``path``: the newest committed checkpoint beside it."""
    found = [i for i in CheckpointRoot(storage_for(os.path.dirname(os.path.abspath(path)))).checkpoints()
             if i.name.endswith(".ckpt")]
    newest = max(found, key=lambda i: (i.step if i.step is not None else -1, i.created or 0.0), default=None)
    return (f"resume from {newest.location} (step {newest.step}), the newest committed checkpoint there" if newest
            else "none there has committed")


def _place_after(staged: str, path: str, fsync: bool, placing: Future, committed: Future) -> None:
    """A done-callback of a staged save: move it into place once committed (a failed save is its own to raise)."""
    try:
        if committed.unseen_exception() is None:  # type: ignore[attr-defined]
            place(staged, path, fsync)
    except BaseException as exc:
        placing.set_exception(exc)
    else:
        placing.set_result(None)


def _remove_after(path: str, removal: Future, committed: Future) -> None:
    """A done-callback of the save in flight: remove ``path`` once that save committed."""
    try:
        if committed.unseen_exception() is None:  # type: ignore[attr-defined]
            _remove(path)
        else:
            log.warning("kept %s: the save that was to replace it failed", path)
    except BaseException as exc:
        removal.set_exception(exc)
    else:
        removal.set_result(None)


def _remove(path: str) -> None:
    """Delete checkpoint ``path``: a zerostall checkpoint, or a file (one of ``TorchCheckpointIO``,
    locally or on ``s3://``; a link of ``ModelCheckpoint(save_last="link")``). Already gone is not an error."""
    if not is_url(path) and (os.path.islink(path) or os.path.isfile(path)):
        os.remove(path)
        return
    parent, name = path.rstrip("/").rsplit("/", 1) if is_url(path) else os.path.split(os.path.abspath(path))
    root = CheckpointRoot(storage_for(parent))
    if is_url(path) and name in root.storage.list():  # an object: Lightning's own file, written through fsspec
        root.storage.delete(name)
        return
    if not root.delete(name):
        raise CheckpointError(f"checkpoint {path} was not wholly deleted (its manifest is gone, so it no longer "
                              "loads): delete what is left there by hand")
    log.debug("removed checkpoint %s", path)


def _looked_up(path: str) -> bool:
    """Whether Lightning's lookups (``ckpt_path="last"``, ``hpc_ckpt_``) may take ``path`` (by its
    name), so that no folder of a save that has not committed may lie there. (A ``CHECKPOINT_NAME_LAST``
    of another word is not known here: its stand-in is refused on load, naming what to resume from.)"""
    name = os.path.basename(path)
    return "last" in name or name.startswith("hpc_ckpt_")  # Lightning's test for "last": the word in the name


def _plain(path: Any) -> str:
    """``path`` as a string, a ``file://`` URL as its local path."""
    text = os.fspath(path)
    return text.removeprefix("file://") if text.startswith("file://") else text

