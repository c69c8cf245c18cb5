"""Recovery from the nearest copies, onto any layout: ranks agree on the
newest step some reachable copies hold whole, then each stored read comes
from this node's tier copy, else from a peer node that holds it (the peer
reads and sends it), else from the persistent tier. A region the step
references in a base comes likewise from the tier copies of the base's
step, else from the base in the persistent tier."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from globalshard.checkpoint.bases import open_in_roots, stores_itself
from globalshard.checkpoint.loading import Checkpoint, _expected_attributes, open_plan
from globalshard.checkpoint.saving import entries_of
from globalshard.comm import Comm, run_collectively
from globalshard.dtypes import cast_into, numpy_dtype
from globalshard.errors import CommError, MetadataError
from globalshard.format.metadata import Metadata, parse_metadata
from globalshard.format.trainer_state import parse_trainer_state
from globalshard.geometry import Box
from globalshard.io import IOStats, engine_name, open_engine
from globalshard.layout import ShardedTensor
from globalshard.planner import LoadPlan, LoadPlanner, PackedRegion, ReadItem, ShardInfo, TargetPlan
from globalshard.shared import require_exchange
from globalshard.store import Store, open_root
from globalshard.tiers.local import LocalTier, scan, step_name
from globalshard.tiers.routing import sources_of, windows_of

__all__ = ["Recovery", "TieredCheckpoint", "open_latest"]

_log = logging.getLogger("globalshard")

#: Bytes of pieces sent between nodes per exchange.
_WINDOW = 64 << 20


@dataclass
class Recovery:
    """What :func:`recover` loaded: the step, its trainer state, and where this
    rank's bytes came from (stored bytes read per tier; ``peer``: received)."""

    step: int
    save_id: str
    trainer_state: dict[str, Any]
    bytes_local: int = 0
    bytes_peer: int = 0
    bytes_persistent: int = 0
    #: The stored arrays this rank read from the persistent tier (no reachable copy held them).
    paths_persistent: list[str] = field(default_factory=list)
    #: The exchanges that carried pieces between nodes (each at most 64 MiB sent and received by a rank).
    windows: int = 0
    #: Why newer steps were passed over, one line each.
    skipped: list[str] = field(default_factory=list)


def _began(save_id: str) -> int:
    return int(save_id[:12], 16)


#: What :func:`_choose` finds: the step, its save, metadata, the nodes holding each path, whether it was
#: persisted, and the step of the tier copies each base is read from (by the base's index).
Chosen = tuple[int, str, Metadata, dict[str, list[int]], bool, dict[int, int]]


def _choose(gathered: list[Any], docs: Mapping[tuple[int, str], Any], only: int | None = None
            ) -> tuple[Chosen | None, list[str]]:
    """The newest (step, save) whole in the reachable copies (of step ``only``,
    when given), and why newer ones were not: ``gathered``, every rank's
    report of the copies (paths held) and persisted steps it found;
    ``docs``, each save's metadata."""
    found: dict[tuple[int, str], dict[str, Any]] = {}
    for node_report in gathered:
        for c in node_report.get("copies", []):
            entry = found.setdefault((c["step"], c["save_id"]), {"holders": {}, "persisted": False})
            for p in c["holds"]:
                entry["holders"].setdefault(p, []).append(c["node"])
        for step, save_id in node_report.get("persisted", []):
            found.setdefault((step, save_id), {"holders": {}, "persisted": False})["persisted"] = True
    for key, entry in found.items():
        entry["doc"] = docs[key]
    skipped: list[str] = []
    for (step, save_id), entry in sorted(found.items(), key=lambda kv: (_began(kv[0][1]), kv[0][0]), reverse=True):
        if only is not None and step != only:
            continue
        metadata = parse_metadata(json.dumps(entry["doc"]))
        missing = [p for p in metadata.paths() if p not in entry["holders"]]
        if entry["persisted"] or not missing:
            in_bases, base_steps = _in_base_copies(found, metadata)
            return (step, save_id, metadata, {**entry["holders"], **in_bases}, entry["persisted"], base_steps), skipped
        skipped.append(f"step {step} (save {save_id}): {len(missing)} of {len(metadata.paths())} of its paths "
                       f"are on no reachable node and it was not persisted (first: {missing[0]})")
    return None, skipped


