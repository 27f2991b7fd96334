"""Collect again: the next save of an unchanged structure reuses what the last collection found.

An :class:`~zerostall.saving.asynchronous.AsyncSaver` saves the same structure over and over. The
first save collects in full (:func:`~zerostall.saving.collect.collect`) and this module keeps what
depends only on the structure: the leaf paths, each tensor leaf's fingerprint (its type, dtype,
shape, device and layout), the keys, rows, entry names and file names, and the structure's digest.
A later save walks the state, compares fingerprints and paths (key types included), and on a match
builds the same :class:`~zerostall.saving.collect.Collected` the full collection would, without the
per-leaf checks, key encodings and names; python values are encoded anew each time. Anything it
does not hold (a tensor subclass, a DTensor, tensors sharing memory, a key that is not a str or an
int) is collected in full.
No tensor is kept between saves: only fingerprints (a data pointer is a number, not a reference).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..format.layout import Entry
from ..state import Path, flatten, fqn
from .collect import Collected, Row, WriteItem, collect, encode_value, optimizers_in, plain_source
from .plan import structure_digest

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_META = operator.attrgetter("dtype", "shape", "device", "layout", "is_nested")


def fingerprints(values: list[Any]) -> tuple[list[Any], bool]:
    """Per leaf: for a tensor, what collecting it depends on but its bytes and its view (its type,
    dtype, shape, device and layout); None for other values. And whether no two tensors share a
    data pointer: then none is an alias of another (:class:`~zerostall.state.ViewIndex` compares
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
    typed: list[type]
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
        flat = flatten(state, skeleton=True)
        paths, values = list(flat.leaves), list(flat.leaves.values())
        try:
            prints, apart = fingerprints(values)
        except RuntimeError:  # a tensor without sizes (nested): the full collection says what is wrong
            prints, apart = [], False
        template = self._template
        if (apart and template is not None and prints == template.prints and paths == template.paths
                and flat.rank_local == template.rank_local and _types(paths) == template.typed):
            self.hits += 1
            return _again(template, flat, values, rank, allow_pickle)
        out = collect(state, rank, allow_pickle=allow_pickle, flat=flat)
        out.digest = structure_digest(out.rows)
        self._template = _learn(out, flat, paths, values, prints) if apart else None
        return out


def _types(paths: list[Path]) -> list[type]:
    """The types of the paths' keys, in order (with the paths' lengths, which the paths' equality
    checks): ``True == 1``, but they are different keys to store."""
    return list(map(type, itertools.chain.from_iterable(paths)))


def _learn(out: Collected, flat: Any, paths: list[Path], values: list[Any], prints: list[Any]) -> _Template | None:
    """The template of a full collection, or None when it holds what a template does not."""
    if out.shards or any(isinstance(v, torch.Tensor) and type(v) not in _PLAIN_TYPES
                                           for v in values):
        return None
    typed = _types(paths)
    if any(t is not str and t is not int for t in typed):
        return None
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
    return _Template(paths, typed, prints, frozenset(flat.rank_local), [out.keys[p] for p in paths], leaves,
                     out.rows, out.digest)


def _again(template: _Template, flat: Any, values: list[Any], rank: int, allow_pickle: bool) -> Collected:
    """The collection of a state whose structure matches ``template``."""
    out = Collected(rows=template.rows, skeleton=flat.skeleton, refs=flat.refs, digest=template.digest,
                    keys=dict(zip(template.paths, template.keys)), optimizers=optimizers_in(flat.statefuls.values()))
    for path, value, leaf in zip(template.paths, values, template.leaves):
        if type(leaf) is _Tensor:
            entry = Entry(leaf.name, path, "tensor", dtype=leaf.dtype, shape=leaf.shape, rank=rank if leaf.local else None)
            if leaf.local:
                out.rank_local.append(entry)
            else:
                out.entries[leaf.key[0]] = entry
            out.items.append(WriteItem(entry, leaf.file_name, plain_source(value), leaf.offsets, leaf.key, leaf.local))
        else:
            encoded = encode_value(value, path, allow_pickle)
            if path in template.rank_local:
                out.rank_local.append(Entry(fqn(path), path, "object", value=encoded, rank=rank))
            else:
                out.objects[leaf] = encoded
    return out
