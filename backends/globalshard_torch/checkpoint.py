"""One call to save, one to load: model, optimizer, LR scheduler and trainer state.

Every rank calls :func:`save_checkpoint` / :func:`load_checkpoint` with its own
model chunks and optimizer; the layouts at save and at load may differ in
every way (TP, PP, VPP, DP). Parameters are placed by the model's
:class:`~globalshard_torch.rules.ShardingRules` (or by their DTensor
placements); Adam/AdamW moments share their parameter's place with their own
dtype; ``step`` is a replicated scalar. Optimizer state is matched to
parameters by checkpoint key, never by position.

Keys in the checkpoint::

    <param key>                          the parameter (global layer index)
    optimizer.<item>.<param key>         optimizer state item (exp_avg, exp_avg_sq, step, ...), from a
                                         plain optimizer or a distributed one's flat pieces alike
    optimizer.master.<param key>         the fp32 master copy, with master_params (or a piece's "master")
    <kind>.<param key>                   a shadow copy (shadows={"ema": ...})
    _extra_state.<module>.tp<r>of<T>     a module's get_extra_state() when it is not JSON

The trainer state holds the caller's ``trainer_state`` plus
``parallel_config``, ``lr_scheduler``, ``optimizer`` (hyper-parameters and
group membership by key), ``rng`` (every rank's RNG states), ``extra_state``
(modules' JSON extra state, per TP rank) and ``rank_state`` (per rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import globalshard as gs
from globalshard import planner as gs_planner
from globalshard.comm import Comm, run_collectively
from globalshard.errors import LayoutError, MetadataError, MismatchError, format_problems
from globalshard_torch import extra_state
from globalshard_torch.comm import default_comm, resolve_comm
from globalshard_torch.extra_state import finish as extra_state_finish
from globalshard_torch.extra_state import restore_targets as extra_state_restore
from globalshard_torch.model import Entry, model_entries, outside_mesh, refuse_unusable
from globalshard_torch.parallel import LAYERS, ParallelLayout
from globalshard_torch.rules import ShardingRules
from globalshard_torch.state import from_jsonable, jsonable, rng_state, set_rng_state
from globalshard_torch.tensors import HostStaging, numpy_view, torch_dtype
from globalshard_torch.zero import FlatShard, zero_redundancy_shards

__all__ = ["CheckpointManager", "LoadResult", "load_checkpoint", "save_checkpoint"]

_RESERVED = ("parallel_config", "lr_scheduler", "optimizer", "rng", "extra_state", "rank_state")


def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)
_OPT = "optimizer."


@dataclass
class LoadResult:
    """What :func:`load_checkpoint` restored."""

    #: What the save was given as ``trainer_state`` (the adapter's own entries: parallel config,
    #: optimizer groups, scheduler, RNG, extra and per-rank state, are not in it), so that it can be
    #: passed to the next save as it is.
    trainer_state: dict[str, Any]
    rng_restored: bool
    stats: gs.IOStats = field(default_factory=gs.IOStats)
    #: This rank's ``rank_state`` as saved, when the layout and world size are
    #: the ones that saved it (per-rank state has no counterpart on another); else None.
    rank_state: Any = None
    #: Keys this rank asked for that the checkpoint does not hold, left as they
    #: were (only with ``strict=False``; a strict load refuses them).
    missing_keys: list[str] = field(default_factory=list)
    #: Checkpoint keys that no rank read, of the kinds the call loads (model
    #: tensors; optimizer state when an optimizer is given; shadows when
    #: shadows are given); the same on every rank.
    unexpected_keys: list[str] = field(default_factory=list)


def _optimizer_params(
    optimizer: torch.optim.Optimizer, entries: list[Entry], master_params: Mapping[str, torch.Tensor] | None
) -> list[tuple[int, torch.Tensor, Entry, bool]]:
    """(group index, optimizer parameter, its entry, is a master copy) for every optimizer parameter."""
    by_id = {id(e.param): e for e in entries}
    by_name = {e.name: e for e in entries}
    masters: dict[int, Entry] = {}
    for name, master in (master_params or {}).items():
        if name not in by_name:
            raise LayoutError(f"master_params names {name!r}, which is not a model tensor")
        masters[id(master)] = by_name[name]
    out, problems = [], []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in masters:
                out.append((g, p, masters[id(p)], True))
            elif id(p) in by_id:
                out.append((g, p, by_id[id(p)], False))
            elif outside_mesh(p):
                continue  # this rank holds nothing of it, nor of its state
            else:
                problems.append(f"group {g}: a parameter of shape {tuple(p.shape)} is not a tensor of the model "
                                "(pass master_params for optimizer-owned copies)")
    if problems:
        raise LayoutError(format_problems("cannot map the optimizer's parameters to checkpoint keys", problems))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _scalar_shard(key: str, data: Any, main: bool) -> gs.ShardedTensor:
    return gs.ShardedTensor.from_offset(key, data, global_shape=(), global_offset=(), replica_id=0 if main else 1)


def save_checkpoint(
    path: Any,
    *,
    model: nn.Module | Sequence[nn.Module],
    layout: ParallelLayout,
    rules: ShardingRules | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    trainer_state: dict[str, Any] | None = None,
    master_params: Mapping[str, torch.Tensor] | None = None,
    optimizer_shards: Sequence[FlatShard] | None = None,
    shadows: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    rank_state: Any = None,
    comm: Comm | None = None,
    overwrite: bool = False,
    kvstore: Any = None,
    stats: gs.IOStats | None = None,
    saver: gs.AsyncSaver | None = None,
    pack_below: int = 0,
    base: Any = None,
    frozen: Sequence[str] = (),
    digests: bool | None = None,
    check_replicas: bool = False,
) -> None:
    """Save this rank's part of the model, optimizer, scheduler and trainer state.

    Call on every rank. ``model`` is this rank's module, or its virtual
    pipeline chunks in local order. ``master_params`` maps model tensor names
    to the fp32 copies the optimizer holds, when it holds copies. With a
    distributed optimizer, ``optimizer_shards`` (:class:`FlatShard` s) are
    this rank's pieces of the optimizer state, and ``optimizer`` (if given)
    only supplies the hyper-parameters; a ``ZeroRedundancyOptimizer`` is
    recognised by itself. ``shadows`` are copies laid out like their
    parameters, by kind and model tensor name (``{"ema": {name: tensor}}``),
    stored as ``<kind>.<param key>``. ``rank_state`` is this rank's own JSON
    state (a dataloader's or sampler's position), kept per rank. With
    ``saver`` (a :class:`globalshard.AsyncSaver`) the call returns once this
    rank's data is copied to host memory, and the rest runs in the
    background: call ``saver.wait()`` to learn its outcome, and before exiting
    (a load or save begun meanwhile waits for its collectives first). A failure on
    any rank raises on every rank and commits nothing. ``pack_below``: as for
    :func:`globalshard.save` (small regions stored in a few packs). ``base``,
    ``frozen`` and ``digests``: as for :func:`globalshard.save` (regions equal
    to a base checkpoint's stored as references to it; ``frozen`` names
    checkpoint keys, such as a LoRA fine-tune's pretrained weights).
    ``check_replicas``: as for :func:`globalshard.save` (data-parallel
    replicas, and TP ranks' copies of replicated tensors, compared bit for
    bit before anything is written).
    """
    comm = resolve_comm(comm)
    user = dict(trainer_state or {})
    clash = [k for k in _RESERVED if k in user]
    if clash:
        raise MetadataError(f"trainer_state keys {clash} are reserved for the adapter")
    if isinstance(path, TierStep):
        path.refuse(overwrite=overwrite, kvstore=kvstore)
    shards: dict[str, gs.ShardedTensor] = {}
    staging = HostStaging.for_save(saver)

    zero = _is_zero_redundancy(optimizer)
    if zero:
        optimizer_shards = zero_redundancy_shards(optimizer)

    def describe() -> dict[str, Any]:
        entries = model_entries(model, layout, rules)
        refuse_unusable(entries, "save the model")
        for e in entries:
            shards.update(e.shards(f"model/{e.name}", e.key, numpy_view(staging.host(e.tensor, for_save=True))))
        membership: dict[str, int] = {}
        if optimizer_shards is not None:
            if not zero:
                _check_main_copies(optimizer, optimizer_shards, entries)
            for fs, e, item, key, t in _flat_items(optimizer_shards, entries):
                host = staging.host(t.detach(), for_save=True)
                _add_flat(shards, fs, e, item, key, numpy_view(host).copy() if t.ndim == 0 else numpy_view(host))
        elif optimizer is not None:
            for g, p, e, is_master in _optimizer_params(optimizer, entries, master_params):
                membership[e.key] = g
                if is_master:
                    host = staging.host(_local(p), for_save=True)
                    shards.update(e.shards(f"master/{e.name}", f"{_OPT}master.{e.key}", numpy_view(host)))
                for item, value in optimizer.state.get(p, {}).items():
                    key = f"{_OPT}{item}.{e.key}"
                    if not torch.is_tensor(value):
                        raise LayoutError(f"optimizer state {item!r} of {e.key!r} is a {type(value).__name__}, "
                                          "not a tensor")
                    local = staging.host(_local(value), for_save=True)
                    if local.ndim == 0:
                        shards[f"opt/{item}/{e.name}"] = _scalar_shard(key, numpy_view(local).copy(), e.scalar_main)
                    else:
                        shards.update(e.shards(f"opt/{item}/{e.name}", key, numpy_view(local)))
        for kind, e, tensor in _shadow_items(shadows, entries):
            shards.update(e.shards(f"shadow/{kind}/{e.name}", f"{kind}.{e.key}",
                                                        numpy_view(staging.host(_local(tensor), for_save=True))))
        extra = extra_state.collect(_chunks(model), layout, LAYERS, shards)
        staging.ready()
        return {"rng": rng_state(), "membership": membership, "extra": extra,
                "rank_state": jsonable(rank_state, "$.rank_state")}

    _, gathered = run_collectively(comm, "save_checkpoint: describing", describe)
    state = dict(user)
    state["parallel_config"] = layout.config_json()
    extras: dict[str, list[dict[str, Any]]] = {}
    for g in gathered:
        for gname, record in g["extra"].items():
            if record not in extras.setdefault(gname, []):
                extras[gname].append(record)
    state["extra_state"] = extras
    state["lr_scheduler"] = jsonable(scheduler.state_dict(), "$.lr_scheduler") if scheduler is not None else None
    if optimizer is not None or optimizer_shards is not None:
        membership: dict[str, int] = {}
        for g in gathered:
            membership.update(g["membership"])
        groups = [jsonable({k: v for k, v in group.items() if k != "params"}, f"$.optimizer.param_groups[{i}]")
                  for i, group in enumerate(optimizer.param_groups if optimizer is not None else [])]
        state["optimizer"] = {"class": _optimizer_class(optimizer), "param_groups": groups,
                              "membership": membership}
    else:
        state["optimizer"] = None
    state["rng"] = {"world_size": comm.world_size, "parallel_config": layout.config_json(),
                    "ranks": [g["rng"] for g in gathered]}
    if rank_state is not None:
        state["rank_state"] = [g["rank_state"] for g in gathered]
    if isinstance(path, TierStep):
        path.save(shards, state, stats, saver, staging, pack_below=pack_below, base=base, frozen=frozen,
                  digests=digests, check_replicas=check_replicas)
    else:
        staging.save(shards, path, saver, trainer_state=state, comm=comm, overwrite=overwrite, kvstore=kvstore,
                     stats=stats, pack_below=pack_below, base=base, frozen=frozen, digests=digests,
                     check_replicas=check_replicas)


def load_checkpoint(
    path: Any,
    *,
    model: nn.Module | Sequence[nn.Module],
    layout: ParallelLayout,
    rules: ShardingRules | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    master_params: Mapping[str, torch.Tensor] | None = None,
    shadows: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    comm: Comm | None = None,
    allow_lossy_cast: bool = False,
    restore_rng: bool = True,
    kvstore: Any = None,
    extra_state: str = "load",
    optimizer_shards: Sequence[FlatShard] | None = None,
    shared_reads: bool = False,
    strict: bool = True,
) -> LoadResult:
    """Load a checkpoint saved under any layout into this rank's model, optimizer
    and scheduler (in place). Call on every rank.

    Optimizer state is created for every parameter the checkpoint has state
    for, in the dtype the optimizer's parameter has (exact widening is
    automatic; narrowing needs ``allow_lossy_cast``). RNG states are restored
    only when the layout and world size are the ones that saved them.
    With a distributed optimizer, ``optimizer_shards`` name this rank's
    pieces (their state tensors are filled in place, whatever DP size, TP
    size or optimizer saved them); a ``ZeroRedundancyOptimizer`` gets the
    state of its own partition. Modules' ``get_extra_state()`` comes back per TP rank; when the TP size
    changed that is an error naming the modules, unless
    ``extra_state="skip"`` (their extra state then stays as it is).
    ``shared_reads=True``: data-parallel replicas read each stored byte once
    between them and send it to each other over the gloo group (see
    :func:`globalshard.load`).

    ``strict`` (the default), as torch's ``load_state_dict``: a model or
    shadow tensor the checkpoint lacks is an error, and so is a checkpoint
    tensor that no rank's model reads (optimizer state too when an optimizer
    is given). ``strict=False`` leaves missing tensors as they are; either
    way :class:`LoadResult` lists the missing and unexpected keys.

    Raises:
        the core's errors (MismatchError, CastError, MetadataError, ...) and
        LayoutError when the model or optimizer does not fit the checkpoint.
    """
    comm = resolve_comm(comm)
    staging = HostStaging()
    targets: dict[str, gs.ShardedTensor] = {}
    new_state: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    opened: list[gs.Checkpoint] = []
    extras: list[Any] = []
    missing: list[str] = []
    group_sources: list[int | None] = []  # for each param group, the saved group whose hyperparameters it gets
    zero = _is_zero_redundancy(optimizer)
    zero_pieces: list[FlatShard] = []
    if extra_state not in ("load", "skip"):
        raise ValueError(f"extra_state must be 'load' or 'skip', got {extra_state!r}")

    def prepare() -> str:
        _prepare()
        _fit_padding(targets, opened[0].metadata)
        return gs_planner.asked_mask(opened[0].metadata, {t.key for t in targets.values()})

    def _prepare() -> None:
        # parsed once, used for planning and loading (or opened already: a TieredManager's nearest copies)
        checkpoint = path if isinstance(path, gs.Checkpoint) else gs.Checkpoint(path, kvstore=kvstore)
        opened.append(checkpoint)
        metadata, ts = checkpoint.metadata, checkpoint.trainer_state
        if scheduler is not None and ts.get("lr_scheduler") is None:
            raise MismatchError(f"{path}: the checkpoint holds no LR scheduler state (it was saved without "
                                "scheduler=); pass scheduler=None to leave the scheduler as it is")
        entries = model_entries(model, layout, rules)
        refuse_unusable(entries, "load into the model")
        for e in entries:
            targets.update(e.shards(f"model/{e.name}", e.key, numpy_view(staging.host(e.tensor, for_save=False))))
        for kind, e, tensor in _shadow_items(shadows, entries):
            targets.update(e.shards(f"shadow/{kind}/{e.name}", f"{kind}.{e.key}",
                                                         numpy_view(staging.host(_local(tensor), for_save=False))))
        if not strict:  # left as they are, and reported
            for name, target in list(targets.items()):
                if target.key not in metadata.tensors and not gs.is_padding_key(target.key):
                    missing.append(target.key)
                    del targets[name]
        extras.extend(extra_state_restore(_chunks(model), layout, LAYERS, ts.get("extra_state") or {},
                                          metadata, targets, extra_state))
        if optimizer is None and optimizer_shards is None:
            return
        if ts.get("optimizer") is None:
            raise MismatchError(f"{path}: the checkpoint holds no optimizer state (it was saved without "
                                "optimizer=); pass optimizer=None to load the model alone")
        if zero or optimizer_shards is not None:
            if optimizer is not None and not zero:
                group_sources[:] = _check_groups(optimizer, ts.get("optimizer"), by_identity=True)
            pieces = _zero_targets(optimizer, entries, metadata) if zero else list(optimizer_shards or [])
            if not zero:
                _check_main_copies(optimizer, pieces, entries)
            zero_pieces.extend(pieces)
            problems = []
            for fs, e, item, key, t in _flat_items(pieces, entries):
                if key not in metadata.tensors:
                    problems.append(f"{key!r}: not in the checkpoint ({item} of {e.key!r})")
                    continue
                if t.ndim:
                    t.detach().zero_()  # elements no region covers (padding) read as zeros
                _add_flat(targets, fs, e, item, key, numpy_view(t if t.ndim == 0 else staging.host(t, for_save=False)))
            if problems:
                raise MismatchError(format_problems("the optimizer does not match the checkpoint", problems))
            return
        items: dict[str, list[str]] = {}
        for k in metadata.tensors:
            if k.startswith(_OPT):
                item, _, key = k[len(_OPT):].partition(".")
                items.setdefault(key, []).append(item)
        assert optimizer is not None  # the branches above return otherwise
        params = _optimizer_params(optimizer, entries, master_params)
        group_sources[:] = _sources_by_membership(optimizer, params, ts["optimizer"])
        problems = []
        for _, p, e, is_master in params:
            if is_master:
                if "master" not in items.get(e.key, []):
                    problems.append(f"{e.key!r}: the checkpoint holds no fp32 master copy")
                    continue
                targets.update(e.shards(f"master/{e.name}",
                    f"{_OPT}master.{e.key}", numpy_view(staging.host(_local(p), for_save=False))))
            st: dict[str, torch.Tensor] = {}
            for item in items.get(e.key, []):
                if item == "master":
                    continue
                stored = metadata.tensors[f"{_OPT}{item}.{e.key}"]
                local = _local(p)
                if stored.global_shape == ():
                    t = torch.zeros((), dtype=torch_dtype(stored.dtype))
                    targets[f"opt/{item}/{e.name}"] = _scalar_shard(f"{_OPT}{item}.{e.key}", numpy_view(t),
                                                                    e.scalar_main)
                else:
                    t = torch.zeros_like(local)
                    targets.update(e.shards(f"opt/{item}/{e.name}",
                        f"{_OPT}{item}.{e.key}", numpy_view(staging.host(t, for_save=False))))
                st[item] = t
            if st:
                new_state.append((p, st))
        if problems:
            raise MismatchError(format_problems("the optimizer does not match the checkpoint", problems))

    _, masks = run_collectively(comm, "load_checkpoint: planning", prepare)
    unexpected = _unexpected(opened[0].metadata, masks, optimizer is not None or optimizer_shards is not None,
                             set(shadows or {}))
    if strict and unexpected:
        raise MismatchError(format_problems(
            f"{path}: checkpoint tensors that no rank's model reads (a model that lacks them, or other names; "
            "pass strict=False to load the rest and leave them out)", [repr(k) for k in unexpected]))
    stats = gs.IOStats()
    trainer = opened[0].load(targets, comm=comm, allow_lossy_cast=allow_lossy_cast, stats=stats,
                             shared_reads=shared_reads)
    staging.finish_load()
    extra_state_finish(extras)
    if zero:
        inner: Any = optimizer
        for fs in zero_pieces:
            inner.optim.state[fs.param] = {k: v.view(fs.param.shape) if v.ndim else v for k, v in fs.state.items()}
    if optimizer is not None:
        for p, st in new_state:
            optimizer.state[p] = {k: _like_param(p, v) for k, v in st.items()}
        saved_groups = (trainer.get("optimizer") or {}).get("param_groups", [])
        # By position unless a check matched them otherwise (a ZeroRedundancyOptimizer's are not checked);
        # a group none of whose parameters the checkpoint holds keeps its own.
        sources = group_sources if group_sources else range(len(saved_groups))
        for group, source in zip(optimizer.param_groups, sources):
            if source is None:
                continue
            for k, v in saved_groups[source].items():
                if group_sources and k in _IDENTITY_KEYS:
                    continue  # what names the group (an experts' one may take a dense group's values)
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    if scheduler is not None and trainer.get("lr_scheduler") is not None:
        scheduler.load_state_dict(from_jsonable(trainer["lr_scheduler"]))
    restored = False
    rng: dict[str, Any] = trainer.get("rng") or {}
    # TODO(limitation): RNG states come back only on the layout that saved them;
    # on another layout there is no rank-for-rank correspondence to restore.
    same_layout = bool(rng) and rng.get("world_size") == comm.world_size \
        and rng.get("parallel_config") == layout.config_json()
    if restore_rng and same_layout:
        set_rng_state(rng["ranks"][comm.rank])
        restored = True
    # TODO(limitation): per-rank state (a dataloader's position) comes back only on the
    # layout that saved it, like RNG states.
    own = trainer["rank_state"][comm.rank] if same_layout and trainer.get("rank_state") else None
    user = {k: v for k, v in trainer.items() if k not in _RESERVED}
    return LoadResult(user, restored, stats, own, sorted(set(missing)), unexpected)


def _fit_padding(targets: dict[str, gs.ShardedTensor], metadata: gs.Metadata) -> None:
    """Padding rows (spec section 1) are zero unless the checkpoint holds them:
    each padding target takes the rows its layout shares with the saving
    layout's padding (as Megatron-Core's own checkpoints do) and keeps the
    rest zero; absent from the checkpoint, it is all zeros."""
    for name, t in list(targets.items()):
        if not gs.is_padding_key(t.key):
            continue
        t.data[...] = 0
        stored = metadata.tensors.get(t.key)
        if stored is None:
            del targets[name]
            continue
        (region,) = t.regions
        targets[name] = gs.ShardedTensor.from_offset(t.key, t.data, global_shape=stored.global_shape,
                                                     global_offset=region.global_box.offset, allow_padding=True)


def _unexpected(metadata: gs.Metadata, masks: list[str], with_optimizer: bool, shadow_kinds: set[str]) -> list[str]:
    """The unread checkpoint keys of the kinds a load asked for: model tensors
    always, optimizer state with an optimizer, shadows of the kinds given."""
    out = []
    for key in gs_planner.unread_keys(metadata, masks):
        if key.startswith(extra_state.PREFIX) or gs.is_padding_key(key):
            continue  # per-rank state, matched module by module; padding rows a smaller padding leaves
        if key.startswith(_OPT):
            if with_optimizer:
                out.append(key)
            continue
        kind, _, rest = key.partition(".")
        if rest in metadata.tensors:  # a shadow copy of a stored tensor (ema.<key>)
            if kind in shadow_kinds:
                out.append(key)
            continue
        out.append(key)
    return out


def _shadow_items(shadows: Mapping[str, Mapping[str, torch.Tensor]] | None,
                  entries: list[Entry]) -> list[tuple[str, Entry, torch.Tensor]]:
    """``(kind, entry, tensor)`` for each shadow copy, checked against its parameter."""
    out, problems = [], []
    by_name = {e.name: e for e in entries}
    for kind, tensors in (shadows or {}).items():
        if not kind or kind in ("optimizer", "_extra_state") or "." in kind:
            problems.append(f"shadow kind {kind!r}: a plain name other than 'optimizer' is needed")
            continue
        for name, tensor in tensors.items():
            e = by_name.get(name)
            if e is None:
                problems.append(f"{kind}: {name!r} is not a tensor of the model")
            elif tuple(_local(tensor).shape) != tuple(e.tensor.shape):
                problems.append(f"{kind}: {name!r} has shape {tuple(_local(tensor).shape)}, its parameter "
                                f"{tuple(e.tensor.shape)}")
            else:
                out.append((kind, e, tensor))
    if problems:
        raise LayoutError(format_problems("cannot place the shadow copies", problems))
    return out


def _is_zero_redundancy(optimizer: Any) -> bool:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _optimizer_class(optimizer: Any) -> str | None:
    """The class recorded for an optimizer: ZeRO's inner one, so that ZeRO and
    the plain optimizer load each other's checkpoints."""
    if optimizer is None:
        return None
    return type(optimizer.optim).__name__ if _is_zero_redundancy(optimizer) else type(optimizer).__name__


