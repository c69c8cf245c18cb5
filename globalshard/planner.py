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

import dataclasses
import difflib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from globalshard.comm import json_digest
from globalshard.dtypes import is_exact_cast, numpy_dtype
from globalshard.errors import CastError, LayoutError, MismatchError, MissingKeyError, format_problems
from globalshard.format.metadata import FORMAT_VERSION, Metadata, StoredRegion, TensorMetadata, gc_paused
from globalshard.format.paths import array_dir, array_dirs, arrays_prefix, is_save_id, pack_path, save_dir
from globalshard.geometry import Box, BoxIndex, Region, cover_problems
from globalshard.layout import ShardedTensor

__all__ = [
    "LoadPlan",
    "LoadPlanner",
    "PACK_BYTES",
    "PackedRegion",
    "RankGroup",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "ShardInfo",
    "TargetPlan",
    "WriteItem",
    "array_dir",
    "asked_mask",
    "check_pack_below",
    "pack_path",
    "describe_shards",
    "group_descriptions",
    "group_ranks",
    "replica_runs",
    "save_dir",
    "unread_keys",
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
    shard ``shard`` (an index into rank ``rank``'s shard list); at
    ``byte_offset`` of the pack at ``path`` when not None."""

    key: str
    box: Box
    path: str
    nbytes: int
    rank: int
    shard: int
    region: int
    byte_offset: int | None = None


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


#: The most bytes one pack of small regions holds (spec section 5.1): each
#: is built in host memory before it is written.
PACK_BYTES = 16 << 20
#: Packed regions start at multiples of this many bytes.
PACK_ALIGN = 64


# --------------------------------------------------------------------------- compact descriptions


@dataclass(frozen=True, slots=True)
class RankGroup:
    """Ranks whose shard lists are the same but for replica ids.

    Data-parallel replicas describe the same keys, shapes and boxes and differ
    only in ``replica_id``: planning works on each distinct list once (8 lists
    at TP=8 x DP=512, not 4096), and ranks exchange a list only once
    (:func:`describe_shards`). ``replicas[i, s]`` is rank ``ranks[i]``'s
    replica id for ``shards[s]``; the shards' own ``replica_id`` is ignored.
    """

    shards: tuple[ShardInfo, ...]
    ranks: np.ndarray  # int64, ascending
    replicas: np.ndarray  # int64, (len(ranks), len(shards))


def describe_shards(infos: Sequence[ShardInfo]) -> tuple[str, list[Any], list[list[int]]]:
    """A rank's shards as ``(digest, schema, replicas)``, the form ranks exchange.

    ``schema`` is the JSON form of the shards with replica ids left out, and
    ``digest`` its SHA-256 (32 hex digits): ranks with equal digests hold the
    same list, so only one of them needs to send it. ``replicas`` holds the
    replica ids run-length encoded, ``[[id, count], ...]``.
    """
    schema = [ShardInfo.to_json(dataclasses.replace(i, replica_id=0)) for i in infos]
    return json_digest(schema), schema, replica_runs(infos)


def replica_runs(infos: Sequence[ShardInfo]) -> list[list[int]]:
    """The shards' replica ids, run-length encoded: ``[[id, count], ...]``."""
    runs: list[list[int]] = []
    for i in infos:
        if runs and runs[-1][0] == i.replica_id:
            runs[-1][1] += 1
        else:
            runs.append([i.replica_id, 1])
    return runs


def group_descriptions(
    digests: Sequence[str], schemas: dict[str, list[Any]], replicas: Sequence[Sequence[Sequence[int]]]
) -> list[RankGroup]:
    """Rebuild the :class:`RankGroup` s from every rank's :func:`describe_shards`
    (``digests[r]`` and ``replicas[r]`` of rank ``r``, one schema per digest)."""
    members: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        members.setdefault(digest, []).append(rank)
    groups = []
    for digest, ranks in members.items():
        if digest not in schemas:
            raise LayoutError(f"no rank sent the shard list with digest {digest} (ranks {ranks[:8]})")
        shards = tuple(ShardInfo.from_json(doc) for doc in schemas[digest])
        rows = []
        for rank in ranks:
            runs = replicas[rank]
            row = np.repeat(np.array([v for v, _ in runs], np.int64), [c for _, c in runs])
            if row.size != len(shards):
                raise LayoutError(f"rank {rank} sent {row.size} replica ids for {len(shards)} shards")
            rows.append(row)
        groups.append(RankGroup(shards, np.array(ranks, np.int64), np.array(rows, np.int64).reshape(len(ranks), -1)))
    return groups


def group_ranks(shards_per_rank: Sequence[Sequence[ShardInfo]]) -> list[RankGroup]:
    """:class:`RankGroup` s of shard lists held in this process (simulations, tests)."""
    if len(shards_per_rank) == 1:  # one process: one group, nothing to compare
        only = tuple(shards_per_rank[0])
        return [RankGroup(only, np.zeros(1, np.int64), np.array([[i.replica_id for i in only]], np.int64)
                          .reshape(1, len(only)))]
    members: dict[Any, list[int]] = {}
    for rank, shards in enumerate(shards_per_rank):
        sig = tuple(
            (i.key, i.dtype, i.global_shape, i.local_shape,
             tuple((r.local_box.offset, r.global_box.offset, r.global_box.shape) for r in i.regions))
            for i in shards
        )
        members.setdefault(sig, []).append(rank)
    groups = []
    for ranks in members.values():
        shards = tuple(shards_per_rank[ranks[0]])
        rows = np.array([[i.replica_id for i in shards_per_rank[r]] for r in ranks], np.int64)
        groups.append(RankGroup(shards, np.array(ranks, np.int64), rows.reshape(len(ranks), len(shards))))
    return groups


# Shards that could write a stored box: (group index, shard index, region index).
# Every rank of the group holds that shard and region.
_Holder = tuple[int, int, int]


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

    Ranks whose shard lists differ only in replica ids are planned as one
    :class:`RankGroup`, so the cost grows with the distinct lists and the
    number of stored regions, not with ranks x tensors.
    """

    def plan(self, shards_per_rank: Sequence[Sequence[ShardInfo]], *, save_id: str = "0" * 32,
             pack_below: int = 0) -> SavePlan:
        """Plan a save. ``shards_per_rank[r]`` lists rank ``r``'s shards, in the
        order that rank will look them up when writing. Arrays are placed
        under :func:`save_dir` of ``save_id`` (the api passes a fresh id).
        Stored regions of fewer than ``pack_below`` bytes are packed (see
        :func:`check_pack_below`).

        Raises:
            LayoutError: the shards are inconsistent (names the keys, ranks, boxes).
        """
        if not is_save_id(save_id):
            raise LayoutError(f"save_id must be 32 lowercase hex digits, got {save_id!r}")
        return self.plan_groups(group_ranks(shards_per_rank), len(shards_per_rank), save_id=save_id,
                                pack_below=pack_below)

    def plan_groups(self, groups: Sequence[RankGroup], world_size: int, *, save_id: str = "0" * 32,
                    pack_below: int = 0) -> SavePlan:
        """:meth:`plan` from the ranks' :class:`RankGroup` s (every rank in one group)."""
        if not is_save_id(save_id):
            raise LayoutError(f"save_id must be 32 lowercase hex digits, got {save_id!r}")
        check_pack_below(pack_below)
        with gc_paused():  # many small objects, no cycles
            plan = self._plan(groups, world_size, save_id)
            return _pack(plan, pack_below) if pack_below else plan

    def _plan(self, groups: Sequence[RankGroup], world_size: int, save_id: str) -> SavePlan:
        by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for g_idx, group in enumerate(groups):
            for s_idx, info in enumerate(group.shards):
                by_key[info.key].append((g_idx, s_idx))
        problems: list[str] = []
        tensors: dict[str, TensorMetadata] = {}
        candidates: dict[tuple[str, Box], list[_Holder]] = {}
        dirs = array_dirs(sorted(by_key))
        prefix = arrays_prefix(save_id)
        # How many of each group's ranks hold each of its shards as the main replica.
        main_counts = [(g.replicas == 0).sum(axis=0).tolist() for g in groups]
        for key in sorted(by_key):
            entries = by_key[key]
            entry = _whole_from_one(key, groups, entries, main_counts, prefix + dirs[key], candidates) \
                if len(entries) == 1 else None
            if entry is None:
                entry = self._plan_key(key, groups, entries, prefix + dirs[key], problems, candidates)
            if entry is not None:
                tensors[key] = entry
        if problems:
            raise LayoutError(format_problems("cannot save: the shards are inconsistent", problems))
        writes = _assign_writers(tensors, candidates, groups, world_size)
        return SavePlan(Metadata(tensors, None, FORMAT_VERSION, save_id), writes, world_size)

    @staticmethod
    def _plan_key(
        key: str,
        groups: Sequence[RankGroup],
        entries: list[tuple[int, int]],
        directory: str,
        problems: list[str],
        candidates: dict[tuple[str, Box], list[_Holder]],
    ) -> TensorMetadata | None:
        # Entries come in group order, and groups in the order of their first rank.
        entries = sorted(entries, key=lambda e: (int(groups[e[0]].ranks[0]), e[1]))
        g0, s0 = entries[0]
        first, first_rank = groups[g0].shards[s0], int(groups[g0].ranks[0])
        bad = False
        for g, s in entries:
            info, rank = groups[g].shards[s], int(groups[g].ranks[0])
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
        main: list[tuple[Box, int]] = []  # (box, rank of its main replica)
        by_box: dict[Box, list[_Holder]] = {}
        copies = False
        for g, s in entries:
            group = groups[g]
            main_ranks = group.ranks[group.replicas[:, s] == 0]
            for r_idx, region in enumerate(group.shards[s].regions):
                box = region.global_box
                if 0 in box.shape:
                    continue
                by_box.setdefault(box, []).append((g, s, r_idx))
                if len(main_ranks):
                    main.append((box, int(main_ranks[0])))
                if len(main_ranks) > 1:
                    copies = True
                    more = f" (and {len(main_ranks) - 2} more ranks)" if len(main_ranks) > 2 else ""
                    problems.append(f"{key!r}: main replicas overlap: rank {int(main_ranks[0])} holds {box} and rank "
                                    f"{int(main_ranks[1])} holds {box}{more} (if these are copies, give all but one a "
                                    "replica_id > 0)")
        bounds = Box.full(first.global_shape)
        gaps, overlaps = cover_problems(bounds, [b for b, _ in main])
        for gap in gaps:
            problems.append(f"{key!r}: global elements {gap} are held by no main replica (replica_id 0)")
        for i, j in overlaps:
            (a, ra), (b, rb) = main[i], main[j]
            hint = " (if these are copies, give all but one a replica_id > 0)" if a == b else ""
            problems.append(f"{key!r}: main replicas overlap: rank {ra} holds {a} and rank {rb} holds {b}{hint}")
        if gaps or overlaps or copies:
            return None
        itemsize = numpy_dtype(first.dtype).itemsize
        distinct = list(by_box)
        stored = sorted({b for b, _ in main}, key=lambda b: b.offset)
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


def _whole_from_one(key: str, groups: Sequence[RankGroup], entries: list[tuple[int, int]], main_counts: list[list[int]],
                    directory: str, candidates: dict[tuple[str, Box], list[_Holder]]) -> TensorMetadata | None:
    """A key that one shard holds whole, with one main replica, planned in few
    steps (what :meth:`SavePlanner._plan_key` would find); None for any other
    key, valid or not."""
    (g, s), = entries
    info = groups[g].shards[s]
    if len(info.regions) != 1 or main_counts[g][s] != 1:
        return None
    box = info.regions[0].global_box
    if box.shape != info.global_shape or any(box.offset) or 0 in box.shape:
        return None
    candidates[(key, box)] = [(g, s, 0)]
    return TensorMetadata(info.dtype, info.global_shape,
                          (StoredRegion(box, f"{directory}/0", box.volume * numpy_dtype(info.dtype).itemsize),))


def rebased(plan: SavePlan, save_id: str) -> SavePlan:
    """``plan`` for a save of the same structure under another ``save_id``:
    every path of the plan's save moved to ``save_id``'s directory, nothing
    else changed (a plan is a pure function of the ranks' shard lists, so a
    repeated save of the same lists has the same plan but for its id).

    Raises:
        LayoutError: ``save_id`` is not 32 lowercase hex digits.
    """
    old = plan.metadata.save_id
    assert old is not None
    return SavePlan(rebased_metadata(plan.metadata, save_id), rebased_writes(plan.writes, old, save_id),
                    plan.world_size)


def _mover(old: str, new: str) -> Callable[[str], str]:
    if not is_save_id(new):
        raise LayoutError(f"save_id must be 32 lowercase hex digits, got {new!r}")
    before, after = save_dir(old) + "/", save_dir(new) + "/"
    cut = len(before)
    moved: dict[str, str] = {}

    def move(path: str) -> str:
        out = moved.get(path)
        if out is None:
            out = moved[path] = after + path[cut:]
        return out

    return move


def rebased_writes(writes: Sequence[WriteItem], old: str, new: str) -> tuple[WriteItem, ...]:
    """``writes`` of the save ``old`` with their paths under save ``new`` (see :func:`rebased`)."""
    move = _mover(old, new)
    return tuple(WriteItem(w.key, w.box, move(w.path), w.nbytes, w.rank, w.shard, w.region, w.byte_offset)
                 for w in writes)


def rebased_metadata(metadata: Metadata, new: str) -> Metadata:
    """``metadata`` of a save with its paths under save ``new`` (see :func:`rebased`)."""
    assert metadata.save_id is not None
    move = _mover(metadata.save_id, new)
    tensors = {key: TensorMetadata(t.dtype, t.global_shape,
                                   tuple(StoredRegion(r.box, move(r.path) if r.base is None else r.path, r.nbytes,
                                                      r.byte_offset, r.base, r.sha256) for r in t.regions))
               for key, t in metadata.tensors.items()}
    return dataclasses.replace(metadata, tensors=tensors, save_id=new)


# TODO(limitation): packing is opt-in (pack_below=0 by default): readers of the format
# written before spec section 5.1 refuse a packed checkpoint, so it is not the default.
def check_pack_below(pack_below: Any) -> int:
    """``pack_below``, checked: regions of fewer bytes are packed (0: none);
    at most :data:`PACK_BYTES`, the size of one pack.

    Raises:
        LayoutError: not an integer in ``[0, PACK_BYTES]``.
    """
    if type(pack_below) is not int or not 0 <= pack_below <= PACK_BYTES:
        raise LayoutError(f"pack_below must be an integer number of bytes in [0, {PACK_BYTES}], "
                          f"got {pack_below!r}")
    return pack_below


def _pack(plan: SavePlan, pack_below: int) -> SavePlan:
    """``plan`` with each stored region of fewer than ``pack_below`` bytes
    moved into a pack of the rank that writes it (spec section 5.1): per
    rank, in the order of key then offset, aligned to :data:`PACK_ALIGN`,
    a new pack whenever the next region would pass :data:`PACK_BYTES`."""
    save_id = plan.metadata.save_id
    assert save_id is not None
    fill: dict[int, tuple[int, int]] = {}  # rank -> (pack number, bytes used)
    moved: dict[tuple[str, tuple[int, ...]], tuple[str, int]] = {}
    writes = []
    for w in plan.writes:  # sorted by key, then offset
        if w.nbytes >= pack_below:
            writes.append(w)
            continue
        n, used = fill.get(w.rank, (0, 0))
        start = -(-used // PACK_ALIGN) * PACK_ALIGN
        if used and start + w.nbytes > PACK_BYTES:
            n, start = n + 1, 0
        fill[w.rank] = (n, start + w.nbytes)
        path = pack_path(save_id, w.rank, n)
        moved[(w.key, w.box.offset)] = (path, start)
        writes.append(WriteItem(w.key, w.box, path, w.nbytes, w.rank, w.shard, w.region, start))
    if not moved:
        return plan
    tensors = {}
    for key, t in plan.metadata.tensors.items():
        regions = []
        for r in t.regions:
            where = moved.get((key, r.box.offset))
            regions.append(r if where is None else StoredRegion(r.box, where[0], r.nbytes, where[1]))
        tensors[key] = TensorMetadata(t.dtype, t.global_shape, tuple(regions))
    return SavePlan(dataclasses.replace(plan.metadata, tensors=tensors), tuple(writes), plan.world_size)


def _assign_writers(
    tensors: dict[str, TensorMetadata],
    candidates: dict[tuple[str, Box], list[_Holder]],
    groups: Sequence[RankGroup],
    world_size: int,
) -> tuple[WriteItem, ...]:
    load = np.zeros(world_size, np.int64)
    items = sorted(
        ((key, r) for key, t in tensors.items() for r in t.regions),
        key=lambda kr: (-kr[1].nbytes, kr[0], kr[1].box.offset),
    )
    writes = []
    firsts = [int(g.ranks[0]) for g in groups]
    for key, region in items:
        # TODO(limitation): replicas are trusted to hold equal values (compared only when the
        # save asks, check_replicas=True); whichever one balances the bytes is written.
        holders = candidates[(key, region.box)]
        if len(holders) == 1 and len(groups[holders[0][0]].ranks) == 1:  # one rank can write it
            rank, shard, reg = firsts[holders[0][0]], holders[0][1], holders[0][2]
        elif len(holders) == 1:  # one group: its ranks are distinct and ascending
            g, s, r = holders[0]
            ranks = groups[g].ranks
            i = int(np.argmin(load[ranks]))
            rank, shard, reg = int(ranks[i]), s, r
        else:  # the least loaded; ties to the lower rank, replica id, shard, region
            rank_c = np.concatenate([groups[g].ranks for g, _, _ in holders])
            replica_c = np.concatenate([groups[g].replicas[:, s] for g, s, _ in holders])
            shard_c = np.concatenate([np.full(len(groups[g].ranks), s) for g, s, _ in holders])
            region_c = np.concatenate([np.full(len(groups[g].ranks), r) for g, _, r in holders])
            order = np.lexsort((region_c, shard_c, replica_c, rank_c))
            i = int(order[np.argmin(load[rank_c[order]])])
            rank, shard, reg = int(rank_c[i]), int(shard_c[i]), int(region_c[i])
        load[rank] += region.nbytes
        writes.append(WriteItem(key, region.box, region.path, region.nbytes, rank, shard, reg))
    writes.sort(key=lambda w: (w.key, w.box.offset))
    return tuple(writes)


# --------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy ``stored_box`` (relative to the stored region) into ``target_box``
    of the target's local array. The region is the array at ``path``, or,
    when ``byte_offset`` is not None, the packed region at that byte offset of
    the pack at ``path``."""

    path: str
    stored_box: Box
    target_box: Box
    byte_offset: int | None = None


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """How one target is filled: reads, then zeros for its padding."""

    target: int
    key: str
    stored_dtype: str
    reads: tuple[ReadItem, ...]
    padding: tuple[Box, ...]


@dataclass(frozen=True, slots=True)
class PackedRegion:
    """A packed region a load reads: what its pack must list, and its layout."""

    key: str
    dtype: str
    box: Box  # global
    nbytes: int

    def member(self, byte_offset: int) -> list[Any]:
        """Its entry in the pack's ``members`` attribute (spec section 5.1)."""
        return [self.key, list(self.box.offset), byte_offset, self.nbytes]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The outcome of :meth:`LoadPlanner.plan`, one entry per target."""

    targets: tuple[TargetPlan, ...]
    arrays: dict[str, tuple[str, tuple[int, ...]]]  # path -> (dtype, shape) of each array read
    #: pack path -> byte_offset -> the packed region read from it.
    packs: dict[str, dict[int, PackedRegion]] = dataclasses.field(default_factory=dict)

    @property
    def bytes_needed(self) -> int:
        """Bytes of stored data the targets need (each element once per target)."""
        return sum(
            r.stored_box.volume * numpy_dtype(t.stored_dtype).itemsize for t in self.targets for r in t.reads
        )


def asked_mask(metadata: Metadata, asked: Sequence[str] | set[str]) -> str:
    """Which of the checkpoint's keys ``asked`` names, as a hexadecimal bit
    mask over its keys in metadata order (every rank parses the same file):
    small enough for every rank to all-gather."""
    wanted = set(asked)
    bits = np.fromiter((k in wanted for k in metadata.tensors), bool, len(metadata.tensors))
    return np.packbits(bits).tobytes().hex()


def unread_keys(metadata: Metadata, masks: Sequence[str]) -> list[str]:
    """The checkpoint's keys that no rank's :func:`asked_mask` names, sorted."""
    n = len(metadata.tensors)
    read = np.zeros(n, bool)
    for m in masks:
        read |= np.unpackbits(np.frombuffer(bytes.fromhex(m), np.uint8), count=n).astype(bool)
    return sorted(key for key, r in zip(metadata.tensors, read) if not r)


def missing_key(key: str, metadata: Metadata) -> str:
    """Why ``key`` cannot be loaded from a checkpoint lacking it, with near misses."""
    folded: dict[str, str] = {}
    for k in metadata.tensors:
        folded.setdefault(k.casefold(), k)
    close = [folded[k] for k in difflib.get_close_matches(key.casefold(), list(folded), n=3)]
    return "no such key in the checkpoint" + (f"; similar keys: {close}" if close else "")



def _label(names: Sequence[str] | None, index: int, key: str) -> str:
    """A target in a problem: its name, and the key it loads when that differs."""
    if not names or names[index] == key:
        return repr(key)
    return f"{names[index]!r} (key {key!r})"

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
        with gc_paused():
            return self._plan(metadata, targets, allow_lossy_cast, names)

    def _plan(self, metadata: Metadata, targets: Sequence[ShardInfo], allow_lossy_cast: bool,
              names: Sequence[str] | None) -> LoadPlan:
        problems: list[str] = []
        cast_problems: list[str] = []
        missing = False
        indexes: dict[str, BoxIndex] = {}
        plans = []
        arrays: dict[str, tuple[str, tuple[int, ...]]] = {}
        packs: dict[str, dict[int, PackedRegion]] = {}
        tensors = metadata.tensors
        for t_idx, info in enumerate(targets):
            stored = tensors.get(info.key)
            if stored is None or stored.global_shape != info.global_shape or (
                    not allow_lossy_cast and not is_exact_cast(stored.dtype, info.dtype)):
                label = _label(names, t_idx, info.key)
                if stored is None:
                    problems.append(f"{label}: {missing_key(info.key, metadata)}")
                    missing = True
                elif stored.global_shape != info.global_shape:
                    problems.append(
                        f"{label}: global shape {info.global_shape} asked for, "
                        f"the checkpoint holds {stored.global_shape}"
                    )
                else:
                    cast_problems.append(
                        f"{label}: stored as {stored.dtype}, loading into {info.dtype} would lose "
                        "information; pass allow_lossy_cast=True to round"
                    )
                continue
            index = indexes.get(info.key)
            if index is None and len(stored.regions) > 1:
                index = indexes[info.key] = BoxIndex([r.box for r in stored.regions])
            reads = []
            for region in info.regions:
                want = region.global_box
                got, whole = 0, False
                for i in (index.query(want) if index is not None else range(len(stored.regions))):
                    s = stored.regions[i]
                    if s.box == want:  # the commonest case, as saved: no arithmetic
                        local = region.local_box
                        rel = want if not any(want.offset) else Box._trusted((0,) * len(want.shape), want.shape)
                        whole = True  # all of it: stored regions do not overlap
                    else:
                        found = s.box.intersect(want)
                        if found is None:
                            continue
                        rel = Box._trusted(tuple(a - b for a, b in zip(found.offset, s.box.offset)), found.shape)
                        local = region.global_to_local(found)
                        got += found.volume
                    reads.append(ReadItem(s.path, rel, local, s.byte_offset))
                    if s.byte_offset is None:
                        arrays[s.path] = (stored.dtype, s.box.shape)
                    else:
                        packs.setdefault(s.path, {})[s.byte_offset] = PackedRegion(
                            info.key, stored.dtype, s.box, s.nbytes)
                if not whole and got != want.volume:  # cannot happen with parsed metadata; never fill silently
                    label = _label(names, t_idx, info.key)
                    problems.append(f"{label}: the checkpoint does not cover global box {want}")
            only = info.regions[0].local_box if len(info.regions) == 1 else None
            if only is not None and only.shape == info.local_shape and not any(only.offset):
                padding: list[Box] = []  # one region fills the local array: nothing to pad
            else:
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
        return LoadPlan(tuple(plans), arrays, packs)
