"""Load plan: match the target state's leaves with the checkpoint's entries; no I/O.

Keys are matched by path, under a prefix, through a name filter and with wrapper segments
stripped; rank-local entries match by rank. The plan lists, for each target tensor, the box of the
global tensor it holds (a DTensor shard reshards from any saved layout) and its entry; what the
fetch stage then reads follows from the entries' chunks. A strict mismatch is raised here, before
any byte moves.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import StateMismatchError
from ..format import codec, subclass
from ..format.boxes import Box, local_box
from ..format.layout import INTERNAL_KEYS, Entry, Manifest
from ..options import KeyFilter, LoadOptions
from ..state import Flat, Path, ViewIndex, flatten, fqn, init_optimizer_state
from .optimizers import key_by_name
from .reader import resolve


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


@dataclass
class LoadPlan:
    """Which bytes go where: targets to fill (a tensor, the box of the global tensor it holds, its
    entry), tensors to allocate, values to replace, subtrees to read whole, values to copy between a
    tensor subclass and a plain tensor (a target, its box, the entry, its name), and what did not match."""

    tensors: list[tuple[torch.Tensor, Box, Entry]] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, Box, Entry, str]] = field(default_factory=list)
    new_tensors: list[tuple[Path, Entry, torch.Tensor | None]] = field(default_factory=list)
    replacements: dict[Path, Any] = field(default_factory=dict)
    subtrees: list[tuple[Path, list[tuple[Path, Entry]]]] = field(default_factory=list)
    consumed: set[Path] = field(default_factory=set)
    used: list[Entry] = field(default_factory=list)
    unused: list[Entry] = field(default_factory=list)
    wanted: set[int] | None = None  # in a collective load: the entries (manifest indices) some rank matched
    unknown_prefix: str | None = None  # what to say when the prefix asked for matches no entry at all
    meta: list[str] = field(default_factory=list)
    mismatch: Mismatch = field(default_factory=Mismatch)


_INTERNAL = {(key,) for key in INTERNAL_KEYS}


class LoadPlanner:
    """Plans loads of one checkpoint's ``manifest`` (at ``path``) on rank ``rank`` of ``world``."""

    def __init__(self, manifest: Manifest, path: str, rank: int, world: int, options: LoadOptions) -> None:
        self.manifest = manifest
        self.path = path
        self.rank = rank
        self.world = world
        self.options = options

    def plan(self, state: Any) -> tuple[Flat, LoadPlan]:
        """Match every target leaf with its entry (what did not match is settled by :meth:`check`)."""
        o = self.options
        prefix, strip, strict_dtype, materialize = o.prefix, o.strip, o.strict_dtype, o.materialize
        prefix_path = (prefix,) if isinstance(prefix, str) else tuple(prefix)
        select = _key_filter(o.keys)
        source = self._source_index(prefix_path, strip, select)
        under = {rel[:i] for rel in source for i in range(len(rel))}
        optimizers: list[Path] = []

        def prepare(path: Path, obj: Any) -> None:
            if isinstance(obj, torch.optim.Optimizer) and _normalize(path + ("state",), strip) in under:
                init_optimizer_state(obj)
                optimizers.append(path)

        flat = flatten(state, prepare=prepare)
        for path in optimizers:  # state saved by parameter name (DCP's get_state_dict) into an optimizer
            key_by_name(flat, path, source, lambda p: _normalize(p, strip), o.allow_pickle)
        plan = LoadPlan()
        seen_targets = ViewIndex()
        world_changed = self.manifest.world_size != self.world
        for path, value in flat.leaves.items():
            rel = _normalize(path, strip)
            if select is not None and not select(fqn(rel)):
                continue
            if world_changed and path in flat.rank_local and rel not in source:
                plan.mismatch.mismatched.append(f"{fqn(path)} (rank-local, saved by {self.manifest.world_size} "
                                                f"ranks, loading on {self.world}: load with strict=False to skip it)")
                continue
            self._match(plan, path, rel, value, source, under, strict_dtype, materialize, seen_targets)
        plan.unused = [e for rel, e in source.items() if rel not in plan.consumed and e.path[:1] not in _INTERNAL]
        if prefix_path and not any(e.path[:len(prefix_path)] == prefix_path for e in self.manifest.entries):
            tops = sorted({fqn(e.path[:1]) for e in self.manifest.entries if e.path[:1] not in _INTERNAL})
            plan.unknown_prefix = (f"nothing in checkpoint {self.path} lies under the prefix {fqn(prefix_path)!r}; its "
                                   f"top-level keys are: {', '.join(tops[:20])}" + (", …" if len(tops) > 20 else ""))
        plan.used = [source[rel] for rel in plan.consumed]
        return flat, plan

    def check(self, plan: LoadPlan, wanted: set[int] | None = None) -> None:
        """Settle what did not match and raise on a strict mismatch, before any byte moves. In a
        collective load, ``wanted`` holds the manifest indices of the entries some rank matched: an
        entry is unexpected only when no rank wanted it (pipeline stages load their own keys)."""
        if wanted is not None:
            plan.unused = [e for e in plan.unused if self._index[id(e)] not in wanted]
        plan.mismatch.unexpected = [e.fqn for e in plan.unused]
        if plan.meta:
            raise StateMismatchError(
                f"targets on the meta device have no memory to load into: {', '.join(plan.meta[:20])}; "
                "pass materialize=True to allocate them from the checkpoint")
        if self.options.strict and plan.mismatch:
            if plan.unknown_prefix:
                raise StateMismatchError(plan.unknown_prefix)
            raise StateMismatchError(f"checkpoint {self.path} does not match the target state: {plan.mismatch.describe()}")

    def used_mask(self, plan: LoadPlan) -> list[int]:
        """One flag per manifest entry: whether this rank's target matched it (summed over ranks)."""
        mask = [0] * len(self.manifest.entries)
        for entry in plan.used:
            mask[self._index[id(entry)]] = 1
        return mask

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        """Each entry's position in the manifest, by identity (only collective loads need it)."""
        return {id(e): i for i, e in enumerate(self.manifest.entries)}

    def _source_index(self, prefix: Path, strip: Sequence[str],
                      select: Callable[[str], bool] | None) -> dict[Path, Entry]:
        source: dict[Path, Entry] = {}
        same_world = self.manifest.world_size == self.world
        for e in self.manifest.entries:
            if e.rank is not None and (not same_world or e.rank != self.rank) or e.inner_of is not None:
                continue  # another rank's, or a part of a tensor subclass (loaded through its subclass entry)
            if e.path[:len(prefix)] != prefix:
                continue
            rel = _normalize(e.path[len(prefix):], strip)
            if select is not None and not select(fqn(rel)):
                continue
            if rel in source:
                raise StateMismatchError(f"entries {source[rel].fqn} and {e.fqn} collide once {list(strip)} are stripped")
            source[rel] = e
        return source

    def _match(self, plan: LoadPlan, path: Path, rel: Path, value: Any, source: dict[Path, Entry],
               under: set[Path], strict_dtype: bool, materialize: bool, seen: ViewIndex) -> None:
        entry = source.get(rel)
        if entry is None:
            if isinstance(value, (dict, list, tuple)) and not value and rel in under:
                plan.subtrees.append((path, self._subtree(source, rel, plan.consumed)))
            else:
                plan.mismatch.missing.append(fqn(path))
            return
        plan.consumed.add(rel)
        entry = resolve(self.manifest, entry, self.path)
        if not isinstance(value, torch.Tensor):
            if entry.kind in ("tensor", "subclass"):
                plan.new_tensors.append((path, entry, None))
            else:
                plan.replacements[path] = codec.decode(entry.value, where=entry.fqn,
                                                      allow_pickle=self.options.allow_pickle)
            return
        if entry.kind not in ("tensor", "subclass"):
            plan.mismatch.mismatched.append(f"{fqn(path)} (the checkpoint holds a python value, the target a tensor)")
        elif value.shape != entry.shape:
            plan.mismatch.mismatched.append(f"{fqn(path)} (shape {list(entry.shape or ())} in the checkpoint, "
                                            f"{list(value.shape)} in the target)")
        elif strict_dtype and value.dtype != entry.torch_dtype:
            plan.mismatch.mismatched.append(f"{fqn(path)} (dtype {entry.dtype} in the checkpoint, "
                                            f"{str(value.dtype).removeprefix('torch.')} in the target)")
        elif value.is_meta:
            if materialize and entry.kind == "subclass" and not self._rebuildable(entry, value):
                plan.mismatch.mismatched.append(f"{fqn(path)} (the checkpoint holds a {entry.cls} tensor subclass: "
                                                "pass that class in tensor_subclasses= to materialize it)")
            elif materialize:
                plan.new_tensors.append((path, entry, value))
            else:
                plan.meta.append(fqn(path))
        else:
            piece, offsets, sizes = local_box(value)
            if entry.kind == "subclass" or subclass.is_wrapper(piece):
                self._match_subclass(plan, path, entry, piece, (offsets, sizes), strict_dtype, seen)
            elif seen.first(piece, True) is None:
                plan.tensors.append((piece, (offsets, sizes), entry))

    def _rebuildable(self, entry: Entry, like: torch.Tensor) -> bool:
        """Whether subclass ``entry`` can be rebuilt for the target ``like``: it is a (non-DTensor)
        target of that very class, or the caller trusts the class."""
        return entry.cls in map(subclass.class_name, (*self.options.tensor_subclasses, type(like)))

    def _match_subclass(self, plan: LoadPlan, path: Path, entry: Entry, piece: torch.Tensor, box: Box,
                        strict_dtype: bool, seen: ViewIndex) -> None:
        """A tensor subclass on either side. Same class: fill the target's inner tensors in place
        (resharding where they follow the box). Otherwise the value is copied as ``load_state_dict``
        does (``target.copy_(saved)``), a saved subclass only when the caller trusts its class."""
        name = fqn(path)
        if entry.kind == "subclass" and subclass.is_wrapper(piece):
            fills = subclass.match(self.manifest.entries, self._index[id(entry)], piece, box, self.path, strict_dtype)
            if isinstance(fills, str):
                plan.mismatch.mismatched.append(f"{name} ({fills})")
                return
            plan.tensors.extend(fill for fill in fills if seen.first(fill[0], True) is None)
        elif entry.kind == "subclass" and entry.cls not in map(subclass.class_name, self.options.tensor_subclasses):
            plan.mismatch.mismatched.append(
                f"{name} (the checkpoint holds a {entry.cls} tensor subclass, the target a plain tensor: load it into "
                "a target of that class, or pass that class in tensor_subclasses= to copy its value into this one)")
        else:
            plan.copies.append((piece, box, entry, name))

    @staticmethod
    def _subtree(source: dict[Path, Entry], root: Path, consumed: set[Path]) -> list[tuple[Path, Entry]]:
        """The checkpoint's entries under ``root`` (by path below it), for a target that holds an
        empty container there: they are read whole and the subtree rebuilt from them."""
        found = []
        for rel, entry in source.items():
            if rel[:len(root)] == root and len(rel) > len(root):
                consumed.add(rel)
                found.append((rel[len(root):], entry))
        return found


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
