"""Stored arrays in local files, read and written without TensorStore.

The arrays are the same zarr v3 arrays TensorStore reads and writes (spec
section 5): ``[bytes, crc32c]`` chunks, alone or inside one
``sharding_indexed`` shard. Going around TensorStore for local files saves
what a profile of a load showed to cost most of its time: TensorStore's
portable crc32c (the ``crc32c`` package uses the CPU's instructions), its
decode into a buffer of its own, and the copy from there into the target.
Here a chunk is read with ``preadv`` straight into the target when it is a
contiguous piece of it, otherwise into a reusable per-thread buffer, its
checksum verified before a byte of it is copied out.

Only layouts this module fully understands are served: anything else in a
zarr.json (another codec, a big-endian ``bytes``, another chunk key
encoding) makes :func:`parse` return None and the caller goes through
TensorStore. Object stores always go through TensorStore.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import itertools
import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import numpy as np

from globalshard.dtypes import cast_into, numpy_dtype
from globalshard.geometry import Box

__all__ = ["ArrayFile", "parse", "read_packs", "write_array", "write_pack", "Reader"]

def workers() -> int:
    """Threads doing local reads and writes (I/O and checksums release the GIL):
    ``GLOBALSHARD_IO_THREADS`` if set; else 4 shared among the ranks of this
    host when the launcher says how many there are (torchrun's
    ``LOCAL_WORLD_SIZE``), at least one each; else 4.

    Four processes saving 1 GiB on this 2-core machine with 4 threads each
    wrote at 0.57 GB/s (median of 6) against 0.80 GB/s with one thread each;
    loads by 2 processes ran the same with 2 or 4 threads each."""
    own = os.environ.get("GLOBALSHARD_IO_THREADS")
    if own is not None:
        if not own.isdigit() or int(own) < 1:
            raise ValueError(f"GLOBALSHARD_IO_THREADS must be a positive integer, got {own!r}")
        return int(own)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, 4 // int(local)) if local.isdigit() and int(local) > 0 else 4

#: Bytes of chunks one task writes before it returns (its granularity).
TASK_BYTES = 8 << 20

#: Bytes of chunks one read task reads: the load's bytes over twice the
#: threads, within these bounds. Cold, one large read lets the kernel read
#: ahead while it copies (a new descriptor per small task does not): a 2-process
#: TP4->2 load of 1 GiB, 6 alternating runs, took 1.04 s cold / 0.28 s warm in
#: 8 MiB tasks and 0.89 / 0.24 s in 64 MiB tasks; the same bytes read raw took
#: 0.76 / 0.12 s.
READ_TASK_BYTES = (8 << 20, 64 << 20)

_NATIVE_LITTLE = sys.byteorder == "little"
_EMPTY = (1 << 64) - 1
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def _crc(data: Any, value: int = 0) -> int:
    return int(crc32c.crc32c(data, value))


@dataclass(frozen=True, slots=True, eq=False)
class ArrayFile:
    """A stored array whose layout this module serves.

    ``outer``: the chunk grid's chunk shape (one file per outer chunk).
    ``inner``: the shard's inner chunk shape, or None when each file is one
    chunk.
    """

    directory: str
    dtype: str
    shape: tuple[int, ...]
    outer: tuple[int, ...]
    inner: tuple[int, ...] | None
    separator: str
    attributes: Any

    @property
    def chunk(self) -> tuple[int, ...]:
        """The unit of a read: the inner chunk, or the whole outer chunk."""
        return self.inner if self.inner is not None else self.outer

    def file_of(self, outer_index: Sequence[int]) -> str:
        key = self.separator.join(["c", *map(str, outer_index)])
        return os.path.join(self.directory, *key.split("/"))


def _is_plain(codecs: Any, itemsize: int) -> bool:
    """``[bytes (little-endian), crc32c]`` exactly."""
    if not isinstance(codecs, list) or len(codecs) != 2 or codecs[1] != {"name": "crc32c"}:
        return False
    first = codecs[0]
    if not isinstance(first, dict) or first.get("name") != "bytes" or set(first) - {"name", "configuration"}:
        return False
    conf = first.get("configuration", {})
    if not isinstance(conf, dict) or set(conf) - {"endian"}:
        return False
    endian = conf.get("endian", "little" if itemsize == 1 else None)
    return endian == "little" or itemsize == 1


def _shape(value: Any, ndim: int) -> tuple[int, ...] | None:
    if (not isinstance(value, list) or len(value) != ndim
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        return None
    return tuple(value)


def parse(directory: str, doc: Any) -> ArrayFile | None:
    """The layout of a zarr.json if this module can serve it, else None."""
    if not _NATIVE_LITTLE or not isinstance(doc, dict):
        return None
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array" or doc.get("storage_transformers"):
        return None
    if set(doc) - {"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                   "fill_value", "codecs", "attributes", "dimension_names"}:
        return None
    dtype, shape = doc.get("data_type"), doc.get("shape")
    try:
        itemsize = numpy_dtype(dtype).itemsize if isinstance(dtype, str) else 0
    except Exception:
        return None
    if not itemsize or not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        return None
    ndim = len(shape)
    grid = doc.get("chunk_grid")
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(grid.get("configuration"), dict):
        return None
    outer = _shape(grid["configuration"].get("chunk_shape"), ndim)
    encoding = doc.get("chunk_key_encoding")
    if not isinstance(encoding, dict) or encoding.get("name") != "default":
        return None
    separator = (encoding.get("configuration") or {}).get("separator", "/")
    if outer is None or separator not in ("/", "."):
        return None
    codecs = doc.get("codecs")
    if _is_plain(codecs, itemsize):
        inner = None
    elif isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) \
            and codecs[0].get("name") == "sharding_indexed" and set(codecs[0]) <= {"name", "configuration"}:
        conf = codecs[0].get("configuration")
        if not isinstance(conf, dict) or set(conf) - {"chunk_shape", "codecs", "index_codecs", "index_location"}:
            return None
        inner = _shape(conf.get("chunk_shape"), ndim)
        if (inner is None or any(o % i for o, i in zip(outer, inner)) or conf.get("index_location", "end") != "end"
                or not _is_plain(conf.get("codecs"), itemsize) or not _is_plain(conf.get("index_codecs"), 8)):
            return None
    else:
        return None
    return ArrayFile(directory, str(dtype), tuple(shape), outer, inner, separator, doc.get("attributes"))


# ------------------------------------------------------------------ writing


def write_array(directory: str, array: np.ndarray, doc: dict[str, Any],
                pool: concurrent.futures.Executor, *, fsync: bool = True,
                mkdirs: bool = True) -> list[concurrent.futures.Future[Any]]:
    """Start writing one stored region (``doc`` from :func:`globalshard.format.zarr.zarr_json`) into a new
    directory (created unless ``mkdirs=False``: the caller did); the futures end
    when every file is written and (``fsync``) fsynced. The caller makes the
    directories durable (or calls :func:`syncfs`)."""
    layout = parse(directory, doc)
    assert layout is not None and array.dtype.isnative
    assert all(s <= o for s, o in zip(array.shape, layout.outer)), "one outer chunk per region"
    path = layout.file_of((0,) * array.ndim)
    if mkdirs:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if layout.inner is None:  # one chunk: the whole array in one task
        return [pool.submit(_write_whole, directory, path, array, json.dumps(doc, allow_nan=False).encode(), fsync)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        itemsize = array.dtype.itemsize
        futures = [pool.submit(_write_small, os.path.join(directory, "zarr.json"),
                               json.dumps(doc, allow_nan=False).encode(), fsync)]
        inner = layout.inner
        chunk_bytes = math.prod(inner) * itemsize + 4
        counts = [o // i for o, i in zip(layout.outer, inner)]
        order = list(np.ndindex(*counts))
        per_task = max(1, TASK_BYTES // chunk_bytes)
        for start in range(0, len(order), per_task):
            batch = [(idx, (start + k) * chunk_bytes) for k, idx in enumerate(order[start:start + per_task])]
            futures.append(pool.submit(_write_chunks, fd, array, batch, inner, itemsize))
        index = np.empty((len(order), 2), dtype="<u8")
        index[:, 0] = np.arange(len(order), dtype=np.uint64) * chunk_bytes
        index[:, 1] = chunk_bytes
        raw = index.tobytes()
        tail = raw + _crc(raw).to_bytes(4, "little")
        futures.append(pool.submit(_pwritev, fd, [tail], len(order) * chunk_bytes))
        return [_closing(pool, fd, futures, fsync)]
    except BaseException:
        os.close(fd)
        raise


#: A chunk of a pack whose pieces (members and the gaps between them) are
#: more than this many is copied into one buffer first (IOV_MAX is 1024).
_MAX_PIECES = 500


def write_pack(directory: str, members: Sequence[tuple[int, np.ndarray]], doc: dict[str, Any],
               pool: concurrent.futures.Executor, *, fsync: bool = True) -> list[concurrent.futures.Future[Any]]:
    """Start writing a pack (spec section 5.1; ``doc`` from :func:`globalshard.format.zarr.zarr_json`
    for a ``uint8`` array of one axis) straight from its members'
    bytes, each ``(byte_offset, contiguous uint8 array)``, without assembling
    it: each chunk is one ``pwritev`` of the member pieces it holds, zeros
    between them, and its crc32c computed over the pieces. The directories
    exist (the caller made them); durability as in :func:`write_array`."""
    layout = parse(directory, doc)
    assert layout is not None and layout.dtype == "uint8" and len(layout.shape) == 1
    size, chunk = layout.shape[0], layout.chunk[0]
    count = -(-size // chunk)
    zeros = memoryview(bytes(chunk))
    pieces: list[list[Any]] = [[] for _ in range(count)]
    ends = [c * chunk for c in range(count)]  # how far each chunk's pieces reach
    for start, data in sorted(members, key=lambda m: m[0]):
        view = memoryview(data).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
        end = start + len(view)
        for c in range(start // chunk, -(-end // chunk)):
            lo, hi = max(start, c * chunk), min(end, (c + 1) * chunk)
            if lo > ends[c]:
                pieces[c].append(zeros[:lo - ends[c]])
            pieces[c].append(view[lo - start:hi - start])
            ends[c] = hi
    for c in range(count):  # zeros to each chunk's end (the array's end, unsharded)
        stop = (c + 1) * chunk if layout.inner is not None else size
        if stop > ends[c]:
            pieces[c].append(zeros[:stop - ends[c]])
    path = layout.file_of((0,))
    text = json.dumps(doc, allow_nan=False).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        futures = [pool.submit(_write_small, os.path.join(directory, "zarr.json"), text, fsync)]
        stored = chunk + 4 if layout.inner is not None else size + 4
        per_task = max(1, TASK_BYTES // stored)
        for first in range(0, count, per_task):
            batch = [(pieces[c], c * stored) for c in range(first, min(count, first + per_task))]
            futures.append(pool.submit(_write_pack_chunks, fd, batch))
        if layout.inner is not None:
            index = np.empty((count, 2), dtype="<u8")
            index[:, 0] = np.arange(count, dtype=np.uint64) * stored
            index[:, 1] = stored
            raw = index.tobytes()
            futures.append(pool.submit(_pwritev, fd, [raw + _crc(raw).to_bytes(4, "little")], count * stored))
        return [_closing(pool, fd, futures, fsync)]
    except BaseException:
        os.close(fd)
        raise


def _write_pack_chunks(fd: int, batch: Sequence[tuple[list[Any], int]]) -> None:
    """Write chunks of a pack, each ``(pieces, file offset)``, followed by its crc32c."""
    for parts, offset in batch:
        if len(parts) > _MAX_PIECES:
            parts = [b"".join(parts)]
        value = 0
        for part in parts:
            value = _crc(part, value)
        _pwritev(fd, [*parts, value.to_bytes(4, "little")], offset)


def _write_whole(directory: str, path: str, array: np.ndarray, zarr_json_bytes: bytes, fsync: bool) -> None:
    """An unsharded array: its zarr.json and its one chunk file."""
    _write_small(os.path.join(directory, "zarr.json"), zarr_json_bytes, fsync)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_chunks(fd, array, [((0,) * array.ndim, 0)], array.shape, array.dtype.itemsize)
    finally:
        _sync_close(fd, fsync)


def _closing(pool: concurrent.futures.Executor, fd: int,
             futures: list[concurrent.futures.Future[Any]], fsync: bool) -> concurrent.futures.Future[Any]:
    """A future that waits for the writes into ``fd``, fsyncs and closes it."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            for f in futures:
                f.result()
            _start_writeback(fd)  # also when a syncfs will follow: it then has less left to wait for
            pool.submit(_sync_close, fd, fsync).add_done_callback(lambda f: _settle(done, f))
        except BaseException as e:
            os.close(fd)
            done.set_exception(e)

    for f in futures:
        f.add_done_callback(finish)
    return done


