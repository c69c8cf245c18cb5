"""``load``: the boxes each process's devices hold, read once per process, under any sharding."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

import globalshard as gs
import globalshard.errors
import globalshard.planner
from globalshard.comm import Comm
from globalshard.errors import LayoutError
from globalshard_jax.comm import default_comm
from globalshard_jax.tree import TREE, KeyMap, is_key, pytree_keys, resolve

__all__ = ["Restored", "load"]


class Restored(tuple):
    """What :func:`load` returns: unpacks as ``(pytree, trainer_state)``, and
    lists the keys it could not match."""

    missing_keys: list[str]  #: checkpoint keys of leaves the checkpoint lacks (left as given; strict=False only)
    unexpected_keys: list[str]  #: checkpoint keys that no process's pytree asked for

    def __new__(cls, pytree: Any, trainer_state: dict[str, Any], missing: list[str],
                unexpected: list[str]) -> Restored:
        self = super().__new__(cls, (pytree, trainer_state))
        self.missing_keys, self.unexpected_keys = missing, unexpected
        return self


_SCALARS = (bool, int, float, complex)


def _leaf_spec(key: str, leaf: Any) -> tuple[tuple[int, ...], np.dtype[Any], Any]:
    """``(shape, dtype, sharding)`` of a load target leaf, checked: a value
    jax would narrow (int64 or float64 with x64 off) is refused, never cut.
    For typed PRNG keys: their key data's shape and dtype."""
    if isinstance(leaf, _SCALARS):
        return (), np.asarray(leaf).dtype, None  # comes back as the same Python type, exactly
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise LayoutError(f"{key!r}: a load target leaf of type {type(leaf).__name__} is not an array, a "
                          "jax.ShapeDtypeStruct or a Python number")
    sharding = _concrete(key, getattr(leaf, "sharding", None))
    if is_key(leaf.dtype):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return tuple(int(n) for n in data.shape), np.dtype(data.dtype), sharding
    try:
        dtype = np.dtype(leaf.dtype)
    except TypeError as e:
        raise LayoutError(f"{key!r}: leaf dtype {leaf.dtype!r} is not an array dtype") from e
    if dtype.kind in "USOMm":
        raise LayoutError(f"{key!r}: a load target leaf of dtype {dtype} is not numeric")
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if canonical != dtype:
        raise gs.CastError(f"{key!r}: a {dtype} leaf would be narrowed to {canonical} by jax (64-bit types are "
                           "off); enable them with jax.config.update('jax_enable_x64', True), or ask for "
                           f"{canonical} (allow_lossy_cast=True if the stored values need it)")
    return tuple(int(n) for n in leaf.shape), dtype, sharding


def _concrete(key: str, sharding: Any) -> Any:
    """``sharding``, a ``NamedSharding`` over an ``AbstractMesh`` (what ``jax.eval_shape`` and
    ``nnx.eval_shape`` give inside ``jax.set_mesh``) resolved to the mesh set around the load, as
    Orbax does: an abstract mesh has no devices to put the boxes on."""
    abstract = getattr(jax.sharding, "AbstractMesh", None)
    if abstract is None or not isinstance(getattr(sharding, "mesh", None), abstract):
        return sharding
    current = jax.sharding.get_mesh() if hasattr(jax.sharding, "get_mesh") else None
    if current is None or not current.axis_names:
        raise LayoutError(f"{key!r}: its sharding is over an AbstractMesh {dict(sharding.mesh.shape)}, which has no "
                          "devices; load inside `with jax.set_mesh(mesh)`, or give a sharding over a Mesh")
    if current.abstract_mesh != sharding.mesh:
        raise LayoutError(f"{key!r}: its sharding is over an AbstractMesh {dict(sharding.mesh.shape)}, not the mesh "
                          f"set around the load ({dict(current.shape)}, devices {current.device_ids.tolist()})")
    return jax.sharding.NamedSharding(current, sharding.spec, memory_kind=sharding.memory_kind)


