"""The public functions: save, async_save, load, open, open_latest, verify, export; and the process-wide saver.

Each takes a path (or a :class:`~zerostall.storage.Storage`), an optional options object and, as
shorthand, that object's fields as keywords. Every call is collective when ``torch.distributed`` is
initialized: every rank of the process group calls it.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping

from .collectives import Group
from .errors import UnsupportedValueError
from .gcpause import gc_paused
from .interop.exporting import ExportInfo, ExportOptions, export_checkpoint
from .loading.checkpoint import Checkpoint
from .options import LoadOptions, SaveOptions
from .roots.naming import Naming
from .roots.root import CheckpointRoot
from .saving.asynchronous import AsyncSaver
from .saving.handles import SaveHandle
from .saving.pipeline import SaveInfo, persist, prepare
from .storage import Storage, storage_for


@gc_paused()  # the caller waits: no cyclic collections over the per-leaf objects
def save(state: Any, path: str | os.PathLike[str] | Storage, options: SaveOptions | None = None, *,
         process_group: Any = None, step: int | None = None, metadata: Mapping[str, Any] | None = None,
         **overrides: Any) -> SaveInfo:
    """Save ``state`` to ``path`` and return once the checkpoint is committed (durable, visible).

    ``state`` is any nesting of dicts/lists/tuples of tensors (DTensors included), python values
    and objects with ``state_dict()``. Collective when ``torch.distributed`` is initialized: every
    rank calls it; replicated data is written once, balanced over the ranks that hold it. Saving
    into an existing checkpoint leaves it intact until the new manifest commits; a rank that fails
    or dies fails the save everywhere, with no manifest written. ``options`` and keyword overrides
    are :class:`SaveOptions` fields (threads, fsync, allow_pickle, block_size, commit_timeout).
    An asynchronous save of the process-wide saver still in flight is waited for first.
    """
    options = _self_contained(SaveOptions.of(options, overrides))
    if _default is not None and not _default._closed:
        _default.wait()
    return persist(prepare(state, path, options, process_group=process_group, step=step, metadata=metadata))


def open(path: str | os.PathLike[str] | Storage, options: LoadOptions | None = None, *, process_group: Any = None,
         **overrides: Any) -> Checkpoint:
    """Open a read session on the checkpoint ``path`` names: a checkpoint (ours, PyTorch DCP or
    Hugging Face safetensors), a checkpoint root or ``ROOT/latest`` (its newest committed
    checkpoint), ``ROOT/<step>`` (the newest of that step); its ``path`` and ``step`` say which.
    Collective when distributed: rank 0 decides which checkpoint and reads its manifest, and every
    rank gets the same one. ``options`` and keyword overrides (:class:`LoadOptions` fields) are the
    defaults of the session's loads and reads."""
    return Checkpoint(path, LoadOptions.of(options, overrides), process_group=process_group, instead=Naming(path))


def open_latest(root: str | os.PathLike[str] | Storage, step: int | None = None, options: LoadOptions | None = None,
                *, process_group: Any = None, **overrides: Any) -> Checkpoint:
    """Open the newest committed checkpoint under the checkpoint root ``root`` (or the newest of
    ``step``), read-only: it takes no writer lease, so an evaluation job can follow a training run
    while its :class:`CheckpointManager` writes there. Rank 0 picks the checkpoint; every rank
    opens that one. If retention deletes it while the session is open, reads of files not yet
    opened fail with a :class:`CheckpointError` saying it was deleted: open the newest again."""
    checkpoints = CheckpointRoot(storage_for(root))
    tag = Group(process_group).agree(lambda: checkpoints.newest(step).encode()).decode()
    return Checkpoint(checkpoints.child(tag), LoadOptions.of(options, overrides), process_group=process_group)


