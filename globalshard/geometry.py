"""Boxes in index space, and the two questions asked of many of them.

A :class:`Box` is a half-open N-d box ``[offset, offset + shape)`` of array
indices. Zero-size boxes (some ``shape`` entry is 0) and 0-d boxes (``shape ==
()``, one element) are legal everywhere. A :class:`Region` pairs a box in a
rank's local array with a box of the same shape in the global array: every
shard layout globalshard knows is a list of regions.

Two questions get asked of thousands of boxes at once, and both are answered
without comparing all pairs:

* :func:`cover_problems`: do these boxes cover a bound exactly once? A sweep
  over one axis at a time cuts the bound into slabs where the set of crossing
  boxes is constant, and recurses on the next axis inside each slab.
* :class:`BoxIndex`: which boxes intersect this one? Boxes sorted by their
  start on the two most fragmented axes, found by bisection.

>>> a = Box((0, 0), (4, 6))
>>> a.intersect(Box((2, 4), (4, 4)))
Box(offset=(2, 4), shape=(2, 2))
>>> a.intersect(Box((4, 0), (1, 1))) is None
True
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from globalshard.errors import LayoutError

__all__ = ["Box", "BoxIndex", "Region", "Segment", "cover_problems", "flat_range_boxes"]


def _int_tuple(values: Iterable[int], what: str) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise LayoutError(f"{what} must be a sequence of integers, got {values!r}") from None
    out = []
    for v in items:
        # bool is an int subclass, and numpy integers are not ints: accept the
        # latter, refuse the former and anything fractional.
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise LayoutError(f"{what} must hold integers, got {v!r} in {items!r}")
        out.append(v.__index__())
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Box:
    """A half-open box of array indices: ``offset[i] <= x[i] < offset[i] + shape[i]``.

    Args:
        offset: first index on each axis (non-negative integers).
        shape: extent on each axis (non-negative integers, same length).
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        offset = _int_tuple(self.offset, "Box offset")
        shape = _int_tuple(self.shape, "Box shape")
        if len(offset) != len(shape):
            raise LayoutError(f"Box offset {offset} and shape {shape} differ in length")
        if any(v < 0 for v in offset) or any(v < 0 for v in shape):
            raise LayoutError(f"Box offset {offset} and shape {shape} must be non-negative")
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "shape", shape)

    @classmethod
    def _trusted(cls, offset: tuple[int, ...], shape: tuple[int, ...]) -> Box:
        """Build from values already known to be valid tuples of ints (hot
        paths): no checks, and the slots set through their own descriptors,
        half the cost of ``object.__setattr__``."""
        box = _new(cls)
        _set_offset(box, offset)
        _set_shape(box, shape)
        return box

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole array of ``shape``."""
        shape = _int_tuple(shape, "shape")
        if any(v < 0 for v in shape):
            raise LayoutError(f"shape {shape} must be non-negative")
        return cls._trusted((0,) * len(shape), shape)  # checked: no second check in __post_init__

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def stop(self) -> tuple[int, ...]:
        """The exclusive end on each axis."""
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @property
    def volume(self) -> int:
        """Number of elements (1 for a 0-d box, 0 for a zero-size one)."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_empty(self) -> bool:
        return 0 in self.shape

    @property
    def slices(self) -> tuple[slice, ...]:
        """Index a numpy array with these to get the box's elements."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def row_windows(self, itemsize: int, limit_bytes: int) -> list[Box]:
        """This box cut along its first axis into pieces of at most ``limit_bytes``
        (one row at least), for reading a large box in bounded memory.

        >>> Box((2, 0), (5, 4)).row_windows(4, 40)
        [Box(offset=(2, 0), shape=(2, 4)), Box(offset=(4, 0), shape=(2, 4)), Box(offset=(6, 0), shape=(1, 4))]
        """
        if self.ndim == 0 or self.volume == 0:
            return [self]
        rows = max(1, limit_bytes // max(1, math.prod(self.shape[1:]) * itemsize))
        return [Box._trusted((self.offset[0] + s, *self.offset[1:]), (min(rows, self.shape[0] - s), *self.shape[1:]))
                for s in range(0, self.shape[0], rows)]

    def view(self, array: Any) -> Any:
        """``array[self.slices]`` as a view, also for a 0-d box (where plain
        indexing with ``()`` would return a scalar)."""
        if self.shape == array.shape and not any(self.offset):
            return array[...]
        return array[(*self.slices, Ellipsis)]

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when it holds no element."""
        if len(other.shape) != len(self.shape):
            raise LayoutError(f"cannot intersect {self} with {other}: different ranks")
        offset, shape = [], []
        for a0, an, b0, bn in zip(self.offset, self.shape, other.offset, other.shape):
            lo = a0 if a0 > b0 else b0
            hi = min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offset.append(lo)
            shape.append(hi - lo)
        return Box._trusted(tuple(offset), tuple(shape))

    def contains(self, other: Box | Sequence[int]) -> bool:
        """Whether every element of ``other`` (a Box, or one index tuple) lies in
        this box. An empty box is contained if its offset lies in the closed box.

        >>> Box((0, 0), (2, 3)).contains((1, 2)), Box((0, 0), (2, 3)).contains((2, 0))
        (True, False)
        """
        if not isinstance(other, Box):
            point = _int_tuple(other, "point")
            return len(point) == self.ndim and all(o <= p < o + s for o, s, p in zip(self.offset, self.shape, point))
        if len(other.shape) != len(self.shape):
            return False
        return all(
            a0 <= b0 and b0 + bn <= a0 + an
            for a0, an, b0, bn in zip(self.offset, self.shape, other.offset, other.shape)
        )

    def translate(self, delta: Sequence[int]) -> Box:
        """The same box moved by ``delta`` (the result must stay non-negative)."""
        return Box(tuple(o + d for o, d in zip(self.offset, delta, strict=True)), self.shape)

    def __str__(self) -> str:
        if not self.shape:
            return "[scalar]"
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offset, self.shape)) + "]"