def load(path: Any, abstract_pytree: Any = None, *, comm: Comm | None = None, keys: KeyMap = None,
         allow_lossy_cast: bool = False, kvstore: Any = None,
         stats: gs.IOStats | None = None, strict: bool = True, fallback_sharding: Any = None) -> Restored:
    """Arrays for every leaf of ``abstract_pytree``, and the trainer state.

    Without ``abstract_pytree``, the pytree the checkpoint's :func:`save` was
    given comes back whole, in the containers Orbax's restore without a
    target gives: dicts and lists as they were, tuples as lists (``()`` as
    itself), other nodes (an optax state, a dataclass) as dicts of their
    children (``None`` when they have none), dict keys as strings;
    ``jax.Array`` leaves (see below), numpy arrays as numpy arrays,
    Python numbers as Python numbers, typed PRNG keys with their saved
    implementation. A ``jax.Array`` saved with a ``NamedSharding`` comes back
    with it, as Orbax restores it: over the devices of the same ids (each
    process reading only its boxes). Where this job lacks them, it takes
    ``fallback_sharding`` (Orbax's argument of that name: a sharding for
    every such leaf, such as a replicated ``NamedSharding`` of this job's
    mesh, or ``SingleDeviceSharding`` for one device), and without one the
    load is a ``MismatchError`` naming the leaf, where Orbax raises too.
    Other arrays come back on the default device. A checkpoint that
    ``gj.save`` did not write (a torch one) comes back as nested dicts of
    numpy arrays, its keys split at the dots.

    A leaf is a ``jax.ShapeDtypeStruct`` (with a ``sharding``: a
    ``NamedSharding`` or any other; without one, the array goes to the
    default device), an array whose shape, dtype and sharding are reused,
    or a Python number (it comes back as one). Each process reads only the
    boxes its devices hold, each once. A 64-bit leaf loads exactly when
    jax's x64 mode is on, and is an error naming it otherwise. An integer
    leaf narrower than what is stored (a Python int saved as int64, asked
    for as int32) loads when every value fits, and is a ``CastError`` naming
    it on every process otherwise.

    ``strict`` (the default): every leaf's key must be in the checkpoint and
    every checkpoint key must be asked for by some process; ``strict=False``
    loads what matches and leaves missing leaves as given.

    Returns:
        :class:`Restored`, which unpacks as ``(pytree, trainer_state)``, with
        ``missing_keys`` and ``unexpected_keys``.
    """
    comm = comm if comm is not None else default_comm()
    if abstract_pytree is None:
        if keys is not None:
            raise LayoutError("keys= maps a target's leaves to checkpoint keys; without a target there are none")
        return _whole(path, comm=comm, allow_lossy_cast=allow_lossy_cast, kvstore=kvstore, stats=stats,
                      fallback=fallback_sharding)
    if fallback_sharding is not None:
        raise LayoutError("fallback_sharding is for a load without a target; a target's leaves carry their shardings")
    return _load(path, abstract_pytree, None, comm=comm, keys=keys, allow_lossy_cast=allow_lossy_cast,
                 kvstore=kvstore, stats=stats, strict=strict)