@gc_paused()  # opening included: the manifest's objects then die by reference counting, never walked
def load(state: Any, path: str | os.PathLike[str] | Storage, options: LoadOptions | None = None, *,
         process_group: Any = None, **overrides: Any) -> Any:
    """Load the checkpoint ``path`` names (a checkpoint, a root, ``ROOT/latest``, ``ROOT/<step>``:
    see :func:`open`) into ``state`` in place and return it (see :meth:`Checkpoint.load`). A save
    of the process-wide saver still in flight is waited for first, so the load neither changes the
    state it captures nor misses the checkpoint it commits; its failure is left for that saver."""
    options = LoadOptions.of(options, overrides)
    if _default is not None and not _default._closed:
        _default.await_done()
    with open(path, options, process_group=process_group) as ck:
        return ck.load(state)


def verify(path: str | os.PathLike[str] | Storage, *, threads: int | None = None,
           progress: Callable[[int], None] | None = None) -> int:
    """Check every file size and block checksum of the checkpoint ``path`` names (see :func:`open`);
    returns the bytes checked. Raises :class:`CorruptCheckpointError` listing every fault on damage, a plain
    :class:`CheckpointError` when some bytes could not be read (not known to be damaged)."""
    with open(path, threads=threads) as ck:
        return ck.verify(progress=progress)


def export(ckpt: str | os.PathLike[str] | Storage | Checkpoint, out: str | os.PathLike[str],
           options: ExportOptions | None = None, *, progress: Callable[[int], None] | None = None,
           **overrides: Any) -> ExportInfo:
    """Export the model weights of ``ckpt`` (what :func:`open` takes: a checkpoint path or URL, a
    root or ``ROOT/latest``, ``ROOT/<step>``; or an open :class:`Checkpoint`) to the local path
    ``out``, consolidated from every rank that saved them: Hugging Face safetensors files
    (``format="hf"``, sharded with an index beyond ``max_shard_size``) or one ``torch.load``-able
    file (``format="torch"``). ``options`` and keyword overrides are :class:`ExportOptions` fields
    (format, prefix, rename, dtype, max_shard_size, tied_weights_keys, overwrite, allow_pickle,
    threads); ``prefix`` reads as a load's. Entries that are not model weights (rank-local, python
    values, tensor subclasses) are skipped with a warning and listed in the returned
    :class:`ExportInfo`; tied weights are written once (``ExportInfo.tied``). Streams: memory holds
    a few slabs (``torch``: one tensor), never the model; every block's checksum is verified as it
    is read. Not collective: where ``torch.distributed`` is initialized, pass a checkpoint every
    rank opened (``zs.open``) on one rank."""
    return export_checkpoint(ckpt, out, ExportOptions.of(options, overrides), progress)


_default: AsyncSaver | None = None
_default_lock = threading.Lock()


def default_saver() -> AsyncSaver:
    """The process-wide saver behind :func:`async_save` (drained at exit)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = AsyncSaver()
        return _default


def async_save(state: Any, path: str | os.PathLike[str] | Storage, options: SaveOptions | None = None, *,
               process_group: Any = None, step: int | None = None, metadata: Mapping[str, Any] | None = None,
               **overrides: Any) -> SaveHandle:
    """Start saving ``state`` with the process-wide saver (drained at exit) and return its
    :class:`SaveHandle` at once; see :class:`AsyncSaver` and :func:`save`."""
    options = _self_contained(SaveOptions.of(options, overrides))
    handle = default_saver().save(state, path, options, process_group=process_group, step=step, metadata=metadata)
    assert handle is not None
    return handle


def _self_contained(options: SaveOptions) -> SaveOptions:
    """``options``, unless they ask for an incremental save: one needs a root of earlier checkpoints."""
    if options.incremental:
        raise UnsupportedValueError("incremental=True refers to the bytes of earlier checkpoints of a root: use "
                                    "CheckpointManager(root, incremental=True); zs.save and zs.async_save write "
                                    "self-contained checkpoints")
    return options
