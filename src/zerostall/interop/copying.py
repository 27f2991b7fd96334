"""Copy one committed checkpoint to another location (local or S3, in any direction), every byte
checked against the manifest's checksums as it is read, before it is written.

Data files keep their names (the manifest references them) and are copied in parallel, a run of
whole checksum blocks at a time, from read buffers straight into the destination's writer (an S3
multipart upload). The manifest is published last, through the storage's atomic publish, as a save
commits: a copy interrupted at any point leaves no manifest, so no checkpoint, at the destination.
Run again, a copy keeps every data file already complete there (its size, header and every block
verified, read back from the destination) and copies the rest. No torch: the CLI's ``cp`` runs it.

A copy is self-contained: the chunks an incremental checkpoint reads from data files of other
checkpoints of its root are copied, checked the same way, into new data files of the copy (its
generation's, numbered after its own), packed back to back behind a header built here, and the
copy's manifest refers to nothing outside it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.layout import MANIFEST_NAME, Chunk, Entry, Manifest, generation_time
from ..loading.opening import read_manifest_bytes, read_manifest_from
from ..loading.reader import ChunkReader
from ..options import default_threads
from ..storage import Storage, storage_for
from ..storage.location import check_location, manifest_generation, publish_manifest, remove_stale, within
from ..storage.references import check_unreferenced, linked
from .contained import Moved, self_contained

log = logging.getLogger(__name__)

RUN_BYTES = 16 << 20
"""Bytes read, checked and handed to the writer at a time (whole checksum blocks, at least one)."""


@dataclass(frozen=True)
class CopyInfo:
    """What a copy did: the checkpoint's generation, the data files and bytes it copied, those it
    found complete at the destination and kept (a resumed copy), and how long it took."""

    source: str
    destination: str
    generation: str
    files: int
    bytes: int
    skipped_files: int
    skipped_bytes: int
    seconds: float
    moved_files: int = 0
    """The copy's data files holding the chunks the source referred to in other checkpoints."""

    @property
    def gb_per_s(self) -> float:
        """Bytes copied per second, in GB/s."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Check:
    """A checked span of a run: bytes ``[lo, hi)`` of the run are chunk bytes from ``chunk_lo`` on
    (``entry``/``chunk``), or the data file's safetensors header (``entry`` None)."""

    lo: int
    hi: int
    entry: Entry | None = None
    chunk: Chunk | None = None
    chunk_lo: int = 0


@dataclass(frozen=True)
class _Run:
    """File bytes ``[offset, offset+length)``, read in one request and checked by ``checks``."""

    offset: int
    length: int
    checks: tuple[_Check, ...]


class _Stopped(CheckpointError):
    """A copying thread gave up because another one failed."""


@dataclass(frozen=True)
class Source:
    """A committed checkpoint to copy: its storage (reading referenced files where they lie), and
    the manifest the copy commits, as bytes and parsed: the source's as stored, or, where it refers
    to other checkpoints, the self-contained one of :func:`self_contained` (``moved``: its new data
    files; ``referred``: the files they are read from, with their sizes). Read once by whoever
    resolved it (the CLI's ``cp``)."""

    storage: Storage
    raw: bytes
    manifest: Manifest
    moved: dict[str, Moved] = field(default_factory=dict)
    referred: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, storage: Storage, raw: bytes | None = None) -> Source:
        """The checkpoint at ``storage``; ``raw``: its manifest's bytes, where they were read already."""
        raw = read_manifest_bytes(storage) if raw is None else raw
        manifest = read_manifest_from(storage, raw)
        if not manifest.refs:
            return cls(storage, raw, manifest)
        contained, moved = self_contained(manifest)
        return cls(linked(storage, manifest), contained.to_bytes(), contained, moved,
                   {name: manifest.files[name] for name in manifest.refs})


