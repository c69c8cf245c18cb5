"""Saving: describe, validate and plan on every rank, write, commit on rank 0,
clean up; a failure on any rank raises on every rank and nothing commits."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from globalshard.checkpoint import cleanup
from globalshard.checkpoint.bases import (
    Base,
    Digests,
    Frozen,
    frozen_references,
    open_base,
)
from globalshard.checkpoint.commit import what_is_there
from globalshard.checkpoint.finishing import finish_save
from globalshard.checkpoint.plan_cache import PLANS, PlanCache
from globalshard.checkpoint.replicas import differing_replicas, region_checksums
from globalshard.comm import Comm, SingleProcessComm, distinct_values, json_digest, run_collectively
from globalshard.errors import LayoutError, StorageError
from globalshard.format.metadata import Metadata, gc_paused
from globalshard.format.paths import SAVES_DIR, TRAINER_STATE_FILE, new_save_id, save_dir
from globalshard.format.trainer_state import TrainerStateRef, dump_trainer_state
from globalshard.format.zarr import array_attributes, pack_attributes
from globalshard.io import ArrayEngine, ArrayItem, IOStats, PackItem, engine_name, open_engine
from globalshard.io.base import item_bytes
from globalshard.layout import ShardedTensor
from globalshard.planner import (
    SavePlanner,
    ShardInfo,
    WriteItem,
    check_pack_below,
    describe_shards,
    group_descriptions,
    group_ranks,
    rebased_metadata,
)
from globalshard.store import Store, open_root

__all__ = ["save"]

_log = logging.getLogger("globalshard")


def entries_of(state: Mapping[str, ShardedTensor]) -> list[tuple[str, ShardedTensor]]:
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
    base: Any = None,
    frozen: Iterable[str] = (),
    digests: bool | None = None,
    io: str | None = None,
    unchanged: Digests | None = None,
    check_replicas: bool = False,
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
    Ranks of a save whose structure (keys, shapes, dtypes, regions, replica
    ids, ranks, ``pack_below``) matches a recent save of theirs reuse its plan
    rather than exchange their shard lists and plan again.

    Args:
        state: local names -> :class:`ShardedTensor` (a ShardedStateDict or dict).
        path: a directory, a kvstore URL or a TensorStore kvstore spec dict;
            with ``kvstore``, a relative path inside that kvstore.
        trainer_state: a dict of exact JSON values for trainer_state.json
            (rank 0's is written).
        comm: the communicator; None for a single process.
        overwrite: replace a committed checkpoint at ``path``, or save into a
            non-empty store that holds none. The previous checkpoint stays
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
        base: a committed checkpoint beside ``path`` (the same parent
            directory or prefix; ``kvstore`` applies to it too) whose arrays
            this one may reference instead of storing again (spec section
            5.2): a region is referenced when its key matches ``frozen`` or
            when its SHA-256 equals the one ``base`` recorded for the same key,
            dtype and box. Deleting or replacing the base later makes this
            checkpoint fail to load (never load zeros).
        frozen: keys (or ``fnmatch`` patterns) whose values equal the base's,
            as the caller knows (a frozen pretrained model under LoRA): their
            regions are referenced without being read, copied or hashed. Each
            must be stored in the base with the same dtype and global shape;
            one the base cuts otherwise (a save under another layout) is
            recorded with the base's cut. Needs ``base``.
        digests: record each region's SHA-256, so that later saves can name
            this checkpoint as a base and find equal regions by hashing.
            Default: when ``base`` is given. Hashing reads every byte once
            more, where the writing happens (the writer process of an async save).
        unchanged: keys whose values may equal ``base``'s, each with the
            SHA-256 of each of its regions by global offset as they were
            known to hold those values (:func:`region_digests` of the state
            loaded from the base, gathered from every rank). A key every
            region of which this save stores with the same SHA-256 is stored
            as a ``frozen`` key is (the base's cut, when it stores the key
            so); the others as usual. Hashed from the snapshot where the
            writing happens, before anything is written (an async save
            returns first). Every rank must pass the same. Needs ``base``.
        io: the array engine for a local directory, ``"localio"`` (the
            default) or ``"tensorstore"``; None: ``GLOBALSHARD_IO``, read now.
            Object stores always use TensorStore.
        check_replicas: compare every copy of a region with the others before
            anything is written (a crc32c of each, exchanged with the plan;
            see :mod:`globalshard.checkpoint.replicas`): copies of one box of
            one key (data-parallel replicas, a tensor every rank holds) that
            differ bit for bit raise :class:`MismatchError` on every rank,
            rather than the save keeping one of them. Reads every
            byte once more; copies of another cut of the key are not compared.
            Every rank must pass the same.

    Raises:
        LayoutError, MismatchError (``check_replicas``), MetadataError,
        CheckpointExistsError (ConcurrentSaveError), StorageError, CommError.

    >>> import numpy as np, tempfile
    >>> from globalshard import Box, read_array
    >>> w = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> d = tempfile.mkdtemp()
    >>> save({"w": ShardedTensor.from_offset("w", w, global_shape=(2, 3), global_offset=(0, 0))},
    ...      d, trainer_state={"step": 10})
    >>> read_array(d, "w", Box((1, 0), (1, 3)))
    array([[3., 4., 5.]], dtype=float32)
    >>> import shutil; shutil.rmtree(d)
    """
    # The cyclic GC is paused (see gc_paused): a save makes objects per tensor, none in a cycle.
    with gc_paused():
        _save(state, path, trainer_state, comm, overwrite, kvstore, stats, pack_below,
              {"base": base, "frozen": frozen, "digests": digests, "kvstore": kvstore, "io": io,
               "unchanged": unchanged, "check_replicas": check_replicas})


