import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from globalshard import Box, LayoutError, Region, Segment
from globalshard.geometry import BoxIndex, cover_problems, flat_range_boxes
from globalshard.testing.strategies import grid_boxes, shapes


def test_box_basics():
    b = Box((1, 2), (3, 4))
    assert b.stop == (4, 6)
    assert b.volume == 12
    assert b.ndim == 2
    assert b.slices == (slice(1, 4), slice(2, 6))
    assert b.contains(Box((2, 2), (2, 4)))
    assert not b.contains(Box((0, 2), (2, 2)))
    assert b.translate((-1, -2)) == Box((0, 0), (3, 4))
    assert str(b) == "[1:4, 2:6]"


def test_box_zero_size_and_zero_d():
    empty = Box((3,), (0,))
    assert empty.volume == 0 and empty.is_empty
    assert Box((0,), (5,)).intersect(empty) is None
    scalar = Box((), ())
    assert scalar.volume == 1 and not scalar.is_empty
    assert scalar.intersect(scalar) == scalar
    assert scalar.slices == ()


def test_box_normalises_numpy_ints_and_rejects_bad_values():
    b = Box(np.array([1, 2]), [np.int64(3), 4])
    assert b.offset == (1, 2) and type(b.offset[0]) is int
    bad = [((1.0,), (1,)), ((True,), (1,)), ((-1,), (1,)), ((0,), (-1,)), ((0, 0), (1,)), (("1",), (1,))]
    for offset, shape in bad:
        with pytest.raises(LayoutError):
            Box(offset, shape)
    with pytest.raises(LayoutError):
        Box((0,), (1,)).translate((-1,))


def test_box_is_frozen():
    b = Box((0,), (1,))
    with pytest.raises(AttributeError):
        b.offset = (1,)  # type: ignore[misc]


def test_region_and_segment_validation():
    with pytest.raises(LayoutError, match="differ in shape"):
        Region(Box((0,), (2,)), Box((0,), (3,)))
    with pytest.raises(LayoutError):
        Segment(0, -1, 2)
    r = Region(Box((2, 0), (2, 3)), Box((10, 5), (2, 3)))
    assert r.global_to_local(Box((11, 6), (1, 2))) == Box((3, 1), (1, 2))


def _brute_counts(bounds, boxes):
    counts = np.zeros(bounds.shape, np.int64)
    for b in boxes:
        counts[b.translate(tuple(-o for o in bounds.offset)).slices] += 1
    return counts


@st.composite
def box_sets(draw):
    shape = draw(shapes(max_side=6))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        offset = tuple(draw(st.integers(0, n)) for n in shape)
        size = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offset))
        boxes.append(Box(offset, size))
    return Box.full(shape), boxes


@given(box_sets())
def test_cover_problems_agrees_with_brute_force(case):
    bounds, boxes = case
    gaps, overlaps = cover_problems(bounds, boxes, limit=10**9)
    counts = _brute_counts(bounds, boxes)
    # Gaps are disjoint and are exactly the uncovered elements (when nothing overlaps,
    # and a superset-free subset of them otherwise).
    gap_counts = _brute_counts(bounds, gaps)
    assert gap_counts.max(initial=0) <= 1
    assert np.array_equal(gap_counts == 1, counts == 0)
    # An overlap is reported iff some element is covered twice; each pair really overlaps.
    assert bool(overlaps) == bool((counts > 1).any())
    for i, j in overlaps:
        assert boxes[i].intersect(boxes[j]) is not None


@given(shapes(max_side=8).flatmap(lambda s: st.tuples(st.just(s), grid_boxes(s))))
def test_grid_partition_is_an_exact_cover(case):
    shape, boxes = case
    assert cover_problems(Box.full(shape), boxes) == ([], [])


def test_cover_reports_gap_and_overlap():
    gaps, overlaps = cover_problems(Box.full((4, 4)), [Box((0, 0), (2, 4)), Box((1, 0), (2, 4))])
    assert gaps == [Box((3, 0), (1, 4))]
    assert overlaps == [(0, 1)]


def test_cover_0d():
    assert cover_problems(Box((), ()), [Box((), ())]) == ([], [])
    assert cover_problems(Box((), ()), []) == ([Box((), ())], [])
    assert cover_problems(Box((), ()), [Box((), ())] * 2)[1] == [(0, 1)]


def test_cover_scales_past_pairwise():
    # 1024 column shards x 64 row shards: a pairwise check would be 2 * 10**9 pairs.
    boxes = [Box((r * 4, c * 2), (4, 2)) for r in range(64) for c in range(1024)]
    assert cover_problems(Box.full((256, 2048)), boxes) == ([], [])


@given(box_sets(), st.data())
def test_box_index_agrees_with_brute_force(case, data):
    bounds, boxes = case
    index = BoxIndex(boxes)
    offset = tuple(data.draw(st.integers(0, n)) for n in bounds.shape)
    query = Box(offset, tuple(data.draw(st.integers(0, n - o)) for n, o in zip(bounds.shape, offset)))
    expected = [i for i, b in enumerate(boxes) if b.intersect(query) is not None]
    assert index.query(query) == expected


@given(shapes(min_dims=0, max_side=5), st.data())
def test_flat_range_boxes_cover_exactly_the_range_in_order(shape, data):
    total = int(np.prod(shape)) if shape else 1
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    flat = np.arange(total).reshape(shape)
    got = np.concatenate([flat[b.slices].ravel() for b in boxes]) if boxes else np.array([], int)
    assert np.array_equal(got, np.arange(start, stop))


def test_flat_range_rejects_out_of_range():
    with pytest.raises(LayoutError):
        flat_range_boxes((2, 2), 3, 5)


def test_box_index_many_queries_are_cheap():
    boxes = [Box((r, c * 8), (1, 8)) for r, c in itertools.product(range(100), range(100))]
    index = BoxIndex(boxes)
    assert index.query(Box((50, 12), (1, 8))) == [50 * 100 + 1, 50 * 100 + 2]
