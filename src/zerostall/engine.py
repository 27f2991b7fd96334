"""Saving: flatten the state, plan the data files, write them in parallel, commit the manifest.

The commit protocol: data files of a new generation are written and fsync'd, then the manifest is
published atomically (temp + fsync + rename + directory fsync), and only then are the files of
older generations deleted. A crash at any instant leaves either the old or the new checkpoint.
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Mapping

import torch
import xxhash

from . import codec
from .errors import CheckpointError, UnsupportedValueError
from .format import (DEFAULT_BLOCK_SIZE, MANIFEST_NAME, Chunk, Entry, FileItem, Manifest, data_file_name,
                     dtype_name, file_generation, generation_time, manifest_tmp_name, new_generation, safetensors_header)
from .plan import WriteItem, assign_files
from .state import Path, flatten, fqn
from .storage import Storage, storage_for

log = logging.getLogger(__name__)

CACHE_PIECE = 512 << 10  # hashed and then copied while still in the CPU cache


def default_threads() -> int:
    """Writer/reader threads per process: one per core, at least 2, at most 8."""
    return max(2, min(8, os.cpu_count() or 1))


def encode_path(path: Path) -> list[Any]:
    return [codec.encode(k) for k in path]


def decode_path(data: list[Any]) -> Path:
    return tuple(codec.decode(k) for k in data)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor's memory (kept valid while ``t`` lives)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def check_tensor(t: torch.Tensor, where: str) -> None:
    """Refuse tensors whose bytes are not plain strided data we can store and restore exactly."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedValueError(f"{where}: tensor subclass {type(t).__qualname__} is not supported")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        kind = "quantized" if t.is_quantized else "nested" if t.is_nested else str(t.layout)
        raise UnsupportedValueError(f"{where}: {kind} tensors are not supported; convert to a dense tensor")
    if t.is_meta:
        raise UnsupportedValueError(f"{where}: tensor is on the meta device and has no data to save")


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity of a tensor view: two leaves with the same key hold the very same bytes."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            t.is_conj(), t.is_neg())


def build_entries(state: Any, *, allow_pickle: bool) -> tuple[list[Entry], list[WriteItem], Any]:
    """Flatten ``state`` into manifest entries and the tensors to write; returns the skeleton tree."""
    flat = flatten(state)
    entries: list[Entry] = []
    items: list[WriteItem] = []
    seen: dict[tuple[Any, ...], int] = {}
    index: dict[Path, int] = {}
    names: set[str] = set()
    for path, value in flat.leaves.items():
        name = fqn(path)
        index[path] = len(entries)
        if not isinstance(value, torch.Tensor):
            entries.append(Entry(name, path, "object", value=codec.encode(value, where=name, allow_pickle=allow_pickle)))
            continue
        check_tensor(value, name)
        key = view_key(value)
        if key in seen:
            entries.append(Entry(name, path, "alias", alias_of=seen[key]))
            continue
        seen[key] = len(entries)
        entries.append(Entry(name, path, "tensor", dtype=dtype_name(value.dtype), shape=tuple(value.shape)))
        source = value.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        file_name = name
        while file_name in names:
            file_name += "#"
        names.add(file_name)
        items.append(WriteItem(len(entries) - 1, file_name, source, (0,) * value.dim()))
    tree = codec.encode(_skeleton_refs(flat.skeleton, (), index))
    return entries, items, tree


def _skeleton_refs(node: Any, path: Path, index: dict[Path, int]) -> Any:
    if path in index:
        return codec.Ref(index[path])
    if isinstance(node, dict):
        return {k: _skeleton_refs(v, path + (k,), index) for k, v in node.items()}
    values = [_skeleton_refs(v, path + (i,), index) for i, v in enumerate(node)]
    return tuple(values) if isinstance(node, tuple) else values


def _file_parts(header: bytes, items: list[WriteItem], chunks: list[Chunk], block_size: int) -> Iterator[memoryview]:
    """Yield the file's bytes in cache-sized pieces, each hashed into its block's checksum just
    before it is written, so the bytes are read from memory once for both."""
    yield memoryview(header)
    for item, chunk in zip(items, chunks):
        data = tensor_bytes(item.tensor)
        for start in range(0, max(len(data), 1), block_size):
            hasher = xxhash.xxh3_64()
            for piece in _cache_pieces(data[start:start + block_size]):
                hasher.update(piece)
                yield piece
            chunk.checksums.append(hasher.hexdigest())


def _cache_pieces(block: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(block), CACHE_PIECE):
        yield block[start:start + CACHE_PIECE]


