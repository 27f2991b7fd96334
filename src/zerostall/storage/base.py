"""The interface every storage backend implements: whole files in, byte ranges out."""

from __future__ import annotations

import os
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import UnsafeFileError


SMALL_FILE_BYTES = 1 << 16  # what a small file of a root (``latest``, the writer lease) may hold when read


class FileTooLargeError(OSError):
    """A file is longer than the limit its reader set (:meth:`Storage.read_bytes`)."""

    def __init__(self, name: str, size: int, limit: int) -> None:
        super().__init__(f"{name} has {size} bytes, more than the {limit} it may have")
        self.size = size
        self.limit = limit


def check_name(name: str) -> str:
    """``name`` if it is a plain file name (not empty, no ``/`` or NUL, not ``.`` or ``..``): the
    only names a backend opens, so no name can reach outside the location; else
    :class:`~zerostall.errors.UnsafeFileError`. Every backend checks the names it is given."""
    if type(name) is not str or not name or "/" in name or "\0" in name or name in (".", ".."):
        raise UnsafeFileError(f"{name!r} is not a plain file name: a checkpoint's files lie inside it")
    return name


@dataclass(frozen=True)
class FileStat:
    """What a listing needs of one file: its size, when it was last written, and a ``version``
    that changes whenever the file is replaced (to cache what was parsed from it)."""

    size: int
    modified: float  # seconds since the epoch
    version: str


class Storage(ABC):
    """A checkpoint location: a directory of named files (or an object prefix).

    Writers stream a file from a sequence of memoryviews (tensor memory, no copies); the
    manifest is published with one atomic operation, the commit point of a checkpoint.
    A location holds files and sub-locations (:meth:`child`): a checkpoint root holds one
    sub-location per checkpoint. Only :meth:`move` needs a rename (an object store copies instead).

    File names are plain names (:func:`check_name`; others raise ``UnsafeFileError``), and only
    regular files are read: a symbolic link, FIFO, device or directory in a file's place raises
    ``UnsafeFileError`` (an ``OSError``) instead of being followed or blocking the reader.
    """

    location: str
    remote = False
    """Whether every request pays a round trip (an object store): readers then fetch a whole
    piece in one call and check its blocks after, instead of cache-sized reads."""
    requests_in_flight = 1
    """How many requests of a reader this storage serves at once to best effect: a reader keeps at
    least this many runs of reads going (an object store's connections; a file system: its threads)."""
    read_grid = 0
    """Bytes of the grid a reader cuts its requests of a file along (an object store's part size:
    a ranged read that starts or ends inside a stored part costs the server a read of that whole
    part); 0: no grid."""

    @abstractmethod
    def create(self) -> None:
        """Make the location exist (durably), before the first file is written."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether the location exists at all (an empty directory counts)."""

    @abstractmethod
    def list(self) -> list[str]:
        """Names of the files at the location, sorted (a local directory's subdirectories may be
        among them: callers pick the names they know)."""

    @abstractmethod
    def child(self, name: str) -> Storage:
        """The storage at sub-location ``name`` (a subdirectory, a deeper key prefix), with this one's settings."""

    @abstractmethod
    def parent(self) -> Storage:
        """The storage one level up (a checkpoint's root), with this one's settings."""

    def sibling(self, name: str) -> Storage:
        """The storage at location ``name`` beside this one (another checkpoint of the same root)."""
        return self.parent().child(check_name(name))

    @abstractmethod
    def children(self) -> list[str]:
        """Names of the sub-locations directly under the location (checkpoints under a root), sorted."""

    def links(self) -> list[str]:
        """Names of the sub-locations that are symbolic links to directories (a local file system's;
        an object store has none): what a root's clean-up must never delete through."""
        return []

    @abstractmethod
    def size(self, name: str) -> int:
        """Size in bytes of one (regular) file; FileNotFoundError if it is absent."""

    def sizes(self) -> dict[str, int] | None:
        """The size of every file directly in the location from one listing, where a listing gives
        sizes (an object store: one request instead of one per file); None where looking each file
        up is as cheap (a local directory)."""
        return None

    @abstractmethod
    def stat(self, name: str) -> FileStat:
        """Size, modification time and version of one file; FileNotFoundError if it is absent."""

    @abstractmethod
    def write(self, name: str, parts: Iterable[memoryview]) -> int:
        """Create ``name`` (never overwriting) from ``parts`` in order, durably; returns its size."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` starting at ``offset``; short files raise EOFError."""

    def read_into_many(self, name: str, offset: int, outs: list[memoryview]) -> None:
        """Fill ``outs`` in order with consecutive bytes of ``name`` from ``offset`` (a scatter
        read: many small tensors stored back to back cost one request)."""
        for out in outs:
            self.read_into(name, offset, out)
            offset += len(out)

    @abstractmethod
    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The whole content of a small file (the manifest); a file of more than ``limit`` bytes
        raises :class:`FileTooLargeError` without being read whole."""

    def read_head(self, name: str, n: int) -> bytes:
        """Up to the first ``n`` bytes of a file (to peek at a manifest's generation)."""
        return self.read_bytes(name)[:n]

    @abstractmethod
    def publish(self, name: str, tmp_name: str, data: bytes,
                before_replace: Callable[[], None] | None = None) -> None:
        """Atomically make ``name`` hold ``data``: readers see the old content or the new, whole.
        ``before_replace`` runs at the last moment before the switch; if it raises, nothing changes.
        Between it and the switch no other publish with a ``before_replace`` on this location can
        switch (a check of what is in place holds until the switch: two writers, one commit)."""

    def put(self, name: str, data: bytes) -> None:
        """Replace the small file ``name`` atomically (a commit record, ``latest``, the lease),
        through a temp file of its own, ``<name>.<8 hex>.tmp``: writers racing on one name never
        share a temp file."""
        self.publish(name, f"{name}.{secrets.token_hex(4)}.tmp", data)

    @abstractmethod
    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create the small file ``name`` holding ``data``, whole, only if it is absent (a lease):
        False when it exists. ``O_EXCL``-like locally, ``If-None-Match: *`` on an object store."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove one file; a file that is already gone is not an error."""

    @abstractmethod
    def delete_tree(self, name: str) -> None:
        """Remove sub-location ``name`` and all it holds, best effort (what is left shows in its
        :meth:`child`'s :meth:`exists`); already gone is not an error. No order: delete first what must go first."""

    @abstractmethod
    def move(self, src: str, dst: str) -> None:
        """Move sub-location ``src`` to ``dst`` (a path of names, ``a/b``, whose parent exists and
        which itself does not); FileNotFoundError if ``src`` is gone. Locally one atomic rename, so
        a writer still writing into ``src`` fails (it is fenced off). An object store copies, then
        deletes, object by object: readers may see both or a part of each meanwhile, and a writer
        still writing into ``src`` is not fenced off."""

    def abort_uploads(self, name: str = "", which: Callable[[str], bool] | None = None) -> int:
        """Abandon the files left half-written under sub-location ``name`` (the whole location by
        default) by writers that died: an object store's unfinished multipart uploads, which no
        listing shows. With ``which``, only those whose paths under ``name`` (``a/b`` for a file
        one level deeper) it accepts. Returns how many. Only where no live writer writes (the lease holder's clean-up,
        or the files of generations a commit made stale); a local directory has none (a
        half-written file is listed and deleted as any)."""
        return 0

    def memory_map(self, name: str) -> memoryview | None:
        """A copy-on-write memory map of the file where the storage allows it, else None."""
        return None

    def close(self) -> None:
        """Release cached handles."""


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize
