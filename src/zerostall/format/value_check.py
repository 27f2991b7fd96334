"""What a python value stored in a manifest may be: the tagged encoding of :mod:`zerostall.format.codec`,
well formed, checked without decoding it (so a whole manifest is checked once, when it is read).

Plain JSON or known tags with bodies of the right shape, at most
:data:`~zerostall.format.codec.MAX_DEPTH` containers deep; ``$ref`` only in the tree, naming an entry;
hashable values where a key belongs; base64 that is base64 (of as many bytes as an array's shape
and dtype need); torch dtypes and devices that exist. What only decoding can tell is checked by
:func:`~zerostall.format.codec.decode`, with the same error: :class:`CorruptCheckpointError`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import CorruptCheckpointError
from .codec import MAX_DEPTH, NON_FINITE, non_finite, numpy_dtype, numpy_module, torch_dtype
from .tensor_check import MAX_INT, FieldError, check_shape, dtype_itemsize


def check_value(data: Any, where: str, *, refs: int | None = None, key: bool = False) -> None:
    """Check, without decoding it, that ``data`` is what :func:`~zerostall.format.codec.encode` produces:
    plain JSON or known tags with well-formed bodies, at most :data:`MAX_DEPTH` containers deep;
    ``$ref`` only when ``refs`` (the number of entries) is given, and below it; with ``key``,
    something that decodes to a hashable value (a dict key, a key path's element). Raises
    :class:`CorruptCheckpointError` naming ``where`` and the place inside it."""
    try:
        _check(data, 0, refs, key)
    except _Malformed as exc:
        raise CorruptCheckpointError(f"{where}{''.join(reversed(exc.location))}: {exc}") from None


class _Malformed(Exception):
    """What is wrong with a value; containers add their part of the location as it unwinds."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.location: list[str] = []


_SCALARS = (type(None), bool, int, float, str)
_HASHABLE_TAGS = frozenset({"$tuple", "$frozenset", "$float", "$bytes", "$complex", "$dtype", "$size", "$device",
                            "$npscalar", "$pickle"})


def _check(data: Any, depth: int, refs: int | None, key: bool) -> None:
    kind = type(data)
    if kind in _SCALARS:
        return
    if kind is not list and kind is not dict:
        raise _Malformed(f"{kind.__name__} is not JSON data")
    if depth >= MAX_DEPTH:
        raise _Malformed(f"nests more than {MAX_DEPTH} containers deep")
    if kind is dict and len(data) == 1:
        (tag, body), = data.items()
        if tag.startswith("$"):
            _within(f".{tag}", _check_tag, tag, body, depth + 1, refs, key)
            return
    if key:
        raise _Malformed(f"a {'list' if kind is list else 'dict'} where a key belongs (keys are hashable)")
    if kind is list:
        for i, v in enumerate(data):
            _within(f"[{i}]", _check, v, depth + 1, refs, False)
        return
    for k, v in data.items():
        if k.startswith("$"):
            raise _Malformed(f"the dict key {k!r} starts with '$' (such dicts are encoded as $dict)")
        _within(f"[{k!r}]", _check, v, depth + 1, refs, False)


def _within(location: str, check: Any, *args: Any) -> None:
    try:
        check(*args)
    except _Malformed as exc:
        exc.location.append(location)
        raise


def _check_tag(tag: str, body: Any, depth: int, refs: int | None, key: bool) -> None:
    if key and tag not in _HASHABLE_TAGS:
        raise _Malformed(f"{tag} where a key belongs (keys are hashable)")
    if tag in ("$tuple", "$set", "$frozenset"):
        for i, v in enumerate(_body(body, list)):
            _within(f"[{i}]", _check, v, depth, refs if tag == "$tuple" else None, key or tag != "$tuple")
    elif tag == "$dict":
        for i, pair in enumerate(_body(body, list)):
            if type(pair) is not list or len(pair) != 2:
                raise _Malformed(f"item {i} is not a [key, value] pair")
            _within(f"[{i}][0]", _check, pair[0], depth, None, True)
            _within(f"[{i}][1]", _check, pair[1], depth, refs, False)
    elif tag == "$float":
        if not non_finite(body):
            raise _Malformed(f"{_clip(body)} is not one of {sorted(NON_FINITE)}")
    elif tag in ("$bytes", "$pickle"):
        _base64(_body(body, str))
    elif tag == "$dtype":
        if dtype_itemsize(_body(body, str)) is None and torch_dtype(body) is None:  # torch only for an alias
            raise _Malformed(f"{_clip(body)} is not a torch dtype")
    elif tag == "$device":
        try:
            import torch  # here: listing checks metadata, and needs torch for nothing else

            torch.device(_body(body, str))
        except (RuntimeError, ValueError) as exc:
            raise _Malformed(f"{_clip(body)} is not a device: {exc}") from None
    elif tag == "$complex":
        parts = _body(body, list)
        if len(parts) != 2 or not all(type(p) is float or (type(p) is dict and len(p) == 1 and
                                                            non_finite(p.get("$float"))) for p in parts):
            raise _Malformed("not [real, imag] floats")  # what a complex holds: an int part could overflow
    elif tag == "$size":
        if not all(type(n) is int and -MAX_INT - 1 <= n <= MAX_INT for n in _body(body, list)):
            raise _Malformed("not a list of 64-bit ints (what a torch.Size holds)")
    elif tag == "$ndarray":
        parts = _body(body, list)
        if len(parts) != 3 or type(parts[0]) is not str or type(parts[1]) is not list or type(parts[2]) is not str:
            raise _Malformed("not [dtype, shape, base64]")
        itemsize = _np_itemsize(parts[0], "biufcmM")
        try:
            check_shape({"shape": parts[1]}, itemsize or 1)
        except FieldError as exc:
            raise _Malformed(f"the shape {exc.why}") from None
        _base64(parts[2], None if itemsize is None else math.prod(parts[1]) * itemsize)
    elif tag == "$npscalar":
        parts = _body(body, list)
        if len(parts) != 2 or type(parts[0]) is not str or type(parts[1]) is not str:
            raise _Malformed("not [dtype, base64]")
        _base64(parts[1], _np_itemsize(parts[0], "biufc"))
    elif tag == "$ref":
        if refs is None:
            raise _Malformed("an entry reference outside the tree")
        if type(body) is not int or not 0 <= body < refs:
            raise _Malformed(f"{body!r} is not the index of an entry (there are {refs})")
    else:
        raise _Malformed(f"unknown tag {tag!r}")


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _base64(text: str, nbytes: int | None = None) -> None:
    """Check that ``text`` is standard base64 (of ``nbytes`` bytes, when given), without decoding it."""
    if len(text) % 4 or not _BASE64.fullmatch(text) or nbytes is not None and len(text) != -(-nbytes // 3) * 4:
        raise _Malformed(f"{_clip(text)} is not the base64 of {'some' if nbytes is None else nbytes} bytes")


def _np_itemsize(name: str, kinds: str) -> int | None:
    """The item size of the numpy dtype ``name`` of one of ``kinds``; None without numpy (decoding
    the value then says numpy is needed)."""
    if numpy_module() is None:
        return None
    try:
        return numpy_dtype(name, kinds).itemsize
    except (TypeError, ValueError) as exc:
        raise _Malformed(str(exc)) from None


def _body(body: Any, kind: type) -> Any:
    if type(body) is not kind:
        raise _Malformed(f"the body {_clip(body)} is not a {kind.__name__}")
    return body


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"
