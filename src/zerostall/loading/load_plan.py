"""Load plan: match the target state's leaves with the checkpoint's entries; no I/O.

Keys are matched by path, under a prefix (:func:`relative`: the one reading of a prefix, which
exports share), through a name filter and with wrapper segments stripped; rank-local entries
match by rank. The plan lists, for each target tensor, the box of the
global tensor it holds (a DTensor shard reshards from any saved layout) and its entry; what the
fetch stage then reads follows from the entries' chunks. A strict mismatch is raised here, before
any byte moves.
"""

from __future__ import annotations

import difflib
import fnmatch
import collections
import functools
import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import StateMismatchError
from ..format import codec, subclass
from ..format.boxes import Box, local_box
from ..format.layout import INTERNAL_KEYS, Entry, Manifest
from ..options import KeyFilter, LoadOptions
from ..state import Flat, Path, flatten, fqn, init_optimizer_state
from ..views import ViewIndex
from .optimizers import match_optimizer
from .reader import resolve


Prefix = str | tuple[Any, ...]
_PAIRED = 10_000  # unexpected names searched for the closest one to each missing name shown (a bound on the cost)
_NEAR = 10  # of those, sharing the most dotted segments with it, compared by difflib (the costly comparison)


def relative(path: Path, prefix: Prefix) -> Path | None:
    """``path`` below ``prefix``, or None where it does not lie under it: how every load and export
    reads a prefix. A tuple is a key path, matched key by key. A str is a dotted name (a trailing
    ``.`` changes nothing) matched against the dotted name at a dot, so ``"model"`` and ``"model."``
    select ``("model", "w")`` and a flat key ``"model.w"`` (a Hugging Face name) both as ``("w",)``;
    a key that itself holds a dot is selected alone by the tuple form."""
    if isinstance(prefix, tuple):
        return path[len(prefix):] if path[:len(prefix)] == prefix else None
    rest = prefix.removesuffix(".")
    if not rest:
        return path
    for i, key in enumerate(path):
        name = str(key)
        if name == rest:
            return path[i + 1:]
        if isinstance(key, str) and name.startswith(rest + "."):  # the prefix ends inside this key, at a dot
            return (name[len(rest) + 1:], *path[i + 1:])
        if not rest.startswith(name + "."):
            return None
        rest = rest[len(name) + 1:]
    return None


def prefix_name(prefix: Prefix) -> str:
    """How messages show ``prefix``: the dotted name, or the tuple where a key holds a dot."""
    if isinstance(prefix, str):
        return repr(prefix.removesuffix("."))
    dotted = fqn(prefix)
    return repr(dotted) if all(isinstance(k, str) and "." not in k for k in prefix) else repr(prefix)


