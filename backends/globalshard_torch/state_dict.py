"""DCP-style entry points: save and load a nested state dict, no layout, no rules.

For users of ``torch.distributed.checkpoint`` (and torchtitan): the state is a
nested dict, as ``model.state_dict()`` or
``torch.distributed.checkpoint.state_dict.get_state_dict`` give it, holding

* DTensors, which place themselves (Shard / Replicate on any mesh, meshes over
  a subset of the ranks included). A key on a mesh over part of the ranks
  may have copies on other meshes of the same dims and shape (tensor
  parallelism on the "tp" sub-mesh, data parallelism across it): as in DCP,
  they are taken as data-parallel replicas, equal, and stored once;
* torch's ``ShardedTensor`` (``torch.distributed._shard``: FSDP1's
  ``SHARDED_STATE_DICT``, which ``get_state_dict`` gives for an FSDP1 model,
  and TorchRec's tables): each local shard at its offsets, as DCP stores them.
  One on a process group over part of the ranks (FSDP1's hybrid sharding)
  may have copies on other groups with the same shards: taken as
  data-parallel replicas, equal, and stored once, as DCP does;
* plain tensors, which are taken as equal on every rank that holds them (all
  ranks, or a pipeline stage's), and stored once;
* Stateful objects (anything with ``state_dict()`` and ``load_state_dict()``:
  a GradScaler, a dataloader, an EMA helper), saved through their state dicts
  and restored by ``load_state_dict`` after the load;
* JSON values (numbers, strings, booleans, None, lists, tuples, dicts of
  them), which go into the trainer state (each key from the lowest rank
  holding it; tuples come back as tuples, as ``random.getstate()`` needs
  them), and
  ``bytes`` and ``io.BytesIO`` (what Transformer Engine modules put in a
  model's state dict as ``_extra_state``, and what DCP saves as a stream),
  stored as uint8 arrays: a BytesIO comes back as one, at the position it
  was saved at, as DCP gives it back; and numpy arrays (a metric's history,
  a sampler's permutation), stored as arrays and given back as numpy arrays
  (filled in place when the state dict holds one of their shape and dtype).

Keys are the dotted paths of the leaves, as DCP flattens them
(``{"model": {"w": t}}`` -> ``model.w``), after removing the wrapper prefixes
``_orig_mod.`` (torch.compile), ``_checkpoint_wrapped_module.`` (activation
checkpointing), ``_fsdp_wrapped_module.`` (FSDP1) and ``module.`` (DDP) from
every component, so a compiled or wrapped model loads into a plain one. Lists
are traversed (with their index as a component) only when they hold tensors,
as in DCP.

Anything else (a module, a function, an arbitrary object) is an error naming
its key: nothing is dropped, and nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

import globalshard as gs
from globalshard.comm import Comm, distinct_values, json_digest, run_collectively
from globalshard.dtypes import numpy_dtype
from globalshard.errors import LayoutError, MetadataError, MismatchError, format_problems
from globalshard.planner import asked_mask, missing_key, unread_keys
from globalshard_torch.checkpoint import TierStep
from globalshard_torch.comm import resolve_comm
from globalshard_torch.model import _dtensor_placement, _is_dtensor, outside_mesh, unwrapped_name
from globalshard_torch.state import from_jsonable, jsonable
from globalshard_torch.tensors import HostStaging, load_device, numpy_view, unusable

__all__ = ["LoadedKeys", "load", "save"]


class LoadedKeys(NamedTuple):
    """What :func:`load` could not match, as torch's ``load_state_dict`` reports it."""

    #: Keys of the state dict that the checkpoint does not hold (left as they were).
    missing_keys: list[str]
    #: Keys of the checkpoint (tensors, JSON values, bytes) that no rank's state dict asked for.
    unexpected_keys: list[str]

