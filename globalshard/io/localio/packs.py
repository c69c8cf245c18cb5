"""Reading packs (spec section 5.1): each chunk once, scattered by ``preadv``
straight into the members' buffers."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from globalshard.io.localio.files import _FLAGS, ArrayFile, ChunkError, Where, _gathered, _task_bytes
from globalshard.io.localio.read import _read_checked, _shard_index, _stored_chunk
from globalshard.io.localio.write import _MAX_PIECES


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
