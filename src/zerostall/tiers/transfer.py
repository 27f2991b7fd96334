"""Copies between ranks: a rank's copy (a directory holding one committed checkpoint) sent over a
process group, verified where it arrives before it is published.

Each transfer is one stream between two ranks (:mod:`zerostall.tiers.stream`): a header, then the
bytes of the files, manifest first, in chunks, a few on the wire at once. No pickling, no
collective: point-to-point messages only, every wait bounded by the group's own timeout. The
sender's files are memory-mapped (the network reads the page cache, no copy in between). The
receiver checks each data file's bytes as they arrive, against the manifest that came first,
before writing them (:class:`~zerostall.loading.verification.ArrivingFile`: every check
``zs.verify`` makes, with no read-back), a few files at once, into a sibling folder
``.incoming-...`` (removed by the local tier at start-up if a crash leaves one), renamed into
place once every file has passed. Files are not fsynced: a copy torn by a power loss fails its
checksums when it is read, and another is used.

A restore receives its own copy straight into the state where it can (``place``): each tensor
that lies in one chunk of the copy and whose memory can take its bytes as they are (contiguous,
of the same dtype and shape) is received into that memory and checked there, as the raw transport
would receive it (on a GPU: into a buffer, checked, then copied there), instead of being written
to a file and read back; the rest of the copy arrives into its folder as above, is loaded from
there, and the folder, which lacks the placed bytes, is never published.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import shutil
import threading
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.checksums import CACHE_PIECE
from ..format.envelope import manifest_body
from ..format.layout import MANIFEST_NAME, Manifest, chunk_items, file_names
from ..format.manifest_check import parse_head
from ..gcpause import gc_paused
from ..loading.opening import read_manifest, read_manifest_bytes
from ..loading.reader import ChunkReader
from ..loading.verification import ArrivingFile, arriving_files, verify_all
from ..roots.described import DAMAGE
from ..storage.base import check_name
from ..storage.local import LocalStorage, open_regular
from .local import INCOMING, replaced_path
from .placing import PLACEABLE, Placer, Spans, direct
from .stream import CHUNK_LIMIT, IN_FLIGHT, LinkError, Plan, Wire, plan_header, receive_header, send_header

log = logging.getLogger(__name__)

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_WRITERS = 4  # files of one copy that travel, and are written, at once


@dataclass(frozen=True)
class Landed:
    """A copy received: ``folder`` holds it, with its ``manifest`` as read and checked on arrival
    (no need to read it again). When entries went straight into memory (``placed``, dotted names),
    ``folder`` lacks their bytes and is never published: load it leaving them out, then remove it;
    else it is the published copy."""

    folder: Path
    placed: frozenset[str]
    manifest: Manifest


def exchange(pg: Any, sends: Sequence[tuple[int, Path | None]], receives: Sequence[tuple[int, Path]], *,
             step: int | None = None, chunk_bytes: int = 4 << 20, cut: bool = False,
             place: Placer | None = None) -> list[Landed | None]:
    """Run every transfer of this rank at once (no deadlock: each rank may send to and receive from
    several ranks, the same ones included). ``sends``: (destination rank in ``pg``, copy directory,
    or None when this rank has nothing: the receiver is told so), sent in chunks of ``chunk_bytes``.
    ``receives``: (source rank, the directory to publish the copy as; one there is replaced).
    ``step``: the step the copies are of, which each sender announces and each receiver checks.
    ``cut``: cut each stream sent at the bounds of its large tensors, for a receiver that puts them
    into memory (it reads the whole manifest: a restore's senders do, a replication's do not);
    ``place``: put what it can of each received copy straight into memory (see the module's
    docstring). Returns, per receive, how the copy landed (:class:`Landed`), or None when the
    sender had nothing. Raises once every transfer has ended: a copy that fails its checks is
    :class:`CorruptCheckpointError` naming the source rank and the file (nothing is published), a
    peer that died or timed out a :class:`LinkError` naming it."""
    me = dist.get_rank(pg)
    for what, peers in (("send to", [r for r, _ in sends]), ("receive from", [r for r, _ in receives])):
        if len(set(peers)) != len(peers) or me in peers or not all(0 <= r < dist.get_world_size(pg) for r in peers):
            raise ValueError(f"exchange on rank {me}: each rank to {what} must be another rank of the group, once: "
                             f"{peers}")
    if not 0 < chunk_bytes <= CHUNK_LIMIT:
        raise ValueError(f"exchange: chunk_bytes must be in 1..{CHUNK_LIMIT}, not {chunk_bytes}")
    if not (sends or receives):
        return []
    jobs = [lambda r=r, p=p: _send(pg, r, None if p is None else Path(p), step, chunk_bytes, cut) for r, p in sends]
    jobs += [lambda r=r, p=p: _receive(pg, r, Path(p), step, place) for r, p in receives]
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="zerostall-transfer") as pool:
        futures = [pool.submit(job) for job in jobs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures[len(sends):]:  # a copy received partly into memory, if this rank's send failed
            landed = f.result() if f.exception() is None else None
            if landed is not None and landed.placed:
                shutil.rmtree(landed.folder, ignore_errors=True)
        raise next((e for e in errors if isinstance(e, LinkError)), errors[0])  # a broken link first: it lasts
    return [f.result() for f in futures[len(sends):]]


def _send(pg: Any, dst: int, copy: Path | None, step: int | None, chunk_bytes: int, cut: bool) -> None:
    """Send ``copy`` (its manifest first, then the files it lists) to ``dst``; None: word that there is none."""
    try:
        try:
            files, data, cuts = ([], [], []) if copy is None else _open_copy(copy, cut)
        except (CheckpointError, OSError) as exc:  # the receiver learns why
            damaged = (isinstance(exc, (*DAMAGE, FileNotFoundError))
                       and not isinstance(exc, CheckpointNotFoundError))  # a file of it gone, not the whole copy
            send_header(pg, dst, {"step": step, "error": f"{type(exc).__name__}: {exc}", "damaged": damaged})
            if damaged:  # the copy's, not this rank's: the receiver reports it, and falls back to another copy
                log.warning("the copy %s for rank %d is damaged or incomplete (%s): not sent", copy, dst, exc)
                return
            raise CheckpointError(f"cannot send the copy {copy} to rank {dst}: {exc}") from exc
        if copy is None:
            send_header(pg, dst, {"step": step, "files": None})
            return
        plan = Plan(files, chunk_bytes, _WRITERS, cuts)
        send_header(pg, dst, {"step": step, **plan_header(plan)})
        wire = Wire(pg, dst)
        for _, chunks in plan.waves():
            for f, offset, n in chunks:
                wire.send(data[f][offset:offset + n])
        wire.finish()
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise LinkError(f"sending the copy {copy} to rank {dst} failed (rank {dst} died, or timed out): "
                              f"{exc}") from exc


def _open_copy(copy: Path, cut: bool) -> tuple[list[tuple[str, int]], list[torch.Tensor], list[list[int]]]:
    """The files of the committed copy ``copy`` (its manifest, then the data files it lists) with
    their sizes, their bytes, mapped (the network reads them from the page cache, no copy; a
    copy's files are never rewritten in place, so none shrinks under its map), and where each is
    cut (``cut``: the bounds of its chunks of at least :data:`PLACEABLE` bytes; else nowhere)."""
    storage = LocalStorage(os.fspath(copy), fsync=False)
    raw = read_manifest_bytes(storage)
    head = parse_head(raw, os.path.join(copy, MANIFEST_NAME))  # the file list: no entries to parse
    bounds: dict[str, set[int]] = {name: set() for name in head.files}
    if cut:
        with gc_paused():  # the body's own checks are the receiver's: here its chunks' bounds only
            body = manifest_body(raw, os.fspath(copy))
            names = file_names(body)
            for entry in body["entries"]:
                for c in entry["chunks"] if entry.get("kind") == "tensor" else ():
                    _, _, file, offset, nbytes, _ = chunk_items(c, names)
                    if nbytes >= PLACEABLE and file in bounds:
                        bounds[file].update((offset, offset + nbytes))
            del body
    files, data, cuts = [], [], []
    for name in [MANIFEST_NAME, *head.files]:
        fd, size = open_regular(os.path.join(copy, check_name(name)))
        try:
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else bytearray()
        finally:
            os.close(fd)
        files.append((name, size))
        data.append(torch.frombuffer(mapped, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8))
        cuts.append(sorted(c for c in bounds.get(name, ()) if 0 < c < size))
    return files, data, cuts


def _receive(pg: Any, src: int, final: Path, step: int | None, place: Placer | None) -> Landed | None:
    """Receive ``src``'s copy into a folder beside ``final`` (into memory what ``place`` allows),
    verify it, publish it as ``final`` (unless something went into memory)."""
    try:
        plan = receive_header(pg, src, final, step)
        if plan is None:
            return None
        incoming = final.parent / f"{INCOMING}{final.name}-{secrets.token_hex(4)}"
        try:
            arrival = _Arrival(src, final, incoming, plan, place)
            arrival.receive(Wire(pg, src))
            if arrival.spans and arrival.spans.placed:
                return Landed(incoming, frozenset(arrival.spans.placed), arrival.manifest)
            _publish(incoming, final)
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
    except RuntimeError as exc:  # what torch.distributed raises for a dead peer or a timeout
        raise LinkError(f"receiving rank {src}'s copy for {final} failed (rank {src} died, or timed out): "
                              f"{exc}") from exc
    return Landed(final, frozenset(), arrival.manifest)


class _Arrival:
    """One copy arriving into ``folder``. The manifest arrives first; then each chunk of a data file
    arrives into a buffer, is hashed into its file's checks (:class:`ArrivingFile`: its size, header
    and every block, against the manifest) and written by its file's writer thread (a file's chunks
    go to one writer, in order) while the next ones arrive; a chunk of a tensor that ``place`` put
    into memory arrives there and is only hashed; each wave then waits for the one before to be
    checked, so once a check fails the waves after it arrive into buffers, not memory. A failure (a
    name that is not a plain file name, a file that cannot be written, a check that fails) is raised
    once every byte has arrived, the rest dropped, so the stream stays whole for the pair's next
    transfer."""

    def __init__(self, src: int, final: Path, folder: Path, plan: Plan, place: Placer | None = None) -> None:
        self.src, self.final, self.folder, self.plan, self.place = src, final, folder, plan, place
        self.spans: Spans | None = None  # where in memory chunks arrive, once the manifest is read
        self.names = [name for name, _ in plan.files]
        self.failure: CheckpointError | None = None
        self.lock = threading.Lock()
        self.writers = [ThreadPoolExecutor(1, thread_name_prefix="zerostall-transfer-write") for _ in range(_WRITERS)]
        self.lanes: dict[int, ThreadPoolExecutor] = {}  # the writer of each file (by index) of the current wave
        self.arriving: dict[int, ArrivingFile] = {}  # each data file's checks, once the manifest is read
        self.checks = ThreadPoolExecutor(1, thread_name_prefix="zerostall-transfer-check")
        self.described: Future[int] | None = None  # the manifest's entries checked (verify_all of no file)
        self.manifest: Manifest | None = None  # once read
        # a buffer is reused once the chunk in it is written; the wire holds fewer than IN_FLIGHT chunks
        self.buffers = [torch.empty(plan.chunk, dtype=torch.uint8) for _ in range(IN_FLIGHT + _WRITERS)]
        self.writes: list[Future[None] | None] = [None] * len(self.buffers)

    def receive(self, wire: Wire) -> None:
        fds = self._create()
        try:
            k = 0
            for group, chunks in self.plan.waves():
                if self.spans is not None and group[0] > 1:
                    self._settle(wire)
                self.lanes.update((f, self.writers[i % _WRITERS]) for i, f in enumerate(group))
                for f, offset, n in chunks:
                    into = self.spans.memory(f, offset, n) if self.spans and self.failure is None else None
                    if into is not None and direct(into):  # else into a buffer (failed: unused)
                        wire.receive(into, lambda f=f, into=into, offset=offset:
                                     self._store_later(None, fds.get(f), f, into, offset))
                        continue
                    slot, k = k % len(self.buffers), k + 1
                    if self.writes[slot] is not None:
                        self.writes[slot].result()
                    buf = self.buffers[slot][:n]
                    wire.receive(buf, lambda slot=slot, f=f, buf=buf, offset=offset, into=into:
                                 self._store_later(slot, fds.get(f), f, buf, offset, into))
                if group == [0]:  # the manifest read before any data chunk is posted: it says where they go
                    wire.finish()
                    self._arrived(group)
                else:
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

    def _settle(self, wire: Wire) -> None:
        """Wait until every chunk of the wave before has arrived and been checked, so a failure in
        it is known before the next wave decides what it receives into memory."""
        wire.finish()
        for writer in self.writers:
            writer.submit(lambda: None).result()

    def _create(self) -> dict[int, int]:
        """A descriptor of each file (by index), made empty; none after a failure."""
        fds: dict[int, int] = {}
        try:
            if self.names[0] != MANIFEST_NAME:
                raise CorruptCheckpointError(f"its file list does not begin with {MANIFEST_NAME}")
            self.folder.mkdir(parents=True)
            for f, (name, size) in enumerate(self.plan.files):
                fds[f] = os.open(self.folder / check_name(name), _CREATE_FLAGS, 0o644)
                os.ftruncate(fds[f], size)  # its listed size, holes where bytes went into memory
        except FileExistsError:
            self._fail(CorruptCheckpointError("its file list names a file twice"))
        except (CheckpointError, OSError) as exc:
            self._fail(exc)
        return fds

    def _store_later(self, slot: int | None, fd: int | None, f: int, buf: torch.Tensor, offset: int,
                     into: torch.Tensor | None = None) -> None:
        """A chunk of file ``f`` has arrived in buffer ``slot`` (None: into memory, where it stays):
        check it, then write it to its file or copy it ``into`` memory (a GPU's), in the background."""
        if self.failure is None and fd is not None:
            done = self.lanes[f].submit(self._store, None if slot is None or into is not None else fd, f, buf, offset,
                                        into)
            if slot is not None:
                self.writes[slot] = done

    def _store(self, fd: int | None, f: int, buf: torch.Tensor, offset: int, into: torch.Tensor | None) -> None:
        """Check the chunk, then write it to ``fd`` or copy it ``into`` memory (neither: only check),
        unless the copy has failed meanwhile."""
        try:
            if self.failure is None:
                _check_and_write(fd, memoryview(buf.numpy()), offset, self.arriving.get(f))
            if into is not None and self.failure is None:
                into.copy_(buf)  # before the buffer is reused: from pageable memory a copy is done when it returns
        except Exception as exc:  # whatever it is, the copy is not taken
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
        self.manifest = manifest
        self.described = self.checks.submit(verify_all, reader, allow_pickle=False, files=())
        if self.place is not None:
            self.spans = Spans(self.plan, manifest, self.place)

    def _finish(self, f: int) -> None:
        try:
            if self.failure is None:
                self.arriving[f].finish()
        except Exception as exc:  # whatever it is, the copy is not taken
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


def _check_and_write(fd: int | None, data: memoryview, offset: int, arriving: ArrivingFile | None) -> None:
    """Hash each cache-sized piece of ``data`` into ``arriving``'s checks (None: the manifest, read
    once written), then write it at ``offset`` of ``fd`` (the piece read from the cache once hashed;
    None: not written)."""
    for lo in range(0, len(data), CACHE_PIECE):
        view, at = data[lo:lo + CACHE_PIECE], offset + lo
        if arriving is not None:
            arriving.update(view)
        while fd is not None and len(view):
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n


def _publish(incoming: Path, final: Path) -> None:
    """Rename ``incoming`` to ``final``; a copy already there is first renamed aside, then removed,
    so ``final`` never holds a mixture of two copies."""
    old = None
    if final.exists():
        old = replaced_path(final)
        os.rename(final, old)
    os.rename(incoming, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
