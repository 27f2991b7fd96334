"""zerostall: fast, sharded, asynchronous, verified checkpointing for PyTorch training."""

from .engine import default_threads, save
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                     StateMismatchError, UnsupportedValueError)
from .format import FORMAT_VERSION, Chunk, Entry
from .reader import Checkpoint, Mismatch, load, open, verify
from .state import Stateful

__version__ = "0.1.0"

__all__ = [
    "save", "load", "open", "verify", "default_threads", "Checkpoint", "Mismatch", "Entry", "Chunk", "Stateful",
    "FORMAT_VERSION", "CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "IncompleteCheckpointError", "StateMismatchError", "UnsupportedValueError",
]
