"""Reading: a session on one committed checkpoint: its entries, single tensors, loads and verification.

Every block read is checked against its xxh3 checksum (unless the caller opts out). Loads fill
target tensors in place, straight from storage into their memory when dtype and layout match,
and through a bounded staging buffer otherwise (dtype conversion, slices, other devices).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
import heapq
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence, overload

import torch
import xxhash

from . import codec, errors
from .collectives import Group
from .commit import manifest_generation
from .engine import CACHE_PIECE, ViewIndex, decode_path, default_threads, local_box
from .memory import tensor_bytes
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError, StateMismatchError, UnsupportedValueError)
from .gcpause import gc_paused
from .format import MANIFEST_NAME, Chunk, Entry, Manifest, ManifestHead, file_generation
from .plan import Box, contiguous_strides, element_span, flat_boxes, intersect
from .state import Flat, Path, flatten, fqn, init_optimizer_state, rebuild
from .storage import Storage, storage_for

log = logging.getLogger(__name__)

_PIECE_BYTES = 32 << 20
_STAGE_BYTES = 4 << 20  # a staged read: copied into its target while still in the CPU cache
Piece = tuple[Entry, Chunk, int, memoryview]  # bytes [lo, lo + len(out)) of a chunk, to be read into out
Staged = tuple[torch.Tensor, Box, Entry, Chunk, Box]  # a target, its box, an entry, a chunk, their overlap
StageJob = tuple[torch.Tensor, Box, Entry, Chunk, Box, int, int]  # a Staged and chunk bytes [lo, hi) of it
DEFAULT_STAGING_BYTES = 256 << 20
KeyFilter = Callable[[str], bool] | Iterable[str] | None


@dataclass
class Mismatch:
    """What a non-strict load could not match: fully-qualified names, with the reason for shapes."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def describe(self, limit: int = 20) -> str:
        parts = []
        for label, names in (("missing from the checkpoint", self.missing),
                             ("unexpected in the checkpoint", self.unexpected),
                             ("mismatched", self.mismatched)):
            if names:
                shown = ", ".join(names[:limit]) + (f", … ({len(names) - limit} more)" if len(names) > limit else "")
                parts.append(f"{label}: {shown}")
        return "; ".join(parts)


def read_manifest_bytes(storage: Storage) -> bytes:
    """The committed manifest's raw bytes at ``storage``, or the precise error for why there is none."""
    if not storage.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {storage.location}")
    try:
        return storage.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        data = [n for n in storage.list() if file_generation(n)]
        if not data:
            raise CheckpointNotFoundError(f"no checkpoint at {storage.location} (no manifest, no data files)") from None
        raise IncompleteCheckpointError(
            f"{storage.location} has no manifest: its save never committed "
            f"({len(data)} uncommitted data file(s) present)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read the manifest of {storage.location}: {exc}") from exc


def parse_manifest(storage: Storage, raw: bytes) -> Manifest:
    with gc_paused():
        return Manifest.from_bytes(raw, decode_path, os.path.join(storage.location, MANIFEST_NAME))


def read_manifest(storage: Storage) -> Manifest:
    """The committed manifest at ``storage``."""
    return parse_manifest(storage, read_manifest_bytes(storage))


def read_manifest_head(storage: Storage) -> ManifestHead:
    """The committed manifest at ``storage`` without its entries (checksum still checked)."""
    return ManifestHead.from_bytes(read_manifest_bytes(storage), os.path.join(storage.location, MANIFEST_NAME))


