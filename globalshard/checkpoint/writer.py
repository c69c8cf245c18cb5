"""The writer process: the background half of an asynchronous save (writing
the arrays, fsync, the commit, the cleanup) in a process of its own, so that
none of it runs in the trainer's interpreter.

The trainer copies its snapshot into a :class:`~globalshard.checkpoint.staging.StagingPool`,
whose memory the writer maps, and sends the writer jobs over a socket: the
items to write (where in the pool each one's bytes are), then the commit
and the cleanup. A job's reply carries its result or its exception. The
messages are JSON (:mod:`~globalshard.checkpoint.messages`): no code crosses
between the two processes. The writer is this module's :func:`main` in a
new interpreter, started with ``subprocess`` (not ``multiprocessing``: a
training script need not guard its ``__main__``), and it exits when the
trainer does.
"""

from __future__ import annotations

import dataclasses
import importlib
import mmap
import os
import queue
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from globalshard.checkpoint import messages
from globalshard.checkpoint.staging import StagingPool
from globalshard.errors import StorageError
from globalshard.format.paths import METADATA_FILE
from globalshard.io import ArrayItem, IOStats, PackItem, open_engine

__all__ = ["Writer", "WriterDied", "describe_items", "main"]


class WriterDied(StorageError):
    """The writer process ended while a save needed it: that save did not commit."""


# ----------------------------------------------------------------------- items across the process boundary


Locate = Callable[[np.ndarray], "tuple[int, int] | None"]


def _slot(array: np.ndarray, locate: Locate) -> tuple[int, int, tuple[int, ...], tuple[int, ...], str]:
    where = locate(array)
    if where is None:
        raise ValueError("an item of a save in the writer process is not in a staging pool")
    return where[0], where[1], array.shape, array.strides, array.dtype.str


def describe_items(items: Sequence[ArrayItem | PackItem], locate: Locate,
                   ready_index: Callable[[Callable[[], None] | None], int | None]) -> list[tuple[Any, ...]]:
    """The items of a save as the writer rebuilds them: each array's bytes as
    a place in a staging pool (``locate``: the pool buffer's generation and the
    byte offset), each ``ready`` as the index of the notice the trainer sends
    once that array holds its values."""
    out: list[tuple[Any, ...]] = []
    for item in items:
        if isinstance(item, PackItem):
            members = [(b, _slot(data, locate), ready_index(ready)) for b, data, ready in item.members]
            out.append(("pack", item.path, item.nbytes, members, item.attributes))
        else:
            out.append(("array", item.path, item.dtype, _slot(item.data, locate), item.attributes, item.cut,
                        ready_index(item.ready)))
    return out


def _rebuild(described: Sequence[tuple[Any, ...]], pools: dict[int, np.ndarray],
             wait: Callable[[int], Callable[[], None]]) -> list[ArrayItem | PackItem]:
    def view(slot: tuple[int, int, tuple[int, ...], tuple[int, ...], str]) -> np.ndarray:
        generation, offset, shape, strides, dtype = slot
        return np.ndarray(shape, np.dtype(dtype), buffer=pools[generation], offset=offset, strides=strides)

    out: list[ArrayItem | PackItem] = []
    for d in described:
        if d[0] == "pack":
            _, path, nbytes, members, attributes = d
            out.append(PackItem(path, nbytes, tuple((b, view(slot), None if k is None else wait(k))
                                                    for b, slot, k in members), attributes))
        else:
            _, path, dtype, slot, attributes, cut, k = d
            out.append(ArrayItem(path, dtype, view(slot), attributes, tuple(cut), None if k is None else wait(k)))
    return out


# ----------------------------------------------------------------------- the trainer's side


