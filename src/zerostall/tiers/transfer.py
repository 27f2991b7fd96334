"""Copies between ranks: a rank's copy (a directory holding one committed checkpoint) sent over a
process group, verified where it arrives before it is published.

Each transfer is one stream between two ranks: a header (the length of a JSON document, then the
document: the copy's file names and sizes, or why there is nothing), then the bytes of the files,
manifest first, in chunks, a few on the wire at once. No pickling, no collective: point-to-point
messages only, every wait bounded by the group's own timeout. The sender's files are
memory-mapped (the network reads the page cache, no copy in between); the receiver writes the
chunks that have arrived from a few threads while the next ones arrive, into a sibling folder
named ``.incoming-...`` (removed by the local tier at start-up if a crash leaves one), checks
every block against the checkpoint's checksums with
:func:`~zerostall.loading.verification.verify_all` (what ``zs.verify`` runs) file by file as
they are written, and only then renames the folder into place. Files are not fsynced: a copy
torn by a power loss fails its checksums when it is read, and another copy is used.
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.layout import MANIFEST_NAME, dump_json, load_json
from ..loading.opening import read_manifest
from ..loading.reader import ChunkReader
from ..loading.verification import verify_all
from ..options import default_threads
from ..storage.base import check_name
from ..storage.local import LocalStorage, open_regular

INCOMING = ".incoming-"
"""The prefix of a copy's folder while it arrives, beside the folder it is published as."""

_HEADER_LIMIT = 64 << 20  # a copy's names and sizes; more is a broken or hostile stream
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_IN_FLIGHT = 4  # chunks of one transfer on the wire at once
_WRITERS = 4  # threads writing one arriving copy's chunks into its files