@dataclass
class Mismatch:
    """What a non-strict load could not match, every name as the target spells its keys (below the
    prefix): missing target keys, unexpected checkpoint keys, mismatched ones with the reason."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def describe(self, limit: int = 20) -> str:
        """The names (``limit`` of each kind), then each missing name shown beside the closest
        unexpected one, so a key saved under another wrapper or prefix is seen at once."""
        parts = []
        for label, names in (("missing from the checkpoint", self.missing),
                             ("unexpected in the checkpoint", self.unexpected),
                             ("mismatched", self.mismatched)):
            if names:
                shown = ", ".join(names[:limit]) + (f", … ({len(names) - limit} more)" if len(names) > limit else "")
                parts.append(f"{label}: {shown}")
        pairs = self.closest(limit)
        if pairs:
            parts.append("closest (missing ~ unexpected): " + ", ".join(f"{m} ~ {u}" for m, u in pairs))
        return "; ".join(parts)

    def closest(self, limit: int = 20) -> list[tuple[str, str]]:
        """Up to ``limit`` pairs (missing name, the most similar unexpected name): ``difflib`` picks
        among the unexpected names that share the most dotted segments with the missing one."""
        pairs = []
        candidates = self.unexpected[:_PAIRED]
        segments = [set(name.split(".")) for name in candidates]
        for name in self.missing[:limit] if candidates else ():
            mine = set(name.split("."))
            near = heapq.nlargest(_NEAR, range(len(candidates)), key=lambda i: len(mine & segments[i]))
            found = difflib.get_close_matches(name, [candidates[i] for i in near], n=1, cutoff=0.5)
            if found:
                pairs.append((name, found[0]))
        return pairs


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
    hint: str | None = None  # what to say when nothing matched but every missing key lies under one prefix
    meta: list[str] = field(default_factory=list)
    mismatch: Mismatch = field(default_factory=Mismatch)
    fresh: list[torch.optim.Optimizer] = field(default_factory=list)  # optimizers whose state planning made

    def describe(self) -> str:
        """What did not match, as errors and warnings say it."""
        return self.unknown_prefix or (f"{self.hint}; " if self.hint else "") + self.mismatch.describe()


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
        select = key_filter(o.keys)
        source = self._source_index(prefix, strip, select)
        under = {rel[:i] for rel in source for i in range(len(rel))}
        optimizers: list[Path] = []

        plan = LoadPlan()

        def prepare(path: Path, obj: Any) -> None:
            if isinstance(obj, torch.optim.Optimizer) and _normalize(path + ("state",), strip) in under:
                if not obj.state:  # made here: a refused load leaves it fresh again
                    plan.fresh.append(obj)
                init_optimizer_state(obj)
                optimizers.append(path)

        flat = flatten(state, prepare=prepare)
        for path in optimizers:  # state saved by parameter name (DCP's get_state_dict) into an optimizer
            wrong = match_optimizer(flat, path, source, lambda p: _normalize(p, strip), o.allow_pickle)
            if wrong:
                plan.mismatch.mismatched.append(wrong)
        seen_targets = ViewIndex()
        world_changed = self.manifest.world_size != self.world
        for path, value in flat.leaves.items():
            rel = _normalize(path, strip)
            if rel not in source:
                rel = _dcp_spelling(rel, source)
            if select is not None and not select(fqn(rel)):
                continue
            if world_changed and path in flat.rank_local and rel not in source:
                plan.mismatch.mismatched.append(f"{fqn(path)} (rank-local, saved by {self.manifest.world_size} "
                                                f"ranks, loading on {self.world}: load with strict=False to skip it)")
                continue
            self._match(plan, path, rel, value, source, under, strict_dtype, materialize, seen_targets)
        plan.unused = [e for rel, e in source.items() if rel not in plan.consumed and e.path[:1] not in _INTERNAL]
        if prefix and not source and not any(relative(e.path, prefix) is not None for e in self.manifest.entries):
            tops = sorted({fqn(e.path[:1]) for e in self.manifest.entries if e.path[:1] not in _INTERNAL})
            shown = ", ".join(tops[:20]) + (", …" if len(tops) > 20 else "")
            plan.unknown_prefix = (f"nothing in checkpoint {self.path} lies under the prefix {prefix_name(prefix)}; "
                                   f"its top-level keys are: {shown}")
        if plan.mismatch.missing and not plan.consumed:
            missing = set(plan.mismatch.missing)
            plan.hint = self._hint([_normalize(p, strip) for p in flat.leaves if fqn(p) in missing])
        plan.used = [source[rel] for rel in plan.consumed]
        return flat, plan

    def check(self, plan: LoadPlan, wanted: set[int] | None = None) -> None:
        """Settle what did not match and raise on a strict mismatch, before any byte moves. In a
        collective load, ``wanted`` holds the manifest indices of the entries some rank matched: an
        entry is unexpected only when no rank wanted it (pipeline stages load their own keys)."""
        if wanted is not None:
            plan.unused = [e for e in plan.unused if self._index[id(e)] not in wanted]
        plan.mismatch.unexpected = [fqn(relative(e.path, self.options.prefix) or e.path) for e in plan.unused]
        if plan.meta or self.options.strict and plan.mismatch:
            for optim in plan.fresh:
                optim.state.clear()
        if plan.meta:
            raise StateMismatchError(
                f"targets on the meta device have no memory to load into: {', '.join(plan.meta[:20])}; "
                "pass materialize=True to allocate them from the checkpoint")
        if self.options.strict and plan.mismatch:
            if plan.unknown_prefix:
                raise StateMismatchError(plan.unknown_prefix)
            raise StateMismatchError(f"checkpoint {self.path} does not match the target state: {plan.describe()}")

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

    def _own(self) -> list[Entry]:
        """The entries this rank may load: not another rank's, nor a part of a tensor subclass
        (loaded through its subclass entry)."""
        same_world = self.manifest.world_size == self.world
        return [e for e in self.manifest.entries
                if (e.rank is None or same_world and e.rank == self.rank) and e.inner_of is None]

    def _source_index(self, prefix: Prefix, strip: Sequence[str],
                      select: Callable[[str], bool] | None) -> dict[Path, Entry]:
        source: dict[Path, Entry] = {}
        for e in self._own():
            below = relative(e.path, prefix)
            if below is None:
                continue
            rel = _normalize(below, strip)
            if select is not None and not select(fqn(rel)):
                continue
            if rel in source:
                raise StateMismatchError(f"entries {source[rel].fqn} and {e.fqn} of checkpoint {self.path} collide: "
                                         f"both load as {fqn(rel)!r}; {_collision_fix(prefix, strip)}")
            source[rel] = e
        return source

    def _hint(self, missing: list[Path]) -> str | None:
        """``did you mean prefix=...?`` when every key ``missing`` (nothing matched) lies under one
        prefix of the checkpoint: checked by loading through it, so the prefix offered works."""
        own = [e for e in self._own() if e.path[:1] not in _INTERNAL]
        first = "." + fqn(missing[0])
        candidates = {e.fqn[:-len(first)] for e in own if e.fqn.endswith(first)}
        for candidate in sorted(candidates, key=lambda c: (len(c), c)):
            found = {_normalize(rel, self.options.strip) for e in own if (rel := relative(e.path, candidate))}
            if all(key in found for key in missing):
                return f"did you mean prefix={candidate!r}? (every missing key lies under it)"
        return None

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
                decoded = codec.decode(entry.value, where=entry.fqn, allow_pickle=self.options.allow_pickle)
                plan.replacements[path] = _keys_as_in(value, decoded)
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
            piece, offsets, sizes = local_box(value, fqn(path))
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


def _dcp_spelling(rel: Path, source: dict[Path, Entry]) -> Path:
    """``rel`` as DCP spells it, when the checkpoint holds that (a DCP checkpoint, or one imported
    from DCP): DCP stores every dict key as a string (an optimizer's ``state`` by ``str(index)``)."""
    spelt = tuple(str(k) if type(k) is int else k for k in rel)
    return spelt if spelt in source else rel


def _keys_as_in(target: Any, value: Any) -> Any:
    """A loaded python value with the dict classes of ``target``, the value it replaces, and its
    keys where DCP spelt them as strings: the target's own, or ints where all the target's are ints
    (a scheduler's milestones, a ``Counter``)."""
    if not (isinstance(target, dict) and isinstance(value, dict)):
        return value
    spelt = {str(k): k for k in target if type(k) is not str and k not in value}
    if target and all(type(k) is int for k in target) and all(type(k) is str and k.isdecimal() for k in value):
        spelt = {k: int(k) for k in value}  # keys of other values than the target's (milestones moved)
    items = {(spelt.get(k, k) if type(k) is str else k): v for k, v in value.items()}
    rekeyed = {k: _keys_as_in(target.get(k), v) for k, v in items.items()}
    return type(target)(rekeyed) if type(target) in (dict, collections.Counter, collections.OrderedDict) else rekeyed


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


def _collision_fix(prefix: Prefix, strip: Sequence[str]) -> str:
    """What to do when two entries load as one key."""
    if isinstance(prefix, str) and prefix:  # a dotted name reaches keys holding dots too
        return (f"the prefix {prefix_name(prefix)} selects both as a dotted name; pass it as a key path to select "
                f"one, e.g. prefix={tuple(prefix.removesuffix('.').split('.'))!r}")
    return f"they differ only in the segments {list(strip)} that strip removes: strip fewer"


def key_filter(keys: KeyFilter) -> Callable[[str], bool] | None:
    """A predicate on entry names, or None when every key is wanted (no name is then built)."""
    if keys is None:
        return None
    if callable(keys):
        return keys
    patterns = [keys] if isinstance(keys, str) else list(keys)
    return lambda name: any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)
