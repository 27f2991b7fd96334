"""Tensor subclasses: wrapper subclasses (float8, NF4, ``TwoTensor``...) stored as their inner tensors.

A traceable wrapper subclass (``__tensor_flatten__``/``__tensor_unflatten__``) is saved as its plain
inner tensors, found recursively, each an ordinary tensor entry (planned, written, checksummed and
resharded like any other), plus a "subclass" entry describing the outer tensor box by box: its
class name, flatten context (tagged-encoded, never pickled), size, stride and where each inner
tensor is stored. An inner tensor whose shape is its shard's box is stored as that box of a tensor
of the outer tensor's global shape (so it reshards); any other (a scale, packed NF4 data) is stored
whole, per box, and loads only into the same box.

Loading into a target of the same class fills its inner tensors in place. Without such a target a
checkpoint's class is never imported by name (a checkpoint is untrusted input): the entry is rebuilt
only with a class the caller passes (``LoadOptions.tensor_subclasses``), else returned as a
:class:`~zerostall.format.flattened.FlattenedTensor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import CorruptCheckpointError, UnsupportedValueError
from . import codec
from .boxes import Box, whole
from .layout import Entry, dtype_name

MAX_NESTING = 16
Attrs = tuple[str, ...]  # the attribute names from the outer tensor down to an inner tensor


def is_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a wrapper subclass that flattens into inner tensors (a DTensor is one too:
    callers take its local tensor first)."""
    return type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t)


def class_name(cls: type) -> str:
    """How the manifest names a class: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(slots=True)
class Ref:
    """Where an inner tensor is stored: tensor entry ``entry`` (its index; its path key while a save
    is assembled), as the shard's box of a tensor of the outer global shape (``box``) or whole."""

    entry: Any
    box: bool


@dataclass(slots=True)
class Node:
    """One (outer or nested) subclass tensor: class, dtype, size, stride, encoded flatten context,
    and its inner tensors by attribute: a nested Node, or a leaf (a tensor when describing a live
    tensor, a :class:`Ref` when read from a manifest)."""

    cls: str
    dtype: str
    sizes: tuple[int, ...]
    stride: tuple[int, ...]
    context: Any
    inner: dict[str, Any] = field(default_factory=dict)

    def leaves(self, above: Attrs = ()) -> Iterator[tuple[Attrs, Any]]:
        for attr, value in self.inner.items():
            yield from value.leaves(above + (attr,)) if isinstance(value, Node) else ((above + (attr,), value),)

    def at(self, attrs: Attrs) -> Any:
        node: Any = self
        for attr in attrs:
            node = node.inner[attr] if isinstance(node, Node) else None
        return node

    def set(self, attrs: Attrs, value: Any) -> None:
        self.at(attrs[:-1]).inner[attrs[-1]] = value

    def signature(self) -> Any:
        """What must agree between a checkpoint and a target: classes, attributes, contexts."""
        return (self.cls, self.context, [(a, v.signature() if isinstance(v, Node) else None)
                                         for a, v in sorted(self.inner.items())])

    def to_json(self, outer: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {} if outer else {"class": self.cls, "dtype": self.dtype}
        d.update(sizes=list(self.sizes), stride=list(self.stride), context=self.context, inner={
            a: v.to_json(False) if isinstance(v, Node) else {"entry": v.entry, "box": v.box}
            for a, v in self.inner.items()})
        return d


# -- saving ---------------------------------------------------------------------------------------


def describe(t: torch.Tensor, where: str, depth: int = 0) -> Node:
    """``t`` flattened: its description with its plain inner tensors as leaves. Raises
    :class:`UnsupportedValueError` naming ``where`` for a context that cannot be stored without
    pickle, and for inner tensors that are not plain strided data."""
    name = class_name(type(t))
    if depth > MAX_NESTING:
        raise UnsupportedValueError(f"{where}: tensor subclasses nest more than {MAX_NESTING} deep")
    attrs, ctx = t.__tensor_flatten__()
    try:
        context = codec.encode(ctx, where="context", hint="only plain python values are stored, never pickled")
    except UnsupportedValueError as exc:
        kind = type(ctx)
        raise UnsupportedValueError(
            f"{where}: tensor subclass {name} has a flatten context (a {kind.__module__}.{kind.__qualname__}) that "
            f"cannot be stored safely ({exc}); contexts are stored without pickle, so they may hold only None, bools, "
            "ints, floats, strings, bytes, torch dtypes/sizes/devices and tuples, lists, sets, dicts of these"
        ) from None
    node = Node(name, dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), context)
    for attr in attrs:
        inner = getattr(t, attr)
        at = f"{where} (inner tensor {attr!r} of {name})"
        if not isinstance(inner, torch.Tensor):
            raise UnsupportedValueError(f"{at}: __tensor_flatten__ named {type(inner).__qualname__}, not a tensor")
        if is_wrapper(inner):
            node.inner[attr] = describe(inner, f"{where}.{attr}", depth + 1)
            continue
        if type(inner) is not torch.Tensor and not isinstance(inner, torch.nn.Parameter):
            raise UnsupportedValueError(f"{at}: tensor subclass {type(inner).__qualname__} is not supported")
        if inner.layout != torch.strided or inner.is_quantized or inner.is_nested or inner.is_meta:
            raise UnsupportedValueError(f"{at}: only dense tensors with data can be stored")
        node.inner[attr] = inner
    return node