def _load(path: Any, abstract_pytree: Any, opened: gs.Checkpoint | None, *, comm: Comm, keys: KeyMap,
          allow_lossy_cast: bool, kvstore: Any, stats: gs.IOStats | None, strict: bool) -> Restored:
    """:func:`load` into a target, from ``opened`` when the caller has the checkpoint open already."""
    treedef = jax.tree_util.tree_structure(abstract_pytree)
    named = pytree_keys(abstract_pytree)
    targets: dict[str, gs.ShardedTensor] = {}
    plans: list[Any] = []  # per leaf: (sharding, shape, dtype, {box: (host array, [devices])}), or None when missing
    specs, problems, kinds = [], [], set()
    for key, leaf in named:
        try:
            specs.append(_leaf_spec(key, leaf))
        except gs.GlobalShardError as e:
            problems.append(str(e))
            kinds.add(type(e))
    if problems:
        kind = gs.CastError if kinds == {gs.CastError} else LayoutError
        raise kind(gs.errors.format_problems("cannot load into this pytree", problems))
    checkpoint = opened if opened is not None else gs.Checkpoint(path, kvstore=kvstore)
    # TODO(limitation): a checkpoint written before the skeleton existed names no key implementation: its key
    # data loads as the target's keys (rbg's 4 words as unsafe_rbg's; threefry's 2 are a shape error).
    impls = _key_impls(checkpoint.trainer_state.get(TREE, {}).get("pytree"))
    wrong = [f"{key!r}: saved as {impls[k]} keys, the target asks for {_impl_name(leaf.dtype)} keys"
             for key, leaf in named if is_key(getattr(leaf, "dtype", None))
             and (k := resolve(keys, key)[0]) in impls and leaf.dtype != _key_dtype(impls[k])]
    if wrong:
        raise gs.MismatchError(gs.errors.format_problems(
            f"{path}: typed PRNG keys of another implementation (their draws would differ)", wrong))
    missing: list[str] = []
    narrowed: list[tuple[str, np.dtype[Any], dict[Any, Any]]] = []  # integer leaves read at the wider stored dtype
    for (key, leaf), (shape, dtype, sharding) in zip(named, specs):
        ckpt_key, axes = resolve(keys, key)
        if ckpt_key not in checkpoint.metadata.tensors:
            missing.append(ckpt_key)
            plans.append(None)
            continue
        read = _read_dtype(dtype, checkpoint.metadata.tensors[ckpt_key].dtype)
        boxes: dict[tuple[tuple[int, int], ...], tuple[np.ndarray, list[Any]]] = {}
        lead, whole = shape, shape[:0]  # the axes the sharding cuts, and those every box holds whole
        if is_key(getattr(leaf, "dtype", None)):  # key data: the keys' boxes, each with the key shape whole
            lead, whole = tuple(leaf.shape), tuple(shape[len(leaf.shape):])
        if sharding is None:
            index_map = {None: tuple(slice(0, s) for s in lead)}
        else:
            index_map = sharding.addressable_devices_indices_map(lead)
        for device, index in index_map.items():
            index = (*index, *(slice(0, n) for n in whole))
            span = tuple((s.start or 0, s.stop if s.stop is not None else n_) for s, n_ in zip(index, shape))
            if span not in boxes:
                host = np.empty(tuple(b - a for a, b in span), read)
                t = gs.ShardedTensor.from_offset(ckpt_key, host, global_shape=shape,
                                                 global_offset=tuple(a for a, _ in span))
                targets[f"{key}#{len(boxes)}"] = t.transposed(axes) if axes else t
                boxes[span] = (host, [])
            boxes[span][1].append(device)
        plans.append((sharding, shape, dtype, boxes))
        if read != dtype:
            narrowed.append((key, dtype, boxes))
    if strict and missing:
        raise gs.MissingKeyError(gs.errors.format_problems(
            f"{path}: the pytree asks for keys the checkpoint does not hold (strict=False leaves them as given)",
            [f"{k!r}: {gs.planner.missing_key(k, checkpoint.metadata)}" for k in missing]))
    masks = comm.all_gather(gs.planner.asked_mask(checkpoint.metadata, {t.key for t in targets.values()}))
    unexpected = [k for k in gs.planner.unread_keys(checkpoint.metadata, masks) if not gs.is_padding_key(k)]
    if strict and unexpected:
        raise gs.MismatchError(gs.errors.format_problems(
            f"{path}: checkpoint keys that no process's pytree asks for (pass strict=False to load a part)",
            [repr(k) for k in unexpected]))
    trainer_state = checkpoint.load(targets, comm=comm, allow_lossy_cast=allow_lossy_cast, stats=stats)
    trainer_state.pop(TREE, None)
    if narrowed:  # the same leaves on every process: each checks its own boxes, all raise if one fails
        local = [why for key, dtype, boxes in narrowed if (why := _narrow(key, boxes, dtype)) is not None]
        problems = list(dict.fromkeys(why for part in comm.all_gather(local) for why in part))
        if problems:
            raise gs.CastError(gs.errors.format_problems(f"{path}: integers that do not fit their leaves", problems))
    out: list[Any] = []
    for (_, leaf), plan in zip(named, plans):
        if plan is None:
            out.append(leaf)
            continue
        sharding, shape, _, boxes = plan
        if isinstance(leaf, _SCALARS):
            (host, _), = boxes.values()
            out.append(type(leaf)(host.item()))
            continue
        key_dtype = leaf.dtype if is_key(leaf.dtype) else None
        out.append(_array(shape if key_dtype is None else tuple(leaf.shape), sharding, boxes, key_dtype))
    return Restored(jax.tree_util.tree_unflatten(treedef, out), trainer_state, missing, unexpected)


