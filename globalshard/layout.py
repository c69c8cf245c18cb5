"""Local shards described by where they sit in the global array.

A :class:`ShardedTensor` is one process's piece of one checkpoint key: its
local ``data`` and the :class:`~globalshard.geometry.Region` list that says
which global box each local box holds. Every parallel layout is such a list:

* a tensor-parallel shard, or one cut on several axes: one region
  (:meth:`ShardedTensor.from_offset`);
* packed layouts (fused QKV with grouped-query attention, fused SwiGLU
  gate/up, packed LoRA-B): one region per segment along the packed axis
  (:meth:`ShardedTensor.from_segments`);
* ZeRO-style flat partitions (a rank owns flat elements ``[start, stop)`` of a
  parameter): :func:`shards_from_flat_range`, one shard per contiguous box;
* padding (vocabulary rows beyond the true vocabulary): local elements outside
  every region, allowed only with ``allow_padding=True``, never saved and
  zero-filled on load.

``replica_id == 0`` marks the main replica; other replicas (data-parallel
copies) hold the same values and are written only once between them.

>>> import numpy as np
>>> w = np.arange(12, dtype=np.float32).reshape(2, 6)     # rank 1 of TP=2, cut on axis 0
>>> t = ShardedTensor.from_offset("w", w, global_shape=(4, 6), global_offset=(2, 0))
>>> t.regions[0].global_box
Box(offset=(2, 0), shape=(2, 6))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from globalshard.dtypes import canonical_name
from globalshard.errors import LayoutError, format_problems
from globalshard.geometry import Box, Region, Segment, _int_tuple, cover_problems, flat_range_boxes

__all__ = ["PADDING_SUFFIX", "ShardedStateDict", "ShardedTensor", "is_padding_key", "overlaps_itself",
           "shards_from_flat_range"]


def _as_array(key: str, data: Any) -> np.ndarray:
    if not isinstance(data, np.ndarray):
        raise LayoutError(
            f"{key!r}: data must be a numpy array (filled in place on load), got {type(data).__name__}"
        )
    return data


def overlaps_itself(a: np.ndarray) -> bool:
    """Whether two elements of ``a`` share memory (a broadcast or expanded
    view), so that it cannot hold distinct values.

    >>> overlaps_itself(np.broadcast_to(np.zeros(3), (2, 3)))
    True
    >>> overlaps_itself(np.zeros((4, 6))[:, ::2].T)
    False
    """
    if a.size <= 1:
        return False
    dims = sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1)
    if any(s == 0 for s, _ in dims):
        return True
    reach = a.itemsize  # bytes spanned by the dims of smaller strides, when each steps over the ones before
    for stride, n in dims:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:
        return False
    # Strides that interleave (a view few libraries make): decided from every element's offset.
    offsets = np.zeros(1, np.int64)
    for stride, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    offsets.sort()
    return bool(np.any(np.diff(offsets) < a.itemsize))


#: The suffix of a key's companion tensor of padding rows (spec section 1).
PADDING_SUFFIX = "#padding"


def is_padding_key(key: str) -> bool:
    """Whether ``key`` names a companion tensor of padding rows (spec section 1)."""
    return key.endswith(PADDING_SUFFIX)


@dataclass(frozen=True, slots=True)
class ShardedTensor:
    """One local piece of the global array stored under ``key``.

    Args:
        key: the checkpoint key (the same on every rank holding a piece of it).
        data: the local numpy array; ml_dtypes types for bfloat16 and float8.
            :func:`globalshard.load` writes into it in place.
        global_shape: shape of the whole array.
        regions: which local box holds which global box. Local boxes may not
            overlap, nor may global boxes; both must lie inside their arrays.
        replica_id: 0 for the main replica, >0 for copies of the same values.
        allow_padding: whether local elements outside every region are
            padding (never saved, zero-filled on load) rather than an error.

    Raises:
        LayoutError: for any inconsistency, naming the key and the boxes.
    """

    key: str
    data: np.ndarray
    global_shape: tuple[int, ...]
    regions: tuple[Region, ...]
    replica_id: int = 0
    allow_padding: bool = False
    dtype: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise LayoutError(f"checkpoint key must be a non-empty string, got {self.key!r}")
        key = self.key
        data = _as_array(key, self.data)
        try:
            object.__setattr__(self, "dtype", canonical_name(data.dtype))
        except TypeError as e:
            raise LayoutError(f"{key!r}: {e}") from None
        gshape = _int_tuple(self.global_shape, f"{key!r} global_shape")
        if any(s < 0 for s in gshape):
            raise LayoutError(f"{key!r}: global_shape {gshape} has a negative entry")
        if len(gshape) != data.ndim:
            raise LayoutError(
                f"{key!r}: data has {data.ndim} dims, global_shape {gshape} has {len(gshape)}"
            )
        if isinstance(self.replica_id, bool) or not isinstance(self.replica_id, int) or self.replica_id < 0:
            raise LayoutError(f"{key!r}: replica_id must be a non-negative int, got {self.replica_id!r}")
        regions = tuple(self.regions)
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "regions", regions)
        self._validate_regions()

    def _validate_regions(self) -> None:
        key, regions = self.key, self.regions
        local_bounds, global_bounds = Box.full(self.data.shape), Box.full(self.global_shape)
        problems = []
        for i, r in enumerate(regions):
            if not isinstance(r, Region):
                raise LayoutError(f"{key!r}: regions[{i}] is not a Region: {r!r}")
            if r.local_box.ndim != self.data.ndim:
                problems.append(f"region {i}: local box {r.local_box} has the wrong number of dims")
                continue
            if not local_bounds.contains(r.local_box):
                problems.append(
                    f"region {i}: local box {r.local_box} is outside the local data shape {self.data.shape}"
                )
            if not global_bounds.contains(r.global_box):
                problems.append(
                    f"region {i}: global box {r.global_box} is outside the global shape {self.global_shape}"
                )
        if problems:
            raise LayoutError(format_problems(f"{key!r}: bad regions", problems))
        if len(regions) == 1:
            gaps = [] if regions[0].local_box == local_bounds else [regions[0].local_box]
            overlaps: list[tuple[int, int]] = []
        else:
            gaps, overlaps = cover_problems(local_bounds, [r.local_box for r in regions])
            problems += [
                f"regions {i} and {j} overlap locally: {regions[i].local_box} and {regions[j].local_box}"
                for i, j in overlaps
            ]
            _, goverlaps = cover_problems(global_bounds, [r.global_box for r in regions], gaps=False)
            problems += [
                f"regions {i} and {j} overlap globally: {regions[i].global_box} and {regions[j].global_box}"
                for i, j in goverlaps
            ]
        if gaps and not self.allow_padding and not problems:
            uncovered = ", ".join(str(g) for g in gaps[:4])
            problems.append(
                f"local elements {uncovered} lie outside every region; pass allow_padding=True "
                "if they are padding (never saved, zero-filled on load)"
            )
        if problems:
            raise LayoutError(format_problems(f"{key!r}: inconsistent layout", problems))

    def transposed(self, axes: Sequence[int]) -> ShardedTensor:
        """The same local piece, for a stored array whose axes are in another order.

        ``axes`` says where each axis of this tensor lives in the stored global
        array: this tensor's global array is ``numpy.transpose(stored, axes)``
        (a Flax ``kernel`` ``(in, out)`` of a torch ``weight`` ``(out, in)``:
        ``axes=(1, 0)``). The result describes the stored order and its data is
        a view of this tensor's data (no copy): loading into it fills this
        array, saving it stores the transposed global array.

        >>> import numpy as np
        >>> kernel = np.zeros((3, 2), np.float32)            # (in, out)
        >>> t = ShardedTensor.from_offset("fc.weight", kernel, global_shape=(3, 4), global_offset=(0, 2))
        >>> s = t.transposed((1, 0))
        >>> s.global_shape, s.regions[0].global_box, s.data.base is kernel
        ((4, 3), Box(offset=(2, 0), shape=(2, 3)), True)
        """
        ndim = self.data.ndim
        perm = _int_tuple(axes, f"{self.key!r} axes")
        if sorted(perm) != list(range(ndim)):
            raise LayoutError(f"{self.key!r}: axes {perm} is not a permutation of the {ndim} axes")
        inverse = tuple(perm.index(a) for a in range(ndim))  # stored axis a is this tensor's axis inverse[a]

        def box(b: Box) -> Box:
            return Box(tuple(b.offset[i] for i in inverse), tuple(b.shape[i] for i in inverse))

        return ShardedTensor(self.key, self.data.transpose(inverse), tuple(self.global_shape[i] for i in inverse),
                             tuple(Region(box(r.local_box), box(r.global_box)) for r in self.regions),
                             self.replica_id, self.allow_padding)

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_offset(
        cls,
        key: str,
        data: np.ndarray,
        *,
        global_shape: Sequence[int],
        global_offset: Sequence[int],
        replica_id: int = 0,
        allow_padding: bool = False,
    ) -> ShardedTensor:
        """A local array that is one box of the global array, at ``global_offset``.

        With ``allow_padding=True`` the part of ``data`` beyond the global shape
        (e.g. vocabulary rows padded to a multiple of the TP size) is padding.

        >>> import numpy as np
        >>> emb = np.zeros((4, 8), np.float32)          # rank 2 of TP=3 for a vocab of 10
        >>> t = ShardedTensor.from_offset("emb", emb, global_shape=(10, 8),
        ...                               global_offset=(8, 0), allow_padding=True)
        >>> t.regions[0].global_box
        Box(offset=(8, 0), shape=(2, 8))
        """
        data = _as_array(key, data)
        gshape = _int_tuple(global_shape, f"{key!r} global_shape")
        goff = _int_tuple(global_offset, f"{key!r} global_offset")
        if not (len(gshape) == len(goff) == data.ndim):
            raise LayoutError(
                f"{key!r}: data has {data.ndim} dims, global_shape {gshape} and "
                f"global_offset {goff} must have as many"
            )
        if any(o < 0 for o in goff):
            raise LayoutError(f"{key!r}: global_offset {goff} has a negative entry")
        shape = tuple(data.shape)
        fits = tuple(max(0, min(s, g - o)) for s, o, g in zip(shape, goff, gshape))
        if fits != shape and not allow_padding:
            raise LayoutError(
                f"{key!r}: local shape {shape} at global offset {goff} does not fit the global "
                f"shape {gshape}; pass allow_padding=True if the excess is padding"
            )
        local = Box((0,) * len(fits), fits)
        # A region holding nothing (all padding, or a zero-size array) is dropped.
        regions = (Region(local, Box(goff, fits)),) if local.volume else ()
        return cls(key, data, gshape, regions, replica_id, allow_padding)

    @classmethod
    def from_segments(
        cls,
        key: str,
        data: np.ndarray,
        *,
        global_shape: Sequence[int],
        axis: int,
        segments: Iterable[Segment | tuple[int, int, int]],
        global_offset: Sequence[int] | None = None,
        replica_id: int = 0,
        allow_padding: bool = False,
    ) -> ShardedTensor:
        """A local array made of segments of the global array along ``axis``.

        The segments, in local order, must tile the local axis from 0 with no
        gap or overlap (a local tail beyond the last one is padding, with
        ``allow_padding=True``). On the other axes the local array sits at
        ``global_offset``, whose entry for ``axis`` must be 0.

        Example: rank 0 of TP=2 holding fused QKV rows ``[q_0; k_0; v_0]`` with
        4 query heads and 2 key/value heads of size 1 (global ``[Q; K; V]``,
        8 rows):

        >>> import numpy as np
        >>> qkv = np.zeros((4, 3), np.float32)
        >>> t = ShardedTensor.from_segments(
        ...     "qkv", qkv, global_shape=(8, 3), axis=0,
        ...     segments=[(0, 0, 2), (2, 4, 1), (3, 6, 1)])
        >>> [str(r.global_box) for r in t.regions]
        ['[0:2, 0:3]', '[4:5, 0:3]', '[6:7, 0:3]']
        """
        data = _as_array(key, data)
        gshape = _int_tuple(global_shape, f"{key!r} global_shape")
        ndim = data.ndim
        if len(gshape) != ndim:
            raise LayoutError(f"{key!r}: data has {ndim} dims, global_shape {gshape} has {len(gshape)}")
        if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
            raise LayoutError(f"{key!r}: axis {axis!r} is not an axis of a {ndim}-d array")
        axis %= ndim
        goff = (0,) * ndim if global_offset is None else _int_tuple(global_offset, f"{key!r} global_offset")
        if len(goff) != ndim or any(o < 0 for o in goff):
            raise LayoutError(f"{key!r}: global_offset {goff} must be {ndim} non-negative ints")
        if goff[axis] != 0:
            raise LayoutError(
                f"{key!r}: global_offset[{axis}] is {goff[axis]}, but along the segment axis "
                "positions come from the segments; pass 0 there"
            )
        segs = []
        for i, s in enumerate(segments):
            if not isinstance(s, Segment):
                try:
                    s = Segment(*s)
                except TypeError:
                    raise LayoutError(f"{key!r}: segments[{i}] is not a Segment: {s!r}") from None
            segs.append((s, i))
        segs.sort(key=lambda si: (si[0].local_offset, si[1]))
        problems = []
        pos = 0
        for s, i in segs:
            if s.local_offset > pos:
                problems.append(f"segments leave local rows [{pos}, {s.local_offset}) on axis {axis} uncovered")
            elif s.local_offset < pos:
                problems.append(f"segment {i} (local offset {s.local_offset}) overlaps the segment before it")
            pos = max(pos, s.local_offset + s.length)
        local_len = data.shape[axis]
        if pos > local_len:
            problems.append(f"segments cover {pos} local entries on axis {axis}, but data has {local_len}")
        elif pos < local_len and not allow_padding:
            problems.append(
                f"segments cover {pos} of {local_len} local entries on axis {axis}; pass "
                "allow_padding=True if the rest is padding"
            )
        for s, i in segs:
            if s.global_offset + s.length > gshape[axis] and not allow_padding:
                problems.append(
                    f"segment {i} covers global [{s.global_offset}, {s.global_offset + s.length}) on "
                    f"axis {axis}, beyond the global size {gshape[axis]}"
                )
        across = [max(0, min(data.shape[d], gshape[d] - goff[d])) for d in range(ndim)]
        if any(across[d] != data.shape[d] for d in range(ndim) if d != axis) and not allow_padding:
            problems.append(
                f"local shape {data.shape} at global offset {goff} does not fit the global shape "
                f"{gshape}; pass allow_padding=True if the excess is padding"
            )
        if problems:
            raise LayoutError(format_problems(f"{key!r}: bad segments", problems))
        regions = []
        for s, _ in segs:
            length = max(0, min(s.length, gshape[axis] - s.global_offset))
            shape = tuple(length if d == axis else across[d] for d in range(ndim))
            if Box((0,) * ndim, shape).is_empty:
                continue
            local = tuple(s.local_offset if d == axis else 0 for d in range(ndim))
            glob = tuple(s.global_offset if d == axis else goff[d] for d in range(ndim))
            regions.append(Region(Box(local, shape), Box(glob, shape)))
        return cls(key, data, gshape, tuple(regions), replica_id, allow_padding)


class ShardedStateDict(Mapping[str, ShardedTensor]):
    """An immutable mapping from local names to :class:`ShardedTensor`.

    Names are unique; checkpoint keys may repeat across entries (several shards
    of one key in one process, or replicas).
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: Mapping[str, ShardedTensor] | Iterable[tuple[str, ShardedTensor]] = ()) -> None:
        items = entries.items() if isinstance(entries, Mapping) else entries
        out: dict[str, ShardedTensor] = {}
        for name, tensor in items:
            if not isinstance(name, str):
                raise LayoutError(f"state dict names must be strings, got {name!r}")
            if not isinstance(tensor, ShardedTensor):
                raise LayoutError(f"state dict entry {name!r} is not a ShardedTensor: {type(tensor).__name__}")
            if name in out:
                raise LayoutError(f"state dict name {name!r} appears twice")
            out[name] = tensor
        self._entries = out

    def __getitem__(self, name: str) -> ShardedTensor:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ShardedStateDict({list(self._entries)!r})"

    def merge(self, other: Mapping[str, ShardedTensor]) -> ShardedStateDict:
        """A new dict with the entries of both; a name present in both is an error."""
        common = sorted(set(self._entries) & set(other))
        if common:
            raise LayoutError(f"cannot merge state dicts: names present in both: {common}")
        return ShardedStateDict([*self._entries.items(), *other.items()])


