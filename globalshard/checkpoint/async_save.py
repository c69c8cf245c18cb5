"""Saves that return once this rank's bytes are in host memory."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from globalshard.checkpoint.saving import entries_of, finish_save, plan_save
from globalshard.comm import Comm, SingleProcessComm
from globalshard.errors import LayoutError
from globalshard.io import ArrayItem, IOStats, PackItem
from globalshard.layout import ShardedTensor
from globalshard.store import open_root

__all__ = ["AsyncSaver"]


class AsyncSaver:
    """Saves that return once this rank's data is copied to host memory, and
    write, commit and clean up in a background thread.

    :meth:`save` does in the caller's thread everything that can fail before
    storage changes (describing, validating and planning on every rank; rank
    0 takes the checkpoint's lock), then copies exactly the bytes this rank
    will write into a host buffer that the saver keeps and reuses (host
    memory stays at one snapshot, however many saves), and returns. The
    arrays may then change: the checkpoint holds the values they had.

    One save at a time: :meth:`save` first waits for the previous one (and
    raises its error, if it failed). Call :meth:`wait` before the process
    exits, and before loading with the same communicator (its collectives
    run in the background thread meanwhile). A crash during the background
    part leaves the previous checkpoint as it was (spec section 2.1).

    >>> import numpy as np, tempfile
    >>> from globalshard import ShardedTensor, read_array
    >>> w = np.ones((2, 3), np.float32)
    >>> saver, d = AsyncSaver(), tempfile.mkdtemp()
    >>> saver.save({"w": ShardedTensor.from_offset("w", w, global_shape=(2, 3), global_offset=(0, 0))}, d)
    >>> w[:] = 7  # training goes on
    >>> saver.wait()
    >>> float(read_array(d, "w")[0, 0])
    1.0
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffer: np.ndarray | None = None
        #: Seconds the last :meth:`save` blocked the caller, and the copy's share of them.
        self.blocking_seconds = 0.0
        self.snapshot_seconds = 0.0

    def save(self, state: Mapping[str, ShardedTensor], path: Any, *, trainer_state: dict[str, Any] | None = None,
             comm: Comm | None = None, overwrite: bool = False, kvstore: Any = None,
             stats: IOStats | None = None, staged: Mapping[str, Callable[[], None]] | None = None,
             pack_below: int = 0) -> None:
        """As :func:`save`, returning after the host snapshot (see the class).

        ``staged``: names of ``state`` whose ``data`` is already a private host
        copy that is still being filled (a device-to-host copy in flight), each
        with a function that blocks until it is done. Those are not copied
        into the snapshot: the background writer waits for each one just
        before writing its bytes, so the copies overlap with the writes of the
        arrays before them.
        """
        self.wait()
        start = time.perf_counter()
        comm = comm if comm is not None else SingleProcessComm()
        store = open_root(path, kvstore)
        entries = entries_of(state)
        unknown = sorted(set(staged or {}) - {name for name, _ in entries})
        if unknown:
            raise LayoutError(f"staged names {unknown[:5]} are not in the state")
        held = contextlib.ExitStack()
        try:
            planned = plan_save(store, comm, entries, trainer_state, overwrite, held, staged,
                                 pack_below=pack_below)
            copied = time.perf_counter()
            planned.items = self._snapshot(planned.items)
            self.snapshot_seconds = time.perf_counter() - copied
        except BaseException:
            held.close()
            raise

        def background() -> None:
            try:
                with held:
                    finish_save(planned, stats, held)
            except BaseException as e:  # raised by wait() in the caller's thread
                self._error = e

        self._thread = threading.Thread(target=background, name="globalshard-save")
        self._thread.start()
        self.blocking_seconds = time.perf_counter() - start

    def _snapshot(self, items: list[ArrayItem | PackItem]) -> list[ArrayItem | PackItem]:
        arrays = [(i.data, i.ready) for i in items if isinstance(i, ArrayItem)]
        arrays += [(data, ready) for i in items if isinstance(i, PackItem) for _, data, ready in i.members]
        total = sum(data.nbytes for data, ready in arrays if ready is None)
        if self._buffer is None or self._buffer.nbytes < total:
            self._buffer = np.empty(total, np.uint8)
        offset = 0

        def copied(array: np.ndarray, ready: Callable[[], None] | None) -> np.ndarray:
            nonlocal offset
            if ready is not None:  # a private copy already, still being filled
                return array
            native = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
            copy = np.ndarray(array.shape, native, buffer=self._buffer, offset=offset)
            np.copyto(copy, array)
            offset += array.nbytes
            return copy

        out: list[ArrayItem | PackItem] = []
        for item in items:
            if isinstance(item, PackItem):
                out.append(item._replace(members=tuple((b, copied(data, ready), ready)
                                                       for b, data, ready in item.members)))
            else:
                out.append(item._replace(data=copied(item.data, item.ready)))
        return out

    def done(self) -> bool:
        """Whether no save is in flight."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