def _save(state: Mapping[str, ShardedTensor], path: Any, trainer_state: dict[str, Any] | None, comm: Comm | None,
          overwrite: bool, kvstore: Any, stats: IOStats | None, pack_below: int, refs: dict[str, Any]) -> None:
    comm = comm if comm is not None else SingleProcessComm()
    store = open_root(path, kvstore)
    entries = entries_of(state)
    stats = stats if stats is not None else IOStats()
    start = time.perf_counter()
    _log.info("save begins: %s, %d tensors on rank %d of %d", store, len(entries), comm.rank, comm.world_size)
    with contextlib.ExitStack() as held:  # rank 0's lock, held until the cleanup is done
        planned = plan_save(store, comm, entries, trainer_state, overwrite, held, pack_below=pack_below, **refs)
        _log.debug("save %s planned: this rank writes %d arrays, %d bytes", planned.save_id, len(planned.items),
                   sum(item_bytes(item) for item in planned.items))
        finish_save(planned, stats, held)
    log_end("save", store, stats.bytes_written, time.perf_counter() - start)


def log_end(what: str, store: Store, nbytes: int, seconds: float) -> None:
    _log.info("%s done: %s, %d bytes in %.3f s (%.2f GB/s)", what, store, nbytes, seconds,
              nbytes / 1e9 / seconds if seconds > 0 else float("inf"))


@dataclasses.dataclass
class _Coordinator:
    """What rank 0 learns before writing and needs at the commit."""

    stamp: Any = None
    previous: Metadata | None = None
    trainer_blob: tuple[bytes, TrainerStateRef] | None = None


