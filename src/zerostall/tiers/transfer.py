"""Copies between ranks: a rank's copy (a directory holding one committed checkpoint) sent over a
process group, verified where it arrives before it is published.

Each transfer is one stream between two ranks: a header (the length of a JSON document, then the
document: the copy's file names and sizes, or why there is nothing), then the bytes of the files
in chunks, each file from offset 0, through two preallocated buffers a side so reading a file (or
writing it) overlaps with the network. No pickling, no collective: point-to-point messages only,
every wait bounded by the group's own timeout. The receiver writes into a sibling folder named
``.incoming-...`` (removed by the local tier at start-up if a crash leaves one), checks every block
against the checkpoint's checksums with :func:`~zerostall.loading.verification.verify_all` (what
``zs.verify`` runs), and only then renames it into place. Files are not fsynced: a copy torn by a
power loss fails its checksums when it is read, and another copy is used.
"""

from __future__ import annotations

import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

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
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


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
    fds: list[tuple[str, int, int]] = []
    try:
        try:
            if copy is None:
                header: dict[str, Any] = {"files": None}
            else:
                manifest = read_manifest(LocalStorage(os.fspath(copy), fsync=False))
                for name in [MANIFEST_NAME, *manifest.files]:
                    fds.append((name, *open_regular(os.path.join(copy, check_name(name)))))
                header = {"files": [[name, size] for name, _, size in fds]}
        except (CheckpointError, OSError) as exc:  # the receiver learns why, then this rank raises it
            _send_header(pg, dst, {"error": f"{type(exc).__name__}: {exc}"})
            raise CheckpointError(f"cannot send the copy {copy} to rank {dst}: {exc}") from exc
        _send_header(pg, dst, header)
        stream = _Stream(pg, dst, chunk_bytes)
        for name, fd, size in fds:
            for offset in range(0, size, chunk_bytes):
                buf = stream.buffer(min(chunk_bytes, size - offset))
                if os.preadv(fd, [buf.numpy()], offset) != buf.numel():
                    raise CheckpointError(f"{copy / name} shrank while it was sent to rank {dst}")
                stream.send(buf)
        stream.drain()
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise CheckpointError(f"sending the copy {copy} to rank {dst} failed (rank {dst} died, or timed out): "
                              f"{exc}") from exc
    finally:
        for _, fd, _ in fds:
            os.close(fd)


def _receive(pg: Any, src: int, final: Path, chunk_bytes: int) -> Path | None:
    """Receive ``src``'s copy into a folder beside ``final``, verify it, publish it as ``final``."""
    try:
        files = _receive_header(pg, src, final)
        if files is None:
            return None
        incoming = final.parent / f"{INCOMING}{final.name}-{secrets.token_hex(4)}"
        try:
            _receive_files(pg, src, files, incoming, final, chunk_bytes)
            _verify(incoming, src, final, {name for name, _ in files})
            _publish(incoming, final)
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise CheckpointError(f"receiving rank {src}'s copy for {final} failed (rank {src} died, or timed out): "
                              f"{exc}") from exc
    return final


def _receive_files(pg: Any, src: int, files: list[tuple[str, int]], folder: Path, final: Path,
                   chunk_bytes: int) -> None:
    """Receive the bytes of ``files`` into ``folder`` (made here). A name that is not a plain file name (or comes
    twice) is refused, and a file that cannot be written fails, once every byte has arrived (and
    been dropped), so the stream stays whole for the next transfer."""
    failure: CheckpointError | None = None
    fds: dict[str, int] = {}
    try:
        try:
            folder.mkdir(parents=True)
            for name, _ in files:
                if check_name(name) in fds:
                    raise CorruptCheckpointError(f"{name!r} comes twice in its file list")
                fds[name] = os.open(folder / name, _WRITE_FLAGS, 0o644)
        except CorruptCheckpointError as exc:
            failure = CorruptCheckpointError(f"the copy rank {src} sent for {final} was refused: {exc}")
        except OSError as exc:
            failure = CheckpointError(f"cannot write rank {src}'s copy into {folder}: {exc}")
        pieces = [(name, offset) for name, size in files for offset in range(0, size, chunk_bytes)]
        sizes = (min(chunk_bytes, size - offset) for name, size in files for offset in range(0, size, chunk_bytes))
        for (name, offset), buf in zip(pieces, _Stream(pg, src, chunk_bytes).received(sizes)):
            if failure is None:
                try:
                    _write_all(fds[name], buf.numpy(), offset)
                except OSError as exc:
                    failure = CheckpointError(f"cannot write rank {src}'s copy into {folder}: {exc}")
    finally:
        for fd in fds.values():
            os.close(fd)
    if failure is not None:
        raise failure


def _verify(folder: Path, src: int, final: Path, received: set[str]) -> None:
    """Check every file size and every block of the copy in ``folder`` (see :func:`verify_all`), and
    that it holds exactly the files its manifest lists."""
    storage = LocalStorage(os.fspath(folder), fsync=False)
    try:
        manifest = read_manifest(storage)
        extra = received - {MANIFEST_NAME, *manifest.files}
        if extra:
            raise CorruptCheckpointError(f"files its manifest does not list: {sorted(extra)[:5]}")
        verify_all(ChunkReader(storage, manifest, default_threads()), allow_pickle=False)
    except CheckpointError as exc:
        kind = CorruptCheckpointError if isinstance(exc, CorruptCheckpointError) else CheckpointError
        raise kind(f"the copy rank {src} sent for {final} failed verification, so it was not kept: "
                   f"{str(exc).replace(str(folder), '(as received)')}") from exc


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


def _write_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _Stream:
    """The chunks of one transfer in flight, through two preallocated buffers: one is filled (read
    from a file, or written to one) while the other is on the wire."""

    def __init__(self, pg: Any, peer: int, chunk_bytes: int) -> None:
        self.pg, self.peer = pg, peer
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        self.works: list[Any] = [None, None]
        self.turn = 0

    def buffer(self, n: int) -> torch.Tensor:
        """The next buffer to fill for sending, once the send it held has completed."""
        work = self.works[self.turn]
        if work is not None:
            work.wait()
        return self.buffers[self.turn][:n]

    def send(self, buf: torch.Tensor) -> None:
        self.works[self.turn] = dist.isend(buf, group_dst=self.peer, group=self.pg)
        self.turn ^= 1

    def drain(self) -> None:
        for work in self.works:
            if work is not None:
                work.wait()

    def received(self, sizes: Iterable[int]) -> Iterator[torch.Tensor]:
        """The chunks of these sizes as they arrive: while one is handed out, the next arrives into
        the other buffer."""
        pending = iter(sizes)
        n, slot = next(pending, None), self.turn
        if n is not None:
            self._post(n)
        while n is not None:
            self.works[slot].wait()
            following = next(pending, None)
            if following is not None:
                self._post(following)
            yield self.buffers[slot][:n]
            n, slot = following, slot ^ 1

    def _post(self, n: int) -> None:
        self.works[self.turn] = dist.irecv(self.buffers[self.turn][:n], group_src=self.peer, group=self.pg)
        self.turn ^= 1
