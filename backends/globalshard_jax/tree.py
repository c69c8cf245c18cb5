"""Pytrees as checkpoint keys: the paths joined with dots, mapped by ``keys=``; typed PRNG keys."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from globalshard.errors import LayoutError

__all__ = ["KeyMap", "is_key", "pytree_keys", "resolve"]

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