@dataclasses.dataclass
class PlannedSave:
    """A save planned and agreed on by every rank: what this rank writes."""

    store: Store
    engine: ArrayEngine
    comm: Comm
    save_id: str
    #: The metadata rank 0 commits (made when it commits: a reused plan's is
    #: rebased then, not while the caller waits).
    metadata: Callable[[], Metadata]
    items: list[ArrayItem | PackItem]
    coordinator: _Coordinator
    #: The base the save references (spec section 5.2), what its frozen keys
    #: reference, and the arrays to hash: path -> (key, offset, the base's
    #: SHA-256 of the same region or None).
    base: Base | None = None
    frozen: Frozen = dataclasses.field(default_factory=Frozen)
    requests: Mapping[str, tuple[str, tuple[int, ...], str | None]] = dataclasses.field(default_factory=dict)
    #: ``unchanged=``: the SHA-256 each region of those keys had; and the arrays
    #: of those keys this rank writes (path -> (key, offset)), hashed before any is.
    unchanged: Digests = dataclasses.field(default_factory=dict)
    checks: Mapping[str, tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    #: The engine's name (:func:`~globalshard.io.engine_name`), for a writer process to open its own.
    io: str = "localio"


def plan_save(store: Store, comm: Comm, entries: list[tuple[str, ShardedTensor]],
               trainer_state: dict[str, Any] | None, overwrite: bool, held: contextlib.ExitStack,
               staged: Mapping[str, Callable[[], None]] | None = None, *, pack_below: int = 0,
               base: Any = None, frozen: Iterable[str] = (), digests: bool | None = None,
               kvstore: Any = None, io: str | None = None, unchanged: Digests | None = None,
               check_replicas: bool = False) -> PlannedSave:
    """Describe, validate and plan collectively; rank 0 takes the lock into
    ``held`` and finds what the save replaces; every rank reads ``base``;
    with ``check_replicas``, copies of a region are compared. Nothing on
    storage changes."""
    check_pack_below(pack_below)
    io = engine_name(io)  # a bad name fails before anything is planned
    frozen = [frozen] if isinstance(frozen, str) else list(frozen)
    if frozen and base is None:
        raise LayoutError(f"frozen keys {frozen[:5]} need base=: the checkpoint their values are in")
    if unchanged and base is None:
        raise LayoutError(f"unchanged keys {sorted(unchanged)[:5]} need base=: the checkpoint their values are in")
    expected = {k: {tuple(o): d for o, d in m.items()} for k, m in (unchanged or {}).items()}
    unchanged_digest = json_digest(sorted([k, sorted([list(o), d] for o, d in m.items())]
                                          for k, m in expected.items())) if expected else ""
    bases: list[Base] = []
    infos = [ShardInfo.of(t) for _, t in entries]
    coordinator = _Coordinator()

    digest, schema, replicas = describe_shards(infos) if comm.world_size > 1 else ("", [], [])
    held_plans = PLANS.held() if comm.world_size > 1 else {}

    def describe() -> dict[str, Any]:
        # Everything checkable is checked before anything on storage changes.
        out: dict[str, Any] = {"digest": digest, "replicas": replicas, "pack_below": pack_below,
                               "plans": list(held_plans), "unchanged": unchanged_digest,
                               "checksums": region_checksums(entries, staged) if check_replicas else None}
        if base is not None:  # on every rank: each decides for the regions it writes
            bases.append(open_base(store, base, kvstore))
        if comm.rank == 0:
            # TODO(limitation): an earlier save's deletion holds the lock until it ends, so
            # a save (async too) to the path of the save before it blocks until that
            # save's replaced checkpoint is deleted.
            cleanup.wait_for_cleanup()
            save_id = new_save_id()
            if trainer_state is not None:
                ts_path = f"{save_dir(save_id)}/{TRAINER_STATE_FILE}"
                coordinator.trainer_blob = dump_trainer_state(trainer_state, ts_path)
            held.enter_context(store.lock())
            link = store.linked_component(SAVES_DIR)
            if link is not None:  # every rank writes below it: checked before any does
                raise StorageError(f"{store.describe(link)} is a symbolic link; a save creates, writes and "
                                   "deletes nothing through links (remove it)")
            coordinator.previous, coordinator.stamp = what_is_there(store, overwrite)
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
    if len({g["unchanged"] for g in gathered}) > 1:  # every rank takes part in hashing them, or none
        raise LayoutError("ranks passed different unchanged= digests; pass the same (gathered from every rank) "
                          "on every rank")
    if len({g["checksums"] is None for g in gathered}) > 1:
        raise LayoutError("ranks passed different check_replicas values; pass the same on every rank")
    if check_replicas:
        # TODO(limitation): every rank's checksums travel to every rank (about 60 bytes a region),
        # though only the holders of a box's copies need them.
        differing_replicas([g["checksums"] for g in gathered])
    rank_digests = [g["digest"] for g in gathered]
    mine: Sequence[WriteItem] | None = None
    if comm.world_size > 1:
        # A save of the structure of a recent one reuses its plan, when every rank holds it.
        key = PlanCache.key(rank_digests, [g["replicas"] for g in gathered], comm.world_size, pack_below)
        if all(key in g["plans"] for g in gathered):
            cached = held_plans[key]
            mine = PLANS.reuse(key, cached, comm.rank, save_id)
            metadata = functools.partial(rebased_metadata, cached.metadata, save_id)
            shape_of = cached.metadata
    if mine is None:
        if comm.world_size == 1:
            groups = group_ranks([infos])
        else:
            schemas = distinct_values(comm, "save: planning", rank_digests, schema)
            groups = group_descriptions(rank_digests, schemas, [g["replicas"] for g in gathered])
        # TODO(limitation): every rank plans the whole save (identically, from the distinct
        # lists); a planner rank scattering each rank's part is measured, not built.
        plan = SavePlanner().plan_groups(groups, comm.world_size, save_id=save_id,
                                         pack_below=pack_below)  # pure: same verdict everywhere
        if comm.world_size > 1:
            PLANS.put(key, plan)
        mine, shape_of = plan.for_rank(comm.rank), plan.metadata
        metadata = functools.partial(_same, shape_of)
    the_base = bases[0] if bases else None
    # References (spec section 5.2): frozen keys are decided here, alike on every rank
    # (their values are not read); the rest by hashing, where the writing happens.
    frozen_refs = frozen_references(shape_of, the_base, frozen) if the_base is not None and frozen else Frozen()
    hashing = digests if digests is not None else the_base is not None
    requests: dict[str, tuple[str, tuple[int, ...], str | None]] = {}
    checks: dict[str, tuple[str, tuple[int, ...]]] = {}
    items: list[ArrayItem | PackItem] = []
    packs: dict[str, list[tuple[WriteItem, np.ndarray, Callable[[], None] | None]]] = {}
    for w in mine:
        name, tensor = entries[w.shard]
        local = tensor.regions[w.region].global_to_local(w.box)
        ready = staged.get(name) if staged else None
        if w.byte_offset is not None:
            packs.setdefault(w.path, []).append((w, local.view(tensor.data), ready))
            continue
        if frozen_refs.skips(w.key, w.box.offset):
            continue
        theirs = the_base.regions.get((w.key, w.box.offset, w.box.shape)) if the_base is not None else None
        theirs_sha = theirs.region.sha256 if theirs is not None and theirs.dtype == tensor.dtype else None
        if hashing or theirs_sha is not None:
            requests[w.path] = (w.key, w.box.offset, theirs_sha)
        if w.key in expected:
            checks[w.path] = (w.key, w.box.offset)
        cut = tuple(a for a, (n, g) in enumerate(zip(w.box.shape, tensor.global_shape)) if n < g)
        items.append(ArrayItem(w.path, tensor.dtype, local.view(tensor.data),
                               array_attributes(w.key, w.box.offset, save_id), cut, ready))
    for path, members in packs.items():  # after the arrays, each once all its members are ready
        members.sort(key=lambda m: m[0].byte_offset or 0)
        attributes = pack_attributes(save_id, [(w.key, w.box.offset, w.byte_offset, w.nbytes) for w, _, _ in members])
        end = max((w.byte_offset or 0) + w.nbytes for w, _, _ in members)
        items.append(PackItem(path, end, tuple((w.byte_offset or 0, data, ready) for w, data, ready in members),
                              attributes))
    return PlannedSave(store, open_engine(store, io), comm, save_id, metadata, items, coordinator, the_base,
                       frozen_refs, requests, expected if the_base is not None else {}, checks, io)


def _same(metadata: Metadata) -> Metadata:
    return metadata