def inner_path(path: tuple[Any, ...], attrs: Attrs, box: bool, offsets: tuple[int, ...] | None) -> tuple[Any, ...]:
    """The key path of an inner tensor's entry: the outer path and the attributes, the last one
    suffixed with ``@<box offsets>`` when it is stored whole per box of a sharded tensor."""
    if box or offsets is None:
        return path + attrs
    return path + attrs[:-1] + (f"{attrs[-1]}@{','.join(map(str, offsets))}",)


def shard_json(node: Node, offsets: tuple[int, ...]) -> dict[str, Any]:
    """One box of a subclass entry, as the manifest stores it (leaves must be :class:`Ref`)."""
    return {"offsets": list(offsets), **node.to_json()}


def link(entries: list[Entry], locate: Callable[[str, int | None], int]) -> None:
    """Once a manifest's entries are in place: turn the path keys in subclass shards into entry
    indices (``locate(key, rank)``) and point each inner tensor entry back at its subclass entry."""
    for i, entry in enumerate(entries):
        if entry.kind != "subclass":
            continue
        for shard in entry.shards or ():
            for ref in _json_leaves(shard):
                if isinstance(ref["entry"], str):
                    ref["entry"] = locate(ref["entry"], entry.rank)
                entries[ref["entry"]].inner_of = i
        (entry.shards or []).sort(key=lambda s: s["offsets"])


def _json_leaves(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for value in node["inner"].values():
        yield from _json_leaves(value) if "inner" in value else (value,)


# -- reading a manifest ---------------------------------------------------------------------------


@dataclass(slots=True)
class Shard:
    offsets: tuple[int, ...]
    node: Node

    @property
    def box(self) -> Box:
        return self.offsets, self.node.sizes


def shards(entries: Sequence[Entry], index: int, where: str) -> list[Shard]:
    """The boxes of subclass entry ``entries[index]``, checked: a malformed description, or a
    reference to anything but one of its own inner tensor entries, is a :class:`CorruptCheckpointError`."""
    entry = entries[index]
    try:
        out = []
        shape = tuple(entry.shape or ())
        for d in entry.shards or ():
            offsets = _ints(d["offsets"], "offsets")
            node = _node(entries, index, entry, d, entry.cls or "", entry.dtype or "", offsets)
            if len(offsets) != len(shape) or len(node.sizes) != len(offsets):
                raise ValueError(f"a box of {len(offsets)} dimensions in a tensor of {len(shape)}")
            if any(o < 0 or n < 0 or o + n > dim for o, n, dim in zip(offsets, node.sizes, shape)):
                raise ValueError(f"the box at {list(offsets)} of sizes {list(node.sizes)} is not inside the tensor's "
                                 f"shape {list(shape)}")
            out.append(Shard(offsets, node))
        if not out:
            raise ValueError("no shards")
        return out
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, UnsupportedValueError) as exc:
        raise CorruptCheckpointError(f"subclass entry {entry.fqn} of {where} is malformed: {exc!r}") from None


def _node(entries: Sequence[Entry], index: int, entry: Entry, d: dict[str, Any], cls: str, dtype: str,
          offsets: tuple[int, ...], attrs: Attrs = ()) -> Node:
    context = d["context"]
    codec.decode(context, where=f"{entry.fqn} (flatten context)")  # no pickle: a $pickle tag raises
    node = Node(str(cls), str(dtype), _ints(d["sizes"], "sizes"), _ints(d["stride"], "stride"), context)
    if not isinstance(d["inner"], dict):
        raise ValueError("inner is not an object")
    for attr, value in d["inner"].items():
        if "inner" in value:
            node.inner[attr] = _node(entries, index, entry, value, value["class"], value["dtype"], offsets,
                                     attrs + (attr,))
            continue
        ref = Ref(value["entry"], bool(value["box"]))
        if type(ref.entry) is not int or not 0 <= ref.entry < len(entries):
            raise ValueError(f"inner tensor {attr!r} refers to entry {ref.entry!r}")
        target = entries[ref.entry]
        if target.kind != "tensor" or target.inner_of != index:
            raise ValueError(f"inner tensor {attr!r} refers to entry {target.fqn}, not one of its inner tensors")
        if ref.box and target.shape != entry.shape:
            raise ValueError(f"inner tensor {attr!r} is stored by box in a tensor of shape {list(target.shape or ())}")
        if target.path not in {inner_path(entry.path, attrs + (attr,), ref.box, at) for at in (None, offsets)}:
            raise ValueError(f"inner tensor {attr!r} refers to entry {target.fqn}, stored for another attribute")
        node.inner[attr] = ref
    return node


