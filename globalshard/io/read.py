"""Executing an opened load plan, array by array: local arrays through
:mod:`~globalshard.io.localio`, the rest through TensorStore."""

from __future__ import annotations

import collections
import itertools
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from globalshard.dtypes import cast_into, numpy_dtype
from globalshard.errors import StorageError, format_problems
from globalshard.format.zarr import from_le
from globalshard.geometry import Box
from globalshard.io import localio
from globalshard.io.base import READ_WINDOW_BYTES, IOStats, OpenedPlan
from globalshard.io.localio import ArrayFile, ChunkError
from globalshard.planner import PackedRegion
from globalshard.store.base import Store, error_text, ts

__all__ = ["at", "read_chunk", "read_plan"]

_LITTLE = sys.byteorder == "little"


def read_plan(store: Store, opened: OpenedPlan, targets: Sequence[np.ndarray], stats: IOStats | None = None) -> None:
    """Execute an opened load plan: fill ``targets[i]`` for each target.

    Reads run in parallel, straight into the targets where no conversion
    is needed; padding is zero-filled.

    Raises:
        StorageError: missing, truncated or corrupted data, naming the file.
    """
    start = time.perf_counter()
    plan, stores = opened.plan, opened.stores
    # TODO(limitation): a chunk found corrupt or missing while reading raises
    # after other reads may already have landed in the targets; checking
    # every chunk first would read everything twice.
    pending: collections.deque[tuple[str, Any, np.ndarray | None, Box, int]] = collections.deque()
    problems: list[str] = []
    needed = in_flight = 0
    touched: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    chunks = {p: read_chunk(s) for p, s in stores.items()}

    def settle_oldest() -> int:
        path, future, staged_into, box, nbytes = pending.popleft()
        try:
            value = future.result()
            if staged_into is not None:
                cast_into(box.view(staged_into), value)
        except Exception as e:
            problems.append(f"{opened.describe(store, path)}: {error_text(e)}")
        return nbytes

    # TODO(limitation): object stores go through TensorStore (portable crc32c, a
    # decode buffer and a copy per chunk).
    files = opened.files
    requests = []
    packed: dict[str, dict[int, list[tuple[np.ndarray, Box, Box]]]] = {}  # pack -> byte_offset -> uses
    for tp in plan.targets:
        data = targets[tp.target]
        stored_dtype = numpy_dtype(tp.stored_dtype)
        # Reads through TensorStore write straight into a target of the stored dtype.
        direct = bool(stores) and data.dtype == stored_dtype and data.dtype.isnative
        view = ts.array(data, copy=False, write=True) if direct else None
        itemsize = stored_dtype.itemsize
        for r in tp.reads:
            if r.byte_offset is not None:
                needed += r.stored_box.volume * itemsize
                uses = packed.get(r.path)
                if uses is None:
                    uses = packed[r.path] = {}
                uses.setdefault(r.byte_offset, []).append((data, r.stored_box, r.target_box))
                continue
            if r.path in files:
                needed += r.stored_box.volume * itemsize
                requests.append((files[r.path], r.stored_box, data, r.target_box))
                continue
            src = at(stores[r.path], r.stored_box)
            nbytes = r.stored_box.volume * itemsize
            needed += nbytes
            touched.setdefault(r.path, []).append(_chunk_span(r.stored_box, chunks[r.path]))
            if view is not None:
                pending.append((r.path, at(view, r.target_box).write(src), None, r.target_box, nbytes))
            else:
                pending.append((r.path, src.read(), data, r.target_box, nbytes))
            in_flight += nbytes
            while in_flight > READ_WINDOW_BYTES and len(pending) > 1:
                in_flight -= settle_oldest()
    while pending:
        settle_oldest()
    read_direct = 0
    if requests:
        read_direct, more = localio.Reader(localio.pool()).read(requests)
        problems += [str(e) for e in more]
    if packed and not problems:
        read_direct += _read_packed(store, opened, packed, problems, touched, chunks)
    if problems:
        raise StorageError(format_problems("cannot read the checkpoint's arrays", problems))
    for tp in plan.targets:
        for box in tp.padding:
            targets[tp.target][box.slices] = 0
    if stats is not None:
        stats.arrays += len(stores) + len(files)
        stats.bytes_needed += needed
        stats.bytes_read += read_direct
        for path, spans in touched.items():
            itemsize = numpy_dtype(plan.arrays[path][0]).itemsize if path in plan.arrays else 1
            stats.bytes_read += _union_volume(spans) * math.prod(chunks[path]) * itemsize
        stats.seconds += time.perf_counter() - start


