"""Collect again: the next save of an unchanged structure reuses what the last collection found.

An :class:`~zerostall.saving.asynchronous.AsyncSaver` saves the same structure over and over. The
first save collects in full (:func:`~zerostall.saving.collect.collect`) and this module keeps what
depends only on the structure: its shape (:class:`~zerostall.state.Shape`) and skeleton, each
tensor leaf's fingerprint (its type, dtype, shape, device and layout), the keys, rows, entry names
and file names, and the structure's digest. A later save walks the state again along that shape
(:func:`~zerostall.state.rewalk`: containers checked by kind, keys and key types, a plain tensor by
a type test), compares fingerprints, and on a match builds the same
:class:`~zerostall.saving.collect.Collected` the full collection would, without the per-leaf
checks, key encodings and names; python values are encoded anew each time. Anything it does not
hold (a tensor subclass, a DTensor, tensors sharing memory, a key that is not a str or an int) is
collected in full. No tensor is kept between saves; the skeleton is shared by the saves of one
saver, which never overlap (each commit numbers its refs the same way).

A saver's save may split the work: :meth:`CollectCache.snapshot`, in the caller's thread, walks
the state, records each tensor leaf's version counter and encodes the python values (what may
change once the call returns); in the saver's worker, a snapshot that :meth:`Snapshot.matches`
has its tensors copied first and is collected from the copies (:meth:`CollectCache.from_copies`),
any other is collected by :meth:`CollectCache.complete`; either way a change made after the call
fails the comparison with the versions the snapshot recorded.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..devices import cuda_devices
from ..format.layout import Entry
from ..state import PLAIN_TENSORS, Changed, Flat, Path, Shape, flatten, fqn, rewalk
from .collect import (Collected, Row, Version, WriteItem, collect, counters, encode_value, optimizers_in,
                      plain_sources)
from .plan import structure_digest

_META = [operator.attrgetter(name) for name in ("dtype", "shape", "device", "layout")]  # shape raises if nested
_PLAIN_TYPES = frozenset(PLAIN_TENSORS)


def fingerprints(tensors: list[torch.Tensor]) -> tuple[list[list[Any]], bool] | None:
    """What collecting the tensor leaves depends on but their bytes and views: their types, dtypes,
    shapes, devices and layouts (a list of each, in the leaves' order: no tuple per leaf), and
    whether no two share a data pointer: then none is an alias of another
    (:class:`~zerostall.views.ViewIndex` compares views only where pointers meet), so views need no
    comparing. None for a tensor without sizes (nested): the full collection says what is wrong."""
    try:
        prints = [list(map(type, tensors))] + [list(map(get, tensors)) for get in _META]
    except RuntimeError:
        return None
    return prints, len(set(map(torch.Tensor.data_ptr, tensors))) == len(tensors)


@dataclass(frozen=True, slots=True)
class _Tensor:
    """How one tensor leaf was collected (its entry without chunks, and its write)."""

    name: str
    dtype: str | None
    shape: tuple[int, ...] | None
    file_name: str
    offsets: tuple[int, ...]
    key: tuple[str, tuple[int, ...]]
    local: bool


@dataclass(frozen=True, slots=True)
class _Template:
    paths: list[Path]
    shape: Shape
    skeleton: Any  # the state's skeleton and its refs (numbered anew by each commit, in the same order)
    refs: dict[Path, Any]
    prints: list[list[Any]]  # of the tensor leaves (see fingerprints)
    rank_local: frozenset[Path]
    keys: list[str]
    leaves: list[_Tensor | str]  # a tensor's collection, or a python value's key
    rows: list[Row]
    digest: int
    tensor_index: list[int]  # the positions of the tensor leaves among the leaves
    others: list[int]  # the positions of the python values
    shapes: tuple[tuple[torch.dtype, tuple[int, ...]], ...]  # each tensor leaf's dtype and shape (its buffer's)
    on_cuda: bool  # whether any tensor leaf is on a CUDA device

    def tensors(self, values: list[Any]) -> list[torch.Tensor]:
        """The tensor leaves among a walk's ``values``."""
        return [values[n] for n in self.tensor_index]


@dataclass(slots=True)
class Snapshot:
    """A state's leaves as one save found them, along the last collection's shape: what the rest of
    its collection needs from the caller's thread (see :meth:`CollectCache.snapshot`)."""

    template: _Template
    values: list[Any]
    tensors: list[torch.Tensor]  # the tensor leaves among the values
    statefuls: dict[Path, Any]
    rank_local: set[Path]
    counters: list[int | None]  # each tensor leaf's version counter at the save (None: it keeps none)
    encoded: dict[Path, Any]  # each python value, encoded at the save
    allow_pickle: bool

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return optimizers_in(self.statefuls.values())

    @property
    def devices(self) -> list[int]:
        """The CUDA devices the tensor leaves are on (no check at all in a process without CUDA)."""
        return cuda_devices(self.tensors) if torch.cuda.is_initialized() else []

    def matches(self) -> bool:
        """Whether the last collection still describes the tensor leaves (fingerprints equal, no
        memory shared, the same rank-local paths): then they can be copied before collecting."""
        found = fingerprints(self.tensors)
        template = self.template
        return found is not None and found[1] and found[0] == template.prints and \
            self.rank_local == template.rank_local

    def recorded(self) -> list[Version]:
        """Each tensor leaf's version at the save, as a copy of the leaf itself is checked."""
        return [None if counter is None else (counter, -1) for counter in self.counters]

    def name(self, n: int) -> str:
        """The key of the ``n``-th tensor leaf."""
        leaf = self.template.leaves[self.template.tensor_index[n]]
        assert type(leaf) is _Tensor
        return leaf.name


class CollectCache:
    """The last collection's structure, for one saver's next save (see the module's docstring)."""

    def __init__(self) -> None:
        self._template: _Template | None = None
        self.hits = 0
        """Saves whose collection was reused."""

    def collect(self, state: Any, rank: int, *, allow_pickle: bool) -> Collected:
        """What :func:`~zerostall.saving.collect.collect` returns for ``state``, from the last
        collection when the structure is unchanged."""
        snap = self.snapshot(state, allow_pickle=allow_pickle)
        if snap is not None:
            return self._collected(snap, rank)[0]
        return self.collect_anew(state, rank, allow_pickle=allow_pickle)

    def collect_anew(self, state: Any, rank: int, *, allow_pickle: bool) -> Collected:
        """The full collection of ``state``, whose structure is learnt for the next save (for a
        state :meth:`snapshot` found changed)."""
        flat = flatten(state, skeleton=True, shape=True)
        out = collect(state, rank, allow_pickle=allow_pickle, flat=flat)
        self._learn(out, flat)
        return out

    def snapshot(self, state: Any, *, allow_pickle: bool) -> Snapshot | None:
        """``state``'s leaves along the last collection's shape, each tensor leaf's version counter
        and the python values encoded; None when there is no last collection or the shape differs.
        The rest (:meth:`complete`) may run in another thread while the caller goes on."""
        template = self._template
        if template is None:
            return None
        try:
            values, statefuls, local = rewalk(state, template.shape)
        except Changed:
            return None
        encoded = {}
        for n in template.others:
            value = values[n]
            if isinstance(value, torch.Tensor):
                return None  # a tensor where a python value was: collected in full
            encoded[template.paths[n]] = encode_value(value, template.paths[n], allow_pickle)
        tensors = template.tensors(values)
        if not _PLAIN_TYPES.issuperset(map(type, tensors)):
            return None  # a python value where a (rank-local) tensor was
        return Snapshot(template, values, tensors, statefuls, local, counters(tensors), encoded, allow_pickle)

    def complete(self, snap: Snapshot, rank: int) -> tuple[Collected, list[Version]]:
        """The collection of a snapshot's state (from the template when every fingerprint matches,
        else in full), and each write item's version to compare after its copy: a change made
        since the snapshot fails that comparison (see :func:`~zerostall.saving.capture.capture`)."""
        out, again = self._collected(snap, rank)
        if again:  # one item per tensor leaf, in order
            return out, list(map(_since, out.items, snap.tensors, snap.counters))
        paths = [snap.template.paths[n] for n in snap.template.tensor_index]
        at_save = dict(zip(paths, zip(snap.tensors, snap.counters)))
        return out, [_since(item, *at_save[item.entry.path]) for item in out.items]

    def from_copies(self, snap: Snapshot, rank: int, copies: list[torch.Tensor]) -> Collected:
        """The collection of a snapshot that :meth:`Snapshot.matches`, whose tensor leaves were
        copied into ``copies`` already (its items hold the copies)."""
        self.hits += 1
        return _again(snap.template, copies, snap.statefuls, rank, snap.encoded)

    def _collected(self, snap: Snapshot, rank: int) -> tuple[Collected, bool]:
        """The collection, and whether it came from the template."""
        template = snap.template
        if snap.matches():
            self.hits += 1
            return _again(template, plain_sources(snap.tensors), snap.statefuls, rank, snap.encoded), True
        flat = Flat(dict(zip(template.paths, snap.values)), snap.rank_local, snap.statefuls, template.skeleton,
                    template.refs, template.shape)
        out = collect(None, rank, allow_pickle=snap.allow_pickle, flat=flat, encoded=snap.encoded)
        self._learn(out, flat)
        return out, False

    def _learn(self, out: Collected, flat: Flat) -> None:
        paths, values = list(flat.leaves), list(flat.leaves.values())
        found = fingerprints([v for v in values if isinstance(v, torch.Tensor)])
        out.digest = structure_digest(out.rows)
        self._template = _learn(out, flat, paths, values, found[0]) if found is not None and found[1] else None


def _since(item: WriteItem, leaf: torch.Tensor, counter: int | None) -> Version:
    """What :func:`~zerostall.saving.capture.capture` compares for ``item`` of ``leaf``, whose
    version counter was ``counter`` at the save: when the item holds another tensor than the leaf
    (a detached view, a contiguous copy made since), the leaf is watched too."""
    if counter is None:
        return None
    if item.tensor is leaf:
        return counter, -1
    item.watch = leaf
    return item.tensor._version, counter


def _learn(out: Collected, flat: Any, paths: list[Path], values: list[Any], prints: list[list[Any]]
           ) -> _Template | None:
    """The template of a full collection, or None when it holds what a template does not."""
    if flat.shape is None or out.shards or any(isinstance(v, torch.Tensor) and type(v) not in PLAIN_TENSORS
                                           for v in values):
        return None
    if any(t is not str and t is not int for t in map(type, itertools.chain.from_iterable(paths))):
        return None  # a tuple key may equal one of other types, (1,) == (True,): only str and int keys are reused
    written = {item.entry.path: item for item in out.items}
    leaves: list[_Tensor | str] = []
    for path, value in zip(paths, values):
        key = out.keys[path]
        if not isinstance(value, torch.Tensor):
            leaves.append(key)
        else:
            item = written[path]
            e = item.entry
            leaves.append(_Tensor(e.fqn, e.dtype, e.shape, item.name, item.offsets, item.key, item.rank_local))
    assert out.digest is not None
    index = [n for n, leaf in enumerate(leaves) if type(leaf) is _Tensor]
    return _Template(paths, flat.shape, flat.skeleton, flat.refs, prints, frozenset(flat.rank_local),
                     [out.keys[p] for p in paths], leaves, out.rows, out.digest, index,
                     [n for n, leaf in enumerate(leaves) if type(leaf) is not _Tensor],
                     tuple(zip(prints[1], prints[2])), any(device.type == "cuda" for device in prints[3]))


def _again(template: _Template, sources: list[torch.Tensor], statefuls: dict[Path, Any], rank: int,
           encoded: dict[Path, Any]) -> Collected:
    """The collection of a state whose structure matches ``template``, its items holding ``sources``
    (a plain tensor per tensor leaf)."""
    out = Collected(rows=template.rows, skeleton=template.skeleton, refs=template.refs, digest=template.digest,
                    keys=dict(zip(template.paths, template.keys)), optimizers=optimizers_in(statefuls.values()))
    entries, items = out.entries, out.items
    next_source = iter(sources).__next__
    for path, leaf in zip(template.paths, template.leaves):
        if type(leaf) is not _Tensor:
            if path in template.rank_local:
                out.rank_local.append(Entry(fqn(path), path, "object", value=encoded[path], rank=rank))
            else:
                out.objects[leaf] = encoded[path]
        elif leaf.local:
            entry = Entry(leaf.name, path, "tensor", leaf.dtype, leaf.shape, rank=rank)
            out.rank_local.append(entry)
            items.append(WriteItem(entry, leaf.file_name, next_source(), leaf.offsets, leaf.key, True))
        else:  # the common case, with positional arguments (quicker than keywords, per leaf)
            entry = entries[leaf.key[0]] = Entry(leaf.name, path, "tensor", leaf.dtype, leaf.shape)
            items.append(WriteItem(entry, leaf.file_name, next_source(), leaf.offsets, leaf.key))
    return out
