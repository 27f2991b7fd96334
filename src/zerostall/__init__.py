"""zerostall: fast, sharded, asynchronous, verified checkpointing for PyTorch training."""

from .api import async_save, load, open, open_latest, save, verify
from .asynchronous import AsyncSaver, SaveHandle
from .checkpoint import Checkpoint
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CommitError, CorruptCheckpointError,
                     IncompleteCheckpointError, StateChangedError, StateMismatchError, UnsupportedValueError)
from .format import FORMAT_VERSION
from .load_plan import Mismatch
from .manager import CheckpointManager
from .options import LoadOptions, SaveOptions
from .retention import RetentionPolicy
from .saving import SaveInfo
from .state import RankLocal, Stateful, rank_local
from .subclass import FlattenedTensor

__version__ = "0.1.0"

__all__ = [
    "save", "async_save", "load", "open", "open_latest", "verify", "SaveOptions", "LoadOptions",
    "AsyncSaver", "SaveHandle", "SaveInfo", "Checkpoint", "Mismatch", "CheckpointManager", "RetentionPolicy",
    "rank_local", "RankLocal", "Stateful", "FlattenedTensor", "FORMAT_VERSION",
    "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError", "CommitError", "CorruptCheckpointError", "IncompleteCheckpointError",
    "StateChangedError", "StateMismatchError", "UnsupportedValueError",
]
