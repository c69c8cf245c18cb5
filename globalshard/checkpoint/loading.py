"""Loading: read and check metadata.json, plan, open and check every array
on every rank, then read; and reading any box of one tensor."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from globalshard.checkpoint.bases import check_bases, open_in_roots
from globalshard.checkpoint.saving import entries_of, log_end
from globalshard.comm import Comm, SingleProcessComm, run_collectively
from globalshard.dtypes import canonical_name, numpy_dtype
from globalshard.errors import (
    CheckpointNotFoundError,
    GlobalShardError,
    LayoutError,
    MetadataError,
    MismatchError,
    MissingKeyError,
    StorageError,
)
from globalshard.format.metadata import Metadata, gc_paused, parse_metadata
from globalshard.format.paths import METADATA_FILE, foreign_files, step_names
from globalshard.format.trainer_state import parse_trainer_state
from globalshard.format.zarr import Expect, PackExpect, array_attributes
from globalshard.geometry import Box, Region
from globalshard.io import ArrayEngine, IOStats, OpenedPlan, engine_name, open_engine
from globalshard.layout import ShardedTensor, overlaps_itself
from globalshard.planner import LoadPlan, LoadPlanner, PackedRegion, ShardInfo, missing_key
from globalshard.shared import read_shared, require_exchange
from globalshard.store import Store, open_root

__all__ = ["Checkpoint", "load", "read_array", "read_metadata", "read_trainer_state"]

_log = __import__("logging").getLogger("globalshard")


def _read_metadata(store: Store) -> Metadata:
    # TODO(limitation): every rank reads and parses metadata.json itself (about
    # 80 bytes per stored region); rank 0 could parse once and broadcast.
    data = store.read(METADATA_FILE)
    if data is None:
        raise CheckpointNotFoundError(f"{store} is not a globalshard checkpoint: it has no {METADATA_FILE}"
                                      f"{_what_is_there(store)}")
    return parse_metadata(data, source=store.describe(METADATA_FILE))


def _what_is_there(store: Store) -> str:
    """Why a root has no metadata.json, as far as the names below it tell
    (where listing them is cheap: a bucket's prefix lists every key under it)."""
    if os.path.basename(str(store).rstrip("/")) == METADATA_FILE:
        return f"; it names the file itself: pass the directory that holds the checkpoint's {METADATA_FILE}"
    names: list[str] = []
    if store.lists_cheaply:
        with contextlib.suppress(GlobalShardError):
            names = store.list_dir()
    foreign = foreign_files(names)
    if foreign is not None:
        return f"; {foreign}"
    below = [n for n in step_names(names) if store.read(f"{n}/{METADATA_FILE}") is not None]
    if below:
        return f"; it holds checkpoints ({', '.join(below)}): pass one of them"
    return " (the save did not complete, or this is not the right path)"


def _read_trainer_state(store: Store, metadata: Metadata) -> dict[str, Any]:
    if metadata.trainer_state is None:
        return {}
    data = store.read(metadata.trainer_state.path)
    if data is None:
        raise MetadataError(
            f"{store.describe(METADATA_FILE)} records a trainer state at {metadata.trainer_state.path}, "
            "but it is missing"
        )
    return parse_trainer_state(data, metadata.trainer_state)


def read_metadata(path: Any, *, kvstore: Any = None) -> Metadata:
    """The parsed, validated metadata.json of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: there is no metadata.json.
        MetadataError: it is malformed (the message names the JSON path).
    """
    return _read_metadata(open_root(path, kvstore))


def read_trainer_state(path: Any, *, kvstore: Any = None) -> dict[str, Any]:
    """The trainer state saved with the checkpoint at ``path`` (empty if none),
    checked against the size and SHA-256 recorded in metadata.json."""
    store = open_root(path, kvstore)
    return _read_trainer_state(store, _read_metadata(store))


def load(
    state: Mapping[str, ShardedTensor],
    path: Any,
    *,
    comm: Comm | None = None,
    allow_lossy_cast: bool = False,
    kvstore: Any = None,
    stats: IOStats | None = None,
    shared_reads: bool = False,
    io: str | None = None,
) -> dict[str, Any]:
    """Fill each ShardedTensor's ``data`` in place from the checkpoint at ``path``.

    The targets may be cut in any way: each reads only the stored chunks that
    intersect its regions. Checkpoint keys not asked for are ignored. The
    target's dtype decides: exact widening conversions happen by themselves;
    others need ``allow_lossy_cast=True``. Padding is zero-filled.

    Everything that can be checked is checked on every rank, and all ranks
    agree that it passed, before any rank writes a target byte: the
    checkpoint's metadata and trainer state, missing keys, global shapes,
    dtype conversions, and that every stored array opens, carries checksums
    and is the array metadata.json names (key, box, save). A load that fails
    there changes nothing anywhere.

    ``path`` and ``kvstore`` name the checkpoint as for :func:`save`.

    ``shared_reads=True``: stored bytes that several ranks need (data-parallel
    replicas loading the same layout) are read once, by one of them, and sent
    to the others over ``comm``, which must then have an ``exchange`` method
    (:class:`globalshard.shared.Exchange`; the torch adapter's communicator
    has one). Checksums are verified by the reading rank as in any load.

    ``io``: the array engine for a local directory, as for :func:`save`.

    Returns:
        The trainer state saved with the checkpoint (an empty dict if none).

    Raises:
        CheckpointNotFoundError, MetadataError, MismatchError, CastError,
        StorageError, CommError.
    """
    with gc_paused():  # as in Checkpoint.load
        return Checkpoint.open(path, comm=comm, kvstore=kvstore, io=io).load(
            state, comm=comm, allow_lossy_cast=allow_lossy_cast, stats=stats, shared_reads=shared_reads)


def _expected_attributes(metadata: Metadata, plan: LoadPlan) -> dict[str, Expect]:
    """What each array and pack a plan reads must say of itself (None in version 1):
    the save of the root it lies in (a base's, for a region with ``base``)."""
    out: dict[str, Expect] = {}
    saves: dict[str, str] = {}  # path -> the save it belongs to
    for key in {t.key for t in plan.targets}:
        for r in metadata.tensors[key].regions:
            save_id = metadata.save_id if r.base is None else metadata.bases[r.base].save_id
            if r.path in plan.arrays:
                out[r.path] = array_attributes(key, r.box.offset, save_id) if save_id else None
            elif save_id is not None:
                saves[r.path] = save_id
    for path, regions in plan.packs.items():
        out[path] = pack_expect(saves[path], regions)  # packs exist from version 2
    return out


def _open_for(store: Store, engine: ArrayEngine, metadata: Metadata, infos: list[ShardInfo], names: list[str] | None,
              allow_lossy_cast: bool, io: str | None = None) -> OpenedPlan:
    """Plan a load, then :func:`open_plan`."""
    plan = LoadPlanner().plan(metadata, infos, allow_lossy_cast=allow_lossy_cast, names=names)
    return open_plan(store, engine, metadata, plan, io)


def open_plan(store: Store, engine: ArrayEngine, metadata: Metadata, plan: LoadPlan, io: str | None = None
              ) -> OpenedPlan:
    """Open and check every array ``plan`` reads, in the checkpoint at ``store``
    and in the bases it needs (spec section 5.2): no data read; ``engine`` reads it all."""
    expect = _expected_attributes(metadata, plan)
    if not metadata.bases:
        with _saying_if_replaced(store, metadata):
            return engine.open(plan, expect)
    needed: dict[int, list[tuple[str, Any]]] = {}
    root_of: dict[str, int] = {}
    for key in sorted({t.key for t in plan.targets}):
        for r in metadata.tensors[key].regions:
            if r.base is not None and (r.path in plan.arrays or r.path in plan.packs):
                needed.setdefault(r.base, []).append((key, r))
                root_of[r.path] = r.base
    return open_in_roots(engine, plan, expect, store, check_bases(store, metadata, needed), root_of, io,
                         lambda: _saying_if_replaced(store, metadata))


@contextlib.contextmanager
def _saying_if_replaced(store: Store, metadata: Metadata) -> Iterator[None]:
    """A replaced checkpoint's arrays are deleted after the new commit: when
    reading them fails for that reason, say so."""
    try:
        yield
    except StorageError as e:
        try:
            now = _read_metadata(store)
        except GlobalShardError:
            raise e from None
        if now.save_id != metadata.save_id:
            raise StorageError(f"the checkpoint at {store} was replaced by another save after it was opened "
                               f"(save {metadata.save_id} -> {now.save_id}); open it again\n{e}") from None
        raise


def _read(store: Store, engine: ArrayEngine, metadata: Metadata, opened: OpenedPlan, targets: list[np.ndarray],
          stats: IOStats | None) -> None:
    with _saying_if_replaced(store, metadata):
        engine.read(opened, targets, stats)


class Checkpoint:
    """A committed checkpoint opened for reading: metadata.json parsed and
    the trainer state checked once, then loaded from as often as needed.

    For callers that look before they load (which keys hold optimizer state,
    what the trainer state says) without reading and parsing twice. The
    handle keeps reading the save it opened: if the checkpoint is replaced
    meanwhile, a load fails with a clear error rather than mix the two.

    ``io``: the array engine for a local directory, as for :func:`save`.

    Raises (on opening): CheckpointNotFoundError, MetadataError, StorageError.
    """

    def __init__(self, path: Any, *, kvstore: Any = None, io: str | None = None) -> None:
        self._store = open_root(path, kvstore)
        self._io = engine_name(io)
        self._engine = open_engine(self._store, self._io)
        self.metadata = _read_metadata(self._store)
        self._trainer_state = _read_trainer_state(self._store, self.metadata)

    @classmethod
    def open(cls, path: Any, *, comm: Comm | None = None, kvstore: Any = None, io: str | None = None) -> Checkpoint:
        """The checkpoint opened on every rank of ``comm``, as :func:`load` opens it: every
        rank must find it before any plans against it, and if one cannot, every rank raises."""
        checkpoint: list[Checkpoint] = []

        def open_() -> None:
            checkpoint.append(cls(path, kvstore=kvstore, io=io))

        run_collectively(comm if comm is not None else SingleProcessComm(), "load: opening", open_)
        return checkpoint[0]

    @property
    def trainer_state(self) -> dict[str, Any]:
        """The trainer state (a copy: changing it changes nothing stored)."""
        return copy.deepcopy(self._trainer_state)

    def load(self, state: Mapping[str, ShardedTensor], *, comm: Comm | None = None,
             allow_lossy_cast: bool = False, stats: IOStats | None = None,
             shared_reads: bool = False) -> dict[str, Any]:
        """As :func:`load`, from this opened checkpoint.

        Two collective steps: every rank plans, checks its targets and opens
        and checks every array it will read; only when all ranks succeeded
        does any rank write a target byte.
        """
        # The cyclic GC is paused (see gc_paused): a load makes objects per
        # tensor and per chunk, none in a cycle, and enough of them to set off
        # full collections of the trainer's whole heap.
        with gc_paused():
            return self._load(state, comm, allow_lossy_cast, stats, shared_reads)

    def _load(self, state: Mapping[str, ShardedTensor], comm: Comm | None, allow_lossy_cast: bool,
              stats: IOStats | None, shared_reads: bool) -> dict[str, Any]:
        comm = comm if comm is not None else SingleProcessComm()
        shared_reads = shared_reads and comm.world_size > 1
        if shared_reads:
            require_exchange(comm)  # before anything is planned, on every rank alike
        entries = entries_of(state)
        opened: list[OpenedPlan] = []
        stats = stats if stats is not None else IOStats()
        start, before = time.perf_counter(), stats.bytes_read
        _log.info("load begins: %s, %d targets on rank %d of %d", self._store, len(entries), comm.rank,
                  comm.world_size)

        def check() -> None:
            frozen = [n for n, t in entries if not t.data.flags.writeable]
            if frozen:
                raise LayoutError(f"cannot load into read-only arrays: {frozen}")
            if shared := [n for n, t in entries if overlaps_itself(t.data)]:
                raise LayoutError(f"cannot load into arrays whose elements share memory (broadcast or expanded "
                                  f"views: each element would hold the last value read into it): {shared}")
            opened.append(_open_for(self._store, self._engine, self.metadata, [ShardInfo.of(t) for _, t in entries],
                                    [n for n, _ in entries], allow_lossy_cast, self._io))

        run_collectively(comm, "load: checking", check)
        _log.debug("load planned: %d stored arrays opened and checked, %d target reads", len(opened[0].plan.arrays),
                   sum(len(t.reads) for t in opened[0].plan.targets))
        targets = [t.data for _, t in entries]
        if shared_reads:
            def read(plan: LoadPlan, into: list[np.ndarray], st: IOStats) -> None:
                _read(self._store, self._engine, self.metadata, dataclasses.replace(opened[0], plan=plan), into, st)

            read_shared(comm, opened[0].plan, targets, read, stats)
        else:
            run_collectively(comm, "load: reading",
                             lambda: _read(self._store, self._engine, self.metadata, opened[0], targets, stats))
        log_end("load", self._store, stats.bytes_read - before, time.perf_counter() - start)
        return self.trainer_state


    def read_array(self, key: str, box: Box | tuple[slice, ...] | None = None, *, dtype: Any = None,
                   allow_lossy_cast: bool = False) -> np.ndarray:
        """As :func:`read_array`, from this opened checkpoint (metadata.json not read again)."""
        return _read_array(self._store, self.metadata, key, box, dtype, allow_lossy_cast, self._io)

    def verify(self, *, workers: int = 1,
               progress: Callable[[int], None] | None = None) -> tuple[list[str], int]:
        """Read and checksum every stored byte in bounded memory, ``workers``
        arrays at a time, each in the root that stores it (this one or a
        base). Returns ``(problems, bytes read)``: one line per damaged or
        foreign array, naming its key, box and file, and per base that cannot
        be read (none: sound). ``progress(nbytes)`` is called as each array is done."""
        from globalshard.checkpoint.verifying import verify

        return verify(self, workers, progress)


def _as_box(box: Any, global_shape: tuple[int, ...], key: str) -> Box:
    if box is None:
        return Box.full(global_shape)
    if isinstance(box, Box):
        return box
    if isinstance(box, slice):
        box = (box,)
    if isinstance(box, tuple) and all(isinstance(s, slice) for s in box):
        if len(box) > len(global_shape):
            raise MismatchError(f"{key!r}: {len(box)} slices for a {len(global_shape)}-d tensor")
        box = box + (slice(None),) * (len(global_shape) - len(box))
        offset, shape = [], []
        for s, n in zip(box, global_shape):
            start, stop, step = s.indices(n)
            if step != 1:
                raise MismatchError(f"{key!r}: slices with a step are not supported, got {s}")
            offset.append(start)
            shape.append(max(0, stop - start))
        return Box(tuple(offset), tuple(shape))
    raise MismatchError(f"{key!r}: box must be a Box or a tuple of slices, got {box!r}")


def read_array(
    path: Any,
    key: str,
    box: Box | tuple[slice, ...] | None = None,
    *,
    dtype: Any = None,
    allow_lossy_cast: bool = False,
    kvstore: Any = None,
    io: str | None = None,
) -> np.ndarray:
    """Any global box of one tensor, consolidated into a new numpy array.

    For consumers that are not trainers: export, inspection, other frameworks.

    Args:
        path: the checkpoint, as for :func:`load`.
        key: the checkpoint key.
        box: a :class:`Box` of global indices, or a tuple of slices; the whole
            tensor if None.
        dtype: the dtype of the result (default: the stored dtype); a lossy
            conversion needs ``allow_lossy_cast=True``.
        allow_lossy_cast: allow a ``dtype`` that cannot hold every stored value.
        kvstore: a TensorStore kvstore spec holding the checkpoint at ``path``.
        io: the array engine for a local directory, as for :func:`save`.
    """
    store = open_root(path, kvstore)
    return _read_array(store, _read_metadata(store), key, box, dtype, allow_lossy_cast, engine_name(io))


def _read_array(store: Store, metadata: Metadata, key: str, box: Box | tuple[slice, ...] | None,
                dtype: Any, allow_lossy_cast: bool, io: str | None = None) -> np.ndarray:
    stored = metadata.tensors.get(key)
    if stored is None:
        raise MissingKeyError(f"{key!r}: {missing_key(key, metadata)}")
    want = _as_box(box, stored.global_shape, key)
    if not Box.full(stored.global_shape).contains(want):
        raise MismatchError(f"{key!r}: box {want} is outside the global shape {stored.global_shape}")
    name = canonical_name(dtype) if dtype is not None else stored.dtype
    info = ShardInfo(key, name, stored.global_shape, want.shape, (Region(Box.full(want.shape), want),))
    engine = open_engine(store, io)
    opened = _open_for(store, engine, metadata, [info], None, allow_lossy_cast, io)
    out = np.empty(want.shape, numpy_dtype(name))  # only once the stored arrays are found and checked
    _read(store, engine, metadata, opened, [out], None)
    return out


def pack_expect(save_id: str, regions: Mapping[int, PackedRegion]) -> PackExpect:
    """The :class:`PackExpect` of the packed regions a load reads from one pack."""
    return PackExpect(save_id, tuple((r.key, r.box.offset, b, r.nbytes) for b, r in sorted(regions.items())))
