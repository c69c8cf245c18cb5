"""Where checkpoints live, and the only module that talks to TensorStore.

A checkpoint root is a local directory or any TensorStore kvstore (a spec
dict, or a URL such as ``"memory://"``, ``"gs://bucket/run/"``, or an OCDBT
spec). Each stored region is one zarr v3 array:

* one chunk holding the whole region, with the ``crc32c`` codec, when it
  is small (at most ``CHUNK_BYTES``);
* otherwise one ``sharding_indexed`` shard holding the whole region, split
  into inner chunks of at most ``CHUNK_BYTES``, each and the shard index
  carrying a crc32c, so a load reads only the inner chunks it needs.

Reads run with ``fill_missing_data_reads: false`` and writes with
``store_data_equal_to_fill_value: true``: a chunk that is absent on disk is an
error, never a block of zeros.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from globalshard.dtypes import cast_into, numpy_dtype
from globalshard.errors import MetadataError, StorageError, format_problems
from globalshard.geometry import Box
from globalshard.metadata import check_relative_path
from globalshard.planner import LoadPlan

__all__ = ["CHUNK_BYTES", "WRITE_WINDOW_BYTES", "IOStats", "Location", "chunk_shape"]

#: Upper bound on the bytes of one (inner) chunk: the unit a load reads.
CHUNK_BYTES = 1 << 20

#: Bytes of writes in flight at once. TensorStore copies what it is given to
#: write, so this bounds the extra memory a save needs.
WRITE_WINDOW_BYTES = 1 << 30

# One context for the process: the memory kvstore persists across calls, and
# the chunk cache is off (every byte is read once, straight into its target).
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})


@dataclass(slots=True)
class IOStats:
    """Figures of one save or load, filled in when passed as ``stats=``.

    ``bytes_needed``: stored bytes the targets need (load) or this rank wrote
    (save). ``bytes_read``: bytes of the whole chunks a load touched, which is
    what storage reads; the ratio of the two is the read amplification.
    """

    arrays: int = 0
    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


def chunk_shape(shape: Sequence[int], itemsize: int, limit: int | None = None) -> tuple[int, ...]:
    """The inner chunk shape for a stored region: halve the longest axis
    until a chunk holds at most ``limit`` bytes. Near-cubic chunks keep the
    waste small whichever axis the loading layout cuts.

    >>> chunk_shape((4096, 4096), 4)
    (512, 512)
    >>> chunk_shape((10, 3), 4)
    (10, 3)
    """
    limit = CHUNK_BYTES if limit is None else limit
    # TODO(limitation): a region under the limit is one chunk, so a target that
    # needs part of it reads all of it (bounded by CHUNK_BYTES of waste).
    chunk = list(shape)
    while chunk and int(np.prod(chunk)) * itemsize > limit and max(chunk) > 1:
        axis = chunk.index(max(chunk))
        chunk[axis] = -(-chunk[axis] // 2)
    return tuple(chunk)


_BYTES = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def _create_spec(kvstore: dict[str, Any], dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    inner = chunk_shape(shape, numpy_dtype(dtype).itemsize)
    # TODO(limitation): no compression codec; zarr3 allows zstd/blosc before crc32c.
    if inner == tuple(shape):
        grid, codecs = list(shape), _BYTES
    else:
        grid = [-(-s // c) * c for s, c in zip(shape, inner)]
        codecs = [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(inner), "codecs": _BYTES, "index_codecs": _BYTES, "index_location": "end",
            },
        }]
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "codecs": codecs,
        },
    }


def _error_text(e: BaseException) -> str:
    text = str(e)
    # TensorStore appends the whole spec as [tensorstore_spec='...']: noise here.
    cut = text.find(" [tensorstore_spec=")
    return text[:cut] if cut > 0 else text


class Location:
    """A checkpoint root: a local directory, or a TensorStore kvstore.

    Args:
        where: a filesystem path; a kvstore URL (``"memory://"``,
            ``"gs://bucket/run/"``, ``"file:///abs/dir/"``); or a kvstore spec
            dict (``{"driver": "ocdbt", "base": "file:///abs/dir/"}``).
        kvstore: a kvstore spec or URL to resolve ``where`` in: the root is
            then ``where``, a relative path, inside that kvstore.
    """

    def __init__(self, where: Any, kvstore: Any = None) -> None:
        self.local: str | None = None
        if kvstore is not None:
            base = Location(kvstore)
            relative = os.fspath(where).strip("/") if isinstance(where, (str, os.PathLike)) else None
            if not relative or check_relative_path(relative) is not None:
                raise StorageError(f"with kvstore=, the path must be relative inside it, got {where!r}")
            where = base.array_kvstore(relative)
        if isinstance(where, os.PathLike) or (isinstance(where, str) and "://" not in where):
            self.local = os.path.abspath(os.fspath(where))
            self.kvstore: dict[str, Any] = {"driver": "file", "path": self.local.rstrip("/") + "/"}
        else:
            try:
                spec = ts.KvStore.Spec(where).to_json() if isinstance(where, str) else dict(where)
                ts.KvStore.Spec(spec)
            except Exception as e:
                raise StorageError(f"not a checkpoint location: {where!r}: {_error_text(e)}") from None
            # TODO(limitation): OCDBT written by several processes needs TensorStore's
            # coordinator configured by the caller in the spec; it is not set up here.
            path = spec.get("path", "")
            if path and not path.endswith("/"):
                spec["path"] = path + "/"
            self.kvstore = spec
            if spec.get("driver") == "file" and set(spec) <= {"driver", "path"}:
                # A plain local directory, however it was named: use the
                # filesystem directly (atomic rename, symlink containment).
                self.local = os.path.abspath(spec["path"])
        self._kv: Any = None

    def __str__(self) -> str:
        if self.local is not None:
            return self.local
        return ts.KvStore.Spec(self.kvstore).to_json().get("path", "") or str(self.kvstore)

    def describe(self, name: str) -> str:
        return os.path.join(self.local, name) if self.local is not None else f"{name} in {self.kvstore}"

    def array_kvstore(self, path: str) -> dict[str, Any]:
        spec = dict(self.kvstore)
        spec["path"] = spec.get("path", "") + path + "/"
        return spec

    # ------------------------------------------------------------ small files

    def _kvs(self) -> Any:
        if self._kv is None:
            try:
                self._kv = ts.KvStore.open(self.kvstore, context=_CONTEXT).result()
            except Exception as e:
                raise StorageError(f"cannot open {self.kvstore}: {_error_text(e)}") from None
        return self._kv

    def read_file(self, name: str) -> bytes | None:
        """The bytes of a file at the root, or None if there is none."""
        try:
            if self.local is not None:
                with open(os.path.join(self.local, name), "rb") as f:
                    return f.read()
            r = self._kvs().read(name).result()
            return None if r.state == "missing" else bytes(r.value)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot read {self.describe(name)}: {_error_text(e)}") from None

    def write_file(self, name: str, data: bytes) -> None:
        """Write a file at the root atomically: it appears whole or not at all.

        Locally: a temporary name, fsync, rename, fsync of the directory. On a
        kvstore: one write, which TensorStore's kvstores apply atomically.
        """
        try:
            if self.local is None:
                self._kvs().write(name, data).result()
                return
            os.makedirs(self.local, exist_ok=True)
            final = os.path.join(self.local, name)
            tmp = os.path.join(self.local, f".{name}.tmp-{uuid.uuid4().hex}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._sync_dir()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot write {self.describe(name)}: {_error_text(e)}") from None

    def remove(self, name: str, *, tree: bool = False) -> None:
        """Remove a file (or, with ``tree``, everything under a prefix), if present."""
        try:
            if self.local is None:
                end = name + ("0" if tree else "\x00")
                start = name + "/" if tree else name
                self._kvs().delete_range(ts.KvStore.KeyRange(start, end)).result()
                return
            target = os.path.join(self.local, name)
            if tree and os.path.isdir(target):
                shutil.rmtree(target)
            elif not tree and os.path.lexists(target):
                os.unlink(target)
            else:
                return
            self._sync_dir()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot remove {self.describe(name)}: {_error_text(e)}") from None

    def _sync_dir(self) -> None:
        assert self.local is not None
        fd = os.open(self.local, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def check_contained(self, paths: Sequence[str]) -> list[str]:
        """Stored paths that escape the root through a symlink (local roots only)."""
        if self.local is None:
            return []
        root = os.path.realpath(self.local)
        bad = []
        for path in paths:
            top = os.path.join(self.local, path)
            escapes = [top] if not _inside(os.path.realpath(top), root) else []
            for dirpath, dirnames, filenames in os.walk(top):
                for name in dirnames + filenames:
                    full = os.path.join(dirpath, name)
                    if os.path.islink(full) and not _inside(os.path.realpath(full), root):
                        escapes.append(full)
            if escapes:
                bad.append(f"{path!r} leads outside the checkpoint through a symlink: {escapes[0]}")
        return bad

    # ------------------------------------------------------------ arrays

    def write_arrays(self, items: Sequence[tuple[str, str, np.ndarray]], stats: IOStats | None = None) -> None:
        """Store each ``(path, dtype, array)`` as a zarr v3 array, all in parallel.

        Raises:
            StorageError: listing every array that could not be written.
        """
        start = time.perf_counter()
        opened = []
        problems: list[str] = []
        for path, dtype, array in items:
            spec = _create_spec(self.array_kvstore(path), dtype, tuple(array.shape))
            try:
                opened.append((path, array, ts.open(spec, create=True, delete_existing=True, context=_CONTEXT)))
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
        pending: list[tuple[str, Any, int]] = []
        in_flight = 0

        def settle(path: str, future: Any) -> None:
            try:
                future.result()
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")

        for path, array, future in opened:
            try:
                store = future.result()
                if not array.dtype.isnative:
                    array = array.astype(array.dtype.newbyteorder("="))
                pending.append((path, store.write(array), array.nbytes))
                in_flight += array.nbytes
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
            while in_flight > WRITE_WINDOW_BYTES and pending:
                done_path, done, nbytes = pending.pop(0)
                settle(done_path, done)
                in_flight -= nbytes
        for path, future, _ in pending:
            settle(path, future)
        if problems:
            raise StorageError(format_problems("cannot write the checkpoint's arrays", problems))
        if stats is not None:
            stats.arrays += len(items)
            stats.bytes_written += sum(a.nbytes for _, _, a in items)
            stats.seconds += time.perf_counter() - start

    def read_into(self, plan: LoadPlan, datas: Sequence[np.ndarray], stats: IOStats | None = None) -> None:
        """Execute a load plan: fill ``datas[i]`` for each target of ``plan``.

        Every stored array is opened (and its zarr.json checked against
        metadata.json) before any target byte is written. Reads then run in
        parallel, straight into the targets where no conversion is needed.

        Raises:
            StorageError: missing, truncated or corrupted data, naming the file.
        """
        start = time.perf_counter()
        problems = self.check_contained(sorted(plan.arrays))
        if problems:
            raise MetadataError(format_problems("checkpoint paths escape the checkpoint", problems))
        futures = {}
        for path, (dtype, shape) in plan.arrays.items():
            spec = {"driver": "zarr3", "kvstore": self.array_kvstore(path), "fill_missing_data_reads": False}
            try:
                futures[path] = ts.open(spec, open=True, read=True, dtype=ts.dtype(dtype), shape=shape,
                                        context=_CONTEXT)
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
        stores: dict[str, Any] = {}
        for path, future in futures.items():
            try:
                stores[path] = future.result()
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
        if problems:
            raise StorageError(format_problems("cannot open the checkpoint's arrays", problems))
        chunks = {p: _read_chunk(s) for p, s in stores.items()}

        # TODO(limitation): a chunk found corrupt or missing while reading raises
        # after other reads may already have landed in the targets; checking
        # every chunk first would read everything twice.
        pending: list[tuple[str, Any, np.ndarray | None, Box]] = []
        needed = touched = 0
        for tp in plan.targets:
            data = datas[tp.target]
            direct = data.dtype == numpy_dtype(tp.stored_dtype) and data.dtype.isnative
            view = ts.array(data, copy=False, write=True) if direct else None
            itemsize = numpy_dtype(tp.stored_dtype).itemsize
            for r in tp.reads:
                src = _at(stores[r.path], r.stored_box)
                needed += r.stored_box.volume * itemsize
                touched += _chunk_envelope(r.stored_box, chunks[r.path]) * itemsize
                if view is not None:
                    pending.append((r.path, _at(view, r.target_box).write(src), None, r.target_box))
                else:
                    pending.append((r.path, src.read(), data, r.target_box))
        for path, future, staged_into, box in pending:
            try:
                value = future.result()
                if staged_into is not None:
                    cast_into(box.view(staged_into), value)
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
        if problems:
            raise StorageError(format_problems("cannot read the checkpoint's arrays", problems))
        for tp in plan.targets:
            for box in tp.padding:
                datas[tp.target][box.slices] = 0
        if stats is not None:
            stats.arrays += len(stores)
            stats.bytes_needed += needed
            stats.bytes_read += touched
            stats.seconds += time.perf_counter() - start


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _at(store: Any, box: Box) -> Any:
    return store[box.slices] if box.ndim else store


def _read_chunk(store: Any) -> tuple[int, ...]:
    shape = store.chunk_layout.read_chunk.shape
    return tuple(shape) if shape is not None else tuple(store.shape)


def _chunk_envelope(box: Box, chunk: tuple[int, ...]) -> int:
    """Elements of the whole chunks that ``box`` touches. zarr stores edge chunks
    at full size, so this is what storage reads (before any shard index)."""
    n = 1
    for o, s, c in zip(box.offset, box.shape, chunk):
        lo = (o // c) * c
        hi = -(-(o + s) // c) * c
        n *= hi - lo
    return n
