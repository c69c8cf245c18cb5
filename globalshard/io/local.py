"""Arrays in a local directory, read and written by :mod:`~globalshard.io.localio`
(``preadv``/``pwritev``, hardware crc32c); any array localio does not fully
understand falls back to TensorStore, array by array."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from globalshard.errors import StorageError, format_problems
from globalshard.format.zarr import Expect, attribute_problem, le_bytes, zarr_json
from globalshard.io import localio
from globalshard.io.base import PACK_WINDOW_BYTES, ArrayItem, PackItem, wait_ready
from globalshard.io.tensorstore import TensorStoreEngine
from globalshard.store.containment import inside
from globalshard.store.files import sync_dir
from globalshard.store.local import LocalStore

__all__ = ["SYNCFS_MIN_ARRAYS", "LocalEngine"]

#: From this many arrays in one save, local writes are made durable by one
#: ``syncfs`` of the filesystem rather than an fsync per file and directory.
SYNCFS_MIN_ARRAYS = 64


class LocalEngine(TensorStoreEngine):
    """Arrays under a :class:`~globalshard.store.local.LocalStore`: written by
    :mod:`~globalshard.io.localio`; read by it where it serves the array's
    zarr.json, by TensorStore otherwise."""

    store: LocalStore

    def _verify_contained(self, path: str, dtype: str, shape: tuple[int, ...] | None, want: Expect) -> int:
        """Through localio where it serves the array, else through TensorStore."""
        layout = self._open_local(path, dtype, shape, want)
        if layout is None:
            return super()._verify_contained(path, dtype, shape, want)
        nbytes, damaged = localio.Reader(localio.pool()).verify(layout)
        if damaged:
            raise StorageError(format_problems(f"{self.store.describe(path)} is damaged", [str(e) for e in damaged]))
        return nbytes

    def _prefetch(self, paths: Sequence[str]) -> None:
        """The zarr.json files :meth:`_open_local` then reads one after the other:
        on a cold page cache each was a disk round trip before the first chunk
        was read (bench/cold_load.py)."""
        self.store.prefetch([f"{path}/zarr.json" for path in paths])

    def _write(self, items: Sequence[ArrayItem | PackItem], unbuffered: bool = False) -> None:
        root = self.store.path
        try:
            os.makedirs(root, exist_ok=True)  # a root no lock file created yet (a tier copy's)
        except OSError as e:
            raise StorageError(f"cannot create {root}: {e.strerror or e}") from None
        pool = localio.pool()
        problems: list[str] = []
        futures: list[tuple[str, Any]] = []
        directories: set[str] = set()
        made: set[str] = set()
        packs: collections.deque[tuple[int, list[Any]]] = collections.deque()  # packs' copies being written
        pack_bytes = 0
        # Many arrays: one syncfs at the end instead of an fsync per file and directory.
        batch = len(items) >= SYNCFS_MIN_ARRAYS and localio.has_syncfs()
        for item in items:
            # TODO(limitation): unless packed (save(pack_below=)), every array is two files
            # (zarr.json, its chunk or shard) and its own directories: thousands of small
            # arrays cost more than the same bytes in a few (bench/small_tensors.py).
            path = item.path
            if isinstance(item, PackItem):
                while packs and pack_bytes + item.nbytes > PACK_WINDOW_BYTES:  # bound the copies in memory
                    nbytes, done = packs.popleft()
                    concurrent.futures.wait(done)
                    pack_bytes -= nbytes
                first = len(futures)
                copied = self._write_pack(item, pool, futures, problems, made, directories, fsync=not batch)
                if copied:
                    packs.append((copied, [f for _, f in futures[first:]]))
                    pack_bytes += copied
                continue
            dtype, array, attributes, cut = item.dtype, item.data, item.attributes, item.cut
            why = wait_ready(item.ready)  # earlier arrays are being written meanwhile
            if why is not None:
                problems.append(f"{self.store.describe(path)}: {why}")
                continue
            directory = os.path.join(root, path)
            if not array.dtype.isnative:
                array = array.astype(array.dtype.newbyteorder("="))
            shape = tuple(array.shape)
            doc = zarr_json(dtype, shape, attributes, cut=cut)
            try:
                leaf = os.path.join(directory, "c", *["0"] * (array.ndim - 1)) if array.ndim else directory
                _make_dirs(root, leaf, made)
                for f in localio.write_array(directory, array, doc, pool, fsync=not batch, mkdirs=False,
                                               unbuffered=unbuffered):
                    futures.append((path, f))
            except OSError as e:
                problems.append(f"{self.store.describe(path)}: {e.strerror or e}")
                continue
            child = os.path.join(directory, "c", *["0"] * (array.ndim - 1)) if array.ndim else directory
            while inside(child, root) and child not in directories:
                directories.add(child)
                child = os.path.dirname(child)
        for path, f in futures:
            try:
                f.result()
            except OSError as e:
                problems.append(f"{self.store.describe(path)}: {e.strerror or e}")
        if not problems and batch:
            try:
                localio.syncfs(root)
            except OSError as e:
                problems.append(f"{root}: {e.strerror or e}")
        elif not problems:
            # New directory entries are durable only once their directory is synced.
            for f in [pool.submit(sync_dir, d) for d in sorted(directories)]:
                try:
                    f.result()
                except OSError as e:
                    problems.append(f"{e.filename}: {e.strerror or e}")
        if problems:
            raise StorageError(format_problems("cannot write the checkpoint's arrays", problems))

    def _write_pack(self, item: PackItem, pool: Any, futures: list[tuple[str, Any]], problems: list[str],
                    made: set[str], directories: set[str], *, fsync: bool) -> int:
        """Start writing one pack from its members' own bytes (:func:`localio.write_pack`),
        once each is ready; returns the bytes copied on the way (members that
        were not contiguous little-endian bytes)."""
        root = self.store.path
        members, copied = [], 0
        for byte_offset, array, ready in item.members:
            why = wait_ready(ready)
            if why is not None:
                problems.append(f"{self.store.describe(item.path)}: {why}")
                return copied
            flat = le_bytes(array)
            copied += 0 if np.may_share_memory(flat, array) else flat.nbytes
            members.append((byte_offset, flat))
        directory = os.path.join(root, item.path)
        leaf = os.path.join(directory, "c")
        doc = zarr_json("uint8", (item.nbytes,), item.attributes)
        try:
            _make_dirs(root, leaf, made)
            futures += [(item.path, f) for f in localio.write_pack(directory, members, doc, pool, fsync=fsync)]
        except OSError as e:
            problems.append(f"{self.store.describe(item.path)}: {e.strerror or e}")
            return copied
        child = leaf
        while inside(child, root) and child not in directories:
            directories.add(child)
            child = os.path.dirname(child)
        return copied

    def _open_local(self, path: str, dtype: str, shape: tuple[int, ...] | None,
                    want: Expect) -> localio.ArrayFile | None:
        """A local array's layout from its zarr.json, checked like TensorStore's
        open plus its attributes' check (``shape`` None: a pack, of one axis);
        None if :mod:`localio` cannot serve it.

        Raises:
            StorageError: the array is missing or is not the one named.
        """
        name = f"{path}/zarr.json"
        raw = self.store.read_checked(name)
        if raw is None:
            raise StorageError(f"{self.store.describe(path)}: the array is missing (no zarr.json)")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise StorageError(f"{self.store.describe(name)}: not valid JSON ({e})") from None
        layout = localio.parse(os.path.join(self.store.path, path), doc)
        if layout is None:
            return None
        if shape is None and (layout.dtype != dtype or len(layout.shape) != 1):
            raise StorageError(f"{self.store.describe(name)}: the array is {layout.dtype} {list(layout.shape)}, "
                               f"metadata.json names a pack: {dtype} of one axis")
        if shape is not None and (layout.dtype != dtype or layout.shape != shape):
            raise StorageError(f"{self.store.describe(name)}: the array is {layout.dtype} {list(layout.shape)}, "
                               f"metadata.json says {dtype} {list(shape)}")
        why = attribute_problem(self.store.describe(path), layout.attributes, layout.shape, want)
        if why is not None:
            raise StorageError(why)
        return layout


def _make_dirs(root: str, leaf: str, made: set[str]) -> None:
    """Create ``leaf`` and its parents below ``root``, each tried once per process
    whether or not another rank made it first (so each rank's filesystem calls
    are the same on every run)."""
    levels = []
    while leaf != root and inside(leaf, root) and leaf not in made:
        levels.append(leaf)
        leaf = os.path.dirname(leaf)
    for level in reversed(levels):
        try:
            os.mkdir(level)
        except FileExistsError:
            if not os.path.isdir(level):
                raise
        made.add(level)

