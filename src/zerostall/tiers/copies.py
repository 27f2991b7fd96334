"""A rank's copy: its whole state as it holds it, saved and loaded by the rank alone.

The local tier stores each rank's state as one ordinary one-rank checkpoint: every leaf under its
own key, a DTensor as the local shard this rank holds (its box in the global tensor is in the
copy's layout digest, not in the checkpoint), replicated tensors in full. Such a copy restores
only the same rank of the same layout, without any collective; a restore into another layout
uses the persistent tier, which reshards.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any, Collection, NamedTuple

import torch
import xxhash

from ..collectives import ALONE
from ..errors import StateMismatchError
from ..format.boxes import local_box
from ..format.layout import Manifest, dtype_name
from ..loading.checkpoint import Checkpoint
from ..options import LoadOptions
from ..state import Flat, Path, flatten, fqn, init_optimizer_state, rebuild

LAYOUT_KEY = "layout"
"""The copy's metadata key holding the digest of the layout it was saved from (see :func:`view`)."""


class View(NamedTuple):
    """A state as this rank holds it (see :func:`view`)."""

    tree: dict[Any, Any]
    flat: Flat
    digest: str


def view(state: Any, *, restoring: bool = False) -> View:
    """``state`` as this rank holds it: nested dicts of its leaves (stateful objects by their
    state dicts, DTensors by their local shards), the flattened state, and a digest of every tensor
    leaf's key, dtype, global shape and this rank's box in it. ``restoring`` gives optimizers
    that have not stepped yet their state first, so it can be filled."""
    flat = flatten(state, prepare=_fresh_optimizer if restoring else None)
    out: dict[Any, Any] = {}
    digest = xxhash.xxh3_64()
    for path, leaf in flat.leaves.items():
        if isinstance(leaf, torch.Tensor):
            piece, offsets, sizes = local_box(leaf)
            digest.update(repr((path, str(leaf.dtype), tuple(leaf.shape), offsets, sizes)).encode())
            leaf = piece
        _insert(out, path, leaf)
    return View(out, flat, digest.hexdigest())


def placeable(options: LoadOptions) -> bool:
    """Whether a restore with ``options`` may receive a copy into memory: it loads every key as saved."""
    return options.keys is None and not options.prefix and not options.strip


def placements(target: View, manifest: Manifest, which: Collection[int]) -> dict[int, torch.Tensor]:
    """Where a copy of this rank's layout arriving from a peer may be received straight into
    ``target`` (its :func:`view` made ``restoring``): by entry index, among ``which``, the memory, as
    bytes, of each tensor leaf that takes the entry's one chunk as it is (a plain contiguous tensor
    of the entry's dtype and shape, on the CPU or a GPU), when the entry's dotted name is its own
    and no alias entry reads its bytes (tied weights: the alias loads from the copy's folder); none
    for another layout."""
    tree, flat, digest = target
    meta = manifest.metadata if isinstance(manifest.metadata, dict) else {}
    if meta.get(LAYOUT_KEY) != digest or manifest.world_size != 1:
        return {}
    names = Counter(fqn(e.path) for e in manifest.entries)  # as a load selects them (``placed``)
    aliased = {e.alias_of for e in manifest.entries if e.kind == "alias"}
    out = {}
    for i in which:  # tensor entries of one chunk (see ``placing.Placer``)
        entry = manifest.entries[i]
        if (entry.inner_of is not None or names[fqn(entry.path)] > 1 or i in aliased
                or not isinstance(flat.leaves.get(entry.path), torch.Tensor)):
            continue
        piece = _get(tree, entry.path)
        if (type(piece) in (torch.Tensor, torch.nn.Parameter) and piece.device.type in ("cpu", "cuda")
                and piece.is_contiguous() and dtype_name(piece.dtype) == entry.dtype and tuple(piece.shape) == entry.shape
                and not (piece.is_conj() or piece.is_neg()) and piece.nbytes == entry.chunks[0].nbytes):
            out[i] = piece.detach().reshape(-1).view(torch.uint8)
    return out


def load_copy(state: Any, target: View, path: str | os.PathLike[str], *, options: LoadOptions,
              placed: frozenset[str] = frozenset(), manifest: Manifest | None = None) -> Any:
    """Load the copy at ``path`` into ``state`` (``target``: its :func:`view` made ``restoring``)
    in place (tensors filled, python values and stateful objects handed their values) and return
    it, leaving out the entries ``placed`` (dotted names: already received into their tensors);
    ``manifest``: the copy's, already read and checked (as it arrived). The copy must have been
    saved from this rank's layout (:class:`StateMismatchError` otherwise)."""
    tree, flat, digest = target
    if placed:  # only placed where the options select every key (see ``placeable``)
        options = dataclasses.replace(options, keys=lambda name: name not in placed)
    with Checkpoint(os.fspath(path), options, process_group=ALONE, manifest=manifest) as ck:
        saved = ck.metadata.get(LAYOUT_KEY) if isinstance(ck.metadata, dict) else None
        if saved != digest:
            raise StateMismatchError(f"the local-tier copy {path} was saved from another layout of the state (another "
                                     "world size, mesh or model): restore from the persistent tier")
        loaded = ck.load(tree, options, strict=True)
    values = {p: _get(loaded, p) for p, leaf in flat.leaves.items() if not isinstance(leaf, torch.Tensor)}
    return rebuild(state, flat, values)


def _fresh_optimizer(path: Path, obj: Any) -> None:
    if isinstance(obj, torch.optim.Optimizer):
        init_optimizer_state(obj)


def _insert(tree: dict[Any, Any], path: Path, value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1] if path else ""] = value


def _get(tree: dict[Any, Any], path: Path) -> Any:
    node: Any = tree
    for key in path or ("",):
        node = node[key]
    return node
