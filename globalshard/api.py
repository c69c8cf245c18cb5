"""save, load, read_metadata, read_array: orchestration only.

Geometry, validation and planning live in pure modules; TensorStore lives in
:mod:`globalshard.storage`. This module sequences them and coordinates ranks
through a :class:`~globalshard.comm.Comm`, so that a failure on any rank
raises on every rank and a failed save never commits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from globalshard.comm import Comm, SingleProcessComm, distinct_values, run_collectively
from globalshard.dtypes import canonical_name, numpy_dtype
from globalshard.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    GlobalShardError,
    LayoutError,
    MetadataError,
    MismatchError,
    MissingKeyError,
    StorageError,
)
from globalshard.geometry import Box, Region
from globalshard.layout import ShardedTensor
from globalshard.metadata import (
    METADATA_FILE,
    TRAINER_STATE_FILE,
    Metadata,
    TrainerStateRef,
    dump_trainer_state,
    gc_paused,
    is_save_id,
    parse_metadata,
    parse_trainer_state,
)
from globalshard.planner import (
    SAVES_DIR,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    ShardInfo,
    WriteItem,
    check_pack_below,
    describe_shards,
    group_descriptions,
    group_ranks,
    missing_key,
    save_dir,
)
from globalshard.shared import read_shared, require_exchange
from globalshard.storage import (
    LOCK_FILE,
    ArrayItem,
    IOStats,
    Location,
    OpenedPlan,
    PackExpect,
    PackItem,
    array_attributes,
    item_bytes,
    pack_attributes,
    pack_expect,
)

_log = logging.getLogger("globalshard")
#: An unlisted save directory on a kvstore root older than this is a leftover (spec 2.2).
_LEFTOVER_AGE_MS = 24 * 3600 * 1000

__all__ = ["AsyncSaver", "Checkpoint", "load", "read_array", "read_metadata", "read_trainer_state", "save",
           "wait_for_cleanup"]

#: A replaced checkpoint storing at least this many bytes is deleted by a
#: background thread of rank 0 once the new one is committed, so that save
#: returns without waiting for it (freeing 1 GiB of files takes 0.3 s here;
#: ``bench/compare.py``). The thread holds the root's lock until it is done.
BACKGROUND_DELETE_BYTES = 64 << 20

_deleting: list[threading.Thread] = []  # this process's background deletions still running
_deleting_lock = threading.Lock()


def wait_for_cleanup() -> None:
    """Wait until this process has finished deleting the checkpoints its saves replaced.

    A save that replaces a checkpoint of :data:`BACKGROUND_DELETE_BYTES` or
    more returns once the new one is committed and deletes the old one in a
    background thread of rank 0, holding the root's lock meanwhile. The next
    save of this process waits for it first, and so does the interpreter at
    exit; call this to wait earlier (before copying or removing the
    directory, say)."""
    while True:
        with _deleting_lock:
            if not _deleting:
                return
            thread = _deleting[0]
        thread.join()
        with _deleting_lock:
            if thread in _deleting:
                _deleting.remove(thread)


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
    pack_below: int = 0,
) -> None:
    """Save this rank's shards as (part of) one checkpoint.

    Every rank calls ``save`` with its own shards and the same ``path``. The
    shards of all ranks are validated together; each region is written once,
    by a writer chosen to balance bytes across ranks, under a directory of
    this save's own; then rank 0 commits by replacing metadata.json
    atomically, and only if no other save committed meanwhile. If anything
    fails on any rank, every rank raises, nothing is committed and the
    previous checkpoint at ``path`` (if any) is untouched. Two saves racing on
    one path: one commits, the other raises :class:`ConcurrentSaveError`.

    Args:
        state: local names -> :class:`ShardedTensor` (a ShardedStateDict or dict).
        path: a directory, a kvstore URL or a TensorStore kvstore spec dict;
            with ``kvstore``, a relative path inside that kvstore.
        trainer_state: a dict of exact JSON values for trainer_state.json
            (rank 0's is written).
        comm: the communicator; None for a single process.
        overwrite: replace a committed checkpoint at ``path``, or save into a
            non-empty location that holds none. The previous checkpoint stays
            loadable until this save commits; then only what its
            metadata.json lists is deleted.
        kvstore: a TensorStore kvstore spec (dict or URL: S3, GCS, OCDBT, ...)
            holding the checkpoint at ``path``.
        stats: an :class:`IOStats` to fill with this rank's figures.
        pack_below: store every region of fewer than this many bytes (at most
            16 MiB) packed with the other small regions its writer stores,
            in a few arrays rather than one each (spec section 5.1): for
            states of thousands of small tensors. 0 (default): no packs.
            Every rank must pass the same value.

    Raises:
        LayoutError, MetadataError, CheckpointExistsError (ConcurrentSaveError),
        StorageError, CommError.

    >>> import numpy as np, tempfile
    >>> w = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> d = tempfile.mkdtemp()
    >>> save({"w": ShardedTensor.from_offset("w", w, global_shape=(2, 3), global_offset=(0, 0))},
    ...      d, trainer_state={"step": 10})
    >>> read_array(d, "w", Box((1, 0), (1, 3)))
    array([[3., 4., 5.]], dtype=float32)
    """
    # The cyclic GC is paused (see gc_paused): a save makes objects per tensor, none in a cycle.
    with gc_paused():
        _save(state, path, trainer_state, comm, overwrite, kvstore, stats, pack_below)


def _save(state: Mapping[str, ShardedTensor], path: Any, trainer_state: dict[str, Any] | None, comm: Comm | None,
          overwrite: bool, kvstore: Any, stats: IOStats | None, pack_below: int) -> None:
    comm = comm if comm is not None else SingleProcessComm()
    location = Location(path, kvstore)
    entries = _entries(state)
    stats = stats if stats is not None else IOStats()
    start = time.perf_counter()
    _log.info("save begins: %s, %d tensors on rank %d of %d", location, len(entries), comm.rank, comm.world_size)
    with contextlib.ExitStack() as held:  # rank 0's lock, held until the cleanup is done
        planned = _plan_save(location, comm, entries, trainer_state, overwrite, held, pack_below=pack_below)
        _log.debug("save %s planned: this rank writes %d arrays, %d bytes", planned.save_id, len(planned.items),
                   sum(item_bytes(item) for item in planned.items))
        _finish_save(planned, stats, held)
    _log_end("save", location, stats.bytes_written, time.perf_counter() - start)


def _log_end(what: str, location: Location, nbytes: int, seconds: float) -> None:
    _log.info("%s done: %s, %d bytes in %.3f s (%.2f GB/s)", what, location, nbytes, seconds,
              nbytes / 1e9 / seconds if seconds > 0 else float("inf"))


@dataclasses.dataclass
class _Coordinator:
    """What rank 0 learns before writing and needs at the commit."""

    stamp: Any = None
    previous: Metadata | None = None
    trainer_blob: tuple[bytes, TrainerStateRef] | None = None


@dataclasses.dataclass
class _PlannedSave:
    """A save planned and agreed on by every rank: what this rank writes."""

    location: Location
    comm: Comm
    save_id: str
    plan: SavePlan
    items: list[ArrayItem | PackItem]
    coordinator: _Coordinator


def _plan_save(location: Location, comm: Comm, entries: list[tuple[str, ShardedTensor]],
               trainer_state: dict[str, Any] | None, overwrite: bool, held: contextlib.ExitStack,
               staged: Mapping[str, Callable[[], None]] | None = None, *, pack_below: int = 0) -> _PlannedSave:
    """Describe, validate and plan collectively; rank 0 takes the lock into
    ``held`` and finds what the save replaces. Nothing on storage changes."""
    check_pack_below(pack_below)
    infos = [ShardInfo.of(t) for _, t in entries]
    coordinator = _Coordinator()

    digest, schema, replicas = describe_shards(infos) if comm.world_size > 1 else ("", [], [])

    def describe() -> dict[str, Any]:
        # Everything checkable is checked before anything on storage changes.
        out: dict[str, Any] = {"digest": digest, "replicas": replicas, "pack_below": pack_below}
        if comm.rank == 0:
            # TODO(limitation): an earlier save's deletion holds the lock until it ends, so
            # a save (async too) to the path of the save before it blocks until that
            # save's replaced checkpoint is deleted (512 MiB: +0.2-0.27 s blocked).
            wait_for_cleanup()
            save_id = new_save_id()
            if trainer_state is not None:
                ts_path = f"{save_dir(save_id)}/{TRAINER_STATE_FILE}"
                coordinator.trainer_blob = dump_trainer_state(trainer_state, ts_path)
            held.enter_context(location.lock())
            link = location.linked_component(SAVES_DIR)
            if link is not None:  # every rank writes below it: checked before any does
                raise StorageError(f"{location.describe(link)} is a symbolic link; a save creates, writes and "
                                   "deletes nothing through links (remove it)")
            coordinator.previous, coordinator.stamp = _what_is_there(location, overwrite)
            out["save_id"] = save_id
        return out

    # Ranks exchange digests of their shard lists, then each distinct list once
    # (data-parallel replicas share theirs): at TP=8 x DP=512 every rank receives
    # 8 lists rather than 4096 (bench/run.py measures both).
    _, gathered = run_collectively(comm, "save: planning", describe)
    save_id = gathered[0]["save_id"]
    packing = {g["pack_below"] for g in gathered}
    if len(packing) > 1:  # the plan must be the same on every rank
        raise LayoutError(f"ranks passed different pack_below values: {sorted(packing)}; pass the same on every rank")
    digests = [g["digest"] for g in gathered]
    if comm.world_size == 1:
        groups = group_ranks([infos])
    else:
        schemas = distinct_values(comm, "save: planning", digests, schema)
        groups = group_descriptions(digests, schemas, [g["replicas"] for g in gathered])
    # TODO(limitation): every rank plans the whole save (identically, from the distinct
    # lists); a planner rank scattering each rank's part is measured, not built.
    plan = SavePlanner().plan_groups(groups, comm.world_size, save_id=save_id,
                                     pack_below=pack_below)  # pure: same verdict everywhere
    items: list[ArrayItem | PackItem] = []
    packs: dict[str, list[tuple[WriteItem, np.ndarray, Callable[[], None] | None]]] = {}
    for w in plan.for_rank(comm.rank):
        name, tensor = entries[w.shard]
        local = tensor.regions[w.region].global_to_local(w.box)
        ready = staged.get(name) if staged else None
        if w.byte_offset is not None:
            packs.setdefault(w.path, []).append((w, local.view(tensor.data), ready))
            continue
        cut = tuple(a for a, (n, g) in enumerate(zip(w.box.shape, tensor.global_shape)) if n < g)
        items.append(ArrayItem(w.path, tensor.dtype, local.view(tensor.data),
                               array_attributes(w.key, w.box.offset, save_id), cut, ready))
    for path, members in packs.items():  # after the arrays, each once all its members are ready
        members.sort(key=lambda m: m[0].byte_offset or 0)
        attributes = pack_attributes(save_id, [(w.key, w.box.offset, w.byte_offset, w.nbytes) for w, _, _ in members])
        end = max((w.byte_offset or 0) + w.nbytes for w, _, _ in members)
        items.append(PackItem(path, end, tuple((w.byte_offset or 0, data, ready) for w, data, ready in members),
                              attributes))
    return _PlannedSave(location, comm, save_id, plan, items, coordinator)


def _finish_save(planned: _PlannedSave, stats: IOStats | None, held: contextlib.ExitStack) -> None:
    """Write, commit (rank 0, conditionally) and clean up, collectively; a large
    replaced checkpoint is deleted in the background, which takes over the lock
    in ``held``."""
    location, comm, save_id, coordinator = planned.location, planned.comm, planned.save_id, planned.coordinator

    def write() -> None:
        location.write_arrays(planned.items, stats)
        if coordinator.trainer_blob is not None:
            data, ref = coordinator.trainer_blob
            location.write_file(ref.path, data)

    def commit() -> None:
        if comm.rank == 0:
            ref = coordinator.trainer_blob[1] if coordinator.trainer_blob is not None else None
            metadata = dataclasses.replace(planned.plan.metadata, trainer_state=ref)
            location.commit(METADATA_FILE, metadata.dumps().encode("utf-8"), coordinator.stamp)

    try:
        run_collectively(comm, "save: writing", write)
        run_collectively(comm, "save: commit", commit)
    except BaseException:
        if comm.rank == 0:  # every rank has stopped writing: the collective above returned
            _remove_quietly(location, save_dir(save_id))
        raise
    if comm.rank == 0:
        previous = coordinator.previous
        if previous is not None and previous.stored_bytes() >= BACKGROUND_DELETE_BYTES:
            delete_in_background(f"the checkpoint replaced at {location}",
                                 lambda: _remove_superseded(location, previous, save_id), holding=held.pop_all())
        else:
            _remove_superseded(location, previous, save_id)
    comm.barrier()


def delete_in_background(what: str, delete: Callable[[], None], *,
                         holding: contextlib.ExitStack | None = None) -> None:
    """Run ``delete`` in a thread that :func:`wait_for_cleanup` (so the next
    save) waits for, then close ``holding`` (a lock it keeps meanwhile). Not a
    daemon: the interpreter waits for it at exit. A failure is logged, naming
    ``what``: what it deletes is no longer part of any checkpoint."""

    def run() -> None:
        with holding if holding is not None else contextlib.nullcontext():
            try:
                delete()
            except BaseException:  # nothing committed depends on it: say so, raise nowhere
                _log.exception("deleting %s failed", what)

    thread = threading.Thread(target=run, name="globalshard-delete")
    with _deleting_lock:
        _deleting.append(thread)
    thread.start()


class AsyncSaver:
    """Saves that return once this rank's data is copied to host memory, and
    write, commit and clean up in a background thread.

    :meth:`save` does in the caller's thread everything that can fail before
    storage changes (describing, validating and planning on every rank; rank
    0 takes the checkpoint's lock), then copies exactly the bytes this rank
    will write into a host buffer that the saver keeps and reuses (host
    memory stays at one snapshot, however many saves), and returns. The
    arrays may then change: the checkpoint holds the values they had.

    One save at a time: :meth:`save` first waits for the previous one (and
    raises its error, if it failed). Call :meth:`wait` before the process
    exits, and before loading with the same communicator (its collectives
    run in the background thread meanwhile). A crash during the background
    part leaves the previous checkpoint as it was (spec section 2.1).

    >>> import numpy as np, tempfile
    >>> w = np.ones((2, 3), np.float32)
    >>> saver, d = AsyncSaver(), tempfile.mkdtemp()
    >>> saver.save({"w": ShardedTensor.from_offset("w", w, global_shape=(2, 3), global_offset=(0, 0))}, d)
    >>> w[:] = 7  # training goes on
    >>> saver.wait()
    >>> float(read_array(d, "w")[0, 0])
    1.0
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffer: np.ndarray | None = None
        #: Seconds the last :meth:`save` blocked the caller, and the copy's share of them.
        self.blocking_seconds = 0.0
        self.snapshot_seconds = 0.0

    def save(self, state: Mapping[str, ShardedTensor], path: Any, *, trainer_state: dict[str, Any] | None = None,
             comm: Comm | None = None, overwrite: bool = False, kvstore: Any = None,
             stats: IOStats | None = None, staged: Mapping[str, Callable[[], None]] | None = None,
             pack_below: int = 0) -> None:
        """As :func:`save`, returning after the host snapshot (see the class).

        ``staged``: names of ``state`` whose ``data`` is already a private host
        copy that is still being filled (a device-to-host copy in flight), each
        with a function that blocks until it is done. Those are not copied
        into the snapshot: the background writer waits for each one just
        before writing its bytes, so the copies overlap with the writes of the
        arrays before them.
        """
        self.wait()
        start = time.perf_counter()
        comm = comm if comm is not None else SingleProcessComm()
        location = Location(path, kvstore)
        entries = _entries(state)
        unknown = sorted(set(staged or {}) - {name for name, _ in entries})
        if unknown:
            raise LayoutError(f"staged names {unknown[:5]} are not in the state")
        held = contextlib.ExitStack()
        try:
            planned = _plan_save(location, comm, entries, trainer_state, overwrite, held, staged,
                                 pack_below=pack_below)
            copied = time.perf_counter()
            planned.items = self._snapshot(planned.items)
            self.snapshot_seconds = time.perf_counter() - copied
        except BaseException:
            held.close()
            raise

        def background() -> None:
            try:
                with held:
                    _finish_save(planned, stats, held)
            except BaseException as e:  # raised by wait() in the caller's thread
                self._error = e

        self._thread = threading.Thread(target=background, name="globalshard-save")
        self._thread.start()
        self.blocking_seconds = time.perf_counter() - start

    def _snapshot(self, items: list[ArrayItem | PackItem]) -> list[ArrayItem | PackItem]:
        arrays = [(i.data, i.ready) for i in items if isinstance(i, ArrayItem)]
        arrays += [(data, ready) for i in items if isinstance(i, PackItem) for _, data, ready in i.members]
        total = sum(data.nbytes for data, ready in arrays if ready is None)
        if self._buffer is None or self._buffer.nbytes < total:
            self._buffer = np.empty(total, np.uint8)
        offset = 0

        def copied(array: np.ndarray, ready: Callable[[], None] | None) -> np.ndarray:
            nonlocal offset
            if ready is not None:  # a private copy already, still being filled
                return array
            native = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
            copy = np.ndarray(array.shape, native, buffer=self._buffer, offset=offset)
            np.copyto(copy, array)
            offset += array.nbytes
            return copy

        out: list[ArrayItem | PackItem] = []
        for item in items:
            if isinstance(item, PackItem):
                out.append(item._replace(members=tuple((b, copied(data, ready), ready)
                                                       for b, data, ready in item.members)))
            else:
                out.append(item._replace(data=copied(item.data, item.ready)))
        return out

    def done(self) -> bool:
        """Whether no save is in flight."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def new_save_id() -> str:
    """A fresh save id: the time in milliseconds, then 80 random bits (spec section 2)."""
    return f"{int(time.time() * 1000) & (16**12 - 1):012x}{secrets.token_hex(10)}"


def _ours(name: str) -> bool:
    """Whether a name at a root belongs to this format (so a root holding only
    such names is not someone else's directory)."""
    return name in (METADATA_FILE, LOCK_FILE, SAVES_DIR) or name.startswith(f".{METADATA_FILE}.tmp-")


def _what_is_there(location: Location, overwrite: bool) -> tuple[Metadata | None, Any]:
    """The checkpoint a save would replace (and the stamp its commit checks),
    refusing what the caller did not ask to replace."""
    data, stamp = location.read_stamped(METADATA_FILE)
    if data is None:
        foreign = [n for n in location.listing() if not _ours(n)]
        if foreign and not overwrite:
            raise CheckpointExistsError(
                f"{location} is not empty and holds no checkpoint ({', '.join(map(repr, foreign[:5]))}"
                f"{', ...' if len(foreign) > 5 else ''}); pass overwrite=True to save into it anyway "
                "(nothing already there is deleted)"
            )
        return None, stamp
    try:
        previous = parse_metadata(data, source=location.describe(METADATA_FILE))
    except MetadataError as e:
        raise CheckpointExistsError(
            f"{location.describe(METADATA_FILE)} exists but is not a valid globalshard checkpoint, so a save "
            f"cannot tell what it may delete; remove it by hand if it is not needed ({e})"
        ) from None
    if not overwrite:
        raise CheckpointExistsError(f"{location} already holds a checkpoint; pass overwrite=True to replace it")
    return previous, stamp


def _remove_quietly(location: Location, name: str, *, tree: bool = True) -> None:
    try:
        location.remove(name, tree=tree)
    except GlobalShardError as e:
        _log.warning("could not remove %s: %s", location.describe(name), e)


def _remove_superseded(location: Location, previous: Metadata | None, save_id: str) -> None:
    """After a commit: delete what the replaced checkpoint listed, then (under
    the lock, or when old enough) leftovers of saves that died (spec 2.1, 2.2).
    Failures are logged, not raised: the new checkpoint is committed."""
    if previous is not None:
        for path in previous.paths():
            is_array = previous.trainer_state is None or path != previous.trainer_state.path
            _remove_quietly(location, path, tree=is_array)
        if previous.version == 1:
            _remove_quietly(location, TRAINER_STATE_FILE, tree=False)
            location.remove_empty_parents([p for p in previous.paths() if p != TRAINER_STATE_FILE])
    now_ms = int(time.time() * 1000)
    try:
        for name in location.listing(SAVES_DIR):
            if name == save_id or not is_save_id(name):
                continue
            # TODO(limitation): on a kvstore nothing tells a dead save from a running one,
            # so an unlisted save directory is swept only once it is a day old.
            if location.local is not None or now_ms - int(name[:12], 16) > _LEFTOVER_AGE_MS:
                _remove_quietly(location, f"{SAVES_DIR}/{name}")
        if location.local is not None:
            for name in location.listing():
                if name.startswith(f".{METADATA_FILE}.tmp-"):
                    _remove_quietly(location, name, tree=False)
    except GlobalShardError as e:
        _log.warning("could not look for leftovers of earlier saves in %s: %s", location, e)


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
    data = location.read_file(metadata.trainer_state.path)
    if data is None:
        raise MetadataError(
            f"{location.describe(METADATA_FILE)} records a trainer state at {metadata.trainer_state.path}, "
            "but it is missing"
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
    shared_reads: bool = False,
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

    Returns:
        The trainer state saved with the checkpoint (an empty dict if none).

    Raises:
        CheckpointNotFoundError, MetadataError, MismatchError, CastError,
        StorageError, CommError.
    """
    checkpoint: list[Checkpoint] = []

    def open_() -> None:
        checkpoint.append(Checkpoint(path, kvstore=kvstore))

    # Every rank must find the checkpoint before any rank plans against it.
    with gc_paused():  # as in Checkpoint.load
        run_collectively(comm if comm is not None else SingleProcessComm(), "load: opening", open_)
        return checkpoint[0].load(state, comm=comm, allow_lossy_cast=allow_lossy_cast, stats=stats,
                                  shared_reads=shared_reads)


def _expected_attributes(metadata: Metadata, plan: LoadPlan) -> dict[str, dict[str, Any] | PackExpect | None]:
    """What each array and pack a plan reads must say of itself (None in version 1)."""
    out: dict[str, dict[str, Any] | PackExpect | None] = {}
    for key in {t.key for t in plan.targets}:
        for r in metadata.tensors[key].regions:
            if r.path in plan.arrays:
                out[r.path] = array_attributes(key, r.box.offset, metadata.save_id) if metadata.save_id else None
    for path, regions in plan.packs.items():
        assert metadata.save_id is not None  # packs exist from version 2
        out[path] = pack_expect(metadata.save_id, regions)
    return out


def _open_for(location: Location, metadata: Metadata, infos: list[ShardInfo], names: list[str] | None,
              allow_lossy_cast: bool) -> OpenedPlan:
    """Plan a load and open and check every array it reads: no data read."""
    plan = LoadPlanner().plan(metadata, infos, allow_lossy_cast=allow_lossy_cast, names=names)
    with _saying_if_replaced(location, metadata):
        return location.open_plan(plan, _expected_attributes(metadata, plan))


@contextlib.contextmanager
def _saying_if_replaced(location: Location, metadata: Metadata) -> Iterator[None]:
    """A replaced checkpoint's arrays are deleted after the new commit: when
    reading them fails for that reason, say so."""
    try:
        yield
    except StorageError as e:
        try:
            now = _read_metadata(location)
        except GlobalShardError:
            raise e from None
        if now.save_id != metadata.save_id:
            raise StorageError(f"the checkpoint at {location} was replaced by another save after it was opened "
                               f"(save {metadata.save_id} -> {now.save_id}); open it again\n{e}") from None
        raise


def _read(location: Location, metadata: Metadata, opened: OpenedPlan, datas: list[np.ndarray],
          stats: IOStats | None) -> None:
    with _saying_if_replaced(location, metadata):
        location.read_opened(opened, datas, stats)


class Checkpoint:
    """A committed checkpoint opened for reading: metadata.json parsed and
    the trainer state checked once, then loaded from as often as needed.

    For callers that look before they load (which keys hold optimizer state,
    what the trainer state says) without reading and parsing twice. The
    handle keeps reading the save it opened: if the checkpoint is replaced
    meanwhile, a load fails with a clear error rather than mix the two.

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
             allow_lossy_cast: bool = False, stats: IOStats | None = None,
             shared_reads: bool = False) -> dict[str, Any]:
        """As :func:`load`, from this opened checkpoint.

        Two collective steps: every rank plans, checks its targets and opens
        and checks every array it will read; only when all ranks succeeded
        does any rank write a target byte.
        """
        # The cyclic GC is paused (see gc_paused): a load makes objects per
        # tensor and per chunk, none in a cycle; 10,000 small tensors set off
        # 2 full collections and 18 of the middle generation, 0.13 s of a 1 s load.
        with gc_paused():
            return self._load(state, comm, allow_lossy_cast, stats, shared_reads)

    def _load(self, state: Mapping[str, ShardedTensor], comm: Comm | None, allow_lossy_cast: bool,
              stats: IOStats | None, shared_reads: bool) -> dict[str, Any]:
        comm = comm if comm is not None else SingleProcessComm()
        shared_reads = shared_reads and comm.world_size > 1
        if shared_reads:
            require_exchange(comm)  # before anything is planned, on every rank alike
        entries = _entries(state)
        opened: list[OpenedPlan] = []
        stats = stats if stats is not None else IOStats()
        start, before = time.perf_counter(), stats.bytes_read
        _log.info("load begins: %s, %d targets on rank %d of %d", self._location, len(entries), comm.rank,
                  comm.world_size)

        def check() -> None:
            frozen = [n for n, t in entries if not t.data.flags.writeable]
            if frozen:
                raise LayoutError(f"cannot load into read-only arrays: {frozen}")
            opened.append(_open_for(self._location, self.metadata, [ShardInfo.of(t) for _, t in entries],
                                    [n for n, _ in entries], allow_lossy_cast))

        run_collectively(comm, "load: checking", check)
        _log.debug("load planned: %d stored arrays opened and checked, %d target reads", len(opened[0].plan.arrays),
                   sum(len(t.reads) for t in opened[0].plan.targets))
        datas = [t.data for _, t in entries]
        if shared_reads:
            def read(plan: LoadPlan, into: list[np.ndarray], st: IOStats) -> None:
                _read(self._location, self.metadata, dataclasses.replace(opened[0], plan=plan), into, st)

            read_shared(comm, opened[0].plan, datas, read, stats)
        else:
            run_collectively(comm, "load: reading", lambda: _read(self._location, self.metadata, opened[0], datas,
                                                                  stats))
        _log_end("load", self._location, stats.bytes_read - before, time.perf_counter() - start)
        return self.trainer_state


    def read_array(self, key: str, box: Box | tuple[slice, ...] | None = None, *, dtype: Any = None,
                   allow_lossy_cast: bool = False) -> np.ndarray:
        """As :func:`read_array`, from this opened checkpoint (metadata.json not read again)."""
        return _read_array(self._location, self.metadata, key, box, dtype, allow_lossy_cast)

    def verify(self, *, workers: int = 1,
               progress: Callable[[int], None] | None = None) -> tuple[list[str], int]:
        """Read and checksum every stored byte in bounded memory, ``workers``
        arrays at a time. Returns ``(problems, bytes read)``: one line per
        damaged or foreign array, naming its key, box and file (none: sound).
        ``progress(nbytes)`` is called as each array is done."""
        jobs: list[tuple[str, str, Any]] = []
        packs: dict[str, list[tuple[str, Any]]] = {}
        for key in sorted(self.metadata.tensors):
            t = self.metadata.tensors[key]
            for r in t.regions:
                if r.byte_offset is None:
                    jobs.append((key, t.dtype, r))
                else:
                    packs.setdefault(r.path, []).append((key, r))
        jobs += [("", "uint8", path) for path in sorted(packs)]  # each pack once, with every region in it

        def one(job: tuple[str, str, Any]) -> tuple[str | None, int]:
            key, dtype, r = job
            if isinstance(r, str):  # a pack
                members = sorted(packs[r], key=lambda m: m[1].byte_offset)
                assert self.metadata.save_id is not None
                expect = PackExpect(self.metadata.save_id, tuple((k, m.box.offset, m.byte_offset, m.nbytes)
                                                                 for k, m in members))
                try:
                    return None, self._location.verify_array(r, "uint8", None, expect)
                except GlobalShardError as e:
                    lost = self._unreadable(members)  # the regions in its damaged chunks
                    names = ", ".join(f"{k} {m.box}" for k, m in lost[:20])
                    more = f" and {len(lost) - 20} more" if len(lost) > 20 else ""
                    return (f"pack {r}: {e}\nregions of the pack that cannot be read: {names}{more}",
                            sum(m.nbytes for _, m in members))
            want = array_attributes(key, r.box.offset, self.metadata.save_id) if self.metadata.save_id else None
            try:
                return None, self._location.verify_array(r.path, dtype, r.box.shape, want)
            except GlobalShardError as e:
                return f"{key} {r.box} ({r.path}): {e}", r.nbytes

        problems, nbytes = [], 0
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            for problem, n in pool.map(one, jobs):
                if problem is not None:
                    problems.append(problem)
                else:
                    nbytes += n
                if progress is not None:
                    progress(n)
        return problems, nbytes


    def _unreadable(self, members: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The packed regions (``(key, StoredRegion)``) that fail to read, each tried alone."""
        out = []
        for key, region in members:
            try:
                self.read_array(key, region.box)
            except GlobalShardError:
                out.append((key, region))
        return out


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
    return _read_array(location, _read_metadata(location), key, box, dtype, allow_lossy_cast)


def _read_array(location: Location, metadata: Metadata, key: str, box: Box | tuple[slice, ...] | None,
                dtype: Any, allow_lossy_cast: bool) -> np.ndarray:
    stored = metadata.tensors.get(key)
    if stored is None:
        raise MissingKeyError(f"{key!r}: {missing_key(key, metadata)}")
    want = _as_box(box, stored.global_shape, key)
    if not Box.full(stored.global_shape).contains(want):
        raise MismatchError(f"{key!r}: box {want} is outside the global shape {stored.global_shape}")
    name = canonical_name(dtype) if dtype is not None else stored.dtype
    info = ShardInfo(key, name, stored.global_shape, want.shape, (Region(Box.full(want.shape), want),))
    opened = _open_for(location, metadata, [info], None, allow_lossy_cast)
    out = np.empty(want.shape, numpy_dtype(name))  # only once the stored arrays are found and checked
    _read(location, metadata, opened, [out], None)
    return out
