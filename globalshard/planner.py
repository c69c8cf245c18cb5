"""Pure planning of saves and loads: no I/O, no collectives, no randomness.

The call sequence of a save, on ``world_size`` ranks:

1. every rank describes its shards as :class:`ShardInfo` (no data moves);
2. the descriptions are all-gathered, so every rank holds all of them;
3. every rank runs :meth:`SavePlanner.plan` on the same input and gets the
   same :class:`SavePlan`: the validation verdict, the stored regions with
   their paths, and one writer per region;
4. each rank writes the :class:`WriteItem` s assigned to it; rank 0 commits.

A load needs no collective to plan: each rank runs :meth:`LoadPlanner.plan`
on the checkpoint's :class:`~globalshard.metadata.Metadata` and its own targets.

Because planning is a pure function of its inputs, many ranks are simulated
by passing all of their shard lists to one call; that is how it is tested.
"""

from __future__ import annotations

import difflib
import gc
import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from globalshard.dtypes import is_exact_cast, numpy_dtype
from globalshard.errors import CastError, LayoutError, MismatchError, MissingKeyError, format_problems
from globalshard.geometry import Box, BoxIndex, Region, cover_problems
from globalshard.layout import ShardedTensor
from globalshard.metadata import FORMAT_VERSION, Metadata, StoredRegion, TensorMetadata, is_save_id

__all__ = [
    "LoadPlan",
    "LoadPlanner",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "ShardInfo",
    "TargetPlan",
    "WriteItem",
    "array_dir",
    "save_dir",
]


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A :class:`~globalshard.layout.ShardedTensor` without its data: what planners see."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    regions: tuple[Region, ...]
    replica_id: int = 0

    @classmethod
    def of(cls, tensor: ShardedTensor) -> ShardInfo:
        return cls(
            tensor.key, tensor.dtype, tensor.global_shape, tuple(tensor.data.shape),
            tensor.regions, tensor.replica_id,
        )

    def to_json(self) -> list[Any]:
        """A compact JSON-able form, for all-gathering between ranks."""
        return [
            self.key, self.dtype, list(self.global_shape), list(self.local_shape), self.replica_id,
            [[list(r.local_box.offset), list(r.global_box.offset), list(r.global_box.shape)] for r in self.regions],
        ]

    @classmethod
    def from_json(cls, doc: list[Any]) -> ShardInfo:
        key, dtype, gshape, lshape, replica_id, regions = doc
        return cls(
            key, dtype, tuple(gshape), tuple(lshape),
            tuple(Region(Box(lo, shape), Box(go, shape)) for lo, go, shape in regions),
            replica_id,
        )


# --------------------------------------------------------------------------- save


@dataclass(frozen=True, slots=True)
class WriteItem:
    """Write global ``box`` of ``key`` to ``path``, from region ``region`` of
    shard ``shard`` (an index into rank ``rank``'s shard list)."""

    key: str
    box: Box
    path: str
    nbytes: int
    rank: int
    shard: int
    region: int


@dataclass(frozen=True, slots=True)
class SavePlan:
    """The outcome of :meth:`SavePlanner.plan`: what to store and who writes it."""

    metadata: Metadata
    writes: tuple[WriteItem, ...]
    world_size: int

    def for_rank(self, rank: int) -> list[WriteItem]:
        return [w for w in self.writes if w.rank == rank]

    def bytes_per_rank(self) -> list[int]:
        out = [0] * self.world_size
        for w in self.writes:
            out[w.rank] += w.nbytes
        return out


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


#: Everything one save writes, besides metadata.json, lies under this prefix.
SAVES_DIR = "saves"


def save_dir(save_id: str) -> str:
    """The directory of one save's arrays and trainer state (spec section 2)."""
    return f"{SAVES_DIR}/{save_id}"


def array_dir(key: str) -> str:
    """A readable, filesystem-safe directory name for a checkpoint key.

    Bytes outside ``[A-Za-z0-9._-]`` are percent-encoded (so the mapping is
    one to one), a leading dot is encoded, and long names are shortened with a
    hash of the key.

    >>> array_dir("layers.0.attn/qkv weight")
    'layers.0.attn%2Fqkv%20weight'
    """
    enc = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in key)
    if enc.startswith("."):
        enc = "%2E" + enc[1:]
    if len(enc) > 120:
        enc = enc[:100] + "~" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return enc


def _array_dirs(keys: Sequence[str]) -> dict[str, str]:
    # Keys that differ only in case would share a directory on a
    # case-insensitive filesystem: give those a hash suffix.
    dirs = {k: array_dir(k) for k in keys}
    folded: dict[str, list[str]] = defaultdict(list)
    for k, d in dirs.items():
        folded[d.casefold()].append(k)
    for group in folded.values():
        if len(group) > 1:
            for k in group:
                dirs[k] += "~" + hashlib.sha256(k.encode("utf-8")).hexdigest()[:8]
    return dirs


# A shard region that could write a stored box: (rank, shard index, region
# index, global box, replica_id). A plain tuple: a save at scale makes one per
# rank, tensor and region (4 million at 4096 ranks x 1000 tensors).
_Holder = tuple[int, int, int, Box, int]
_RANK: Final = 0
_SHARD: Final = 1
_REGION: Final = 2
_BOX: Final = 3
_REPLICA: Final = 4


class SavePlanner:
    """Validates the shards of every rank and plans who writes what.

    Validation, per checkpoint key: every shard agrees on dtype and global
    shape, and the main replicas (``replica_id == 0``) cover every global
    element exactly once (sweep line, no pairwise comparison). Every problem
    found is reported in one :class:`LayoutError`.

    Writers: each main-replica region is stored once. Any shard, main replica
    or not, whose region contains it can write it. Regions are assigned
    largest first to the candidate rank with the fewest bytes so far (ties to
    the lower rank): deterministic, and balanced across data-parallel
    replicas rather than always on rank 0.
    """

    def plan(self, shards_per_rank: Sequence[Sequence[ShardInfo]], *, save_id: str = "0" * 32) -> SavePlan:
        """Plan a save. ``shards_per_rank[r]`` lists rank ``r``'s shards, in the
        order that rank will look them up when writing. Arrays are placed
        under :func:`save_dir` of ``save_id`` (the api passes a fresh id).

        Raises:
            LayoutError: the shards are inconsistent (names the keys, ranks, boxes).
        """
        # Planning builds millions of small objects and no reference cycles: the
        # cyclic collector would only traverse them again and again (2.7x the
        # time per doubling of ranks at 4096, against 2.0x with it paused).
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._plan(shards_per_rank, save_id)
        finally:
            if paused:
                gc.enable()

    def _plan(self, shards_per_rank: Sequence[Sequence[ShardInfo]], save_id: str) -> SavePlan:
        by_key: dict[str, list[tuple[int, int, ShardInfo]]] = defaultdict(list)
        for rank, shards in enumerate(shards_per_rank):
            for s_idx, info in enumerate(shards):
                by_key[info.key].append((rank, s_idx, info))
        problems: list[str] = []
        tensors: dict[str, TensorMetadata] = {}
        candidates: dict[tuple[str, Box], list[_Holder]] = {}
        if not is_save_id(save_id):
            raise LayoutError(f"save_id must be 32 lowercase hex digits, got {save_id!r}")
        dirs = _array_dirs(sorted(by_key))
        prefix = save_dir(save_id) + "/arrays/"
        for key in sorted(by_key):
            entry = self._plan_key(key, by_key[key], prefix + dirs[key], problems, candidates)
            if entry is not None:
                tensors[key] = entry
        if problems:
            raise LayoutError(format_problems("cannot save: the shards are inconsistent", problems))
        writes = _assign_writers(tensors, candidates, len(shards_per_rank))
        return SavePlan(Metadata(tensors, None, FORMAT_VERSION, save_id), writes, len(shards_per_rank))

    @staticmethod
    def _plan_key(
        key: str,
        entries: list[tuple[int, int, ShardInfo]],
        directory: str,
        problems: list[str],
        candidates: dict[tuple[str, Box], list[_Holder]],
    ) -> TensorMetadata | None:
        first_rank, _, first = entries[0]
        bad = False
        for rank, _, info in entries:
            if info.dtype != first.dtype:
                problems.append(f"{key!r}: rank {rank} has dtype {info.dtype}, rank {first_rank} has {first.dtype}")
                bad = True
            if info.global_shape != first.global_shape:
                problems.append(
                    f"{key!r}: rank {rank} has global shape {info.global_shape}, "
                    f"rank {first_rank} has {first.global_shape}"
                )
                bad = True
        if bad:
            return None
        # Every holder (main or replica) whose box contains a stored box may write it.
        # Replicas mostly repeat the same boxes: group them by box as they come.
        main: list[_Holder] = []
        by_box: dict[Box, list[_Holder]] = {}
        # Keyed by (offset, shape): tuples hash in C, a Box through its dataclass __hash__.
        by_coords: dict[tuple[tuple[int, ...], tuple[int, ...]], list[_Holder]] = {}
        for rank, s_idx, info in entries:
            replica = info.replica_id
            for r_idx, region in enumerate(info.regions):
                box = region.global_box
                shape = box.shape
                if 0 in shape:
                    continue
                h = (rank, s_idx, r_idx, box, replica)
                coords = (box.offset, shape)
                same = by_coords.get(coords)
                if same is None:
                    by_coords[coords] = [h]
                    by_box[box] = by_coords[coords]
                else:
                    same.append(h)
                if replica == 0:
                    main.append(h)
        bounds = Box.full(first.global_shape)
        gaps, overlaps = cover_problems(bounds, [h[_BOX] for h in main])
        for g in gaps:
            problems.append(f"{key!r}: global elements {g} are held by no main replica (replica_id 0)")
        for i, j in overlaps:
            a, b = main[i], main[j]
            hint = " (if these are copies, give all but one a replica_id > 0)" if a[_BOX] == b[_BOX] else ""
            problems.append(f"{key!r}: main replicas overlap: rank {a[_RANK]} holds {a[_BOX]} and rank {b[_RANK]} "
                            f"holds {b[_BOX]}{hint}")
        if gaps or overlaps:
            return None
        itemsize = numpy_dtype(first.dtype).itemsize
        distinct = list(by_box)
        stored = sorted({h[_BOX] for h in main}, key=lambda b: b.offset)
        # Main boxes are disjoint: when replicas repeat them exactly (the usual
        # data-parallel case), only identical boxes can contain a stored one.
        index = BoxIndex(distinct) if len(distinct) > len(stored) else None
        regions = []
        for n, box in enumerate(stored):
            if index is None:
                candidates[(key, box)] = by_box[box]
            else:
                candidates[(key, box)] = [
                    h for i in index.query(box) if distinct[i].contains(box) for h in by_box[distinct[i]]
                ]
            regions.append(StoredRegion(box, f"{directory}/{n}", box.volume * itemsize))
        return TensorMetadata(first.dtype, first.global_shape, tuple(regions))


