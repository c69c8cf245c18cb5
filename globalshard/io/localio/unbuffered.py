"""A shard written around the page cache (``O_DIRECT``): for the writer
process of an asynchronous save, whose CPU time is taken from training.

A buffered write puts every byte into the page cache, and the kernel's
writeback and reclaim of those pages run on the cores that train; with
``O_DIRECT`` the bytes go from the writer's memory to the disk. It needs
block-aligned offsets, lengths and memory, which a chunk followed by its
4-byte checksum is not, so each inner chunk starts at a multiple of
:data:`BLOCK` bytes. A chunk that is a contiguous, page-aligned piece of its
array (row chunks of an array in the staging pool) is written in place as
far as its last whole block, and the rest of it, its crc32c and zeros up to
the next block go through a small aligned buffer; any other chunk (square
chunks of a whole tensor, edge chunks) is copied into an aligned buffer
first. The shard index (spec section 5: readers find chunks through it)
records where each chunk starts; the file is cut to its exact end after the
last write.

In bench/training.py's loop (a save of the 384 MiB state every 4 steps;
docs/benchmarks.md) a bare process writing the same bytes slows the loop by
1.21-1.27x buffered and by 1.01-1.04x unbuffered; the writer's own CPU time
hardly differs (0.37 against 0.43 CPU-seconds per save when measured for an
earlier version): what buffering cost the loop is the kernel's work on those
pages outside the writer.
Alone, an unbuffered write takes longer (the disk, not the page cache, sets
its pace), so synchronous saves stay buffered.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from globalshard.io.localio.files import TASK_BYTES, ArrayFile, _at, _crc, _pwritev
from globalshard.io.localio.write import _closing, _write_small, fill_chunk, shard_index

__all__ = ["BLOCK", "SCRATCH_BYTES", "aligned", "stride", "write_shard"]

#: The alignment of offsets, lengths and memory: the largest logical block
#: size of common disks (512 and 4096 bytes).
BLOCK = 4096

#: Most chunks one pwritev writes (two buffers each; IOV_MAX is 1024).
_BATCH_CHUNKS = 256

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def stride(chunk_bytes: int) -> int:
    """The distance between two inner chunks of ``chunk_bytes`` (and their checksums) in an unbuffered shard."""
    return -(-(chunk_bytes + 4) // BLOCK) * BLOCK


def aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeros starting at a multiple of :data:`BLOCK` in memory."""
    raw = np.zeros(nbytes + BLOCK, dtype=np.uint8)
    start = -raw.ctypes.data % BLOCK
    return raw[start:start + nbytes]


_local = threading.local()

#: Bytes of the per-thread buffer chunks are copied into (more for a larger chunk): the writer
#: process's memory beside the staging pool is bounded by this times its I/O threads.
SCRATCH_BYTES = 1 << 20


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread aligned buffer of at least ``nbytes`` (contents left over)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.buf = aligned(nbytes)
    return buf[:nbytes]


def write_shard(directory: str, path: str, layout: ArrayFile, array: np.ndarray, doc: dict[str, Any],
                pool: concurrent.futures.Executor, fsync: bool) -> list[concurrent.futures.Future[Any]]:
    """Start writing ``array``'s one shard (``layout.inner`` set) at ``path``
    with each inner chunk at a multiple of :data:`BLOCK`, ``O_DIRECT`` where
    the file system takes it (buffered where it does not: the same bytes);
    its zarr.json beside it. Futures as :func:`~globalshard.io.localio.write.write_array`'s."""
    assert layout.inner is not None
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | _O_DIRECT, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT
            raise
        fd = os.open(path, flags, 0o644)
    try:
        itemsize = array.dtype.itemsize
        futures = [pool.submit(_write_small, os.path.join(directory, "zarr.json"),
                               json.dumps(doc, allow_nan=False).encode(), fsync)]
        inner = layout.inner
        chunk_bytes = math.prod(inner) * itemsize
        step = stride(chunk_bytes)
        counts = [o // i for o, i in zip(layout.outer, inner)]
        order = list(np.ndindex(*counts))
        per_task = max(1, min(_BATCH_CHUNKS, TASK_BYTES // step))
        for start in range(0, len(order), per_task):
            batch = order[start:start + per_task]
            futures.append(pool.submit(_write_chunks, fd, array, batch, start * step, inner, step))
        tail = shard_index(len(order), step, chunk_bytes + 4)
        end = len(order) * step
        padded = aligned(-(-len(tail) // BLOCK) * BLOCK)
        padded[:len(tail)] = np.frombuffer(tail, np.uint8)
        futures.append(pool.submit(_write, fd, [padded], end))
        return [_closing(pool, fd, futures, fsync, size=end + len(tail))]
    except BaseException:
        os.close(fd)
        raise


def _write_chunks(fd: int, array: np.ndarray, batch: Sequence[tuple[int, ...]], offset: int,
                  chunk: tuple[int, ...], step: int) -> None:
    """Write the chunks ``batch`` (chunk indices) of ``array`` back to back from file ``offset``, each
    taking ``step`` bytes: its bytes, its crc32c, zeros. What is copied goes through a per-thread
    buffer of at most ``max(step, SCRATCH_BYTES)``, written out whenever the next chunk would not fit."""
    nbytes = math.prod(chunk) * array.dtype.itemsize
    whole = nbytes // BLOCK * BLOCK  # what can be written from the array itself
    rest = step - whole
    room = max(step, SCRATCH_BYTES)
    tails = _scratch(room)
    buffers: list[Any] = []
    used = 0
    for index in batch:
        lo = tuple(i * c for i, c in zip(index, chunk))
        part = array[_at(lo, chunk)]
        in_place = part.shape == chunk and part.flags.c_contiguous and part.ctypes.data % BLOCK == 0
        if used + (rest if in_place else step) > room:  # the buffer is full: write what it holds
            _write(fd, buffers, offset)
            offset += sum(len(b) for b in buffers)
            buffers, used = [], 0
        if in_place:
            data = part.reshape(-1).view(np.uint8)
            out = tails[used:used + rest]
            out[:nbytes - whole] = data[whole:]
            buffers += [data[:whole], out] if whole else [out]
            head = nbytes - whole
        else:  # an edge chunk (zero beyond the array, as zarr stores it), a strided or unaligned one: copied
            # TODO(limitation): square chunks of whole tensors are copied too (27-31% of the writer's CPU in
            # bench/training.py); staging them in chunk order made the blocking copy 1.5-1.8x a memcpy. A bare
            # writer doing only these copies and the crc32c (bench/training.py raw_chunked) costs that loop
            # as much as this writer does.
            data = out = tails[used:used + step]
            fill_chunk(out[:nbytes], part, chunk)
            buffers.append(out)
            head = nbytes
        out[head:head + 4] = np.frombuffer(_crc(data[:nbytes]).to_bytes(4, "little"), np.uint8)
        out[head + 4:] = 0
        used += len(out)
    _write(fd, buffers, offset)


def _write(fd: int, buffers: list[Any], offset: int) -> None:
    """``pwritev``; if the file system refuses the unbuffered write (``EINVAL``: a block size above
    :data:`BLOCK`), the file is written buffered from here on (same bytes). Threads write parts of
    one file at once: a write refused while the file was unbuffered is written again, also when
    another thread has made the file buffered since (an EINVAL that buffered writes get too is
    raised by that second write)."""
    try:
        _pwritev(fd, buffers, offset)
    except OSError as e:
        if e.errno != errno.EINVAL or not _O_DIRECT:
            raise
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & _O_DIRECT:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        _pwritev(fd, buffers, offset)
