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
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..format.layout import Entry
from ..state import PLAIN_TENSORS, Changed, Path, Shape, flatten, fqn, rewalk
from .collect import Collected, Row, WriteItem, collect, encode_value, optimizers_in, plain_source
from .plan import structure_digest

_META = operator.attrgetter("dtype", "shape", "device", "layout", "is_nested")


def fingerprints(values: list[Any]) -> tuple[list[Any], bool]:
    """Per leaf: for a tensor, what collecting it depends on but its bytes and its view (its type,
    dtype, shape, device and layout); None for other values. And whether no two tensors share a
    data pointer: then none is an alias of another (:class:`~zerostall.views.ViewIndex` compares
    views only where pointers meet), so views need no comparing."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    metas = iter(zip(map(type, tensors), map(_META, tensors)))
    pointers = set(map(torch.Tensor.data_ptr, tensors))
    return [next(metas) if isinstance(v, torch.Tensor) else None for v in values], len(pointers) == len(tensors)


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
    prints: list[Any]
    rank_local: frozenset[Path]
    keys: list[str]
    leaves: list[_Tensor | str]  # a tensor's collection, or a python value's key
    rows: list[Row]
    digest: int


class CollectCache:
    """The last collection's structure, for one saver's next save (see the module's docstring)."""

    def __init__(self) -> None:
        self._template: _Template | None = None
        self.hits = 0
        """Saves whose collection was reused."""

    def collect(self, state: Any, rank: int, *, allow_pickle: bool) -> Collected:
        """What :func:`~zerostall.saving.collect.collect` returns for ``state``, from the last
        collection when the structure is unchanged."""
        template = self._template
        if template is not None:
            try:
                values, statefuls, local = rewalk(state, template.shape)
            except Changed:
                pass
            else:
                prints, apart = _fingerprints(values)
                if apart and prints == template.prints and local == template.rank_local:
                    self.hits += 1
                    return _again(template, values, statefuls, rank, allow_pickle)
        flat = flatten(state, skeleton=True, shape=True)
        paths, values = list(flat.leaves), list(flat.leaves.values())
        prints, apart = _fingerprints(values)
        out = collect(state, rank, allow_pickle=allow_pickle, flat=flat)
        out.digest = structure_digest(out.rows)
        self._template = _learn(out, flat, paths, values, prints) if apart else None
        return out


def _fingerprints(values: list[Any]) -> tuple[list[Any], bool]:
    try:
        return fingerprints(values)
    except RuntimeError:  # a tensor without sizes (nested): the full collection says what is wrong
        return [], False


def _learn(out: Collected, flat: Any, paths: list[Path], values: list[Any], prints: list[Any]) -> _Template | None:
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
    return _Template(paths, flat.shape, flat.skeleton, flat.refs, prints, frozenset(flat.rank_local),
                     [out.keys[p] for p in paths], leaves, out.rows, out.digest)


def _again(template: _Template, values: list[Any], statefuls: dict[Path, Any], rank: int,
           allow_pickle: bool) -> Collected:
    """The collection of a state whose structure matches ``template``."""
    out = Collected(rows=template.rows, skeleton=template.skeleton, refs=template.refs, digest=template.digest,
                    keys=dict(zip(template.paths, template.keys)), optimizers=optimizers_in(statefuls.values()))
    entries, items = out.entries, out.items
    for path, value, leaf in zip(template.paths, values, template.leaves):
        if type(leaf) is not _Tensor:
            encoded = encode_value(value, path, allow_pickle)
            if path in template.rank_local:
                out.rank_local.append(Entry(fqn(path), path, "object", value=encoded, rank=rank))
            else:
                out.objects[leaf] = encoded
        elif leaf.local:
            entry = Entry(leaf.name, path, "tensor", leaf.dtype, leaf.shape, rank=rank)
            out.rank_local.append(entry)
            items.append(WriteItem(entry, leaf.file_name, plain_source(value), leaf.offsets, leaf.key, True))
        else:  # the common case, with positional arguments (quicker than keywords, per leaf)
            entry = entries[leaf.key[0]] = Entry(leaf.name, path, "tensor", leaf.dtype, leaf.shape)
            items.append(WriteItem(entry, leaf.file_name, plain_source(value), leaf.offsets, leaf.key))
    return out
