"""Saves that return once this rank's bytes are in host memory, the rest
written by a writer process (or a thread) while training goes on."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook is registered before ours below, so runs after)
import contextlib
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from globalshard.checkpoint.bases import Digests, hash_checked
from globalshard.checkpoint.finishing import InProcess, finish_save
from globalshard.checkpoint.messages import can_send
from globalshard.checkpoint.saving import PlannedSave, entries_of, plan_save
from globalshard.checkpoint.staging import StagingPool, parallel_copy
from globalshard.checkpoint.writer import Writer, describe_items, shared_writer
from globalshard.comm import Comm, SingleProcessComm, start_in_background
from globalshard.errors import LayoutError
from globalshard.format.metadata import Metadata
from globalshard.io import ArrayItem, IOStats, PackItem
from globalshard.layout import ShardedTensor
from globalshard.store import Store, open_root

__all__ = ["MODES", "AsyncSaver"]

_log = logging.getLogger("globalshard")

#: Where the background part of an asynchronous save runs.
MODES = ("process", "thread")

#: Every saver of this process, for the exit's report of failures no wait() raised.
_SAVERS: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


def _finish_saves_at_exit() -> None:
    """At interpreter shutdown, wait for the saves in flight before Python shuts
    down its thread pools (their writes use one: a save still writing then
    failed with "cannot schedule new futures after interpreter shutdown" and
    was not committed). Python waits for such threads anyway, but only after."""
    for saver in list(_SAVERS):
        saver.join()


# Threading's exit hooks run in the reverse order of their registration, before non-daemon threads are joined.
# A private hook of threading (Python 3.9 and later; concurrent.futures registers its own with it).
_register_at_shutdown = getattr(threading, "_register_atexit", None)
if _register_at_shutdown is not None:
    _register_at_shutdown(_finish_saves_at_exit)


@atexit.register
def _report_unraised() -> None:
    """At exit (after the interpreter has waited for the saves in flight): a
    background failure that no :meth:`AsyncSaver.wait` raised is said on
    stderr, rather than lost with the checkpoint it did not commit."""
    for saver in list(_SAVERS):
        if saver._error is not None:
            warnings.warn(f"the asynchronous save to {saver._where} failed and was not committed; nothing raised "
                          f"it (call AsyncSaver.wait() before exiting): {type(saver._error).__name__}: "
                          f"{saver._error}", RuntimeWarning, stacklevel=1)


class AsyncSaver:
    """Saves that return once this rank's data is copied to host memory; the
    writing, fsync, commit and cleanup go on in the background.

    :meth:`save` does in the caller's thread everything that can fail before
    storage changes (describing, validating and planning on every rank,
    reusing the plan of a save of the same structure; rank 0 takes the
    checkpoint's lock), then copies exactly the bytes this rank will write
    into a staging pool that the saver keeps and reuses (allocated once for
    the state, however many saves), and returns. The arrays may then change:
    the checkpoint holds the values they had.

    ``mode="process"`` (the default): the arrays are written, synced,
    committed and cleaned up by a writer process that maps the staging pool,
    so none of that work runs in the trainer's interpreter; a thread of the
    saver only waits for it and takes part in the save's few collectives.
    ``mode="thread"``: all of it in a thread of this process. A store that
    another process cannot reach (an in-memory kvstore), or a writer that
    cannot be started, falls back to the thread, with a log line.

    One save at a time: :meth:`save` first waits for the previous one (and
    raises its error, if it failed). Call :meth:`wait` before the process
    exits (and before destroying its process group); a script that ends
    without it still has its save finished before the interpreter shuts
    down, and a failure that no :meth:`wait` raised is printed at exit (a
    ``RuntimeWarning``) rather than lost in silence. Over several ranks the
    save's last collectives run in the background: a load or save begun
    meanwhile (of any saver, on any communicator) waits for them before its
    own, which would otherwise pair with theirs. A crash, or a killed
    writer, during the background part leaves the previous checkpoint as it
    was (spec section 2.1); the error is raised by the next :meth:`wait` or
    :meth:`save`, and the next save starts a new writer.

    Args:
        mode: ``"process"`` or ``"thread"``, see above.
        writer: the writer process to use (default: this process's shared
            one).

    >>> import numpy as np, tempfile
    >>> from globalshard import ShardedTensor, read_array
    >>> w = np.ones((2, 3), np.float32)
    >>> saver, d = AsyncSaver(), tempfile.mkdtemp()
    >>> saver.save({"w": ShardedTensor.from_offset("w", w, global_shape=(2, 3), global_offset=(0, 0))}, d)
    >>> w[:] = 7  # training goes on
    >>> saver.wait()
    >>> float(read_array(d, "w")[0, 0])
    1.0
    >>> import shutil; shutil.rmtree(d)
    """

    def __init__(self, mode: str = "process", *, writer: Writer | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._writer = writer
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: The staging pool of snapshots, reused by every save.
        self.pool = StagingPool()
        #: A second pool, for adapters that stage device tensors whole before a
        #: save (pinned by them for device-to-host copies): what lies there is
        #: written from there, not copied again.
        self.host_pool = StagingPool()
        #: Seconds the last :meth:`save` blocked the caller, and the copy's share of them.
        self.blocking_seconds = 0.0
        self.snapshot_seconds = 0.0
        #: Where the last save's background part ran: ``"process"`` or ``"thread"``.
        self.last_mode = ""
        self._where = ""
        _SAVERS.add(self)

    @property
    def writer(self) -> Writer:
        """The writer process of this saver's process-mode saves."""
        if self._writer is None:
            self._writer = shared_writer()
        return self._writer

    def save(self, state: Mapping[str, ShardedTensor], path: Any, *, trainer_state: dict[str, Any] | None = None,
             comm: Comm | None = None, overwrite: bool = False, kvstore: Any = None,
             stats: IOStats | None = None, staged: Mapping[str, Callable[[], None]] | None = None,
             pack_below: int = 0, base: Any = None, frozen: Iterable[str] = (),
             digests: bool | None = None, io: str | None = None, unchanged: Digests | None = None,
             check_replicas: bool = False) -> None:
        """As :func:`~globalshard.save`, returning after the host snapshot (see the class).

        Args:
            state: as for :func:`~globalshard.save`.
            path: as for :func:`~globalshard.save`.
            trainer_state: as for :func:`~globalshard.save`.
            comm: as for :func:`~globalshard.save`.
            overwrite: as for :func:`~globalshard.save`.
            kvstore: as for :func:`~globalshard.save`.
            stats: as for :func:`~globalshard.save`, filled when the save has finished.
            pack_below: as for :func:`~globalshard.save`.
            base: as for :func:`~globalshard.save`.
            frozen: as for :func:`~globalshard.save`: those regions are not
                copied into the snapshot either.
            digests: as for :func:`~globalshard.save`.
            unchanged: as for :func:`~globalshard.save`: hashed from the
                snapshot in the background, before anything is written.
            io: as for :func:`~globalshard.save` (the writer process opens that engine).
            check_replicas: as for :func:`~globalshard.save`: compared before
                this call returns (staged copies waited for).
            staged: names of ``state`` whose ``data`` is already a private
                host copy that is still being filled (a device-to-host copy in
                flight), each with a function that blocks until it is done.
                Those are not copied again: the writer waits for each one just
                before writing its bytes, so the copies overlap with the
                writes of the arrays before them.
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
                                pack_below=pack_below, base=base, frozen=frozen, digests=digests, kvstore=kvstore,
                                io=io, unchanged=unchanged, check_replicas=check_replicas)
        except BaseException:
            held.close()
            raise

        def finish(planned: PlannedSave, ops: InProcess) -> None:
            with held:
                finish_save(planned, stats, held, ops)

        self.start(planned, held, store, finish)
        self.blocking_seconds = time.perf_counter() - start

    def start(self, planned: PlannedSave, held: contextlib.ExitStack, where: Store,
              finish: Callable[[PlannedSave, InProcess], None]) -> None:
        """The part of :meth:`save` after planning, for a save planned by the
        caller (a tiered save's, which writes to a node's tier): copy
        ``planned``'s arrays into the pool, then run ``finish(planned, ops)``
        in the background, its I/O done by ``ops`` (the writer process, when
        ``where`` reaches it, in process mode); the next :meth:`wait` raises
        its failure. ``finish`` closes ``held`` (nothing else does once it
        runs); a failed snapshot closes it here."""
        try:
            ops = self._operations(where)
            copied = time.perf_counter()
            planned.items, later = self._snapshot(planned.items, copy_staged=isinstance(ops, _InWriter))
            self.snapshot_seconds = time.perf_counter() - copied
            if isinstance(ops, _InWriter):
                ops.later = later
        except BaseException:
            held.close()
            raise
        self._where = str(where)

        def background() -> None:
            try:
                finish(planned, ops)
            except BaseException as e:  # raised by wait() in the caller's thread
                self._error = e

        if planned.comm.world_size > 1:  # its collectives go on in the background: other collectives wait for them
            self._thread = start_in_background(background, "globalshard-save")
        else:
            self._thread = threading.Thread(target=background, name="globalshard-save")
            self._thread.start()

    def _operations(self, store: Store) -> InProcess:
        if self.mode == "process" and can_send(store):
            try:
                self.writer.ensure()
                self.last_mode = "process"
                return _InWriter(self.writer, [self.pool, self.host_pool])
            except OSError as e:
                _log.warning("the writer process cannot be started (%s): this save is written by a thread", e)
        elif self.mode == "process":
            _log.info("%s is not reachable from another process (an in-memory or unknown kind of store): this "
                      "save is written by a thread", store)
        self.last_mode = "thread"
        return InProcess(unbuffered=True)  # in the background too: less of the training's CPU

    def _snapshot(self, items: list[ArrayItem | PackItem], *, copy_staged: bool
                  ) -> tuple[list[ArrayItem | PackItem], list[tuple[Callable[[], None], np.ndarray, np.ndarray]]]:
        """``items`` with their data copied into the pool. A staged array stays
        where it is being filled, unless ``copy_staged`` (the writer must find
        it in the pool): it then gets a slot, filled once it is ready; those
        ``(ready, source, slot)`` are returned for the background to copy."""
        arrays = [(i.data, i.ready) for i in items if isinstance(i, ArrayItem)]
        arrays += [(data, ready) for i in items if isinstance(i, PackItem) for _, data, ready in i.members]
        def elsewhere(a: np.ndarray) -> bool:  # a staged array the writer would not find
            return copy_staged and self.host_pool.offset_of(a) is None and self.pool.offset_of(a) is None

        pooled = [a for a, ready in arrays if ready is None or elsewhere(a)]
        self.pool.reserve(StagingPool.needed(pooled))
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        later: list[tuple[Callable[[], None], np.ndarray, np.ndarray]] = []

        def copied(array: np.ndarray, ready: Callable[[], None] | None) -> np.ndarray:
            if ready is not None and not elsewhere(array):
                return array  # a private copy already, still being filled
            native = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
            slot, _ = self.pool.take(array.shape, native)
            if ready is None:
                pairs.append((slot, array))
            else:
                later.append((ready, array, slot))
            return slot

        out: list[ArrayItem | PackItem] = []
        for item in items:
            if isinstance(item, PackItem):
                out.append(item._replace(members=tuple((b, copied(data, ready), ready)
                                                       for b, data, ready in item.members)))
            else:
                out.append(item._replace(data=copied(item.data, item.ready)))
        parallel_copy(pairs)
        return out, later

    def done(self) -> bool:
        """Whether no save is in flight."""
        return self._thread is None or not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes) for the save
        in flight, without raising its error, which the next :meth:`wait` or
        :meth:`save` raises; whether no save is in flight now."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class _InWriter(InProcess):
    """The I/O that finishes a save, done by the writer process."""

    def __init__(self, writer: Writer, pools: list[StagingPool]) -> None:
        self.writer, self.pools = writer, pools
        #: Staged arrays the writer finds in the pool once copied there: (ready, source, slot).
        self.later: list[tuple[Callable[[], None], np.ndarray, np.ndarray]] = []

    def hash(self, planned: PlannedSave) -> list[list[Any]]:
        """As :meth:`InProcess.hash`, in this process (the snapshot is shared
        memory): an array whose copy into the pool is still to be made is
        hashed from where it is staged."""
        sources = {id(ready): source for ready, source, _ in self.later}
        return hash_checked(planned.items, planned.checks, lambda item: sources.get(id(item.ready), item.data))

    def write(self, planned: PlannedSave, stats: IOStats | None) -> list[list[Any]]:
        index: dict[int, int] = {}
        waits: list[Callable[[], None]] = []

        def ready_index(ready: Callable[[], None] | None) -> int | None:
            if ready is None:
                return None
            if id(ready) not in index:
                index[id(ready)] = len(waits)
                waits.append(ready)
            return index[id(ready)]

        def locate(array: np.ndarray) -> tuple[int, int] | None:
            for pool in self.pools:
                offset = pool.offset_of(array)
                if offset is not None:
                    return pool.generation, offset
            return None

        described = describe_items(planned.items, locate, ready_index)
        copies = {id(ready): (source, slot) for ready, source, slot in self.later}
        blob = planned.coordinator.trainer_blob
        trainer_state = (blob[1].path, blob[0]) if blob is not None else None
        with self.writer.job_lock:
            self.writer.ensure()
            for pool in self.pools:
                if pool.fd >= 0:
                    self.writer.map_pool(pool)
            job = self.writer.submit("write", planned.store, planned.io, described, trainer_state,
                                     dict(planned.requests))
            failed: BaseException | None = None
            for k, ready in enumerate(waits):
                if failed is None:
                    try:
                        ready()  # blocks until that array holds its values (a device copy in flight)
                        if id(ready) in copies:
                            source, slot = copies[id(ready)]
                            np.copyto(slot, source)
                    except BaseException as e:
                        failed = e
                if failed is None:
                    self.writer.ready(job, k)
                else:
                    self.writer.cancel(job, k, f"{type(failed).__name__}: {failed}")
            result, outcomes = self.writer.result(job)
        if stats is not None:
            for field, value in result.items():
                setattr(stats, field, getattr(stats, field) + value)
        return list(outcomes)

    def commit(self, store: Store, metadata: Metadata, stamp: Any) -> bytes:
        text = metadata.dumps()
        self.writer.call("commit", store, text, stamp)
        return text.encode("utf-8")

    def cleanup(self, store: Store, previous: Metadata | None, save_id: str) -> None:
        self.writer.call("cleanup", store, previous, save_id)

    def remove(self, store: Store, name: str) -> None:
        try:
            self.writer.call("remove", store, name)
        except Exception as e:  # the writer is gone: this process removes the failed save
            _log.debug("removing %s here: %s", name, e)
            super().remove(store, name)

