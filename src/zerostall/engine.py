"""Saving: flatten the state, plan who writes what, write in parallel, commit the manifest.

Every rank collects what it holds; one small collective checks that the cached plan still fits
(or plans anew); each rank writes its share of a new generation of data files; the commit runs
through storage records (see :mod:`zerostall.commit`) and the coordinator publishes the manifest
atomically. Only then are the files of older generations deleted, so a crash at any instant
leaves either the old or the new checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any, Iterator, Mapping

import torch
import xxhash
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from . import codec
from .collectives import Group
from .commit import await_commit, await_records, manifest_generation, write_abort, write_record
from .errors import CheckpointError, StateMismatchError, UnsupportedValueError
from .gcpause import gc_paused
from .format import (DEFAULT_BLOCK_SIZE, MANIFEST_NAME, Chunk, Entry, FileItem, Manifest, data_file_name,
                     dtype_name, file_generation, generation_id, generation_time, manifest_tmp_name, parse_record,
                     safetensors_header)
from .memory import tensor_bytes
from .plan import ChunkKey, Row, SavePlan, WriteItem, assign_files, build_plan, structure_digest
from .state import Path, flatten, fqn
from .storage import LocalStorage, Storage, storage_for

log = logging.getLogger(__name__)

CACHE_PIECE = 512 << 10  # hashed and then copied while still in the CPU cache


def default_threads() -> int:
    """Writer/reader threads per process: one per core, at least 2, at most 8."""
    return max(2, min(8, os.cpu_count() or 1))


def encode_path(path: Path) -> list[Any]:
    return [k if type(k) is str else codec.encode(k) for k in path]


def decode_path(data: list[Any]) -> Path:
    return tuple([k if type(k) is str else codec.decode(k) for k in data])


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
    return t.device, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg()


class ViewIndex:
    """Tensor views seen so far, each with a value, found by :func:`view_key` identity. Views are
    filed by data pointer and compared by whole key only when pointers meet (tied weights), so
    each of thousands of distinct leaves costs one pointer read, not seven attribute reads."""

    __slots__ = ("_by_pointer",)

    def __init__(self) -> None:
        self._by_pointer: dict[int, Any] = {}  # a (view, value) pair, or a list of them once pointers meet

    def first(self, t: torch.Tensor, value: Any) -> Any:
        """The value filed for ``t``'s view by an earlier call, or None after filing ``value`` for it."""
        pointer = t.data_ptr()
        filed = self._by_pointer.get(pointer)
        if filed is None:
            self._by_pointer[pointer] = (t, value)
            return None
        key = view_key(t)
        for view, earlier in filed if type(filed) is list else (filed,):
            if view_key(view) == key:
                return earlier
        if type(filed) is list:
            filed.append((t, value))
        else:
            self._by_pointer[pointer] = [filed, (t, value)]
        return None


def plain_source(t: torch.Tensor) -> torch.Tensor:
    """``t`` as plain contiguous bytes with no autograd history: the tensor itself when it already
    is (an optimizer state), else a detached, resolved, contiguous view or copy."""
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


_KEY_ENCODER = json.JSONEncoder(separators=(",", ":"))


def path_key(path: Path) -> str:
    """A canonical string for a key path, identical on every rank (used in plans and records): the
    compact JSON of its encoding, built directly when every key is a str or an int (the usual case;
    the JSON encoder's per-call set-up costs ~10 us, which adds up over thousands of leaves)."""
    parts = []
    for k in path:
        kind = type(k)
        if kind is str:
            parts.append(encode_basestring_ascii(k))
        elif kind is int:
            parts.append(int.__repr__(k))
        else:
            return _KEY_ENCODER.encode(encode_path(path))
    return "[" + ",".join(parts) + "]"


@dataclass
class Collected:
    """What this rank holds, ready to plan and write: no collective has run yet."""

    entries: dict[str, Entry] = field(default_factory=dict)
    rank_local: list[Entry] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    items: list[WriteItem] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    skeleton: Any = None
    refs: dict[Path, codec.Ref] = field(default_factory=dict)
    keys: dict[Path, str] = field(default_factory=dict)


