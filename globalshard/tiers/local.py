"""The node-local tier: a directory on each node holding tier copies (spec
section 5.3) of recent steps, its own ranks' arrays and those of the nodes
before it in the ring."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from globalshard.comm import Comm
from globalshard.errors import GlobalShardError, LayoutError
from globalshard.format.holdings import HOLDINGS_FILE, Holdings, parse_holdings
from globalshard.store import Store, open_root

__all__ = ["LocalTier", "Nodes", "step_name", "step_of"]

_log = logging.getLogger("globalshard")
_STEP = re.compile(r"iter_(\d{7,})")


def step_name(step: int) -> str:
    """The directory of a step, in every tier (as :class:`~globalshard.CheckpointManager` names them)."""
    return f"iter_{step:07d}"


def step_of(name: str) -> int | None:
    """The step whose directory is ``name`` (None: not a step's)."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Nodes:
    """How a job's ranks sit on its nodes: ``ranks_per_node`` consecutive ranks each."""

    world: int
    ranks_per_node: int

    @property
    def count(self) -> int:
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def lead(self, node: int) -> int:
        """The rank that writes and reads a node's commit records."""
        return node * self.ranks_per_node


@dataclass(frozen=True)
class LocalTier:
    """Checkpoints on each node's own storage (NVMe or a RAM disk), copied to
    the next ``replicas`` nodes of the ring, keeping the last ``keep`` steps.

    Args:
        path: this node's directory. ``{node}`` in it is replaced by the job's
            node index (for nodes that share a filesystem, or tests); a
            function of the node index gives a directory per node.
        replicas: how many following nodes (in a ring, by node index) hold a
            copy of each node's arrays too.
        keep: tier copies kept per node, newest first (the step a drain is
            still copying is kept too, and so are the copies of the bases
            kept copies reference, spec section 5.2: a recovery reads the
            regions referenced there from them).
        ranks_per_node: ranks on each node (consecutive ranks); default the
            launcher's ``LOCAL_WORLD_SIZE`` (torchrun sets it), else 1.
    """

    path: str | Callable[[int], str]
    replicas: int = 1
    keep: int = 2
    ranks_per_node: int | None = None

    # TODO(limitation): every node runs the same number of ranks, consecutive ranks on one node.
    def nodes(self, comm: Comm) -> Nodes:
        """The job's node layout.

        Raises:
            LayoutError: the world does not divide into nodes of that many ranks.
        """
        per = self.ranks_per_node
        if per is None:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            per = int(local) if local.isdigit() and int(local) > 0 else 1
        if per < 1 or comm.world_size % per:
            raise LayoutError(f"{comm.world_size} ranks do not make nodes of {per} ranks each "
                              "(LocalTier(ranks_per_node=), or LOCAL_WORLD_SIZE)")
        if self.replicas < 0 or self.keep < 1:
            raise LayoutError(f"LocalTier needs replicas >= 0 and keep >= 1, got {self.replicas} and {self.keep}")
        return Nodes(comm.world_size, per)

    def root(self, node: int) -> Store:
        """The store of node ``node``'s directory (only that node's ranks open it)."""
        path = self.path(node) if callable(self.path) else self.path.format(node=node)
        return open_root(path)

    def peers(self, nodes: Nodes, node: int) -> list[int]:
        """The nodes that hold copies of ``node``'s arrays, nearest first."""
        return [(node + k) % nodes.count for k in range(1, min(self.replicas, nodes.count - 1) + 1)]

    def sources(self, nodes: Nodes, node: int) -> list[int]:
        """The nodes whose arrays ``node`` holds copies of."""
        return [(node - k) % nodes.count for k in range(1, min(self.replicas, nodes.count - 1) + 1)]


def scan(root: Store) -> dict[int, Holdings]:
    """The committed tier copies in a node's directory, by step (damaged ones logged and skipped)."""
    out = {}
    for name in root.list_dir():
        step = step_of(name)
        if step is None:
            continue
        try:
            data = root.read(f"{name}/{HOLDINGS_FILE}")
            if data is not None:
                out[step] = parse_holdings(data, source=root.describe(f"{name}/{HOLDINGS_FILE}"))
        except GlobalShardError as e:
            _log.warning("the tier copy %s is not readable, ignored: %s", root.describe(name), e)
    return out


def prune(root: Store, keep: int, protect: set[int]) -> None:
    """Delete all but the newest ``keep`` committed copies (and ``protect``, and
    the copies of the saves they reference as bases), and directories of steps
    never committed but the newest (one may be written now): each copy's
    holdings.json first, so a crash midway leaves no half copy."""
    copies = scan(root)
    committed = sorted(copies, reverse=True)
    kept = set(committed[:keep]) | protect
    saves = {c.metadata.save_id: step for step, c in copies.items()}  # a base's copy is known by its save
    for ref in [ref for step in kept if step in copies for ref in copies[step].metadata.bases]:
        if (base := saves.get(ref.save_id)) is not None:  # references never chain (spec section 5.2): one level
            kept.add(base)
    names = {step: n for n in root.list_dir() if (step := step_of(n)) is not None}
    newest = max(names, default=None)
    for step, name in names.items():
        if step in kept or (step == newest and step not in committed):
            continue
        try:
            root.delete(f"{name}/{HOLDINGS_FILE}")
            root.delete(name, tree=True)
        except GlobalShardError as e:
            _log.warning("could not prune the tier copy %s: %s", root.describe(name), e)
