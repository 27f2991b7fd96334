"""The interface every storage backend implements: whole files in, byte ranges out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable


class Storage(ABC):
    """A checkpoint location: a directory of named files (or an object prefix).

    Writers stream a file from a sequence of memoryviews (tensor memory, no copies); the
    manifest is published with one atomic operation, the commit point of a checkpoint.
    """

    location: str

    @abstractmethod
    def create(self) -> None:
        """Make the location exist (durably), before the first file is written."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether the location exists at all (an empty directory counts)."""

    @abstractmethod
    def list(self) -> list[str]:
        """Names of the files at the location."""

    @abstractmethod
    def size(self, name: str) -> int:
        """Size in bytes of one file; FileNotFoundError if it is absent."""

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
    def read_bytes(self, name: str) -> bytes:
        """The whole content of a small file (the manifest)."""

    def read_head(self, name: str, n: int) -> bytes:
        """Up to the first ``n`` bytes of a file (to peek at a manifest's generation)."""
        return self.read_bytes(name)[:n]

    @abstractmethod
    def publish(self, name: str, tmp_name: str, data: bytes,
                before_replace: Callable[[], None] | None = None) -> None:
        """Atomically make ``name`` hold ``data``: readers see the old content or the new, whole.
        ``before_replace`` runs at the last moment before the switch; if it raises, nothing changes."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove one file; a file that is already gone is not an error."""

    def memory_map(self, name: str) -> memoryview | None:
        """A copy-on-write memory map of the file where the storage allows it, else None."""
        return None

    def close(self) -> None:
        """Release cached handles."""