def local_box(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of a tensor and its box (offsets, sizes) in the global tensor.

    For a DTensor the box comes from DTensor itself, which also handles the strided shards that
    FSDP2 + TP produce; a plain tensor is its own whole box.
    """
    if type(value) is not torch.Tensor and isinstance(value, DTensor):
        if any(p.is_partial() for p in value.placements):
            raise UnsupportedValueError("DTensors with Partial placements must be reduced before saving")
        offsets, sizes = _dtensor_box(value.shape, value.device_mesh, value.placements)
        return value.to_local(), offsets, sizes
    return value, (0,) * value.dim(), tuple(value.shape)


@functools.lru_cache(maxsize=1 << 16)
def _dtensor_box(shape: torch.Size, mesh: Any, placements: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's box of a DTensor layout, cached: DTensor computes it in ~36 us, and a sharded
    model + optimizer state has thousands of DTensors with a few distinct layouts."""
    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(offsets), tuple(sizes)


def collect(state: Any, rank: int, *, allow_pickle: bool) -> Collected:
    """Flatten ``state`` into entries, structure rows for planning, and the tensors to write."""
    flat = flatten(state, skeleton=True)
    out = Collected(skeleton=flat.skeleton, refs=flat.refs)
    seen = ViewIndex()  # view -> the key of the leaf that first held it
    names: set[str] = set()
    for path, value in flat.leaves.items():
        name, key, local = fqn(path), path_key(path), path in flat.rank_local
        out.keys[path] = key
        if not isinstance(value, torch.Tensor):
            encoded = codec.encode(value, where=name, allow_pickle=allow_pickle)
            if local:
                out.rank_local.append(Entry(name, path, "object", value=encoded, rank=rank))
            else:
                out.rows.append(Row(key, "object"))
                out.objects[key] = encoded
            continue
        piece, offsets, sizes = local_box(value)
        check_tensor(piece, name)
        first = None if local else seen.first(piece, key)
        if first is not None:
            out.rows.append(Row(key, "alias", alias_of=first))
            continue
        source = plain_source(piece)
        dtype, shape = dtype_name(value.dtype), tuple(value.shape)
        entry = Entry(name, path, "tensor", dtype=dtype, shape=shape, rank=rank if local else None)
        if local:
            out.rank_local.append(entry)
        else:
            out.entries[key] = entry
            out.rows.append(Row(key, "tensor", dtype, shape, offsets, sizes, source.nbytes))
        file_name = name if sizes == shape else f"{name}@{','.join(map(str, offsets))}"
        while file_name in names:
            file_name += "#"
        names.add(file_name)
        out.items.append(WriteItem(entry, file_name, source, offsets, (key, offsets), local))
    return out


class _Stopped(CheckpointError):
    """A writer thread gave up because another writer of the same save failed."""


def _file_parts(header: bytes, items: list[WriteItem], chunks: list[Chunk], block_size: int,
                stop: threading.Event) -> Iterator[memoryview]:
    """Yield the file's bytes in cache-sized pieces, each hashed into its block's checksum just
    before it is written, so the bytes are read from memory once for both; raise :class:`_Stopped`
    once ``stop`` is set."""
    yield memoryview(header)
    whole = min(block_size, CACHE_PIECE)  # an item this small is one block, hashed in one call
    for item, chunk in zip(items, chunks):
        if stop.is_set():
            raise _Stopped("another writer of this save failed")
        data = tensor_bytes(item.tensor)
        n = len(data)
        if n <= whole:
            chunk.checksums.append(xxhash.xxh3_64_hexdigest(data))
            yield data
            continue
        for start in range(0, n, block_size):
            end = min(start + block_size, n)
            hasher = xxhash.xxh3_64()
            for lo in range(start, end, CACHE_PIECE):
                if stop.is_set():
                    raise _Stopped("another writer of this save failed")
                piece = data[lo:min(lo + CACHE_PIECE, end)]
                hasher.update(piece)
                yield piece
            chunk.checksums.append(hasher.hexdigest())


def _write_file(storage: Storage, name: str, items: list[WriteItem], generation: str, block_size: int,
                stop: threading.Event) -> tuple[str, int, list[Chunk], str]:
    """Write one data file; returns its name, size, chunks and header checksum. A failure sets
    ``stop``, so the save's other writers give up too."""
    with gc_paused():
        header, offsets = safetensors_header(
            (FileItem(i.name, i.tensor.dtype, tuple(i.tensor.shape), i.nbytes) for i in items), generation)
        chunks = [Chunk(i.offsets, tuple(i.tensor.shape), name, off, i.nbytes) for i, off in zip(items, offsets)]
    try:
        size = storage.write(name, _file_parts(header, items, chunks, block_size, stop))
    except BaseException:
        stop.set()
        raise
    expected = len(header) + sum(i.nbytes for i in items)
    if size != expected:
        raise CheckpointError(f"wrote {size} bytes to {name}, expected {expected}")
    return name, size, chunks, xxhash.xxh3_64_hexdigest(header)


@dataclass
class SaveInfo:
    """What one rank's ``save`` did: the checkpoint it committed and where the time went."""

    path: str
    generation: str
    step: int | None
    bytes_written: int
    replanned: bool
    collect_s: float
    plan_s: float
    write_s: float
    commit_s: float
    total_s: float


class SavePlanner:
    """Computes save plans and caches them per process group and structure (see :mod:`zerostall.plan`).

    A save of a cached structure costs one all-reduce of two int64s, whatever the world size: each
    rank proposes the most recently used cached plan that fits its own structure (slot ``p``, 1-based;
    0 for none) and contributes ``p + p**2 << 32``; the sums ``S1 = sum(p)`` and ``S2 = sum(p**2)``
    satisfy ``S1**2 == world * S2`` exactly when every rank proposed the same slot, so agreement is
    exact, not probabilistic. The second lane carries the coordinator's clock for the generation id.
    Every rank's cache changes only on agreed outcomes, so slot numbers mean the same plan everywhere.
    """

    def __init__(self, cache_size: int = 8) -> None:
        self._caches: dict[Any, list[SavePlan]] = {}
        self._cache_size = cache_size

    @staticmethod
    def refuse(group: Group) -> None:
        """Take part in the first planning collective as a rank that cannot save: every rank then
        raises, where the others would wait for this one in the collective for good."""
        group.all_reduce_ints([0, 0, 1])

    def plan(self, group: Group, collected: Collected) -> tuple[SavePlan, str, bool]:
        """The plan, the generation id every rank uses, and whether planning ran (not cached)."""
        cache = self._caches.setdefault(group.pg, [])
        digest = structure_digest(collected.rows)
        slot = next((n for n, p in enumerate(cache, 1) if p.digests[group.rank] == digest), 0)
        clock = time.time_ns() if group.is_coordinator else 0
        proposals, clock, refused = group.all_reduce_ints([slot + (slot * slot << 32), clock, 0])
        if refused:
            raise CheckpointError(f"{refused} other rank(s) could not collect their state for this save (their "
                                  "errors name the key); nothing was written")
        s1, s2 = proposals & 0xFFFFFFFF, proposals >> 32
        if s1 and s1 * s1 == group.size * s2:
            plan = cache.pop(s1 // group.size - 1)
            cache.insert(0, plan)
            return plan, generation_id(clock, plan.seed), False
        gathered = group.all_gather_object((collected.rows, secrets.randbits(32)))
        structures = [rows for rows, _ in gathered]
        try:
            plan = build_plan(structures, [structure_digest(rows) for rows in structures], seed=gathered[0][1])
        except ValueError as exc:
            raise StateMismatchError(str(exc)) from None
        _check_replicas(group, plan, collected)
        cache.insert(0, plan)
        del cache[self._cache_size:]
        return plan, generation_id(clock, plan.seed), True


def _check_replicas(group: Group, plan: SavePlan, collected: Collected) -> None:
    """On a structure's first save, check by checksum that every replica holds the same value."""
    if group.size == 1:
        return
    mine: dict[ChunkKey, int] = {}
    for item in collected.items:
        if not item.rank_local and len(plan.holders[item.key]) > 1:
            mine[item.key] = xxhash.xxh3_64_intdigest(tensor_bytes(item.tensor.cpu()))
    for key, encoded in collected.objects.items():
        if len(plan.holders[(key, ())]) > 1:
            mine[(key, ())] = xxhash.xxh3_64_intdigest(json.dumps(encoded, sort_keys=True).encode())
    everyone = group.all_gather_object(mine)
    bad = sorted({key for d in everyone for key, h in d.items() if any(o.get(key, h) != h for o in everyone)})
    if bad:
        names = ", ".join(fqn(decode_path(json.loads(k))) + (f" (box at {list(o)})" if o else "") for k, o in bad)
        raise StateMismatchError(f"replicas disagree on {names}: ranks hold different values for a leaf that is "
                                 "not sharded; make them equal or mark it with zerostall.rank_local()")


_PLANNER = SavePlanner()


@dataclass
class Prepared:
    """A save after its collective part: what this rank writes, under which generation, and how.

    Built in the caller's thread (planning may run collectives); :func:`persist` then needs no
    process group, so it can run in a background writer.
    """

    group: Group
    collected: Collected
    plan: SavePlan
    generation: str
    replanned: bool
    items: list[WriteItem]
    storage: Storage
    step: int | None
    metadata: Any
    threads: int
    block_size: int
    commit_timeout: float
    collect_s: float
    plan_s: float


def prepare(state: Any, path: str | os.PathLike[str], *, process_group: Any = None, step: int | None = None,
            metadata: Mapping[str, Any] | None = None, threads: int | None = None, fsync: bool = True,
            allow_pickle: bool = False, block_size: int = DEFAULT_BLOCK_SIZE,
            commit_timeout: float = 600.0) -> Prepared:
    """Collect, encode and plan a save (collective when distributed); no byte is written yet."""
    t0 = time.perf_counter()
    group = Group(process_group)
    with gc_paused():
        try:
            collected = collect(state, group.rank, allow_pickle=allow_pickle)
        except Exception:
            _PLANNER.refuse(group)
            raise
        t_collect = time.perf_counter()
        plan, generation, replanned = _PLANNER.plan(group, collected)
        items = [i for i in collected.items if i.rank_local or plan.writes(group.rank, i.key)]
    encoded = codec.encode(dict(metadata or {}), where="metadata", allow_pickle=allow_pickle)
    return Prepared(group, collected, plan, generation, replanned, items, storage_for(path, fsync=fsync), step,
                    encoded, threads or default_threads(), block_size, commit_timeout, t_collect - t0,
                    time.perf_counter() - t_collect)


def for_writer_process(prepared: Prepared) -> Prepared:
    """A picklable copy of ``prepared`` for a writer process: no process group, no live tensors
    other than the (captured, shared-memory) items this rank writes, storage by path (a
    :class:`LocalStorage` pickles as its path and fsync setting)."""
    if not isinstance(prepared.storage, LocalStorage):
        raise CheckpointError(f"a writer process needs a local path, not {prepared.storage.location}")
    collected = dataclasses.replace(prepared.collected, items=[])
    return dataclasses.replace(prepared, group=prepared.group.detached(), collected=collected)


def persist(prepared: Prepared) -> SaveInfo:
    """Write this rank's items and take part in the commit (see :mod:`zerostall.commit`)."""
    p, group, storage, generation = prepared, prepared.group, prepared.storage, prepared.generation
    t0 = time.perf_counter()
    for item in p.items:
        if item.tensor.device.type != "cpu":
            item.tensor = item.tensor.cpu()
    previous = manifest_generation(storage) if group.is_coordinator else None  # see commit()
    try:
        _create(storage)
        files, headers = _write_data(storage, p.items, generation, group.rank, p.threads, p.block_size)
        if not group.is_coordinator:
            with gc_paused():
                record = _record(p.collected, p.plan, group.rank, files, headers, p.items)
            write_record(storage, generation, group.rank, "done", record)
    except BaseException as exc:
        _delete_generation(storage, generation, group.rank)
        if group.size > 1:
            _report_failure(storage, generation, group, exc)
        storage.close()
        raise
    t_write = time.perf_counter()
    try:
        if group.is_coordinator:
            others = await_records(storage, generation, list(range(1, group.size)), p.commit_timeout)
            with gc_paused():
                commit(storage, assemble(p.collected, p.plan, files, headers, others, generation, group.size,
                                         p.step, p.metadata, p.block_size), previous)
        else:
            await_commit(storage, generation, p.commit_timeout)
    except BaseException as exc:
        if group.is_coordinator and manifest_generation(storage) != generation:
            if group.size > 1:
                write_abort(storage, generation, f"{type(exc).__name__}: {exc}")
            _delete_generation(storage, generation, group.rank)
            storage.delete(manifest_tmp_name(generation))
        storage.close()
        raise
    if group.is_coordinator:
        clean_up_after_commit(storage, generation, previous)
    storage.close()
    end = time.perf_counter()
    return SaveInfo(storage.location, generation, p.step, sum(files.values()), p.replanned, p.collect_s,
                    p.plan_s, t_write - t0, end - t_write, p.collect_s + p.plan_s + end - t0)


@gc_paused()  # the caller waits: no cyclic collections over the per-leaf objects
def save(state: Any, path: str | os.PathLike[str], *, process_group: Any = None, step: int | None = None,
         metadata: Mapping[str, Any] | None = None, threads: int | None = None, fsync: bool = True,
         allow_pickle: bool = False, block_size: int = DEFAULT_BLOCK_SIZE,
         commit_timeout: float = 600.0) -> SaveInfo:
    """Save ``state`` to ``path`` and return once the checkpoint is committed (durable, visible).

    ``state`` is any nesting of dicts/lists/tuples of tensors (DTensors included), python values
    and objects with ``state_dict()``. Collective when ``torch.distributed`` is initialized: every
    rank calls it; replicated data is written once, balanced over the ranks that hold it. Saving
    into an existing checkpoint leaves it intact until the new manifest commits; a rank that fails
    or dies fails the save everywhere within ``commit_timeout`` seconds, with no manifest written.
    ``fsync=False`` trades durability for speed on scratch storage. An asynchronous save still in
    flight (:func:`zerostall.async_save`) is waited for first.
    """
    from .background import wait_for_default

    wait_for_default()
    return persist(prepare(state, path, process_group=process_group, step=step, metadata=metadata,
                           threads=threads, fsync=fsync, allow_pickle=allow_pickle, block_size=block_size,
                           commit_timeout=commit_timeout))


def _report_failure(storage: Storage, generation: str, group: Group, exc: BaseException) -> None:
    """Make the other ranks give up now instead of at the timeout (best effort)."""
    reason = f"{type(exc).__name__}: {exc}"
    try:
        if group.is_coordinator:
            write_abort(storage, generation, reason)
        else:
            write_record(storage, generation, group.rank, "failed", {"error": reason})
    except OSError:
        log.warning("could not record the failure of rank %d in %s", group.rank, storage.location)


def _record(collected: Collected, plan: SavePlan, rank: int, files: dict[str, int], headers: dict[str, str],
            written: list[WriteItem]) -> dict[str, Any]:
    """This rank's ``done`` record: its files (sizes, header checksums), the chunks it wrote and
    the values it owns."""
    return {
        "rank": rank,
        "files": files,
        "headers": headers,
        "chunks": [[i.key[0], i.entry.chunks[-1].to_json()] for i in written if not i.rank_local],
        "objects": [[k, v] for k, v in collected.objects.items() if plan.writes(rank, (k, ()))],
        "rank_local": [e.to_json(encode_path) for e in collected.rank_local],
    }


def assemble(collected: Collected, plan: SavePlan, files: dict[str, int], headers: dict[str, str],
             records: dict[int, dict[str, Any]], generation: str, world_size: int, step: int | None, metadata: Any,
             block_size: int) -> Manifest:
    """The coordinator builds the manifest from the plan, its own entries (which already hold the
    chunks it wrote) and the other ranks' records."""
    entries: list[Entry] = []
    index: dict[tuple[str, int | None], int] = {}
    paths = {key: path for path, key in collected.keys.items()}
    for row in plan.entries:
        entry = collected.entries.get(row.key)
        if entry is None:
            path = paths.get(row.key) or decode_path(json.loads(row.key))
            entry = Entry(fqn(path), path, row.kind, dtype=row.dtype, shape=row.shape)
        index[(row.key, None)] = len(entries)
        entries.append(entry)
    for row, entry in zip(plan.entries, entries):
        if row.kind == "alias":
            entry.alias_of = index[(row.alias_of or "", None)]
    for key, value in collected.objects.items():
        if plan.writes(0, (key, ())):
            entries[index[(key, None)]].value = value
    for entry in collected.rank_local:
        index[(collected.keys[entry.path], 0)] = len(entries)
        entries.append(entry)
    files, headers = dict(files), dict(headers)
    for rank, record in sorted(records.items()):
        files.update(record["files"])
        headers.update(record["headers"])
        for key, chunk in record["chunks"]:
            entries[index[(key, None)]].chunks.append(Chunk.from_json(chunk))
        for key, value in record["objects"]:
            entries[index[(key, None)]].value = value
        for data in record["rank_local"]:
            entry = Entry.from_json(data, decode_path)
            index[(path_key(entry.path), rank)] = len(entries)
            entries.append(entry)
    for entry in entries:
        if len(entry.chunks) > 1:
            entry.chunks.sort(key=operator.attrgetter("offsets"))
    for path, ref in collected.refs.items():
        key = collected.keys[path]
        ref.index = index.get((key, None), index.get((key, 0), -1))
    return Manifest(generation=generation, entries=entries, files=files, tree=codec.encode(collected.skeleton),
                    world_size=world_size, block_size=block_size, step=step, metadata=metadata, headers=headers)


def _create(storage: Storage) -> None:
    try:
        storage.create()
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {storage.location}: {exc}") from exc


def _write_data(storage: Storage, items: list[WriteItem], generation: str, rank: int, threads: int,
                block_size: int) -> tuple[dict[str, int], dict[str, str]]:
    """Write this rank's items into balanced files in parallel; each item's chunk is appended to its
    entry. Returns each file's size and the checksum of its header."""
    with gc_paused():
        groups = assign_files(items, threads) if items else []
    names = [data_file_name(generation, rank, n) for n in range(len(groups))]
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=max(1, len(groups)), thread_name_prefix="zerostall-write") as pool:
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


def commit(storage: Storage, manifest: Manifest, previous: str | None) -> None:
    """Publish the manifest: the single atomic step that makes the checkpoint exist. Refused at the
    last moment if the manifest in place is no longer ``previous`` (the generation this save
    found when it began writing): another save committed into the path meanwhile (two writers on
    one path), its clean-up may have removed this save's data files, and its checkpoint stays."""
    def unchanged() -> None:
        current = manifest_generation(storage)
        if current != previous:
            raise CheckpointError(f"the save {manifest.generation} into {storage.location} was not committed: "
                                  f"another save ({current}) committed there while it was in flight (two writers "
                                  "on one path?); that checkpoint is kept")

    try:
        storage.publish(MANIFEST_NAME, manifest_tmp_name(manifest.generation), manifest.to_bytes(encode_path),
                        before_replace=unchanged)
    except OSError as exc:
        raise CheckpointError(f"committing the manifest in {storage.location} failed: {exc}") from exc


def _delete_generation(storage: Storage, generation: str, rank: int) -> None:
    """Remove this rank's files of a save that did not commit."""
    own = f"{generation}-r{rank:05d}"
    for name in storage.list():
        if name.startswith(own):
            try:
                storage.delete(name)
            except OSError:
                log.warning("could not remove %s of the failed save in %s", name, storage.location)


def clean_up_after_commit(storage: Storage, keep: str, replaced: str | None) -> None:
    """After a commit, remove the files of older generations (no manifest references them any
    more), of the generation the commit ``replaced`` (whatever its date: a writer's clock may
    have run ahead) and the commit records of this one. Other newer generations may belong to
    a save still in flight, so they stay."""
    for name in storage.list():
        gen = file_generation(name)
        older = gen is not None and gen != keep and (gen == replaced or generation_time(gen) <= generation_time(keep))
        if older or (gen == keep and parse_record(name) is not None):
            try:
                storage.delete(name)
            except OSError as exc:
                log.warning("could not remove stale %s in %s: %s", name, storage.location, exc)
