"""Local and shared POSIX file systems: parallel ``writev`` from tensor memory, ``preadv`` into it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import resource
import secrets
import shutil
import stat
import threading
from typing import Callable, Iterable, Iterator

from ..errors import InvalidPathError, UnsafeFileError
from .base import FileStat, FileTooLargeError, Storage, check_name
from .vectored import IOV_PARTS, WriteBack, move_all, writev_all

log = logging.getLogger(__name__)

_WRITEV_BYTES = 1 << 20  # small, so bytes hashed just before are still in cache when written
# never through a symbolic link, never blocking on a FIFO with no writer, never taking a terminal
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


def open_regular(path: str) -> tuple[int, int]:
    """A read descriptor of the regular file ``path`` and its size. A symbolic link is not
    followed, and a FIFO, device or directory is refused after opening (checked on the open
    descriptor: nothing can be swapped in between a check and the open), as
    :class:`~zerostall.errors.UnsafeFileError`; the descriptor then blocks as usual."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symbolic link, not a regular file: refused") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path} is {_file_type(st.st_mode)}, not a regular file: refused")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _hf_cache_blobs(location: str) -> str | None:
    """The ``blobs/`` directory (resolved) of the Hugging Face cache repository whose snapshot
    ``location`` is (``models--org--name/snapshots/<revision>``, a directory of links to blobs), else None."""
    snapshots = os.path.dirname(location)
    if os.path.basename(snapshots) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return os.path.realpath(blobs) if os.path.isdir(blobs) else None