def _read_packed(store: Store, opened: OpenedPlan, packed: dict[str, dict[int, list[tuple[np.ndarray, Box, Box]]]],
                 problems: list[str], touched: dict[str, list[Any]], chunks: dict[str, tuple[int, ...]]) -> int:
    """Fill the targets' parts of packed regions: ``packed[pack][byte_offset]``
    lists ``(target, stored_box, target_box)``. Each region's bytes are read
    once: from a local pack straight into the target when it takes the whole
    region as it is stored (all such regions in one go, each pack's reads
    starting while the next pack's are put together), otherwise through at
    most :data:`READ_WINDOW_BYTES` of staging at a time. Returns the bytes
    of chunks read through :mod:`localio`."""
    plan = opened.plan
    files = opened.files
    direct: dict[str, list[tuple[int, np.ndarray]]] = {}  # pack -> (byte_offset, target bytes)
    staged: list[tuple[str, int]] = []

    def local_packs() -> Iterator[tuple[ArrayFile, list[tuple[int, np.ndarray]]]]:
        for path, regions in packed.items():
            if not _LITTLE or path not in files:
                staged.extend((path, byte_offset) for byte_offset in regions)
                continue
            members: list[tuple[int, np.ndarray]] = []
            stored = plan.packs[path]
            for byte_offset, uses in regions.items():
                into = _whole_region_bytes(uses, stored[byte_offset])
                if into is None:
                    staged.append((path, byte_offset))
                else:
                    members.append((byte_offset, into))
            if members:
                direct[path] = members
                yield files[path], members

    total, more = localio.read_packs(localio.pool(), local_packs(), sum(
        r.nbytes for path in packed if path in files for r in plan.packs[path].values()))
    problems += [_naming_members(store, p, opened, direct) for p in more]
    staged.sort()
    start = 0
    while start < len(staged) and not problems:
        window: dict[str, list[tuple[int, np.ndarray]]] = {}
        staged_bytes = 0
        while start < len(staged) and (not window or staged_bytes < READ_WINDOW_BYTES):
            path, byte_offset = staged[start]
            start += 1
            # TODO(limitation): a target that needs part of a packed region reads all of
            # it (fewer than pack_below bytes) and the pack chunks holding it.
            into = np.empty(plan.packs[path][byte_offset].nbytes, np.uint8)
            staged_bytes += into.nbytes
            window.setdefault(path, []).append((byte_offset, into))
        total += _read_pack_window(store, opened, window, problems, touched, chunks)
        if problems:
            break
        for path, members in window.items():
            for byte_offset, into in members:
                region = plan.packs[path][byte_offset]
                values = from_le(into, numpy_dtype(region.dtype)).reshape(region.box.shape)
                for target, stored_box, target_box in packed[path][byte_offset]:
                    cast_into(target_box.view(target), stored_box.view(values))
    return total

