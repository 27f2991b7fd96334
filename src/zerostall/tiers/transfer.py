"""Copies between ranks: a rank's copy (a directory holding one committed checkpoint) sent over a
process group, verified where it arrives before it is published.

Each transfer is one stream between two ranks: a header (the length of a JSON document, then the
document: the copy's file names and sizes, or why there is nothing), then the bytes of the files,
manifest first, in chunks, a few on the wire at once. No pickling, no collective: point-to-point
messages only, every wait bounded by the group's own timeout. The sender's files are
memory-mapped (the network reads the page cache, no copy in between). The receiver checks each
data file's bytes as they arrive, against the manifest that came first, before writing them
(:class:`~zerostall.loading.verification.ArrivingFile`: every check ``zs.verify`` makes, with no
read-back), a few files at once, into a sibling folder ``.incoming-...`` (removed by the local
tier at start-up if a crash leaves one), renamed into place once every file has passed. Files are
not fsynced: a copy torn by a power loss fails its checksums when it is read, and another is used.
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
import threading
from itertools import zip_longest
from collections import deque
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksums import CACHE_PIECE
from ..format.layout import MANIFEST_NAME, dump_json, load_json
from ..loading.opening import read_manifest, read_manifest_head
from ..loading.reader import ChunkReader
from ..loading.verification import ArrivingFile, arriving_files, verify_all
from ..storage.base import check_name
from ..storage.local import LocalStorage, open_regular

INCOMING = ".incoming-"
"""The prefix of a copy's folder while it arrives, beside the folder it is published as."""

_HEADER_LIMIT = 64 << 20  # a copy's names and sizes; more is a broken or hostile stream
_CHUNK_LIMIT = 64 << 20  # the largest chunk a receiver takes (it holds a few)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_IN_FLIGHT = 4  # chunks of one transfer on the wire at once
_WRITERS = 4  # files of one copy that travel, and are written, at once