def _senders(gathered: list[Any]) -> dict[tuple[int, str], int]:
    """The rank that sends each save's metadata: the one that reported it
    persisted (rank 0), since the persistent tier's commit of a save is its
    last word (keys removed in place, spec section 2.5); else the first
    (lowest) rank that reported a copy of it."""
    out: dict[tuple[int, str], int] = {}
    for rank, node_report in enumerate(gathered):
        for step, save_id in node_report.get("persisted", []):
            out.setdefault((step, save_id), rank)
    for rank, node_report in enumerate(gathered):
        for c in node_report.get("copies", []):
            out.setdefault((c["step"], c["save_id"]), rank)
    return out


def _in_base_copies(found: Mapping[tuple[int, str], Mapping[str, Any]], metadata: Metadata
                    ) -> tuple[dict[str, list[int]], dict[int, int]]:
    """The nodes that hold each region ``metadata`` references in a base, in
    a tier copy of the base's save that stores the region itself (spec
    sections 5.2 and 5.3; found by the save, whatever the base's root is
    named): a recovery reads it there, not from the base in the persistent
    tier. And the step of each base's copies (by the base's index)."""
    out, steps = {}, {}
    by_save = {save_id: (step, entry) for (step, save_id), entry in found.items()}
    for b, ref in enumerate(metadata.bases):
        step, entry = by_save.get(ref.save_id, (None, None))
        if step is None or not entry or not entry["holders"]:
            continue
        steps[b] = step
        theirs = parse_metadata(json.dumps(entry["doc"]))
        for key, t in metadata.tensors.items():
            out.update({r.path: entry["holders"][r.path] for r in t.regions if r.base == b and r.path in
                        entry["holders"] and stores_itself(theirs, key, t.dtype, r)})
    return out, steps


def _needs(plan: LoadPlan) -> list[Any]:
    return sorted({(r.path, -1 if r.byte_offset is None else r.byte_offset, r.stored_box.offset, r.stored_box.shape,
                    t.stored_dtype) for t in plan.targets for r in t.reads})


class TieredCheckpoint(Checkpoint):
    """The newest step whole in the tiers a job reaches, opened for loading
    (see the module): :attr:`metadata` and :attr:`trainer_state` as for a
    :class:`~globalshard.Checkpoint`; :meth:`load` reads each stored read
    from the nearest copy. Made by :func:`open_latest` (collective)."""

    def __init__(self, comm: Comm, tier: LocalTier, found: Chosen,
                 step_store: Callable[[int], Store], skipped: list[str]) -> None:
        self.step, self.save_id, self.metadata, self._holders, self._persisted, self._base_steps = found
        self._comm, self._tier, self._skipped = comm, tier, skipped
        self._nodes = tier.nodes(comm)
        node = self._nodes.node_of(comm.rank)
        self._local = open_root(tier.root(node).child(step_name(self.step)))
        self._store = step_store(self.step)  # the persistent tier's (reads no copy holds come from it)
        self._io = engine_name(None)
        self._engine = open_engine(self._store, self._io)
        self._trainer_state = _trainer_state(comm, self.metadata, self._holders, self._nodes, self._persisted,
                                             self._local, self._store)
        #: Where the last :meth:`load` read from.
        self.recovery: Recovery | None = None

    def load(self, state: Mapping[str, ShardedTensor], *, comm: Comm | None = None, allow_lossy_cast: bool = False,
             stats: IOStats | None = None, shared_reads: bool = False) -> dict[str, Any]:
        """Fill ``state`` from the nearest copies (``comm``: the one it was opened
        with; ``shared_reads`` has no effect: reads already go to one copy each).
        Collective. Returns the trainer state."""
        comm = comm if comm is not None else self._comm
        exchanger = require_exchange(comm) if comm.world_size > 1 else None
        entries = entries_of(state)
        plan = LoadPlanner().plan(self.metadata, [ShardInfo.of(t) for _, t in entries],
                                  allow_lossy_cast=allow_lossy_cast, names=[n for n, _ in entries])
        mine = _needs(plan)
        _, needs = run_collectively(comm, "recover: planning", lambda: mine)
        # Regions referenced in a base: from the tier copies of the base's step, else from the base.
        root_of = {r.path: r.base for t in self.metadata.tensors.values() for r in t.regions if r.base is not None}
        in_bases = frozenset(p for p in root_of if p not in self._holders)
        sources = sources_of(needs, self._holders, self._nodes.node_of, self._nodes.ranks_of, self._persisted,
                           in_bases)
        node = self._nodes.node_of(comm.rank)
        here = {p: b for p, b in root_of.items() if node in self._holders.get(p, ())}
        bases = {b: open_root(self._tier.root(node).child(step_name(self._base_steps[b]))) for b in here.values()}
        result = Recovery(self.step, self.save_id, self.trainer_state, skipped=self._skipped)
        _read(comm, exchanger, self.metadata, plan, needs, sources, [t.data for _, t in entries],
              (self._local, bases, here), self._store, result)
        if stats is not None:
            stats.bytes_read += result.bytes_local + result.bytes_persistent
            stats.bytes_received += result.bytes_peer
        self.recovery = result
        return self.trainer_state


