"""Stored arrays: the only code that calls TensorStore's array API or
``preadv``/``pwritev``. :func:`open_engine` picks the engine of a store."""

from __future__ import annotations

import os

from globalshard.io.base import ArrayEngine, ArrayItem, IOStats, OpenedPlan, PackItem
from globalshard.io.local import LocalEngine
from globalshard.io.tensorstore import TensorStoreEngine
from globalshard.store import LocalStore, Store

__all__ = ["ENGINES", "ArrayEngine", "ArrayItem", "IOStats", "LocalEngine", "OpenedPlan", "PackItem",
           "TensorStoreEngine", "engine_name", "open_engine"]

#: The engines a local root can use; an object store always uses ``tensorstore``.
ENGINES = ("localio", "tensorstore")


def engine_name(io: str | None = None) -> str:
    """The engine for local roots: ``io`` if given, else ``GLOBALSHARD_IO``
    (``localio``, the default, or ``tensorstore``), read when called.
    ``GLOBALSHARD_LOCAL_IO=direct|tensorstore`` (the old name) is honoured.

    Raises:
        ValueError: not an engine name.
    """
    if io is None:
        io = os.environ.get("GLOBALSHARD_IO") or os.environ.get("GLOBALSHARD_LOCAL_IO", "localio")
        io = "localio" if io == "direct" else io
    if io not in ENGINES:
        raise ValueError(f"the array engine must be one of {', '.join(ENGINES)}, not {io!r} "
                         "(io=, or GLOBALSHARD_IO)")
    return io


def open_engine(store: Store, io: str | None = None) -> ArrayEngine:
    """The array engine of ``store``: :class:`LocalEngine` for a local root
    unless ``io`` (see :func:`engine_name`) says ``tensorstore``;
    :class:`TensorStoreEngine` for any other store."""
    if isinstance(store, LocalStore) and engine_name(io) == "localio":
        return LocalEngine(store)
    return TensorStoreEngine(store)