def _file_type(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _directory_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` of directory ``path``, held by one process at a time. Where the file
    system has none for directories (some network file systems), a warning, and no lock."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            log.warning("cannot lock %s for the commit (%s): two writers on this path are not fenced", path, exc)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_path(path: str) -> str:
    """``path``; a NUL byte in it is an :class:`InvalidPathError` naming it (not each call's bare ``ValueError``)."""
    if "\0" in path:
        raise InvalidPathError(f"the path {path!r} holds a NUL byte ('\\0'), which no file name can hold; check how "
                               "the path was built")
    return path


class LocalStorage(Storage):
    """A directory. ``fsync=False`` skips every fsync (for scratch tiers where speed beats durability)."""

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.location = os.path.abspath(check_path(root))
        self.fsync = fsync
        self._local = threading.local()  # .fds: this thread's open files, in the order it opened them
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._fds_per_thread = max(2, min(64, limit // 64))  # 16 at the usual limit of 1024
        self._maps_left = max(1, limit // 4)  # see memory_map
        self._caches: list[dict[str, int]] = []  # every thread's, so close() can close them all
        self._lock = threading.Lock()
        self._blobs = _hf_cache_blobs(self.location)

    def __getstate__(self) -> dict[str, object]:
        return {"location": self.location, "fsync": self.fsync}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(str(state["location"]), fsync=bool(state["fsync"]))

    def _path(self, name: str) -> str:
        return os.path.join(self.location, name)

    def _file(self, name: str) -> str:
        """The path of file ``name``, a plain name (else ``UnsafeFileError``): nothing outside the directory."""
        return os.path.join(self.location, check_name(name))

    def _readable(self, name: str) -> str:
        """The path to read file ``name`` at: :meth:`_file`, but in a Hugging Face cache snapshot a
        link into the repository's ``blobs/`` is read at its target (any other link is refused when
        opened, as everywhere)."""
        path = self._file(name)
        if self._blobs is not None and os.path.islink(path):
            target = os.path.realpath(path)
            if os.path.dirname(target) == self._blobs:
                return target
        return path

    def create(self) -> None:
        """Make the directory and any missing parents, each new entry made durable in its parent."""
        path, missing = self.location, []
        while not os.path.isdir(path):
            missing, path = [path, *missing], os.path.dirname(path)
        for path in missing:
            with contextlib.suppress(FileExistsError):  # made meanwhile (by another rank)
                os.mkdir(path)
            if self.fsync:
                fsync_dir(os.path.dirname(path))

    def exists(self) -> bool:
        return os.path.isdir(self.location)

    def list(self) -> list[str]:
        """Every entry's name, subdirectories too: telling them apart costs a stat per entry where
        the file system gives no entry types, and a save polls this list while it commits."""
        try:
            return sorted(os.listdir(self.location))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self._path(name), fsync=self.fsync)

    def parent(self) -> LocalStorage:
        return LocalStorage(os.path.dirname(self.location), fsync=self.fsync)

    def children(self) -> list[str]:
        try:
            with os.scandir(self.location) as entries:
                return sorted(e.name for e in entries if _is_dir(e))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def links(self) -> list[str]:
        try:
            with os.scandir(self.location) as entries:
                return sorted(e.name for e in entries if e.is_symlink() and _is_dir(e))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, name: str) -> int:
        """The size of the regular file ``name`` (a symbolic link is not followed; anything but a
        regular file raises ``UnsafeFileError``, as reading it would)."""
        path = self._readable(name)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path} is {_file_type(st.st_mode)}, not a regular file: refused")
        return st.st_size

    def stat(self, name: str) -> FileStat:
        st = os.lstat(self._readable(name))
        return FileStat(st.st_size, st.st_mtime, f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}")

    def write(self, name: str, parts: Iterable[memoryview]) -> int:
        path = self._file(name)
        fd = os.open(path, _WRITE_FLAGS | os.O_EXCL, 0o644)
        try:
            written = 0
            batch: list[memoryview] = []
            batch_bytes = 0
            behind = WriteBack(fd) if self.fsync else None  # the fsync below then waits for little
            for part in parts:
                if not len(part):
                    continue
                batch.append(part)
                batch_bytes += len(part)
                if batch_bytes >= _WRITEV_BYTES or len(batch) >= IOV_PARTS:
                    written += writev_all(fd, batch)
                    batch, batch_bytes = [], 0
                    if behind is not None:
                        behind.wrote(written)
            if batch:
                written += writev_all(fd, batch)
            if self.fsync:
                os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            _remove(path)
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = path  # writev does not say which file filled the disk
            raise
        os.close(fd)
        return written

    def _fd(self, name: str) -> int:
        """A read descriptor of ``name``, from this thread's cache of at most ``_fds_per_thread``:
        a checkpoint written by a thousand ranks has thousands of files, more than a process may
        hold open. No lock on the common path (reader threads ask once per piece); per thread, so
        no descriptor is closed while another thread reads through it."""
        cache = getattr(self._local, "fds", None)
        if cache is None:
            cache = self._local.fds = {}
            with self._lock:
                self._caches.append(cache)
        fd = cache.get(name)
        if fd is None:
            if len(cache) >= self._fds_per_thread:
                os.close(cache.pop(next(iter(cache))))  # the one opened first: reads go file by file
            fd = cache[name] = open_regular(self._readable(name))[0]
        return fd

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        done = os.preadv(self._fd(name), [out], offset)  # one call in the common case: a piece costs one syscall
        if done < len(out):
            self.read_into_many(name, offset + done, [out[done:]])

    def read_into_many(self, name: str, offset: int, outs: list[memoryview]) -> None:
        fd = self._fd(name)
        total = sum(len(out) for out in outs)
        done = move_all(outs, lambda bufs, done: os.preadv(fd, bufs, offset + done))
        if done < total:
            raise EOFError(f"{self._path(name)} ends at byte {offset + done}, expected {offset + total}")

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        fd, size = open_regular(self._readable(name))
        with os.fdopen(fd, "rb") as f:
            if limit is None:
                return f.read()
            if size > limit:
                raise FileTooLargeError(f.name, size, limit)
            data = f.read(limit + 1)  # it may have grown since
        if len(data) > limit:
            raise FileTooLargeError(self._readable(name), len(data), limit)
        return data

    def read_head(self, name: str, n: int) -> bytes:
        with os.fdopen(open_regular(self._readable(name))[0], "rb") as f:
            return f.read(n)

    def publish(self, name: str, tmp_name: str, data: bytes,
                before_replace: Callable[[], None] | None = None) -> None:
        tmp = self._file(tmp_name)
        self._write_small(tmp, data, os.O_TRUNC)  # e.g. the disk filled up: it leaves no half-written temp file
        try:
            if self.fsync:
                fsync_dir(self.location)  # the data files' directory entries are durable before the commit
            if before_replace is None:
                os.replace(tmp, self._file(name))
            else:
                with _directory_lock(self.location):
                    before_replace()
                    os.replace(tmp, self._file(name))
        except BaseException:
            _remove(tmp)
            raise
        if self.fsync:
            fsync_dir(self.location)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Written to a temp file (``name.*.tmp``), then hard-linked into place, which fails if
        ``name`` exists: a reader never sees it empty or partly written. File systems without hard
        links get an ``O_EXCL`` create, which a reader may see before it holds ``data``."""
        tmp = self._file(f"{check_name(name)}.{secrets.token_hex(4)}.tmp")
        self._write_small(tmp, data, os.O_EXCL)
        try:
            os.link(tmp, self._file(name))
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            try:
                self._write_small(self._file(name), data, os.O_EXCL)
            except FileExistsError:
                return False
        finally:
            _remove(tmp)
        if self.fsync:
            fsync_dir(self.location)
        return True

    def _write_small(self, path: str, data: bytes, flags: int) -> None:
        """Write ``path`` whole (durably unless ``fsync=False``); nothing is left if that fails."""
        fd = os.open(path, _WRITE_FLAGS | flags, 0o644)
        try:
            try:
                writev_all(fd, [memoryview(data)])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _remove(path)
            raise

    def delete(self, name: str) -> None:
        with self._lock:
            fds = [fd for cache in self._caches if (fd := cache.pop(name, None)) is not None]
        for fd in fds:
            os.close(fd)
        try:
            os.unlink(self._file(name))
        except FileNotFoundError:
            pass

    def delete_tree(self, name: str) -> None:
        shutil.rmtree(self._path(name), ignore_errors=True)

    def move(self, src: str, dst: str) -> None:
        target = self._path(dst)
        os.rename(self._path(src), target)
        if self.fsync:
            fsync_dir(os.path.dirname(target))
            fsync_dir(self.location)

    def memory_map(self, name: str) -> memoryview | None:
        """A copy-on-write map of ``name``; None (read by copying instead) for an empty file and
        beyond ``_maps_left`` maps, since each map holds a file descriptor as long as it lives."""
        with self._lock:
            if self._maps_left <= 0:
                return None
            self._maps_left -= 1
        fd, size = open_regular(self._readable(name))
        try:
            if size == 0:
                return None
            return memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
        finally:
            os.close(fd)  # the map keeps its own reference to the file

    def close(self) -> None:
        with self._lock:
            caches, self._caches, self._local = self._caches, [], threading.local()
        for cache in caches:
            for fd in cache.values():
                os.close(fd)
            cache.clear()


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """Whether a directory entry is a directory (following links); False if it vanished meanwhile."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