def exchange(pg: Any, sends: Sequence[tuple[int, Path | None]], receives: Sequence[tuple[int, Path]], *,
             chunk_bytes: int = 4 << 20) -> list[Path | None]:
    """Run every transfer of this rank at once (no deadlock: each rank may send to and receive from
    several ranks, the same ones included). ``sends``: (destination rank in ``pg``, copy directory,
    or None when this rank has nothing: the receiver is told so). ``receives``: (source rank, the
    directory to publish the copy as; one there is replaced). Returns, per receive, that directory,
    or None when the sender had nothing. Raises once every transfer has ended: a copy that fails its
    checks is :class:`CorruptCheckpointError` naming the source rank and the file (nothing is
    published), a peer that died or timed out a :class:`CheckpointError` naming it."""
    me = dist.get_rank(pg)
    for what, peers in (("send to", [r for r, _ in sends]), ("receive from", [r for r, _ in receives])):
        if len(set(peers)) != len(peers) or me in peers or not all(0 <= r < dist.get_world_size(pg) for r in peers):
            raise ValueError(f"exchange on rank {me}: each rank to {what} must be another rank of the group, once: "
                             f"{peers}")
    if not (sends or receives):
        return []
    jobs = [lambda r=r, p=p: _send(pg, r, None if p is None else Path(p), chunk_bytes) for r, p in sends]
    jobs += [lambda r=r, p=p: _receive(pg, r, Path(p), chunk_bytes) for r, p in receives]
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="zerostall-transfer") as pool:
        futures = [pool.submit(job) for job in jobs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return [f.result() for f in futures[len(sends):]]


def _send(pg: Any, dst: int, copy: Path | None, chunk_bytes: int) -> None:
    """Send ``copy`` (its manifest first, then the files it lists) to ``dst``; None: word that there is none."""
    try:
        try:
            files, data = ([], []) if copy is None else _open_copy(copy)
        except (CheckpointError, OSError) as exc:  # the receiver learns why, then this rank raises it
            _send_header(pg, dst, {"error": f"{type(exc).__name__}: {exc}"})
            raise CheckpointError(f"cannot send the copy {copy} to rank {dst}: {exc}") from exc
        _send_header(pg, dst, {"files": None if copy is None else [list(f) for f in files]})
        wire = _Wire(pg, dst)
        for whole in data:
            for offset in range(0, whole.numel(), chunk_bytes):
                wire.send(whole[offset:offset + chunk_bytes])
        wire.finish()
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise CheckpointError(f"sending the copy {copy} to rank {dst} failed (rank {dst} died, or timed out): "
                              f"{exc}") from exc


def _open_copy(copy: Path) -> tuple[list[tuple[str, int]], list[torch.Tensor]]:
    """The files of the committed copy ``copy`` (its manifest, then the data files it lists) with
    their sizes, and their bytes, mapped (the network reads them from the page cache, no copy)."""
    manifest = read_manifest(LocalStorage(os.fspath(copy), fsync=False))
    files, data = [], []
    for name in [MANIFEST_NAME, *manifest.files]:
        fd, size = open_regular(os.path.join(copy, check_name(name)))
        try:
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else bytearray()
        finally:
            os.close(fd)
        files.append((name, size))
        data.append(torch.frombuffer(mapped, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8))
    return files, data


def _receive(pg: Any, src: int, final: Path, chunk_bytes: int) -> Path | None:
    """Receive ``src``'s copy into a folder beside ``final``, verify it, publish it as ``final``."""
    try:
        files = _receive_header(pg, src, final)
        if files is None:
            return None
        incoming = final.parent / f"{INCOMING}{final.name}-{secrets.token_hex(4)}"
        try:
            _Arrival(src, final, incoming, chunk_bytes).receive(_Wire(pg, src), files)
            _publish(incoming, final)
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise CheckpointError(f"receiving rank {src}'s copy for {final} failed (rank {src} died, or timed out): "
                              f"{exc}") from exc
    return final


class _Arrival:
    """One copy arriving into ``folder``. Chunks arrive into a ring of preallocated buffers and are
    written into their files by a few threads while the next ones arrive; each file is checked
    (:func:`verify_all` of that file) in the background once written, while the next ones arrive.
    A failure (a name that is not a plain file name, a file that cannot be written, a check that
    fails) is raised once every byte has arrived, the rest dropped, so the stream stays whole for
    the pair's next transfer."""

    def __init__(self, src: int, final: Path, folder: Path, chunk_bytes: int) -> None:
        self.src, self.final, self.folder, self.chunk_bytes = src, final, folder, chunk_bytes
        self.failure: CheckpointError | None = None
        self.lock = threading.Lock()
        self.reader: ChunkReader | None = None
        self.writers = ThreadPoolExecutor(_WRITERS, thread_name_prefix="zerostall-transfer-write")
        self.checks = ThreadPoolExecutor(1, thread_name_prefix="zerostall-transfer-check")
        self.checked: list[Future[int]] = []
        # a buffer is reused once the chunk in it is written; the wire holds fewer than _IN_FLIGHT chunks
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(_IN_FLIGHT + _WRITERS)]
        self.writes: list[Future[None] | None] = [None] * len(self.buffers)
        self.file_writes: dict[str, list[Future[None]]] = {}

    def receive(self, wire: _Wire, files: list[tuple[str, int]]) -> None:
        self.names = {name for name, _ in files}
        fds = self._create(files)
        try:
            k = 0
            for name, size in files:
                for offset in range(0, size, self.chunk_bytes):
                    slot, k = k % len(self.buffers), k + 1
                    if self.writes[slot] is not None:
                        self.writes[slot].result()
                    buf = self.buffers[slot][:min(self.chunk_bytes, size - offset)]
                    wire.receive(buf, lambda slot=slot, fd=fds.get(name), name=name, buf=buf, offset=offset:
                                 self._write_later(slot, fd, name, buf, offset))
                wire.then(lambda name=name: self._arrived(name))
            wire.finish()
        finally:
            self.writers.shutdown()
            for fd in fds.values():
                os.close(fd)
            self.checks.shutdown()
        for future in self.checked:
            if future.exception() is not None:
                self._fail(future.exception())
        if self.failure is not None:
            raise self.failure

    def _create(self, files: list[tuple[str, int]]) -> dict[str, int]:
        """A descriptor of each file, made empty; none after a failure."""
        fds: dict[str, int] = {}
        try:
            if not files or files[0][0] != MANIFEST_NAME:
                raise CorruptCheckpointError(f"its file list does not begin with {MANIFEST_NAME}")
            self.folder.mkdir(parents=True)
            for name, _ in files:
                fds[name] = os.open(self.folder / check_name(name), _CREATE_FLAGS, 0o644)
        except FileExistsError:
            self._fail(CorruptCheckpointError("its file list names a file twice"))
        except (CheckpointError, OSError) as exc:
            self._fail(exc)
        return fds

    def _write_later(self, slot: int, fd: int | None, name: str, buf: torch.Tensor, offset: int) -> None:
        """A chunk has arrived in buffer ``slot``: write it into its file in the background."""
        if self.failure is None and fd is not None:
            self.writes[slot] = self.writers.submit(self._write, fd, buf, offset)
            self.file_writes.setdefault(name, []).append(self.writes[slot])

    def _write(self, fd: int, buf: torch.Tensor, offset: int) -> None:
        try:
            view = memoryview(buf.numpy())
            while len(view):
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            self._fail(exc)

    def _arrived(self, name: str) -> None:
        """File ``name`` is whole: the manifest is read (and the file list checked against it), a
        data file checked in the background."""
        if self.failure is not None:
            return
        written = self.file_writes.pop(name, [])
        if name == MANIFEST_NAME:
            for future in written:
                future.result()
            storage = LocalStorage(os.fspath(self.folder), fsync=False)
            try:
                manifest = read_manifest(storage)
                listed = {MANIFEST_NAME, *manifest.files}
                if self.names != listed:
                    raise CorruptCheckpointError(f"its files are not those its manifest lists (not listed: "
                                                 f"{sorted(self.names - listed)[:5]}, not sent: "
                                                 f"{sorted(listed - self.names)[:5]})")
            except CheckpointError as exc:
                self._fail(exc)
                return
            self.reader = ChunkReader(storage, manifest, default_threads())
            self.checked.append(self.checks.submit(verify_all, self.reader, allow_pickle=False, files=()))
        elif self.reader is not None:
            self.checked.append(self.checks.submit(self._check, name, written))

    def _check(self, name: str, written: list[Future[None]]) -> int:
        for future in written:
            future.result()
        assert self.reader is not None  # set before any data file arrives
        return verify_all(self.reader, allow_pickle=False, files={name})

    def _fail(self, exc: BaseException) -> None:
        """Keep the first failure, as the error that names the source rank and what failed."""
        with self.lock:
            if self.failure is None:
                self.failure = self._error(exc)

    def _error(self, exc: BaseException) -> CheckpointError:
        message = str(exc).replace(str(self.folder), "(as received)")
        if isinstance(exc, CorruptCheckpointError):
            return CorruptCheckpointError(f"the copy rank {self.src} sent for {self.final} failed its checks, so it "
                                          f"was not kept: {message}")
        if isinstance(exc, CheckpointError):
            return CheckpointError(f"the copy rank {self.src} sent for {self.final} could not be checked, so it was "
                                   f"not kept: {message}")
        return CheckpointError(f"cannot write the copy rank {self.src} sent into {self.folder}: "
                               f"{type(exc).__name__}: {exc}")