class Writer:
    """The trainer's handle on its writer process (one per trainer process,
    shared by its savers; a job runs at a time). Started on first use and
    again after it died.

    Args:
        nice: added to the writer's niceness (0: none). A niced writer that a
            trainer busy on every core starves may not finish before the next
            save, which then waits for it.
        setup: a function the writer runs when it starts (logging, CPU
            affinity), named ``("package.module:function", [JSON
            arguments])``: the writer imports it; None: nothing.
    """

    def __init__(self, nice: int = 0, setup: tuple[str, Sequence[Any]] | None = None) -> None:
        self.nice, self.setup = nice, setup
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: socket.socket | None = None
        self._fds: socket.socket | None = None
        self._send_lock = threading.Lock()
        #: Held by whoever runs a job, from sending it to its reply.
        self.job_lock = threading.RLock()
        self._mapped: dict[int, int] = {}  # pool ident -> the generation the writer maps
        self._next = 0

    @property
    def pid(self) -> int | None:
        """The writer process's id, once started."""
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self) -> None:
        self.close()
        ctrl, ctrl_child = socket.socketpair()
        fds, fds_child = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from globalshard.checkpoint.writer import main; main(sys.argv[1:])",
                 str(ctrl_child.fileno()), str(fds_child.fileno()), str(self.nice)],
                pass_fds=(ctrl_child.fileno(), fds_child.fileno()), stdin=subprocess.DEVNULL)
        finally:
            ctrl_child.close()
            fds_child.close()
        self._conn = ctrl
        self._fds = fds
        self._mapped = {}
        if self.setup is not None:
            self._send(("setup", self.setup[0], list(self.setup[1])))

    def ensure(self) -> None:
        """Start the writer if it is not running. Under :attr:`job_lock`: two
        threads (ranks of one process) start one writer, and none is
        replaced while a job sent to it waits for its reply.

        Raises:
            OSError: it cannot be started.
        """
        if self.alive():
            return
        with self.job_lock:
            if not self.alive():
                self._start()

    def _send(self, message: Any) -> None:
        assert self._conn is not None
        with self._send_lock:
            try:
                messages.send(self._conn, message)
            except (OSError, EOFError) as e:
                raise self._died(f"sending it {message[0]!r} ({e})") from None

    def _died(self, doing: str) -> WriterDied:
        code = self._proc.wait(timeout=5) if self._proc is not None else None
        how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return WriterDied(f"the writer process (pid {self.pid}) ended ({how}) while {doing}; the save in it "
                          "is not committed and the previous checkpoint stands")

    def map_pool(self, pool: StagingPool) -> None:
        """Hand the writer the current buffer of ``pool`` (its memory file), once;
        the buffer it replaced is dropped."""
        old = self._mapped.get(pool.ident)
        if old == pool.generation:
            return
        assert self._fds is not None
        with self._send_lock:
            try:
                socket.send_fds(self._fds, [b"p"], [pool.fd])
            except OSError as e:
                raise self._died(f"sending it a staging pool ({e})") from None
        self._send(("pool", pool.generation, pool.nbytes, old))
        self._mapped[pool.ident] = pool.generation

    def submit(self, kind: str, *args: Any) -> int:
        """Send job ``kind``; returns its id, for :meth:`ready` and :meth:`result`."""
        self._next += 1
        self._send(("job", self._next, kind, args))
        return self._next

    def ready(self, job: int, index: int) -> None:
        """Tell the writer that the array of ready notice ``index`` holds its values."""
        self._send(("ready", job, index))

    def cancel(self, job: int, index: int, why: str) -> None:
        """Tell the writer that the array of ready notice ``index`` will never be
        ready (``why``): writing it fails with that message."""
        self._send(("cancel", job, index, why))

    def result(self, job: int) -> Any:
        """Wait for job ``job``'s reply: its result, or its exception raised here."""
        assert self._conn is not None
        while True:
            try:
                reply = messages.receive(self._conn)
            except (OSError, EOFError):
                raise self._died(f"running job {job}") from None
            if reply[1] == job:
                break
        if reply[0] == "done":
            return reply[2]
        error = reply[2]
        if isinstance(error, BaseException):
            raise error
        raise StorageError(f"the writer process failed: {error}")

    def call(self, kind: str, *args: Any) -> Any:
        """Run job ``kind`` and wait for its result."""
        with self.job_lock:
            self.ensure()
            return self.result(self.submit(kind, *args))

    def close(self) -> None:
        """Stop the writer (it finishes the job it is running first)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._fds is not None:
            self._fds.close()
            self._fds = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


_SHARED: Writer | None = None
_SHARED_LOCK = threading.Lock()


def shared_writer() -> Writer:
    """This process's writer (one for all its savers)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Writer()
        return _SHARED


# ----------------------------------------------------------------------- the writer's side


