"""Verify: check a whole checkpoint, every data file's size and header and every block's checksum.

Faults are collected, not raised one by one, so a report lists all that is wrong. A checkpoint
whose bytes could not all be read (permissions, I/O errors) is "could not verify", a plain
``CheckpointError``, never ``CorruptCheckpointError``: a clean-up script must not delete it.
A data file that arrives over a network is checked the same way from its bytes as they arrive
(:class:`ArrivingFile`), so it is never read back.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Collection, Iterable

from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ..format import codec
from ..format.checksums import BlockHasher
from ..format.layout import Chunk, Entry
from ..gcpause import gc_paused
from .foreign import describe
from .reader import ChunkReader, resolve


def verify_all(fetcher: ChunkReader, *, allow_pickle: bool, progress: Callable[[int], None] | None = None,
               files: Collection[str] | None = None) -> int:
    """Check every file size and every block checksum; returns bytes checked. ``files``: check
    only these data files (and every entry's description): none, the descriptions alone, for a
    copy whose data files are checked as they arrive (:class:`ArrivingFile`).

    ``progress(nbytes)`` is called from the reader threads as blocks are checked. Raises
    :class:`CorruptCheckpointError` listing every fault found (``.faults``), or a plain
    :class:`CheckpointError` when some bytes could not be read at all (permission denied,
    I/O errors): such a checkpoint is unverified, not known to be damaged.
    """
    manifest = fetcher.manifest
    if manifest.foreign:
        raise CheckpointError(f"{fetcher.path} is {describe(manifest.foreign)}: it carries no checksums, so "
                              "nothing can be verified (`zerostall import` converts it into a zerostall checkpoint "
                              "with checksums, checking every value)")
    faults: list[str] = []
    unreadable = False
    jobs = [(e, c) for e in manifest.entries if e.kind == "tensor" for c in e.chunks
            if files is None or c.file in files]
    data_start = _data_starts(c for _, c in jobs)
    sizes: dict[str, int] = {}  # the actual size of each data file found
    for name, size in manifest.files.items():
        if files is not None and name not in files:
            continue
        try:
            actual = sizes[name] = fetcher.storage.size(name)
            header_fault = _header_fault(fetcher, name, data_start.get(name))
        except FileNotFoundError:
            missing = fetcher.missing(name)
            if not isinstance(missing, CorruptCheckpointError):
                raise missing from None
            faults.append(f"data file {name} is missing")
            continue
        except CorruptCheckpointError as exc:  # not a regular file (UnsafeFileError)
            faults.append(str(exc))
            continue
        except OSError as exc:
            faults.append(f"reading the header of data file {name} failed: {exc}")
            unreadable = True
            continue
        if actual != size:
            faults.append(f"data file {name} has {actual} bytes, the manifest says {size}")
        if header_fault:
            faults.append(header_fault)
    for entry in manifest.entries:
        try:
            resolve(manifest, entry, fetcher.path)
            if entry.kind == "object" and not allow_pickle:
                _decode_safely(entry)
        except CheckpointError as exc:
            faults.append(str(exc))
    if any(e.kind == "subclass" or e.inner_of is not None for e in manifest.entries):
        from ..format import subclass  # imports torch: only for checkpoints holding tensor subclasses
        faults += subclass.check(manifest.entries, fetcher.path)  # their descriptions and links
    lock = threading.Lock()

    def check(entry: Entry, chunk: Chunk) -> None:
        nonlocal unreadable
        if chunk.offset + chunk.nbytes > sizes.get(chunk.file, chunk.offset + chunk.nbytes):
            with lock:  # nothing to read (or to allocate for) past the end of what is there
                faults.append(f"data file {chunk.file} of {fetcher.path} is truncated: entry {entry.fqn} lies past "
                              "its end")
            return
        try:
            step = manifest.block_size  # the scratch stays in the CPU cache: nothing keeps these bytes
            for piece in range(0, max(chunk.nbytes, 1), step):
                out = fetcher.scratch_view(min(step, chunk.nbytes - piece))
                fetcher.read_piece(entry, chunk, piece, out, True)
                if progress is not None:
                    progress(len(out))
        except CheckpointError as exc:
            with lock:
                faults.append(str(exc))
                unreadable = unreadable or not isinstance(exc, CorruptCheckpointError)

    try:
        with ThreadPoolExecutor(fetcher.threads, thread_name_prefix="zerostall-verify") as pool:
            list(pool.map(lambda job: check(*job), jobs))
    finally:
        fetcher.storage.close()
    if faults:
        kind, outcome = (CheckpointError, "could not be verified") if unreadable else \
            (CorruptCheckpointError, "failed verification")
        error = kind(f"{fetcher.path} {outcome}: " + "; ".join(faults[:10])
                     + (f"; … ({len(faults) - 10} more)" if len(faults) > 10 else ""))
        error.faults = faults  # type: ignore[attr-defined]
        raise error
    return sum(c.nbytes for _, c in jobs)


def _header_fault(fetcher: ChunkReader, name: str, length: int | None) -> str | None:
    """What is wrong with the safetensors header of data file ``name`` (its first ``length``
    bytes: length prefix, JSON, padding), checked against the checksum in the manifest
    (manifests before it had none), or None."""
    if name not in fetcher.manifest.headers or length is None or name in fetcher.manifest.refs:
        return None  # a referenced file's header is its owner's: this checkpoint reads none of it
    try:
        fetcher.check_header(name, fetcher.storage.read_head(name, length))
    except CorruptCheckpointError as exc:
        return str(exc)
    return None


def _decode_safely(entry: Entry) -> None:
    """Decode a python value as a load would, without pickle: a value that fails for any other
    reason than needing pickle is damaged."""
    try:
        codec.decode(entry.value, where=entry.fqn, allow_pickle=False)
    except UnsupportedValueError as exc:
        if "pickle" not in str(exc):
            raise CorruptCheckpointError(f"entry {entry.fqn}: {exc}") from exc


@gc_paused()  # a few objects per chunk: no cyclic collections over the process meanwhile
def arriving_files(fetcher: ChunkReader, sizes: dict[str, int]) -> dict[str, ArrivingFile]:
    """The checks of the manifest's data files ``sizes`` (name: size as it arrives), each with its
    chunks, found in one pass over the entries."""
    chunks: dict[str, list[tuple[Entry, Chunk]]] = {name: [] for name in sizes}
    for entry in fetcher.manifest.entries:
        for chunk in entry.chunks if entry.kind == "tensor" else ():
            if chunk.file in chunks:
                chunks[chunk.file].append((entry, chunk))
    return {name: ArrivingFile(fetcher, name, size, chunks[name]) for name, size in sizes.items()}


def _data_starts(chunks: Iterable[Chunk]) -> dict[str, int]:
    """Where each data file's data section begins (its first chunk): its header ends there."""
    starts: dict[str, int] = {}
    for chunk in chunks:
        starts[chunk.file] = min(chunk.offset, starts.get(chunk.file, chunk.offset))
    return starts


@dataclass(frozen=True)
class _Span:
    """Bytes ``[start, end)`` of a data file under one check, ``check(digests)`` of its blocks of
    ``block`` bytes: a chunk's, or the file's header (one block)."""

    start: int
    end: int
    block: int
    check: Callable[[list[str]], None]


class ArrivingFile:
    """Data file ``name`` of ``fetcher.manifest`` (holding ``chunks``) checked from its ``size``
    bytes as they arrive, in order (a copy received from another node): every check
    :func:`verify_all` makes of a data file (its size, its header's checksum, chunks inside the
    file, every block's checksum), made on the arriving bytes, so the file is never read back. A
    fault raises :class:`CorruptCheckpointError` naming the file (and entry, and block)."""

    def __init__(self, fetcher: ChunkReader, name: str, size: int, chunks: list[tuple[Entry, Chunk]]) -> None:
        manifest, where = fetcher.manifest, fetcher.path
        self.name, self.size, self.at = name, size, 0
        if size != manifest.files[name]:
            raise CorruptCheckpointError(f"data file {name} of {where} has {size} bytes, the manifest says "
                                         f"{manifest.files[name]}")
        spans = []
        for entry, chunk in chunks:
            if chunk.offset + chunk.nbytes > size:
                raise CorruptCheckpointError(f"data file {name} of {where} is truncated: entry {entry.fqn} lies "
                                             "past its end")
            spans.append(_Span(chunk.offset, chunk.offset + chunk.nbytes, manifest.block_size,
                               partial(fetcher.check_digests, entry, chunk, 0, chunk.nbytes)))
        header = _data_starts(c for _, c in chunks).get(name)
        if header is not None and name in manifest.headers and name not in manifest.refs:
            spans.append(_Span(0, header, max(header, 1),
                               lambda digests: fetcher.check_header_digest(name, digests[0])))
        self.waiting = deque(sorted(spans, key=lambda span: span.start))
        self.active: list[tuple[_Span, BlockHasher]] = []  # the spans begun, a hasher each (made as each begins)

    def update(self, data: memoryview) -> None:
        """Hash the file's next bytes; every span they complete is checked."""
        start, end = self.at, self.at + len(data)
        while self.waiting and self.waiting[0].start <= end:
            span = self.waiting.popleft()
            self.active.append((span, BlockHasher(span.block)))
        still = []
        for span, hasher in self.active:
            lo, hi = max(start, span.start), min(end, span.end)
            if lo < hi:
                hasher.update(data[lo - start:hi - start])
            if span.end > end:
                still.append((span, hasher))
            else:
                span.check(hasher.finish())
        self.active, self.at = still, end

    def finish(self) -> None:
        """Every byte has arrived: spans without bytes (an empty chunk) are checked too; a file that
        did not arrive whole is an error."""
        self.update(memoryview(b""))
        if self.at != self.size or self.waiting or self.active:
            raise CheckpointError(f"data file {self.name}: only {self.at} of its {self.size} bytes arrived")
