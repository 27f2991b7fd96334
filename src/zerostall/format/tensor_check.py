"""A tensor entry's layout: its dtype and shape, and chunks that lie inside the tensor and inside
the data files the manifest lists (starting at a multiple of the element size), hold ``nbytes`` =
elements × item size with one checksum per block, and tile the tensor exactly (each element in
exactly one chunk) and their data files (back to back, to the end). Part of the manifest's schema
(:mod:`zerostall.format.manifest_check`), with the helpers that name a field the format does not allow.
No torch here: the command line checks manifests without it.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from operator import add, le
from typing import Any

from .layout import CHUNK_FIELDS, chunk_items

MAX_NDIM = 64  # dimensions of a tensor
MAX_INT = (1 << 63) - 1  # sizes, offsets and dimensions fit the signed 64-bit integers of torch and the OS

HEX16 = re.compile(r"[0-9a-f]{16}")  # an xxh3-64 checksum
_INT = {int}


class FieldError(Exception):
    """A field that the format does not allow: where it is, and why."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an int", float: "a number", type(None): "null"}


def field(d: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str | None = None) -> Any:
    """``d[name]``, which must be present with exactly the type ``kind`` (``object``: any); errors
    name it ``where`` (default: ``name``)."""
    if name not in d:
        raise FieldError(where or name, "missing")
    value, kinds = d[name], kind if isinstance(kind, tuple) else (kind,)
    if kind is not object and type(value) not in kinds:
        raise FieldError(where or name, f"{clip(value)} is not " + " or ".join(_NAMES[k] for k in kinds))
    return value


def int_field(value: Any, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``value``, which must be an int in ``[lo, hi]`` (errors name it ``where``)."""
    if type(value) is not int or not lo <= value <= hi:
        raise FieldError(where, f"{clip(value)} is not an int in [{lo}, {hi}]")
    return value


def clip(value: Any) -> str:
    """``repr(value)``, cut short for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


# The torch dtypes by their canonical names (``float32``, not the alias ``float``), with their item
# sizes: known without importing torch (the command line never does). Quantized dtypes are never saved.
ITEMSIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
}


def dtype_itemsize(name: Any) -> int | None:
    """The item size of the dtype a tensor entry names, or None when torch has no such dtype. A
    dtype newer than this table is looked up in torch itself (imported then, and only then)."""
    if type(name) is not str:
        return None
    size = ITEMSIZES.get(name)
    return size if size is not None else _newer_itemsize(name)


@functools.cache
def _newer_itemsize(name: str) -> int | None:
    import torch

    dtype = vars(torch).get(name)
    if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{name}" or name.startswith("q"):
        return None
    return dtype.itemsize


def check_shape(e: dict[str, Any], itemsize: int) -> list[int]:
    """The ``shape`` of entry ``e``: at most :data:`MAX_NDIM` ints ≥ 0 whose strides (elements of
    ``itemsize`` bytes, an empty tensor's too) fit in :data:`MAX_INT` bytes."""
    shape = e.get("shape")
    if type(shape) is not list or not set(map(type, shape)) <= _INT or len(shape) > MAX_NDIM \
            or shape and (min(shape) < 0 or max(shape) > MAX_INT):
        field(e, "shape", list)
        if len(shape) > MAX_NDIM:
            raise FieldError("shape", f"{len(shape)} dimensions, more than {MAX_NDIM}")
        for n in shape:
            int_field(n, "shape")
    if (math.prod(shape) or math.prod(n or 1 for n in shape)) * itemsize > MAX_INT:
        raise FieldError("shape", f"{shape} spans more than {MAX_INT} bytes")
    return shape


