"""A fixed staging pool: the host memory an asynchronous save copies its
snapshot into, sized once for the rank's state and reused by every save, and
shared with the writer process (an anonymous memory file mapped by both)."""

from __future__ import annotations

import itertools
import mmap
import os
import tempfile
import threading
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["COPY_THREADS", "StagingPool", "parallel_copy"]

#: Every pool buffer of this process gets a new number (a writer maps them by it).
_GENERATIONS = itertools.count(1)
_IDENTS = itertools.count(1)
#: Threads a snapshot copies with: memory bandwidth, not one core, bounds a large copy.
COPY_THREADS = 2
#: Arrays below this many bytes are copied by the calling thread alone.
_SPLIT_BYTES = 8 << 20
#: Arrays of more than this many bytes start at a multiple of 4096 in the pool,
#: so that the writer process can hand their pages to the disk unbuffered
#: (io/localio/unbuffered.py; those are the arrays stored as shards); smaller
#: ones at a multiple of 64, so that many small tensors waste little.
_PAGE_ALIGNED_ABOVE = 1 << 20


def _align(nbytes: int) -> int:
    return 4096 if nbytes > _PAGE_ALIGNED_ABOVE else 64


def _memory_file(nbytes: int) -> int:
    """A file descriptor of ``nbytes`` of anonymous shared memory (Linux
    ``memfd``; elsewhere a temporary file unlinked at once)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("globalshard-staging", getattr(os, "MFD_CLOEXEC", 0))
    else:
        fd, name = tempfile.mkstemp(prefix="globalshard-staging-")
        os.unlink(name)
    try:
        os.ftruncate(fd, max(nbytes, 1))
    except BaseException:
        os.close(fd)
        raise
    return fd


class StagingPool:
    """Host buffers for the snapshots of asynchronous saves.

    A save takes slices of the pool with :meth:`take` after :meth:`reset`,
    in order; the pool grows (a new memory file, the old one dropped once no
    save uses it) only when a save needs more than it holds, so a training
    run that saves the same state again and again allocates it once. The
    memory is a file descriptor (:attr:`fd`) that another process can map:
    the writer process reads the snapshot where the trainer wrote it.

    ``pin``: called with ``(address, nbytes)`` of each new buffer, e.g. to
    page-lock it for device-to-host copies (``cudaHostRegister``); ``unpin``
    before it is dropped.
    """

    def __init__(self, pin: Callable[[int, int], None] | None = None,
                 unpin: Callable[[int, int], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._pin, self._unpin = pin, unpin
        self.fd = -1
        self.nbytes = 0
        #: This pool, among the process's pools.
        self.ident = next(_IDENTS)
        #: The number of the pool's current buffer, new whenever a larger one replaces it.
        self.generation = 0
        #: The bytes the pool's user asked for last (an adapter staging into it
        #: records there what the next save should reserve).
        self.wanted = 0
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._used = 0

    def set_pinning(self, pin: Callable[[int, int], None], unpin: Callable[[int, int], None]) -> None:
        """Page-lock the pool's memory with ``pin`` from now on (the current
        buffer too), ``unpin`` before a buffer is dropped. Once."""
        with self._lock:
            if self._pin is not None:
                return
            self._pin, self._unpin = pin, unpin
            if self._array is not None:
                pin(self._array.ctypes.data, self.nbytes)

    def reserve(self, nbytes: int) -> None:
        """Make the pool hold at least ``nbytes`` (and forget what was taken)."""
        with self._lock:
            self._used = 0
            if nbytes <= self.nbytes and (self._array is not None or nbytes == 0):
                return
            self._drop()
            size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
            fd = _memory_file(size)
            self._map = mmap.mmap(fd, size)
            self._array = np.frombuffer(self._map, np.uint8)
            self.fd, self.nbytes = fd, size
            self.generation = next(_GENERATIONS)
            if self._pin is not None:
                self._pin(self._array.ctypes.data, size)

    def reset(self) -> None:
        """Forget what was taken: the next save reuses the pool from its start."""
        with self._lock:
            self._used = 0

    def take(self, shape: Sequence[int], dtype: np.dtype) -> tuple[np.ndarray, int]:
        """A new C-contiguous array of ``shape`` and ``dtype`` in the pool, aligned to
        64 bytes (4096 above 1 MiB), and its byte offset in the pool.

        Raises:
            MemoryError: the pool holds too little (call :meth:`reserve` first).
        """
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        with self._lock:
            align = _align(nbytes)
            start = -(-self._used // align) * align
            if self._array is None or start + nbytes > self.nbytes:
                raise MemoryError(f"the staging pool holds {self.nbytes} bytes, {start + nbytes} asked for")
            self._used = start + nbytes
            buffer = self._array[start:start + nbytes]
        return buffer.view(dt).reshape(tuple(shape)), start

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where ``array``'s first byte lies in the pool, or None if it is not in the pool."""
        if self._array is None:
            return None
        base = self._array.ctypes.data
        address = array.__array_interface__["data"][0]
        return address - base if base <= address < base + self.nbytes else None

    @staticmethod
    def needed(arrays: Sequence[np.ndarray]) -> int:
        """The bytes :meth:`take` needs for ``arrays``, alignment included."""
        # Whatever the order: an array aligned to 4096 starts at most 4096 - 64 bytes
        # beyond the 64-byte boundary that a smaller alignment would have given it.
        return sum(-(-a.nbytes // 64) * 64 + _align(a.nbytes) - 64 for a in arrays)

    def _drop(self) -> None:
        if self._array is not None and self._unpin is not None:
            self._unpin(self._array.ctypes.data, self.nbytes)
        self._array = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views of the old pool are still alive: the memory goes with them
                pass
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.nbytes = 0

    def close(self) -> None:
        """Release the pool (views taken from it must no longer be used)."""
        with self._lock:
            self._drop()


def parallel_copy(pairs: Sequence[tuple[np.ndarray, np.ndarray]], threads: int = COPY_THREADS) -> None:
    """``np.copyto(dst, src)`` for each ``(dst, src)``, large arrays split
    along their first axis among ``threads`` threads (numpy copies without
    the GIL)."""
    small: list[tuple[np.ndarray, np.ndarray]] = []
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for dst, src in pairs:
        if threads <= 1 or dst.nbytes < _SPLIT_BYTES or dst.ndim == 0 or dst.shape[0] < threads:
            small.append((dst, src))
            continue
        step = -(-dst.shape[0] // threads)
        for t in range(threads):
            lo, hi = t * step, min((t + 1) * step, dst.shape[0])
            if lo < hi:
                parts[t].append((dst[lo:hi], src[lo:hi]))
                loads[t] += dst[lo:hi].nbytes
    for dst, src in small:  # the smallest thread load takes the small arrays
        parts[loads.index(min(loads))].append((dst, src))
        loads[loads.index(min(loads))] += dst.nbytes

    def run(work: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for dst, src in work:
            np.copyto(dst, src)

    errors: list[BaseException] = []

    def guarded(w: list[tuple[np.ndarray, np.ndarray]]) -> None:
        try:
            run(w)
        except BaseException as e:
            errors.append(e)

    helpers = [threading.Thread(target=guarded, args=(w,), name="globalshard-snapshot") for w in parts[1:] if w]
    for h in helpers:
        h.start()
    try:
        run(parts[0])
    finally:
        for h in helpers:
            h.join()
    if errors:
        raise errors[0]