def _settle(done: concurrent.futures.Future[Any], f: concurrent.futures.Future[Any]) -> None:
    e = f.exception()
    if e is not None:
        done.set_exception(e)
    else:
        done.set_result(None)


def _sync_close(fd: int, fsync: bool) -> None:
    try:
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_small(path: str, data: bytes, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _libc(name: str, *argtypes: Any) -> Any:
    """A libc function through ctypes (Linux calls Python's os module lacks), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
        fn.argtypes = list(argtypes)
        return fn
    except (OSError, AttributeError):
        return None


_LINUX = sys.platform.startswith("linux")
_SYNC_FILE_RANGE = _libc("sync_file_range", ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
                         ctypes.c_uint) if _LINUX else None


def _start_writeback(fd: int) -> None:
    """Start writing a finished file's dirty pages to the disk without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); its fsync, queued
    behind the other files' writes, then has less left to wait for. Saving 2
    GiB from 4 processes (3 alternating runs): 3.4-3.7 s without, 2.5-2.9 s
    with; 1 GiB the same (0.8-0.9 s), where the kernel had not yet throttled
    the writers. Durability still comes from the fsync, or from the one
    syncfs of a save of many files, which otherwise started all of the
    writeback at the end: 10,000 small tensors in 114 packs (1.8 GB) saved in
    2.9-3.8 s without, 1.6-2.3 s with (the same bytes in 8 tensors: 1.0-1.3 s)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE; an error is the fsync's to report


_SYNCFS = _libc("syncfs", ctypes.c_int) if _LINUX else None


def has_syncfs() -> bool:
    """Whether :func:`syncfs` is available (Linux)."""
    return _SYNCFS is not None


def syncfs(path: str) -> None:
    """Make everything written to the filesystem holding ``path`` durable, in
    one call (Linux ``syncfs``): for saves of many small files, where one
    fsync per file and directory costs more than the data."""
    assert _SYNCFS is not None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}", path)
    finally:
        os.close(fd)


