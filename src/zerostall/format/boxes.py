"""Box geometry: a box is (offsets, sizes) of a region of a global tensor.

A saved chunk is a box; a load target (a DTensor shard, a whole tensor) is a box; resharding is
box intersection, and copying part of a stored chunk is a walk over the row-major regions that a
byte range of it covers.
"""

from __future__ import annotations

import bisect
import functools
import json
from typing import Any, Sequence

import torch
import xxhash
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import UnsupportedValueError

Box = tuple[tuple[int, ...], tuple[int, ...]]
Grid = tuple[int, int, int, int, int]  # a layout's id, copies of a box, this rank's position among them, mesh ranks, box


def local_box(value: torch.Tensor, name: str = "") -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of a tensor and its box (offsets, sizes) in the global tensor (``name``:
    its key, for errors).

    For a DTensor the box comes from DTensor itself, which also handles the strided shards that
    FSDP2 + TP produce; a rank outside its mesh holds an empty box; a plain tensor is its own whole box.
    """
    if type(value) is not torch.Tensor and isinstance(value, DTensor):
        if any(p.is_partial() for p in value.placements):
            raise UnsupportedValueError(f"{name or 'a DTensor'}: DTensors with Partial placements must be reduced "
                                        "before saving")
        if not _one_box(value.device_mesh, tuple(value.placements)):
            raise UnsupportedValueError(
                f"{name or 'a DTensor'}: its placements {list(value.placements)} give this rank rows that are not "
                "one block of the tensor (a strided shard with no shard of the same dimension to split it): "
                "redistribute it to Shard or Replicate placements first")
        offsets, sizes = _dtensor_box(value.shape, value.device_mesh, value.placements)
        with torch.no_grad():  # the local tensor itself, not an autograd view of it (which costs a graph node)
            piece = value.to_local()
        if piece.dim() != len(sizes):  # a rank outside the mesh: torch's piece has one dimension
            piece = piece.new_empty(sizes)
        return piece, offsets, sizes
    return value, (0,) * value.dim(), tuple(value.shape)


@functools.lru_cache(maxsize=1 << 16)
def _dtensor_box(shape: torch.Size, mesh: Any, placements: tuple[Any, ...]) -> Box:
    """This rank's box of a DTensor layout, cached: a sharded model and its optimizer state hold
    thousands of DTensors with a few distinct layouts."""
    if mesh.get_coordinate() is None:  # a rank outside the mesh: nothing (torch gives a box of no dimension), at
        return tuple(shape), (0,) * len(shape)  # the end, as torch places an empty shard: a box of its own
    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(offsets), tuple(sizes)


@functools.lru_cache(maxsize=1 << 10)
def _one_box(mesh: Any, placements: tuple[Any, ...]) -> bool:
    """Whether each rank's piece of this layout is one box: every strided shard of a dimension
    (FSDP2's, under tensor parallelism) is split by the shards of that dimension on the mesh
    dimensions after it, into exactly its ``split_factor`` parts."""
    for i, placement in enumerate(placements):
        factor = getattr(placement, "split_factor", None)  # a _StridedShard (no Shard in torch's eyes)
        if factor is None:
            continue
        after = 1
        for j in range(i + 1, len(placements)):
            if placements[j].is_shard(placement.dim) or getattr(placements[j], "dim", None) == placement.dim:
                after *= mesh.size(j)
        if after != factor:
            return False
    return True


def grid_of(value: torch.Tensor) -> Grid | None:
    """Where this rank's box of a DTensor sits in its layout, in terms every rank can reason with alone:
    the layout's id (its mesh's ranks and its placements: alike on every rank holding it), how many ranks
    hold this same box (those along its replicated mesh dimensions), this rank's position among them,
    the mesh's number of ranks, and the box's index among the layout's boxes (its coordinates along the
    other mesh dimensions). None for any other tensor, and on a rank outside the mesh."""
    if type(value) is torch.Tensor or not isinstance(value, DTensor):
        return None
    return _grid(value.device_mesh, tuple(value.placements))


@functools.lru_cache(maxsize=1 << 10)
def _grid(mesh: Any, placements: tuple[Any, ...]) -> Grid | None:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    copies, position, box = 1, 0, 0
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            copies, position = copies * mesh.size(dim), position * mesh.size(dim) + coordinate[dim]
        else:
            box = box * mesh.size(dim) + coordinate[dim]
    ident = xxhash.xxh3_64_intdigest(json.dumps([mesh.mesh.tolist(), [repr(p) for p in placements]]).encode())
    return ident, copies, position, mesh.size(), box


class BoxIndex:
    """Boxes (a tensor's chunks), found by the region they overlap without a look at each: sorted
    along the dimension where their starts differ most, a query takes those that start within one
    box length (the longest) before the region's start along it, up to its end, so a rank reading
    its part of a tensor cut into thousands of chunks looks at a few of them."""

    def __init__(self, boxes: Sequence[Box]) -> None:
        ndim = len(boxes[0][0]) if boxes else 0
        self.axis = max(range(ndim), key=lambda k: len({b[0][k] for b in boxes}), default=None)
        if self.axis is None:  # 0-d: any box overlaps every other
            self.order, self.starts, self.longest = list(range(len(boxes))), [0] * len(boxes), 0
            return
        self.order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][self.axis])
        self.starts = [boxes[i][0][self.axis] for i in self.order]
        self.longest = max(b[1][self.axis] for b in boxes)

    def overlapping(self, box: Box) -> list[int]:
        """The positions of the boxes that may overlap ``box`` (every one that does), in ascending order."""
        if self.axis is None:
            return self.order
        lo, hi = box[0][self.axis], box[0][self.axis] + box[1][self.axis]
        first = bisect.bisect_right(self.starts, lo - self.longest)  # a box starting there or before ends by lo
        return sorted(self.order[first:bisect.bisect_left(self.starts, max(hi, lo + 1))])


def whole(t: torch.Tensor) -> Box:
    """The box of a tensor that is a whole global tensor."""
    return (0,) * t.dim(), tuple(t.shape)


def region(inner: Box, box: Box) -> tuple[slice, ...]:
    """The slices of a tensor holding ``box`` that cover ``inner`` (a box inside it)."""
    return tuple(slice(o - b, o - b + s) for o, b, s in zip(inner[0], box[0], inner[1]))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes (offsets, sizes), or None when they do not overlap."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``sizes``, in elements."""
    strides = []
    acc = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def element_span(chunk: Box, inner: Box) -> tuple[int, int]:
    """First and one-past-last element index, within the row-major chunk, that ``inner`` touches."""
    strides = contiguous_strides(chunk[1])
    first = sum((io - co) * st for io, co, st in zip(inner[0], chunk[0], strides))
    last = sum((io + isz - 1 - co) * st for io, isz, co, st in zip(inner[0], inner[1], chunk[0], strides))
    return first, last + 1


def flat_boxes(sizes: Sequence[int], first: int, end: int) -> list[Box]:
    """Boxes (offsets, sizes) that tile the elements ``[first, end)`` of a row-major tensor of
    ``sizes``, in order: a partial row, whole rows, a partial row, each level alike (at most
    ``2 * ndim - 1`` boxes), so a byte range of stored data can be copied as strided regions."""
    if first >= end:
        return []
    if not sizes:
        return [((), ())]
    inner = 1
    for s in sizes[1:]:
        inner *= s
    row, col = divmod(first, inner)
    last_row, last_col = divmod(end, inner)
    if row == last_row:
        return [((row, *o), (1, *s)) for o, s in flat_boxes(sizes[1:], col, last_col)]
    boxes: list[Box] = []
    if col:
        boxes += [((row, *o), (1, *s)) for o, s in flat_boxes(sizes[1:], col, inner)]
        row += 1
    if last_row > row:
        boxes.append(((row, *[0] * (len(sizes) - 1)), (last_row - row, *sizes[1:])))
    if last_col:
        boxes += [((last_row, *o), (1, *s)) for o, s in flat_boxes(sizes[1:], 0, last_col)]
    return boxes