# Box._trusted's pieces: the slots' own setters bypass the frozen __setattr__.
_new = object.__new__
_set_offset = vars(Box)["offset"].__set__
_set_shape = vars(Box)["shape"].__set__


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of ``length`` indices along one axis: local ``[local_offset, +length)``
    holds global ``[global_offset, +length)``."""

    local_offset: int
    global_offset: int
    length: int

    def __post_init__(self) -> None:
        values = _int_tuple((self.local_offset, self.global_offset, self.length), "Segment")
        if min(values) < 0:
            raise LayoutError(f"Segment fields must be non-negative, got {values}")
        for name, v in zip(("local_offset", "global_offset", "length"), values):
            object.__setattr__(self, name, v)


@dataclass(frozen=True, slots=True)
class Region:
    """A box of a local array and the box of the global array it holds."""

    local_box: Box
    global_box: Box

    def __post_init__(self) -> None:
        if not isinstance(self.local_box, Box) or not isinstance(self.global_box, Box):
            raise LayoutError(f"Region needs two Boxes, got {self.local_box!r}, {self.global_box!r}")
        if self.local_box.shape != self.global_box.shape:
            raise LayoutError(
                f"Region local box {self.local_box} and global box {self.global_box} differ in shape"
            )

    def global_to_local(self, box: Box) -> Box:
        """The local box holding ``box``, a sub-box of :attr:`global_box`."""
        if box == self.global_box:
            return self.local_box
        lo, go = self.local_box.offset, self.global_box.offset
        return Box._trusted(tuple(b - g + l for b, g, l in zip(box.offset, go, lo)), box.shape)


# --------------------------------------------------------------------------- cover


#: Corner updates the exact-cover fast path may make (n boxes x 2**cut axes).
_CORNER_BUDGET = 1 << 21
#: Boxes the sweep may visit, summed over its slabs, before giving up: it is
#: near-linear on the layouts writers produce and quadratic only on crafted ones.
_SWEEP_BUDGET = 1 << 24


def _is_exact_cover(bounds: Box, boxes: Sequence[Box]) -> bool | None:
    """Whether ``boxes`` (all inside ``bounds``) cover it exactly once, in time
    linear in ``len(boxes)``; None when the cut axes are too many to afford it.

    The mixed finite difference of a box's indicator is +-1 at its 2**d
    corners (the sign is -1 to the number of upper coordinates), and the
    difference operator is one to one. So the boxes' indicators sum to the
    indicator of ``bounds`` (every element covered exactly once) if and only
    if their signed corners cancel everywhere but at ``bounds``' own corners.
    Axes that every box spans whole carry no information and are dropped.
    """
    live = [b for b in boxes if not b.is_empty]
    axes = [a for a in range(bounds.ndim)
            if any(b.offset[a] != bounds.offset[a] or b.shape[a] != bounds.shape[a] for b in live)]
    e = len(axes)
    if (len(live) + 1) << e > _CORNER_BUDGET:
        return None
    signs = [(-1) ** bin(mask).count("1") for mask in range(1 << e)]
    counts: dict[tuple[int, ...], int] = defaultdict(int)

    def add(box: Box, weight: int) -> None:
        lo = [box.offset[a] for a in axes]
        hi = [box.offset[a] + box.shape[a] for a in axes]
        for mask in range(1 << e):
            corner = tuple(hi[k] if mask >> k & 1 else lo[k] for k in range(e))
            counts[corner] += weight * signs[mask]

    for b in live:
        add(b, 1)
    add(bounds, -1)
    return not any(counts.values())


@dataclass(slots=True)
class _Sweep:
    axes: tuple[int, ...]
    limit: int
    want_gaps: bool
    gaps: list[Box] = field(default_factory=list)
    overlaps: list[tuple[int, int]] = field(default_factory=list)
    seen: set[tuple[int, int]] = field(default_factory=set)
    work: int = 0

    def full(self) -> bool:
        return len(self.gaps) + len(self.overlaps) >= self.limit

    def gap(self, lo: list[int], hi: list[int]) -> None:
        if self.want_gaps:
            self.gaps.append(Box._trusted(tuple(lo), tuple(h - l for l, h in zip(lo, hi))))

    def overlap(self, i: int, j: int) -> None:
        pair = (i, j) if i < j else (j, i)
        if pair not in self.seen:
            self.seen.add(pair)
            self.overlaps.append(pair)

    def run(self, items: list[tuple[tuple[int, ...], tuple[int, ...], int]], depth: int,
            lo: list[int], hi: list[int]) -> None:
        ax = self.axes[depth]
        self.work += len(items)
        if self.work > _SWEEP_BUDGET:
            raise LayoutError(
                f"{len(self.axes)}-d boxes too fragmented to check for gaps and overlaps "
                f"(more than {_SWEEP_BUDGET} box visits); no writer produces such a layout"
            )
        if depth == len(self.axes) - 1:
            items = sorted(items, key=lambda it: it[0][ax])
            pos, reach = lo[ax], -1
            for blo, bhi, i in items:
                start, end = blo[ax], bhi[ax]
                if start > pos:
                    self.gap(lo[:ax] + [pos] + lo[ax + 1:], hi[:ax] + [start] + hi[ax + 1:])
                elif start < pos:
                    self.overlap(reach, i)
                if end > pos:
                    pos, reach = end, i
                if self.full():
                    return
            if pos < hi[ax]:
                self.gap(lo[:ax] + [pos] + lo[ax + 1:], hi)
            return
        starting: dict[int, list[int]] = defaultdict(list)
        ending: dict[int, list[int]] = defaultdict(list)
        cuts = {lo[ax], hi[ax]}
        for k, (blo, bhi, _) in enumerate(items):
            starting[blo[ax]].append(k)
            ending[bhi[ax]].append(k)
            cuts.add(blo[ax])
            cuts.add(bhi[ax])
        ordered = sorted(cuts)
        active: dict[int, None] = {}
        for c, nxt in itertools.pairwise(ordered):
            for k in ending.get(c, ()):
                active.pop(k, None)
            for k in starting.get(c, ()):
                active[k] = None
            slab_lo = lo[:ax] + [c] + lo[ax + 1:]
            slab_hi = hi[:ax] + [nxt] + hi[ax + 1:]
            if not active:
                self.gap(slab_lo, slab_hi)
            else:
                self.run([items[k] for k in active], depth + 1, slab_lo, slab_hi)
            if self.full():
                return


def cover_problems(
    bounds: Box, boxes: Sequence[Box], *, limit: int = 20, gaps: bool = True
) -> tuple[list[Box], list[tuple[int, int]]]:
    """Where ``boxes`` fail to cover ``bounds`` exactly once.

    Every box must lie inside ``bounds`` (callers check that first, with a
    better message). Empty boxes are ignored.

    Returns:
        ``(gaps, overlaps)``: disjoint boxes of ``bounds`` that no box covers,
        and pairs of indices into ``boxes`` that share elements. Both empty
        means an exact cover. At most ``limit`` problems are returned; when
        ``boxes`` do not overlap, the gaps are the complete complement. With
        ``gaps=False`` only overlaps are looked for (a partial set of boxes).

    Cost: an exact cover is recognised in O(n * 2**k), k the number of axes
    some box cuts (see :func:`_is_exact_cover`); otherwise a sweep finds the
    problems in O(n log n) for grid-like layouts, in general the sum over its
    slabs of the boxes crossing each slab.

    Raises:
        LayoutError: the boxes are too fragmented to check within a fixed budget.

    >>> cover_problems(Box.full((4,)), [Box((0,), (2,)), Box((1,), (2,))])
    ([Box(offset=(3,), shape=(1,))], [(0, 1)])
    """
    ndim = bounds.ndim
    if bounds.is_empty:
        return [], []
    if ndim == 0:
        n = len(boxes)
        missing = [bounds] if n == 0 and gaps else []
        return missing, [(0, k) for k in range(1, min(n, limit + 1))]
    if gaps and len(boxes) == 1 and boxes[0] == bounds:  # one whole box: the commonest case
        return [], []
    if gaps and _is_exact_cover(bounds, boxes):
        return [], []
    items = [(b.offset, b.stop, i) for i, b in enumerate(boxes) if not b.is_empty]
    # Sweep the axes with the fewest distinct cut points first and finish on the
    # most fragmented one, where one sort handles all boxes of a slab.
    cut_counts = [len({it[0][a] for it in items} | {it[1][a] for it in items}) for a in range(ndim)]
    axes = tuple(sorted(range(ndim), key=lambda a: (cut_counts[a], a)))
    sweep = _Sweep(axes, limit, gaps)
    sweep.run(items, 0, list(bounds.offset), list(bounds.stop))
    return sweep.gaps, sweep.overlaps


class BoxIndex:
    """Finds the boxes of a fixed set that intersect a query box.

    Boxes are grouped by their start on the axis with the most distinct starts
    (the primary axis), and sorted within each group by their start on the
    next most fragmented axis. A query bisects twice: for the groups whose
    start lies in ``(query.start - longest + 1, query.stop)`` on the primary
    axis, then for the same window on the secondary axis inside each group.
    For the disjoint, grid-like sets of a checkpoint a query costs
    O(log n + hits); it is correct for any set.

    >>> idx = BoxIndex([Box((0, 0), (2, 4)), Box((2, 0), (2, 4))])
    >>> idx.query(Box((1, 1), (2, 1)))
    [0, 1]
    """

    __slots__ = ("_all", "_boxes", "_groups", "_longest", "_primary", "_secondary", "_starts")

    def __init__(self, boxes: Sequence[Box]) -> None:
        self._boxes = list(boxes)
        live = [i for i, b in enumerate(self._boxes) if not b.is_empty]
        self._all = live
        ndim = self._boxes[0].ndim if self._boxes else 0
        self._primary = self._secondary = -1
        self._starts: list[int] = []
        self._groups: list[tuple[list[int], list[int], int]] = []
        self._longest = 0
        if ndim == 0:
            return
        distinct = [len({self._boxes[i].offset[a] for i in live}) for a in range(ndim)]
        by_distinct = sorted(range(ndim), key=lambda a: (-distinct[a], a))
        p = self._primary = by_distinct[0]
        sec = self._secondary = by_distinct[1] if ndim > 1 else -1
        groups: dict[int, list[int]] = defaultdict(list)
        for i in live:
            groups[self._boxes[i].offset[p]].append(i)
        for start in sorted(groups):
            members = groups[start]
            if sec >= 0:
                members.sort(key=lambda i: self._boxes[i].offset[sec])
                sec_starts = [self._boxes[i].offset[sec] for i in members]
                longest = max(self._boxes[i].shape[sec] for i in members)
            else:
                sec_starts, longest = [], 0
            self._starts.append(start)
            self._groups.append((sec_starts, members, longest))
        self._longest = max((self._boxes[i].shape[p] for i in live), default=0)

    def query(self, box: Box) -> list[int]:
        """Indices (ascending) of the boxes sharing at least one element with ``box``."""
        if box.is_empty:
            return []
        if self._primary < 0:
            return list(self._all)
        p, sec = self._primary, self._secondary
        first = bisect.bisect_left(self._starts, box.offset[p] - self._longest + 1)
        last = bisect.bisect_left(self._starts, box.offset[p] + box.shape[p])
        hits = []
        for sec_starts, members, longest in self._groups[first:last]:
            if sec >= 0:
                lo = bisect.bisect_left(sec_starts, box.offset[sec] - longest + 1)
                hi = bisect.bisect_left(sec_starts, box.offset[sec] + box.shape[sec])
                members = members[lo:hi]
            hits += [i for i in members if self._boxes[i].intersect(box) is not None]
        hits.sort()
        return hits


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes of an array of ``shape`` that hold flat (C-order) indices
    ``[start, stop)``, in flat order: at most ``2 * ndim - 1`` boxes, each a
    contiguous run of memory. This is how a ZeRO-style flat slice of a
    parameter becomes regions.

    >>> flat_range_boxes((3, 4), 2, 10)
    [Box(offset=(0, 2), shape=(1, 2)), Box(offset=(1, 0), shape=(1, 4)), Box(offset=(2, 0), shape=(1, 2))]
    """
    shape = _int_tuple(shape, "shape")
    total = Box.full(shape).volume
    if not 0 <= start <= stop <= total:
        raise LayoutError(f"flat range [{start}, {stop}) is not inside an array of {total} elements")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    return _flat_boxes(shape, start, stop)


def _flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    # Split on the first axis: a partial head row, whole rows, a partial tail row.
    inner = 1
    for s in shape[1:]:
        inner *= s
    rest = len(shape) - 1
    if rest == 0:
        return [Box((start,), (stop - start,))]
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(stop, inner)
    out: list[Box] = []

    def shifted(row: int, boxes: list[Box]) -> list[Box]:
        return [Box((row,) + b.offset, (1,) + b.shape) for b in boxes]

    if first_row == last_row:
        return shifted(first_row, _flat_boxes(shape[1:], first_col, last_col))
    if first_col:
        out += shifted(first_row, _flat_boxes(shape[1:], first_col, inner))
        first_row += 1
    if last_row > first_row:
        out.append(Box((first_row,) + (0,) * rest, (last_row - first_row,) + shape[1:]))
    if last_col:
        out += shifted(last_row, _flat_boxes(shape[1:], 0, last_col))
    return out