def check_tensor(d: dict[str, Any], e: dict[str, Any], numbers: list[Any], digests: list[Any],
                 spans: dict[str, list[tuple[int, int]]], names: list[str] | None) -> None:
    """Check the tensor entry ``e`` of the manifest body ``d`` (whose head is checked). The
    chunks' ints are added to ``numbers`` and their checksums to ``digests``: the caller checks
    their types in bulk, once, and calls :func:`explain_chunk` only if one is wrong; the byte
    spans of its non-empty chunks are added to ``spans``, for :func:`check_packed`. ``names``:
    the data files in order, which chunks index (format version 4 on); None: chunks are objects."""
    dtype = e.get("dtype")
    itemsize = dtype_itemsize(dtype)
    if itemsize is None:
        raise FieldError("dtype", f"{clip(dtype)} is not a torch dtype")
    shape = check_shape(e, itemsize)
    numel = math.prod(shape)
    files, block, ndim = d["files"], d["block_size"], len(shape)
    covered = 0
    boxes = []
    whole = [0] * ndim
    chunks = e.get("chunks")
    if type(chunks) is not list:
        field(e, "chunks", list)
    for j, c in enumerate(chunks):
        # the common case at full speed (the types of the ints and checksums are checked in bulk,
        # by the caller); explain_chunk names what is wrong with any other chunk
        try:
            offsets, sizes, file, offset, nbytes, checksums = chunk_items(c, names)
            elements = math.prod(sizes)
            good = (type(offsets) is list and type(sizes) is list and type(checksums) is list
                    and len(offsets) == ndim == len(sizes)
                    and (offsets == whole and sizes == shape
                         or min(offsets) >= 0 and min(sizes) >= 0 and all(map(le, map(add, offsets, sizes), shape)))
                    and nbytes == elements * itemsize and 0 <= offset and offset + nbytes <= files[file]
                    and offset % itemsize == 0
                    and len(checksums) == (-(-nbytes // block) or 1))
        except (TypeError, KeyError, IndexError, ValueError):
            good = False
        if not good:
            explain_chunk(j, c, shape, dtype, itemsize, files, block, names)
        numbers += offsets
        numbers += sizes
        numbers.append(offset)
        numbers.append(nbytes)
        digests += checksums
        covered += elements
        if elements:
            boxes.append((offsets, sizes))
            spans[file].append((offset, offset + nbytes))
    if not tiled(boxes, covered, shape):
        raise FieldError("chunks", f"the chunks do not tile the shape {shape} exactly (each element in exactly "
                                   f"one chunk): they hold {covered} of its {numel} elements"
                                   + (" with overlaps" if covered == numel else ""))


def explain_chunk(j: int, c: Any, shape: list[int], dtype: str, itemsize: int, files: dict[str, int], block: int,
                  names: list[str] | None, always: bool = True) -> None:
    """Raise :class:`FieldError` naming what is wrong with chunk ``j``, ``c`` (if nothing is and not
    ``always``, return). ``names``: as :func:`check_tensor` takes them."""
    at = f"chunks[{j}]"
    if names is not None:
        if type(c) is not list or len(c) != len(CHUNK_FIELDS):
            raise FieldError(at, f"{clip(c)} is not an array [{', '.join(CHUNK_FIELDS)}]")
        index = c[2]
        if type(index) is not int or not 0 <= index < len(names):
            raise FieldError(f"{at}.file", f"{clip(index)} is not the index of a file (files lists {len(names)})")
        c = dict(zip(CHUNK_FIELDS, c))
        c["file"] = names[index]
    if type(c) is not dict:
        raise FieldError(at, f"{clip(c)} is not an object")
    offsets = field(c, "offsets", list, f"{at}.offsets")
    sizes = field(c, "sizes", list, f"{at}.sizes")
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise FieldError(at, f"offsets {clip(offsets)} and sizes {clip(sizes)} do not have the {len(shape)} "
                       f"dimensions of the shape {shape}")
    for o, s, n in zip(offsets, sizes, shape):
        if type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > n:
            raise FieldError(at, f"the box at {clip(offsets)} of sizes {clip(sizes)} is not inside the shape {shape}")
    elements = math.prod(sizes)
    file = field(c, "file", str, f"{at}.file")
    if file not in files:
        raise FieldError(f"{at}.file", f"{clip(file)} is not a file of the checkpoint (a key of files)")
    offset = int_field(field(c, "offset", int, f"{at}.offset"), f"{at}.offset")
    nbytes = field(c, "nbytes", int, f"{at}.nbytes")
    if nbytes != elements * itemsize:
        raise FieldError(f"{at}.nbytes", f"{nbytes}, but {elements} elements of {dtype} take {elements * itemsize}")
    if offset % itemsize:
        raise FieldError(f"{at}.offset", f"{offset} is not a multiple of the {itemsize}-byte elements of {dtype}")
    if offset + nbytes > files[file]:
        raise FieldError(at, f"bytes {offset}-{offset + nbytes} lie past the end of {file} ({files[file]} bytes)")
    checksums = field(c, "checksums", list, f"{at}.checksums")
    if len(checksums) != max(1, -(-nbytes // block)):
        raise FieldError(f"{at}.checksums", f"{len(checksums)} checksums for the {max(1, -(-nbytes // block))} "
                                      f"block(s) of {nbytes} bytes")
    for digest in checksums:
        if type(digest) is not str or not HEX16.fullmatch(digest):
            raise FieldError(f"{at}.checksums", f"{clip(digest)} is not an xxh3-64 checksum (16 hex digits)")
    if always:
        raise FieldError(at, "malformed")


def tiled(boxes: list[tuple[list[int], list[int]]], covered: int, shape: list[int]) -> bool:
    """Whether the non-empty ``boxes`` (offsets, sizes), each inside ``shape`` and holding
    ``covered`` elements together, tile it exactly: each element in exactly one of them."""
    return covered == math.prod(shape) and (len(boxes) < 2 or _disjoint(boxes, shape))


def _disjoint(boxes: list[tuple[list[int], list[int]]], shape: list[int]) -> bool:
    """Whether no two of the (non-empty) boxes overlap, given that each lies inside ``shape`` and
    their elements add up to its (so disjoint boxes tile it). A sharded tensor's boxes split one
    dimension (checked by sorting) or form a grid (each dimension cut at the same places across
    the others: checked in linear time); any other layout is checked by its corners
    (:func:`_tiles`), in time linear in the boxes too, so no layout makes a manifest slow to check."""
    first_offsets, first_sizes = boxes[0]
    split = [k for k in range(len(first_offsets))
             if any(o[k] != first_offsets[k] or s[k] != first_sizes[k] for o, s in boxes)]
    if not split:
        return False  # the same box twice
    if len(split) == 1:
        k = split[0]
        spans = sorted((o[k], o[k] + s[k]) for o, s in boxes)
        return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    cuts = [sorted({o[k] for o, _ in boxes} | {o[k] + s[k] for o, s in boxes}) for k in split]
    if math.prod(len(c) - 1 for c in cuts) == len(boxes):  # as many boxes as grid cells: a grid?
        index = [{x: n for n, x in enumerate(c)} for c in cuts]
        cells = {tuple([at[o[k]] for at, k in zip(index, split)]) for o, _ in boxes}
        if len(cells) == len(boxes) and all(at[o[k] + s[k]] == at[o[k]] + 1
                                            for o, s in boxes for at, k in zip(index, split)):
            return True
    return _tiles(boxes, split, shape)


_CORNER_DIMS = 12
"""The most dimensions a tensor's chunks may split it along in a layout that is no grid (each box
has 2**dims corners to count)."""


def _tiles(boxes: list[tuple[list[int], list[int]]], split: list[int], shape: list[int]) -> bool:
    """Whether the boxes tile ``shape`` exactly. Along the dimensions no box splits, every box must
    span the whole tensor; along the others, the sum of the boxes' indicator functions is written
    as a signed sum of orthants, one at each corner of each box (+ for an even number of upper
    bounds, - for odd). That sum is unique, so the boxes tile the tensor exactly when the signs
    cancel at every point but the tensor's own corners."""
    if any(o[k] != 0 or s[k] != shape[k] for o, s in boxes[:1] for k in range(len(shape)) if k not in split):
        return False
    if len(split) > _CORNER_DIMS:
        raise FieldError("chunks", f"the chunks split the tensor along {len(split)} dimensions in a layout that is no "
                                   f"grid; more than {_CORNER_DIMS} cannot be checked")
    signs: dict[tuple[int, ...], int] = {}
    for o, s in boxes:
        for upper in itertools.product((False, True), repeat=len(split)):
            corner = tuple(o[k] + s[k] if up else o[k] for k, up in zip(split, upper))
            signs[corner] = signs.get(corner, 0) + (-1) ** sum(upper)
    for upper in itertools.product((False, True), repeat=len(split)):
        corner = tuple(shape[k] if up else 0 for k, up in zip(split, upper))
        signs[corner] = signs.get(corner, 0) - (-1) ** sum(upper)
    return not any(signs.values())


def check_packed(spans: dict[str, list[tuple[int, int]]], files: dict[str, int], loose: Any = ()) -> None:
    """The chunks of each data file (``spans``: their first byte and end, by file) lie back to
    back up to its end, with no gap and no overlap (format.md §3): every byte after a file's header
    belongs to exactly one chunk, so none is left unchecked and none is read as two tensors. In a
    file of ``loose`` (another checkpoint's, of which this one uses some chunks) they may leave gaps."""
    for name, spans_of in spans.items():
        if not spans_of:
            continue
        spans_of.sort()
        end = spans_of[0][0]
        for start, stop in spans_of:
            if start > end and name in loose:
                end = start
            if start != end:
                raise FieldError(f"files[{name!r}]", f"bytes {min(start, end)}-{max(start, end)} are "
                                                     + ("in two chunks" if start < end else "in no chunk"))
            end = stop
        if end != files[name] and name not in loose:
            raise FieldError(f"files[{name!r}]", f"its chunks end at byte {end}, the file at {files[name]}")
