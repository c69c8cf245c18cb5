"""The part of a save that follows its plan, collectively: hashing what may
be unchanged, writing, the commit (rank 0, conditionally, spec section 2.1)
and the cleanup; done by this process (:class:`InProcess`) or, for an
asynchronous save, by its writer process (``async_save._InWriter``)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from globalshard.checkpoint import cleanup
from globalshard.checkpoint.bases import hash_checked, settle_unchanged, skip_unchanged, with_references
from globalshard.checkpoint.commit import remember_commit
from globalshard.comm import run_collectively
from globalshard.format.metadata import Metadata
from globalshard.format.paths import METADATA_FILE, save_dir
from globalshard.io import IOStats
from globalshard.store import Store

if TYPE_CHECKING:  # saving imports this module
    from globalshard.checkpoint.saving import PlannedSave

__all__ = ["InProcess", "finish_save", "settle_unchanged_keys"]


class InProcess:
    """The I/O that finishes a save, done by this process (its engine's threads).
    ``unbuffered``: local shards are written around the page cache, as an
    asynchronous save's background part writes them (see
    :mod:`~globalshard.io.localio.unbuffered`)."""

    def __init__(self, *, unbuffered: bool = False) -> None:
        self.unbuffered = unbuffered

    def write(self, planned: PlannedSave, stats: IOStats | None) -> list[list[Any]]:
        """Write this rank's arrays, but those whose SHA-256 equals the base's, and
        the trainer state if this rank holds it; returns the hashes
        (:func:`~globalshard.checkpoint.bases.skip_unchanged`)."""
        items, outcomes = skip_unchanged(planned.items, planned.requests) if planned.requests else \
            (planned.items, [])
        planned.engine.write(items, stats, unbuffered=self.unbuffered)
        if planned.coordinator.trainer_blob is not None:
            data, ref = planned.coordinator.trainer_blob
            planned.store.write(ref.path, data)
        return outcomes

    def hash(self, planned: PlannedSave) -> list[list[Any]]:
        """``[key, offset, sha256]`` of each array of ``planned.checks`` this rank
        writes, from the values it will write (a failed copy is left for the
        write to report)."""
        return hash_checked(planned.items, planned.checks, lambda item: item.data)

    def commit(self, store: Store, metadata: Metadata, stamp: Any) -> bytes:
        """Commit ``metadata`` (spec section 2.1); returns the bytes written."""
        data = metadata.dumps().encode("utf-8")
        store.commit(METADATA_FILE, data, stamp)
        return data

    def cleanup(self, store: Store, previous: Metadata | None, save_id: str) -> None:
        """Delete what the commit replaced, and leftovers (spec 2.1, 2.2)."""
        cleanup.remove_superseded(store, previous, save_id)

    def remove(self, store: Store, name: str) -> None:
        """Delete ``name`` (a failed save's directory), logging a failure."""
        cleanup.remove_quietly(store, name)


def finish_save(planned: PlannedSave, stats: IOStats | None, held: contextlib.ExitStack,
                ops: InProcess | None = None) -> None:
    """Write, commit (rank 0, conditionally) and clean up, collectively; a large
    replaced checkpoint is deleted in the background, which takes over the lock
    in ``held``. ``ops`` does the I/O (by default this process: :class:`InProcess`)."""
    store, comm, save_id, coordinator = planned.store, planned.comm, planned.save_id, planned.coordinator
    io = ops if ops is not None else InProcess()

    hashed: list[list[Any]] = []

    def commit() -> None:
        if comm.rank == 0:
            ref = coordinator.trainer_blob[1] if coordinator.trainer_blob is not None else None
            metadata = with_references(planned.metadata(), planned.base, planned.frozen, hashed)
            metadata = dataclasses.replace(metadata, trainer_state=ref)
            remember_commit(store, io.commit(store, metadata, coordinator.stamp), metadata)

    try:
        planned = settle_unchanged_keys(planned, io, "save")
        _, outcomes = run_collectively(comm, "save: writing", lambda: io.write(planned, stats))
        hashed.extend(o for rank in outcomes for o in rank or [])
        run_collectively(comm, "save: commit", commit)
    except BaseException:
        if comm.rank == 0:  # every rank has stopped writing: the collective above returned
            io.remove(store, save_dir(save_id))
        raise
    if comm.rank == 0:
        previous = coordinator.previous
        if previous is not None and previous.stored_bytes() >= cleanup.BACKGROUND_DELETE_BYTES:
            cleanup.delete_in_background(f"the checkpoint replaced at {store}",
                                         lambda: io.cleanup(store, previous, save_id), holding=held.pop_all())
        else:
            io.cleanup(store, previous, save_id)
    comm.barrier()


def settle_unchanged_keys(planned: PlannedSave, io: InProcess, doing: str) -> PlannedSave:
    """``planned`` with the keys of ``unchanged=`` that every rank found
    unchanged, hashed by ``io`` from the values to be saved, referenced as
    frozen keys are, their arrays not written: the same on every rank.
    Collective (``doing`` names the save in errors) when there are such keys."""
    if not planned.unchanged:  # the same on every rank
        return planned
    _, found = run_collectively(planned.comm, f"{doing}: hashing keys that may be unchanged",
                                lambda: io.hash(planned))
    hashed = [o for rank in found for o in rank or []]
    if planned.base is None:
        return planned
    metadata = planned.metadata()  # built once (a reused plan's is rebased): the commit takes the same
    frozen, dropped = settle_unchanged(metadata, planned.base, planned.frozen, planned.unchanged, planned.checks,
                                       hashed)
    return dataclasses.replace(planned, metadata=lambda: metadata, frozen=frozen, unchanged={}, checks={},
                               items=[i for i in planned.items if i.path not in dropped],
                               requests={p: r for p, r in planned.requests.items() if p not in dropped})