def _flat_items(pieces: Sequence[FlatShard], entries: list[Entry]) -> Any:
    """``(piece, entry, item, key, tensor)`` for every state item of every piece."""
    by_id = {id(e.param): e for e in entries}
    problems = []
    out = []
    for fs in pieces:
        e = by_id.get(id(fs.param))
        if e is None:
            if outside_mesh(fs.param):
                continue
            problems.append(f"a flat optimizer shard of a tensor of shape {tuple(fs.param.shape)} that is not a "
                            "parameter of the model")
            continue
        for item, t in fs.state.items():
            out.append((fs, e, item, f"{_OPT}{item}.{e.key}", t))
    if problems:
        raise LayoutError(format_problems("cannot map the optimizer shards to checkpoint keys", problems))
    return out


def _check_main_copies(optimizer: torch.optim.Optimizer | None, pieces: Sequence[FlatShard],
                       entries: list[Entry]) -> None:
    """Refuse pieces whose state the optimizer keeps for a copy of another dtype
    than the parameter (the fp32 main copy of a bf16 parameter, as Megatron-Core's
    DistributedOptimizer steps) without giving that copy as ``master``: a save
    would lose it, a load leave it as it was."""
    if optimizer is None:
        return
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]  # Megatron-Core's ChainedOptimizer
    stepped = {id(v): p for part in parts for group in part.param_groups for p in group["params"]
               for v in part.state.get(p, {}).values() if torch.is_tensor(v)}
    by_id = {id(e.param): e for e in entries}
    problems = []
    for fs in pieces:
        if "master" in fs.state or id(fs.param) not in by_id:
            continue
        copy = next((stepped[id(t)] for t in fs.state.values() if id(t) in stepped), None)
        if copy is not None and copy.dtype != fs.param.dtype:
            problems.append(f"{by_id[id(fs.param)].key!r}: the optimizer steps a {copy.dtype} copy of this "
                            f"{fs.param.dtype} parameter, which the piece does not give as its 'master'")
    if problems:
        raise LayoutError(format_problems("optimizer_shards leave out main copies", problems))


