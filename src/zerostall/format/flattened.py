"""A tensor subclass read without a target of its class: a :class:`FlattenedTensor` per entry (or
per saved box), which a caller rebuilds with the classes it trusts; a checkpoint's class names are
never imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch

from . import codec
from ..errors import UnsupportedValueError
from .boxes import Box, contiguous_strides
from .layout import Entry, dtype_from_name
from .subclass import Node, Ref, Shard, class_name

Inner = Union[torch.Tensor, "FlattenedTensor"]


@dataclass
class FlattenedTensor:
    """A tensor subclass as a checkpoint stores it: what ``Checkpoint.read`` / ``state()`` return
    for a subclass entry whose class the caller did not pass in ``LoadOptions.tensor_subclasses``
    (a checkpoint's class names are never imported), or whose inner tensors are stored per box and
    cannot form one tensor (then ``read`` returns a list of these, one per saved box).

    ``unflatten(*classes)`` rebuilds it with ``cls.__tensor_unflatten__(inner, context, sizes, stride)``,
    taking each class (this one and any nested one) from ``classes`` by name."""

    cls: str
    """The subclass, ``module:qualname``."""
    dtype: torch.dtype
    """The outer tensor's dtype."""
    shape: torch.Size
    """The outer (global) tensor's shape."""
    offsets: tuple[int, ...]
    """Where this piece starts in the global tensor (zeros for a whole tensor)."""
    sizes: torch.Size
    """This piece's outer size (``shape`` for a whole tensor): ``outer_size`` of ``__tensor_unflatten__``."""
    stride: tuple[int, ...]
    """``outer_stride`` of ``__tensor_unflatten__``."""
    context: Any
    """The flatten context, decoded."""
    inner: dict[str, Inner]
    """The inner tensors by attribute name (a nested subclass is itself a FlattenedTensor)."""

    def unflatten(self, *classes: type) -> torch.Tensor:
        """This tensor rebuilt by its class's ``__tensor_unflatten__``, each class found in ``classes``
        by its module and qualified name."""
        by_name = {class_name(c): c for c in classes}
        cls = by_name.get(self.cls)
        if cls is None or not hasattr(cls, "__tensor_unflatten__"):
            raise UnsupportedValueError(f"rebuilding a {self.cls} needs that class: pass it (zerostall never imports "
                                        "a class named by a checkpoint)")
        inner = {k: v.unflatten(*classes) if isinstance(v, FlattenedTensor) else v for k, v in self.inner.items()}
        out = cls.__tensor_unflatten__(inner, self.context, self.sizes, self.stride)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(self.sizes):
            raise UnsupportedValueError(f"{self.cls}.__tensor_unflatten__ returned {type(out).__qualname__} of shape "
                                        f"{list(getattr(out, 'shape', []))}, not a tensor of shape {list(self.sizes)}")
        return out


def joinable(saved: Sequence[Shard], shape: tuple[int, ...]) -> bool:
    """Whether the saved boxes form one tensor: a single whole box, or boxes that agree on
    everything but their box and store every inner tensor by box (so each reads whole)."""
    if len(saved) == 1 and saved[0].box == ((0,) * len(shape), shape):
        return True
    first = saved[0]
    return (all(s.node.signature() == first.node.signature() for s in saved)
            and all(_by_box(s.node, s.node.sizes) for s in saved))


def _by_box(node: Node, sizes: tuple[int, ...]) -> bool:
    return node.sizes == sizes and all(_by_box(v, sizes) if isinstance(v, Node) else v.box
                                       for v in node.inner.values())


def flattened(saved: Sequence[Shard], entry: Entry, entries: Sequence[Entry],
              read: Callable[[Entry, Box | None], torch.Tensor]) -> FlattenedTensor | list[FlattenedTensor]:
    """The entry's inner tensors, read with ``read(entry, box)`` (box None: whole), as one
    FlattenedTensor when its boxes form one tensor, else one per saved box."""
    shape = tuple(entry.shape or ())
    if joinable(saved, shape):
        node = saved[0].node
        one = len(saved) == 1
        stride = node.stride if one else contiguous_strides(shape)
        return _flat(node, entry.cls or "", shape, (0,) * len(shape), shape, stride, entries,
                     lambda ref: read(entries[ref.entry], None), one)
    return [_flat(s.node, entry.cls or "", shape, s.offsets, s.node.sizes, s.node.stride, entries,
                  lambda ref, s=s: read(entries[ref.entry], s.box if ref.box else None), True) for s in saved]


def _flat(node: Node, cls: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
          stride: tuple[int, ...], entries: Sequence[Entry], leaf: Callable[[Ref], torch.Tensor],
          as_saved: bool) -> FlattenedTensor:
    inner: dict[str, Inner] = {}
    for attr, value in node.inner.items():
        if isinstance(value, Node):
            size, stride_ = (value.sizes, value.stride) if as_saved else (sizes, contiguous_strides(sizes))
            inner[attr] = _flat(value, value.cls, size, (0,) * len(size), size, stride_, entries, leaf, as_saved)
        else:
            inner[attr] = leaf(value)
    return FlattenedTensor(cls, dtype_from_name(node.dtype), torch.Size(shape), tuple(offsets), torch.Size(sizes),
                           tuple(stride), codec.decode(node.context), inner)
