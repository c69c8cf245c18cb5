"""Bases (spec/FORMAT.md section 5.2): a save that stores regions equal to a
base checkpoint's as references to the base's arrays, and the checks a
reader makes before it reads from a base.

A save with ``base=`` references a region of the base instead of writing it
when the caller names its key ``frozen`` (its values are then not even read)
or when its SHA-256 equals the one the base records for the same key, dtype
and box; and a key as a frozen one is (the base's cut, whatever the save's)
when the caller gave ``unchanged=`` digests of it, as a job that loaded it
from the base held it, and every region the save stores of it still has
them. References always name the checkpoint that stores the bytes: a region
the base itself references is referenced where it lies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import glob
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from globalshard.errors import LayoutError, MetadataError, StorageError, format_problems
from globalshard.format.metadata import BaseRef, Metadata, StoredRegion, TensorMetadata, parse_metadata
from globalshard.format.paths import METADATA_FILE
from globalshard.io import ArrayEngine, OpenedPlan, open_engine
from globalshard.io.base import ArrayItem, PackItem, wait_ready
from globalshard.layout import ShardedTensor
from globalshard.planner import LoadPlan
from globalshard.store import Store, open_root

__all__ = ["Base", "BaseRegion", "Frozen", "check_bases", "digest_of", "frozen_references", "open_base",
           "hash_checked", "open_in_roots", "region_digests", "settle_unchanged", "skip_unchanged",
           "still_unchanged", "stores_itself", "unchanged_references", "with_references"]

#: Per key, the SHA-256 of each of its regions by the region's global offset (:func:`region_digests`).
Digests = Mapping[str, Mapping[tuple[int, ...], str]]

#: (key, offset, shape) of a stored region.
RegionKey = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class BaseRegion:
    """A region as the checkpoint that stores it records it: that root's
    name, its save and the region (no ``base`` of its own), with the dtype."""

    root: str
    save_id: str
    region: StoredRegion
    dtype: str


@dataclass(frozen=True, slots=True)
class Base:
    """The base of a save: its root beside the save's, and every region it
    holds or references, by (key, offset, shape), where the bytes lie; and
    by key, its dtype, global shape and regions in the base's order."""

    root: str
    save_id: str
    regions: Mapping[RegionKey, BaseRegion]
    tensors: Mapping[str, tuple[str, tuple[int, ...], tuple[BaseRegion, ...]]] = dataclasses.field(
        default_factory=dict)


@dataclass(frozen=True, slots=True)
class Frozen:
    """What a save's frozen keys reference: its planned regions cut as the
    base's, each with the base's region, by (key, offset); and the keys the
    base stores cut otherwise, recorded with the base's regions whole."""

    regions: Mapping[tuple[str, tuple[int, ...]], BaseRegion] = dataclasses.field(default_factory=dict)
    whole: Mapping[str, tuple[BaseRegion, ...]] = dataclasses.field(default_factory=dict)

    def skips(self, key: str, offset: tuple[int, ...]) -> bool:
        """Whether the planned region of ``key`` at ``offset`` is not written."""
        return key in self.whole or (key, offset) in self.regions


def _metadata_of(store: Store, what: str) -> Metadata:
    data = store.read(METADATA_FILE)
    if data is None:
        raise StorageError(f"{what} {store} holds no committed checkpoint (no {METADATA_FILE}): it was deleted, "
                           "or never committed")
    return parse_metadata(data, source=store.describe(METADATA_FILE))


def open_base(store: Store, base: Any, kvstore: Any = None) -> Base:
    """The committed checkpoint ``base`` that a save to ``store`` may reference.

    ``base`` names a root beside ``store``'s (a path, URL, spec or
    :class:`~globalshard.store.Store`; with ``kvstore``, inside it as for
    :func:`~globalshard.save`). The base's own bases must still hold the
    saves it references.

    Raises:
        StorageError: it is not a sibling, holds no checkpoint, or depends on a
            base that was deleted or replaced.
    """
    # TODO(limitation): every rank reads and parses the base's metadata.json (and its
    # bases'), as every rank of a load does; rank 0 could read once and broadcast.
    base_store = open_root(base, kvstore)
    name = store.sibling_name(base_store)
    if name is None:
        raise StorageError(f"the base {base_store} is not a checkpoint beside {store}: a base must be a sibling "
                           "root (the same parent directory or prefix), and not the checkpoint being saved")
    metadata = _metadata_of(base_store, "the base")
    if metadata.save_id is None:
        raise StorageError(f"the base {base_store} is a version 1 checkpoint, whose arrays name no save")
    holders = {b: _check_holder(store, ref, f"the base {name}") for b, ref in enumerate(metadata.bases)}
    regions: dict[RegionKey, BaseRegion] = {}
    tensors = {}
    for key, t in metadata.tensors.items():
        for r in t.regions:
            if r.base is None:
                regions[(key, r.box.offset, r.box.shape)] = BaseRegion(name, metadata.save_id, r, t.dtype)
            else:  # where the bytes lie: never a chain of references
                ref = holders[r.base]
                regions[(key, r.box.offset, r.box.shape)] = BaseRegion(
                    ref.root, ref.save_id, dataclasses.replace(r, base=None), t.dtype)
        tensors[key] = (t.dtype, t.global_shape,
                        tuple(regions[(key, r.box.offset, r.box.shape)] for r in t.regions))
    return Base(name, metadata.save_id, regions, tensors)