def copy(src: str | os.PathLike[str] | Storage | Source, dst: str | os.PathLike[str] | Storage, *,
         overwrite: bool = False, threads: int | None = None,
         progress: Callable[[int], None] | None = None) -> CopyInfo:
    """Copy the committed checkpoint at ``src`` to ``dst`` (paths, ``s3://`` URLs or storages),
    checking every block as it is read; resumes an interrupted copy into ``dst``.

    A committed checkpoint at ``dst`` raises :class:`CheckpointExistsError` unless ``overwrite``
    (it stays readable until the copy commits), and :class:`CheckpointError` while other
    checkpoints beside it refer to its data files (checked again at the commit); files there that
    are not a checkpoint's (retained data among them) are refused. A damaged source raises
    :class:`CorruptCheckpointError` naming the file and block, and nothing is committed. An
    incremental source is copied self-contained (see :func:`self_contained`). ``threads``: data
    files copied at once; ``progress(nbytes)`` is called from the copying threads as bytes are
    copied or found complete at ``dst``."""
    start, began = time.perf_counter(), time.time_ns()  # began: as a save's generation time, for the clean-up
    source = src if isinstance(src, Source) else Source.read(storage_for(src))
    target, manifest = storage_for(dst), source.manifest
    inside = within(target.location, source.storage.location)
    in_place = inside and within(source.storage.location, target.location)  # then no file of it is ever deleted
    if inside and not in_place:
        raise CheckpointError(f"{target.location} lies inside the checkpoint it would copy "
                              f"({source.storage.location}); nothing was written: copy it to a location outside it")
    listed = target.sizes()  # one listing, with the sizes where it gives them (an object store)
    names = target.list() if listed is None else list(listed)
    check_location(target, overwrite, what="copy", names=names)
    found = manifest_generation(target)  # the checkpoint the copy replaces: still there at its commit?
    committed = MANIFEST_NAME in names  # by the listing: a manifest that cannot be read is still one
    if overwrite:
        check_unreferenced(target, committed)  # its clean-up would delete files that checkpoints beside it read
    present: dict[str, int | None] = dict.fromkeys(names) if listed is None else dict(listed)
    try:
        target.create()
    except OSError as exc:
        raise CheckpointError(f"cannot create {target.location}: {exc}") from exc
    job = _Copy(source, target, threads or default_threads(), progress or (lambda n: None), in_place)
    try:
        copied, skipped = job.run(present)
    finally:
        job.close()
    recheck = (lambda: check_unreferenced(target, committed)) if overwrite else None  # a save beside it
    # may refer to it by now
    publish_manifest(target, manifest.generation, source.raw, found, what="copy", before_commit=recheck)
    # the checkpoint replaced, and saves or copies begun before this one (interrupted, or refused now that this one
    # committed); a save begun since may be writing into this checkpoint: its files stay, as after a save's commit
    remove_stale(target, manifest.generation, lambda gen: gen == found or generation_time(gen) < began)
    return CopyInfo(source.storage.location, target.location, manifest.generation, len(copied), sum(copied),
                    len(skipped), sum(skipped), time.perf_counter() - start, len(source.moved))


