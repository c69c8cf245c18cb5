"""The demo's trainer on ranks of simulated nodes, saving into a TieredManager
and recovering from it (run by tests/tiers/test_tiers_gloo.py through torch_harness)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch

import globalshard as gs
import globalshard_torch as gt
from globalshard.format.holdings import HOLDINGS_FILE


def _trainer(cfg: dict[str, Any], topo: dict[str, Any], rank: int) -> Any:
    import gpt_trainer as g

    torch.manual_seed(0)
    return g.Trainer(g.Config(**cfg), g.Topology(**topo), rank)


def _manager(local: str, nodes: list[int], persistent: str, kvstore: Any, per_node: int, replicas: int) -> Any:
    tier = gs.LocalTier(lambda node: os.path.join(local, f"node{nodes[node]}"), replicas=replicas, keep=2,
                        ranks_per_node=per_node)
    return gt.TieredManager(tiers=[tier, persistent], kvstore=kvstore)


def _watch_opens(local: str) -> set[str]:
    """The node directories below ``local`` this process opens (an audit hook)."""
    seen: set[str] = set()
    prefix = os.path.realpath(local) + os.sep

    def hook(event: str, args: Any) -> None:
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(prefix):
                seen.add(path[len(prefix):].split(os.sep)[0])

    sys.addaudithook(hook)
    return seen


def _kill_at(phase: str) -> None:
    """SIGKILL this rank when the tiered save reaches ``phase`` (a scoped patch, in this rank only)."""
    from globalshard.tiers import saving

    def die(*_: Any, **__: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    if phase == "local write":
        saving.open_engine = lambda *a, **k: type("Dying", (), {"write": die})()
    elif phase == "replication":
        saving._replicate = die
    elif phase == "drain":
        real = saving._start_drain

        def drain(*args: Any, **kwargs: Any) -> Any:
            args[4].write = die  # the persistent step store: the rank dies as it drains its first file
            return real(*args, **kwargs)

        saving._start_drain = drain


def train_job(rank: int, *, cfg: dict[str, Any], topo: dict[str, Any], local: str, nodes: list[int],
              persistent: str, kvstore: Any, per_node: int, replicas: int, saves: list[int],
              kill: dict[str, Any] | None = None, saver: str | None = None, reference: str | None = None,
              until: int = 0) -> dict[str, Any]:
    """Train to ``until`` (at least the last of ``saves``), saving into the tiers
    at each step of ``saves`` (each drained before the next); with ``saver``
    (a mode), asynchronously, training on while the copies are written; with
    ``reference``, each such step is first saved plainly to ``reference/iter_<step>``."""
    opened = _watch_opens(local)
    trainer = _trainer(cfg, topo, rank)
    manager = _manager(local, nodes, persistent, kvstore, per_node, replicas)
    background = gs.AsyncSaver(saver) if saver is not None else None
    losses = []
    for step in range(1, max(max(saves), until) + 1):
        loss = trainer.train_step()
        if loss is not None:
            losses.append(loss)
        if step in saves:
            target = manager.target(step)  # once the step before is drained (its background over)
            if kill is not None and step == kill["step"] and rank == kill["rank"]:
                _kill_at(kill["phase"])
            if reference is not None:
                trainer.save(os.path.join(reference, f"iter_{step:07d}"))
            trainer.save(target, saver=background)
    manager.wait()
    if background is not None and background.last_mode != saver:
        raise AssertionError(f"the saves ran in {background.last_mode} mode, not {saver}")
    return {"losses": losses, "opened": sorted(opened), "persisted": manager.persisted()}


def resume_job(rank: int, *, cfg: dict[str, Any], topo: dict[str, Any], local: str, nodes: list[int],
               persistent: str, kvstore: Any, per_node: int, replicas: int, until: int,
               reference: str | None = None) -> dict[str, Any]:
    """Recover from the nearest copies, compare every tensor with a plain load of
    the persistent checkpoint of the same step (when there is one; of
    ``reference/iter_<step>`` when given), train on."""
    opened = _watch_opens(local)
    trainer = _trainer(cfg, topo, rank)
    manager = _manager(local, nodes, persistent, kvstore, per_node, replicas)
    found = manager.open_latest()
    trainer.load(found)
    rec = found.recovery
    out: dict[str, Any] = {"step": rec.step, "bytes_local": rec.bytes_local, "bytes_peer": rec.bytes_peer,
                           "bytes_persistent": rec.bytes_persistent, "skipped": rec.skipped,
                           "paths_persistent": rec.paths_persistent}
    done = dict(manager.complete())
    if reference is not None:
        done[rec.step] = os.path.join(reference, f"iter_{rec.step:07d}")
    if rec.step in done:  # the same step loaded plainly: every tensor must be equal, bit for bit
        reference = _trainer(cfg, topo, rank)
        reference.load(done[rec.step])
        mine = dict(trainer.model.named_parameters()) if hasattr(trainer.model, "named_parameters") else {}
        theirs = dict(reference.model.named_parameters()) if hasattr(reference.model, "named_parameters") else {}
        params = [(n, p, theirs[n]) for n, p in mine.items()] or [
            (f"{c}.{n}", p, q) for c, (a, b) in enumerate(zip(trainer.chunks, reference.chunks))
            for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters())]
        out["tensors_compared"] = len(params)
        out["unequal"] = [n for n, p, q in params if not torch.equal(p.detach(), q.detach())]
        states = [(trainer.opt.state[p], reference.opt.state[q]) for (_, p, q) in params if p in trainer.opt.state]
        out["unequal"] += [k for a, b in states for k in a if torch.is_tensor(a[k]) and not torch.equal(a[k], b[k])]
    losses = []
    while trainer.step < until:
        loss = trainer.train_step()
        if loss is not None:
            losses.append(loss)
    out |= {"losses": losses, "opened": sorted(opened)}
    return out


def holds(local: str, node: str, step: str) -> set[str]:
    """The paths node ``node``'s copy of ``step`` holds."""
    from globalshard.format.holdings import parse_holdings

    return set(parse_holdings(open(os.path.join(local, node, step, HOLDINGS_FILE), "rb").read()).holds)


def inspect_tiers(local: str) -> dict[str, Any]:
    """For the parent: each node directory's committed copies, and whether each held file is there."""
    out = {}
    for node in sorted(os.listdir(local)):
        steps = {}
        for step in sorted(os.listdir(os.path.join(local, node))):
            record = os.path.join(local, node, step, HOLDINGS_FILE)
            if os.path.exists(record):
                from globalshard.format.holdings import parse_holdings

                h = parse_holdings(open(record, "rb").read())
                steps[step] = all(os.path.exists(os.path.join(local, node, step, p)) for p in h.holds)
            else:
                steps[step] = None
        out[node] = steps
    return out