def _read_pack_window(store: Store, opened: OpenedPlan, window: dict[str, list[tuple[int, np.ndarray]]],
                      problems: list[str], touched: dict[str, list[Any]],
                      chunks: dict[str, tuple[int, ...]]) -> int:
    """Read packed regions: ``window[pack]`` lists ``(byte_offset, into)``,
    each region's bytes into its ``into``; problems name the regions they
    affect. Returns the bytes of chunks read through :mod:`localio`."""
    total = 0
    local = [(opened.files[path], members) for path, members in window.items() if path in opened.files]
    pending = []
    for path, members in window.items():
        if path not in opened.files:
            for byte_offset, into in members:
                box = Box._trusted((byte_offset,), (into.nbytes,))
                touched.setdefault(path, []).append(_chunk_span(box, chunks[path]))
                pending.append((path, into, at(opened.stores[path], box).read()))
    if local:
        total, more = localio.read_packs(localio.pool(), local, sum(i.nbytes for _, m in local for _, i in m))
        problems += [_naming_members(store, p, opened, window) for p in more]
    failed: dict[str, None] = {}  # each damaged chunk fails every member read from it: say it once
    for path, into, future in pending:
        try:
            into[...] = future.result()
        except Exception as e:
            failed.setdefault(f"{opened.describe(store, path)}: {error_text(e)}")
    problems += [_naming_members(store, p, opened, window) for p in failed]
    return total

def _naming_members(store: Store, problem: ChunkError | str, opened: OpenedPlan,
                    window: dict[str, list[tuple[int, np.ndarray]]]) -> str:
    """A problem met reading a pack, with the packed regions it affects: those
    in the damaged inner chunk when the problem (a :class:`ChunkError`) names one."""
    packs = opened.plan.packs
    for path, members in window.items():
        layout = opened.files.get(path)
        if isinstance(problem, ChunkError):
            if layout is None or not problem.path.startswith(layout.directory.rstrip(os.sep) + os.sep):
                continue
        elif opened.describe(store, path) not in problem and path not in problem:
            continue
        regions = sorted((b, packs[path][b]) for b, _ in members)
        one_file = layout is not None and layout.outer[0] >= layout.shape[0]  # the chunk index is the pack's
        if isinstance(problem, ChunkError) and problem.chunk is not None and layout is not None and one_file:
            size = layout.chunk[0]
            lo = problem.chunk[0] * size
            regions = [(b, r) for b, r in regions if b < lo + size and b + r.nbytes > lo]
        names = ", ".join(f"{r.key!r} {r.box}" for _, r in regions[:5])
        more = f" and {len(regions) - 5} more" if len(regions) > 5 else ""
        return f"{problem} (packed regions it holds: {names}{more})"
    return str(problem)


def _whole_region_bytes(uses: list[tuple[np.ndarray, Box, Box]], region: PackedRegion) -> np.ndarray | None:
    """The target's bytes when one target takes a whole packed region as it is
    stored (same dtype, contiguous, little-endian host), else None."""
    if len(uses) != 1:
        return None
    target, stored_box, target_box = uses[0]
    dtype = target.dtype
    if stored_box.shape != region.box.shape or dtype != numpy_dtype(region.dtype) or not dtype.isnative:
        return None
    out = target_box.view(target)
    if not out.flags.c_contiguous:
        return None
    return out.reshape(-1).view(np.uint8)


def _chunk_span(box: Box, chunk: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chunk indices ``[lo, hi)`` a box touches, per axis."""
    return (tuple(o // c for o, c in zip(box.offset, chunk)),
            tuple(-(-(o + s) // c) for o, s, c in zip(box.offset, box.shape, chunk)))


def _union_volume(spans: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """How many chunks the spans touch together, each counted once: storage
    reads a chunk once however many targets need parts of it."""
    spans = list(set(spans))
    if len(spans) == 1:
        lo, hi = spans[0]
        return math.prod(h - l for l, h in zip(lo, hi))
    if not spans or not spans[0][0]:
        return 1 if spans else 0
    cuts = sorted({lo[0] for lo, _ in spans} | {hi[0] for _, hi in spans})
    total = 0
    for c, n in itertools.pairwise(cuts):
        active = [(lo[1:], hi[1:]) for lo, hi in spans if lo[0] <= c and hi[0] >= n]
        if active:
            total += (n - c) * _union_volume(active)
    return total


def at(store: Any, box: Box) -> Any:
    """The part of an open TensorStore array a box selects."""
    return store[box.slices] if box.ndim else store


def read_chunk(store: Any) -> tuple[int, ...]:
    """The read chunk shape of an open TensorStore array."""
    shape = store.chunk_layout.read_chunk.shape
    return tuple(shape) if shape is not None else tuple(store.shape)