def exchange(pg: Any, sends: Sequence[tuple[int, Path | None]], receives: Sequence[tuple[int, Path]], *,
             chunk_bytes: int = 4 << 20) -> list[Path | None]:
    """Run every transfer of this rank at once (no deadlock: each rank may send to and receive from
    several ranks, the same ones included). ``sends``: (destination rank in ``pg``, copy directory,
    or None when this rank has nothing: the receiver is told so), sent in chunks of ``chunk_bytes``.
    ``receives``: (source rank, the directory to publish the copy as; one there is replaced).
    Returns, per receive, that directory, or None when the sender had nothing. Raises once every
    transfer has ended: a copy that fails its checks is :class:`CorruptCheckpointError` naming the
    source rank and the file (nothing is published), a peer that died or timed out a
    :class:`CheckpointError` naming it."""
    me = dist.get_rank(pg)
    for what, peers in (("send to", [r for r, _ in sends]), ("receive from", [r for r, _ in receives])):
        if len(set(peers)) != len(peers) or me in peers or not all(0 <= r < dist.get_world_size(pg) for r in peers):
            raise ValueError(f"exchange on rank {me}: each rank to {what} must be another rank of the group, once: "
                             f"{peers}")
    if not 0 < chunk_bytes <= _CHUNK_LIMIT:
        raise ValueError(f"exchange: chunk_bytes must be in 1..{_CHUNK_LIMIT}, not {chunk_bytes}")
    if not (sends or receives):
        return []
    jobs = [lambda r=r, p=p: _send(pg, r, None if p is None else Path(p), chunk_bytes) for r, p in sends]
    jobs += [lambda r=r, p=p: _receive(pg, r, Path(p)) for r, p in receives]
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="zerostall-transfer") as pool:
        futures = [pool.submit(job) for job in jobs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return [f.result() for f in futures[len(sends):]]


@dataclass(frozen=True)
class _Plan:
    """What a header announces: the files (names and sizes, the manifest first), the chunk size and
    how many files travel at once."""

    files: list[tuple[str, int]]
    chunk: int
    wave: int

    def waves(self) -> Iterator[tuple[list[int], Iterator[tuple[int, int, int]]]]:
        """The order the chunks travel in, by wave: (its files' indexes, its chunks as (file index,
        offset, size)). The manifest travels alone, then the other files ``wave`` at a time, their
        chunks in turn, so the receiver writes that many files at once (writes into one file wait
        for each other)."""
        starts = range(1, len(self.files), self.wave)
        for group in [[0]] + [list(range(i, min(i + self.wave, len(self.files)))) for i in starts]:
            turns = zip_longest(*(self._chunks(f) for f in group))
            yield group, (c for turn in turns for c in turn if c is not None)

    def _chunks(self, f: int) -> Iterator[tuple[int, int, int]]:
        size = self.files[f][1]
        for offset in range(0, size, self.chunk):
            yield f, offset, min(self.chunk, size - offset)


def _send(pg: Any, dst: int, copy: Path | None, chunk_bytes: int) -> None:
    """Send ``copy`` (its manifest first, then the files it lists) to ``dst``; None: word that there is none."""
    try:
        try:
            files, data = ([], []) if copy is None else _open_copy(copy)
        except (CheckpointError, OSError) as exc:  # the receiver learns why, then this rank raises it
            _send_header(pg, dst, {"error": f"{type(exc).__name__}: {exc}"})
            raise CheckpointError(f"cannot send the copy {copy} to rank {dst}: {exc}") from exc
        if copy is None:
            _send_header(pg, dst, {"files": None})
            return
        plan = _Plan(files, chunk_bytes, _WRITERS)
        _send_header(pg, dst, {"files": [list(f) for f in files], "chunk": plan.chunk, "wave": plan.wave})
        wire = _Wire(pg, dst)
        for _, chunks in plan.waves():
            for f, offset, n in chunks:
                wire.send(data[f][offset:offset + n])
        wire.finish()
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise CheckpointError(f"sending the copy {copy} to rank {dst} failed (rank {dst} died, or timed out): "
                              f"{exc}") from exc


def _open_copy(copy: Path) -> tuple[list[tuple[str, int]], list[torch.Tensor]]:
    """The files of the committed copy ``copy`` (its manifest, then the data files it lists) with
    their sizes, and their bytes, mapped (the network reads them from the page cache, no copy; a
    copy's files are never rewritten in place, so none shrinks under its map)."""
    head = read_manifest_head(LocalStorage(os.fspath(copy), fsync=False))  # the file list: no entries to parse
    files, data = [], []
    for name in [MANIFEST_NAME, *head.files]:
        fd, size = open_regular(os.path.join(copy, check_name(name)))
        try:
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else bytearray()
        finally:
            os.close(fd)
        files.append((name, size))
        data.append(torch.frombuffer(mapped, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8))
    return files, data


def _receive(pg: Any, src: int, final: Path) -> Path | None:
    """Receive ``src``'s copy into a folder beside ``final``, verify it, publish it as ``final``."""
    try:
        plan = _receive_header(pg, src, final)
        if plan is None:
            return None
        incoming = final.parent / f"{INCOMING}{final.name}-{secrets.token_hex(4)}"
        try:
            _Arrival(src, final, incoming, plan).receive(_Wire(pg, src))
            _publish(incoming, final)
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise CheckpointError(f"receiving rank {src}'s copy for {final} failed (rank {src} died, or timed out): "
                              f"{exc}") from exc
    return final


class _Arrival:
    """One copy arriving into ``folder``. The manifest arrives first; then each chunk of a data file
    arrives into a buffer, is hashed into its file's checks (:class:`ArrivingFile`: its size, header
    and every block, against the manifest) and written by its file's writer thread (a file's chunks
    go to one writer, in order) while the next ones arrive. A failure (a name that is not a plain
    file name, a file that cannot be written, a check that fails) is raised once every byte has
    arrived, the rest dropped, so the stream stays whole for the pair's next transfer."""

    def __init__(self, src: int, final: Path, folder: Path, plan: _Plan) -> None:
        self.src, self.final, self.folder, self.plan = src, final, folder, plan
        self.names = [name for name, _ in plan.files]
        self.failure: CheckpointError | None = None
        self.lock = threading.Lock()
        self.writers = [ThreadPoolExecutor(1, thread_name_prefix="zerostall-transfer-write") for _ in range(_WRITERS)]
        self.lanes: dict[int, ThreadPoolExecutor] = {}  # the writer of each file (by index) of the current wave
        self.arriving: dict[int, ArrivingFile] = {}  # each data file's checks, once the manifest is read
        self.checks = ThreadPoolExecutor(1, thread_name_prefix="zerostall-transfer-check")
        self.described: Future[int] | None = None  # the manifest's entries checked (verify_all of no file)
        # a buffer is reused once the chunk in it is written; the wire holds fewer than _IN_FLIGHT chunks
        self.buffers = [torch.empty(plan.chunk, dtype=torch.uint8) for _ in range(_IN_FLIGHT + _WRITERS)]
        self.writes: list[Future[None] | None] = [None] * len(self.buffers)

    def receive(self, wire: _Wire) -> None:
        fds = self._create()
        try:
            k = 0
            for group, chunks in self.plan.waves():
                self.lanes.update((f, self.writers[i % _WRITERS]) for i, f in enumerate(group))
                for f, offset, n in chunks:
                    slot, k = k % len(self.buffers), k + 1
                    if self.writes[slot] is not None:
                        self.writes[slot].result()
                    buf = self.buffers[slot][:n]
                    wire.receive(buf, lambda slot=slot, f=f, buf=buf, offset=offset:
                                 self._store_later(slot, fds.get(f), f, buf, offset))
                wire.then(lambda group=group: self._arrived(group))
            wire.finish()
        finally:
            for writer in self.writers:
                writer.shutdown()
            for fd in fds.values():
                os.close(fd)
            self.checks.shutdown()
        if self.described is not None and self.described.exception() is not None:
            self._fail(self.described.exception())
        if self.failure is not None:
            raise self.failure

    def _create(self) -> dict[int, int]:
        """A descriptor of each file (by index), made empty; none after a failure."""
        fds: dict[int, int] = {}
        try:
            if self.names[0] != MANIFEST_NAME:
                raise CorruptCheckpointError(f"its file list does not begin with {MANIFEST_NAME}")
            self.folder.mkdir(parents=True)
            for f, name in enumerate(self.names):
                fds[f] = os.open(self.folder / check_name(name), _CREATE_FLAGS, 0o644)
        except FileExistsError:
            self._fail(CorruptCheckpointError("its file list names a file twice"))
        except (CheckpointError, OSError) as exc:
            self._fail(exc)
        return fds

    def _store_later(self, slot: int, fd: int | None, f: int, buf: torch.Tensor, offset: int) -> None:
        """A chunk of file ``f`` has arrived in buffer ``slot``: check and write it in the background."""
        if self.failure is None and fd is not None:
            self.writes[slot] = self.lanes[f].submit(self._store, fd, f, buf, offset)

    def _store(self, fd: int, f: int, buf: torch.Tensor, offset: int) -> None:
        """Check and write the chunk, unless the copy has failed meanwhile."""
        try:
            if self.failure is None:
                _check_and_write(fd, memoryview(buf.numpy()), offset, self.arriving.get(f))
        except (CheckpointError, OSError) as exc:
            self._fail(exc)

    def _arrived(self, group: list[int]) -> None:
        """The files ``group`` have arrived: the manifest is read (the file list checked against it,
        each data file's checks made ready), a data file's last checks are made once it is written."""
        if self.failure is not None:
            return
        if group != [0]:
            for f in group:
                self.lanes[f].submit(self._finish, f)
            return
        self.lanes[0].submit(lambda: None).result()  # the manifest is written
        storage = LocalStorage(os.fspath(self.folder), fsync=False)
        try:
            manifest = read_manifest(storage)
            listed, names = {MANIFEST_NAME, *manifest.files}, set(self.names)
            if names != listed:
                raise CorruptCheckpointError(f"its files are not those its manifest lists (not listed: "
                                             f"{sorted(names - listed)[:5]}, not sent: {sorted(listed - names)[:5]})")
            reader = ChunkReader(storage, manifest, 1)
            arriving = arriving_files(reader, dict(self.plan.files[1:]))
            self.arriving = {f: arriving[name] for f, (name, _) in enumerate(self.plan.files[1:], 1)}
        except CheckpointError as exc:
            self._fail(exc)
            return
        self.described = self.checks.submit(verify_all, reader, allow_pickle=False, files=())

    def _finish(self, f: int) -> None:
        try:
            if self.failure is None:
                self.arriving[f].finish()
        except CheckpointError as exc:
            self._fail(exc)

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


def _check_and_write(fd: int, data: memoryview, offset: int, arriving: ArrivingFile | None) -> None:
    """Hash each cache-sized piece of ``data`` into ``arriving``'s checks (None: the manifest, read
    once written), then write it at ``offset`` of ``fd`` (the piece read from the cache once hashed)."""
    for lo in range(0, len(data), CACHE_PIECE):
        view, at = data[lo:lo + CACHE_PIECE], offset + lo
        if arriving is not None:
            arriving.update(view)
        while len(view):
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n


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


def _receive_header(pg: Any, src: int, final: Path) -> _Plan | None:
    """What the copy ``src`` sends holds, or None when it has none; a header of the wrong shape is a
    :class:`CorruptCheckpointError` (the stream cannot be followed further)."""
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
    header = header if isinstance(header, dict) else {}
    if "error" in header:
        raise CheckpointError(f"rank {src} could not send its copy for {final}: {header['error']}")
    files, chunk, wave = header.get("files", ()), header.get("chunk"), header.get("wave")
    if files is None:
        return None
    if not (isinstance(files, list) and files and all(isinstance(f, list) and len(f) == 2 and type(f[1]) is int
                                                      and f[1] >= 0 for f in files)
            and type(chunk) is int and 0 < chunk <= _CHUNK_LIMIT and type(wave) is int and 0 < wave <= 64):
        raise CorruptCheckpointError(f"rank {src} sent a header for {final} of the wrong shape: {header!r:.200}")
    return _Plan([(name, size) for name, size in files], chunk, wave)


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
