"""Stored arrays through TensorStore: any kvstore, any zarr v3 array.

Reads run with ``fill_missing_data_reads: false`` and writes with
``store_data_equal_to_fill_value: true``: a chunk that is absent is an
error, never a block of zeros.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from globalshard.dtypes import numpy_dtype
from globalshard.errors import MetadataError, StorageError, format_problems
from globalshard.format.zarr import Expect, attribute_problem, is_checksummed, le_bytes, zarr_json
from globalshard.geometry import Box
from globalshard.io.base import (
    VERIFY_WINDOW_BYTES,
    WRITE_WINDOW_BYTES,
    ArrayItem,
    IOStats,
    OpenedPlan,
    PackItem,
    item_bytes,
    wait_ready,
)
from globalshard.io.read import at, read_chunk, read_plan
from globalshard.planner import LoadPlan
from globalshard.store.base import Store, context, error_text, ts

if TYPE_CHECKING:
    from globalshard.io.localio import ArrayFile

__all__ = ["TensorStoreEngine"]


class TensorStoreEngine:
    """Arrays under any :class:`~globalshard.store.base.Store`'s root, read and
    written by TensorStore (its kvstore spec from :meth:`Store.kvstore`)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def write(self, items: Sequence[ArrayItem | PackItem], stats: IOStats | None = None, *,
              unbuffered: bool = False) -> None:
        """Store each :class:`ArrayItem` (and :class:`PackItem`) as a zarr v3
        array, all in parallel; packs are built at most
        :data:`~globalshard.io.base.PACK_WINDOW_BYTES` at a time.

        Raises:
            StorageError: listing every array that could not be written.
        """
        start = time.perf_counter()
        self._write(items, unbuffered)
        if stats is not None:
            stats.arrays += len(items)
            stats.bytes_written += sum(item_bytes(item) for item in items)
            stats.seconds += time.perf_counter() - start

    def read(self, opened: OpenedPlan, targets: Sequence[np.ndarray], stats: IOStats | None = None) -> None:
        """Execute an opened load plan: fill ``targets[i]`` for each target
        (see :func:`~globalshard.io.read.read_plan`)."""
        read_plan(self.store, opened, targets, stats)

    def _open_local(self, path: str, dtype: str, shape: tuple[int, ...] | None,
                    want: Expect) -> ArrayFile | None:
        """An array this engine reads without TensorStore, or None (all of them here)."""
        return None

    def _prefetch(self, paths: Sequence[str]) -> None:
        """Start fetching the zarr.json of each array :meth:`open` is about to
        open, once their paths are known to stay inside the root (none here:
        TensorStore opens them concurrently)."""

    def _write(self, items: Sequence[ArrayItem | PackItem], unbuffered: bool = False) -> None:
        opened: list[tuple[str, Any, Any, Any]] = []
        problems: list[str] = []
        for item in items:
            if isinstance(item, PackItem):
                spec = _create_spec(self.store.kvstore(item.path), "uint8", (item.nbytes,), item.attributes)
                source: Any = item
            else:
                spec = _create_spec(self.store.kvstore(item.path), item.dtype, tuple(item.data.shape),
                                    item.attributes, item.cut)
                source = item.data
            try:
                opened.append((item.path, source, item.ready if not isinstance(item, PackItem) else None,
                               ts.open(spec, create=True, delete_existing=True, context=context())))
            except Exception as e:
                problems.append(f"{self.store.describe(item.path)}: {error_text(e)}")
        pending: list[tuple[str, Any, int]] = []
        in_flight = 0

        def settle(path: str, future: Any) -> None:
            try:
                future.result()
            except Exception as e:
                problems.append(f"{self.store.describe(path)}: {error_text(e)}")

        for path, array, ready, future in opened:
            if isinstance(array, PackItem):  # built now: the window below bounds what is held
                array, why = _pack_data(array)
            else:
                why = wait_ready(ready)
            if why is not None or array is None:
                problems.append(f"{self.store.describe(path)}: {why}")
                continue
            try:
                store = future.result()
                if not array.dtype.isnative:
                    array = array.astype(array.dtype.newbyteorder("="))
                pending.append((path, store.write(array), array.nbytes))
                in_flight += array.nbytes
            except Exception as e:
                problems.append(f"{self.store.describe(path)}: {error_text(e)}")
            while in_flight > WRITE_WINDOW_BYTES and pending:
                done_path, done, nbytes = pending.pop(0)
                settle(done_path, done)
                in_flight -= nbytes
        for path, future, _ in pending:
            settle(path, future)
        if problems:
            raise StorageError(format_problems("cannot write the checkpoint's arrays", problems))

    def open(self, plan: LoadPlan, expect: Mapping[str, Expect]) -> OpenedPlan:
        """Open every stored array and pack a load plan reads, and check it, reading no data.

        Each array must stay inside the root, open with the shape and dtype of
        metadata.json, carry a crc32c on every chunk, and say in its zarr.json
        attributes that it holds the key, offset and save ``expect[path]``
        names (None: a version 1 checkpoint, which records none). Each pack
        must be a 1-d uint8 array that names the save and lists every packed
        region read from it (a :class:`PackExpect`), each inside it.

        Raises:
            MetadataError: a path escapes the checkpoint.
            StorageError: every array that is missing, damaged or not the one
            metadata.json names, each named by its file.
        """
        problems = self.store.escaping(sorted([*plan.arrays, *plan.packs]))
        if problems:
            raise MetadataError(format_problems("checkpoint paths escape the checkpoint", problems))
        futures = {}
        files: dict[str, ArrayFile] = {}
        wanted: list[tuple[str, str, tuple[int, ...] | None]] = [
            *((path, dtype, tuple(shape)) for path, (dtype, shape) in plan.arrays.items()),
            *((path, "uint8", None) for path in plan.packs)]
        self._prefetch([path for path, _, _ in wanted])
        for path, dtype, shape in wanted:
            # zarr.json files are read one after the other: for 2,000 small arrays that
            # took half the time of a pool of threads warm (they contend for the GIL)
            # and the same cold (bench/small_tensors.py).
            try:
                found = self._open_local(path, dtype, shape, expect.get(path))
            except StorageError as e:
                problems.append(str(e))
                continue
            if found is not None:
                files[path] = found
                continue
            try:
                futures[path] = self._open_array(path, dtype, shape)
            except Exception as e:
                problems.append(f"{self.store.describe(path)}: {error_text(e)}")
        stores: dict[str, Any] = {}
        for path, future in futures.items():
            try:
                store = future.result()
            except Exception as e:
                problems.append(f"{self.store.describe(path)}: {error_text(e)}")
                continue
            why = self._not_the_array(path, store, expect.get(path))
            if why is not None:
                problems.append(why)
            else:
                stores[path] = store
        if problems:
            raise StorageError(format_problems("cannot open the checkpoint's arrays", problems))
        return OpenedPlan(plan, stores, files)

    def _open_array(self, path: str, dtype: str, shape: tuple[int, ...] | None) -> Any:
        """Open a stored array (``shape`` None: a pack, of one axis) for reading: a future."""
        spec = {"driver": "zarr3", "kvstore": self.store.kvstore(path), "fill_missing_data_reads": False}
        if shape is None:
            return ts.open(spec, open=True, read=True, dtype=ts.dtype(dtype), rank=1, context=context())
        return ts.open(spec, open=True, read=True, dtype=ts.dtype(dtype), shape=shape, context=context())

    def _not_the_array(self, path: str, store: Any, want: Expect) -> str | None:
        """Why an opened array may not be read as the one metadata.json names, or None."""
        codecs = store.codec.to_json().get("codecs")
        if not is_checksummed(codecs):
            names = [c.get("name") for c in codecs or [] if isinstance(c, dict)]
            return (f"{self.store.describe(path)}: its chunks carry no crc32c checksum (codecs {names}); "
                    "unverifiable data is not read")
        if want is not None:
            attributes = (store.spec().to_json().get("metadata") or {}).get("attributes") or {}
            return attribute_problem(self.store.describe(path), attributes, tuple(store.shape), want)
        return None

    def verify(self, path: str, dtype: str, shape: tuple[int, ...] | None, want: Expect) -> int:
        """Read every chunk of one stored array, verifying its checksums, one
        window of chunks at a time (memory stays bounded whatever the array's
        size). Returns the bytes read. A pack: ``shape`` None, ``want`` the
        :class:`PackExpect` of every region metadata.json places in it.

        Raises:
            MetadataError: the path escapes the checkpoint.
            StorageError: the array is missing, damaged or not the one named.
        """
        problems = self.store.escaping([path])
        if problems:
            raise MetadataError(format_problems("checkpoint paths escape the checkpoint", problems))
        return self._verify_contained(path, dtype, shape, want)

    def _verify_contained(self, path: str, dtype: str, shape: tuple[int, ...] | None, want: Expect) -> int:
        """:meth:`verify` of an array whose path :meth:`Store.escaping` accepted."""
        try:
            store = self._open_array(path, dtype, shape).result()
        except Exception as e:
            raise StorageError(f"{self.store.describe(path)}: {error_text(e)}") from None
        why = self._not_the_array(path, store, want)
        if why is not None:
            raise StorageError(why)
        shape = tuple(store.shape)
        chunk = read_chunk(store)
        itemsize = numpy_dtype(dtype).itemsize
        window: list[Any] = []
        window_bytes = total = 0
        try:
            for index in np.ndindex(*[-(-s // c) for s, c in zip(shape, chunk)]):
                box = Box._trusted(tuple(i * c for i, c in zip(index, chunk)),
                                   tuple(min(c, s - i * c) for i, c, s in zip(index, chunk, shape)))
                window.append(at(store, box).read())
                window_bytes += box.volume * itemsize
                if window_bytes >= VERIFY_WINDOW_BYTES:
                    total += sum(f.result().nbytes for f in window)
                    window, window_bytes = [], 0
            total += sum(f.result().nbytes for f in window)
        except Exception as e:
            raise StorageError(f"{self.store.describe(path)}: {error_text(e)}") from None
        return total


def _create_spec(kvstore: dict[str, Any], dtype: str, shape: tuple[int, ...],
                 attributes: dict[str, Any] | None = None, cut: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": kvstore, "store_data_equal_to_fill_value": True,
            "metadata": zarr_json(dtype, shape, attributes or {}, cut=cut)}


def _pack_data(item: PackItem) -> tuple[np.ndarray | None, str | None]:
    """A pack's bytes, assembled once its members are ready (TensorStore
    writes from one array); or why it cannot be."""
    data = np.zeros(item.nbytes, np.uint8)
    for byte_offset, array, ready in item.members:
        why = wait_ready(ready)
        if why is not None:
            return None, why
        flat = le_bytes(array)
        data[byte_offset:byte_offset + flat.nbytes] = flat
    return data, None