class Checkpoint:
    """A read session on one checkpoint (what :func:`zerostall.open` returns); use it as a context manager."""

    def __init__(self, path: str | os.PathLike[str], *, process_group: Any = None, verify: bool = True,
                 allow_pickle: bool = False, threads: int | None = None) -> None:
        self.group = Group(process_group)
        self.storage = storage_for(path)
        self.path = self.storage.location
        self.tag = os.path.basename(self.path.rstrip("/"))
        self.manifest = _agreed_manifest(self.storage, self.group)
        self.verify_reads = verify
        self.allow_pickle = allow_pickle
        self.threads = threads or default_threads()
        block = self.manifest.block_size
        self._piece_step = max(block, _PIECE_BYTES // block * block)  # the largest read, whole blocks
        self._maps: dict[str, memoryview | None] = {}
        self._scratch = threading.local()

    # -- what is in it -------------------------------------------------------------------------
    @functools.cached_property
    def _by_path(self) -> dict[tuple[Path, int | None], Entry]:
        """Entries by (path, rank): built on first use, since a load matches by path without it."""
        return {(e.path, e.rank): e for e in self.manifest.entries}

    @functools.cached_property
    def _by_fqn(self) -> dict[str, Entry]:
        by_fqn: dict[str, Entry] = {}
        for e in self.manifest.entries:
            by_fqn.setdefault(e.fqn if e.rank is None else f"{e.fqn}@rank{e.rank}", e)
        return by_fqn

    @property
    def entries(self) -> dict[str, Entry]:
        """Entries by fully-qualified name, in save order."""
        return dict(self._by_fqn)

    @property
    def metadata(self) -> dict[str, Any]:
        """The caller's metadata given to ``save``, decoded."""
        return codec.decode(self.manifest.metadata, where="metadata", allow_pickle=self.allow_pickle) or {}

    @property
    def step(self) -> int | None:
        return self.manifest.step

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release file handles; tensors returned by :meth:`read` stay valid."""
        self.storage.close()
        self._maps.clear()

    def _entry(self, key: str | Path) -> Entry:
        if isinstance(key, tuple):
            entry = self._by_path.get((key, None)) or self._by_path.get((key, self.group.rank))
        else:
            entry = self._by_fqn.get(key) or self._by_fqn.get(f"{key}@rank{self.group.rank}")
        if entry is None:
            raise KeyError(f"{key!r} is not in checkpoint {self.path}")
        return self._resolve(entry)

    def _resolve(self, entry: Entry) -> Entry:
        entries = self.manifest.entries
        if entry.kind == "alias":
            index = entry.alias_of
            if not isinstance(index, int) or not 0 <= index < len(entries) or entries[index].kind != "tensor":
                raise CorruptCheckpointError(f"entry {entry.fqn} aliases entry #{index}, which is not a tensor "
                                             f"entry of {self.path}")
            return entries[index]
        return entry

    # -- reading -------------------------------------------------------------------------------
    def read(self, key: str | Path, *, verify: bool | None = None) -> Any:
        """One entry, whole: a tensor (memory-mapped from the file where possible) or a python value.

        ``key`` is a dotted name or a key path tuple; a rank-local entry is this rank's copy
        (``"name@rankN"`` names another rank's)."""
        entry = self._entry(key)
        if entry.kind == "object":
            return codec.decode(entry.value, where=entry.fqn, allow_pickle=self.allow_pickle)
        verify = self.verify_reads if verify is None else verify
        shape, dtype = entry.shape or (), entry.torch_dtype
        chunk = entry.chunks[0] if len(entry.chunks) == 1 else None
        if chunk is not None and chunk.sizes == shape and chunk.nbytes > 0:
            mapped = self._map(chunk.file)
            if mapped is not None:
                if chunk.offset + chunk.nbytes > len(mapped):
                    raise CorruptCheckpointError(f"{chunk.file} is truncated: entry {entry.fqn} lies past its end")
                if verify:
                    self._check_blocks(entry, chunk, 0, mapped[chunk.offset:chunk.offset + chunk.nbytes])
                raw = torch.frombuffer(mapped, dtype=torch.uint8, count=chunk.nbytes, offset=chunk.offset)
                return raw.view(dtype).reshape(shape)
        out = torch.empty(shape, dtype=dtype)
        self._fill([(out, _whole(out), entry)], verify)
        return out

    def state(self) -> Any:
        """The whole saved state, rebuilt from the manifest's tree (tensors memory-mapped).

        The tree is the coordinator's view; global entries that only other ranks held (pipeline
        stages) are added by their key paths. Rank-local entries appear as this rank's.
        """
        tree = codec.decode(self.manifest.tree, allow_pickle=self.allow_pickle)
        entries = self.manifest.entries
        index = {id(e): i for i, e in enumerate(entries)}
        cache: dict[int, Any] = {}
        referenced: set[int] = set()

        def value(i: int) -> Any:
            referenced.add(i)
            target = index[id(self._resolve(entries[i]))]
            if target not in cache:
                cache[target] = self.read(entries[target].path)
            return cache[target]

        result = _build(tree, value)
        for i, entry in enumerate(entries):
            if i not in referenced and entry.rank is None and isinstance(result, dict) and entry.path:
                _insert(result, entry.path, value(i))
        return result

    def _map(self, name: str) -> memoryview | None:
        if name not in self._maps:
            try:
                self._maps[name] = self.storage.memory_map(name)
            except FileNotFoundError:
                raise self._missing(name) from None
        return self._maps[name]

    # -- loading into a target state -----------------------------------------------------------
    @overload
    def load(self, state: Any, *, strict: Literal[True] = ..., prefix: str | Path = ..., keys: KeyFilter = ...,
             strip: Sequence[str] = ..., strict_dtype: bool = ..., materialize: bool = ...,
             verify: bool | None = ..., broadcast: bool = ..., max_staging_bytes: int = ...) -> Any: ...

    @overload
    def load(self, state: Any, *, strict: Literal[False], prefix: str | Path = ..., keys: KeyFilter = ...,
             strip: Sequence[str] = ..., strict_dtype: bool = ..., materialize: bool = ...,
             verify: bool | None = ..., broadcast: bool = ...,
             max_staging_bytes: int = ...) -> tuple[Any, Mismatch]: ...

    @gc_paused()  # the caller waits: no cyclic collections over the per-leaf objects
    def load(self, state: Any, *, strict: bool = True, prefix: str | Path = (), keys: KeyFilter = None,
             strip: Sequence[str] = (), strict_dtype: bool = False, materialize: bool = False,
             verify: bool | None = None, broadcast: bool = False,
             max_staging_bytes: int = DEFAULT_STAGING_BYTES) -> Any:
        """Fill ``state`` in place from this checkpoint and return it.

        ``prefix`` selects a subtree of the checkpoint (``"model"`` loads a bare model from a
        full training checkpoint); ``keys`` filters by name (a predicate or glob patterns);
        ``strip`` drops wrapper segments such as ``("_orig_mod", "module")`` from key names on
        both sides. With ``strict=True`` any missing/unexpected key or shape mismatch raises
        :class:`StateMismatchError` before anything is modified; with ``strict=False`` what
        matches is loaded and ``(state, Mismatch)`` is returned. dtypes convert like
        ``load_state_dict`` unless ``strict_dtype``. Meta-device targets need ``materialize``.

        Collective when distributed: each rank reads only the bytes its targets need (DTensor
        shards reshard from any saved layout). ``broadcast=True`` has one rank read each chunk
        that every rank needs whole and broadcast it to the others; if one rank's state does not
        match, every rank raises before anything is read. Bytes that cannot go straight
        into a target pass through one staging buffer per reader thread, together at most
        ``max_staging_bytes`` (and at least a block each; pinned when the target is on a GPU),
        and are copied into the target by the thread that read them.
        """
        verify = self.verify_reads if verify is None else verify
        together = broadcast and self.group.size > 1  # then every rank takes part in every broadcast
        with (self.group.failing_together(f"broadcast load from {self.path} refused: {{failed}} other rank(s) could "
                                          "not match their state with it (their errors name the keys); nothing was "
                                          "loaded") if together else contextlib.nullcontext()):
            flat, plan = self._plan(state, strict, prefix, keys, strip, strict_dtype, materialize)
        received = self._broadcast_fill(plan.tensors, verify, max_staging_bytes) if together else set()
        self._fill(plan.tensors, verify, skip=received, staging=max_staging_bytes)
        for path, entry, like in plan.new_tensors:
            plan.replacements[path] = self._materialize(entry, like, verify)
        result = rebuild(state, flat, plan.replacements, assign=materialize)
        if strict:
            return result
        if plan.mismatch:
            log.warning("partial load from %s: %s", self.path, plan.mismatch.describe())
        return result, plan.mismatch

    def _plan(self, state: Any, strict: bool, prefix: str | Path, keys: KeyFilter, strip: Sequence[str],
              strict_dtype: bool, materialize: bool) -> tuple[Flat, _LoadPlan]:
        """Match every target leaf with its entry; raise on a strict mismatch before any byte moves."""
        prefix_path = (prefix,) if isinstance(prefix, str) else tuple(prefix)
        select = _key_filter(keys)
        source = self._source_index(prefix_path, strip, select)
        under = {rel[:i] for rel in source for i in range(len(rel))}

        def prepare(path: Path, obj: Any) -> None:
            if isinstance(obj, torch.optim.Optimizer) and _normalize(path + ("state",), strip) in under:
                init_optimizer_state(obj)

        flat = flatten(state, prepare=prepare)
        plan = _LoadPlan()
        seen_targets = ViewIndex()
        world_changed = self.manifest.world_size != self.group.size
        for path, value in flat.leaves.items():
            rel = _normalize(path, strip)
            if select is not None and not select(fqn(rel)):
                continue
            if world_changed and path in flat.rank_local and rel not in source:
                plan.mismatch.mismatched.append(f"{fqn(path)} (rank-local, saved by {self.manifest.world_size} "
                                                f"ranks, loading on {self.group.size})")
                continue
            self._match(plan, path, rel, value, source, under, strict_dtype, materialize, seen_targets)
        plan.mismatch.unexpected = [e.fqn for rel, e in source.items() if rel not in plan.consumed]
        if plan.meta:
            raise StateMismatchError(
                f"targets on the meta device have no memory to load into: {', '.join(plan.meta[:20])}; "
                "pass materialize=True to allocate them from the checkpoint")
        if strict and plan.mismatch:
            raise StateMismatchError(f"checkpoint {self.path} does not match the target state: {plan.mismatch.describe()}")
        return flat, plan

    def _source_index(self, prefix: Path, strip: Sequence[str],
                      select: Callable[[str], bool] | None) -> dict[Path, Entry]:
        source: dict[Path, Entry] = {}
        same_world = self.manifest.world_size == self.group.size
        for e in self.manifest.entries:
            if e.rank is not None and (not same_world or e.rank != self.group.rank):
                continue
            if e.path[:len(prefix)] != prefix:
                continue
            rel = _normalize(e.path[len(prefix):], strip)
            if select is not None and not select(fqn(rel)):
                continue
            if rel in source:
                raise StateMismatchError(f"entries {source[rel].fqn} and {e.fqn} collide once {list(strip)} are stripped")
            source[rel] = e
        return source

    def _match(self, plan: "_LoadPlan", path: Path, rel: Path, value: Any, source: dict[Path, Entry],
               under: set[Path], strict_dtype: bool, materialize: bool, seen: ViewIndex) -> None:
        entry = source.get(rel)
        if entry is None:
            if isinstance(value, (dict, list, tuple)) and not value and rel in under:
                plan.replacements[path] = self._subtree(source, rel, plan.consumed)
            else:
                plan.mismatch.missing.append(fqn(path))
            return
        plan.consumed.add(rel)
        entry = self._resolve(entry)
        if not isinstance(value, torch.Tensor):
            if entry.kind == "tensor":
                plan.new_tensors.append((path, entry, None))
            else:
                plan.replacements[path] = codec.decode(entry.value, where=entry.fqn, allow_pickle=self.allow_pickle)
            return
        if entry.kind != "tensor":
            plan.mismatch.mismatched.append(f"{fqn(path)} (the checkpoint holds a python value, the target a tensor)")
        elif value.shape != entry.shape:
            plan.mismatch.mismatched.append(f"{fqn(path)} (shape {list(entry.shape or ())} in the checkpoint, "
                                            f"{list(value.shape)} in the target)")
        elif strict_dtype and value.dtype != entry.torch_dtype:
            plan.mismatch.mismatched.append(f"{fqn(path)} (dtype {entry.dtype} in the checkpoint, "
                                            f"{str(value.dtype).removeprefix('torch.')} in the target)")
        elif value.is_meta:
            if materialize:
                plan.new_tensors.append((path, entry, value))
            else:
                plan.meta.append(fqn(path))
        else:
            piece, offsets, sizes = local_box(value)
            if seen.first(piece, True) is None:
                plan.tensors.append((piece, (offsets, sizes), entry))

    def _subtree(self, source: dict[Path, Entry], root: Path, consumed: set[Path]) -> Any:
        """Rebuild the checkpoint's subtree under ``root`` for a target that holds an empty container."""
        tree: dict[Any, Any] = {}
        for rel, entry in source.items():
            if rel[:len(root)] == root and len(rel) > len(root):
                consumed.add(rel)
                _insert(tree, rel[len(root):], self.read(entry.path))
        return tree

    def _materialize(self, entry: Entry, like: torch.Tensor | None, verify: bool) -> torch.Tensor:
        dtype = like.dtype if like is not None else entry.torch_dtype
        out = torch.empty(entry.shape or (), dtype=dtype)
        self._fill([(out, _whole(out), entry)], verify)
        return out

    # -- moving bytes --------------------------------------------------------------------------
    def _fill(self, targets: list[tuple[torch.Tensor, Box, Entry]], verify: bool, skip: set[int] = frozenset(),
              staging: int = DEFAULT_STAGING_BYTES) -> None:
        """Copy into each target (a tensor holding ``box`` of its entry) the bytes of every chunk
        that intersects it, reading in parallel: straight into the target when a chunk is exactly
        the target's box and layouts match, through staging buffers otherwise. Chunks whose
        ``id`` is in ``skip`` were already delivered (by broadcast)."""
        direct, staged = self._route(targets, skip)
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="zerostall-read") as pool:
                _run(pool, self.threads, self._read_run, _runs(direct, _piece_span), verify)
                block = self.manifest.block_size
                step = max(block, min(_STAGE_BYTES, staging // self.threads) // block * block)
                jobs = [job for item in staged for job in self._stage_jobs(item, step, verify)]
                stream = torch.cuda.current_stream() if any(job[0].is_cuda for job in jobs) else None
                stage = functools.partial(self._stage_run, stream=stream)
                _run(pool, self.threads, stage, _runs(jobs, _job_span), verify)
        finally:
            self.storage.close()  # the files these threads held open: the next fill has new threads

    def _route(self, targets: list[tuple[torch.Tensor, Box, Entry]],
               skip: set[int]) -> tuple[list[Piece], list[Staged]]:
        """Split the reads for ``targets``: pieces that go straight into a target, and chunk parts
        that go through staging; raise if some part of a target has no stored bytes."""
        direct: list[Piece] = []
        staged: list[Staged] = []
        for target, box, entry in targets:
            covered = 0
            for chunk in entry.chunks:
                inter = box if box == (chunk.offsets, chunk.sizes) else intersect(box, (chunk.offsets, chunk.sizes))
                if inter is None:
                    continue
                covered += math.prod(inter[1])
                if id(chunk) in skip:
                    continue
                if _direct(target, box, entry, chunk):
                    direct.extend(self._pieces(entry, chunk, 0, tensor_bytes(target)))
                else:
                    staged.append((target, box, entry, chunk, inter))
            if covered < math.prod(box[1]):
                raise CorruptCheckpointError(f"entry {entry.fqn} of {self.path} has no data for part of the box "
                                             f"{[list(b) for b in box]}: its chunks do not cover the tensor")
        return direct, staged

    def _broadcast_fill(self, targets: list[tuple[torch.Tensor, Box, Entry]], verify: bool,
                        staging: int) -> set[int]:
        """Deliver the chunks that every rank needs whole: one rank reads each (balanced by bytes,
        verified) and broadcasts it into preallocated buffers, the target itself where layouts
        match; other buffers hold at most ``staging`` bytes at a time. Returns the ids of the
        chunks delivered."""
        if self.group.device.type != "cpu":
            raise CheckpointError("broadcast=True moves host buffers and needs a process group that can (gloo); "
                                  "open the checkpoint with process_group=dist.new_group(backend='gloo')")
        index = {id(e): i for i, e in enumerate(self.manifest.entries)}
        wanted: dict[tuple[int, int], tuple[torch.Tensor, Box, Entry, Chunk]] = {}
        for target, box, entry in targets:
            for n, chunk in enumerate(entry.chunks):
                if intersect(box, (chunk.offsets, chunk.sizes)) == (chunk.offsets, chunk.sizes) and chunk.nbytes:
                    wanted[(index[id(entry)], n)] = (target, box, entry, chunk)
        everyone = self.group.all_gather_object(sorted(wanted))
        common = sorted(set.intersection(*(set(map(tuple, keys)) for keys in everyone)))
        load = [0] * self.group.size
        readers = {}
        for key in sorted(common, key=lambda k: (-wanted[k][3].nbytes, k)):
            readers[key] = min(range(self.group.size), key=lambda r: (load[r], r))
            load[readers[key]] += wanted[key][3].nbytes
        direct = {key for key in common if _direct(*wanted[key])}
        failure: CheckpointError | None = None
        with ThreadPoolExecutor(self.threads, thread_name_prefix="zerostall-read") as pool:
            for batch in _batches(common, lambda k: 0 if k in direct else wanted[k][3].nbytes, staging):
                failure = self._broadcast_batch(pool, batch, wanted, readers, direct, verify) or failure
        with self.group.failing_together(f"broadcast load from {self.path} failed: {{failed}} rank(s) could not "
                                         "read their share (their errors name the file)"):
            if failure is not None:
                raise failure
        return {id(wanted[key][3]) for key in common}

    def _broadcast_batch(self, pool: ThreadPoolExecutor, batch: list[tuple[int, int]],
                         wanted: dict[tuple[int, int], tuple[torch.Tensor, Box, Entry, Chunk]],
                         readers: dict[tuple[int, int], int], direct: set[tuple[int, int]],
                         verify: bool) -> CheckpointError | None:
        """Read this rank's chunks of ``batch``, broadcast every chunk of it from its reader (every
        rank runs the same broadcasts, even after a failed read) and copy staged bytes into their
        targets. Returns this rank's first read failure."""
        buffers = {key: wanted[key][0].data.reshape(-1).view(torch.uint8) if key in direct
                   else torch.empty(wanted[key][3].nbytes, dtype=torch.uint8) for key in batch}
        reads = {key: pool.submit(self._read_chunk, wanted[key][2], wanted[key][3], buffers[key], verify)
                 for key in batch if readers[key] == self.group.rank}
        failure = None
        for key in batch:
            if key in reads:
                try:
                    reads[key].result()
                except CheckpointError as exc:
                    failure = failure or exc
            self.group.broadcast_tensor(buffers[key], src=readers[key])
        with torch.no_grad():
            for key in (k for k in batch if k not in direct):
                target, box, entry, chunk = wanted[key]
                src = buffers[key].view(entry.torch_dtype).reshape(chunk.sizes)
                target[_region((chunk.offsets, chunk.sizes), box)].copy_(src)
        return failure

    def _read_chunk(self, entry: Entry, chunk: Chunk, buf: torch.Tensor, verify: bool) -> None:
        for piece in self._pieces(entry, chunk, 0, tensor_bytes(buf)):
            self._read_piece(*piece, verify)

    def _stage_jobs(self, item: Staged, step: int, verify: bool) -> list[StageJob]:
        """Split the stored bytes of ``item``'s intersection into reads of at most ``step`` bytes,
        whole blocks when verifying, each to be read, checked and copied by one thread."""
        target, box, entry, chunk, inter = item
        if math.prod(inter[1]) == 0:
            return []
        if inter == (chunk.offsets, chunk.sizes):  # the whole chunk (dtype conversion, other layouts)
            lo, hi = 0, chunk.nbytes
        else:
            itemsize = entry.torch_dtype.itemsize
            first, last = element_span((chunk.offsets, chunk.sizes), inter)
            lo, hi = first * itemsize, last * itemsize
            if verify:
                block = self.manifest.block_size
                lo, hi = lo // block * block, min(-(-hi // block) * block, chunk.nbytes)
        return [(target, box, entry, chunk, inter, a, min(a + step, hi)) for a in range(lo, hi, step)]

    def _stage_run(self, run: list[StageJob], verify: bool, stream: Any = None) -> None:
        """Read jobs that lie back to back in one file into this thread's staging buffer (one read
        for several small ones) and copy the part of each intersection they hold into its target
        at once: the bytes are still in the CPU cache, and the copies run in parallel whatever
        torch's own thread setting. Copies to GPU targets run on the caller's ``stream``, after
        the work queued there, and are complete when they return (the buffer is reused)."""
        buf = self._staging(sum(hi - lo for *_, lo, hi in run), pinned=any(job[0].is_cuda for job in run))
        view, pieces, at = tensor_bytes(buf), [], 0
        for _, _, entry, chunk, _, lo, hi in run:
            pieces.append((entry, chunk, lo, view[at:at + hi - lo]))
            at += hi - lo
        self._read_run(pieces, verify)
        at = 0
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for target, box, entry, chunk, inter, lo, hi in run:
                _copy_part(target, box, entry, chunk, inter, lo, buf[at:at + hi - lo].view(entry.torch_dtype))
                at += hi - lo

    def _staging(self, n: int, pinned: bool) -> torch.Tensor:
        """This thread's reusable staging buffer of at least ``n`` bytes (pinned for GPU targets)."""
        buf = getattr(self._scratch, "staging", None)
        if buf is None or buf.numel() < n or buf.is_pinned() != pinned:
            buf = self._scratch.staging = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        return buf

    def _pieces(self, entry: Entry, chunk: Chunk, lo: int, out: memoryview) -> list[Piece]:
        """Split a read of ``chunk`` bytes ``[lo, lo+len(out))`` into block-aligned pieces."""
        step = self._piece_step
        if len(out) <= step:
            return [(entry, chunk, lo, out)]
        return [(entry, chunk, lo + start, out[start:start + step]) for start in range(0, len(out), step)]

    def _read_run(self, run: list[Piece], verify: bool) -> None:
        """Read pieces that lie back to back in one file: one piece with the cache-sized hashing
        of :meth:`_read_piece`, several with one scatter read and then their checks. If that read
        fails they are read one by one, so the error names the entry at fault."""
        if len(run) == 1:
            self._read_piece(*run[0], verify)
            return
        _, chunk, lo, _ = run[0]
        try:
            self.storage.read_into_many(chunk.file, chunk.offset + lo, [piece[3] for piece in run])
        except (OSError, EOFError):
            for piece in run:
                self._read_piece(*piece, verify)
            return
        if verify:
            for piece in run:
                self._check_blocks(*piece)

    def _read_piece(self, entry: Entry, chunk: Chunk, lo: int, out: memoryview, verify: bool) -> None:
        """Read chunk bytes ``[lo, lo+len(out))``; when verifying, hash each cache-sized piece right
        after reading it (``lo`` is then block-aligned) and check every block's checksum."""
        if not verify:
            self._read_raw(entry, chunk, lo, out)
            return
        block = self.manifest.block_size
        self._check_count(entry, chunk)
        for start in range(0, max(len(out), 1), block):
            hasher = xxhash.xxh3_64()
            for offset in range(start, min(start + block, len(out)), CACHE_PIECE):
                piece = out[offset:min(offset + CACHE_PIECE, start + block)]
                self._read_raw(entry, chunk, lo + offset, piece)
                hasher.update(piece)
            self._check_digest(entry, chunk, lo + start, min(block, len(out) - start), hasher.hexdigest())

    def _read_raw(self, entry: Entry, chunk: Chunk, lo: int, out: memoryview) -> None:
        try:
            self.storage.read_into(chunk.file, chunk.offset + lo, out)
        except FileNotFoundError:
            raise self._missing(chunk.file, entry) from None
        except EOFError:
            raise CorruptCheckpointError(
                f"data file {chunk.file} of {self.path} is truncated: entry {entry.fqn} lies past its end") from None
        except OSError as exc:
            raise CheckpointError(f"reading {chunk.file} of {self.path} (entry {entry.fqn}) failed: {exc}") from exc

    def _missing(self, name: str, entry: Entry | None = None) -> CheckpointError:
        """The error for a data file that is gone: damage, unless the checkpoint changed under this
        session (a save into the same path replaced it, or it was deleted) - then it is not corrupt,
        and a script that deletes corrupt checkpoints must not delete the new one."""
        of = f" (entry {entry.fqn})" if entry is not None else ""
        current = manifest_generation(self.storage)
        if current != self.manifest.generation:
            now = f"another save ({current}) replaced it" if current else "it was deleted"
            return CheckpointError(f"{self.path} changed while this read session was open ({now}): data file "
                                   f"{name}{of} is gone; open the checkpoint again")
        return CorruptCheckpointError(f"data file {name} of {self.path} is missing{of}")

    def _check_count(self, entry: Entry, chunk: Chunk) -> None:
        expected = max(1, -(-chunk.nbytes // self.manifest.block_size))
        if len(chunk.checksums) != expected:
            raise CorruptCheckpointError(f"entry {entry.fqn} in {chunk.file}: {len(chunk.checksums)} checksums for "
                                         f"{expected} blocks")

    def _check_digest(self, entry: Entry, chunk: Chunk, lo: int, length: int, digest: str) -> None:
        index = lo // self.manifest.block_size
        if digest != chunk.checksums[index]:
            first = chunk.offset + lo
            raise CorruptCheckpointError(
                f"checksum mismatch in {chunk.file} of {self.path}: entry {entry.fqn}, block {index} "
                f"(file bytes {first}-{first + length})")

    def _check_blocks(self, entry: Entry, chunk: Chunk, lo: int, data: memoryview) -> None:
        """Check data already in memory (a memory map) against its blocks' checksums."""
        self._check_count(entry, chunk)
        block = self.manifest.block_size
        for start in range(0, max(len(data), 1), block):
            piece = data[start:start + block]
            self._check_digest(entry, chunk, lo + start, len(piece), xxhash.xxh3_64_hexdigest(piece))

    # -- verification --------------------------------------------------------------------------
    def verify(self, *, progress: Callable[[int], None] | None = None) -> int:
        """Check every file size and every block checksum; returns bytes checked.

        ``progress(nbytes)`` is called from the reader threads as blocks are checked. Raises
        :class:`CorruptCheckpointError` listing every fault found (``.faults``), or a plain
        :class:`CheckpointError` when some bytes could not be read at all (permission denied,
        I/O errors): such a checkpoint is unverified, not known to be damaged.
        """
        faults: list[str] = []
        unreadable = False
        jobs = [(e, c) for e in self.manifest.entries if e.kind == "tensor" for c in e.chunks]
        data_start: dict[str, int] = {}  # where each file's data section begins: its header ends there
        for _, chunk in jobs:
            data_start[chunk.file] = min(chunk.offset, data_start.get(chunk.file, chunk.offset))
        for name, size in self.manifest.files.items():
            try:
                actual = self.storage.size(name)
                header_fault = self._header_fault(name, data_start.get(name))
            except FileNotFoundError:
                missing = self._missing(name)
                if not isinstance(missing, CorruptCheckpointError):
                    raise missing from None
                faults.append(f"data file {name} is missing")
                continue
            except OSError as exc:
                faults.append(f"reading the header of data file {name} failed: {exc}")
                unreadable = True
                continue
            if actual != size:
                faults.append(f"data file {name} has {actual} bytes, the manifest says {size}")
            if header_fault:
                faults.append(header_fault)
        for entry in self.manifest.entries:
            try:
                self._resolve(entry)
                if entry.kind == "object" and not self.allow_pickle:
                    _decode_safely(entry)
            except CheckpointError as exc:
                faults.append(str(exc))
        lock = threading.Lock()

        def check(entry: Entry, chunk: Chunk) -> None:
            nonlocal unreadable
            try:
                step = self.manifest.block_size  # the scratch stays in the CPU cache: nothing keeps these bytes
                for piece in range(0, max(chunk.nbytes, 1), step):
                    out = self._scratch_view(min(step, chunk.nbytes - piece))
                    self._read_piece(entry, chunk, piece, out, True)
                    if progress is not None:
                        progress(len(out))
            except CheckpointError as exc:
                with lock:
                    faults.append(str(exc))
                    unreadable = unreadable or not isinstance(exc, CorruptCheckpointError)

        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="zerostall-verify") as pool:
                list(pool.map(lambda job: check(*job), jobs))
        finally:
            self.storage.close()
        if faults:
            kind, outcome = (CheckpointError, "could not be verified") if unreadable else \
                (CorruptCheckpointError, "failed verification")
            error = kind(f"{self.path} {outcome}: " + "; ".join(faults[:10])
                         + (f"; … ({len(faults) - 10} more)" if len(faults) > 10 else ""))
            error.faults = faults  # type: ignore[attr-defined]
            raise error
        return sum(c.nbytes for _, c in jobs)

    def _header_fault(self, name: str, length: int | None) -> str | None:
        """What is wrong with the safetensors header of data file ``name`` (its first ``length``
        bytes: length prefix, JSON, padding), checked against the checksum in the manifest
        (manifests before it had none), or None."""
        digest = self.manifest.headers.get(name)
        if digest is None or length is None:
            return None
        if xxhash.xxh3_64_hexdigest(self.storage.read_head(name, length)) != digest:
            return f"the safetensors header of data file {name} is damaged (fails its checksum)"
        return None

    def _scratch_view(self, n: int) -> memoryview:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.buf = bytearray(max(n, 1))
        return memoryview(buf)[:n]


@dataclass
class _LoadPlan:
    tensors: list[tuple[torch.Tensor, Entry]] = field(default_factory=list)
    new_tensors: list[tuple[Path, Entry, torch.Tensor | None]] = field(default_factory=list)
    replacements: dict[Path, Any] = field(default_factory=dict)
    consumed: set[Path] = field(default_factory=set)
    meta: list[str] = field(default_factory=list)
    mismatch: Mismatch = field(default_factory=Mismatch)


def _build(node: Any, value: Callable[[int], Any]) -> Any:
    """The manifest's tree with each entry reference replaced by ``value(index)``."""
    if isinstance(node, codec.Ref):
        return value(node.index)
    if isinstance(node, dict):
        return {k: _build(v, value) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_build(v, value) for v in node)
    return node


def _insert(tree: dict[Any, Any], path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` in nested dicts, creating them; a path that runs into a non-dict
    node is skipped."""
    node: Any = tree
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node[path[-1]] = value


def _region(inner: Box, box: Box) -> tuple[slice, ...]:
    """The slices of a tensor holding ``box`` that cover ``inner`` (a box inside it)."""
    return tuple(slice(o - b, o - b + s) for o, b, s in zip(inner[0], box[0], inner[1]))


def _whole(t: torch.Tensor) -> Box:
    return (0,) * t.dim(), tuple(t.shape)


def _direct(target: torch.Tensor, box: Box, entry: Entry, chunk: Chunk) -> bool:
    """Whether ``chunk`` is exactly the target's ``box`` and its stored bytes can be read straight
    into the target's memory."""
    return (box == (chunk.offsets, chunk.sizes) and target.is_cpu
            and target.dtype == entry.torch_dtype and target.is_contiguous()
            and not target.is_conj() and not target.is_neg())


def _copy_part(target: torch.Tensor, box: Box, entry: Entry, chunk: Chunk, inter: Box, lo: int,
               data: torch.Tensor) -> None:
    """Copy into ``target`` (holding ``box``) the elements of ``inter`` that lie in ``data``: the
    chunk's elements from byte ``lo`` on, as strided regions of the row-major chunk."""
    first = lo // data.itemsize
    if first == 0 and data.numel() == math.prod(chunk.sizes) and inter == (chunk.offsets, chunk.sizes):
        (target if inter == box else target[_region(inter, box)]).copy_(data.view(chunk.sizes))
        return
    strides = contiguous_strides(chunk.sizes)
    local = (tuple(o - c for o, c in zip(inter[0], chunk.offsets)), inter[1])
    base = data.storage_offset() - first  # as_strided counts from the start of the storage
    for part in flat_boxes(chunk.sizes, first, first + data.numel()):
        sub = intersect(part, local)
        if sub is not None:
            src = data.as_strided(sub[1], strides, base + sum(o * s for o, s in zip(sub[0], strides)))
            target[_region((tuple(o + c for o, c in zip(sub[0], chunk.offsets)), sub[1]), box)].copy_(src)


def _agreed_manifest(storage: Storage, group: Group) -> Manifest:
    """Rank 0 reads the manifest and broadcasts its bytes, so every rank opens the same one
    (even if a save commits meanwhile); an error on rank 0 is raised on every rank."""
    if group.size == 1:
        return read_manifest(storage)
    payload = manifest = None
    if group.is_coordinator:
        try:
            raw = read_manifest_bytes(storage)
            manifest = parse_manifest(storage, raw)  # checked before it is sent
            payload = b"M" + raw
        except CheckpointError as exc:
            payload = b"E" + json.dumps([type(exc).__name__, str(exc)]).encode()
    data = group.broadcast_bytes(payload)
    if data[:1] == b"E":
        kind, message = json.loads(data[1:])
        raise getattr(errors, kind, CheckpointError)(message)
    return manifest if manifest is not None else parse_manifest(storage, data[1:])


def _decode_safely(entry: Entry) -> None:
    try:
        codec.decode(entry.value, where=entry.fqn, allow_pickle=False)
    except UnsupportedValueError as exc:
        if "pickle" not in str(exc):
            raise CorruptCheckpointError(f"entry {entry.fqn}: {exc}") from exc


def _run(pool: ThreadPoolExecutor, threads: int, read: Callable[[list[Any], bool], None],
         runs: list[tuple[list[Any], int]], verify: bool) -> None:
    """Call ``read`` on runs of work (with their byte counts) as one task per thread with balanced
    bytes (largest run first onto the least-loaded thread). Once one thread fails the others
    stop at their next run, so a bad block is reported without reading the rest of a large
    checkpoint; the failure is raised when they have stopped."""
    lanes: list[list[list[Any]]] = [[] for _ in range(threads)]
    heap = [(0, i) for i in range(len(lanes))]
    for run, nbytes in sorted(runs, key=lambda r: -r[1]):
        load, lane = heap[0]
        lanes[lane].append(run)
        heapq.heapreplace(heap, (load + nbytes, lane))
    failed = threading.Event()

    def drain(lane: list[list[Any]]) -> None:
        try:
            for run in lane:
                if failed.is_set():
                    return
                read(run, verify)
        except BaseException:
            failed.set()
            raise

    for fut in [pool.submit(drain, lane) for lane in lanes if lane]:
        fut.result()


def _runs(items: list[Any], span: Callable[[Any], tuple[str, int, int]]) -> list[tuple[list[Any], int]]:
    """Group items whose bytes (``span``: file, offset, length) lie back to back in one file into
    runs of at most a cache piece (with their byte counts), so many small tensors are read by one
    scatter read; larger items stay alone."""
    runs: list[tuple[list[Any], int]] = []
    run: list[Any] = []
    size = end = 0
    file = None
    for (name, start, n), item in sorted(((span(i), i) for i in items), key=lambda s: s[0][:2]):
        if run and start == end and name == file and size + n <= CACHE_PIECE:
            run.append(item)
            size += n
        else:
            if run:
                runs.append((run, size))
            run, size, file = [item], n, name
        end = start + n
    if run:
        runs.append((run, size))
    return runs


def _piece_span(piece: Piece) -> tuple[str, int, int]:
    return piece[1].file, piece[1].offset + piece[2], len(piece[3])


def _job_span(job: StageJob) -> tuple[str, int, int]:
    return job[3].file, job[3].offset + job[5], job[6] - job[5]


def _batches(items: list[Any], size: Callable[[Any], int], limit: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    total = 0
    for item in items:
        if batch and total + size(item) > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size(item)
    if batch:
        yield batch


def _normalize(path: Path, strip: Sequence[str]) -> Path:
    """Drop wrapper segments (``module``, ``_orig_mod``) from string keys, e.g. DDP/compile prefixes."""
    if not strip:
        return path
    drop = set(strip)
    out = []
    for k in path:
        if isinstance(k, str):
            kept = [seg for seg in k.split(".") if seg not in drop]
            if not kept:
                continue
            k = ".".join(kept)
        out.append(k)
    return tuple(out)


def _key_filter(keys: KeyFilter) -> Callable[[str], bool] | None:
    """A predicate on entry names, or None when every key is wanted (no name is then built)."""
    if keys is None:
        return None
    if callable(keys):
        return keys
    patterns = [keys] if isinstance(keys, str) else list(keys)
    return lambda name: any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)


def open(path: str | os.PathLike[str], process_group: Any = None, *, verify: bool = True,
         allow_pickle: bool = False, threads: int | None = None) -> Checkpoint:
    """Open a read session on the checkpoint at ``path`` (collective when distributed: rank 0
    reads the manifest and every rank gets the same one)."""
    return Checkpoint(path, process_group=process_group, verify=verify, allow_pickle=allow_pickle, threads=threads)


@gc_paused()  # opening included: the manifest's objects then die by reference counting, never walked
def load(state: Any, path: str | os.PathLike[str], *, strict: bool = True, process_group: Any = None,
         verify: bool = True, allow_pickle: bool = False, threads: int | None = None, **options: Any) -> Any:
    """Load the checkpoint at ``path`` into ``state`` in place and return it (see :meth:`Checkpoint.load`)."""
    with open(path, process_group, verify=verify, allow_pickle=allow_pickle, threads=threads) as ck:
        return ck.load(state, strict=strict, **options)


def verify(path: str | os.PathLike[str], *, threads: int | None = None,
           progress: Callable[[int], None] | None = None) -> int:
    """Check every checksum of the checkpoint at ``path``; raises :class:`CorruptCheckpointError`
    on damage, :class:`CheckpointError` when bytes cannot be read (see :meth:`Checkpoint.verify`)."""
    with open(path, threads=threads) as ck:
        return ck.verify(progress=progress)