def _read_dtype(dtype: np.dtype[Any], stored: str) -> np.dtype[Any]:
    """What an integer leaf is read as: the stored dtype where it is a wider integer (a Python int saved as
    int64, asked for as jax's int32 with 64-bit types off), then narrowed by :func:`_narrow` only if every
    value fits; ``dtype`` itself otherwise (the core checks that cast)."""
    if dtype.kind not in "iu" or not stored.startswith(("int", "uint")) or gs.is_exact_cast(stored, dtype.name):
        return dtype
    return np.dtype(stored)


def _narrow(key: str, boxes: dict[Any, tuple[np.ndarray, list[Any]]], dtype: np.dtype[Any]) -> str | None:
    """Each box's integers converted to ``dtype`` in place, or why not: a value that does not fit."""
    info = np.iinfo(dtype)
    for span, (host, devices) in boxes.items():
        if host.size and (host.min() < info.min or host.max() > info.max):
            bad = host.min() if host.min() < info.min else host.max()
            hint = ("; with jax's 64-bit types on (jax.config.update('jax_enable_x64', True)) it loads whole"
                    if dtype.itemsize == 4 and jax.dtypes.canonicalize_dtype(np.int64) != np.int64 else "")
            return f"{key!r}: stored as {host.dtype}, holds {bad}, which does not fit {dtype}{hint}"
        boxes[span] = (host.astype(dtype), devices)
    return None


