"""save, load, read_metadata, read_array: orchestration only.

Geometry, validation and planning live in pure modules; TensorStore lives in
:mod:`globalshard.storage`. This module sequences them and coordinates ranks
through a :class:`~globalshard.comm.Comm`, so that a failure on any rank
raises on every rank and a failed save never commits.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from globalshard.comm import Comm, SingleProcessComm, run_collectively
from globalshard.dtypes import canonical_name, numpy_dtype
from globalshard.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    LayoutError,
    MetadataError,
    MismatchError,
    MissingKeyError,
)
from globalshard.geometry import Box, Region
from globalshard.layout import ShardedTensor
from globalshard.metadata import (
    METADATA_FILE,
    TRAINER_STATE_FILE,
    Metadata,
    TrainerStateRef,
    dump_trainer_state,
    parse_metadata,
    parse_trainer_state,
)
from globalshard.planner import LoadPlanner, SavePlanner, ShardInfo, missing_key
from globalshard.storage import IOStats, Location

__all__ = ["Checkpoint", "load", "read_array", "read_metadata", "read_trainer_state", "save"]

_ARRAYS = "arrays"


def _entries(state: Mapping[str, ShardedTensor]) -> list[tuple[str, ShardedTensor]]:
    if not isinstance(state, Mapping):
        raise LayoutError(f"state must be a mapping of names to ShardedTensors, got {type(state).__name__}")
    out = []
    for name, tensor in state.items():
        if not isinstance(tensor, ShardedTensor):
            raise LayoutError(f"state entry {name!r} is not a ShardedTensor: {type(tensor).__name__}")
        out.append((str(name), tensor))
    return out


def save(
    state: Mapping[str, ShardedTensor],
    path: Any,
    *,
    trainer_state: dict[str, Any] | None = None,
    comm: Comm | None = None,
    overwrite: bool = False,
    kvstore: Any = None,
    stats: IOStats | None = None,
) -> None:
    """Save this rank's shards as (part of) one checkpoint.

    Every rank calls ``save`` with its own shards and the same ``path``. The
    shards of all ranks are validated together; each region is written once,
    by a writer chosen to balance bytes across ranks; metadata.json is written
    last, atomically, by rank 0. If anything fails on any rank, every rank
    raises and no metadata.json is published.

    Args:
        state: local names -> :class:`ShardedTensor` (a ShardedStateDict or dict).
        path: a directory, a kvstore URL or a TensorStore kvstore spec dict;
            with ``kvstore``, a relative path inside that kvstore.
        trainer_state: a dict of exact JSON values for trainer_state.json
            (rank 0's is written).
        comm: the communicator; None for a single process.
        overwrite: replace a committed checkpoint at ``path`` (it is
            un-published first, so a crash mid-save leaves no checkpoint).
        kvstore: a TensorStore kvstore spec (dict or URL: S3, GCS, OCDBT, ...)
            holding the checkpoint at ``path``.
        stats: an :class:`IOStats` to fill with this rank's figures.

    Raises:
        LayoutError, MetadataError, CheckpointExistsError, StorageError, CommError.

    >>> import numpy as np, tempfile
    >>> w = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> d = tempfile.mkdtemp()
    >>> save({"w": ShardedTensor.from_offset("w", w, global_shape=(2, 3), global_offset=(0, 0))},
    ...      d, trainer_state={"step": 10})
    >>> read_array(d, "w", Box((1, 0), (1, 3)))
    array([[3., 4., 5.]], dtype=float32)
    """
    comm = comm if comm is not None else SingleProcessComm()
    location = Location(path, kvstore)
    entries = _entries(state)
    infos = [ShardInfo.of(t) for _, t in entries]
    ts_blob: list[tuple[bytes, TrainerStateRef]] = []

    def describe() -> list[Any]:
        # Everything checkable is checked before anything on storage changes.
        if comm.rank == 0:
            if trainer_state is not None:
                ts_blob.append(dump_trainer_state(trainer_state))
            if not overwrite and location.read_file(METADATA_FILE) is not None:
                raise CheckpointExistsError(f"{location} already holds a checkpoint; pass overwrite=True to replace it")
        return [i.to_json() for i in infos]

    _, gathered = run_collectively(comm, "save: planning", describe)
    if comm.world_size == 1:
        per_rank = [infos]
    else:
        per_rank = [[ShardInfo.from_json(j) for j in rank_infos] for rank_infos in gathered]
    plan = SavePlanner().plan(per_rank)  # pure: raises identically on every rank

    def clear() -> None:
        if comm.rank == 0:
            # Un-publish first: a crash from here on must not leave something
            # that looks like a checkpoint.
            location.remove(METADATA_FILE)
            location.remove(TRAINER_STATE_FILE)
            # TODO(limitation): the arrays of a failed save stay on storage (never
            # mistaken for a checkpoint: no metadata.json) until the next save to
            # the same path removes them here.
            location.remove(_ARRAYS, tree=True)

    run_collectively(comm, "save: clearing the old checkpoint", clear)

    def write() -> None:
        items = []
        for w in plan.for_rank(comm.rank):
            tensor = entries[w.shard][1]
            local = tensor.regions[w.region].global_to_local(w.box)
            items.append((w.path, tensor.dtype, local.view(tensor.data)))
        location.write_arrays(items, stats)
        if ts_blob:
            location.write_file(TRAINER_STATE_FILE, ts_blob[0][0])

    run_collectively(comm, "save: writing", write)

    def commit() -> None:
        if comm.rank == 0:
            metadata = dataclasses.replace(plan.metadata, trainer_state=ts_blob[0][1] if ts_blob else None)
            location.write_file(METADATA_FILE, metadata.dumps().encode("utf-8"))

    run_collectively(comm, "save: commit", commit)


def _read_metadata(location: Location) -> Metadata:
    # TODO(limitation): every rank reads and parses metadata.json itself (about
    # 80 bytes per stored region); rank 0 could parse once and broadcast.
    data = location.read_file(METADATA_FILE)
    if data is None:
        raise CheckpointNotFoundError(
            f"{location} is not a globalshard checkpoint: it has no {METADATA_FILE} "
            "(the save did not complete, or this is not the right path)"
        )
    return parse_metadata(data, source=location.describe(METADATA_FILE))


def _read_trainer_state(location: Location, metadata: Metadata) -> dict[str, Any]:
    if metadata.trainer_state is None:
        return {}
    data = location.read_file(TRAINER_STATE_FILE)
    if data is None:
        raise MetadataError(
            f"{location.describe(METADATA_FILE)} records a {TRAINER_STATE_FILE}, but it is missing"
        )
    return parse_trainer_state(data, metadata.trainer_state)


def read_metadata(path: Any, *, kvstore: Any = None) -> Metadata:
    """The parsed, validated metadata.json of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: there is no metadata.json.
        MetadataError: it is malformed (the message names the JSON path).
    """
    return _read_metadata(Location(path, kvstore))


def read_trainer_state(path: Any, *, kvstore: Any = None) -> dict[str, Any]:
    """The trainer state saved with the checkpoint at ``path`` (empty if none),
    checked against the size and SHA-256 recorded in metadata.json."""
    location = Location(path, kvstore)
    return _read_trainer_state(location, _read_metadata(location))


def load(
    state: Mapping[str, ShardedTensor],
    path: Any,
    *,
    comm: Comm | None = None,
    allow_lossy_cast: bool = False,
    kvstore: Any = None,
    stats: IOStats | None = None,
) -> dict[str, Any]:
    """Fill each ShardedTensor's ``data`` in place from the checkpoint at ``path``.

    The targets may be cut in any way: each reads only the stored chunks that
    intersect its regions. Checkpoint keys not asked for are ignored. The
    target's dtype decides: exact widening conversions happen by themselves;
    others need ``allow_lossy_cast=True``. Padding is zero-filled.

    Everything that can be checked is checked before any target byte is
    written: the checkpoint's metadata and trainer state, missing keys,
    global shapes, dtype conversions, and that every stored array opens.

    ``path`` and ``kvstore`` name the checkpoint as for :func:`save`.

    Returns:
        The trainer state saved with the checkpoint (an empty dict if none).

    Raises:
        CheckpointNotFoundError, MetadataError, MismatchError, CastError,
        StorageError, CommError.
    """
    comm = comm if comm is not None else SingleProcessComm()
    location = Location(path, kvstore)
    entries = _entries(state)
    trainer: list[dict[str, Any]] = []

    def run() -> None:
        metadata = _read_metadata(location)
        trainer.append(_read_trainer_state(location, metadata))
        _fill(location, metadata, entries, allow_lossy_cast, stats)

    run_collectively(comm, "load", run)
    return trainer[0]


def _fill(location: Location, metadata: Metadata, entries: list[tuple[str, ShardedTensor]],
          allow_lossy_cast: bool, stats: IOStats | None) -> None:
    """Plan, check, then read into the targets (no collectives)."""
    plan = LoadPlanner().plan(
        metadata, [ShardInfo.of(t) for _, t in entries], allow_lossy_cast=allow_lossy_cast,
        names=[n for n, _ in entries],
    )
    frozen = [n for n, t in entries if not t.data.flags.writeable]
    if frozen:
        raise LayoutError(f"cannot load into read-only arrays: {frozen}")
    location.read_into(plan, [t.data for _, t in entries], stats)


class Checkpoint:
    """A committed checkpoint opened for reading: metadata.json parsed and
    trainer_state.json checked once, then loaded from as often as needed.

    For callers that look before they load (which keys hold optimizer state,
    what the trainer state says) without reading and parsing twice.

    Raises (on opening): CheckpointNotFoundError, MetadataError, StorageError.
    """

    def __init__(self, path: Any, *, kvstore: Any = None) -> None:
        self._location = Location(path, kvstore)
        self.metadata = _read_metadata(self._location)
        self._trainer_state = _read_trainer_state(self._location, self.metadata)

    @property
    def trainer_state(self) -> dict[str, Any]:
        """The trainer state (a copy: changing it changes nothing stored)."""
        return copy.deepcopy(self._trainer_state)

    def load(self, state: Mapping[str, ShardedTensor], *, comm: Comm | None = None,
             allow_lossy_cast: bool = False, stats: IOStats | None = None) -> dict[str, Any]:
        """As :func:`load`, from this opened checkpoint."""
        entries = _entries(state)
        run_collectively(comm if comm is not None else SingleProcessComm(), "load",
                         lambda: _fill(self._location, self.metadata, entries, allow_lossy_cast, stats))
        return self.trainer_state


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
) -> np.ndarray:
    """Any global box of one tensor, consolidated into a new numpy array.

    For consumers that are not trainers: export, inspection, other frameworks.

    Args:
        key: the checkpoint key.
        box: a :class:`Box` of global indices, or a tuple of slices; the whole
            tensor if None.
        dtype: the dtype of the result (default: the stored dtype); a lossy
            conversion needs ``allow_lossy_cast=True``.
    """
    location = Location(path, kvstore)
    metadata = _read_metadata(location)
    stored = metadata.tensors.get(key)
    if stored is None:
        raise MissingKeyError(f"{key!r}: {missing_key(key, metadata)}")
    want = _as_box(box, stored.global_shape, key)
    if not Box.full(stored.global_shape).contains(want):
        raise MismatchError(f"{key!r}: box {want} is outside the global shape {stored.global_shape}")
    name = canonical_name(dtype) if dtype is not None else stored.dtype
    out = np.empty(want.shape, numpy_dtype(name))
    info = ShardInfo(key, name, stored.global_shape, want.shape, (Region(Box.full(want.shape), want),))
    plan = LoadPlanner().plan(metadata, [info], allow_lossy_cast=allow_lossy_cast)
    location.read_into(plan, [out])
    return out
