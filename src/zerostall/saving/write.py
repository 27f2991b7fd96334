"""Write: this rank's chunks into new data files, in parallel, hashed as they stream out.

The items are spread over up to ``threads`` files with balanced bytes; each file is a valid
safetensors file whose header is written first, then every tensor's bytes straight from its
memory, each cache-sized piece hashed into its block's checksum just before it is written. The
files belong to the save's generation, so they never touch a committed checkpoint's files.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from ..balance import balance
from ..devices import CallerStreams
from ..errors import CheckpointError
from ..format.checksums import CACHE_PIECE, BlockHasher, block_checksums, checksum, pieces
from ..format.layout import FORMAT_NAME, Chunk, data_file_name
from ..format.safetensors_file import FileItem, safetensors_header
from ..gcpause import gc_paused
from ..memory import owned_bytes, tensor_bytes
from ..storage import Storage
from .collect import WriteItem

DEVICE_WINDOW = 16 << 20
"""Bytes of a device tensor a writer thread copies to host memory at a time."""


def assign_files(items: Sequence[WriteItem], n_files: int) -> list[list[WriteItem]]:
    """Spread items over at most ``n_files`` files with balanced bytes (largest first, least loaded).

    Within a file, items are ordered by descending element size so that packing them with no
    gaps keeps every tensor at its natural alignment (a safetensors requirement).
    """
    n_files = max(1, min(n_files, len(items)))
    where, _ = balance([item.nbytes for item in items], n_files)
    files: list[list[int]] = [[] for _ in range(n_files)]
    for i, f in enumerate(where):
        files[f].append(i)
    return [[items[i] for i in sorted(f, key=lambda i: (-items[i].tensor.element_size(), i))] for f in files if f]


def create(storage: Storage) -> None:
    """Make the checkpoint's location exist before the first data file is written."""
    try:
        storage.create()
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {storage.location}: {exc}") from exc


def write_data(storage: Storage, items: list[WriteItem], generation: str, rank: int, threads: int,
               block_size: int) -> tuple[dict[str, int], dict[str, str]]:
    """Write this rank's items into balanced files in parallel; each item's chunk is appended to its
    entry. Returns each file's size and the checksum of its header. The first writer that fails
    stops the others. Items still on a GPU (a synchronous save, in the caller's thread) are
    copied by the writer threads once the work the caller queued on them is done."""
    cuda = CallerStreams.of(item.tensor for item in items)
    if cuda is not None:
        cuda.wait()  # the writer threads copy on their own streams, not ordered after the caller's
    with gc_paused():
        groups = assign_files(items, threads) if items else []
    names = [data_file_name(generation, rank, n) for n in range(len(groups))]
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=max(1, len(groups)), thread_name_prefix="zerostall-write",
                            initializer=None if cuda is None else cuda.enter) as pool:
        futures = [pool.submit(_write_file, storage, n, g, generation, block_size, stop)
                   for n, g in zip(names, groups)]
    cause = next((exc for exc in map(Future.exception, futures) if exc is not None and not isinstance(exc, _Stopped)),
                 None)
    if isinstance(cause, OSError):
        raise CheckpointError(f"writing a data file of {storage.location} failed: {cause}") from cause
    if cause is not None:
        raise cause
    files: dict[str, int] = {}
    headers: dict[str, str] = {}
    for fut, group in zip(futures, groups):
        name, size, chunks, header = fut.result()
        files[name], headers[name] = size, header
        for item, chunk in zip(group, chunks):
            item.entry.chunks.append(chunk)
    return files, headers


class _Stopped(CheckpointError):
    """A writer thread gave up because another writer of the same save failed."""


def _write_file(storage: Storage, name: str, items: list[WriteItem], generation: str, block_size: int,
                stop: threading.Event) -> tuple[str, int, list[Chunk], str]:
    """Write one data file; returns its name, size, chunks and header checksum. A failure sets
    ``stop``, so the save's other writers give up too."""
    with gc_paused():
        header, offsets = safetensors_header(
            (FileItem(i.name, i.tensor.dtype, tuple(i.tensor.shape), i.nbytes) for i in items),
            {"format": FORMAT_NAME, "generation": generation})
        chunks = [Chunk(i.offsets, tuple(i.tensor.shape), name, off, i.nbytes) for i, off in zip(items, offsets)]
    try:
        size = storage.write(name, _file_parts(header, items, chunks, block_size, stop))
    except BaseException:
        stop.set()
        raise
    expected = len(header) + sum(i.nbytes for i in items)
    if size != expected:
        raise CheckpointError(f"wrote {size} bytes to {name}, expected {expected}")
    return name, size, chunks, checksum(header)


def _file_parts(header: bytes, items: list[WriteItem], chunks: list[Chunk], block_size: int,
                stop: threading.Event) -> Iterator[memoryview]:
    """The file's bytes in cache-sized pieces, each hashed into its block's checksum just before
    it is written, so memory is read once for both; raise :class:`_Stopped` once ``stop`` is set."""
    yield memoryview(header)
    whole = min(block_size, CACHE_PIECE)  # an item this small is one piece: hashed in one call
    for item, chunk in zip(items, chunks):
        if stop.is_set():
            raise _Stopped("another writer of this save failed")
        if item.tensor.device.type != "cpu":
            hasher = BlockHasher(block_size)
            for piece in device_pieces(item.tensor, block_size, stop):
                hasher.update(piece)
                yield piece
            chunk.checksums = hasher.finish()
            continue
        data = tensor_bytes(item.tensor)
        if len(data) <= whole:
            chunk.checksums = block_checksums(data, block_size)
            yield data
            continue
        hasher = BlockHasher(block_size)
        for lo, hi in pieces(len(data), block_size):
            if stop.is_set():
                raise _Stopped("another writer of this save failed")
            piece = data[lo:hi]
            hasher.update(piece)
            yield piece
        chunk.checksums = hasher.finish()


def device_pieces(tensor: torch.Tensor, block_size: int, stop: threading.Event,
                  window: int = DEVICE_WINDOW) -> Iterator[memoryview]:
    """The bytes of a contiguous tensor in the pieces of :func:`pieces`, copied to host memory
    ``window`` bytes at a time; each piece keeps its window alive until the file has written it."""
    flat = tensor.reshape(-1).view(torch.uint8)
    n = flat.numel()
    base, host = 0, memoryview(b"")
    for lo, hi in pieces(n, block_size):
        if hi > base + len(host):
            if stop.is_set():
                raise _Stopped("another writer of this save failed")
            base, host = lo, owned_bytes(flat[lo:min(n, lo + max(window, hi - lo))].cpu())
        yield host[lo - base:hi - base]