def _write_file(storage: Storage, name: str, items: list[WriteItem], generation: str,
                block_size: int) -> tuple[str, int, list[Chunk]]:
    header, offsets = safetensors_header(
        (FileItem(i.name, i.tensor.dtype, tuple(i.tensor.shape), i.nbytes) for i in items), generation)
    chunks = [Chunk(i.offsets, tuple(i.tensor.shape), name, off, i.nbytes) for i, off in zip(items, offsets)]
    size = storage.write(name, _file_parts(header, items, chunks, block_size))
    expected = len(header) + sum(i.nbytes for i in items)
    if size != expected:
        raise CheckpointError(f"wrote {size} bytes to {name}, expected {expected}")
    return name, size, chunks


def save(state: Any, path: str | os.PathLike[str], *, process_group: Any = None, step: int | None = None,
         metadata: Mapping[str, Any] | None = None, threads: int | None = None, fsync: bool = True,
         allow_pickle: bool = False, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Save ``state`` to ``path`` and return once the checkpoint is committed (durable, visible).

    ``state`` is any nesting of dicts/lists/tuples of tensors, python values and objects with
    ``state_dict()``. Saving into an existing checkpoint leaves it intact until the new manifest
    commits. ``fsync=False`` trades durability for speed on scratch storage.
    """
    require_single_process(process_group)
    entries, items, tree = build_entries(state, allow_pickle=allow_pickle)
    storage = storage_for(path, fsync=fsync)
    generation = new_generation()
    try:
        _create(storage)
        files = _write_data(storage, entries, items, generation, threads or default_threads(), block_size)
        manifest = Manifest(
            generation=generation, entries=entries, files=files, tree=tree, block_size=block_size, step=step,
            metadata=codec.encode(dict(metadata or {}), where="metadata", allow_pickle=allow_pickle))
        commit(storage, manifest)
    except BaseException:
        if not _is_committed(storage, generation):
            _delete_generation(storage, generation)
        storage.close()
        raise
    delete_older_generations(storage, generation)
    storage.close()


def require_single_process(process_group: Any) -> None:
    import torch.distributed as dist

    if process_group is not None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        raise CheckpointError("multi-rank save/load is not supported yet: run with one process")


def _create(storage: Storage) -> None:
    try:
        storage.create()
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {storage.location}: {exc}") from exc


def _write_data(storage: Storage, entries: list[Entry], items: list[WriteItem], generation: str,
                threads: int, block_size: int) -> dict[str, int]:
    groups = assign_files(items, threads)
    names = [data_file_name(generation, 0, n) for n in range(len(groups))]
    files: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=max(1, len(groups)), thread_name_prefix="zerostall-write") as pool:
        futures = [pool.submit(_write_file, storage, n, g, generation, block_size) for n, g in zip(names, groups)]
        for fut, group in zip(futures, groups):
            try:
                name, size, chunks = fut.result()
            except OSError as exc:
                raise CheckpointError(f"writing {exc.filename or storage.location} failed: {exc}") from exc
            files[name] = size
            for item, chunk in zip(group, chunks):
                entries[item.entry].chunks.append(chunk)
    return files


def commit(storage: Storage, manifest: Manifest) -> None:
    """Publish the manifest: the single atomic step that makes the checkpoint exist."""
    try:
        storage.publish(MANIFEST_NAME, manifest_tmp_name(manifest.generation), manifest.to_bytes(encode_path))
    except OSError as exc:
        raise CheckpointError(f"committing the manifest in {storage.location} failed: {exc}") from exc


def _is_committed(storage: Storage, generation: str) -> bool:
    """Whether the manifest in place is ours: a failure after the rename must not delete its data."""
    try:
        return Manifest.from_bytes(storage.read_bytes(MANIFEST_NAME), decode_path, storage.location).generation == generation
    except (OSError, CheckpointError):
        return False


def _delete_generation(storage: Storage, generation: str) -> None:
    for name in storage.list():
        if file_generation(name) == generation:
            try:
                storage.delete(name)
            except OSError:
                log.warning("could not remove %s of the failed save in %s", name, storage.location)


def delete_older_generations(storage: Storage, keep: str) -> None:
    """After a commit, remove data files (and manifest temps) of older generations: no manifest
    references them any more. Newer ones may belong to a save still in flight, so they stay."""
    for name in storage.list():
        gen = file_generation(name)
        if gen is not None and gen != keep and generation_time(gen) <= generation_time(keep):
            try:
                storage.delete(name)
            except OSError as exc:
                log.warning("could not remove stale %s in %s: %s", name, storage.location, exc)