def _ints(values: Any, what: str) -> tuple[int, ...]:
    """``values`` (a JSON list) as a tuple of ints; a list holding anything else is a ValueError."""
    out = tuple(values)
    if not all(type(v) is int for v in out):
        raise ValueError(f"{what} {out!r} are not all integers")
    return out


def check(entries: Sequence[Entry], where: str) -> list[str]:
    """What is structurally wrong with the subclass entries and inner tensor entries (for verify)."""
    faults = []
    for i, entry in enumerate(entries):
        if entry.kind == "subclass":
            try:
                shards(entries, i, where)
            except CorruptCheckpointError as exc:
                faults.append(str(exc))
        elif entry.inner_of is not None:
            owner = entry.inner_of
            if type(owner) is not int or not 0 <= owner < len(entries) or entries[owner].kind != "subclass":
                faults.append(f"entry {entry.fqn} is the inner tensor of entry #{owner}, which is no subclass entry")
    return faults


# -- loading into a target of the same class ------------------------------------------------------


def match(entries: Sequence[Entry], index: int, piece: torch.Tensor, box: Box, where: str,
          strict_dtype: bool) -> list[tuple[torch.Tensor, Box, Entry]] | str:
    """The fills that load subclass entry ``entries[index]`` into ``piece`` (a tensor of the same
    class holding ``box`` of the global tensor): each inner tensor of ``piece`` with the box it
    holds of a tensor entry. Returns why not instead when they do not match."""
    entry = entries[index]
    name = class_name(type(piece))
    if name != entry.cls:
        return f"the checkpoint holds a {entry.cls} tensor subclass, the target a {name}"
    saved = shards(entries, index, where)
    try:
        target = describe(piece, entry.fqn)
    except UnsupportedValueError as exc:
        return str(exc)
    exact = next((s for s in saved if s.box == box), None)
    candidates = [exact] if exact is not None else saved
    wanted = target.signature()
    for shard in candidates:
        if shard.node.signature() != wanted:
            return _difference(shard.node, target, exact is None and len(saved) > 1)
    fills = []
    for attrs, tensor in target.leaves():
        dotted, shape = ".".join(attrs), tuple(tensor.shape)
        if exact is not None:
            ref = exact.node.at(attrs)
            stored = entries[ref.entry]
            expected = box[1] if ref.box else stored.shape
            if shape != tuple(expected or ()):
                return (f"inner tensor {dotted} has shape {list(expected or ())} in the checkpoint, {list(shape)} in "
                        "the target")
            fill = (tensor, box if ref.box else whole(tensor), stored)
        else:
            refs = [s.node.at(attrs) for s in saved]
            if not all(r.box and r.entry == refs[0].entry for r in refs):
                return (f"inner tensor {dotted} of {name} is stored per shard (its shape does not follow the tensor's "
                        f"box), and the target's box at {list(box[0])} of size {list(box[1])} is not one of the saved "
                        "boxes: load it with the sharding it was saved with")
            if shape != box[1]:
                return (f"inner tensor {dotted} follows the tensor's box in the checkpoint, but has shape "
                        f"{list(shape)} in the target's box of size {list(box[1])}")
            fill = (tensor, box, entries[refs[0].entry])
        if strict_dtype and tensor.dtype != fill[2].torch_dtype:
            return (f"inner tensor {dotted} has dtype {fill[2].dtype} in the checkpoint, {dtype_name(tensor.dtype)} in "
                    "the target")
        fills.append(fill)
    return fills


def _difference(saved: Node, target: Node, resharding: bool) -> str:
    if saved.cls != target.cls:
        return f"a nested tensor subclass is a {saved.cls} in the checkpoint, a {target.cls} in the target"
    if sorted(saved.inner) != sorted(target.inner):
        return (f"{saved.cls} has inner tensors {sorted(saved.inner)} in the checkpoint, {sorted(target.inner)} in the "
                "target")
    if saved.context != target.context:
        why = " (its context differs between the saved boxes, so it loads only into those boxes)" if resharding else ""
        return (f"the flatten context of {saved.cls} is {_clip(saved.context)} in the checkpoint, "
                f"{_clip(target.context)} in the target{why}")
    for attr, value in saved.inner.items():
        other = target.inner[attr]
        if isinstance(value, Node) != isinstance(other, Node):
            return f"inner tensor {attr} of {saved.cls} is a tensor subclass on one side only"
        if isinstance(value, Node) and value.signature() != other.signature():
            return _difference(value, other, resharding)
    return f"{saved.cls} differs between the checkpoint and the target"


def _clip(value: Any, limit: int = 120) -> str:
    text = repr(codec.decode(value))
    return text if len(text) <= limit else text[:limit] + "…"
