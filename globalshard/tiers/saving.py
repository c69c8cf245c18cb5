"""A tiered save: each rank writes its arrays to its node's directory, each
node's arrays are copied to the next nodes of the ring, every node commits
its tier copy (spec section 5.3), and a background drain copies the arrays
to the persistent tier and commits the checkpoint there."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from globalshard.checkpoint.bases import Digests, with_references
from globalshard.checkpoint.finishing import InProcess, settle_unchanged_keys
from globalshard.checkpoint.saving import PlannedSave, entries_of, plan_save
from globalshard.comm import Comm, run_collectively
from globalshard.errors import CommError, LayoutError, StorageError
from globalshard.format.holdings import HOLDINGS_FILE, Holdings
from globalshard.format.metadata import Metadata, parse_metadata
from globalshard.format.paths import METADATA_FILE
from globalshard.io import IOStats, open_engine
from globalshard.layout import ShardedTensor
from globalshard.shared import require_exchange
from globalshard.store import Store, open_root
from globalshard.store.base import Sink, copy_file
from globalshard.tiers.local import LocalTier, Nodes, prune, step_name
from globalshard.tiers.routing import pieces_of

if TYPE_CHECKING:
    from globalshard.checkpoint.async_save import AsyncSaver

__all__ = ["DRAIN_DIR", "Drain", "save_tiered"]

_log = logging.getLogger("globalshard")

#: Where ranks mark, in the persistent tier, that they copied their arrays (removed after the commit).
DRAIN_DIR = ".drain"
#: Bytes of files sent to the ring's next nodes per exchange.
_WINDOW = 64 << 20
#: How long rank 0's drain waits for the other ranks' marks before it gives up (the step stays local).
DRAIN_TIMEOUT_S = 3600.0


@dataclasses.dataclass
class Drain:
    """The background copy of one step to the persistent tier, on one rank."""

    step: int
    save_id: str
    thread: threading.Thread
    error: BaseException | None = None
    #: Seconds from the start of the drain to the persistent commit (rank 0), or to this rank's copies.
    seconds: float = 0.0

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _files(store: Store, paths: Sequence[str]) -> list[str]:
    out = []
    for p in paths:
        found = store.files(p)
        out += found if found else [p]  # a path that is one file (the trainer state)
    return out


def _replicate(comm: Comm, tier: LocalTier, nodes: Nodes, local: Store, mine: list[str]) -> list[str]:
    """Send the files of this rank's paths to the same local rank of the next
    ``replicas`` nodes and write theirs from the nodes before: returns the
    paths received. Files travel in pieces, in exchanges of at most _WINDOW
    bytes from each sender (:func:`~globalshard.tiers.routing.pieces_of`);
    a received file appears once its last piece is written. Collective."""
    if not tier.peers(nodes, nodes.node_of(comm.rank)):
        return []
    exchanger = require_exchange(comm)
    files = _files(local, mine)
    node, local_rank = nodes.node_of(comm.rank), comm.rank % nodes.ranks_per_node
    to = [tier.peers(nodes, node)[k] * nodes.ranks_per_node + local_rank for k in range(len(tier.peers(nodes, node)))]
    senders = [s * nodes.ranks_per_node + local_rank for s in tier.sources(nodes, node)]
    listing: dict[str, Any] = {"paths": mine, "files": files}
    # Every rank cuts its own files and its senders': the sends and receives of window w meet in one exchange.
    plan: dict[int, list[tuple[int, int, int, int]]] = {}

    def sized() -> tuple[dict[int, Any], int]:
        """This rank's list of files, for the next nodes' ranks; its count of exchanges, for all."""
        found = [local.size(f) for f in files]
        gone = [local.describe(f) for f, n in zip(files, found) if n is None]
        if gone:
            raise StorageError(f"{gone[0]} is gone from the tier copy before it was copied to the next nodes")
        listing["sizes"] = sizes = [n or 0 for n in found]
        plan[comm.rank] = cut = pieces_of(sizes, _WINDOW)
        return dict.fromkeys(to, listing), cut[-1][3] + 1 if cut else 0

    # The lists of files go to the ranks that receive them only; every rank learns how many exchanges
    # the busiest sender needs, and takes part in each.
    lists, counts = _send_objects(comm, "tier save: replication", sized)
    if sorted(lists) != sorted(senders):
        raise CommError(f"tier save: expected the lists of files of ranks {senders}, got those of {sorted(lists)}")
    gathered = {comm.rank: listing, **lists}
    plan.update({r: pieces_of(g["sizes"], _WINDOW) for r, g in lists.items()})
    count = max(counts, default=0)
    by_window: list[list[tuple[int, int, tuple[int, int, int, int]]]] = [[] for _ in range(count)]
    for src in [comm.rank, *senders]:
        for k, piece in enumerate(plan[src]):
            by_window[piece[3]].append((src, k, piece))
    reading: dict[int, Iterator[bytes]] = {}  # this rank's files, by index, being read
    writing: dict[tuple[int, int], tuple[contextlib.ExitStack, Sink]] = {}  # received files being written
    # A failure leaves the files being written unwritten (each one's block ends with the error).
    with contextlib.ExitStack() as unfinished:
        unfinished.callback(lambda: [getattr(r, "close", lambda: None)() for r in reading.values()])
        for w in range(count):
            sends: list[tuple[int, int, np.ndarray]] = []

            def read(w: int = w, sends: list[tuple[int, int, np.ndarray]] = sends) -> None:
                for src, k, (f, offset, length, _) in by_window[w]:
                    if src == comm.rank:
                        if offset == 0:
                            reading[f] = local.read_pieces(files[f], _WINDOW) or iter(())
                        data = next(reading[f], None)
                        if data is None or len(data) != length:
                            raise StorageError(f"{local.describe(files[f])} changed while it was being copied "
                                               "to the next nodes")
                        sends.extend((peer, k, np.frombuffer(data, np.uint8)) for peer in to)

            # Every rank has its window in memory before any sends: a rank that cannot read
            # fails the save on every rank, rather than leave its peers waiting for its bytes.
            run_collectively(comm, "tier save: replication", read)
            incoming = [(src, k, piece, np.empty(piece[2], np.uint8)) for src, k, piece in by_window[w]
                        if src != comm.rank]
            try:
                exchanger.exchange(sends, [(src, k, buf) for src, k, _, buf in incoming])
            except Exception as e:
                raise CommError(f"tier save: sending copies to the next nodes failed: {type(e).__name__}: {e}"
                                ) from e

            def write(incoming: list[Any] = incoming) -> None:
                for src, _, (f, offset, length, _), buf in incoming:
                    if offset == 0:
                        stack = unfinished.enter_context(contextlib.ExitStack())
                        writing[(src, f)] = stack, stack.enter_context(local.open_write(gathered[src]["files"][f]))
                    writing[(src, f)][1].write(buf.data)
                    if offset + length == gathered[src]["sizes"][f]:  # its last piece: the file appears
                        writing.pop((src, f))[0].close()

            run_collectively(comm, "tier save: replication", write)
    return [p for s in senders for p in gathered[s]["paths"]]


def save_tiered(state: Mapping[str, ShardedTensor], step: int, comm: Comm, tier: LocalTier, persistent: Store,
                step_store: Callable[[int], Store], *, trainer_state: dict[str, Any] | None = None,
                stats: IOStats | None = None, on_persisted: Callable[[int], None] | None = None,
                saver: AsyncSaver | None = None, staged: Mapping[str, Callable[[], None]] | None = None,
                on_drain: Callable[[Drain], None] = lambda drain: None, pack_below: int = 0,
                base: Any = None, frozen: Iterable[str] = (), digests: bool | None = None,
                unchanged: Digests | None = None, kvstore: Any = None, check_replicas: bool = False) -> Drain | None:
    """Save ``state`` as step ``step``: into this node's directory (and the next
    nodes'), committed there on every node; then, in the background, copied
    to ``step_store(step)`` in the persistent tier and committed there, when
    ``on_persisted(step)`` runs on rank 0. Without ``saver``, returns the
    drain once every node has committed its copy. With one (an
    :class:`~globalshard.AsyncSaver`), returns None once this rank's arrays
    are in the saver's staging pool (``staged``: as for its ``save``); the
    local writes (by its writer process, in process mode), the copies to the
    next nodes and the local commit follow in the background, which then
    hands the drain to ``on_drain``; ``saver.wait()`` raises their failure.
    ``pack_below``: as for :func:`~globalshard.save` (small regions stored
    in a few packs, each copied and drained as one file). ``base``,
    ``frozen``, ``digests`` and ``unchanged``: as for
    :func:`~globalshard.save`, the base a committed checkpoint of the
    persistent tier beside ``step_store(step)``: the frozen keys' regions,
    those hashed equal to the base's, and the unchanged keys' (in the base's
    cut) are referenced there, neither written nor copied nor drained
    (``kvstore``: as for :func:`~globalshard.save`'s, for ``base``).
    ``check_replicas``: as for :func:`~globalshard.save`.

    Raises:
        LayoutError, StorageError, CommError: as :func:`~globalshard.save`; the
        previous steps stay whole in every tier.
    """
    began = time.perf_counter()
    unknown = sorted(set(staged or {}) - set(state))
    if unknown:
        raise LayoutError(f"staged names {unknown[:5]} are not in the state")
    nodes = tier.nodes(comm)
    local = open_root(tier.root(nodes.node_of(comm.rank)).child(step_name(step)))
    target = step_store(step)
    held = contextlib.ExitStack()
    try:
        planned = plan_save(target, comm, entries_of(state), trainer_state, False, held, staged,
                            pack_below=pack_below, base=base, frozen=frozen, digests=digests, kvstore=kvstore,
                            unchanged=unchanged, check_replicas=check_replicas)
    except BaseException:
        held.close()
        raise

    def finish(planned: PlannedSave, ops: InProcess) -> Drain:
        try:
            metadata, mine = _commit_copies(planned, ops, comm, tier, step, local, stats)
        except BaseException:
            held.close()
            raise
        return _start_drain(comm, step, metadata, local, target, persistent, mine, planned.coordinator.stamp,
                            held, on_persisted)

    if saver is None:
        return finish(planned, InProcess())
    saver.start(planned, held, local, lambda planned, ops: on_drain(finish(planned, ops)))
    saver.blocking_seconds = time.perf_counter() - began
    return None


def _commit_copies(planned: PlannedSave, ops: InProcess, comm: Comm, tier: LocalTier, step: int, local: Store,
                   stats: IOStats | None) -> tuple[Metadata, list[str]]:
    """Write this rank's arrays to its node's tier (through ``ops``), copy
    them to the next nodes, and commit every node's tier copy: returns the
    step's metadata and this rank's paths. Collective."""
    nodes = tier.nodes(comm)
    node = nodes.node_of(comm.rank)
    planned = settle_unchanged_keys(planned, ops, "tier save")  # keys still as loaded: referenced in the base
    mine = [item.path for item in planned.items]
    blob = planned.coordinator.trainer_blob

    def clear_local() -> None:  # a save of this step that died left its files: they go first, once
        if comm.rank == nodes.lead(node) and local.files(""):
            local.delete("", tree=True)

    run_collectively(comm, "tier save: local write", clear_local)
    here = dataclasses.replace(planned, store=local, engine=open_engine(local, planned.io))
    _, outcomes = run_collectively(comm, "tier save: local write", lambda: ops.write(here, stats))
    # Arrays hashed equal to the base's were not written: referenced there, they are not this step's files.
    equal = {(k, tuple(o)) for k, o, _, same in outcomes[comm.rank] or [] if same}
    mine = [p for p in mine if p not in planned.requests or tuple(planned.requests[p][:2]) not in equal]
    hashed = [o for rank in outcomes for o in rank or []]
    if blob is not None:
        mine.append(blob[1].path)
    received = _replicate(comm, tier, nodes, local, mine)

    def metadata_doc() -> Any:
        if comm.rank != 0:
            return None
        ref = blob[1] if blob is not None else None
        metadata = with_references(planned.metadata(), planned.base, planned.frozen, hashed)
        return dataclasses.replace(metadata, trainer_state=ref).to_json()

    # What each rank holds goes to its node's lead, which commits the node's copy; rank 0's metadata to all.
    held, docs = _send_objects(comm, "tier save: local commit",
                               lambda: ({nodes.lead(node): mine + received}, metadata_doc()))
    metadata = parse_metadata(json.dumps(docs[0]))

    def commit_local() -> None:
        if comm.rank == nodes.lead(node):
            holds = {p for paths in held.values() for p in paths}
            local.write(HOLDINGS_FILE, Holdings(metadata, frozenset(holds), node).dumps().encode("utf-8"))
            prune(tier.root(node), tier.keep, {step})

    run_collectively(comm, "tier save: local commit", commit_local)
    return metadata, mine


def _send_objects(comm: Comm, step: str, outgoing: Callable[[], tuple[dict[int, Any], Any]]
                  ) -> tuple[dict[int, Any], list[Any]]:
    """Send JSON values point to point: ``outgoing()`` gives this rank's
    ``{destination rank: value}`` and a small value for every rank (a
    count, say). Returns the values sent to this rank, by sender, and every
    rank's small value. Collective: the sizes travel in one all-gather (a
    few numbers a rank), which fails every rank if ``outgoing`` fails on one."""
    blobs: dict[int, np.ndarray] = {}

    def sizes() -> dict[str, Any]:
        values, note = outgoing()
        encoded: dict[int, np.ndarray] = {}  # a value sent to several ranks (a list to each replica) once
        for d, v in values.items():
            if id(v) not in encoded:
                encoded[id(v)] = np.frombuffer(json.dumps(v).encode("utf-8"), np.uint8)
            blobs[d] = encoded[id(v)]
        return {"sizes": {str(d): len(b) for d, b in blobs.items()}, "note": note}

    _, gathered = run_collectively(comm, step, sizes)
    me = str(comm.rank)
    incoming = {src: np.empty(g["sizes"][me], np.uint8) for src, g in enumerate(gathered)
                if me in g["sizes"] and src != comm.rank}
    sends = [(d, 0, b) for d, b in blobs.items() if d != comm.rank]
    if sends or incoming:  # point to point: a rank with nothing to send or receive takes no part
        try:
            require_exchange(comm).exchange(sends, [(src, 0, buf) for src, buf in incoming.items()])
        except Exception as e:
            raise CommError(f"{step}: sending to other ranks failed: {type(e).__name__}: {e}") from e
    received = {src: json.loads(buf.tobytes()) for src, buf in incoming.items()}
    if comm.rank in blobs:
        received[comm.rank] = json.loads(blobs[comm.rank].tobytes())
    return received, [g["note"] for g in gathered]


def _committed(target: Store, save_id: str) -> bool:
    data = target.read(METADATA_FILE)
    if data is None:
        return False
    return parse_metadata(data).save_id == save_id


def _marked(persistent: Store, marks: str, world: int) -> int:
    """How many ranks have finished their drain: the marks named by a rank.
    A mark still being written is a temporary file beside them (a local
    store writes it and renames it into place); counted, it let rank 0
    commit and delete the marks' directory under the rename of the last."""
    ranks = {str(r) for r in range(world)}
    return sum(name in ranks for name in persistent.list_dir(marks))