def _at(offset: Sequence[int], shape: Sequence[int]) -> Any:
    """An index of the box; with ``...`` so that a 0-d box gives a view, not a scalar."""
    return (*(slice(o, o + s) for o, s in zip(offset, shape)), Ellipsis)


_local = threading.local()


def _staging(nbytes: int) -> np.ndarray:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


def _write_chunks(fd: int, array: np.ndarray, batch: Sequence[tuple[tuple[int, ...], int]],
                  chunk: tuple[int, ...], itemsize: int) -> None:
    """Write chunks ``(chunk index, file offset)`` of ``array``, each followed by its crc32c."""
    nbytes = math.prod(chunk) * itemsize
    for index, offset in batch:
        lo = tuple(i * c for i, c in zip(index, chunk))
        part = array[_at(lo, chunk)]
        if part.shape == chunk and part.flags.c_contiguous:
            data = part.reshape(-1).view(np.uint8)
        else:
            # An edge chunk (zero beyond the array, as zarr stores it) or a strided one.
            data = _staging(nbytes)
            shaped = data.view(array.dtype).reshape(chunk)
            if part.shape != chunk:
                data[:] = 0
            shaped[tuple(slice(0, s) for s in part.shape)] = part
        tail = _crc(data).to_bytes(4, "little")
        _pwritev(fd, [data, tail], offset)