class _Notices:
    """The ready notices the trainer has sent, by job."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()
        self._cancelled: dict[tuple[int, int], str] = {}
        self._cond = threading.Condition()
        self.closed = False

    def add(self, job: int, index: int) -> None:
        with self._cond:
            self._seen.add((job, index))
            self._cond.notify_all()

    def cancel(self, job: int, index: int, why: str) -> None:
        with self._cond:
            self._cancelled[(job, index)] = why
            self._cond.notify_all()

    def forget(self, job: int) -> None:
        """Drop the notices of a job that has ended."""
        with self._cond:
            self._seen = {n for n in self._seen if n[0] != job}
            self._cancelled = {n: w for n, w in self._cancelled.items() if n[0] != job}

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def waiter(self, job: int) -> Callable[[int], Callable[[], None]]:
        def wait_for(index: int) -> Callable[[], None]:
            def wait() -> None:
                with self._cond:
                    while (job, index) not in self._seen:
                        if (job, index) in self._cancelled:
                            raise RuntimeError(self._cancelled.pop((job, index)))
                        if self.closed:
                            raise WriterDied("the trainer ended before the array was ready")
                        self._cond.wait()
            return wait
        return wait_for


def _run_job(kind: str, args: tuple[Any, ...], pools: dict[int, np.ndarray],
             wait: Callable[[int], Callable[[], None]]) -> Any:
    from globalshard.checkpoint import cleanup

    if kind == "write":
        from globalshard.checkpoint.bases import skip_unchanged

        store, io, described, trainer_state, requests = args
        items, outcomes = skip_unchanged(_rebuild(described, pools, wait), requests)
        stats = IOStats()
        # Unbuffered: this process's CPU time is the training's (io/localio/unbuffered.py).
        open_engine(store, io).write(items, stats, unbuffered=True)
        if trainer_state is not None:
            store.write(*trainer_state)
        return dataclasses.asdict(stats), outcomes
    if kind == "commit":
        store, text, stamp = args  # the metadata's text: the writer stores it as it is
        store.commit(METADATA_FILE, text.encode("utf-8"), stamp)
        return None
    if kind == "cleanup":
        store, previous, save_id = args
        cleanup.remove_superseded(store, previous, save_id)
        return None
    if kind == "remove":
        store, name = args
        cleanup.remove_quietly(store, name)
        return None
    raise ValueError(f"unknown job {kind!r}")


def main(argv: Sequence[str]) -> None:
    """The writer process: map pools, run jobs in order, until the trainer goes."""
    conn = socket.socket(fileno=int(argv[0]))
    fds = socket.socket(fileno=int(argv[1]))
    if len(argv) > 2 and int(argv[2]):
        os.nice(int(argv[2]))
    pools: dict[int, np.ndarray] = {}
    maps: dict[int, mmap.mmap] = {}
    notices = _Notices()
    jobs: queue.Queue[Any] = queue.Queue()

    def listen() -> None:
        try:
            receive()
        except BaseException:  # a message it cannot take: the trainer sees the writer end, never a hang
            traceback.print_exc()
            os._exit(70)

    def receive() -> None:
        while True:
            try:
                message = messages.receive(conn)
            except (OSError, EOFError):
                break
            if message[0] == "pool":
                _, generation, nbytes, old = message
                _, received, _, _ = socket.recv_fds(fds, 1, 1)
                maps[generation] = mmap.mmap(received[0], nbytes)
                os.close(received[0])
                pools[generation] = np.frombuffer(maps[generation], np.uint8)
                if old is not None:  # the trainer replaced it; its map goes when no view is left
                    pools.pop(old, None)
                    maps.pop(old, None)
            elif message[0] == "ready":
                notices.add(message[1], message[2])
            elif message[0] == "cancel":
                notices.cancel(message[1], message[2], message[3])
            else:
                jobs.put(message)
        notices.close()
        jobs.put(None)

    threading.Thread(target=listen, name="globalshard-writer-listen", daemon=True).start()
    while True:
        message = jobs.get()
        if message is None:
            break
        if message[0] == "setup":
            module, _, name = message[1].partition(":")
            getattr(importlib.import_module(module), name)(*message[2])
            continue
        _, job, kind, args = message
        try:
            reply: tuple[Any, ...] = ("done", job, _run_job(kind, args, pools, notices.waiter(job)))
        except BaseException as e:  # sent to the trainer, which raises it at wait()
            reply = ("error", job, e)
        notices.forget(job)
        try:
            try:
                messages.send(conn, reply)
            except TypeError as e:  # a result no message carries (nothing was sent): reported, never a hang
                why = StorageError(f"the writer's reply to job {job} cannot be sent: {e}")
                messages.send(conn, ("error", job, why))
        except (OSError, EOFError):
            break