def open_latest(comm: Comm, tier: LocalTier, persisted: Callable[[], list[tuple[int, Metadata]]],
                step_store: Callable[[int], Store], step: int | None = None) -> TieredCheckpoint | None:
    """The newest step whole in the tiers this job reaches: this rank's node's
    copies, the other nodes' (through their ranks), and the persistent tier
    (``persisted()``: its committed steps, called on rank 0; ``step_store(step)``:
    its store); with ``step``, that step (its newest save whole). None when no
    such step is whole anywhere; each newer one passed over is logged, with
    why. Collective."""
    nodes = tier.nodes(comm)
    node = nodes.node_of(comm.rank)
    root = tier.root(node)

    mine: dict[tuple[int, str], Metadata] = {}  # the saves this rank reports, found in report()

    def report() -> dict[str, Any]:
        copies = scan(root) if comm.rank == nodes.lead(node) else {}
        persisted_here = persisted() if comm.rank == 0 else []
        mine.update({(s, str(h.metadata.save_id)): h.metadata for s, h in copies.items()})
        mine.update({(s, str(m.save_id)): m for s, m in persisted_here})  # a persisted save's own commit wins
        # TODO(limitation): the paths each node's copies hold travel to every rank (a few
        # hundred bytes a stored region, times 1 + replicas), though a rank needs only the
        # holders of the paths it reads.
        return {"copies": [{"step": s, "save_id": str(h.metadata.save_id), "holds": sorted(h.holds), "node": node}
                           for s, h in copies.items()],
                "persisted": [(s, str(m.save_id)) for s, m in persisted_here]}

    _, gathered = run_collectively(comm, "recover: finding the newest whole step", report)
    # Each save's metadata travels once, from the first rank that reported it: not once a node.
    senders = _senders(gathered)
    _, sent = run_collectively(comm, "recover: the steps' metadata", lambda: [
        [s, sid, m.to_json()] for (s, sid), m in sorted(mine.items()) if senders.get((s, sid)) == comm.rank])
    chosen, skipped = _choose(gathered, {(s, sid): doc for docs in sent for s, sid, doc in docs}, step)
    for line in skipped:
        if comm.rank == 0:
            _log.warning("recover: passing over %s", line)
    if chosen is None:
        return None
    return TieredCheckpoint(comm, tier, chosen, step_store, skipped)


def _key(r: ReadItem, dtype: str) -> tuple[Any, ...]:
    return (r.path, -1 if r.byte_offset is None else r.byte_offset, r.stored_box.offset, r.stored_box.shape, dtype)


