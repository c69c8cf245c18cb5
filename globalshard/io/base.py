"""What crosses the boundary of an array engine: the items a save writes,
an opened load plan, the figures of a save or load, and the engine protocol."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from globalshard.format.zarr import Expect
from globalshard.planner import LoadPlan

if TYPE_CHECKING:
    from globalshard.io.localio import ArrayFile

__all__ = ["READ_WINDOW_BYTES", "WRITE_WINDOW_BYTES", "ArrayEngine", "ArrayItem", "IOStats", "OpenedPlan",
           "PackItem", "item_bytes", "wait_ready"]

#: Bytes of writes in flight at once. TensorStore copies what it is given to
#: write, so this bounds the extra memory a save needs.
WRITE_WINDOW_BYTES = 64 << 20

#: Bytes of packs (spec section 5.1) in host memory and not yet written:
#: whole packs assembled for TensorStore; locally, only copies of members
#: that were not contiguous little-endian bytes (the rest is written from
#: the members themselves).
PACK_WINDOW_BYTES = 32 << 20

#: Bytes of reads in flight at once: TensorStore decodes each chunk into a
#: buffer of its own before copying it into the target, so this bounds the
#: memory a load needs beyond its targets.
READ_WINDOW_BYTES = 32 << 20

#: Bytes one verification reads before it waits for them (its memory bound).
VERIFY_WINDOW_BYTES = 64 << 20


@dataclass(slots=True)
class IOStats:
    """Figures of one save or load, filled in when passed as ``stats=``.

    ``bytes_needed``: stored bytes the targets need (load) or this rank wrote
    (save). ``bytes_read``: bytes of the distinct whole chunks a load touched,
    each counted once however many targets share it, which is what storage
    reads; the ratio of the two is the read amplification. With shared reads,
    ``bytes_received`` and ``bytes_sent`` count the pieces other ranks read
    for this one and this one read for others.
    """

    arrays: int = 0
    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


class ArrayItem(NamedTuple):
    """One stored array to write: ``data`` under ``path``, with ``attributes``
    (from :func:`~globalshard.format.zarr.array_attributes`) in its zarr.json;
    ``cut``: the axes along which the region is a part of its tensor (see
    :func:`~globalshard.format.zarr.chunk_shape`); ``ready``: see below."""

    path: str
    dtype: str
    data: np.ndarray
    attributes: dict[str, Any]
    cut: tuple[int, ...] = ()
    #: Blocks until ``data`` holds its values (a device-to-host copy still in
    #: flight); called before its bytes are written. None: ready now.
    ready: Callable[[], None] | None = None


class PackItem(NamedTuple):
    """One pack to write (spec section 5.1): ``nbytes`` bytes at ``path``,
    holding ``members``, each ``(byte_offset, data, ready)`` (``ready`` as in
    :class:`ArrayItem`), with ``attributes`` from
    :func:`~globalshard.format.zarr.pack_attributes`. The pack is built in
    host memory once its members are ready."""

    path: str
    nbytes: int
    members: tuple[tuple[int, np.ndarray, Callable[[], None] | None], ...]
    attributes: dict[str, Any]


def item_bytes(item: ArrayItem | PackItem) -> int:
    """The stored bytes of an item."""
    return item.nbytes if isinstance(item, PackItem) else item.data.nbytes


@dataclass(frozen=True, slots=True)
class OpenedPlan:
    """A load plan whose arrays are all open and checked: nothing read yet."""

    plan: LoadPlan
    #: Arrays read through TensorStore: path -> an open ``tensorstore.TensorStore``.
    stores: dict[str, Any]
    #: Local arrays read by :mod:`~globalshard.io.localio` instead.
    files: dict[str, ArrayFile] = dataclasses.field(default_factory=dict)
    #: Arrays of other roots (a base's, spec section 5.2): path -> its full name.
    where: dict[str, str] = dataclasses.field(default_factory=dict)

    def describe(self, store: Any, path: str) -> str:
        """``path`` as a message names it: in ``store``, unless it lies in another root."""
        return self.where.get(path) or store.describe(path)


def wait_ready(ready: Callable[[], None] | None) -> str | None:
    """Wait until an array's data holds its values; why it never will, or None."""
    if ready is None:
        return None
    try:
        ready()
    except Exception as e:  # a failed device copy: this array is not written
        return f"its data never became ready ({type(e).__name__}: {e})"
    return None


class ArrayEngine(Protocol):
    """Reads and writes stored arrays (spec section 5) under one store's root.

    It works per array and per plan, never per chunk: the tuned loops stay
    inside the engines. Errors are :class:`~globalshard.errors.StorageError`
    listing every array affected, each named by its file.
    """

    def write(self, items: Sequence[ArrayItem | PackItem], stats: IOStats | None = None, *,
              unbuffered: bool = False) -> None:
        """Store each item as a zarr v3 array, all in parallel. ``unbuffered``:
        local shards go around the page cache (an asynchronous save's
        background part; :mod:`~globalshard.io.localio.unbuffered`), where the
        engine can; others ignore it."""
        ...

    def open(self, plan: LoadPlan, expect: Mapping[str, Expect]) -> OpenedPlan:
        """Open and check every array a load plan reads; read no data."""
        ...

    def read(self, opened: OpenedPlan, targets: Sequence[np.ndarray], stats: IOStats | None = None) -> None:
        """Execute an opened plan: fill ``targets[i]`` for each target."""
        ...

    def verify(self, path: str, dtype: str, shape: tuple[int, ...] | None, expect: Expect) -> int:
        """Read every chunk of one array, checking its checksums; the bytes read."""
        ...