def _check_holder(store: Store, ref: BaseRef, what: str) -> BaseRef:
    holder = _metadata_of(store.sibling(ref.root), f"{what} references {ref.root}, but")
    if holder.save_id != ref.save_id:
        raise StorageError(f"{what} references save {ref.save_id} of {ref.root}, which now holds save "
                           f"{holder.save_id}: it was replaced, and {what} cannot be read")
    return ref


def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def frozen_references(metadata: Metadata, base: Base, frozen: Iterable[str]) -> Frozen:
    """What the keys of a planned save matching ``frozen`` (exact keys or
    ``fnmatch`` patterns) reference in ``base``: each region cut as one of
    the base's, that region (packed regions are stored as planned); a key
    the base stores cut otherwise (a save under another layout), the base's
    regions whole, when it has the same dtype and global shape and no region
    of it is packed here. Pure: every rank finds the same.

    Raises:
        LayoutError: a pattern matches no key, or a frozen key is not in the
            base with its dtype and global shape (or is packed here, cut
            otherwise there).
    """
    patterns = [frozen] if isinstance(frozen, str) else list(frozen)
    problems = [f"frozen {p!r} matches no key of the state" for p in patterns
                if not any(fnmatch.fnmatchcase(k, p) for k in metadata.tensors)]
    regions: dict[tuple[str, tuple[int, ...]], BaseRegion] = {}
    whole: dict[str, tuple[BaseRegion, ...]] = {}
    for key in sorted(metadata.tensors):
        if not _matches(key, patterns):
            continue
        t = metadata.tensors[key]
        # TODO(limitation): packed regions (save(pack_below=)) are written as planned,
        # never referenced: their pack's member list is fixed when the save is planned.
        own = [r for r in t.regions if r.byte_offset is None]
        found = [base.regions.get((key, r.box.offset, r.box.shape)) for r in own]
        if all(f is not None and f.dtype == t.dtype for f in found):
            regions.update({(key, r.box.offset): f for r, f in zip(own, found) if f is not None})
            continue
        dtype, shape, theirs = base.tensors.get(key, (None, None, ()))
        if (dtype, shape) != (t.dtype, t.global_shape):
            stored = "not stored" if dtype is None else f"stored as {dtype} {shape}"
            problems.append(f"frozen {key!r} ({t.dtype} {t.global_shape}) is {stored} in the base {base.root}: a "
                            "frozen key must be stored there with the same dtype and global shape")
        elif len(own) < len(t.regions):
            problems.append(f"frozen {key!r} is cut otherwise in the base {base.root}, and packed in this save "
                            "(pack_below): save it unpacked, or cut as the base")
        else:
            whole[key] = theirs
    if problems:
        raise LayoutError(format_problems("cannot save with these frozen keys", problems))
    return Frozen(regions, whole)


def digest_of(data: np.ndarray) -> str:
    """The SHA-256 of an array's bytes as spec section 3 defines them: C order, little-endian."""
    little = data.dtype.newbyteorder("<") if data.dtype.byteorder not in ("|", "<") else data.dtype
    arr = np.ascontiguousarray(data, dtype=little)
    return hashlib.sha256(arr.reshape(-1).view(np.uint8).data).hexdigest()


def region_digests(state: Any) -> dict[str, dict[tuple[int, ...], str]]:
    """The SHA-256 (spec section 3) of every region of ``state``'s shards (a
    dict or ShardedStateDict of :class:`ShardedTensor`), by key and by the
    region's global offset: what a later ``save(..., unchanged=)`` compares
    the regions it stores with (gathered from every rank, where ranks hold
    different regions).

    >>> import numpy as np
    >>> w = ShardedTensor.from_offset("w", np.zeros((2, 2), np.float32), global_shape=(4, 2), global_offset=(2, 0))
    >>> list(region_digests({"w": w})["w"])
    [(2, 0)]
    """
    out: dict[str, dict[tuple[int, ...], str]] = {}
    for name, t in state.items():
        if not isinstance(t, ShardedTensor):
            raise LayoutError(f"state entry {name!r} is not a ShardedTensor: {type(t).__name__}")
        for r in t.regions:
            out.setdefault(t.key, {})[r.global_box.offset] = digest_of(r.local_box.view(t.data))
    return out