def _assign_writers(
    tensors: dict[str, TensorMetadata],
    candidates: dict[tuple[str, Box], list[_Holder]],
    world_size: int,
) -> tuple[WriteItem, ...]:
    load = [0] * world_size
    items = sorted(
        ((key, r) for key, t in tensors.items() for r in t.regions),
        key=lambda kr: (-kr[1].nbytes, kr[0], kr[1].box.offset),
    )
    writes = []
    for key, region in items:
        # TODO(limitation): replicas are trusted to hold equal values; whichever
        # one balances the bytes is written, and no check compares them.
        best = min(candidates[(key, region.box)], key=lambda h: (load[h[_RANK]], h[_RANK], h[_REPLICA], h[_SHARD]))
        load[best[_RANK]] += region.nbytes
        writes.append(WriteItem(key, region.box, region.path, region.nbytes, best[_RANK], best[_SHARD],
                                best[_REGION]))
    writes.sort(key=lambda w: (w.key, w.box.offset))
    return tuple(writes)


# --------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy ``stored_box`` (relative to the stored array at ``path``) into
    ``target_box`` of the target's local array."""

    path: str
    stored_box: Box
    target_box: Box


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """How one target is filled: reads, then zeros for its padding."""

    target: int
    key: str
    stored_dtype: str
    reads: tuple[ReadItem, ...]
    padding: tuple[Box, ...]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The outcome of :meth:`LoadPlanner.plan`, one entry per target."""

    targets: tuple[TargetPlan, ...]
    arrays: dict[str, tuple[str, tuple[int, ...]]]  # path -> (dtype, shape) of each array read

    @property
    def bytes_needed(self) -> int:
        """Bytes of stored data the targets need (each element once per target)."""
        return sum(
            r.stored_box.volume * numpy_dtype(t.stored_dtype).itemsize for t in self.targets for r in t.reads
        )


def missing_key(key: str, metadata: Metadata) -> str:
    """Why ``key`` cannot be loaded from a checkpoint lacking it, with near misses."""
    folded: dict[str, str] = {}
    for k in metadata.tensors:
        folded.setdefault(k.casefold(), k)
    close = [folded[k] for k in difflib.get_close_matches(key.casefold(), list(folded), n=3)]
    return "no such key in the checkpoint" + (f"; similar keys: {close}" if close else "")


class LoadPlanner:
    """Maps each target region onto the stored regions that intersect it.

    Every check that can be made before touching a target is made here, and
    all problems are reported at once: a key missing from the checkpoint, a
    global shape that differs, a dtype conversion that would lose information
    (unless ``allow_lossy_cast``).
    """

    def plan(
        self, metadata: Metadata, targets: Sequence[ShardInfo], *, allow_lossy_cast: bool = False,
        names: Sequence[str] | None = None,
    ) -> LoadPlan:
        """Plan the reads for ``targets`` (``names`` label them in messages).

        Raises:
            MissingKeyError: some key is missing (a MismatchError and a KeyError;
                the message lists every problem found).
            MismatchError: shapes differ (with every problem).
            CastError: only dtype conversions are refused.
        """
        problems: list[str] = []
        cast_problems: list[str] = []
        missing = False
        indexes: dict[str, BoxIndex] = {}
        plans = []
        arrays: dict[str, tuple[str, tuple[int, ...]]] = {}
        for t_idx, info in enumerate(targets):
            label = f"{names[t_idx]!r} (key {info.key!r})" if names else repr(info.key)
            stored = metadata.tensors.get(info.key)
            if stored is None:
                problems.append(f"{label}: {missing_key(info.key, metadata)}")
                missing = True
                continue
            if stored.global_shape != info.global_shape:
                problems.append(
                    f"{label}: global shape {info.global_shape} asked for, "
                    f"the checkpoint holds {stored.global_shape}"
                )
                continue
            if not allow_lossy_cast and not is_exact_cast(stored.dtype, info.dtype):
                cast_problems.append(
                    f"{label}: stored as {stored.dtype}, loading into {info.dtype} would lose "
                    "information; pass allow_lossy_cast=True to round"
                )
                continue
            index = indexes.get(info.key)
            if index is None:
                index = indexes[info.key] = BoxIndex([r.box for r in stored.regions])
            reads = []
            for region in info.regions:
                want = region.global_box
                got = 0
                for i in index.query(want):
                    s = stored.regions[i]
                    inter = s.box.intersect(want)
                    if inter is None:
                        continue
                    got += inter.volume
                    rel = Box._trusted(tuple(a - b for a, b in zip(inter.offset, s.box.offset)), inter.shape)
                    reads.append(ReadItem(s.path, rel, region.global_to_local(inter)))
                    arrays[s.path] = (stored.dtype, s.box.shape)
                if got != want.volume:  # cannot happen with parsed metadata; never fill silently
                    problems.append(f"{label}: the checkpoint does not cover global box {want}")
            padding, _ = cover_problems(
                Box.full(info.local_shape), [r.local_box for r in info.regions], limit=1 << 62
            )
            plans.append(TargetPlan(t_idx, info.key, stored.dtype, tuple(reads), tuple(padding)))
        if problems:
            error = MissingKeyError if missing else MismatchError
            summary = "cannot load: the targets do not match the checkpoint"
            raise error(format_problems(summary, problems + cast_problems))
        if cast_problems:
            raise CastError(format_problems("cannot load: lossy dtype conversions", cast_problems))
        return LoadPlan(tuple(plans), arrays)