def shards_from_flat_range(
    key: str,
    flat: np.ndarray,
    *,
    global_shape: Sequence[int],
    start: int,
    replica_id: int = 0,
    local_shape: Sequence[int] | None = None,
    regions: Sequence[Region] | None = None,
) -> list[ShardedTensor]:
    """Shards for a 1-D ``flat`` array holding C-order elements ``[start, start +
    len(flat))`` of an array, as ZeRO / distributed optimizers keep them.

    Without ``regions`` that array is the global one. With them, it is a
    rank's local tensor of ``local_shape`` (a TP shard, a fused QKV, a padded
    vocabulary), and ``regions`` say where its boxes lie in the global array:
    the flat range is cut by them, and elements outside every region
    (padding) are neither saved nor loaded.

    The range splits into at most ``2 * ndim - 1`` boxes, each a contiguous run
    of ``flat``; each shard's data is a *view* of ``flat``, so a load fills
    ``flat`` in place.

    >>> import numpy as np
    >>> flat = np.arange(2, 10, dtype=np.float32)        # elements 2..9 of a (3, 4) array
    >>> [str(t.regions[0].global_box) for t in shards_from_flat_range("w", flat, global_shape=(3, 4), start=2)]
    ['[0:1, 2:4]', '[1:2, 0:4]', '[2:3, 0:2]']
    """
    flat = _as_array(key, flat)
    if flat.ndim != 1 or not flat.flags.c_contiguous:
        raise LayoutError(f"{key!r}: a flat range must be a contiguous 1-D array, got shape {flat.shape}")
    gshape = _int_tuple(global_shape, f"{key!r} global_shape")
    if (regions is None) != (local_shape is None):
        raise LayoutError(f"{key!r}: local_shape and regions go together")
    lshape = gshape if local_shape is None else _int_tuple(local_shape, f"{key!r} local_shape")
    maps = [Region(Box.full(gshape), Box.full(gshape))] if regions is None else list(regions)
    out, pos = [], 0
    for box in flat_range_boxes(lshape, start, start + flat.size):
        view = flat[pos:pos + box.volume].reshape(box.shape)
        pos += box.volume
        for region in maps:
            inter = box.intersect(region.local_box)
            if inter is None:
                continue
            sub = view[tuple(slice(o - b, o - b + n) for o, b, n in zip(inter.offset, box.offset, inter.shape))]
            gbox = Box(tuple(g + o - lo for g, o, lo in
                             zip(region.global_box.offset, inter.offset, region.local_box.offset)), inter.shape)
            out.append(ShardedTensor(key, sub, gshape, (Region(Box.full(inter.shape), gbox),), replica_id))
    return out

