"""Hypothesis strategies for global arrays and the layouts that cut them.

A layout is drawn as a grid (random cut points on each axis) whose cells are
grouped into shards: cells that line up along one "packing" axis may be
stacked into one local array in a random order (a segmented, QKV-like
layout), optionally followed by padding. Replicas are further, independent
grids with ``replica_id > 0``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

import globalshard as gs
from globalshard.dtypes import numpy_dtype


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a layout: global boxes stacked along ``axis`` in this order."""

    boxes: tuple[gs.Box, ...]
    axis: int
    pad: int
    replica_id: int


def random_values(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """Arbitrary bit patterns (NaNs and infinities included) of a dtype."""
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    n = int(np.prod(shape)) if shape else 1
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape).copy()


@st.composite
def shapes(draw: Any, min_dims: int = 1, max_dims: int = 3, max_side: int = 9) -> tuple[int, ...]:
    ndim = draw(st.integers(min_dims, max_dims))
    return tuple(draw(st.lists(st.integers(0, max_side), min_size=ndim, max_size=ndim)))


@st.composite
def box_within(draw: Any, shape: tuple[int, ...]) -> gs.Box:
    """A box inside an array of ``shape`` (no side empty; ``shape`` has none)."""
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    return gs.Box(tuple(lo), tuple(draw(st.integers(1, n - a)) for a, n in zip(lo, shape)))


@st.composite
def grid_boxes(draw: Any, shape: tuple[int, ...]) -> list[gs.Box]:
    """A random grid partition of an array: every element in exactly one box."""
    if not shape:
        return [gs.Box((), ())]
    axes = []
    for n in shape:
        cuts = draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) if n > 1 else set()
        points = [0, *sorted(cuts), n]
        axes.append(list(itertools.pairwise(points)) if n else [(0, 0)])
    return [
        gs.Box(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
        for cell in itertools.product(*axes)
    ]


@st.composite
def layouts(draw: Any, shape: tuple[int, ...], replicas: bool = True) -> list[ShardSpec]:
    """Shards covering ``shape`` once with replica_id 0, plus optional replicas."""
    out = _group(draw, draw(grid_boxes(shape)), shape, 0)
    if replicas:
        for rid in range(1, draw(st.integers(0, 2)) + 1):
            out += _group(draw, draw(grid_boxes(shape)), shape, rid)
    return out


def _group(draw: Any, boxes: list[gs.Box], shape: tuple[int, ...], replica_id: int) -> list[ShardSpec]:
    boxes = [b for b in boxes if not b.is_empty] or boxes[:1]
    if not shape:
        return [ShardSpec(tuple(boxes), 0, 0, replica_id)]
    axis = draw(st.integers(0, len(shape) - 1))
    # Cells that share their extent on every other axis can be stacked along `axis`.
    columns: dict[tuple[Any, ...], list[gs.Box]] = {}
    for b in boxes:
        sig = tuple((b.offset[d], b.shape[d]) for d in range(len(shape)) if d != axis)
        columns.setdefault(sig, []).append(b)
    specs = []
    for column in columns.values():
        order = draw(st.permutations(column))
        # Split the permuted column into consecutive groups, each one shard.
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(order) - 1)), max_size=2))) if len(order) > 1 else []
        for lo, hi in itertools.pairwise([0, *cuts, len(order)]):
            group = tuple(order[lo:hi])
            if group:
                pad = draw(st.sampled_from([0, 0, 0, 1, 2]))
                specs.append(ShardSpec(group, axis, pad, replica_id))
    return specs


def make_shard(key: str, spec: ShardSpec, global_array: np.ndarray, *, dtype: str | None = None,
               fill: str = "values", seed: int = 0) -> gs.ShardedTensor:
    """Materialise a ShardSpec: local data holding the values (or junk, for a target)."""
    dtype = dtype or global_array.dtype.name
    shape = global_array.shape
    if not shape:
        data = global_array.copy() if fill == "values" else random_values((), dtype, seed)
        return gs.ShardedTensor.from_offset(key, data, global_shape=(), global_offset=(),
                                            replica_id=spec.replica_id)
    axis = spec.axis
    length = sum(b.shape[axis] for b in spec.boxes) + spec.pad
    local_shape = tuple(length if d == axis else spec.boxes[0].shape[d] for d in range(len(shape)))
    if fill == "values":
        data = random_values(local_shape, dtype, seed)  # padding holds junk, never saved
        pos = 0
        for b in spec.boxes:
            sl = tuple(slice(pos, pos + b.shape[axis]) if d == axis else slice(None) for d in range(len(shape)))
            data[sl] = global_array[b.slices]
            pos += b.shape[axis]
    else:
        data = random_values(local_shape, dtype, seed)
    if len(spec.boxes) == 1 and spec.pad == 0:
        return gs.ShardedTensor.from_offset(key, data, global_shape=shape, global_offset=spec.boxes[0].offset,
                                            replica_id=spec.replica_id)
    segments, pos = [], 0
    for b in spec.boxes:
        segments.append(gs.Segment(pos, b.offset[axis], b.shape[axis]))
        pos += b.shape[axis]
    goff = tuple(0 if d == axis else spec.boxes[0].offset[d] for d in range(len(shape)))
    return gs.ShardedTensor.from_segments(key, data, global_shape=shape, axis=axis, segments=segments,
                                          global_offset=goff, replica_id=spec.replica_id,
                                          allow_padding=spec.pad > 0)


def expected_target(target: gs.ShardedTensor, global_array: np.ndarray) -> np.ndarray:
    """What a loaded target must hold: its regions' global values, zeros elsewhere."""
    out = np.zeros(target.data.shape, target.data.dtype)
    # Widening a signalling NaN (random_values makes them) sets the FPU's invalid flag, which numpy
    # reports as a warning; the value is still NaN, and globalshard.dtypes.assign casts the same way.
    with np.errstate(invalid="ignore"):
        for r in target.regions:
            out[r.local_box.slices] = global_array[r.global_box.slices].astype(target.data.dtype)
    return out