_VALUES = "state_dict_values"  # trainer-state member holding the JSON leaves, by key
_BYTES = "state_dict_bytes"  # the keys stored as uint8 arrays from bytes
_STREAMS = "state_dict_bytes_io"  # of those, the keys saved from an io.BytesIO: key -> its position
_ARRAYS = "state_dict_arrays"  # the keys saved from numpy arrays
_TUPLES = "state_dict_tuples"  # JSON leaves holding tuples: key -> the paths of the tuples in the value


def _holds_tensors(value: Any) -> bool:
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return _is_stateful(value)


def _is_stateful(value: Any) -> bool:
    """Anything with ``state_dict()`` and ``load_state_dict()``, but modules and
    plain optimizers: an optimizer that declares itself ``Stateful``
    (torchtitan's ``OptimizersContainer``, whose state dict is keyed by
    parameter name) is one; a plain optimizer's is keyed by position."""
    if not (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))):
        return False
    if isinstance(value, torch.nn.Module):
        return False
    if isinstance(value, torch.optim.Optimizer):
        from torch.distributed.checkpoint.stateful import Stateful

        return Stateful in type(value).__mro__
    return True


def _refusal(value: Any) -> str | None:
    """Why a leaf that looks like state cannot be saved as it is, if it cannot."""
    if isinstance(value, torch.optim.Optimizer):
        return ("a torch optimizer's own state dict is keyed by parameter position; pass "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer) (keyed by "
                "parameter name) instead")
    if isinstance(value, torch.nn.Module):
        return "a module: pass its state_dict() (or get_model_state_dict(model))"
    return None


Visit = Callable[[str, Any, MutableMapping[Any, Any] | list[Any], Any], None]


def _walk(state: Any, visit: Visit, prefix: str = "", seen: dict[str, str] | None = None) -> None:
    """Call ``visit(key, leaf, container, index)`` for every leaf, DCP-style."""
    seen = {} if seen is None else seen
    items: list[tuple[Any, Any]]
    if isinstance(state, dict):
        items = list(state.items())
    else:
        items = list(enumerate(state))
    for k, value in items:
        if isinstance(state, dict) and not isinstance(k, str):
            raise LayoutError(f"{prefix or '$'}: key {k!r} is a {type(k).__name__}; state dict keys are strings")
        component = unwrapped_name(str(k))
        key = f"{prefix}.{component}" if prefix else component
        if isinstance(value, dict) or (isinstance(value, (list, tuple)) and _holds_tensors(value)):
            if isinstance(value, tuple) and _holds_tensors(value):
                raise LayoutError(f"{key}: a tuple holding tensors or arrays cannot be filled in place; use a list"
                                  " (numpy's get_state() is such a tuple: np.random.default_rng's "
                                  "bit_generator.state is a dict of numbers)")
            _walk(value, visit, key, seen)
            continue
        if key in seen:
            raise LayoutError(f"{key}: two entries of the state dict flatten to this key ({seen[key]!r} and "
                              f"{'.'.join(map(str, [prefix, k]))!r})")
        seen[key] = ".".join(map(str, [prefix, k])) if prefix else str(k)
        visit(key, value, state, k)


def _check_root(state_dict: Any) -> None:
    if not isinstance(state_dict, dict):
        raise LayoutError(f"a state dict is a dict of tensors, Stateful objects and JSON values, got a "
                          f"{type(state_dict).__name__}")


def _replica_shard(key: str, data: np.ndarray, main: bool) -> gs.ShardedTensor:
    return gs.ShardedTensor.from_offset(key, data, global_shape=tuple(data.shape), global_offset=(0,) * data.ndim,
                                        replica_id=0 if main else 1)


def _is_sharded_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is torch's (pre-DTensor) ``ShardedTensor``."""
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, ShardedTensor)


