"""A tagged, non-executing JSON encoding of python values.

It keeps what JSON loses (tuple vs list, non-string keys, NaN/Inf, bytes, sets, complex numbers,
numpy arrays and scalars, torch dtypes, sizes and devices). A tag is a one-key object whose key
starts with "$". Anything else is refused with an error naming the key, unless the caller opts in
to pickle, on save and on load alike.
"""

from __future__ import annotations

import base64
import functools
import math
import pickle
from typing import Any

from .errors import UnsupportedValueError


def _torch() -> Any:
    """torch, imported on first use: decoding plain values (the command line) needs none."""
    import torch

    return torch


@functools.cache
def _numpy() -> Any:
    """numpy, imported on first use; None without it (numpy is optional: numpy values then cannot occur)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


_PICKLE_HINT = "not a tensor or a plain python value; pass allow_pickle=True to store it with pickle"


def encode(value: Any, *, where: str = "", allow_pickle: bool = False, hint: str = _PICKLE_HINT) -> Any:
    """Encode ``value`` into JSON-compatible data; ``where`` names the key in errors, ``hint``
    says what to do about a value that cannot be encoded."""
    try:
        return _encode(value, allow_pickle)
    except _Refused as exc:
        at = where + "".join(reversed(exc.location))
        raise UnsupportedValueError(
            f"cannot save {type(exc.value).__module__}.{type(exc.value).__qualname__} at {at or '<root>'}: {hint}"
        ) from None
    except RecursionError:
        raise UnsupportedValueError(f"cannot save the value at {where or '<root>'}: it nests too deeply") from None


class _Refused(Exception):
    """A value the codec cannot encode; containers add their key to ``location`` as it unwinds, so
    the success path builds no location strings."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.location: list[str] = []


def _encode(value: Any, allow_pickle: bool) -> Any:
    kind = type(value)
    if value is None or kind in (bool, str, int):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if kind is list or kind is tuple:
        items = []
        for i, v in enumerate(value):
            try:
                items.append(_encode(v, allow_pickle))
            except _Refused as exc:
                exc.location.append(f"[{i}]")
                raise
        return items if kind is list else {"$tuple": items}
    if isinstance(value, dict) and kind.__module__ in ("builtins", "collections"):
        pairs = []
        for k, v in value.items():
            try:
                pairs.append((_encode(k, allow_pickle), _encode(v, allow_pickle)))
            except _Refused as exc:
                exc.location.append(f".{k}")
                raise
        if all(type(k) is str and not k.startswith("$") for k in value):
            return dict(pairs)
        return {"$dict": [list(p) for p in pairs]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": _b64(bytes(value))}
    if kind is complex:
        return {"$complex": [_encode(value.real, False), _encode(value.imag, False)]}
    if isinstance(value, (set, frozenset)):
        tag = "$set" if isinstance(value, set) else "$frozenset"
        return {tag: [_encode(v, allow_pickle) for v in value]}
    if kind is Ref:
        return {"$ref": value.index}
    torch = _torch()
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    np = _numpy()
    if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufcmM":
        arr = np.ascontiguousarray(value)
        return {"$ndarray": [arr.dtype.str, list(arr.shape), _b64(arr.tobytes())]}
    if np is not None and isinstance(value, np.generic) and value.dtype.kind in "biufc":
        return {"$npscalar": [value.dtype.str, _b64(value.tobytes())]}
    if allow_pickle:
        return {"$pickle": _b64(pickle.dumps(value))}
    raise _Refused(value)


def decode(data: Any, *, where: str = "", allow_pickle: bool = False) -> Any:
    """Decode what :func:`encode` produced; pickled values need ``allow_pickle=True``."""
    if isinstance(data, list):
        return [decode(v, where=where, allow_pickle=allow_pickle) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, body), = data.items()
        if tag.startswith("$"):
            return _decode_tag(tag, body, where, allow_pickle)
    return {k: decode(v, where=f"{where}.{k}", allow_pickle=allow_pickle) for k, v in data.items()}


def _decode_tag(tag: str, body: Any, where: str, allow_pickle: bool) -> Any:
    sub = lambda v: decode(v, where=where, allow_pickle=allow_pickle)  # noqa: E731
    if tag == "$ref":
        return Ref(body)
    if tag == "$tuple":
        return tuple(sub(v) for v in body)
    if tag == "$dict":
        return {sub(k): sub(v) for k, v in body}
    if tag == "$float":
        return float(body)
    if tag == "$bytes":
        return _unb64(body)
    if tag == "$complex":
        return complex(sub(body[0]), sub(body[1]))
    if tag == "$set":
        return {sub(v) for v in body}
    if tag == "$frozenset":
        return frozenset(sub(v) for v in body)
    if tag == "$dtype":
        return getattr(_torch(), body)
    if tag == "$size":
        return _torch().Size(body)
    if tag == "$device":
        return _torch().device(body)
    if tag == "$ndarray":
        np = _numpy()
        if np is None:
            raise UnsupportedValueError(f"numpy is needed to restore the array at {where}")
        dtype, shape, raw = body
        return np.frombuffer(_unb64(raw), dtype=np.dtype(dtype)).reshape(shape).copy()
    if tag == "$npscalar":
        np = _numpy()
        if np is None:
            raise UnsupportedValueError(f"numpy is needed to restore the scalar at {where}")
        dtype, raw = body
        return np.frombuffer(_unb64(raw), dtype=np.dtype(dtype))[0]
    if tag == "$pickle":
        if not allow_pickle:
            raise UnsupportedValueError(
                f"the value at {where or '<root>'} was saved with pickle; loading it could run code, "
                "pass allow_pickle=True only if you trust this checkpoint"
            )
        return pickle.loads(_unb64(body))
    raise UnsupportedValueError(f"unknown tag {tag!r} at {where or '<root>'}")



class Ref:
    """A placeholder for a leaf stored as a manifest entry, used in the saved state's skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Ref({self.index})"


def encode_path(path: tuple[Any, ...]) -> list[Any]:
    """A key path as JSON: string keys as they are, other keys (ints, tuples...) in the tagged encoding."""
    return [k if type(k) is str else encode(k) for k in path]


def decode_path(data: list[Any]) -> tuple[Any, ...]:
    """The key path that :func:`encode_path` encoded."""
    return tuple([k if type(k) is str else decode(k) for k in data])
