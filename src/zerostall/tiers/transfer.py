"""Copies between ranks: a rank's copy (a directory holding one committed checkpoint) sent over a
process group, verified where it arrives before it is published.

Each transfer is one stream between two ranks: a header (the length of a JSON document, then the
document: the copy's file names and sizes, or why there is nothing), then the bytes of the files,
manifest first, in chunks, a few on the wire at once. No pickling, no collective: point-to-point
messages only, every wait bounded by the group's own timeout. Files are memory-mapped on both
sides, so the network reads and writes the page cache with no copy in between. The receiver
writes into a sibling folder named ``.incoming-...`` (removed by the local tier at start-up if a
crash leaves one), checks every block against the checkpoint's checksums with
:func:`~zerostall.loading.verification.verify_all` (what ``zs.verify`` runs) file by file as
they arrive, and only then renames the folder into place. Files are not fsynced: a copy torn by
a power loss fails its checksums when it is read, and another copy is used.
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
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
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_IN_FLIGHT = 4  # chunks of one transfer on the wire at once


def exchange(pg: Any, sends: Sequence[tuple[int, Path | None]], receives: Sequence[tuple[int, Path]], *,
             chunk_bytes: int = 16 << 20) -> list[Path | None]:
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
            _Arrival(src, final, incoming).receive(_Wire(pg, src), files, chunk_bytes)
            _publish(incoming, final)
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise CheckpointError(f"receiving rank {src}'s copy for {final} failed (rank {src} died, or timed out): "
                              f"{exc}") from exc
    return final


class _Arrival:
    """One copy arriving into ``folder``: each file is received straight into its mapped file, and
    checked (:func:`verify_all` of that file) in the background once whole, while the next ones
    arrive. A failure (a name that is not a plain file name, a file that cannot be written, a
    check that fails) is raised once every byte has arrived, the rest dropped, so the stream stays
    whole for the pair's next transfer."""

    def __init__(self, src: int, final: Path, folder: Path) -> None:
        self.src, self.final, self.folder = src, final, folder
        self.failure: CheckpointError | None = None
        self.reader: ChunkReader | None = None
        self.checks = ThreadPoolExecutor(1, thread_name_prefix="zerostall-transfer-check")
        self.checked: list[Future[int]] = []

    def receive(self, wire: _Wire, files: list[tuple[str, int]], chunk_bytes: int) -> None:
        self.names = {name for name, _ in files}
        targets = self._create(files)
        drop = None
        try:
            for i, (name, size) in enumerate(files):
                for offset in range(0, size, chunk_bytes):
                    n = min(chunk_bytes, size - offset)
                    if self.failure is None:
                        wire.receive(targets[i][offset:offset + n])
                    else:
                        drop = torch.empty(chunk_bytes, dtype=torch.uint8) if drop is None else drop
                        wire.receive(drop[:n])
                wire.then(lambda name=name: self._arrived(name))
            wire.finish()
        finally:
            targets.clear()
            self.checks.shutdown()
        for future in self.checked:
            if future.exception() is not None:
                self._fail(future.exception())
        if self.failure is not None:
            raise self.failure

    def _create(self, files: list[tuple[str, int]]) -> list[torch.Tensor]:
        """Each file, made at its size (space taken now: a full disk fails here, not as a fault
        in a mapped page) and mapped; nothing after a failure."""
        targets: list[torch.Tensor] = []
        try:
            if not files or files[0][0] != MANIFEST_NAME:
                raise CorruptCheckpointError(f"its file list does not begin with {MANIFEST_NAME}")
            self.folder.mkdir(parents=True)
            for name, size in files:
                fd = os.open(self.folder / check_name(name), _CREATE_FLAGS, 0o644)
                try:
                    if size:
                        os.posix_fallocate(fd, 0, size)
                    mapped = mmap.mmap(fd, size) if size else bytearray()
                finally:
                    os.close(fd)
                targets.append(torch.frombuffer(mapped, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8))
        except FileExistsError:
            self._fail(CorruptCheckpointError("its file list names a file twice"))
        except (CheckpointError, OSError) as exc:
            self._fail(exc)
        return targets

    def _arrived(self, name: str) -> None:
        """File ``name`` is whole: the manifest is read (and the file list checked against it), a
        data file checked in the background."""
        if self.failure is not None:
            return
        if name == MANIFEST_NAME:
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
            self.checked.append(self.checks.submit(verify_all, self.reader, allow_pickle=False, files={name}))

    def _fail(self, exc: BaseException) -> None:
        """Keep the first failure, as the error that names the source rank and what failed."""
        if self.failure is not None:
            return
        message = str(exc).replace(str(self.folder), "(as received)")
        if isinstance(exc, CorruptCheckpointError):
            self.failure = CorruptCheckpointError(f"the copy rank {self.src} sent for {self.final} failed its checks, "
                                                  f"so it was not kept: {message}")
        elif isinstance(exc, CheckpointError):
            self.failure = CheckpointError(f"the copy rank {self.src} sent for {self.final} could not be checked, so "
                                           f"it was not kept: {message}")
        else:
            self.failure = CheckpointError(f"cannot write the copy rank {self.src} sent into {self.folder}: "
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

    def receive(self, into: torch.Tensor) -> None:
        self._post(dist.irecv(into, group_src=self.peer, group=self.pg), into, None)

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once every chunk posted so far has arrived (or been sent)."""
        self.works.append((None, None, fn))

    def finish(self) -> None:
        while self.works:
            self._complete_one()

    def _post(self, work: Any, data: torch.Tensor, then: Callable[[], None] | None) -> None:
        self.works.append((work, data, then))  # the tensor stays referenced until its transfer is done
        if len(self.works) >= _IN_FLIGHT:
            self._complete_one()

    def _complete_one(self) -> None:
        work, _, then = self.works.popleft()
        if work is not None:
            work.wait()
        if then is not None:
            then()