def _tensor_shards(key: str, t: torch.Tensor, staging: HostStaging, *, for_save: bool) -> list[gs.ShardedTensor]:
    """``t`` as this rank's shards of key ``key``: a ShardedTensor's local shards
    (none, one or several, each at its offsets, all main copies), else what
    :func:`_tensor_shard` gives."""
    if not _is_sharded_tensor(t):
        shard = _tensor_shard(key, t.detach(), staging, for_save=for_save)
        return [] if shard is None else [shard]
    global_shape = tuple(t.size())
    out = []
    for local in t.local_shards():  # type: ignore[attr-defined]
        offsets, sizes = tuple(local.metadata.shard_offsets), tuple(local.metadata.shard_sizes)
        if tuple(local.tensor.shape) != sizes:
            raise LayoutError(f"{key}: a local shard of shape {tuple(local.tensor.shape)} where its metadata "
                              f"says {sizes}")
        data = numpy_view(staging.host(local.tensor, for_save=for_save))
        out.append(gs.ShardedTensor.from_offset(key, data, global_shape=global_shape, global_offset=offsets))
    return out


def _materialized(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor to load a target given on the meta device into, as DCP
    makes one (a model built on the meta device, whose state dict is loaded
    rather than initialized): on :func:`load_device`; a DTensor with the same
    placements and global shape, on its mesh's device type.

    Raises:
        LayoutError: a torch ShardedTensor on the meta device (as in DCP).
    """
    if _is_sharded_tensor(t):
        raise LayoutError("a ShardedTensor on the meta device: its shards hold no data to load into")
    if _is_dtensor(t):
        from torch.distributed.tensor import DTensor

        mesh = t.device_mesh  # type: ignore[attr-defined]
        kind = mesh.device_type
        device = torch.device(kind) if kind == "cpu" else torch.device(kind, getattr(torch, kind).current_device())
        local = torch.empty_like(t.to_local(), device=device)  # type: ignore[attr-defined]
        return DTensor.from_local(local, mesh, t.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=t.size(), stride=t.stride())
    return torch.empty_like(t, device=load_device())


def _named(key: str, shards: list[gs.ShardedTensor]) -> dict[str, gs.ShardedTensor]:
    """Names for a key's shards in one dict: the key, then the key, a NUL and a number
    (no state dict key holds a NUL)."""
    return {key if i == 0 else f"{key}\0{i}": shard for i, shard in enumerate(shards)}


def _tensor_shard(key: str, t: torch.Tensor, staging: HostStaging, *, for_save: bool) -> gs.ShardedTensor | None:
    """``t`` as a shard: a DTensor where it places itself (the main copy where its mesh
    coordinates on Replicate dims are 0), a plain tensor whole (a main copy)."""
    if _is_dtensor(t):
        if outside_mesh(t):
            return None  # this rank holds nothing of it
        try:
            local, placement, main, _ = _dtensor_placement(t)
        except LayoutError as e:
            raise LayoutError(f"{key}: {e}") from e
        assert placement.regions is not None
        return gs.ShardedTensor(key, numpy_view(staging.host(local, for_save=for_save)), placement.global_shape,
                                placement.regions, 0 if main else 1)
    return _replica_shard(key, numpy_view(staging.host(t, for_save=for_save)), True)


def _holder(t: torch.Tensor, rank: int, world_size: int) -> tuple[str, int] | None:
    """``(kind, holder)`` of a tensor whose copies other ranks may hold: a plain
    tensor (kind ``""``, held by this rank), a DTensor on a mesh over part of
    the world (kind its dim names and shape, held by its mesh's lowest rank),
    or a ShardedTensor on a process group over part of the world, as FSDP1's
    hybrid sharding makes them (kind its shards' boxes, held by its group's
    lowest rank)."""
    if _is_sharded_tensor(t):
        group = torch.distributed.get_process_group_ranks(t._process_group)  # type: ignore[attr-defined]
        if len(group) >= world_size:
            return None
        metadata = t.metadata()  # type: ignore[attr-defined]
        boxes = [[list(m.shard_offsets), list(m.shard_sizes)] for m in metadata.shards_metadata]
        return json.dumps(["ShardedTensor", sorted(boxes)]), min(group)
    if not _is_dtensor(t):
        return "", rank
    mesh = t.device_mesh  # type: ignore[attr-defined]
    if mesh.mesh.numel() >= world_size:  # checked first: on a save's blocking path, once per tensor
        return None
    return json.dumps([list(mesh.mesh_dim_names or ()), list(mesh.shape)]), int(mesh.mesh.min())


def replica_keys(rank: int, digests: Sequence[str], holders: Sequence[Mapping[str, int]],
                 lists: Mapping[str, Sequence[Sequence[str]]]) -> set[str]:
    """The keys of ``rank`` whose copy is not the one written, because a lower
    holder of the same kind holds the key too: for plain tensors a lower rank,
    for DTensors a mesh of the same dims and shape whose lowest rank is lower
    (data-parallel copies; PP stages' meshes hold other keys).

    ``lists[digests[r]]`` holds rank ``r``'s ``[key, kind]`` pairs and
    ``holders[r][kind]`` its holder of that kind. The cost grows with ranks
    times kinds and distinct lists times keys, not ranks times keys.
    """
    lowest: dict[str, dict[str, int]] = {}  # digest -> kind -> its lowest holder among ranks with that digest
    for r, digest in enumerate(digests):
        kinds = lowest.setdefault(digest, {})
        for kind, low in holders[r].items():
            kinds[kind] = min(kinds.get(kind, low), low)
    first: dict[tuple[str, str], int] = {}
    for digest, kinds in lowest.items():
        for key, kind in lists[digest]:
            first[key, kind] = min(first.get((key, kind), kinds[kind]), kinds[kind])
    mine = holders[rank]
    return {key for key, kind in lists[digests[rank]] if mine[kind] > first[key, kind]}


def save(state_dict: dict[str, Any], path: Any, *, comm: Comm | None = None, overwrite: bool = False,
         kvstore: Any = None, stats: gs.IOStats | None = None, pack_below: int = 0, base: Any = None,
         frozen: Sequence[str] = (), digests: bool | None = None, saver: gs.AsyncSaver | None = None,
         unchanged: Mapping[str, Mapping[tuple[int, ...], str]] | None = None,
         check_replicas: bool = False) -> None:
    """Save a nested state dict (see the module docstring). Call on every rank.
    ``pack_below``, ``base``, ``frozen``, ``digests``, ``unchanged``: as for :func:`globalshard.save`
    (small regions stored in a few packs; regions equal to a base checkpoint's
    stored as references to it). ``check_replicas``: as for
    :func:`globalshard.save`: the copies of a key that several ranks hold
    (plain tensors, replicated DTensors, data-parallel replicas) are compared
    bit for bit before anything is written, rather than taken as equal. ``saver`` (a :class:`globalshard.AsyncSaver`),
    as DCP's ``async_save``: the call returns once this rank's tensors are
    copied to host memory (CUDA tensors into the saver's page-locked pool, on
    a side stream), and the writing goes on in the background; training may
    change them meanwhile. Call ``saver.wait()`` to learn its outcome, and
    before exiting (a load or save begun meanwhile waits for its collectives
    first). ``path`` may be a :class:`TieredManager`'s ``target(step)``: the
    state is saved into its tiers (node-local copies, drained to the
    persistent tier), and ``load(state_dict, manager.open_latest())``
    recovers it from the nearest copies, onto any layout.

    Raises:
        LayoutError: a leaf that cannot be saved (named by its key), or
            shards that do not fit together; the core's errors otherwise.
    """
    _check_root(state_dict)
    if isinstance(path, TierStep):
        path.refuse(overwrite=overwrite, kvstore=kvstore)
    comm = resolve_comm(comm)
    staging = HostStaging.for_save(saver)
    shards: dict[str, gs.ShardedTensor] = {}
    values: dict[str, Any] = {}
    byte_keys: list[str] = []
    streams: dict[str, int] = {}  # the keys of io.BytesIO leaves -> their positions
    arrays: list[str] = []  # the keys of numpy array leaves
    tuples: dict[str, list[list[Any]]] = {}  # JSON leaves' keys -> where their tuples are
    shared: dict[str, str] = {}  # key -> kind, for the keys other ranks may hold copies of
    holders: dict[str, int] = {"": comm.rank}  # kind -> this rank's holder of it

    def describe() -> dict[str, Any]:
        problems: list[str] = []

        def visit(key: str, value: Any, _container: Any, _index: Any) -> None:
            if torch.is_tensor(value) and (why := unusable(value)) is not None:
                problems.append(f"{key}: {why}")
            elif torch.is_tensor(value):
                mine = _tensor_shards(key, value, staging, for_save=True)
                shards.update(_named(key, mine))
                if mine:
                    if (holder := _holder(value, comm.rank, comm.world_size)) is not None:
                        kind, low = holder
                        if holders.setdefault(kind, low) != low:
                            problems.append(f"{key}: on a mesh of dims and shape {kind} whose lowest rank is {low}, "
                                            f"where another such mesh holding this rank starts at {holders[kind]}; "
                                            "name the two meshes' dims apart")
                        shared[key] = kind
            elif _is_stateful(value):
                _walk(_plain(value.state_dict()), visit, key)
            elif isinstance(value, (bytes, bytearray, io.BytesIO)):
                data = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)
                shards[key] = _replica_shard(key, np.frombuffer(data, np.uint8).copy(), True)
                shared[key] = ""
                byte_keys.append(key)
                if isinstance(value, io.BytesIO):
                    streams[key] = value.tell()
            elif isinstance(value, np.ndarray):
                try:
                    shards[key] = _replica_shard(key, value if value.flags.c_contiguous else value.copy(), True)
                except gs.GlobalShardError as e:
                    problems.append(f"{key}: a numpy array that cannot be stored ({e})")
                else:
                    shared[key] = ""
                    arrays.append(key)
            elif (why := _refusal(value)) is not None:
                problems.append(f"{key}: {why}")
            else:
                try:
                    values[key] = jsonable(value, key)
                    if paths := _tuple_paths(value):
                        tuples[key] = paths
                except gs.TrainerStateError as e:
                    problems.append(f"{key}: {type(value).__name__} cannot be saved ({e}); a state dict holds "
                                    "tensors, Stateful objects, bytes (or io.BytesIO) and JSON values")

        _walk(state_dict, visit)
        staging.ready()
        if problems:
            raise LayoutError(format_problems("cannot save the state dict", problems))
        held.update(shared=sorted(shared.items()), values=values, bytes=sorted(byte_keys),
                    **({"streams": streams} if streams else {}), **({"arrays": sorted(arrays)} if arrays else {}),
                    **({"tuples": tuples} if tuples else {}))
        return {"digest": json_digest(held), "holders": holders}

    held: dict[str, Any] = {}  # what this rank holds that other ranks may hold too, as it is sent
    _, described = run_collectively(comm, "save: describing the state dict", describe)
    # Ranks holding other parts (pipeline stages) send what they hold, each distinct part once.
    kept = [d["digest"] for d in described]
    parts = {kept[0]: held} if len(set(kept)) == 1 else \
        distinct_values(comm, "save: what each rank holds", kept, held)
    # Which rank (plain tensors) or mesh (DTensors on part of the world) holds the main copy of
    # each such key: the lowest that holds it (DCP too stores one of the copies; any holder of
    # a copy may write it). JSON values: the lowest rank's.
    # TODO(limitation): copies of a key on several ranks are assumed equal unless the save
    # compares them (check_replicas=True); JSON values are the lowest rank's, never compared.
    copies = replica_keys(comm.rank, kept, [d["holders"] for d in described],
                          {digest: part["shared"] for digest, part in parts.items()})
    for name, shard in shards.items():
        if shard.key in copies:
            shards[name] = dataclasses.replace(shard, replica_id=1)
    merged: dict[str, Any] = {}
    shapes: dict[str, Any] = {}  # where the values kept hold tuples
    for digest in dict.fromkeys(kept):  # in rank order
        part = parts[digest]
        for key, value in part["values"].items():
            if key not in merged:
                merged[key] = value
                if key in part.get("tuples", {}):
                    shapes[key] = part["tuples"][key]
    all_bytes = sorted({key for part in parts.values() for key in part["bytes"]})
    recorded: dict[str, Any] = {_VALUES: merged, _BYTES: all_bytes}
    positions: dict[str, int] = {}
    for digest in dict.fromkeys(kept):  # the lowest rank's, as for the bytes themselves
        for key, position in parts[digest].get("streams", {}).items():
            positions.setdefault(key, position)
    if positions:  # written only when there is one: a checkpoint without streams is as it was
        recorded[_STREAMS] = dict(sorted(positions.items()))
    if shapes:  # likewise
        recorded[_TUPLES] = dict(sorted(shapes.items()))
    all_arrays = sorted({key for part in parts.values() for key in part.get("arrays", [])})
    if all_arrays:  # likewise
        recorded[_ARRAYS] = all_arrays
    if isinstance(path, TierStep):
        path.save(shards, recorded, stats, saver, staging, pack_below=pack_below, base=base, frozen=frozen,
                  digests=digests, unchanged=unchanged, check_replicas=check_replicas)
    else:
        staging.save(shards, path, saver, trainer_state=recorded, comm=comm,
                     overwrite=overwrite, kvstore=kvstore, stats=stats, pack_below=pack_below, base=base,
                     frozen=frozen, digests=digests, unchanged=unchanged, check_replicas=check_replicas)


def _tuple_paths(value: Any, path: tuple[Any, ...] = ()) -> list[list[Any]]:
    """Where ``value`` (a JSON leaf) holds tuples, which JSON stores as lists:
    each a path of list indices and dict keys, outermost first."""
    out = [list(path)] if isinstance(value, tuple) else []
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out += _tuple_paths(v, (*path, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            out += _tuple_paths(v, (*path, k))
    return out


def _with_tuples(key: str, value: Any, paths: Sequence[Sequence[Any]]) -> Any:
    """``value`` (from JSON) with the lists at ``paths`` tuples again, as saved."""
    for path in sorted(paths, key=len, reverse=True):  # the innermost first: a tuple is not changed in place
        try:
            if not path:
                value = tuple(value)
                continue
            parent = value
            for step in path[:-1]:
                parent = parent[step]
            if not isinstance(parent[path[-1]], list):
                raise TypeError(f"a {type(parent[path[-1]]).__name__} there")
            parent[path[-1]] = tuple(parent[path[-1]])
        except (LookupError, TypeError) as e:
            raise MetadataError(f"{key}: the trainer state's {_TUPLES!r} names a tuple at {list(path)} that the "
                                f"saved value does not have ({e})") from None
    return value


def _like(template: Any, value: Any) -> Any:
    """``value`` (from JSON) with the tuples the state dict had where it had them."""
    if isinstance(template, tuple) and isinstance(value, list) and len(template) == len(value):
        return tuple(_like(t, v) for t, v in zip(template, value))
    if isinstance(template, list) and isinstance(value, list) and len(template) == len(value):
        return [_like(t, v) for t, v in zip(template, value)]
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: _like(template[k], v) if k in template else v for k, v in value.items()}
    return value


def _filled(stream: Any, data: bytes, position: int) -> io.BytesIO:
    """``stream`` (a BytesIO of the state dict, else a new one) holding
    ``data``, at ``position``: where the saved stream was."""
    if not isinstance(stream, io.BytesIO):
        stream = io.BytesIO()
    stream.seek(0)
    stream.truncate()
    stream.write(data)
    stream.seek(position)
    return stream


def _plain(state: Any) -> Any:
    """A Stateful's state dict, with tuples of tensors as lists (so they load in place)."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, tuple) and _holds_tensors(state):
        return [_plain(v) for v in state]
    return state


def region_digests(state_dict: Mapping[str, Any], keys: Any) -> dict[str, dict[tuple[int, ...], str]]:
    """:func:`globalshard.region_digests` of the tensors of a flat state dict
    whose keys are in ``keys``, as :func:`save` would store them (this rank's
    pieces): what a later ``save(..., unchanged=)`` compares with."""
    staging, shards = HostStaging(), {}
    for name, value in state_dict.items():
        key = unwrapped_name(str(name))
        if key in keys and torch.is_tensor(value):
            shards.update(_named(key, _tensor_shards(key, value.detach(), staging, for_save=True)))
    staging.ready()  # device tensors' copies landed (a HostStaging without a pool overlaps none)
    return gs.region_digests(shards)


def load(state_dict: dict[str, Any], path: Any, *, comm: Comm | None = None, allow_lossy_cast: bool = False,
         kvstore: Any = None, stats: gs.IOStats | None = None, shared_reads: bool = False,
         strict: bool = True) -> LoadedKeys:
    """Load into a nested state dict in place: tensors and DTensors are filled
    where they are (any layout saved, any layout loaded), JSON values and bytes
    are replaced in their containers, Stateful objects get ``load_state_dict``.
    Call on every rank. ``shared_reads=True``: bytes several ranks need are
    read once (see :func:`globalshard.load`). ``path`` may also be a
    :class:`globalshard.Checkpoint` opened already, such as a
    :class:`TieredManager`'s ``open_latest()`` (reads from the nearest copies).

    ``strict`` (the default), as torch's ``load_state_dict``: every key asked
    for must be in the checkpoint, and every key of the checkpoint must be
    asked for by some rank. ``strict=False`` loads what matches (to load a
    part, such as the model alone) and leaves the rest as it was.

    Returns:
        :class:`LoadedKeys`: the missing and unexpected keys (empty after a
        strict load), the same unexpected keys on every rank.

    Raises:
        MismatchError / MissingKeyError: a key is missing, unexpected or does
        not match (every problem listed; nothing is written anywhere); the
        core's errors.
    """
    _check_root(state_dict)
    comm = resolve_comm(comm)
    staging = HostStaging()
    targets: dict[str, gs.ShardedTensor] = {}
    fills: list[tuple[str, MutableMapping[Any, Any] | list[Any], Any]] = []  # JSON and bytes leaves to replace
    # Tensors given on the meta device, and the tensors made to load them into: they replace them once loaded.
    created: list[tuple[str, MutableMapping[Any, Any] | list[Any], Any, torch.Tensor]] = []
    statefuls: list[tuple[Any, dict[str, Any]]] = []
    opened: list[gs.Checkpoint] = []
    missing: list[str] = []
    asked_values: set[str] = set()

    def prepare() -> dict[str, Any]:
        checkpoint = path if isinstance(path, gs.Checkpoint) else gs.Checkpoint(path, kvstore=kvstore)
        opened.append(checkpoint)
        saved = checkpoint.trainer_state
        saved_values, saved_bytes = saved.get(_VALUES, {}), set(saved.get(_BYTES, []))
        saved_arrays = set(saved.get(_ARRAYS, []))
        problems: list[str] = []

        def visit(key: str, value: Any, container: Any, index: Any) -> None:
            if torch.is_tensor(value):
                if value.device.type == "meta":
                    try:
                        value = _materialized(value)
                    except LayoutError as e:
                        problems.append(f"{key}: {e}")
                        return
                    created.append((key, container, index, value))
                if (why := unusable(value)) is not None:
                    problems.append(f"{key}: {why}")
                    return
                targets.update(_named(key, _tensor_shards(key, value, staging, for_save=False)))
            elif _is_stateful(value):
                inner = _plain(value.state_dict())
                statefuls.append((value, inner))
                _walk(inner, visit, key)
            elif key in saved_arrays:
                stored = checkpoint.metadata.tensors[key]
                dtype = numpy_dtype(stored.dtype)
                if isinstance(value, np.ndarray) and value.shape == stored.global_shape and value.dtype == dtype \
                        and value.flags.c_contiguous and value.flags.writeable:
                    targets[key] = _replica_shard(key, value, True)  # filled in place
                else:
                    targets[key] = _replica_shard(key, np.empty(stored.global_shape, dtype), True)
                    fills.append((key, container, index))
            elif key in saved_bytes:
                stored = checkpoint.metadata.tensors[key]
                targets[key] = _replica_shard(key, np.zeros(stored.global_shape, np.uint8), True)
                fills.append((key, container, index))
            elif key in saved_values:
                fills.append((key, container, index))
                asked_values.add(key)
            elif key in checkpoint.metadata.tensors:
                problems.append(f"{key}: stored as a tensor, the state dict holds a {type(value).__name__}")
            elif (why := _refusal(value)) is not None:
                problems.append(f"{key}: {why}")
            elif strict:
                problems.append(f"{key}: {missing_key(key, checkpoint.metadata)}")
            else:
                missing.append(key)

        _walk(state_dict, visit)
        if not strict:
            for name in [k for k, t in targets.items() if t.key not in checkpoint.metadata.tensors]:
                if targets[name].key not in missing:
                    missing.append(targets[name].key)
                del targets[name]
        if problems:
            raise MismatchError(format_problems("cannot load: the state dict does not match the checkpoint",
                                                problems))
        return {"tensors": asked_mask(checkpoint.metadata, {t.key for t in targets.values()}),
                "values": sorted(asked_values)}

    _, asked = run_collectively(comm, "load: matching the state dict", prepare)
    checkpoint = opened[0]
    values_read = {k for a in asked for k in a["values"]}
    unexpected = sorted([k for k in unread_keys(checkpoint.metadata, [a["tensors"] for a in asked])
                         if not gs.is_padding_key(k)]
                        + [k for k in checkpoint.trainer_state.get(_VALUES, {}) if k not in values_read])
    if strict and unexpected:
        raise MismatchError(format_problems(
            f"cannot load: checkpoint keys that no rank's state dict asks for (pass strict=False to load a part "
            f"of {path})", [repr(k) for k in unexpected]))
    checkpoint.load(targets, comm=comm, allow_lossy_cast=allow_lossy_cast, stats=stats, shared_reads=shared_reads)
    staging.finish_load()
    saved = checkpoint.trainer_state
    streams, arrays = saved.get(_STREAMS, {}), set(saved.get(_ARRAYS, []))
    for key, container, index in fills:
        if key in arrays:
            container[index] = targets[key].data
        elif key in targets:
            data = targets[key].data.tobytes()
            # As DCP gives them back: the type saved (a BytesIO: the state dict's own, filled, if it holds one).
            container[index] = _filled(container[index], data, streams[key]) if key in streams else data
        else:
            value = from_jsonable(saved[_VALUES][key])
            # As DCP gives them back: tuples where the saved value had them (or, before that was
            # recorded, where the state dict has them).
            container[index] = _with_tuples(key, value, saved[_TUPLES][key]) if key in saved.get(_TUPLES, {}) \
                else _like(container[index], value)
    for key, container, index, tensor in created:
        if key not in missing:  # a key not loaded stays on the meta device, as it was given
            container[index] = tensor
    for obj, inner in statefuls:
        obj.load_state_dict(inner)
    return LoadedKeys(sorted(missing), unexpected)
