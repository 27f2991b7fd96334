"""Tensor views by identity: which leaves of a state hold the very same bytes (tied weights)."""

from __future__ import annotations

from typing import Any

import torch


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity of a tensor view: two leaves with the same key hold the very same bytes."""
    return t.device, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg()


def storage_key(t: torch.Tensor) -> Any:
    """Identity of a tensor without memory (on the meta device, where every data pointer is 0):
    its storage, offset, shape, strides and dtype (a module's ``state_dict()`` detaches each tied
    parameter anew, over one storage); for a tensor that exposes no storage, the object itself."""
    try:
        return t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t)


class ViewIndex:
    """Tensor views seen so far, each with a value, found by :func:`view_key` identity. Views are
    filed by data pointer and compared by whole key only when pointers meet (tied weights), so
    each of thousands of distinct leaves costs one pointer read, not seven attribute reads."""

    __slots__ = ("_by_pointer",)

    def __init__(self) -> None:
        self._by_pointer: dict[int, Any] = {}  # a (view, value) pair, or a list of them once pointers meet

    def first(self, t: torch.Tensor, value: Any) -> Any:
        """The value filed for ``t``'s view by an earlier call, or None after filing ``value`` for it."""
        pointer = t.data_ptr()
        filed = self._by_pointer.get(pointer)
        if filed is None:
            self._by_pointer[pointer] = (t, value)
            return None
        key = view_key(t)
        for view, earlier in filed if type(filed) is list else (filed,):
            if view_key(view) == key:
                return earlier
        if type(filed) is list:
            filed.append((t, value))
        else:
            self._by_pointer[pointer] = [filed, (t, value)]
        return None