def _array(shape: tuple[int, ...], sharding: Any, boxes: dict[Any, tuple[np.ndarray, list[Any]]],
           key_dtype: Any) -> Any:
    """One leaf's ``jax.Array`` of ``shape`` from its loaded host boxes, each put on its devices;
    with ``key_dtype``, the boxes are key data, wrapped into typed PRNG keys on each device."""
    def put(host: np.ndarray, device: Any) -> Any:
        data = jax.numpy.asarray(host) if device is None else jax.device_put(host, device)
        return data if key_dtype is None else jax.random.wrap_key_data(data, dtype=key_dtype)

    if sharding is None:
        (host, _), = boxes.values()
        return put(host, None)
    arrays = [put(host, d) for host, devices in boxes.values() for d in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


_SCALAR_KINDS = {"int": 0, "float": 0.0, "bool": False, "complex": 0j}


def _leaves(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The leaf descriptions of a pytree skeleton (:func:`~globalshard_jax.tree.skeleton`), in order."""
    if node is None:
        return []
    (kind, value), = node.items()
    if kind == "leaf":
        return [value]
    children = value.values() if kind in ("dict", "node") else value if kind in ("list", "tuple") else []
    return [leaf for child in children for leaf in _leaves(child)]


def _key_impls(skeleton: dict[str, Any] | None) -> dict[str, str]:
    """Stored key -> implementation name of the typed PRNG keys a save described."""
    return {leaf.get("stored", leaf["key"]): leaf["impl"] for leaf in _leaves(skeleton) if leaf["kind"] == "prng_key"}


@functools.cache
def _key_dtype(impl: str) -> Any:
    """The dtype of typed keys of an implementation (an ``eval_shape``, 0.2 ms: once per name)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def _impl_name(dtype: Any) -> str:
    """The name ``jax.random.key(..., impl=)`` takes for a key dtype (its own string where none matches)."""
    return next((name for name in ("threefry2x32", "rbg", "unsafe_rbg") if _key_dtype(name) == dtype), str(dtype))


def _saved_sharding(leaf: dict[str, Any], fallback: Any) -> Any:
    """The sharding a leaf was saved with, as Orbax restores it without a target: a ``NamedSharding``
    over the devices of the ids it recorded, or (a file written before they were) this job's devices
    in ``jax.devices()`` order when there are as many; a ``SingleDeviceSharding`` on the device of
    its id. Where this job does not have them, ``fallback`` (Orbax's ``fallback_sharding``), else a
    MismatchError naming the leaf. None (the default device) for a leaf saved with neither."""
    by_id = {d.id: d for d in jax.devices()}
    device = leaf.get("device")
    if device is not None:
        if device in by_id:
            return jax.sharding.SingleDeviceSharding(by_id[device])
        if fallback is not None:
            return fallback
        raise gs.MismatchError(f"{leaf['key']!r}: saved on device {device}, which this job does not have "
                               f"({jax.device_count()} devices, ids {sorted(by_id)[:16]}); pass a target, or "
                               "fallback_sharding= for such leaves (as Orbax's)")
    mesh = leaf.get("mesh")
    if mesh is None:
        return None
    ids = mesh.get("devices")
    if ids is not None and all(i in by_id for i in ids):
        devices = np.array([by_id[i] for i in ids]).reshape(mesh["shape"])
    elif ids is None and int(np.prod(mesh["shape"])) == jax.device_count():
        devices = np.array(jax.devices()).reshape(mesh["shape"])
    elif fallback is not None:
        return fallback
    else:
        saved = f"devices {ids}" if ids is not None else f"{int(np.prod(mesh['shape']))} devices"
        raise gs.MismatchError(f"{leaf['key']!r}: saved over a mesh of {saved}, which this job does not have "
                            f"({jax.device_count()} devices, ids {sorted(by_id)[:16]}); pass a target, or "
                            "fallback_sharding= for such leaves (as Orbax's)")
    spec = jax.sharding.PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in leaf["spec"]))
    return jax.sharding.NamedSharding(jax.sharding.Mesh(devices, tuple(mesh["axes"])), spec)


def _whole(path: Any, *, comm: Comm, allow_lossy_cast: bool, kvstore: Any, stats: gs.IOStats | None,
           fallback: Any) -> Restored:
    """:func:`load` without a target: the saved pytree rebuilt from its skeleton (``gj.save``'s), or
    nested dicts of the stored arrays split at the dots."""
    # TODO(limitation): shardings other than NamedSharding and SingleDeviceSharding come back on the
    # default device.
    checkpoint = gs.Checkpoint.open(path, comm=comm, kvstore=kvstore)
    described = checkpoint.trainer_state.get(TREE, {}).get("pytree")
    if described is None:
        return Restored(_split(checkpoint), checkpoint.trainer_state, [], [])
    leaves = _leaves(described)
    abstract: dict[str, Any] = {}
    mapping: dict[str, Any] = {}
    for leaf in leaves:
        if leaf["kind"] == "numpy":
            continue
        if "stored" in leaf:
            mapping[leaf["key"]] = (leaf["stored"], tuple(leaf["axes"])) if "axes" in leaf else leaf["stored"]
        if leaf["kind"] in _SCALAR_KINDS:
            abstract[leaf["key"]] = _SCALAR_KINDS[leaf["kind"]]
        elif leaf["kind"] == "prng_key":
            abstract[leaf["key"]] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), _key_dtype(leaf["impl"]),
                                                         sharding=_saved_sharding(leaf, fallback))
        else:
            abstract[leaf["key"]] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"]),
                                                         sharding=_saved_sharding(leaf, fallback))
    got, trainer_state = _load(path, abstract, checkpoint, comm=comm, keys=mapping or None,
                               allow_lossy_cast=allow_lossy_cast, kvstore=kvstore, stats=stats, strict=False)
    values = dict(got)  # keyed by each leaf's key: a dict key holding dots is that key whole
    for leaf in leaves:
        if leaf["kind"] == "numpy":
            stored = checkpoint.read_array(leaf.get("stored", leaf["key"]))
            values[leaf["key"]] = np.transpose(stored, np.argsort(leaf["axes"])) if "axes" in leaf else stored

    return Restored(_build(described, values), trainer_state, [], [])


