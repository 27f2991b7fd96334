"""A tagged, non-executing JSON encoding of python values.

It keeps what JSON loses (tuple vs list, non-string keys, NaN/Inf, bytes, sets, complex numbers,
numpy arrays and scalars, torch dtypes, sizes and devices). A tag is a one-key object whose key
starts with "$". Anything else is refused with an error naming the key, unless the caller opts in
to pickle, on save and on load alike. Values nest at most :data:`MAX_DEPTH` containers deep, on
save and on load; what a checkpoint holds is checked (:mod:`zerostall.format.value_check`) before it is
decoded, and a malformed value is a :class:`~zerostall.errors.CorruptCheckpointError`, never
another exception.
"""

from __future__ import annotations

import base64
import functools
import math
import pickle
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError

MAX_DEPTH = 100  # containers (lists, tuples, dicts, sets) nested in one value: deeper is refused on save and on load
MAX_INT_BITS = 14_000  # an int's size: longer ones (some 4200 digits) are refused on save, as JSON readers do


def _torch() -> Any:
    """torch, imported on first use: decoding plain values (the command line) needs none."""
    import torch

    return torch


@functools.cache
def numpy_module() -> Any:
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
        return _encode(value, allow_pickle, 0)
    except _Refused as exc:
        at = (where + "".join(reversed(exc.location))).removeprefix("" if where else ".")
        if exc.value is _TOO_DEEP:
            raise UnsupportedValueError(f"cannot save the value at {at or '<root>'}: it nests more than {MAX_DEPTH} "
                                        "containers deep (the most a checkpoint may hold)") from None
        if exc.value is _TOO_LONG:
            raise UnsupportedValueError(f"cannot save the int at {at or '<root>'}: it has more than {MAX_INT_BITS} "
                                        "bits, more digits than JSON readers accept (sys.get_int_max_str_digits); "
                                        "store it as bytes (n.to_bytes) or a string") from None
        raise UnsupportedValueError(
            f"cannot save {type(exc.value).__module__}.{type(exc.value).__qualname__} at {at or '<root>'}: "
            f"{exc.why or hint}") from None


class _Refused(Exception):
    """A value the codec cannot encode; containers add their key to ``location`` as it unwinds, so
    the success path builds no location strings."""

    def __init__(self, value: Any, why: str | None = None) -> None:
        self.value = value
        self.why = why  # said instead of the hint (what to do), when there is nothing left to do
        self.location: list[str] = []


_TOO_DEEP = object()  # the value of a _Refused raised by nesting deeper than MAX_DEPTH
_TOO_LONG = object()  # the value of a _Refused raised by an int of more than MAX_INT_BITS


def _encode(value: Any, allow_pickle: bool, depth: int) -> Any:
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        if value.bit_length() > MAX_INT_BITS:
            raise _Refused(_TOO_LONG)
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if depth >= MAX_DEPTH and (kind in (list, tuple) or isinstance(value, (dict, set, frozenset))):
        raise _Refused(_TOO_DEEP)
    depth += 1
    if kind is list or kind is tuple:
        items = []
        for i, v in enumerate(value):
            try:
                items.append(_encode(v, allow_pickle, depth))
            except _Refused as exc:
                exc.location.append(f"[{i}]")
                raise
        return items if kind is list else {"$tuple": items}
    if isinstance(value, dict) and kind.__module__ in ("builtins", "collections"):
        pairs = []
        for k, v in value.items():
            try:
                pairs.append((_encode(k, allow_pickle, depth), _encode(v, allow_pickle, depth)))
            except _Refused as exc:
                exc.location.append(f".{k}")
                raise
        if all(type(k) is str and not k.startswith("$") for k in value):
            return dict(pairs)
        return {"$dict": [list(p) for p in pairs]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": _b64(bytes(value))}
    if kind is complex:
        return {"$complex": [_encode(value.real, False, depth), _encode(value.imag, False, depth)]}
    if isinstance(value, (set, frozenset)):
        tag = "$set" if isinstance(value, set) else "$frozenset"
        return {tag: [_encode(v, allow_pickle, depth) for v in value]}
    if kind is Ref:
        return {"$ref": value.index}
    torch = _torch()
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    np = numpy_module()
    if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufcmM":
        arr = np.ascontiguousarray(value)
        return {"$ndarray": [arr.dtype.str, list(arr.shape), _b64(arr.tobytes())]}
    if np is not None and isinstance(value, np.generic) and value.dtype.kind in "biufc":
        return {"$npscalar": [value.dtype.str, _b64(value.tobytes())]}
    if allow_pickle:
        try:
            return {"$pickle": _b64(pickle.dumps(value))}
        except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError...
            raise _Refused(value, f"pickle cannot store it ({type(exc).__name__}: {exc})") from None
    raise _Refused(value)


def decode(data: Any, *, where: str = "", allow_pickle: bool = False) -> Any:
    """Decode what :func:`encode` produced; pickled values need ``allow_pickle=True``. Data that no
    encoding produces raises :class:`CorruptCheckpointError` naming ``where``."""
    try:
        return _decode(data, where, allow_pickle, 0)
    except CheckpointError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, RuntimeError, OverflowError,
            RecursionError, MemoryError) as exc:
        raise CorruptCheckpointError(f"the value at {where or '<root>'} is malformed: {exc!r}") from None