def _add_flat(into: dict[str, gs.ShardedTensor], fs: FlatShard, e: Entry, item: str, key: str, data: Any) -> None:
    """The ShardedTensors of one state item of one flat piece: a 0-d item is
    the parameter's scalar (its main copy where the piece starts the
    parameter), a 1-D one the piece's elements mapped through the entry's regions."""
    main = e.main if e.main_across_dp is None else e.main_across_dp
    scalar_main = e.scalar_main if e.scalar_main_across_dp is None else e.scalar_main_across_dp
    if data.ndim == 0:
        into[f"flat/{item}/{e.name}/{fs.start}"] = _scalar_shard(key, data, scalar_main and fs.start == 0)
        return
    local_shape, regions = e.regions()
    for replica in (False, True):  # regions this rank holds as main, then those another TP rank also holds
        part = [r for r, shared in regions if shared == replica]
        if not part:
            continue
        for i, t in enumerate(gs.shards_from_flat_range(
                key, data, global_shape=e.placement.global_shape, start=fs.start, local_shape=local_shape,
                regions=part, replica_id=0 if main and not replica else 1)):
            into[f"flat/{item}/{e.name}/{fs.start}/{int(replica)}/{i}"] = t
    padding = e.padding()  # the piece's elements in vocabulary padding rows, in the key's companion
    if padding is not None:
        shape, region = padding
        for i, t in enumerate(gs.shards_from_flat_range(
                key + gs.PADDING_SUFFIX, data, global_shape=shape, start=fs.start, local_shape=local_shape,
                regions=[region], replica_id=0 if main else 1)):
            into[f"flat/{item}/{e.name}/{fs.start}/padding/{i}"] = t


