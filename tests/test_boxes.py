"""Box arithmetic of read planning: the boxes that tile a flat element range of a tensor, and the
index that finds the chunks overlapping a target box."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from zerostall.format.boxes import BoxIndex, contiguous_strides, flat_boxes, intersect


def flat_indices(box, sizes) -> list[int]:
    strides = contiguous_strides(sizes)
    return [sum(i * s for i, s in zip(index, strides))
            for index in itertools.product(*[range(o, o + n) for o, n in zip(*box)])]


@st.composite
def ranges(draw):
    sizes = tuple(draw(st.lists(st.integers(1, 5), max_size=4)))
    n = math.prod(sizes)
    first = draw(st.integers(0, n))
    return sizes, first, draw(st.integers(first, n))


@given(ranges())
def test_flat_boxes_tile_the_range_in_order(case):
    sizes, first, end = case
    boxes = flat_boxes(sizes, first, end)
    assert [i for box in boxes for i in flat_indices(box, sizes)] == list(range(first, end))
    assert len(boxes) <= max(1, 2 * len(sizes) - 1)


def test_flat_boxes_of_whole_rows_is_one_box():
    assert flat_boxes((4, 3, 2), 6, 18) == [((1, 0, 0), (2, 3, 2))]
    assert flat_boxes((), 0, 1) == [((), ())]


def cuts(draw, length: int) -> list[int]:
    """The starts of the pieces a dimension of ``length`` is cut into (some empty, as DTensor leaves them)."""
    inner = sorted(draw(st.lists(st.integers(0, length), max_size=6)))
    return [0, *inner]


@st.composite
def tilings(draw):
    """A shape, disjoint boxes tiling it (a grid, or each row of a grid cut again along another dimension:
    not a grid), and a query box inside the shape."""
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    grid = [cuts(draw, n) for n in shape]
    boxes = []
    for cell in itertools.product(*[list(zip(c, [*c[1:], n])) for c, n in zip(grid, shape)]):
        offsets, sizes = tuple(a for a, _ in cell), tuple(b - a for a, b in cell)
        if len(shape) > 1 and draw(st.booleans()):  # cut this cell again along the last dimension
            last = cuts(draw, sizes[-1])
            for a, b in zip(last, [*last[1:], sizes[-1]]):
                boxes.append(((*offsets[:-1], offsets[-1] + a), (*sizes[:-1], b - a)))
        else:
            boxes.append((offsets, sizes))
    lo = tuple(draw(st.integers(0, n)) for n in shape)
    query = (lo, tuple(draw(st.integers(0, n - o)) for o, n in zip(lo, shape)))
    return boxes, query


@given(tilings())
def test_the_box_index_finds_every_chunk_a_box_overlaps(case):
    boxes, query = case
    found = set(BoxIndex(boxes).overlapping(query))
    assert {i for i, b in enumerate(boxes) if intersect(b, query) is not None} <= found


def test_the_box_index_looks_at_few_chunks_of_a_regular_layout():
    rows = BoxIndex([((r * 4, 0), (4, 64)) for r in range(1000)])  # FSDP: 1,000 shards of 4 rows
    assert rows.overlapping(((10, 0), (8, 64))) == [2, 3, 4]
    grid = BoxIndex([((r * 4, c * 8), (4, 8)) for r in range(500) for c in range(8)])  # FSDP x TP
    assert len(grid.overlapping(((100, 0), (4, 64)))) <= 3 * 8