def _decode(data: Any, where: str, allow_pickle: bool, depth: int) -> Any:
    if isinstance(data, list):
        _enter(depth, where)
        return [_decode(v, where, allow_pickle, depth + 1) for v in data]
    if not isinstance(data, dict):
        return data
    _enter(depth, where)
    if len(data) == 1:
        (tag, body), = data.items()
        if tag.startswith("$"):
            return _decode_tag(tag, body, where, allow_pickle, depth + 1)
    return {k: _decode(v, f"{where}.{k}", allow_pickle, depth + 1) for k, v in data.items()}


def _enter(depth: int, where: str) -> None:
    if depth >= MAX_DEPTH:
        raise CorruptCheckpointError(f"the value at {where or '<root>'} nests more than {MAX_DEPTH} containers deep")


def _decode_tag(tag: str, body: Any, where: str, allow_pickle: bool, depth: int) -> Any:
    sub = lambda v: _decode(v, where, allow_pickle, depth)  # noqa: E731
    if tag == "$ref":
        if type(body) is not int:
            raise ValueError(f"$ref body {body!r} is not an entry index")
        return Ref(body)
    if tag == "$tuple":
        return tuple([sub(v) for v in _list(body)])
    if tag == "$dict":
        return {sub(k): sub(v) for k, v in _list(body)}
    if tag == "$float":
        if not non_finite(body):
            raise ValueError(f"$float body {body!r} is not one of {sorted(NON_FINITE)}")
        return float(body)
    if tag == "$bytes":
        return _unb64(body)
    if tag == "$complex":
        real, imag = _list(body)
        return complex(_number(sub(real)), _number(sub(imag)))
    if tag == "$set":
        return {sub(v) for v in _list(body)}
    if tag == "$frozenset":
        return frozenset([sub(v) for v in _list(body)])
    if tag == "$dtype":
        dtype = torch_dtype(body)
        if dtype is None:
            raise ValueError(f"{body!r} is not a torch dtype")
        return dtype
    if tag == "$size":
        return _torch().Size(_list(body))
    if tag == "$device":
        if type(body) is not str:
            raise ValueError(f"$device body {body!r} is not a string")
        return _torch().device(body)
    if tag == "$ndarray":
        np = numpy_module()
        if np is None:
            raise UnsupportedValueError(f"numpy is needed to restore the array at {where}")
        dtype, shape, raw = _list(body)
        return np.frombuffer(_unb64(raw), dtype=numpy_dtype(dtype, "biufcmM")).reshape(_list(shape)).copy()
    if tag == "$npscalar":
        np = numpy_module()
        if np is None:
            raise UnsupportedValueError(f"numpy is needed to restore the scalar at {where}")
        dtype, raw = _list(body)
        data = _unb64(raw)
        dt = numpy_dtype(dtype, "biufc")
        if len(data) != dt.itemsize:
            raise ValueError(f"{len(data)} bytes for a numpy scalar of {dt.itemsize}")
        return np.frombuffer(data, dtype=dt)[0]
    if tag == "$pickle":
        if not allow_pickle:
            raise UnsupportedValueError(
                f"the value at {where or '<root>'} was saved with pickle; loading it could run code, "
                "pass allow_pickle=True only if you trust this checkpoint"
            )
        try:
            return pickle.loads(_unb64(body))
        except Exception as exc:  # the caller opted in: whatever unpickling raised, named
            raise UnsupportedValueError(f"the pickled value at {where or '<root>'} could not be restored: "
                                        f"{exc!r}") from exc
    raise UnsupportedValueError(f"unknown tag {tag!r} at {where or '<root>'}")


NON_FINITE = frozenset({"nan", "inf", "-inf"})


def non_finite(body: Any) -> bool:
    """Whether ``body`` is the body of a ``$float`` tag."""
    return type(body) is str and body in NON_FINITE


def _list(body: Any) -> list[Any]:
    if type(body) is not list:
        raise TypeError(f"a tag's body {body!r} is not a list")
    return body


def _number(value: Any) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"{value!r} is not a number")
    return value


def torch_dtype(name: Any) -> Any:
    """The torch dtype called ``name`` (``float32``, or an alias such as ``float``), else None:
    only what torch itself defines is looked at (``getattr`` would import submodules by name)."""
    torch = _torch()
    dtype = vars(torch).get(name) if type(name) is str else None
    return dtype if isinstance(dtype, torch.dtype) else None


def numpy_dtype(name: Any, kinds: str) -> Any:
    """The numpy dtype ``name`` (a plain one, of one of ``kinds``) that a ``$ndarray`` or ``$npscalar``
    may hold; numpy must be there."""
    if type(name) is not str:
        raise TypeError(f"numpy dtype {name!r} is not a string")
    dtype = numpy_module().dtype(name)
    if dtype.kind not in kinds or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"numpy dtype {name!r} is not one zerostall stores")
    return dtype


class Ref:
    """A placeholder for a leaf stored as a manifest entry, used in the saved state's skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Ref({self.index})"


def encode_path(path: tuple[Any, ...]) -> list[Any]:
    """A key path as JSON: string keys as they are, other keys (ints, tuples...) in the tagged encoding
    (which leaves an int of at most ``MAX_INT_BITS`` as it is: done here, without the call, for the
    many int keys of an optimizer's state)."""
    return [k if type(k) is str or type(k) is int and k.bit_length() <= MAX_INT_BITS else encode(k) for k in path]


def decode_path(data: list[Any]) -> tuple[Any, ...]:
    """The key path that :func:`encode_path` encoded (an int decodes to itself: done here, without the call)."""
    return tuple([k if type(k) is str or type(k) is int else decode(k) for k in data])
