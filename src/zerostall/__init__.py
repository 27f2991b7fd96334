"""zerostall: fast, sharded, asynchronous, verified checkpointing for PyTorch training.

The public names are imported on first use (PEP 562): ``import zerostall`` alone imports no torch,
so the ``zerostall`` command starts in a fraction of a second; ``zerostall.save`` or ``from
zerostall import save`` imports what it needs then.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "save", "async_save", "load", "open", "open_latest", "verify", "export", "copy", "CopyInfo", "SaveOptions",
    "LoadOptions", "ExportOptions", "ExportInfo",
    "AsyncSaver", "SaveHandle", "SaveInfo", "Checkpoint", "Mismatch", "CheckpointManager", "RetentionPolicy",
    "RestoreInfo", "LocalTier",
    "rank_local", "RankLocal", "Stateful", "FlattenedTensor", "FORMAT_VERSION", "S3Storage", "S3Options",
    "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError", "CommitError", "CorruptCheckpointError",
    "IncompleteCheckpointError", "InvalidPathError", "SharedMemoryError", "StateChangedError", "StateMismatchError",
    "UnsafeFileError", "UnsupportedValueError", "StorageError", "ConcurrentWriteError", "ExportError",
    "InsufficientSpaceError",
]

# Each public name and the module that defines it (tests/test_lazy_import.py keeps __all__, this and
# the imports below naming the same objects).
_EXPORTS = {
    "save": "api", "async_save": "api", "load": "api", "open": "api", "open_latest": "api", "verify": "api",
    "copy": "interop.copying", "CopyInfo": "interop.copying", "export": "api",
    "SaveOptions": "options", "LoadOptions": "options",
    "ExportOptions": "interop.exporting", "ExportInfo": "interop.exporting",
    "AsyncSaver": "saving.asynchronous", "SaveHandle": "saving.handles", "SaveInfo": "saving.pipeline",
    "Checkpoint": "loading.checkpoint", "Mismatch": "loading.load_plan", "CheckpointManager": "manager",
    "RetentionPolicy": "roots.retention", "RestoreInfo": "roots.restore", "LocalTier": "tiers.local",
    "rank_local": "state", "RankLocal": "state", "Stateful": "state", "FlattenedTensor": "format.flattened",
    "FORMAT_VERSION": "format.layout", "S3Storage": "storage.s3", "S3Options": "storage.s3client",
    "CheckpointError": "errors", "CheckpointExistsError": "errors", "CheckpointNotFoundError": "errors",
    "CommitError": "errors", "InvalidPathError": "errors",
    "CorruptCheckpointError": "errors", "IncompleteCheckpointError": "errors", "SharedMemoryError": "errors",
    "StateChangedError": "errors", "StateMismatchError": "errors", "UnsafeFileError": "errors",
    "UnsupportedValueError": "errors", "StorageError": "errors", "ConcurrentWriteError": "errors",
    "ExportError": "errors", "InsufficientSpaceError": "errors",
}

if TYPE_CHECKING:  # what type checkers and editors see
    from .api import async_save, export, load, open, open_latest, save, verify
    from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CommitError,
                         ConcurrentWriteError, CorruptCheckpointError, ExportError, IncompleteCheckpointError,
                         InsufficientSpaceError, InvalidPathError, SharedMemoryError, StateChangedError,
                         StateMismatchError, StorageError, UnsafeFileError, UnsupportedValueError)
    from .format.layout import FORMAT_VERSION
    from .format.flattened import FlattenedTensor
    from .interop.copying import CopyInfo, copy
    from .interop.exporting import ExportInfo, ExportOptions
    from .loading.checkpoint import Checkpoint
    from .loading.load_plan import Mismatch
    from .manager import CheckpointManager
    from .options import LoadOptions, SaveOptions
    from .roots.restore import RestoreInfo
    from .roots.retention import RetentionPolicy
    from .saving.asynchronous import AsyncSaver
    from .saving.handles import SaveHandle
    from .saving.pipeline import SaveInfo
    from .state import RankLocal, Stateful, rank_local
    from .storage.s3 import S3Storage
    from .storage.s3client import S3Options
    from .tiers.local import LocalTier


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept here); or a submodule, as
    ``zerostall.format.layout`` after a plain ``import zerostall``."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = globals()[name] = getattr(importlib.import_module(f".{module}", __name__), name)
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _drain_at_exit() -> None:
    """Close every asynchronous saver still open at exit, so its save in flight commits (once
    ``zerostall.saving.asynchronous`` is loaded there can be one). A threading exit hook, which runs before
    ``concurrent.futures`` refuses new work (plain ``atexit`` would run after); registered on
    ``import zerostall``, so hooks a program registers after that import run before it (they run
    last registered first)."""
    asynchronous = sys.modules.get(f"{__name__}.saving.asynchronous")
    if asynchronous is not None:
        asynchronous.close_at_exit()


# concurrent.futures registers its own exit hook when first imported (torch imports it): first, so
# that ours, registered after it, runs before it whichever of torch and zerostall was imported first
importlib.import_module("concurrent.futures.thread")
threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]