def _zero_targets(optimizer: Any, entries: list[Entry], metadata: gs.Metadata) -> list[FlatShard]:
    """Fresh state for the parameters of a ZeroRedundancyOptimizer's own
    partition: every item the checkpoint holds for their keys."""
    by_id = {id(e.param): e for e in entries}
    pieces = []
    for group in optimizer.optim.param_groups:
        for p in group["params"]:
            e = by_id.get(id(p))
            if e is None:
                continue
            state = {}
            for key, stored in metadata.tensors.items():
                if key.startswith(_OPT) and key.endswith(f".{e.key}") and not key.startswith(f"{_OPT}master."):
                    item = key[len(_OPT):-len(e.key) - 1]
                    state[item] = (torch.zeros((), dtype=torch_dtype(stored.dtype)) if stored.global_shape == ()
                                   else torch.zeros(p.numel(), dtype=p.dtype))
            pieces.append(FlatShard(p, 0, p.numel(), state))
    return pieces


def _like_param(p: Any, local: torch.Tensor) -> torch.Tensor:
    """Optimizer state for ``p``: a DTensor with p's placements when p is one."""
    if local.ndim == 0 or not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


# Megatron-Core's param_group_identifier_keys (NeMo prefixes the first two with "pre_").
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
_IDENTITY_KEYS = frozenset(_GROUP_IDENTITY) | {f"pre_{k}" for k in _GROUP_IDENTITY}