def _need_key(n: Sequence[Any]) -> tuple[Any, ...]:
    return (n[0], n[1], tuple(n[2]), tuple(n[3]), n[4])


def _opening(plan: LoadPlan, *others: LoadPlan) -> LoadPlan:
    """One plan opening the arrays and packs that ``plan`` and ``others`` read."""
    used = {r.path for p in (plan, *others) for t in p.targets for r in t.reads}
    arrays = {k: v for p in (plan, *others) for k, v in p.arrays.items() if k in used}
    packs: dict[str, dict[int, PackedRegion]] = {}
    for p in (plan, *others):
        for k, m in p.packs.items():
            if k in used:
                packs.setdefault(k, {}).update(m)
    return LoadPlan(tuple(t for p in (plan, *others) for t in p.targets), arrays, packs)


def _read(comm: Comm, exchanger: Any, metadata: Metadata, plan: LoadPlan, needs: list[Any],
          sources: dict[tuple[int, int], tuple[str, int]], targets: list[np.ndarray],
          local: tuple[Store, Mapping[int, Store], Mapping[str, int]], persistent: Store, result: Recovery) -> None:
    """Read this rank's part of ``plan`` and what it serves to other nodes
    (``local``: this node's copy of the step, its copies of the bases by
    index, and the base of each path read from those)."""
    rank = comm.rank
    index = {_need_key(n): i for i, n in enumerate(needs[rank])}

    def part(kind: str, padding: bool) -> LoadPlan:
        return LoadPlan(tuple(TargetPlan(t.target, t.key, t.stored_dtype, tuple(
            r for r in t.reads if sources[(rank, index[_key(r, t.stored_dtype)])][0] == kind),
            t.padding if padding else ()) for t in plan.targets), plan.arrays, plan.packs)

    local_plan, persistent_plan, base_plan = part("local", True), part("persistent", False), part("base", False)
    served = [(r, i, n) for r in range(len(needs)) for i, n in enumerate(needs[r]) if sources[(r, i)] == ("peer", rank)]
    # What this rank serves may be arrays its own load does not read: their records come from the metadata.
    arrays: dict[str, Any] = {}
    packs: dict[str, dict[int, PackedRegion]] = {}
    key_of = {}
    for key, stored in metadata.tensors.items():
        for region in stored.regions:
            key_of[region.path] = key
            if region.byte_offset is None:
                arrays[region.path] = (stored.dtype, region.box.shape)
            else:
                packs.setdefault(region.path, {})[region.byte_offset] = PackedRegion(key, stored.dtype, region.box,
                                                                                     region.nbytes)

    def serving(pieces: Sequence[tuple[int, int, Any]]) -> LoadPlan:
        """The plan that reads ``pieces`` (``(reader, index, need)``), piece k into target k."""
        paths = {n[0] for _, _, n in pieces}
        return LoadPlan(tuple(TargetPlan(k, key_of[n[0]], n[4], (ReadItem(
            n[0], Box(tuple(n[2]), tuple(n[3])), Box.full(tuple(n[3])), None if n[1] < 0 else n[1]),), ())
            for k, (_, _, n) in enumerate(pieces)), {p: v for p, v in arrays.items() if p in paths},
            {p: {b: v for b, v in m.items() if any(n[0] == p and n[1] == b for _, _, n in pieces)}
             for p, m in packs.items() if p in paths})

    serve_plan = serving(served)
    opened: dict[str, Any] = {}

    def open_all() -> None:
        sub = _opening(local_plan, serve_plan)
        if sub.arrays or sub.packs:
            engine = open_engine(local[0])
            opened["local"] = (engine, open_in_roots(engine, sub, _expected_attributes(metadata, sub), *local))
        sub = _opening(persistent_plan)
        if sub.arrays or sub.packs:
            engine = open_engine(persistent)
            opened["persistent"] = (engine, engine.open(sub, _expected_attributes(metadata, sub)))
        sub = _opening(base_plan)
        if sub.arrays or sub.packs:  # each base beside the step's root in the persistent tier, checked first
            engine = open_engine(persistent)
            opened["base"] = (engine, open_plan(persistent, engine, metadata, sub))

    run_collectively(comm, "recover: checking", open_all)
    stats = {"local": IOStats(), "persistent": IOStats(), "base": IOStats()}

    def read(name: str, sub: LoadPlan, into: list[np.ndarray]) -> None:
        if name in opened:
            engine, op = opened[name]
            engine.read(type(op)(sub, op.stores, op.files, op.where), into, stats[name])
        else:  # nothing to read there: only the padding to zero-fill
            for t in sub.targets:
                for box in t.padding:
                    box.view(into[t.target])[...] = 0

    def read_direct() -> None:
        read("local", local_plan, targets)
        read("persistent", persistent_plan, targets)
        read("base", base_plan, targets)

    run_collectively(comm, "recover: reading", read_direct)
    # The pieces travel in windows: in each, a rank sends and receives at most _WINDOW bytes.
    window = windows_of(needs, sources, _WINDOW)
    places: dict[tuple[Any, ...], list[tuple[np.ndarray, Box]]] = {}  # where each received piece goes
    for t in plan.targets:
        for r in t.reads:
            places.setdefault(_key(r, t.stored_dtype), []).append((targets[t.target], r.target_box))
    count = max(window.values(), default=-1) + 1
    serves: list[list[Any]] = [[] for _ in range(count)]  # by window: what this rank sends, and receives
    wants: list[list[Any]] = [[] for _ in range(count)]
    for p in served:
        serves[window[(p[0], p[1])]].append(p)
    for i, n in enumerate(needs[rank]):
        if sources[(rank, i)][0] == "peer":
            wants[window[(rank, i)]].append((n, sources[(rank, i)][1], i))
    for pieces, wanted in zip(serves, wants):
        buffers = [np.empty(tuple(n[3]), numpy_dtype(n[4])) for _, _, n in pieces]

        def serve(pieces: list[Any] = pieces, buffers: list[np.ndarray] = buffers) -> None:
            if pieces:
                read("local", serving(pieces), buffers)

        # Every rank has read (and checked) what it serves in this window before any of it is sent.
        run_collectively(comm, "recover: reading", serve)
        incoming = [(owner, i, np.empty(tuple(n[3]), numpy_dtype(n[4]))) for n, owner, i in wanted]
        if exchanger is not None:
            try:
                exchanger.exchange([(r, i, buf) for (r, i, _), buf in zip(pieces, buffers)], incoming)
            except Exception as e:
                raise CommError(f"recover: receiving pieces from other nodes failed: {type(e).__name__}: {e}") \
                    from e
        for (n, _, _), (_, _, buf) in zip(wanted, incoming):
            for target, box in places[_need_key(n)]:
                cast_into(box.view(target), buf)
        result.bytes_peer += sum(b.nbytes for _, _, b in incoming)
        result.windows += 1
    result.bytes_local += stats["local"].bytes_read
    result.bytes_persistent += stats["persistent"].bytes_read + stats["base"].bytes_read
    result.paths_persistent = sorted({r.path for p in (persistent_plan, base_plan) for t in p.targets
                                      for r in t.reads})


def _trainer_state(comm: Comm, metadata: Metadata, holders: Mapping[str, list[int]], nodes: Any, persisted: bool,
                   local: Store, persistent: Store) -> dict[str, Any]:
    ref = metadata.trainer_state
    if ref is None:
        return {}
    if persisted:
        data = persistent.read(ref.path)
    else:
        holder = nodes.lead(min(holders[ref.path]))

        def share() -> Any:
            return local.read(ref.path).decode("latin-1") if comm.rank == holder else None  # type: ignore[union-attr]

        _, gathered = run_collectively(comm, "recover: trainer state", share)
        data = gathered[holder].encode("latin-1")
    if data is None:
        raise MetadataError(f"the trainer state {ref.path} of the recovered step is missing")
    return parse_trainer_state(data, ref)
