"""A read session on one checkpoint: its entries, single tensors, the whole state, loads, verify.

``Checkpoint`` is the front of the read side and runs its stages in order: open (the manifest,
agreed on by every rank) → load plan (match keys; no I/O) → fetch (ranged reads, broadcast,
staging, every block verified) → rebuild the state.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, Sequence

import torch

from ..collectives import Group
from ..errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ..format import codec, flattened, subclass
from ..format.boxes import Box, intersect, region, whole
from ..format.layout import Entry, Manifest
from ..gcpause import gc_paused
from ..memory import host_empty, tensor_bytes
from ..options import LoadOptions, default_threads
from ..state import Path, rebuild
from ..storage import Storage
from ..storage.references import linked
from ..views import storage_key
from . import foreign as sources
from . import trees
from .broadcast import broadcast_fill
from .fetch import Fetcher
from .load_plan import LoadPlan, LoadPlanner
from .opening import Instead, agreed_source
from .reader import resolve
from .verification import verify_all

log = logging.getLogger(__name__)


class Checkpoint:
    """A read session on one checkpoint (what :func:`zerostall.open` returns); use it as a context
    manager. ``options`` are the defaults of its loads and reads (verify, allow_pickle, threads...).
    Where ``path`` holds no checkpoint, the one ``instead`` names is opened (rank 0 decides which);
    :attr:`path` and :attr:`step` say which was opened."""

    @gc_paused()  # the manifest's per-entry objects: no cyclic collection while they are built
    def __init__(self, path: str | os.PathLike[str] | Storage, options: LoadOptions, *,
                 process_group: Any = None, instead: Instead | None = None, manifest: Manifest | None = None) -> None:
        self.group = Group(process_group)
        asked, file = sources.split_file(path)  # a single safetensors file: its directory's storage
        self.options = options
        if manifest is not None:  # the caller read and checked the one at ``path`` (a copy, as it arrived)
            self.storage, self.manifest = linked(asked, manifest), manifest
        else:
            self.storage, self.manifest = agreed_source(asked, self.group, allow_pickle=options.allow_pickle,
                                                        file=file, instead=instead, deferred=True)  # entries: when used
        self.path = self.storage.location
        self.tag = os.path.basename(self.path.rstrip("/"))
        if self.storage is not asked and self.group.is_coordinator:
            log.info("%s names checkpoint %s (step %s): opened it", asked.location, self.path, self.step)
        self._fetcher = Fetcher(self.storage, self.manifest, options.threads or default_threads())

    # -- what is in it -------------------------------------------------------------------------
    @functools.cached_property
    def _by_path(self) -> dict[tuple[Path, int | None], Entry]:
        """Entries by (path, rank): built on first use, since a load matches by path without it."""
        with gc_paused():
            return {(e.path, e.rank): e for e in self.manifest.entries}

    @functools.cached_property
    def _by_fqn(self) -> dict[str, Entry]:
        by_fqn: dict[str, Entry] = {}
        with gc_paused():
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
        return codec.decode(self.manifest.metadata, where="metadata", allow_pickle=self.options.allow_pickle) or {}

    @property
    def step(self) -> int | None:
        """The step given to ``save``, if any."""
        return self.manifest.step

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release file handles; tensors returned by :meth:`read` stay valid."""
        self._fetcher.close()

    def _entry(self, key: str | Path) -> Entry:
        alone = self.manifest.entry(key)  # the first reads of a session: without building every entry
        if alone is not None:
            return alone
        if isinstance(key, tuple):
            entry = self._by_path.get((key, None)) or self._by_path.get((key, self.group.rank))
        else:
            entry = self._by_fqn.get(key) or self._by_fqn.get(f"{key}@rank{self.group.rank}")
        if entry is None:
            raise KeyError(f"{key!r} is not in checkpoint {self.path}")
        return resolve(self.manifest, entry, self.path)

    # -- reading -------------------------------------------------------------------------------
    def read(self, key: str | Path, *, verify: bool | None = None, box: Box | None = None,
             out: torch.Tensor | None = None) -> Any:
        """One entry, whole: a tensor (memory-mapped from the file where possible) or a python value;
        with ``box`` = ``(offsets, sizes)``, only that part of a tensor entry (for large tensors);
        with ``out``, the tensor (or its ``box``) is read into ``out`` (its shape and dtype,
        contiguous, on the CPU), which is returned: no memory of its own.

        ``key`` is a dotted name or a key path tuple; a rank-local entry is this rank's copy
        (``"name@rankN"`` names another rank's). A tensor subclass is rebuilt when its class is in
        ``tensor_subclasses``, else returned as a :class:`FlattenedTensor` (see there)."""
        entry = self._entry(key)
        verify = self.options.verify if verify is None else verify
        if box is not None:
            offsets, sizes = tuple(box[0]), tuple(box[1])
            shape = tuple(entry.shape or ())
            if entry.kind != "tensor" or len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
                raise ValueError(f"box {box} is not a part of {entry.fqn} ({entry.kind} of shape {list(shape)})")
            box = (offsets, sizes)
        if out is not None:
            want = box[1] if box is not None else tuple(entry.shape or ())
            if entry.kind != "tensor" or tuple(out.shape) != want or out.dtype != entry.torch_dtype or \
                    not out.is_contiguous() or out.device.type != "cpu":
                raise ValueError(f"out (a {out.dtype} tensor of shape {list(out.shape)} on {out.device}) cannot "
                                 f"receive {entry.fqn} ({entry.kind} {entry.dtype} of shape {list(want)}): pass a "
                                 "contiguous CPU tensor of its shape and dtype")
            self._fetcher.check_sizes(entry)
            span = self._span(entry, box, verify)
            if span is not None:  # a run of whole stored blocks: read into out as it is, in this thread
                self._fetcher.read_piece(entry, entry.chunks[0], span, tensor_bytes(out), verify)
            else:
                self._fetcher.fill([(out, box if box is not None else whole(out), entry)], verify,
                                   self.options.max_staging_bytes)
            return out
        if box is not None:
            return self._tensor(entry, verify, box)
        if entry.kind == "object":
            return codec.decode(entry.value, where=entry.fqn, allow_pickle=self.options.allow_pickle)
        if entry.kind == "subclass":
            return self._subclass(entry, self.options.tensor_subclasses, verify)
        return self._tensor(entry, verify)

    def _span(self, entry: Entry, box: Box | None, verify: bool) -> int | None:
        """Where ``box``, a run of a one-dimensional entry stored as one chunk, starts in that
        chunk, when its bytes are whole blocks (when verifying); else None (the fetcher reads a
        whole entry straight into ``out`` already, and other boxes through staging)."""
        chunk = entry.chunks[0] if len(entry.chunks) == 1 else None
        shape = tuple(entry.shape or ())
        if chunk is None or box is None or len(shape) != 1 or chunk.sizes != shape or not box[1][0]:
            return None  # an empty box has no bytes (and no block) to read
        itemsize, block = entry.torch_dtype.itemsize, self.manifest.block_size
        lo, hi = box[0][0] * itemsize, (box[0][0] + box[1][0]) * itemsize
        whole_blocks = lo % block == 0 and (hi % block == 0 or hi == chunk.nbytes)  # each checked whole
        return lo if not verify or whole_blocks else None

    def read_many(self, keys: Sequence[str | Path], *, verify: bool | None = None,
                  into: Sequence[torch.Tensor | None] | None = None) -> list[Any]:
        """Several entries whole, as :meth:`read` gives each, their tensors read together by the
        reader threads in parallel (many tensors: one parallel read, not one each). ``into``: per
        key, a tensor to read the entry into in place where it fits (a contiguous CPU tensor of the
        entry's shape and dtype, sharing no memory with another key's), else new memory."""
        verify = self.options.verify if verify is None else verify
        entries = [self._entry(key) for key in keys]
        places = _places(entries, into) if into is not None else {}
        values: list[Any] = []
        targets = []
        for i, (key, entry) in enumerate(zip(keys, entries)):
            if entry.kind != "tensor":
                values.append(self.read(key, verify=verify))
                continue
            out = places.get(i)
            if out is None:
                self._fetcher.check_sizes(entry)
                out = host_empty(entry.shape or (), entry.torch_dtype)
            targets.append((out, whole(out), entry))
            values.append(out)
        if targets:
            self._fetcher.fill(targets, verify, self.options.max_staging_bytes)
            for out in places.values():  # written as copy_ writes (see load)
                torch.autograd.graph.increment_version(out)
        return values

    def _tensor(self, entry: Entry, verify: bool, box: Box | None = None) -> torch.Tensor:
        """Tensor entry ``entry`` whole, or its part ``box``."""
        if box is not None:
            out = host_empty(box[1], entry.torch_dtype)
            self._fetcher.fill([(out, box, entry)], verify, self.options.max_staging_bytes)
            return out
        shape, dtype = entry.shape or (), entry.torch_dtype
        chunk = entry.chunks[0] if len(entry.chunks) == 1 else None
        if chunk is not None and chunk.sizes == shape and chunk.nbytes > 0 and chunk.offset % dtype.itemsize == 0:
            mapped = self._fetcher.map(chunk.file)
            if mapped is not None:
                if chunk.offset + chunk.nbytes > len(mapped):
                    raise CorruptCheckpointError(f"{chunk.file} is truncated: entry {entry.fqn} lies past its end")
                if verify:
                    self._fetcher.check_blocks(entry, chunk, 0, mapped[chunk.offset:chunk.offset + chunk.nbytes])
                raw = torch.frombuffer(mapped, dtype=torch.uint8, count=chunk.nbytes, offset=chunk.offset)
                return raw.view(dtype).reshape(shape)
        self._fetcher.check_sizes(entry)  # before allocating what the manifest says the files hold
        out = host_empty(shape, dtype)
        self._fetcher.fill([(out, whole(out), entry)], verify, self.options.max_staging_bytes)
        return out

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {id(e): i for i, e in enumerate(self.manifest.entries)}

    def _subclass(self, entry: Entry, trusted: tuple[type, ...], verify: bool) -> Any:
        """Subclass entry ``entry`` rebuilt by a ``trusted`` class where it forms one tensor, else
        as stored: a FlattenedTensor, or a list of them (one per saved box)."""
        entries = self.manifest.entries
        saved = subclass.shards(entries, self._index[id(entry)], self.path)
        flat = flattened.flattened(saved, entry, entries, lambda e, box: self._tensor(e, verify, box))
        if isinstance(flat, flattened.FlattenedTensor) and flat.cls in map(subclass.class_name, trusted):
            return flat.unflatten(*trusted)
        return flat

    def _copy(self, target: torch.Tensor, box: Box, entry: Entry, name: str, options: LoadOptions) -> None:
        """Fill ``target`` (holding ``box``) with the value of ``entry`` as ``load_state_dict`` would
        (``target.copy_(saved)``) where one side is a tensor subclass and the other is not."""
        try:
            with torch.no_grad():
                if entry.kind == "tensor":  # into a subclass target: its copy_ converts
                    target.copy_(self._tensor(entry, options.verify, box))
                    return
                flat = self._subclass(entry, (), options.verify)
                for piece in flat if isinstance(flat, list) else [flat]:
                    stored = (piece.offsets, tuple(piece.sizes))
                    overlap = intersect(box, stored)
                    if overlap is not None:
                        dense = torch.empty(piece.sizes, dtype=piece.dtype)
                        dense.copy_(piece.unflatten(*options.tensor_subclasses))
                        target[region(overlap, box)].copy_(dense[region(overlap, stored)])
        except CheckpointError:
            raise
        except Exception as exc:  # the subclass's own code refused (no copy_ to or from a plain tensor...)
            raise StateMismatchError(f"{name}: copying between the checkpoint's {entry.cls or 'plain tensor'} and the "
                                     f"{type(target).__qualname__} target failed: {type(exc).__name__}: {exc}") from exc

    def state(self) -> Any:
        """The whole saved state, rebuilt from the manifest's tree (tensors memory-mapped).

        The tree is the coordinator's view; global entries that only other ranks held (pipeline
        stages) are added by their key paths. Rank-local entries appear as this rank's.
        """
        tree = codec.decode(self.manifest.tree, allow_pickle=self.options.allow_pickle)
        entries, index = self.manifest.entries, self._index
        cache: dict[int, Any] = {}
        referenced: set[int] = set()

        def value(i: int) -> Any:
            referenced.add(i)
            target = index[id(resolve(self.manifest, entries[i], self.path))]
            if target not in cache:
                cache[target] = self.read(entries[target].path)
            return cache[target]

        result = trees.build(tree, value)
        for i, entry in enumerate(entries):
            if (i not in referenced and entry.rank is None and entry.inner_of is None and isinstance(result, dict)
                    and entry.path):
                trees.insert(result, entry.path, value(i))
        return result

    @gc_paused()  # the caller waits: no cyclic collections over the per-leaf objects
    def load(self, state: Any, options: LoadOptions | None = None, **overrides: Any) -> Any:
        """Fill ``state`` in place from this checkpoint and return it (``(state, Mismatch)`` when
        not ``strict``). ``options`` (default: the session's) and keyword overrides are
        :class:`LoadOptions` fields: prefix, keys, strip, strict_dtype, materialize, verify, broadcast...

        Collective when distributed: each rank reads only the bytes its targets need (DTensor
        shards reshard from any saved layout); if one rank's state does not match, every rank
        raises before anything is read.
        """
        o = LoadOptions.of(options or self.options, overrides)
        planner = LoadPlanner(self.manifest, self.path, self.group.rank, self.group.size, o)
        flat, plan = planner.plan(state) if self.group.size == 1 else self._plan_together(planner, state)
        together = o.broadcast and self.group.size > 1  # then every rank takes part in every broadcast
        with (self.group.failing_together(f"load from {self.path} refused: {{failed}} other rank(s) could not match "
                                          "their state with it (their errors name the keys); nothing was loaded")
              if self.group.size > 1 else contextlib.nullcontext()):  # a rank raising alone: the others would wait
            planner.check(plan, plan.wanted)
        received = broadcast_fill(self._fetcher, self.group, plan.tensors, o.verify, o.max_staging_bytes) \
            if together else set()
        with (self.group.failing_together(f"load from {self.path} failed: {{failed}} other rank(s) could not read "
                                          "their part (their errors say why); the state may be partly loaded")
              if self.group.size > 1 else contextlib.nullcontext()):
            try:
                self._fetcher.fill(plan.tensors, o.verify, o.max_staging_bytes, skip=received)
            finally:  # written as copy_ writes: autograd and an asynchronous save in flight see the change
                for target in {id(t): t for t, _, _ in plan.tensors}.values():
                    torch.autograd.graph.increment_version(target)
            for target, box, entry, name in plan.copies:
                self._copy(target, box, entry, name, o)
            self._new_tensors(plan, o)
            for path, found in plan.subtrees:
                tree: dict[Any, Any] = {}
                for rel, entry in found:
                    trees.insert(tree, rel, self.read(entry.path, verify=o.verify))
                plan.replacements[path] = tree
            result = rebuild(state, flat, plan.replacements, assign=o.materialize)
        if o.strict:
            return result
        if plan.mismatch:  # once, not once a rank
            log.log(logging.WARNING if self.group.is_coordinator else logging.DEBUG, "partial load from %s: %s",
                    self.path, plan.describe())
        return result, plan.mismatch

    def _new_tensors(self, plan: LoadPlan, o: LoadOptions) -> None:
        """Build the tensors the plan allocates (``materialize``, subclasses): one for each meta
        tensor of the target, so targets that were one tensor (tied weights) stay one."""
        made: dict[Any, Any] = {}
        for path, entry, like in plan.new_tensors:
            same = None if like is None else storage_key(like)
            if same in made:
                plan.replacements[path] = made[same]
                continue
            if entry.kind == "subclass" and (like is None or subclass.is_wrapper(like)):
                trusted = (*o.tensor_subclasses, *((type(like),) if like is not None else ()))
                out = self._subclass(entry, trusted, o.verify)
            else:
                self._fetcher.check_sizes(entry)
                out = host_empty(entry.shape or (), like.dtype if like is not None else entry.torch_dtype)
                if entry.kind == "subclass":
                    self._copy(out, whole(out), entry, ".".join(map(str, path)), o)
                else:
                    self._fetcher.fill([(out, whole(out), entry)], o.verify, o.max_staging_bytes)
            plan.replacements[path] = out
            if same is not None:
                made[same] = out

    def _plan_together(self, planner: LoadPlanner, state: Any) -> tuple[Any, LoadPlan]:
        """Plan on every rank, then learn in one all-reduce which entries some rank wants (so an
        entry only another rank loads is not unexpected here) and whether a rank failed to plan."""
        message = (f"load from {self.path} refused: {{failed}} other rank(s) could not match their state with it "
                   "(their errors say why); nothing was loaded")
        try:
            flat, plan = planner.plan(state)
        except Exception:
            self.group.all_reduce_or_fail([0] * len(self.manifest.entries), message, failed=True)
            raise
        counts = self.group.all_reduce_or_fail(planner.used_mask(plan), message)
        plan.wanted = {i for i, n in enumerate(counts) if n}
        return flat, plan

    def verify(self, *, progress: Callable[[int], None] | None = None) -> int:
        """Check every file size and every block checksum; returns bytes checked (see
        :func:`zerostall.verify`). ``progress(nbytes)`` is called as blocks are checked."""
        return verify_all(self._fetcher, allow_pickle=self.options.allow_pickle, progress=progress)


def _places(entries: list[Entry], into: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
    """Which tensor entries of ``entries`` read into ``into``'s tensor of the same index: those it
    fits (a contiguous CPU tensor of the entry's shape and dtype) whose memory no other one
    chosen shares (two reads into one place would race)."""
    fits = [(t.data_ptr(), t.data_ptr() + t.nbytes, i) for i, (t, e) in enumerate(zip(into, entries))
            if t is not None and e.kind == "tensor" and t.device.type == "cpu" and t.dtype == e.torch_dtype
            and tuple(t.shape) == tuple(e.shape or ()) and t.is_contiguous()
            and type(t) in (torch.Tensor, torch.nn.Parameter)]
    fits.sort()
    places: dict[int, torch.Tensor] = {}
    end = -1
    for k, (lo, hi, i) in enumerate(fits):
        shared = lo < end or k + 1 < len(fits) and fits[k + 1][0] < hi
        if lo < hi and not shared:
            places[i] = into[i]  # type: ignore[assignment]
        end = max(end, hi)
    return places