def _sources_by_membership(optimizer: torch.optim.Optimizer, params: list[tuple[int, torch.Tensor, Entry, bool]],
                           saved: dict[str, Any]) -> list[int | None]:
    """For each of the optimizer's param groups, the saved group its parameters
    were in (by their checkpoint keys, as DCP matches groups by parameter name):
    groups may be reordered, split or merged, and a group none of whose
    parameters the checkpoint holds gets None (it keeps its hyperparameters).
    Checkpoints without a record of membership match by position.

    Raises:
        MismatchError: another optimizer class; a group whose parameters were
            saved in groups of different hyperparameters (named).
    """
    membership: dict[str, int] = saved.get("membership") or {}
    if not membership:
        return list(_check_groups(optimizer, saved))
    _check_class(optimizer, saved)
    saved_groups = saved.get("param_groups", [])
    origins: list[set[int]] = [set() for _ in optimizer.param_groups]
    for g, _, e, _ in params:
        if e.key in membership:
            origins[g].add(membership[e.key])
    out: list[int | None] = []
    problems = []
    for g, found in enumerate(origins):
        if any(s >= len(saved_groups) for s in found):
            problems.append(f"param group {g}: its parameters were saved in groups {sorted(found)}, the checkpoint "
                            f"records the hyperparameters of {len(saved_groups)}")
            continue
        differ = sorted({k for s in found for t in found for k in saved_groups[s]
                         if saved_groups[s].get(k) != saved_groups[t].get(k)})
        if differ:
            problems.append(f"param group {g} holds parameters saved in groups {sorted(found)}, whose {differ} "
                            "differ; keep them in groups of their own")
        out.append(min(found) if found else None)
    if problems:
        raise MismatchError(format_problems("the optimizer's param groups do not match the checkpoint's", problems))
    return out


