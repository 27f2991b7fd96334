"""Storage backends: where checkpoint files live. One backend a module, one small interface."""

from __future__ import annotations

import os

from .base import FileStat, FileTooLargeError, Storage, check_name
from .local import LocalStorage


def storage_for(path: str | os.PathLike[str] | Storage, *, fsync: bool = True) -> Storage:
    """The backend for ``path``: local (or shared POSIX) paths today; URLs get their own backends.
    A :class:`Storage` is used as it is (a wrapper that injects faults in tests, say)."""
    if isinstance(path, Storage):
        return path
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        scheme = text.split("://", 1)[0]
        raise ValueError(f"no storage backend for {scheme}:// URLs yet (path {text!r})")
    return LocalStorage(text.removeprefix("file://"), fsync=fsync)


__all__ = ["FileStat", "FileTooLargeError", "Storage", "LocalStorage", "check_name", "storage_for"]
