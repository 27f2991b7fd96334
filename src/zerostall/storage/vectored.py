"""Vectored I/O on a descriptor: ``writev``/``preadv`` until every byte has moved, and early
write-back of a file that will be fsynced."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from typing import Any, Callable

log = logging.getLogger(__name__)

IOV_PARTS = 512  # buffers per writev/preadv call (the kernel takes at most 1024)
WRITEBACK_BYTES = 8 << 20
"""Bytes written to a file between two requests to start their write-back."""
_START_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writing the range's dirty pages out, without waiting


def _sync_file_range() -> Any:
    """Linux's ``sync_file_range`` from the C library (it releases the GIL while it runs), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()


class WriteBack:
    """Early write-back of one file being written: every :data:`WRITEBACK_BYTES`, the kernel is
    asked to start sending the pages just written to the device, so the device works while later
    bytes are still being copied in and the closing ``fsync`` has little left to wait for. Only a
    hint: the fsync alone makes the file durable, and where the call is missing or refused nothing changes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sent = 0
        self.on = _SYNC_FILE_RANGE is not None

    def wrote(self, end: int) -> None:
        """The file's first ``end`` bytes are written."""
        if not self.on or end - self.sent < WRITEBACK_BYTES:
            return
        if _SYNC_FILE_RANGE(self.fd, self.sent, end - self.sent, _START_WRITE) != 0:
            self.on = False  # a file system without it (ESPIPE, EINVAL): the fsync does it all
            log.debug("no early write-back on descriptor %d: %s", self.fd, os.strerror(ctypes.get_errno()))
        self.sent = end


def writev_all(fd: int, parts: list[memoryview]) -> int:
    """``writev`` until every byte of ``parts`` is written; returns the bytes written. A write that
    makes no progress raises, so no caller can mistake a short file for a whole one."""
    total = sum(len(p) for p in parts)
    done = move_all(parts, lambda bufs, done: os.writev(fd, bufs))
    if done < total:
        raise OSError(errno.EIO, f"write stalled after {done} of {total} bytes")
    return done


def move_all(parts: list[memoryview], move: Callable[[list[memoryview], int], int]) -> int:
    """Call ``move(buffers, done)`` (a ``writev`` or ``preadv`` of the buffers still pending, ``done``
    bytes moved so far) until every byte of ``parts`` has moved or a call moves none (end of file);
    calls may stop short, and do. Returns the bytes moved."""
    pending = list(parts)
    first = done = 0
    while first < len(pending):
        n = move(pending[first:first + IOV_PARTS], done)
        if n == 0:
            break
        done += n
        while first < len(pending) and n >= len(pending[first]):
            n -= len(pending[first])
            first += 1
        if n:
            pending[first] = pending[first][n:]
    return done
