"""Writing stored arrays and packs into local files: ``pwritev`` from the
arrays themselves, crc32c per chunk, writeback started early, fsync or one syncfs."""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import json
import math
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from globalshard.io.localio.files import TASK_BYTES, _at, _crc, _pwritev, parse


def write_array(directory: str, array: np.ndarray, doc: dict[str, Any],
                pool: concurrent.futures.Executor, *, fsync: bool = True,
                mkdirs: bool = True, unbuffered: bool = False) -> list[concurrent.futures.Future[Any]]:
    """Start writing one stored region (``doc`` from :func:`globalshard.format.zarr.zarr_json`) into a new
    directory (created unless ``mkdirs=False``: the caller did); the futures end
    when every file is written and (``fsync``) fsynced. The caller makes the
    directories durable (or calls :func:`syncfs`). ``unbuffered``: a shard
    is written around the page cache (:mod:`~globalshard.io.localio.unbuffered`)."""
    layout = parse(directory, doc)
    assert layout is not None and array.dtype.isnative
    assert all(s <= o for s, o in zip(array.shape, layout.outer)), "one outer chunk per region"
    path = layout.file_of((0,) * array.ndim)
    if mkdirs:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if layout.inner is None:  # one chunk: the whole array in one task
        return [pool.submit(_write_whole, directory, path, array, json.dumps(doc, allow_nan=False).encode(), fsync)]
    if unbuffered:
        from globalshard.io.localio.unbuffered import write_shard  # it builds on this module's helpers

        return write_shard(directory, path, layout, array, doc, pool, fsync)
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
        tail = shard_index(len(order), chunk_bytes, chunk_bytes)
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
            futures.append(pool.submit(_pwritev, fd, [shard_index(count, stored, stored)], count * stored))
        return [_closing(pool, fd, futures, fsync)]
    except BaseException:
        os.close(fd)
        raise


def shard_index(count: int, stride: int, length: int) -> bytes:
    """The bytes of a shard index (``index_location: "end"``) of ``count`` inner
    chunks of ``length`` bytes each (checksum included), chunk ``k`` at byte
    ``k * stride``, followed by the index's own crc32c."""
    index = np.empty((count, 2), dtype="<u8")
    index[:, 0] = np.arange(count, dtype=np.uint64) * stride
    index[:, 1] = length
    raw = index.tobytes()
    return raw + _crc(raw).to_bytes(4, "little")


def fill_chunk(out: np.ndarray, part: np.ndarray, chunk: tuple[int, ...]) -> None:
    """Copy ``part`` (a chunk's elements, an edge chunk's fewer) into the bytes
    ``out`` of a whole chunk of shape ``chunk``, zeros beyond the array as zarr
    stores them."""
    if part.shape != chunk:
        out[:] = 0
    out.view(part.dtype).reshape(chunk)[tuple(slice(0, s) for s in part.shape)] = part


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


def _closing(pool: concurrent.futures.Executor, fd: int, futures: list[concurrent.futures.Future[Any]], fsync: bool,
             size: int | None = None) -> concurrent.futures.Future[Any]:
    """A future that waits for the writes into ``fd``, cuts the file to ``size`` (if given), fsyncs and closes it."""
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
            if size is not None:
                os.ftruncate(fd, size)
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
    behind the other files' writes, then has less left to wait for once the
    kernel throttles the writers. Durability still comes from the fsync, or
    from the one syncfs of a save of many files, which would otherwise start
    all of the writeback at the end."""
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
            data = _staging(nbytes)  # an edge chunk or a strided one
            fill_chunk(data, part, chunk)
        tail = _crc(data).to_bytes(4, "little")
        # TODO(limitation): buffered writes for synchronous saves, regions of one chunk
        # and packs: the kernel copies every byte into the page cache on the cores that
        # train. An asynchronous save's shards go around it (unbuffered.py); writing
        # the bytes at all still costs a CPU-bound loop step time (docs/limitations.md).
        _pwritev(fd, [data, tail], offset)