def still_unchanged(metadata: Metadata, expected: Digests, hashed: Iterable[Sequence[Any]]) -> list[str]:
    """The keys of ``expected`` whose every region in ``metadata`` (a planned
    save's; none packed) its writer hashed (``hashed``: ``[key, offset,
    sha256]`` from every rank) to the SHA-256 ``expected`` gives for it."""
    seen = {(k, tuple(o)): d for k, o, d in hashed}
    out = []
    for key in sorted(expected):
        t = metadata.tensors.get(key)
        if t is not None and t.regions and all(
                r.byte_offset is None and (d := seen.get((key, r.box.offset))) is not None
                and d == expected[key].get(r.box.offset) for r in t.regions):
            out.append(key)
    return out


def unchanged_references(metadata: Metadata, base: Base, keys: Sequence[str]) -> Frozen:
    """What the ``keys`` of a planned save found unchanged reference in ``base``,
    as frozen keys do (:func:`frozen_references`), of those the base stores
    with the same dtype and global shape (the others are written)."""
    fit = [k for k in keys if base.tensors.get(k, (None, None))[:2] ==
           (metadata.tensors[k].dtype, metadata.tensors[k].global_shape)]
    return frozen_references(metadata, base, [glob.escape(k) for k in fit]) if fit else Frozen()


def hash_checked(items: Sequence[ArrayItem | PackItem], checks: Mapping[str, tuple[str, tuple[int, ...]]],
                 values: Callable[[ArrayItem], np.ndarray]) -> list[list[Any]]:
    """``[key, offset, sha256]`` of the arrays among ``items`` that ``checks``
    names (path -> (key, offset)), each hashed from ``values(item)`` once its
    copy has landed (a failed copy is left for the write to report)."""
    out: list[list[Any]] = []
    for item in items:
        check = checks.get(item.path) if isinstance(item, ArrayItem) else None
        if check is not None and isinstance(item, ArrayItem) and wait_ready(item.ready) is None:
            key, offset = check
            out.append([key, list(offset), digest_of(values(item))])
    return out


def settle_unchanged(metadata: Metadata, base: Base, frozen: Frozen, expected: Digests,
                     checks: Mapping[str, tuple[str, tuple[int, ...]]], hashed: Iterable[Sequence[Any]]
                     ) -> tuple[Frozen, set[str]]:
    """A planned save's frozen references with the keys of ``expected`` that
    every rank found unchanged (``hashed``, gathered from every rank) added,
    and the paths of its arrays (``checks``: this rank's) no longer to write."""
    found = unchanged_references(metadata, base, still_unchanged(metadata, expected, hashed))
    merged = Frozen({**frozen.regions, **found.regions}, {**frozen.whole, **found.whole})
    return merged, {path for path, (key, offset) in checks.items() if found.skips(key, offset)}


def skip_unchanged(items: Sequence[ArrayItem | PackItem], requests: Mapping[str, Any]
                   ) -> tuple[list[ArrayItem | PackItem], list[list[Any]]]:
    """Hash the arrays ``requests`` names (``path -> (key, offset, the base's SHA-256 or None)``):
    those equal to the base's are left out of the write. Returns the items to
    write and, per hashed array, ``[key, offset, sha256, referenced]``."""
    write: list[ArrayItem | PackItem] = []
    outcomes: list[list[Any]] = []
    for item in items:
        request = requests.get(item.path) if isinstance(item, ArrayItem) else None
        if request is None or not isinstance(item, ArrayItem) or wait_ready(item.ready) is not None:
            # not hashed (a pack, or a failed copy, which the write reports)
            write.append(item)
            continue
        key, offset, theirs = request
        digest = digest_of(item.data)
        same = digest == theirs
        outcomes.append([key, list(offset), digest, same])
        if not same:
            write.append(item)
    return write, outcomes