class _Copy:
    """The data files of one copy, in parallel threads, each file read and checked a run at a time."""

    def __init__(self, source: Source, target: Storage, threads: int, progress: Callable[[int], None],
                 in_place: bool) -> None:
        self.source, self.target, self.manifest, self.in_place = source.storage, target, source.manifest, in_place
        self.moved, self.referred = source.moved, source.referred
        self.threads, self.progress = max(1, threads), progress
        self.src_reader = ChunkReader(self.source, self.manifest, threads)
        self.dst_reader = ChunkReader(target, self.manifest, threads)
        self.stop = threading.Event()
        self.segments = _segments(self.manifest)
        self.source_sizes = self.source.sizes()  # one listing instead of a request a file, where it gives sizes

    def close(self) -> None:
        self.src_reader.close()
        self.dst_reader.close()

    def run(self, present: dict[str, int | None]) -> tuple[list[int], list[int]]:
        """Copy every data file not complete at the destination (``present``: its files, with their
        sizes where the listing gave them); the sizes of those copied and kept."""
        files = sorted(self.manifest.files.items(), key=lambda item: -item[1])
        with ThreadPoolExecutor(self.threads, thread_name_prefix="zerostall-copy") as pool:
            futures = [pool.submit(self._file, name, size, name in present, present.get(name))
                       for name, size in files]
            try:
                wait(futures)
            except BaseException:  # Ctrl-C: the threads stop at their next run; the files done stay
                self.stop.set()
                for future in futures:
                    future.cancel()
                raise
        cause = next((e for e in map(Future.exception, futures) if e is not None and not isinstance(e, _Stopped)),
                     None)
        if cause is not None:
            raise cause
        results = [f.result() for f in futures]
        return [n for n, kept in results if not kept], [n for n, kept in results if kept]

    def _file(self, name: str, size: int, present: bool, found: int | None) -> tuple[int, bool]:
        """Copy one data file (or keep it, complete at the destination, where it has ``found``
        bytes if the listing said); returns its size and whether it was kept."""
        if self.stop.is_set():
            raise _Stopped("another copying thread failed")
        try:
            runs = list(_runs(self.segments.get(name, []), name, size, self.manifest, self.source.location))
            if present:
                if self._complete(name, size, found, runs):
                    log.info("%s of %s is complete at %s: kept", name, self.source.location, self.target.location)
                    return size, True
                self.target.delete(name)
            for origin, expected in self._read_from(name, size).items():
                self._check_source_size(origin, expected)
            written = self.target.write(name, self._stream(name, runs))
        except BaseException as exc:
            self.stop.set()
            if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
                raise CheckpointError(f"copying data file {name} to {self.target.location} failed: {exc}") from exc
            raise
        if written != size:
            raise CheckpointError(f"wrote {written} bytes to {name} of {self.target.location}, expected {size}")
        return size, False

    def _read_from(self, name: str, size: int) -> dict[str, int]:
        """The source's files that data file ``name`` of the copy is read from, with their sizes."""
        moved = self.moved.get(name)
        if moved is None:
            return {name: size}
        return {chunk.file: self.referred[chunk.file] for chunk in moved.origins.values()}

    def _check_source_size(self, name: str, size: int) -> None:
        try:
            actual = self.source.size(name) if self.source_sizes is None else self.source_sizes[name]
        except (FileNotFoundError, KeyError):
            raise self.src_reader.missing(name) from None
        if actual != size:
            raise CorruptCheckpointError(f"data file {name} of {self.source.location} has {actual} bytes, the "
                                         f"manifest says {size}; nothing was committed at {self.target.location}")

    def _complete(self, name: str, size: int, found: int | None, runs: list[_Run]) -> bool:
        """Whether data file ``name`` at the destination (``found`` bytes, if known) has its size
        and passes every check; one that is gone or damaged is copied again. A read that fails
        otherwise is raised: the file may be a committed checkpoint's (this one's, copied again),
        and only damage may replace it. In place, the destination's file is the source's own: one
        that does not pass is raised too, never copied again over itself."""
        try:
            if (actual := self.target.size(name) if found is None else found) != size:
                raise CorruptCheckpointError(f"data file {name} of {self.target.location} has {actual} bytes, the "
                                             f"manifest says {size}")
            for run in runs:
                if self.stop.is_set():
                    raise _Stopped("another copying thread failed")
                _read_checked(self.dst_reader, name, run)
                self.progress(run.length)
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            if self.in_place:
                raise
            log.info("%s at %s is not complete (%s): copied again", name, self.target.location, exc)
            return False
        return True

    def _stream(self, name: str, runs: list[_Run]) -> Iterator[memoryview]:
        """The file's bytes, a fresh buffer a run (the writer may still hold the last ones), each
        run checked before it is handed on."""
        moved = self.moved.get(name)
        for run in runs:
            if self.stop.is_set():
                raise _Stopped("another copying thread failed")
            yield _read_checked(self.src_reader, name, run) if moved is None else _read_moved(self.src_reader, moved,
                                                                                                run)
            self.progress(run.length)


def _segments(manifest: Manifest) -> dict[str, list[tuple[int, Entry, Chunk]]]:
    """Every stored chunk by data file, in file order: (offset, entry, chunk)."""
    found: dict[str, list[tuple[int, Entry, Chunk]]] = {}
    for entry in manifest.entries:
        if entry.kind == "tensor":
            for chunk in entry.chunks:
                found.setdefault(chunk.file, []).append((chunk.offset, entry, chunk))
    for chunks in found.values():
        chunks.sort(key=lambda item: (item[0], item[2].nbytes))
    return found


