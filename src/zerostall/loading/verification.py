"""Verify: check a whole checkpoint, every data file's size and header and every block's checksum.

Faults are collected, not raised one by one, so a report lists all that is wrong. A checkpoint
whose bytes could not all be read (permissions, I/O errors) is "could not verify", a plain
``CheckpointError``, never ``CorruptCheckpointError``: a clean-up script must not delete it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Collection

from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ..format import codec
from ..format.layout import Chunk, Entry
from .foreign import describe
from .reader import ChunkReader, resolve


def verify_all(fetcher: ChunkReader, *, allow_pickle: bool, progress: Callable[[int], None] | None = None,
               files: Collection[str] | None = None) -> int:
    """Check every file size and every block checksum; returns bytes checked. ``files``: check
    only these data files (and every entry's description), so a copy that arrives file by file is
    checked as it arrives.

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
    data_start: dict[str, int] = {}  # where each file's data section begins: its header ends there
    for _, chunk in jobs:
        data_start[chunk.file] = min(chunk.offset, data_start.get(chunk.file, chunk.offset))
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
    if name not in fetcher.manifest.headers or length is None:
        return None
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