def with_references(metadata: Metadata, base: Base | None, frozen: Frozen, outcomes: Iterable[list[Any]]
                    ) -> Metadata:
    """The metadata a save commits: frozen regions and regions found equal to
    the base's as references (``$.bases`` listing the roots they lie in, in
    the order first used), a frozen key the base cuts otherwise as the base's
    regions, the others with the SHA-256 hashed for them."""
    hashed = {(k, tuple(o)): (d, same) for k, o, d, same in outcomes}
    if base is None and not hashed:
        return metadata
    roots: dict[tuple[str, str], int] = {}
    tensors = {}
    for key in sorted(metadata.tensors):
        t = metadata.tensors[key]
        regions = []
        if key in frozen.whole:  # the base's cut, every region referenced where its bytes lie
            for b in frozen.whole[key]:
                index = roots.setdefault((b.root, b.save_id), len(roots))
                regions.append(dataclasses.replace(b.region, base=index))
            tensors[key] = TensorMetadata(t.dtype, t.global_shape, tuple(regions))
            continue
        for r in t.regions:
            found = frozen.regions.get((key, r.box.offset))
            digest, same = hashed.get((key, r.box.offset), (None, False))
            if found is None and same and base is not None:
                found = base.regions[(key, r.box.offset, r.box.shape)]
            if found is None:
                regions.append(r if digest is None else dataclasses.replace(r, sha256=digest))
                continue
            index = roots.setdefault((found.root, found.save_id), len(roots))
            regions.append(StoredRegion(r.box, found.region.path, r.nbytes, found.region.byte_offset, index,
                                        found.region.sha256 or digest))
        tensors[key] = TensorMetadata(t.dtype, t.global_shape, tuple(regions))
    bases = tuple(BaseRef(root, save_id) for (root, save_id), _ in sorted(roots.items(), key=lambda kv: kv[1]))
    return dataclasses.replace(metadata, tensors=tensors, bases=bases)


def check_bases(store: Store, metadata: Metadata, needed: Mapping[int, Sequence[tuple[str, StoredRegion]]]
                ) -> dict[int, Store]:
    """The store of each base a read needs (``needed[b]``: the ``(key, region)``
    read from base ``b``), checked as spec section 5.2 says: the base holds
    the save it was referenced at, and stores each of those regions itself.

    Raises:
        StorageError: a base is gone or was replaced, or does not store a
            region it is referenced for, naming the base and the keys.
    """
    out = {}
    for b, reads in needed.items():
        ref = metadata.bases[b]
        keys = sorted({k for k, _ in reads})
        names = ", ".join(map(repr, keys[:5])) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        base_store = store.sibling(ref.root)
        try:
            theirs = _metadata_of(base_store, "the base")
        except (StorageError, MetadataError) as e:
            raise StorageError(f"{store} reads {names} from its base {ref.root}, which cannot be read: {e}") from None
        if theirs.save_id != ref.save_id:
            raise StorageError(f"{store} reads {names} from save {ref.save_id} of its base {ref.root}, which now "
                               f"holds save {theirs.save_id}: the base was replaced after this checkpoint was saved, "
                               "and these keys cannot be loaded")
        problems = [f"{key!r} {r.box} at {r.path}" for key, r in reads
                    if not stores_itself(theirs, key, metadata.tensors[key].dtype, r)]
        if problems:
            raise StorageError(format_problems(f"the base {ref.root} of {store} does not store what it is "
                                               "referenced for", problems))
        out[b] = base_store
    return out


def stores_itself(base: Metadata, key: str, dtype: str, region: StoredRegion) -> bool:
    """Whether ``base`` stores, as a region of its own, the region of ``key``
    (of ``dtype``) that a checkpoint references in it (spec section 5.2, 2)."""
    t = base.tensors.get(key)
    return t is not None and t.dtype == dtype and any(
        x.base is None and x.box == region.box and x.path == region.path and x.byte_offset == region.byte_offset
        for x in t.regions)


def open_in_roots(engine: ArrayEngine, plan: LoadPlan, expect: Mapping[str, Any], own: Store,
                  bases: Mapping[int, Store], root_of: Mapping[str, int], io: str | None = None,
                  guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> OpenedPlan:
    """Open every array and pack ``plan`` reads in the root it lies in: the
    store of base ``root_of[path]`` (``bases``), else ``own`` (the
    checkpoint's, opened by ``engine``), each under ``guard()``; one opened
    plan, which ``engine`` reads. No data read."""
    opened = []
    for b in [None, *sorted(bases)]:
        part = dataclasses.replace(plan, arrays={p: v for p, v in plan.arrays.items() if root_of.get(p) == b},
                                   packs={p: v for p, v in plan.packs.items() if root_of.get(p) == b})
        with guard():
            opened.append((engine if b is None else open_engine(bases[b], io)).open(part, expect))
    where = {p: (own if b is None else bases[b]).describe(p) for p, b in root_of.items()}
    return OpenedPlan(plan, {k: v for o in opened for k, v in o.stores.items()},
                      {k: v for o in opened for k, v in o.files.items()}, where)