def _runs(chunks: list[tuple[int, Entry, Chunk]], name: str, size: int, manifest: Manifest,
          where: str) -> Iterator[_Run]:
    """Runs of whole checksum blocks tiling data file ``name``: its header, then its chunks, which
    must cover the rest exactly (a file zerostall writes has no other bytes); a byte no checksum
    covers is refused, never copied unchecked."""
    block = manifest.block_size
    limit = max(block, RUN_BYTES // block * block)
    header = chunks[0][0] if chunks else size
    if header and manifest.headers and name not in manifest.headers:  # (manifests before headers had none)
        raise CorruptCheckpointError(f"data file {name} of {where}: no checksum for its first {header} bytes "
                                     "(its header); it cannot be copied checked")
    checks: list[_Check] = [_Check(0, header)] if header else []
    offset, at = 0, header  # the run's start in the file; the next byte to cover
    for start, entry, chunk in chunks:
        if start != at:
            raise CorruptCheckpointError(f"data file {name} of {where}: bytes {min(at, start)}-{max(at, start)} "
                                         f"are {'covered twice' if start < at else 'not covered'} by its chunks "
                                         f"(entry {entry.fqn}); it cannot be copied checked")
        lo = 0
        while True:
            pos = start + lo
            rest, room = chunk.nbytes - lo, offset + limit - pos
            if rest <= room:
                checks.append(_Check(pos - offset, pos + rest - offset, entry, chunk, lo))
                break
            take = max(0, room) // block * block  # a chunk is split at its blocks only
            if take:
                checks.append(_Check(pos - offset, pos + take - offset, entry, chunk, lo))
                lo, pos = lo + take, pos + take
            yield _Run(offset, pos - offset, tuple(checks))
            offset, checks = pos, []
        at = start + chunk.nbytes
    if at != size:
        raise CorruptCheckpointError(f"data file {name} of {where}: the manifest gives it {size} bytes but its "
                                     f"header and chunks cover {at}; it cannot be copied checked")
    if checks:
        yield _Run(offset, size - offset, tuple(checks))


def _read_checked(reader: ChunkReader, name: str, run: _Run) -> memoryview:
    """Read ``run`` of data file ``name`` into a new buffer and check it: the header against its
    checksum, every block against the manifest's."""
    out = memoryview(bytearray(run.length))
    reader.read_range(name, run.offset, out)
    for check in run.checks:
        data = out[check.lo:check.hi]
        if check.entry is None:
            reader.check_header(name, data)
        else:
            reader.check_blocks(check.entry, check.chunk, check.chunk_lo, data)  # type: ignore[arg-type]
    return out


def _read_moved(reader: ChunkReader, moved: Moved, run: _Run) -> memoryview:
    """:func:`_read_checked` of a run of a file the copy builds: its header as built, its chunks
    read from where the source has them (chunks lying back to back there too in one request), each
    block checked as the source's chunk (a fault names the file it lies in)."""
    out = memoryview(bytearray(run.length))
    spans: list[tuple[str, int, int, int]] = []  # (source file, its offset, out's lo, hi): one read each
    checks = []
    for check in run.checks:
        if check.entry is None:
            out[check.lo:check.hi] = moved.header[run.offset + check.lo:run.offset + check.hi]
            continue
        if check.hi == check.lo:  # an empty chunk: nothing to read, its checksum still checked
            checks.append((check, check.chunk))
            continue
        chunk = moved.origins[check.chunk.offset]  # type: ignore[union-attr]
        checks.append((check, chunk))
        at, last = chunk.offset + check.chunk_lo, spans[-1] if spans else None
        if last is not None and last[0] == chunk.file and last[3] == check.lo and last[1] + check.lo - last[2] == at:
            spans[-1] = (chunk.file, last[1], last[2], check.hi)
        else:
            spans.append((chunk.file, at, check.lo, check.hi))
    for file, at, lo, hi in spans:
        reader.read_range(file, at, out[lo:hi])
    for check, chunk in checks:
        reader.check_blocks(check.entry, chunk, check.chunk_lo, out[check.lo:check.hi])  # type: ignore[arg-type]
    return out
