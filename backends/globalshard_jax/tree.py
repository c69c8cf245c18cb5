"""Pytrees as checkpoint keys: the paths joined with dots, mapped by ``keys=``; typed PRNG keys."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from globalshard.errors import LayoutError

__all__ = ["KeyMap", "TREE", "is_key", "pytree_keys", "resolve", "skeleton"]

#: The trainer-state member where :func:`skeleton` is stored, and whose ``"pytree"`` a load without a target
#: rebuilds the pytree from; ``gj.load`` returns the trainer state without it.
TREE = "globalshard_jax"

KeyMap = Mapping[str, Any] | Callable[[str], Any] | None


def _path_part(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def pytree_keys(tree: Any) -> list[tuple[str, Any]]:
    """``(key, leaf)`` for every leaf: the path's parts joined with dots."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = [(".".join(_path_part(k) for k in path), leaf) for path, leaf in flat]
    seen: dict[str, int] = {}
    for key, _ in out:
        if not key:
            raise LayoutError("a pytree leaf at the root has no key; wrap it in a dict")
        seen[key] = seen.get(key, 0) + 1
    dupes = [k for k, n in seen.items() if n > 1]
    if dupes:
        raise LayoutError(f"pytree paths that join to the same key: {dupes[:5]}")
    return out


def resolve(keys: KeyMap, key: str) -> tuple[str, tuple[int, ...] | None]:
    if keys is None:
        return key, None
    found = keys(key) if callable(keys) else keys.get(key, key)
    if isinstance(found, tuple):
        return str(found[0]), tuple(found[1])
    return str(found), None


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``jax.random.key``), which numpy cannot hold."""
    return dtype is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def _leaf(key: str, leaf: Any, keys: KeyMap) -> dict[str, Any]:
    """How one leaf comes back without a target: its kind, shape and dtype, and the checkpoint key it is under."""
    ckpt_key, axes = resolve(keys, key)
    out: dict[str, Any] = {"key": key}
    if ckpt_key != key or axes:
        out["stored"] = ckpt_key
        if axes:
            out["axes"] = list(axes)
    if isinstance(leaf, (bool, int, float, complex)):
        return {**out, "kind": type(leaf).__name__}
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        return {**out, "kind": "numpy"}  # np.asarray of it: what the save stores, or refuses by name
    shape = [int(n) for n in leaf.shape]
    if is_key(leaf.dtype):
        out = {**out, "kind": "prng_key", "impl": str(jax.random.key_impl(leaf)), "shape": shape}
    elif isinstance(leaf, jax.Array):
        out = {**out, "kind": "jax", "shape": shape, "dtype": str(leaf.dtype)}
    else:
        return {**out, "kind": "numpy", "shape": shape, "dtype": str(leaf.dtype)}
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        out["mesh"] = {"shape": [int(n) for n in mesh.devices.shape], "axes": [str(a) for a in mesh.axis_names],
                       "devices": [int(d.id) for d in mesh.devices.flat]}
        out["spec"] = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        out["device"] = int(device.id)  # type: ignore[attr-defined]
    return out


def skeleton(tree: Any, keys: KeyMap = None, path: tuple[Any, ...] = ()) -> dict[str, Any]:
    """``tree``'s containers as JSON, so a load without a target can rebuild it: dicts
    (string keys), lists, tuples and ``None`` as themselves, any other node (a
    dataclass, a NamedTuple, an optax state) as ``"node"``, its children by their path
    names, and each leaf as :func:`_leaf` describes it."""
    if tree is None:
        return {"none": None}
    if type(tree) in (list, tuple):
        return {type(tree).__name__: [skeleton(v, keys, (*path, i)) for i, v in enumerate(tree)]}
    if type(tree) is dict:
        return {"dict": {str(k): skeleton(v, keys, (*path, k)) for k, v in tree.items()}}
    children, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    if len(children) == 1 and children[0][0] == () and children[0][1] is tree:  # a leaf
        return {"leaf": _leaf(".".join(_path_part(k) for k in path), tree, keys)}
    return {"node": {_path_part(p[0]): skeleton(v, keys, (*path, *p)) for p, v in children}}
