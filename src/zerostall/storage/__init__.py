"""Storage backends: where checkpoint files live. One backend a module, one small interface."""

from __future__ import annotations

import os

from ..errors import InvalidPathError
from .base import SMALL_FILE_BYTES, FileStat, FileTooLargeError, Storage, check_name
from .local import LocalStorage
from .s3 import S3Storage
from .s3client import S3Options


def storage_for(path: str | os.PathLike[str] | Storage, *, fsync: bool = True) -> Storage:
    """The backend for ``path``: :class:`S3Storage` for ``s3://bucket/prefix`` (settings from the
    environment and AWS config; always durable, so ``fsync`` does not apply), :class:`LocalStorage`
    for local (or shared POSIX) paths. A :class:`Storage` is used as it is (an ``S3Storage`` with
    explicit :class:`S3Options`, a wrapper that injects faults in tests)."""
    if isinstance(path, Storage):
        return path
    text = os.fspath(path)
    if text.startswith("s3://"):
        return S3Storage(text)
    if "://" in text and not text.startswith("file://"):
        scheme = text.split("://", 1)[0]
        raise InvalidPathError(f"no storage backend for {scheme}:// URLs yet (path {text!r})")
    return LocalStorage(text.removeprefix("file://"), fsync=fsync)


__all__ = ["SMALL_FILE_BYTES", "FileStat", "FileTooLargeError", "Storage", "LocalStorage", "S3Options", "S3Storage",
           "check_name", "storage_for"]
