"""The typed errors zerostall raises; every one names the key, file or step at fault."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every zerostall error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given path (or under the given tag)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save would replace a committed checkpoint without ``overwrite=True``; nothing was written."""


class IncompleteCheckpointError(CheckpointError):
    """Data exists at the path but no manifest was committed: the save never finished."""


class CorruptCheckpointError(CheckpointError):
    """A checksum, size or structural check failed: the bytes on storage are not what was saved."""


class UnsafeFileError(CorruptCheckpointError, OSError):
    """A checkpoint's file that zerostall refuses to open: a name that is not a plain file name (a
    path, ``..``, an absolute path), or a file that is not a regular file (a symbolic link, FIFO,
    device or directory). zerostall never writes such a thing, so a checkpoint holding one is
    damaged or forged; it is also an ``OSError``, like every other failure of a storage backend."""


class InvalidPathError(CheckpointError, ValueError):
    """A path or URL no storage can name (a NUL byte in it, a URL scheme with no backend); the
    message names it. Nothing was read or written."""


class StateMismatchError(CheckpointError):
    """The checkpoint and the target state disagree (missing/unexpected keys, shapes, dtypes)."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value cannot be saved or restored safely (e.g. an object that would need pickle)."""


class CommitError(CheckpointError):
    """A save did not commit: a rank failed, died or timed out; the previous checkpoint is intact."""


class StateChangedError(CheckpointError):
    """A tensor of an asynchronous save changed before its capture finished (no ``wait_staged()``
    before mutating the state): the save is not committed, so no torn checkpoint can exist."""


class SharedMemoryError(CheckpointError):
    """The capture buffers of an asynchronous save do not fit in shared memory (``/dev/shm``, which
    a writer process needs): nothing was saved; the message says how much is needed and free."""


class StorageError(CheckpointError, OSError):
    """A storage request failed for good (an object store's error, or a network failure that
    outlasted the retries); the message names the object and the server's answer."""


class ConcurrentWriteError(CheckpointError):
    """Another writer replaced or created a file between this writer's check and its conditional
    write (an object store's If-Match / If-None-Match failed): this write did not take effect."""


class ExportError(CheckpointError, ValueError):
    """An export cannot be done as asked (a prefix that selects nothing, two keys renamed onto one
    name, a dtype the output format cannot hold); the message says which keys and what to do. Nothing
    was written."""


class InsufficientSpaceError(CheckpointError, OSError):
    """A directory has too little free space for what is about to be written there; the error gives
    the bytes needed and free, and nothing was written."""
