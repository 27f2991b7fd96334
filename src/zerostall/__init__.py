"""zerostall: fast, sharded, asynchronous, verified checkpointing for PyTorch training."""

from .background import AsyncSaver, SaveHandle, async_save
from .engine import SaveInfo, default_threads, save
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                     StateMismatchError, UnsupportedValueError)
from .format import FORMAT_VERSION, Chunk, Entry
from .manager import CheckpointManager
from .retention import RetentionPolicy
from .reader import Checkpoint, Mismatch, load, open, verify
from .state import RankLocal, Stateful, rank_local

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "RetentionPolicy", "save", "async_save", "AsyncSaver", "SaveHandle", "load", "open", "verify", "default_threads", "rank_local", "RankLocal", "SaveInfo", "Checkpoint",
    "Mismatch", "Entry", "Chunk", "Stateful",
    "FORMAT_VERSION", "CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "IncompleteCheckpointError", "StateMismatchError", "UnsupportedValueError",
]
