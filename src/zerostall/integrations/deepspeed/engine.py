"""A DeepSpeed ``CheckpointEngine`` whose tags are zerostall checkpoints, and :func:`attach`, which
installs it on an engine after ``deepspeed.initialize``.

Writing is DeepSpeed's ``create → save → commit``: ``save`` only collects the state dict of each
file DeepSpeed writes; ``commit`` writes them (and this rank's NVMe swap files) as one checkpoint,
committed once for all ranks, then points ``latest`` at it. Reading is ``open → load … → close``:
``open`` decides the tag once on rank 0, every rank opens that checkpoint, and each ``load`` reads
one file's entries from it, every block verified.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ... import api
from ...collectives import ALONE, Group
from ...errors import CheckpointError, CheckpointNotFoundError
from ...loading.checkpoint import Checkpoint
from ...options import LoadOptions, SaveOptions, _Options
from ...roots.root import LATEST_NAME, CheckpointRoot, typed_error, validate_tag
from ...saving.asynchronous import AsyncSaver
from ...saving.estimate import bytes_needed
from ...saving.handles import OneShot
from ...state import flatten, rank_local
from ...storage import storage_for
from . import space, swap, tags, values
from .swap import SwapFolders

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepSpeedOptions(_Options):
    """How :func:`attach` saves and loads DeepSpeed's checkpoints."""

    asynchronous: bool = False
    """Return from ``save_checkpoint`` once the state is captured; the checkpoint commits in the
    background and ``latest`` follows its commit. The next save, :meth:`ZeroStallCheckpointEngine.wait`
    and the end of the process wait for it. NVMe swap files are captured into host memory too."""
    allow_pickle: bool = False
    """Store (and load) with pickle the objects our encoding cannot hold; otherwise such an object
    is refused with the key that holds it. DeepSpeed's own objects never need it."""
    save: SaveOptions | None = None
    """Options of the saves (threads, fsync, block size...); ``allow_pickle`` above wins."""
    load: LoadOptions | None = None
    """Options of the loads (threads, verify...); ``allow_pickle`` above wins."""
    in_place: bool = True
    """Read this rank's optimizer file and the model file into the engine's own tensors where they
    match (key path, shape, dtype), which DeepSpeed then keeps: no second copy of the state in
    memory, no new pages to fault in. A load that fails part way may leave those tensors partly
    overwritten (its error says so): load another checkpoint before training on."""

    def __post_init__(self) -> None:
        self._check_bools("asynchronous", "allow_pickle", "in_place")
        self._check("save", self.save is None or isinstance(self.save, SaveOptions), "None or a SaveOptions")
        self._check("load", self.load is None or isinstance(self.load, LoadOptions), "None or a LoadOptions")

    @property
    def save_options(self) -> SaveOptions:
        """A tag saved again replaces its checkpoint (as DeepSpeed's files are replaced)."""
        return dataclasses.replace(self.save or SaveOptions(), allow_pickle=self.allow_pickle, overwrite=True)

    @property
    def load_options(self) -> LoadOptions:
        return dataclasses.replace(self.load or LoadOptions(), allow_pickle=self.allow_pickle)


@dataclass
class _Save:
    """The save between ``create`` and ``commit``: where, and the files DeepSpeed gave so far."""

    save_dir: str
    tag: str
    step: int
    save_latest: bool
    swap: SwapFolders
    files: dict[str, Any] = field(default_factory=dict)

    @property
    def directory(self) -> str:
        return os.path.join(self.save_dir, self.tag)


@dataclass
class _Session:
    """What ``open`` took: the checkpoint, and a directory that shows DeepSpeed its file names
    (empty files: every read comes back to :meth:`ZeroStallCheckpointEngine.load`)."""

    load_dir: str
    tag: str
    checkpoint: Checkpoint
    view: str
    into: dict[str, Callable[[], Any]] = field(default_factory=dict)
    """Per file name: the state dict DeepSpeed would save in it now, whose tensors that file's
    load reads into where they match (set by :func:`attach` with ``in_place``)."""

    @property
    def directory(self) -> str:
        return os.path.join(self.view, self.tag)


class ZeroStallCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine for zerostall checkpoints; install it with :func:`attach`."""

    def __init__(self, config_params: Any = None, options: DeepSpeedOptions | None = None, **overrides: Any) -> None:
        super().__init__(config_params)
        self.name = "ZeroStallCheckpointEngine"
        self.options = DeepSpeedOptions.of(options, overrides)
        self.saver = AsyncSaver() if self.options.asynchronous else None
        self.group = Group(None)
        self._save: _Save | None = None
        self._session: _Session | None = None
        self._latest: Future | None = None  # rank 0's update of ``latest`` after an asynchronous commit

    # -- writing: create → save → commit -------------------------------------------------------
    def begin(self, save_dir: str, tag: str, *, step: int, save_latest: bool, swap: SwapFolders) -> None:
        """Start the save of ``tag`` that DeepSpeed's ``create``/``save``/``commit`` calls then fill
        (called by the ``save_checkpoint`` that :func:`attach` installs)."""
        validate_tag(tag)
        self._save = _Save(os.fspath(save_dir), tag, step, save_latest, swap)

    def end(self) -> None:
        """Forget a save that DeepSpeed did not commit (it failed half-way)."""
        self._save = None

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._save is not None and (info.tag, os.fspath(info.save_dir)) != (self._save.tag, self._save.save_dir):
            raise CheckpointError(f"DeepSpeed creates {info.save_dir}/{info.tag} while "
                                  f"{self._save.directory} is being saved")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self._save is None or not _inside(path, self._save.directory):
            os.makedirs(path, exist_ok=exist_ok)  # the tag's directory is the checkpoint's, made by its save

    def save(self, state_dict: Any, path: str) -> None:
        if self._save is None:  # outside save_checkpoint (save_16bit_model): the torch file it promises
            torch.save(state_dict, path)
            return
        if not _inside(path, self._save.directory) or os.path.normpath(path) == os.path.normpath(self._save.directory):
            raise CheckpointError(f"DeepSpeed saves {path}, outside the checkpoint {self._save.directory} being saved")
        self._save.files[os.path.relpath(path, self._save.directory)] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        current, self._save = self._save, None
        if current is None:
            return True
        save_options = self.options.save_options
        failure = self._latest_failure()
        with self.group.failing_together(  # no rank waits for the others in the save's collectives
                f"checkpoint {current.directory} was not saved on any rank: {{failed}} other rank(s) could not "
                "prepare it (their errors say why: a value they cannot encode, or rank 0's failure to point latest "
                "at the checkpoint saved before)"):
            if failure is not None:  # rank 0's failure to point latest at the save before
                raise failure
            if tags.deepspeeds_own(current.save_dir, current.tag):
                raise CheckpointError(
                    f"{current.directory} is a checkpoint of DeepSpeed's own engine: zerostall does not save over it "
                    "(it would be lost if the save failed); save under another tag, or move it away first; nothing "
                    "was written")
            state = self._state(current)
            needed = bytes_needed(flatten(state).leaves, save_options.block_size, save_options.allow_pickle,
                                  self.group.size)
            free = space.free_space(current.save_dir)
        space.check_space(self.group, current.directory, needed, free)
        storage = CheckpointRoot(storage_for(current.save_dir)).child(current.tag)
        metadata = {"deepspeed": {"tag": current.tag}}
        if self.saver is None:
            api.save(state, storage, save_options, step=current.step, metadata=metadata)
            with self.group.failing_together(f"checkpoint {current.directory} committed, but rank 0 could not point "
                                             f"{current.save_dir}/latest at it (its error says why)"):
                self._point_latest(current)
            return True
        handle = self.saver.save(state, storage, save_options, step=current.step, metadata=metadata)
        assert handle is not None
        self._latest = latest = Future()
        handle.committed.add_done_callback(OneShot(functools.partial(self._committed, current, latest)))
        return True

    def _state(self, current: _Save) -> dict[str, Any]:
        """What this rank saves: each file DeepSpeed gave split into its tensors and values, and its swap files."""
        allow_pickle = self.options.allow_pickle
        state: dict[str, Any] = {name: values.split(sd, allow_pickle=allow_pickle, where=name)
                                 for name, sd in current.files.items()}
        offloaded = current.swap.tensors() if current.swap else {}
        if offloaded:
            state[swap.KEY] = rank_local(offloaded)
        return state

    def _point_latest(self, current: _Save) -> None:
        """Rank 0 rewrites ``latest`` (DeepSpeed's plain-text tag, replaced atomically) once the
        checkpoint committed."""
        if not (current.save_latest and self.group.is_coordinator):
            return
        try:
            storage_for(current.save_dir).put(LATEST_NAME, current.tag.encode())
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {current.directory} committed, but {current.save_dir}/{LATEST_NAME} could not be made "
                f"to name it ({type(exc).__name__}: {exc}), which still names the checkpoint before: load this one by "
                f"its tag, {current.tag!r}; the next save updates {LATEST_NAME} again") from exc

    def _committed(self, current: _Save, latest: Future, fut: Future) -> None:
        try:
            if fut.unseen_exception() is None:  # a failed save is the saver's to raise
                self._point_latest(current)
        except BaseException as exc:
            log.error("%s", exc)  # said now too: at the end of the process no save is left to raise it
            latest.set_exception(exc)
        else:
            latest.set_result(None)

    def _latest_failure(self) -> BaseException | None:
        """Rank 0's failure to point ``latest`` at the asynchronous save before (waited for), once."""
        latest, self._latest = self._latest, None
        return latest.exception() if latest is not None else None

    def wait(self) -> None:
        """Wait for the asynchronous save in flight to commit and ``latest`` to name it; raises
        what went wrong."""
        if self.saver is not None:
            self.saver.wait()
        failure = self._latest_failure()
        if failure is not None:
            raise failure

    def settle(self) -> None:
        """Before a load (collective): wait for the asynchronous save in flight to commit; its
        failure fails the load on every rank. Rank 0's failure to point ``latest`` at it is left
        for the next save to raise on every rank (that checkpoint committed: it loads by its tag)."""
        with self.group.failing_together("the asynchronous save before this load failed on {failed} other rank(s) "
                                         "(their errors say why); nothing was loaded"):
            if self.saver is not None:
                self.saver.wait()

    def cleanup(self) -> None:
        """Finish the save in flight and free the saver's buffers."""
        try:
            self.wait()
        finally:
            if self.saver is not None:
                self.saver.close()

    # -- reading: open → load … → close --------------------------------------------------------
    def open(self, load_dir: str, tag: str | None = None) -> str | None:
        """Open checkpoint ``tag`` of ``load_dir`` for the loads that follow (collective). ``None``
        or ``"latest"``: the tag that ``latest`` names, else the newest committed checkpoint; None
        when there is none. Rank 0 decides; every rank opens the same. Returns the tag opened."""
        if self._session is not None:
            raise CheckpointError(f"checkpoint {self._session.tag} of {self._session.load_dir} is still open: "
                                  "close() it first")
        load_dir = os.fspath(load_dir)
        agreed = self.group.agree(lambda: tags.resolve(load_dir, tag).encode()).decode()
        if not agreed:
            log.warning("no checkpoint to load in %s", load_dir)
            return None
        checkpoint = Checkpoint(CheckpointRoot(storage_for(load_dir)).child(agreed), self.options.load_options,
                                process_group=ALONE if self.group.pg is None else self.group.pg)
        view = ""
        try:
            with self.group.failing_together(f"checkpoint {agreed} of {load_dir} could not be opened on {{failed}} "
                                             "other rank(s) (their errors say why)"):  # none waits for the others
                try:
                    view = tempfile.mkdtemp(prefix="zerostall-deepspeed-")
                    _show(view, agreed, checkpoint, self.group.rank)
                except OSError as exc:
                    raise typed_error(exc, f"cannot show checkpoint {agreed} of {load_dir} to DeepSpeed (a folder of "
                                      f"its file names under {tempfile.gettempdir()}, TMPDIR)") from exc
        except BaseException:
            checkpoint.close()
            if view:
                shutil.rmtree(view, ignore_errors=True)
            raise
        self._session = _Session(load_dir, agreed, checkpoint, view)
        return agreed

    def deepspeeds_own(self, load_dir: str, tag: str | None = None) -> str | None:
        """``tag`` (None or ``"latest"``: the tag ``latest`` names) when it is a checkpoint that
        DeepSpeed's own engine wrote in ``load_dir`` (its files and no zerostall manifest), else
        None. Collective: rank 0 decides."""
        found = self.group.agree(lambda: tags.deepspeeds_own(os.fspath(load_dir), tag).encode()).decode()
        return found or None

    def close(self) -> None:
        """Free what :meth:`open` took (its files, its directory of names)."""
        session, self._session = self._session, None
        if session is not None:
            session.checkpoint.close()
            shutil.rmtree(session.view, ignore_errors=True)

    @property
    def session(self) -> _Session | None:
        """The checkpoint :meth:`open` opened, until :meth:`close`."""
        return self._session

    def load(self, path: str, map_location: Any = None) -> Any:
        session = self._session
        if session is None:
            raise CheckpointError(f"DeepSpeed reads {path} with no checkpoint open: load through the "
                                  "load_checkpoint that zerostall.integrations.deepspeed.attach installs")
        if not _inside(path, session.directory):
            raise CheckpointError(f"DeepSpeed reads {path}, outside checkpoint {session.tag} of {session.load_dir}")
        name = os.path.relpath(path, session.directory)
        ck = session.checkpoint
        where = f"{name} of checkpoint {ck.path}"
        value = _file_value(ck, name)
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        live = session.into.get(name) if device is None or torch.device(device).type == "cpu" else None
        into = values.tensors_of(live()) if live is not None else {}

        def tensors(names: list[str]) -> list[torch.Tensor]:
            keys = [(name, values.TENSORS, t) for t in names]
            return [_to(t, device) for t in ck.read_many(keys, into=[into.get(t) for t in names])]

        try:
            return values.join(value, tensors, where, allow_pickle=self.options.allow_pickle)
        except CheckpointError as exc:
            if not into:
                raise
            raise type(exc)(f"{exc}; it was being read into the engine's own tensors, which may now be partly "
                            "overwritten: load another checkpoint before training on") from exc

    def is_decoupled(self) -> bool:
        return False  # an asynchronous save commits in the background, without waiting at the next step

    def preserves_storage_sharing(self) -> bool:
        return True  # a tensor met twice is stored once (values.split): no clones needed


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.normpath(path), os.path.normpath(directory)
    return path == directory or path.startswith(directory + os.sep)


def _file_value(ck: Checkpoint, name: str) -> Any:
    """The python value of file ``name``: its own entry, or a part of a larger one where no tensor
    lies below (a file without tensors is stored whole; a checkpoint without any, as one value)."""
    path = (name, values.VALUE)
    for depth in (2, 1, 0):
        try:
            value = ck.read(path[:depth])
        except KeyError:
            continue
        try:
            for key in path[depth:]:
                value = value[key]
        except (KeyError, TypeError):
            break
        return value
    raise CheckpointNotFoundError(f"checkpoint {ck.path} holds no {name}")


def _to(t: torch.Tensor, device: Any) -> torch.Tensor:
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)


def _show(view: str, tag: str, ck: Checkpoint, rank: int) -> None:
    """Lay out ``view/tag`` as DeepSpeed expects to find it: an empty file per stored file (it
    globs and checks names before reading), this rank's empty swap folder (it copies from there
    after the swap files were restored), and ``view/latest`` naming the tag (its ``zero_to_fp32``
    reads it)."""
    directory = os.path.join(view, tag)
    os.makedirs(directory)
    with open(os.path.join(view, LATEST_NAME), "w") as f:
        f.write(tag)
    for name in {e.path[0] for e in ck.manifest.entries if e.path and e.path[0] != swap.KEY}:
        target = os.path.normpath(os.path.join(directory, str(name)))
        if not _inside(target, directory) or target == directory:
            raise CheckpointError(f"checkpoint {ck.path} holds a file named {name!r}, outside its directory")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "wb").close()
    os.makedirs(os.path.join(directory, swap.KEY, f"rank{rank:0>2d}"), exist_ok=True)
