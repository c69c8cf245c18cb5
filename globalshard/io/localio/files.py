"""What every part of localio shares: the stored arrays it serves (parsed
from their zarr.json), chunk errors as data, vectored I/O, and the I/O threads."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c

from globalshard.dtypes import numpy_dtype


def workers() -> int:
    """Threads doing local reads and writes (I/O and checksums release the GIL):
    ``GLOBALSHARD_IO_THREADS`` if set; else 4 shared among the ranks of this
    host when the launcher says how many there are (torchrun's
    ``LOCAL_WORLD_SIZE``), at least one each; else 4. Shared, because ranks
    of one host each running 4 threads contend for the same cores and disk
    and save slower than with one thread each."""
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
#: ahead while it copies (a new descriptor per small task does not), so large
#: tasks load faster, warm and cold.
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


def _pwritev(fd: int, buffers: list[Any], offset: int) -> None:
    _vectored(os.pwritev, fd, buffers, offset, None)


def _preadv_exact(fd: int, buffers: list[Any], offset: int, where: Where | str) -> None:
    _vectored(os.preadv, fd, buffers, offset, where)


def _at(offset: Sequence[int], shape: Sequence[int]) -> Any:
    """An index of the box; with ``...`` so that a 0-d box gives a view, not a scalar."""
    return (*(slice(o, o + s) for o, s in zip(offset, shape)), Ellipsis)


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
