"""Box arithmetic of read planning: the boxes that tile a flat element range of a tensor."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from zerostall.format.boxes import contiguous_strides, flat_boxes


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