def _pwritev(fd: int, buffers: list[Any], offset: int) -> None:
    _vectored(os.pwritev, fd, buffers, offset, None)


def _vectored(call: Any, fd: int, buffers: list[Any], offset: int, where: Where | str | None) -> None:
    """``os.pwritev`` or ``os.preadv`` of all of ``buffers`` at ``offset``, resumed
    after short transfers; a read that meets the end of the file (``where``
    names it) is a ChunkError."""
    views = [memoryview(b).cast("B") for b in buffers]
    n = call(fd, views, offset)
    if n == sum(map(len, views)):  # the common case: all of it at once
        return
    done = 0  # views[:done] are complete
    while True:
        if n == 0 and where is not None:
            raise ChunkError(where, "the file ends before the chunk does (truncated?)")
        offset += n
        while done < len(views) and n >= len(views[done]):
            n -= len(views[done])
            done += 1
        if done == len(views):
            return
        if n:
            views[done] = views[done][n:]
        n = call(fd, views[done:], offset)


# ------------------------------------------------------------------ reading


@dataclass(slots=True)
class _Destination:
    """Where the part of a stored array's ``stored_box`` goes: ``target[target_box]``."""

    target: np.ndarray | None  # None: only verify
    stored_box: Box
    target_box: Box


class Where(NamedTuple):
    """A chunk's place: its file and, inside a shard, its inner chunk index."""

    path: str
    chunk: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return self.path if self.chunk is None else f"{self.path} (inner chunk {list(self.chunk)})"


class ChunkError(Exception):
    """A chunk that is missing, truncated, damaged or unreadable, as data:
    ``path`` (its file), ``chunk`` (its inner chunk index inside a shard, or
    None for the whole file) and ``why``; ``str()`` says all three."""

    def __init__(self, where: Where | str, why: str) -> None:
        where = where if isinstance(where, Where) else Where(where)
        self.path, self.chunk, self.why = where.path, where.chunk, why
        super().__init__(f"{where}: {why}")


