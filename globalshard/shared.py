"""Shared reads: stored bytes that several ranks need are read once and sent.

Data-parallel replicas loading the same layout need the same stored bytes. With
``load(..., shared_reads=True)`` each such piece is read from storage by one of
the ranks that need it (its *owner*) and sent to the others point to point over
the communicator; on object storage, where every byte read is a request billed
and waited for, a group of ``n`` replicas reads ``1/n`` of what it did.

The steps, on every rank of the load:

1. each rank lists the pieces its load plan reads (path and box of each stored
   read); ranks exchange digests of their lists, then each distinct list once;
2. :func:`plan_sharing` (pure, the same on every rank) picks an owner for every
   piece two or more ranks need: largest first to the needing rank that reads
   the fewest bytes so far, ties to the lower rank;
3. in windows of at most :data:`WINDOW_BYTES` of shared pieces (the first one
   also does every rank's unshared reads), each owner reads its pieces into
   host buffers, verifying every checksum as a plain load does; all ranks
   agree that every read succeeded before any byte is sent; then the owners
   send and the others receive, and each rank copies the pieces into its
   targets (converting the dtype when the target's differs).

The communicator must have :meth:`exchange` (see :class:`Exchange`); the torch
adapter's does, over its gloo group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from globalshard.comm import Comm, distinct_values, json_digest, run_collectively
from globalshard.dtypes import cast_into, numpy_dtype
from globalshard.errors import CommError
from globalshard.geometry import Box
from globalshard.planner import LoadPlan, ReadItem, TargetPlan

__all__ = ["WINDOW_BYTES", "Exchange", "Piece", "SharedRead", "plan_sharing", "read_shared", "require_exchange"]

#: Shared pieces per exchange window (and the most a piece holds: larger
#: stored reads are cut along their first axis).
WINDOW_BYTES = 64 << 20
_PIECE_BYTES = 16 << 20


@runtime_checkable
class Exchange(Protocol):
    """A communicator that can also move arrays between ranks, point to point."""

    def exchange(self, sends: Sequence[tuple[int, int, np.ndarray]],
                 recvs: Sequence[tuple[int, int, np.ndarray]]) -> None:
        """Send each ``(peer, tag, array)`` of ``sends`` and fill each buffer of
        ``recvs`` from its peer's send with the same tag; return when all are
        done. Arrays are C-contiguous; a receive buffer has the sent size."""
        ...


@dataclass(frozen=True, slots=True)
class SharedRead:
    """A box of a stored array needed by several ranks, read by ``owner``."""

    path: str
    byte_offset: int | None  # the packed region's, as in ReadItem.byte_offset
    box: Box  # relative to the stored region, as in ReadItem.stored_box
    dtype: str
    owner: int
    needers: tuple[int, ...]  # every rank that needs it, owner included, ascending
    read: Box  # the stored read it was cut from

    @property
    def nbytes(self) -> int:
        return self.box.volume * numpy_dtype(self.dtype).itemsize


def needs_of(plan: LoadPlan) -> list[list[Any]]:
    """The distinct stored reads of a plan, as JSON: ``[path, byte_offset, offset,
    shape, dtype]`` (``byte_offset`` -1 for a region stored whole), sorted."""
    seen = {(r.path, -1 if r.byte_offset is None else r.byte_offset, r.stored_box.offset, r.stored_box.shape,
             t.stored_dtype) for t in plan.targets for r in t.reads}
    return [[p, b, list(o), list(s), d] for p, b, o, s, d in sorted(seen)]


#: The earlier name of :class:`SharedRead`, kept for code that imports it.
Piece = SharedRead


def plan_sharing(needs: Sequence[Sequence[Sequence[Any]]]) -> list[SharedRead]:
    """The pieces two or more ranks need, each with its owner, in exchange order.

    ``needs[r]`` is rank ``r``'s :func:`needs_of`. Reads are shared when they
    are the same box of the same array (what data-parallel replicas of one
    layout read); each is cut along its first axis into pieces of at most
    16 MiB. Owners: largest first, to the needing rank with the fewest bytes
    read so far (its unshared reads counted), ties to the lower rank.
    """
    # TODO(limitation): only identical stored reads are shared; partial overlaps
    # between ranks of different layouts are each read by every rank that needs them.
    needers: dict[tuple[str, int, tuple[int, ...], tuple[int, ...], str], list[int]] = {}
    for rank, items in enumerate(needs):
        for path, byte_offset, offset, shape, dtype in items:
            needers.setdefault((path, byte_offset, tuple(offset), tuple(shape), dtype), []).append(rank)
    load = [0] * len(needs)
    shared = []
    for (path, byte_offset, offset, shape, dtype), ranks in needers.items():
        nbytes = math.prod(shape) * numpy_dtype(dtype).itemsize
        if len(ranks) == 1:
            load[ranks[0]] += nbytes
        else:  # ranks ascending, each once
            shared.append((nbytes, path, byte_offset, offset, shape, dtype, tuple(ranks)))
    pieces = []
    for nbytes, path, byte_offset, offset, shape, dtype, group in sorted(shared, key=lambda s: (-s[0], *s[1:4])):
        owner = min(group, key=lambda r: (load[r], r))
        load[owner] += nbytes
        whole = Box(offset, shape)
        packed = None if byte_offset < 0 else byte_offset
        for box in whole.row_windows(numpy_dtype(dtype).itemsize, _PIECE_BYTES):
            pieces.append(SharedRead(path, packed, box, dtype, owner, group, whole))
    pieces.sort(key=lambda p: (p.path, -1 if p.byte_offset is None else p.byte_offset, p.box.offset))
    return pieces


def windows(pieces: Sequence[SharedRead]) -> list[list[SharedRead]]:
    """Consecutive pieces grouped into windows of at most :data:`WINDOW_BYTES`
    (one piece at least); always one window, even an empty one."""
    out: list[list[SharedRead]] = [[]]
    size = 0
    for p in pieces:
        if out[-1] and size + p.nbytes > WINDOW_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


def require_exchange(comm: Comm) -> Exchange:
    """``comm`` as an :class:`Exchange`, checked before a load plans anything.

    Raises:
        CommError: it has no ``exchange`` method.
    """
    if not isinstance(comm, Exchange):
        raise CommError(f"shared_reads=True needs a communicator with an exchange() method; "
                        f"{type(comm).__name__} has none")
    return comm


def read_shared(comm: Comm, plan: LoadPlan, targets: Sequence[np.ndarray], read: Any, stats: Any) -> None:
    """Fill ``targets`` as ``read(plan, targets, stats)`` would, reading each piece
    that several ranks need once. Collective: every rank calls it, with its own
    plan (``read`` executes a load plan, e.g. ``Location.read_opened`` bound to
    the opened arrays).

    Raises:
        CommError: the communicator cannot exchange arrays, or a rank failed.
        StorageError: damaged or missing data (on the rank that read it; the
            others raise CommError naming it).
    """
    exchanger = require_exchange(comm)
    mine = needs_of(plan)
    _, digests = run_collectively(comm, "load: shared reads", lambda: json_digest(mine))
    lists = distinct_values(comm, "load: shared reads", digests, mine)
    pieces = plan_sharing([lists[d] for d in digests])
    rank = comm.rank
    # My reads of each shared stored box: the pieces land in these targets.
    where: dict[tuple[str, int | None, Box], list[tuple[int, Box]]] = {}
    shared = {(p.path, p.byte_offset, p.read) for p in pieces if rank in p.needers}
    unshared = []
    for t in plan.targets:
        keep = []
        for r in t.reads:
            if (r.path, r.byte_offset, r.stored_box) in shared:
                where.setdefault((r.path, r.byte_offset, r.stored_box), []).append((t.target, r.target_box))
            else:
                keep.append(r)
        unshared.append(TargetPlan(t.target, t.key, t.stored_dtype, tuple(keep), t.padding))
    received = sent = 0
    for n, window in enumerate(windows(pieces)):
        staged: dict[int, np.ndarray] = {}

        def read_window(n: int = n, window: list[SharedRead] = window, staged: dict[int, np.ndarray] = staged) -> None:
            if n == 0:
                read(LoadPlan(tuple(unshared), plan.arrays, plan.packs), targets, stats)
            mine: list[TargetPlan] = []
            buffers: list[np.ndarray] = []
            for i, p in enumerate(window):
                if rank in p.needers:
                    staged[i] = np.empty(p.box.shape, numpy_dtype(p.dtype))
                if p.owner == rank:
                    mine.append(TargetPlan(len(buffers), "", p.dtype,
                                            (ReadItem(p.path, p.box, Box.full(p.box.shape), p.byte_offset),), ()))
                    buffers.append(staged[i])
            if mine:
                read(LoadPlan(tuple(mine), plan.arrays, plan.packs), buffers, stats)

        run_collectively(comm, "load: shared reads", read_window)
        sends = [(peer, i, staged[i]) for i, p in enumerate(window) if p.owner == rank
                 for peer in p.needers if peer != rank]
        recvs = [(p.owner, i, staged[i]) for i, p in enumerate(window) if p.owner != rank and rank in p.needers]
        try:
            exchanger.exchange(sends, recvs)
        except Exception as e:
            raise CommError(f"load: shared reads: exchanging pieces failed: {type(e).__name__}: {e}") from e
        sent += sum(a.nbytes for _, _, a in sends)
        received += sum(a.nbytes for _, _, a in recvs)
        for i, buf in staged.items():
            p = window[i]
            for target, target_box in where[(p.path, p.byte_offset, p.read)]:
                shift = tuple(a + b - c for a, b, c in zip(target_box.offset, p.box.offset, p.read.offset))
                cast_into(Box(shift, p.box.shape).view(targets[target]), buf)
    if stats is not None:
        stats.bytes_needed += received
        stats.bytes_received += received
        stats.bytes_sent += sent