def _start_drain(comm: Comm, step: int, metadata: Metadata, local: Store, target: Store, persistent: Store,
                 mine: list[str], stamp: Any, held: contextlib.ExitStack,
                 on_persisted: Callable[[int], None] | None) -> Drain:
    assert metadata.save_id is not None
    marks = f"{DRAIN_DIR}/{metadata.save_id}"
    rank, world = comm.rank, comm.world_size

    def run() -> None:
        start = time.perf_counter()
        try:
            with held:
                for f in _files(local, mine):  # each file as it is in the tier copy, a piece at a time
                    if not copy_file(local, f, target):
                        raise StorageError(f"{local.describe(f)} is gone from the tier copy before it was drained")
                persistent.write(f"{marks}/{rank}", b"")
                if rank == 0:
                    deadline = time.monotonic() + DRAIN_TIMEOUT_S
                    while _marked(persistent, marks, world) < world:
                        if time.monotonic() > deadline:
                            raise StorageError(f"step {step}: not every rank drained its arrays to {target}; "
                                               "it is not persisted (the tier copies still hold it)")
                        time.sleep(0.05)
                    target.commit(METADATA_FILE, metadata.dumps().encode("utf-8"), stamp)
                    # Every mark under it is done with: this drain's ranks have all written theirs, a drain
                    # that failed before left its own, and no rank drains the next step before rank 0 has
                    # begun its save, which waits for this drain.
                    persistent.delete(DRAIN_DIR, tree=True)
                    if on_persisted is not None:
                        on_persisted(step)
                else:  # this rank's drain ends when the step is committed, by rank 0
                    deadline = time.monotonic() + DRAIN_TIMEOUT_S
                    while not _committed(target, drain.save_id):
                        if time.monotonic() > deadline:
                            raise StorageError(f"step {step} was not committed to {target} in time; it is not "
                                               "persisted (the tier copies still hold it)")
                        time.sleep(0.05)
        except BaseException as e:  # raised by Drain.wait
            drain.error = e
            _log.warning("step %d was not persisted: %s", step, e)
        drain.seconds = time.perf_counter() - start

    drain = Drain(step, metadata.save_id, threading.Thread(target=run, name=f"globalshard-drain-{step}"))
    drain.thread.start()
    return drain