def _check_class(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    if saved.get("class") != _optimizer_class(optimizer):
        raise MismatchError(f"the checkpoint holds {saved.get('class')} state; the optimizer is "
                            f"{_optimizer_class(optimizer)}")


def _check_groups(optimizer: torch.optim.Optimizer, saved: dict[str, Any] | None,
                  by_identity: bool = False) -> list[int]:
    """For each of the optimizer's param groups, the saved group whose
    hyperparameters it gets: the one in the same place, or, when their number
    changed and ``by_identity`` (state held by pieces, not by group), the one
    with the same Megatron-Core identity, else the one that differs from it
    only in ``is_expert_parallel`` (expert groups come and go with EP)."""
    if saved is None:
        return []
    _check_class(optimizer, saved)
    saved_groups, groups = saved.get("param_groups", []), optimizer.param_groups
    if len(saved_groups) == len(groups):
        return list(range(len(groups)))
    identities = [_group_identity(g) for g in saved_groups]
    # TODO(limitation): when their number changes, the groups of a distributed optimizer's flat shards are
    # matched by Megatron-Core's identifier keys only (other optimizers': by their parameters' membership).
    if not by_identity or any(i is None for i in identities) or any(_group_identity(g) is None for g in groups):
        raise MismatchError(f"the checkpoint has {len(saved_groups)} optimizer param groups, the optimizer "
                            f"{len(groups)}")
    out, problems = [], []
    for n, group in enumerate(groups):
        identity = _group_identity(group)
        assert identity is not None
        # Experts' groups exist only with EP > 1 and differ from the dense ones by is_expert_parallel alone.
        source = identities.index(identity) if identity in identities else next(
            (i for i, saved_id in enumerate(identities)
             if saved_id is not None and _without_expert(saved_id) == _without_expert(identity)), None)
        if source is None:
            problems.append(f"param group {n} ({dict(zip(_GROUP_IDENTITY, identity))}): no saved group has "
                            "this identity")
        else:
            out.append(source)
    if problems:
        raise MismatchError(format_problems("the optimizer's param groups do not match the checkpoint's", problems))
    return out


def _without_expert(identity: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v for k, v in zip(_GROUP_IDENTITY, identity) if k != "is_expert_parallel")


def _group_identity(group: Mapping[str, Any]) -> tuple[Any, ...] | None:
    try:
        return tuple(group[k] if k in group else group[f"pre_{k}"] for k in _GROUP_IDENTITY)
    except KeyError:
        return None


# --------------------------------------------------------------------------- manager

class CheckpointManager(gs.CheckpointManager):
    """:class:`globalshard.CheckpointManager` for torch models: :meth:`save`
    runs :func:`save_checkpoint` and :meth:`load_latest` :func:`load_checkpoint`;
    the communicator defaults to torch.distributed's when it is initialised.

    ``root`` is a local directory or any kvstore (``kvstore=`` as for
    :func:`globalshard.save`).
    """

    def comm(self) -> Comm | None:
        return resolve_comm(self._comm) if self._comm is not None else default_comm()

    def save(self, step: int, **kwargs: Any) -> Any:  # type: ignore[override]
        """:func:`save_checkpoint` into ``iter_<step>``, then move the pointer and
        prune; with ``saver=``, once that save has committed (see
        :class:`globalshard.CheckpointManager`)."""
        trainer_state = dict(kwargs.pop("trainer_state", None) or {})
        trainer_state.setdefault("step", step)
        return self.save_with(step, lambda path: save_checkpoint(path, trainer_state=trainer_state,
                                                                 comm=self.comm(), **kwargs),
                              saver=kwargs.get("saver"))

    def load_latest(self, **kwargs: Any) -> LoadResult | None:  # type: ignore[override]
        """:func:`load_checkpoint` from :meth:`latest`; None when there is none.
        An asynchronous save in flight is waited for first."""
        self.wait()
        found = self.latest()
        if found is None:
            return None
        return load_checkpoint(found[1], comm=self.comm(), **kwargs)


@dataclass(frozen=True)
class TierStep:
    """A step of a :class:`TieredManager`'s tiers (:meth:`TieredManager.target`):
    the path to pass :func:`save_checkpoint` or :func:`globalshard_torch.save`
    to save into the tiers."""

    manager: TieredManager
    step: int

    def refuse(self, **options: Any) -> None:
        """Refuse the save options a tiered save has no use for, naming those given."""
        given = [name for name, value in options.items() if value]
        if given:
            raise LayoutError(f"a TieredManager's save takes none of {given}: the manager names and keeps its "
                              "steps in its persistent tier (no overwrite=, kvstore=)")

    def save(self, shards: Mapping[str, gs.ShardedTensor], trainer_state: dict[str, Any],
             stats: gs.IOStats | None, saver: gs.AsyncSaver | None, staging: HostStaging, **options: Any) -> None:
        """Save the staged ``shards`` as this step (with ``saver``: in the
        background); ``options``: ``pack_below``, ``base``, ``frozen``, ``digests``, ``unchanged``,
        ``check_replicas``."""
        self.manager.save_state(self.step, shards, trainer_state=trainer_state, stats=stats, saver=saver,
                                staged=staging.staged(shards) if saver is not None else None, **options)


class TieredManager(gs.TieredManager):
    """:class:`globalshard.TieredManager` for torch models: :meth:`save` runs
    :func:`save_checkpoint` into the tiers (a node-local tier, then the
    persistent one) and :meth:`load_latest` runs :func:`load_checkpoint` from
    the nearest copies, onto any layout; the communicator defaults to
    torch.distributed's (its gloo group carries the copies between nodes).
    With ``saver=`` (an :class:`globalshard.AsyncSaver`), a save returns once
    the arrays are in its staging pool; the tier copies follow in the
    background (see :meth:`globalshard.TieredManager.save`).

    For example::

        manager = gt.TieredManager(tiers=[gs.LocalTier("/local/ckpt", replicas=1, keep=2), "s3://bucket/run/"])
        manager.save(step, model=chunks, layout=layout, rules=rules, optimizer=opt)
        result = manager.load_latest(model=chunks, layout=new_layout, rules=rules, optimizer=opt)
    """

    def comm(self) -> Comm | None:
        return resolve_comm(self._comm) if self._comm is not None else default_comm()

    def save(self, step: int, **kwargs: Any) -> Any:  # type: ignore[override]
        """:func:`save_checkpoint` as step ``step`` of the tiers (see the class)."""
        trainer_state = dict(kwargs.pop("trainer_state", None) or {})
        trainer_state.setdefault("step", step)
        save_checkpoint(self.target(step), trainer_state=trainer_state, comm=self.comm(), **kwargs)
        return self.path(step)

    def target(self, step: int) -> Any:
        """What to pass :func:`save_checkpoint` as its path to save step ``step``
        into the tiers (for a trainer that calls it itself), once the step
        before is drained."""
        self.wait()
        return TierStep(self, step)

    def save_state(self, step: int, state: Any, **kwargs: Any) -> Any:
        """:meth:`globalshard.TieredManager.save` of a state of ShardedTensors."""
        return super().save(step, state, **kwargs)

    def load_latest(self, **kwargs: Any) -> LoadResult | None:  # type: ignore[override]
        """:func:`load_checkpoint` from the newest step whole in the tiers; None when there is none."""
        found = self.open_latest()
        if found is None:
            return None
        result = load_checkpoint(found, comm=self.comm(), **kwargs)
        self.recovery = found.recovery
        return result