class Reader:
    """Reads chunks of local arrays into targets, each chunk once, in parallel."""

    def __init__(self, pool: concurrent.futures.Executor) -> None:
        self._pool = pool

    def read(self, requests: Iterable[tuple[ArrayFile, Box, np.ndarray | None, Box]]) -> tuple[int, list[ChunkError]]:
        """Fill ``target[target_box]`` from ``stored_box`` of each array (a None
        target: only read and verify). Returns ``(bytes of chunks read,
        problems)``; each problem names the file and the chunk."""
        by_chunk: dict[tuple[ArrayFile, tuple[int, ...]], list[_Destination]] = {}
        for layout, stored_box, target, target_box in requests:
            if stored_box.volume == 0:
                continue
            dest = _Destination(target, stored_box, target_box)
            chunk = layout.chunk
            spans = [range(o // c, -(-(o + s) // c)) for o, s, c in zip(stored_box.offset, stored_box.shape, chunk)]
            for index in itertools.product(*spans):
                by_chunk.setdefault((layout, index), []).append(dest)
        by_file: dict[tuple[ArrayFile, tuple[int, ...]], list[tuple[tuple[int, ...], list[_Destination]]]] = {}
        for (layout, index), dests in by_chunk.items():
            outer = tuple(i * c // o for i, c, o in zip(index, layout.chunk, layout.outer))
            by_file.setdefault((layout, outer), []).append((index, dests))
        # Tasks of about ``task`` bytes: a large file's chunks split over several, small files grouped.
        chunk_bytes = {layout: max(1, math.prod(layout.chunk) * numpy_dtype(layout.dtype).itemsize)
                       for layout, _ in by_file}
        total_bytes = sum(len(chunks) * chunk_bytes[layout] for (layout, _), chunks in by_file.items())
        task = _task_bytes(total_bytes)
        tasks: list[list[tuple[ArrayFile, tuple[int, ...], Any]]] = [[]]
        size = 0
        for (layout, outer), chunks in by_file.items():
            nbytes = chunk_bytes[layout]
            chunks.sort()
            for start in range(0, len(chunks), max(1, task // nbytes)):
                part = chunks[start:start + max(1, task // nbytes)]
                if size and size + len(part) * nbytes > task:
                    tasks.append([])
                    size = 0
                tasks[-1].append((layout, outer, part))
                size += len(part) * nbytes
        return _gathered([self._pool.submit(_read_units, task) for task in tasks if task])

    def verify(self, layout: ArrayFile) -> tuple[int, list[ChunkError]]:
        """Read and check every chunk of an array; ``(bytes read, problems)``."""
        box = Box._trusted((0,) * len(layout.shape), layout.shape)
        return self.read([(layout, box, None, box)])


def read_packs(pool: concurrent.futures.Executor,
               packs: Iterable[tuple[ArrayFile, Sequence[tuple[int, np.ndarray]]]],
               nbytes: int) -> tuple[int, list[ChunkError]]:
    """Fill the members of packs (spec section 5.1): for each 1-d uint8 array,
    ``(byte_offset, buffer)`` pairs whose buffers (contiguous uint8) take
    that many bytes from that offset. Each chunk holding any of them is read
    once, scattered by ``preadv`` straight into the buffers (bytes no buffer
    takes land in scratch memory), and its crc32c is checked over the pieces
    before the call returns. ``packs`` may be a generator: reads start while
    it makes the next pack's members. ``nbytes``: about how many bytes the
    members take, to size the tasks. Returns ``(bytes of chunks read,
    problems)``; each problem names the file and the chunk."""
    futures = []
    current: list[tuple[ArrayFile, int, list[tuple[int, Any]]]] = []
    size = 0
    task = _task_bytes(nbytes)

    def add(layout: ArrayFile, c: int, pieces: list[tuple[int, Any]]) -> None:
        nonlocal current, size
        if size and size + layout.chunk[0] > task:  # each task starts while the next is put together
            futures.append(pool.submit(_read_pack_task, current))
            current, size = [], 0
        current.append((layout, c, pieces))
        size += layout.chunk[0]

    try:
        for layout, members in packs:
            chunk = layout.chunk[0]
            # Chunks that later members may still reach, in ascending order (members
            # come sorted, so chunks are added in order); the lowest is ``low``.
            pieces: dict[int, list[tuple[int, Any]]] = {}
            low = -1
            for start, buf in sorted(members, key=_first):  # members do not overlap
                flat = buf if buf.ndim == 1 and buf.dtype == _UINT8 else buf.reshape(-1).view(np.uint8)
                view = memoryview(flat)  # type: ignore[arg-type]  # numpy is a buffer
                end = start + len(view)
                first = start // chunk
                if 0 <= low < first:
                    for c in [c for c in pieces if c < first]:
                        add(layout, c, pieces.pop(c))
                    low = next(iter(pieces), -1)
                last = (end - 1) // chunk
                if first == last:  # the commonest: the member lies in one chunk
                    pieces.setdefault(first, []).append((start, view))
                else:
                    for c in range(first, last + 1):
                        lo, hi = max(start, c * chunk), min(end, (c + 1) * chunk)
                        pieces.setdefault(c, []).append((lo, view[lo - start:hi - start]))
                if low < 0:
                    low = next(iter(pieces), -1)
            for c in pieces:
                add(layout, c, pieces[c])
    except BaseException:  # packs is the caller's generator: no task may outlive this call
        concurrent.futures.wait(futures)
        raise
    if current:
        futures.append(pool.submit(_read_pack_task, current))
    return _gathered(futures)


_UINT8 = np.dtype(np.uint8)


def _first(item: tuple[int, Any]) -> int:
    return item[0]


def _task_bytes(total: int) -> int:
    """Bytes of one read task: the load's bytes over twice the threads, within :data:`READ_TASK_BYTES`."""
    low, high = READ_TASK_BYTES
    return min(high, max(low, total // (2 * workers())))


def _gathered(futures: Sequence[concurrent.futures.Future[tuple[int, list[ChunkError]]]],
              ) -> tuple[int, list[ChunkError]]:
    """The summed ``(bytes read, problems)`` of read tasks, once all have ended."""
    total, problems = 0, []
    for f in futures:
        nbytes, more = f.result()
        total += nbytes
        problems += more
    return total, problems


def _read_pack_task(units: Sequence[tuple[ArrayFile, int, list[tuple[int, Any]]]]) -> tuple[int, list[ChunkError]]:
    """Read chunks of packs, each ``(layout, chunk index, [(byte offset, view)])``,
    consecutive chunks of one file by one ``preadv``. A chunk of more than
    :data:`_MAX_PIECES` pieces (IOV_MAX is 1024) is read whole into scratch
    memory and its members copied out once its crc32c is checked."""
    total, problems = 0, []
    fd, opened, size, index, path = -1, None, 0, None, ""
    failed: set[tuple[ArrayFile, int]] = set()  # files that would not open: said once
    # (where, buffers, crc, copies after the check) of chunks back to back in the file
    run: list[tuple[Where, list[Any], bytearray, list[tuple[Any, Any]]]] = []
    run_start = run_end = 0
    buffers = 0

    def flush() -> None:
        nonlocal run
        if run:
            _read_checked(fd, [(where, bufs, crc) for where, bufs, crc, _ in run], run_start)
            for _, _, _, copies in run:
                for view, part in copies:
                    view[:] = part
        run = []

    try:
        for layout, c, pieces in units:
            chunk = layout.chunk[0]
            per_file = layout.outer[0] // chunk
            outer = c // per_file  # the file (outer chunk) holding chunk c, and c's place in it
            if (layout, outer) in failed:
                continue
            try:
                if opened != (layout, outer):
                    path = layout.file_of((outer,))
                    flush()
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    opened = None
                    failed.add((layout, outer))
                    try:
                        fd = os.open(path, _FLAGS)
                    except FileNotFoundError:
                        raise ChunkError(path, "the chunk file is missing") from None
                    size = os.fstat(fd).st_size
                    index = _shard_index(fd, path, layout, size) if layout.inner is not None else None
                    failed.discard((layout, outer))
                    opened = (layout, outer)
                local = c - outer * per_file
                offset, length, where = _stored_chunk(path, index, local, [local], size, chunk, f"[{chunk}] uint8")
                bufs, copies = _pack_chunk_buffers(c * chunk, chunk, pieces)
                if not run or offset != run_end or buffers + len(bufs) + 1 > 1000:
                    flush()
                    run_start, buffers = offset, 0
                run.append((where, bufs, bytearray(4), copies))
                run_end = offset + length
                buffers += len(bufs) + 1
                total += chunk
            except ChunkError as e:
                run = []
                problems.append(e)
            except OSError as e:
                run = []
                problems.append(ChunkError(e.filename or path, e.strerror or str(e)))
        try:
            flush()
        except ChunkError as e:
            problems.append(e)
        except OSError as e:
            problems.append(ChunkError(e.filename or path, e.strerror or str(e)))
    finally:
        if fd >= 0:
            os.close(fd)
    return total, problems


def _pack_chunk_buffers(start: int, chunk: int, pieces: list[tuple[int, Any]]) -> tuple[list[Any], list[Any]]:
    """The buffers one pack chunk of ``chunk`` bytes from byte ``start`` is read
    into: its members' views (``pieces``, in order, as ``(byte offset, view)``)
    and scratch memory for the bytes between them; or, past
    :data:`_MAX_PIECES` buffers, one scratch buffer and ``(view, part of it)``
    copies to make once the chunk is checked."""
    if 2 * len(pieces) + 1 > _MAX_PIECES:
        whole = memoryview(bytearray(chunk))
        return [whole], [(view, whole[lo - start:lo - start + len(view)]) for lo, view in pieces]
    taken = sum(len(v) for _, v in pieces)
    scratch = memoryview(bytearray(chunk - taken)) if taken < chunk else None
    bufs: list[Any] = []
    cursor, used = start, 0
    for lo, view in pieces:
        if lo > cursor:
            assert scratch is not None
            bufs.append(scratch[used:used + lo - cursor])
            used += lo - cursor
        bufs.append(view)
        cursor = lo + len(view)
    if cursor < start + chunk:
        assert scratch is not None
        bufs.append(scratch[used:used + start + chunk - cursor])
    return bufs, []


def _read_units(units: Sequence[tuple[ArrayFile, tuple[int, ...], Any]]) -> tuple[int, list[ChunkError]]:
    """Read each file's chunks; a problem in one file does not stop the others."""
    total, problems = 0, []
    for layout, outer, chunks in units:
        try:
            total += _read_file_chunks(layout, outer, chunks)
        except ChunkError as e:
            problems.append(e)
        except OSError as e:
            problems.append(ChunkError(e.filename or layout.file_of(outer), e.strerror or str(e)))
    return total, problems


def _stored_chunk(path: str, index: list[list[int]] | None, position: int, label: list[int], size: int, nbytes: int,
                  what: str) -> tuple[int, int, Where]:
    """Where a chunk of ``nbytes`` (``what``: its shape and dtype) lies in its
    file, checked: ``(offset, length, where)`` from entry ``position`` of a
    shard's index (``label``: the inner chunk index), or the whole file."""
    if index is not None:
        offset, length = index[position]
        where = Where(path, tuple(label))
        if offset == _EMPTY and length == _EMPTY:
            raise ChunkError(where, "the chunk is missing from the shard")
        if offset + length > size:
            raise ChunkError(where, "the shard index points past the end of the file (truncated?)")
    else:
        offset, length, where = 0, size, Where(path)
    if length != nbytes + 4:
        raise ChunkError(where, f"{length} bytes stored, a chunk of {what} takes {nbytes + 4} with its checksum")
    return offset, length, where


def _shard_index(fd: int, path: str, layout: ArrayFile, size: int) -> list[list[int]]:
    """A shard's index, checked: ``[offset, length]`` of each inner chunk."""
    assert layout.inner is not None
    count = math.prod(o // i for o, i in zip(layout.outer, layout.inner))
    nbytes = count * 16 + 4
    if size < nbytes:
        raise ChunkError(path, f"{size} bytes, too short for a shard index of {count} chunks (truncated?)")
    raw = os.pread(fd, nbytes, size - nbytes)
    if len(raw) != nbytes or _crc(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise ChunkError(path, "the shard index fails its crc32c checksum (damaged file)")
    return np.frombuffer(raw, dtype="<u8", count=count * 2).reshape(count, 2).tolist()


def _read_file_chunks(layout: ArrayFile, outer: tuple[int, ...],
                      chunks: Sequence[tuple[tuple[int, ...], list[_Destination]]]) -> int:
    path = layout.file_of(outer)
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise ChunkError(path, "the chunk file is missing") from None
    try:
        size = os.fstat(fd).st_size
        itemsize = numpy_dtype(layout.dtype).itemsize
        chunk = layout.chunk
        nbytes = math.prod(chunk) * itemsize
        dtype = numpy_dtype(layout.dtype)
        index = _shard_index(fd, path, layout, size) if layout.inner is not None else None
        per_outer = [o // c for o, c in zip(layout.outer, chunk)]
        total = 0
        # Chunks that land whole in their target and lie back to back in the file
        # are read by one preadv (each chunk's bytes, then its checksum): fewer
        # system calls and GIL hand-overs than one preadv per 1 MiB chunk.
        run: list[tuple[Where, np.ndarray]] = []
        run_start = run_end = 0
        for chunk_index, dests in chunks:
            local = tuple(i - o * n for i, o, n in zip(chunk_index, outer, per_outer))
            position = int(np.ravel_multi_index(local, per_outer)) if local and index is not None else 0
            offset, length, where = _stored_chunk(path, index, position, list(local), size, nbytes,
                                                  f"{list(chunk)} {layout.dtype}")
            total += nbytes
            direct = _whole_chunk_view(dests, chunk_index, chunk, dtype, layout.shape)
            if direct is not None and run and offset == run_end and len(run) < _RUN_CHUNKS:
                run.append((where, direct))
                run_end = offset + length
                continue
            _read_run(fd, run, run_start)
            run = []
            if direct is not None:
                run, run_start, run_end = [(where, direct)], offset, offset + length
            else:
                _read_one(fd, where, offset, nbytes, chunk_index, chunk, dtype, layout.shape, dests)
        _read_run(fd, run, run_start)
        return total
    finally:
        os.close(fd)


#: Most chunks one preadv reads (two buffers each; IOV_MAX is 1024).
_RUN_CHUNKS = 64


def _whole_chunk_view(dests: list[_Destination], chunk_index: tuple[int, ...], chunk: tuple[int, ...],
                      dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray | None:
    """The target bytes a whole chunk is read straight into, or None (staged)."""
    if len(dests) != 1:
        return None
    lo = tuple(i * c for i, c in zip(chunk_index, chunk))
    if any(o + c > s for o, c, s in zip(lo, chunk, shape)):  # a partial chunk at the edge
        return None
    return _direct_view(dests[0], lo, chunk, dtype)


def _read_run(fd: int, run: list[tuple[Where, np.ndarray]], offset: int) -> None:
    """Read chunks stored back to back from ``offset`` straight into their
    targets, each checked (see :func:`_read_checked`)."""
    if run:
        _read_checked(fd, [(where, [data], bytearray(4)) for where, data in run], offset)


def _read_checked(fd: int, run: list[tuple[Where, list[Any], bytearray]], offset: int) -> None:
    """Read chunks stored back to back from ``offset``, each ``(where, the
    buffers its bytes fill, a 4-byte buffer for its stored crc32c)``, and
    check each one's crc32c (a failure names that chunk).

    Chunks already in the page cache are read one at a time without waiting
    (``RWF_NOWAIT``) and checked while they are still in the CPU's cache; from
    the first that is not, the rest of the run is one blocking preadv, which
    the kernel reads ahead as one request. A checksum over a chunk just read
    runs at twice the speed of one over a chunk read 64 MiB earlier (19.5
    against 9 GB/s here): a 2-process TP4->2 warm load of 1 GiB took 71-75
    instead of 90-94 ms of user CPU per rank (wall time unchanged: the
    kernel's copy dominates); cold loads read as before."""
    first = 0
    if _NOWAIT:
        for where, bufs, crc in run:
            try:
                n = os.preadv(fd, [*bufs, crc], offset, _NOWAIT)
            except OSError:  # EAGAIN: not cached; EOPNOTSUPP: the file system cannot say
                break
            if n != sum(map(len, bufs)) + 4:  # partly cached: the blocking read starts again at this chunk
                break
            _check(where, bufs, crc)
            offset += n
            first += 1
        if first == len(run):
            return
    _preadv_exact(fd, [b for _, bufs, crc in run[first:] for b in (*bufs, crc)], offset, run[first][0])
    for where, bufs, crc in run[first:]:
        _check(where, bufs, crc)


def _check(where: Where | str, bufs: list[Any], crc: bytearray) -> None:
    """A chunk's bytes (``bufs``, in order) against its stored crc32c."""
    value = 0
    for b in bufs:
        value = crc32c.crc32c(b, value)
    if value != int.from_bytes(crc, "little"):
        raise ChunkError(where, "the chunk fails its crc32c checksum (damaged file)")


#: ``os.RWF_NOWAIT`` where the platform has it, else 0 (every read blocks).
_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)


def _read_one(fd: int, where: Where | str, offset: int, nbytes: int, chunk_index: tuple[int, ...],
              chunk: tuple[int, ...], dtype: np.dtype[Any], shape: tuple[int, ...],
              dests: list[_Destination]) -> None:
    lo = tuple(i * c for i, c in zip(chunk_index, chunk))
    inside = tuple(min(c, s - o) for o, c, s in zip(lo, chunk, shape))
    crc_buf = bytearray(4)
    direct = _direct_view(dests[0], lo, chunk, dtype) if len(dests) == 1 and inside == chunk else None
    data = direct if direct is not None else _staging(nbytes)
    _preadv_exact(fd, [data, crc_buf], offset, where)
    _check(where, [data], crc_buf)
    if direct is not None:
        return
    values = data.view(dtype).reshape(chunk)
    chunk_box = Box._trusted(lo, inside)
    for d in dests:
        if d.target is None:
            continue
        part = chunk_box.intersect(d.stored_box)
        if part is None or part.volume == 0:
            continue
        src = values[_at(tuple(p - c for p, c in zip(part.offset, lo)), part.shape)]
        at = tuple(t + p - b for t, p, b in zip(d.target_box.offset, part.offset, d.stored_box.offset))
        out = d.target[_at(at, part.shape)]
        if out.dtype == dtype:
            np.copyto(out, src)
        else:
            cast_into(out, src)


def _direct_view(dest: _Destination, lo: tuple[int, ...], chunk: tuple[int, ...],
                 dtype: np.dtype[Any]) -> np.ndarray | None:
    """The target's bytes for a whole chunk when they are contiguous and need no cast."""
    if dest.target is None or dest.target.dtype != dtype or not dest.target.dtype.isnative:
        return None
    box = dest.stored_box
    if any(l < o or l + c > o + s for l, c, o, s in zip(lo, chunk, box.offset, box.shape)):
        return None
    at = tuple(t + l - o for t, l, o in zip(dest.target_box.offset, lo, box.offset))
    out = dest.target[_at(at, chunk)]
    if not out.flags.c_contiguous:
        return None
    return out.reshape(-1).view(np.uint8)


def _preadv_exact(fd: int, buffers: list[Any], offset: int, where: Where | str) -> None:
    _vectored(os.preadv, fd, buffers, offset, where)


def make_pool(threads: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of ``threads`` I/O threads (default: :func:`workers`, read now)."""
    return concurrent.futures.ThreadPoolExecutor(threads or workers(), thread_name_prefix="globalshard-io")


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's I/O threads (created on first use, after any fork, with
    :func:`workers` threads read from the environment then)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = make_pool()
        return _POOL


def _forget_pool() -> None:
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)