def _build(node: dict[str, Any], values: dict[str, Any]) -> Any:
    """A skeleton's pytree with each leaf's value by its key, in Orbax's conventions for a restore
    without a target."""
    (kind, value), = node.items()
    if kind == "leaf":
        return values[value["key"]]
    if kind == "dict" or (kind == "node" and value):
        return {k: _build(v, values) for k, v in value.items()}
    if kind == "list" or (kind == "tuple" and value):
        return [_build(v, values) for v in value]
    return () if kind == "tuple" else None  # an empty tuple; None, or a node of nothing (optax's EmptyState)


def metadata(path: Any, *, kvstore: Any = None) -> Any:
    """The saved pytree with a ``jax.ShapeDtypeStruct`` for each leaf, from
    metadata.json and the trainer state alone (no array is read), as Orbax's
    item metadata gives it: in the containers :func:`load` without a target
    gives, each leaf's global shape and dtype (typed PRNG keys as keys of
    their implementation; Python numbers as 0-d structs of their stored
    dtype), and the sharding it was saved with where this job has its
    devices (else None). A target for another layout is one ``tree.map``
    away: ``jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
    sharding=s), gj.metadata(path))``. Reads in this process only."""
    checkpoint = gs.Checkpoint(path, kvstore=kvstore)
    tensors = checkpoint.metadata.tensors

    def stored(key: str) -> gs.TensorMetadata:
        if key not in tensors:
            raise gs.MetadataError(f"{path}: the pytree's leaf {key!r} is not in the checkpoint")
        return tensors[key]

    described = checkpoint.trainer_state.get(TREE, {}).get("pytree")
    if described is None:
        return _split(checkpoint, lambda key: jax.ShapeDtypeStruct(tensors[key].global_shape,
                                                                   np.dtype(tensors[key].dtype)))
    values: dict[str, Any] = {}
    for leaf in _leaves(described):
        try:
            sharding = _saved_sharding(leaf, None) if leaf["kind"] in ("jax", "prng_key") else None
        except gs.MismatchError:
            sharding = None  # saved over devices this job does not have
        if leaf["kind"] == "prng_key":
            values[leaf["key"]] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), _key_dtype(leaf["impl"]),
                                                       sharding=sharding)
            continue
        t = stored(leaf.get("stored", leaf["key"]))
        shape = tuple(leaf["shape"]) if "shape" in leaf else (
            tuple(t.global_shape[i] for i in np.argsort(leaf["axes"])) if "axes" in leaf else t.global_shape)
        dtype = np.dtype(leaf["dtype"]) if "dtype" in leaf else np.dtype(t.dtype)
        values[leaf["key"]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return _build(described, values)


def _split(checkpoint: gs.Checkpoint, leaf: Any = None) -> dict[str, Any]:
    """Every stored array whole (or ``leaf(key)`` of it), in nested dicts by the dots of its key."""
    tree: dict[str, Any] = {}
    for key in sorted(checkpoint.metadata.tensors):
        if gs.is_padding_key(key):
            continue
        node, parts = tree, key.split(".")
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise LayoutError(f"{key!r} nests under {'.'.join(parts[:i + 1])!r}, which is an array itself; "
                                  "pass a target pytree to load it")
        if parts[-1] in node:
            raise LayoutError(f"{key!r} is an array and also the prefix of other keys; pass a target pytree to "
                              "load it")
        node[parts[-1]] = checkpoint.read_array(key) if leaf is None else leaf(key)
    return tree