def _publish(incoming: Path, final: Path) -> None:
    """Rename ``incoming`` to ``final``; a copy already there is first renamed aside, then removed,
    so ``final`` never holds a mixture of two copies."""
    old = None
    if final.exists():
        old = final.parent / f"{INCOMING}{final.name}-{secrets.token_hex(4)}-replaced"
        os.rename(final, old)
    os.rename(incoming, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _send_header(pg: Any, dst: int, header: dict[str, Any]) -> None:
    data = torch.frombuffer(bytearray(dump_json(header)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), group_dst=dst, group=pg)
    dist.send(data, group_dst=dst, group=pg)


def _receive_header(pg: Any, src: int, final: Path) -> list[tuple[str, int]] | None:
    """The files (names and sizes) of the copy ``src`` sends, or None when it has none; a header
    of the wrong shape is a :class:`CorruptCheckpointError` (the stream cannot be followed further)."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, group_src=src, group=pg)
    n = int(length.item())
    if not 0 < n <= _HEADER_LIMIT:
        raise CorruptCheckpointError(f"rank {src} announced a header of {n} bytes for {final}: not a copy (refused)")
    data = torch.empty(n, dtype=torch.uint8)
    dist.recv(data, group_src=src, group=pg)
    try:
        header = load_json(data.numpy().tobytes())
    except ValueError as exc:
        raise CorruptCheckpointError(f"rank {src} sent a header for {final} that is not JSON: {exc}") from None
    if isinstance(header, dict) and "error" in header:
        raise CheckpointError(f"rank {src} could not send its copy for {final}: {header['error']}")
    files = header.get("files", ()) if isinstance(header, dict) else ()
    if files is None:
        return None
    if not (isinstance(files, list) and all(isinstance(f, list) and len(f) == 2 and type(f[1]) is int and f[1] >= 0
                                            for f in files)):
        raise CorruptCheckpointError(f"rank {src} sent a header for {final} of the wrong shape: {header!r:.200}")
    return [(name, size) for name, size in files]


class _Wire:
    """The chunks of one transfer on the wire, at most ``_IN_FLIGHT`` at once, completed in order."""

    def __init__(self, pg: Any, peer: int) -> None:
        self.pg, self.peer = pg, peer
        self.works: deque[tuple[Any, torch.Tensor | None, Callable[[], None] | None]] = deque()

    def send(self, data: torch.Tensor) -> None:
        self._post(dist.isend(data, group_dst=self.peer, group=self.pg), data, None)

    def receive(self, into: torch.Tensor, then: Callable[[], None]) -> None:
        """Receive the next chunk into ``into``; ``then()`` runs once it has arrived."""
        self._post(dist.irecv(into, group_src=self.peer, group=self.pg), into, then)

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once every chunk posted so far has arrived (or been sent)."""
        self._post(None, None, fn)

    def finish(self) -> None:
        while self.works:
            self._complete_one()

    def _post(self, work: Any, data: torch.Tensor | None, then: Callable[[], None] | None) -> None:
        """Queue a transfer (or only a callback); complete the oldest while ``_IN_FLIGHT`` are queued."""
        self.works.append((work, data, then))  # the tensor stays referenced until its transfer is done
        if len(self.works) >= _IN_FLIGHT:
            self._complete_one()

    def _complete_one(self) -> None:
        work, _, then = self.works.popleft()
        if work is not None:
            work.wait()
        if then is not None:
            then()
