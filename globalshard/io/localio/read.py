"""Reading chunks of local arrays straight into targets (``preadv``),
each chunk once, its crc32c checked before a byte of it is used."""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from globalshard.dtypes import cast_into, numpy_dtype
from globalshard.geometry import Box
from globalshard.io.localio.files import (
    _EMPTY,
    _FLAGS,
    ArrayFile,
    ChunkError,
    Where,
    _at,
    _crc,
    _gathered,
    _preadv_exact,
    _task_bytes,
)
from globalshard.io.localio.write import _staging


@dataclass(slots=True)
class _Destination:
    """Where the part of a stored array's ``stored_box`` goes: ``target[target_box]``."""

    target: np.ndarray | None  # None: only verify
    stored_box: Box
    target_box: Box


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
        # (or apart by less than a block: an unbuffered shard's padding, read and
        # dropped) are read by one preadv (each chunk's bytes, then its checksum):
        # fewer system calls and GIL hand-overs than one preadv per 1 MiB chunk.
        run: list[tuple[Where, np.ndarray, int]] = []
        run_start = run_end = 0
        for chunk_index, dests in chunks:
            local = tuple(i - o * n for i, o, n in zip(chunk_index, outer, per_outer))
            position = int(np.ravel_multi_index(local, per_outer)) if local and index is not None else 0
            offset, length, where = _stored_chunk(path, index, position, list(local), size, nbytes,
                                                  f"{list(chunk)} {layout.dtype}")
            total += nbytes
            direct = _whole_chunk_view(dests, chunk_index, chunk, dtype, layout.shape)
            if direct is not None and run and run_end <= offset < run_end + _GAP_BYTES and len(run) < _RUN_CHUNKS:
                run[-1] = (*run[-1][:2], offset - run_end)
                run.append((where, direct, 0))
                run_end = offset + length
                continue
            _read_run(fd, run, run_start)
            run = []
            if direct is not None:
                run, run_start, run_end = [(where, direct, 0)], offset, offset + length
            else:
                _read_one(fd, where, offset, nbytes, chunk_index, chunk, dtype, layout.shape, dests)
        _read_run(fd, run, run_start)
        return total
    finally:
        os.close(fd)


#: Most chunks one preadv reads (two buffers each; IOV_MAX is 1024).
_RUN_CHUNKS = 64
#: Chunks of a run may lie this far apart (an unbuffered shard pads each to a 4096-byte boundary).
_GAP_BYTES = 4096


def _whole_chunk_view(dests: list[_Destination], chunk_index: tuple[int, ...], chunk: tuple[int, ...],
                      dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray | None:
    """The target bytes a whole chunk is read straight into, or None (staged)."""
    if len(dests) != 1:
        return None
    lo = tuple(i * c for i, c in zip(chunk_index, chunk))
    if any(o + c > s for o, c, s in zip(lo, chunk, shape)):  # a partial chunk at the edge
        return None
    return _direct_view(dests[0], lo, chunk, dtype)


def _read_run(fd: int, run: list[tuple[Where, np.ndarray, int]], offset: int) -> None:
    """Read chunks stored from ``offset`` straight into their targets, each
    ``(where, target, bytes after its checksum up to the next)``, each checked
    (see :func:`_read_checked`)."""
    if run:
        _read_checked(fd, [(where, [data], bytearray(4 + gap)) for where, data, gap in run], offset)


def _read_checked(fd: int, run: list[tuple[Where, list[Any], bytearray]], offset: int) -> None:
    """Read chunks stored back to back from ``offset``, each ``(where, the
    buffers its bytes fill, a buffer for its stored crc32c and whatever
    follows it up to the next chunk)``, and
    check each one's crc32c (a failure names that chunk).

    Chunks already in the page cache are read one at a time without waiting
    (``RWF_NOWAIT``) and checked while they are still in the CPU's cache; from
    the first that is not, the rest of the run is one blocking preadv, which
    the kernel reads ahead as one request. A checksum over a chunk just read
    runs at about twice the speed of one over a chunk that has left the CPU's
    cache, which saves CPU time on warm loads; cold loads read as before."""
    first = 0
    if _NOWAIT:
        for where, bufs, crc in run:
            try:
                n = os.preadv(fd, [*bufs, crc], offset, _NOWAIT)
            except OSError:  # EAGAIN: not cached; EOPNOTSUPP: the file system cannot say
                break
            if n != sum(map(len, bufs)) + len(crc):  # partly cached: the blocking read starts again at this chunk
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
    if value != int.from_bytes(crc[:4], "little"):
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
