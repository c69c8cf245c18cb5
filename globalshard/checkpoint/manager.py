"""``iter_0000100``-style checkpoints under one root, on any store: a
pointer to the last one saved, recovery of the newest complete one, and
retention."""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from globalshard.checkpoint import cleanup
from globalshard.checkpoint.loading import load, read_metadata
from globalshard.checkpoint.saving import save
from globalshard.comm import Comm
from globalshard.errors import GlobalShardError
from globalshard.format.metadata import Metadata
from globalshard.format.paths import METADATA_FILE, is_temporary
from globalshard.layout import ShardedTensor
from globalshard.store import Store, open_root

if TYPE_CHECKING:
    from globalshard.checkpoint.async_save import AsyncSaver

__all__ = ["POINTER_FILE", "CheckpointManager"]

_log = logging.getLogger("globalshard")
#: The pointer at the root: ``{"step": 100, "path": "iter_0000100"}``, replaced after each commit.
POINTER_FILE = "latest"


class CheckpointManager:
    """``iter_0000100``-style checkpoints under one root: a local directory or
    any kvstore (``root`` and ``kvstore`` as for :func:`~globalshard.save`).

    ``latest`` (a small JSON file, replaced atomically after each commit)
    names the checkpoint saved last, whatever its step (a run that rewinds to
    an earlier step resumes from there). :meth:`latest` trusts it when it
    names a complete checkpoint and none was committed after it; otherwise (a
    crash between a commit and the pointer, a missing or stale pointer) it
    takes the complete checkpoint saved last (by its save id, which starts
    with the time the save began). ``keep_last`` keeps the checkpoint just
    saved and the ``keep_last - 1`` complete ones with the highest steps
    among the others, and every base those reference (a save with
    ``base=``, spec section 5.2); a save never deletes what it has just written.

    With ``saver=`` (an :class:`~globalshard.AsyncSaver`), :meth:`save`
    returns once the state is in the saver's host memory; the pointer moves
    and pruning runs only once that save has committed, at the manager's
    next :meth:`save`, :meth:`wait` or :meth:`load_latest`. A save that
    failed moves and prunes nothing (the checkpoints before it stay), and
    they raise its error, unless the saver's own ``wait()`` raised it first.
    Call :meth:`wait` before the process exits.

    >>> import numpy as np, tempfile
    >>> from globalshard import ShardedTensor
    >>> w = np.ones(4, np.float32)
    >>> d = tempfile.mkdtemp()
    >>> manager = CheckpointManager(d, keep_last=2)
    >>> for step in (100, 200, 300):
    ...     state = {"w": ShardedTensor.from_offset("w", w * step, global_shape=(4,), global_offset=(0,))}
    ...     _ = manager.save(step, state)
    >>> [step for step, _ in manager.complete()]
    [200, 300]
    >>> manager.latest()[0]
    300
    >>> manager.wait(); import shutil; shutil.rmtree(d)
    """

    def __init__(self, root: Any, *, keep_last: int | None = None, comm: Comm | None = None,
                 kvstore: Any = None) -> None:
        self.store: Store = open_root(root, kvstore)
        #: The root as given to :func:`~globalshard.save` (a directory, or a kvstore spec).
        self.root: Any = self.store.child()
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        self.keep_last = keep_last
        self._comm = comm
        #: The asynchronous save in flight, published by wait(): (step, its saver).
        self._pending: tuple[int, AsyncSaver] | None = None

    #: The name of a step's checkpoint under the root, and the pattern that finds them (its group: the step).
    #: A subclass may name them as its trainer does (torchtitan's ``step-<n>``).
    STEP_NAME = "iter_{step:07d}"
    STEP_PATTERN = re.compile(r"iter_(\d{7,})")

    def step_name(self, step: int) -> str:
        """The name of step ``step``'s checkpoint under the root."""
        return self.STEP_NAME.format(step=step)

    def comm(self) -> Comm | None:
        """The communicator of the job (None: one process)."""
        return self._comm

    def path(self, step: int) -> Any:
        """Where step ``step`` is saved: a directory, or a kvstore spec."""
        return self._path(self.step_name(step))

    def _path(self, name: str) -> Any:
        return self.store.child(name)

    def _rank(self) -> int:
        comm = self.comm()
        return comm.rank if comm is not None else 0

    def save(self, step: int, state: Mapping[str, ShardedTensor], *, saver: AsyncSaver | None = None,
             **kwargs: Any) -> Any:
        """:func:`~globalshard.save` ``state`` as step ``step`` (``trainer_state``
        gains ``"step"``), then move the pointer and prune; with ``saver``, in
        the background (see the class). Returns its path."""
        trainer_state = dict(kwargs.pop("trainer_state", None) or {})
        trainer_state.setdefault("step", step)
        if saver is not None:
            return self.save_with(step, lambda path: saver.save(state, path, trainer_state=trainer_state,
                                                                comm=self.comm(), **kwargs), saver=saver)
        return self.save_with(step, lambda path: save(state, path, trainer_state=trainer_state, comm=self.comm(),
                                                      **kwargs))

    def save_with(self, step: int, save: Callable[[Any], Any], *, saver: AsyncSaver | None = None) -> Any:
        """Run ``save(path)`` (any function that saves a checkpoint there on
        every rank), then move the pointer and prune. Returns the path.

        ``saver``: the :class:`~globalshard.AsyncSaver` that ``save`` starts an
        asynchronous save on; the pointer moves and pruning runs once it has
        committed (see the class). Collective, as the save is."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        self.wait()
        path = self.path(step)
        save(path)
        if saver is not None:
            self._pending = (step, saver)
        else:
            self._publish(step)
        return path

    def wait(self) -> None:
        """Wait for the asynchronous save in flight (if any), then move the
        pointer to it and prune; raise its error if it failed, and then move
        and prune nothing. Collective, as :meth:`save` is."""
        if self._pending is None:
            return
        (step, saver), self._pending = self._pending, None
        saver.wait()
        self._publish(step, committed_only=True)

    def _publish(self, step: int, *, committed_only: bool = False) -> None:
        # committed_only: the saver's error may have been raised by its own wait() already.
        if self._rank() == 0 and (not committed_only or self._committed(step)):
            self._write_pointer(step)
            self._prune(keep=self.step_name(step))
            self._remove_leftovers()
        comm = self.comm()
        if comm is not None:
            comm.barrier()

    def _committed(self, step: int) -> bool:
        try:
            read_metadata(self.path(step))
        except GlobalShardError as e:
            _log.warning("step %d did not commit (%s): the pointer stays, nothing is pruned", step, e)
            return False
        return True

    def _write_pointer(self, step: int) -> None:
        # Whole or not at all (locally: a temporary file, fsync, rename, fsync of the directory).
        self.store.write(POINTER_FILE, json.dumps({"step": step, "path": self.step_name(step)}).encode("utf-8"))

    def _complete(self) -> list[tuple[int, str, Metadata]]:
        out = []
        for name in self.store.list_dir():
            m = self.STEP_PATTERN.fullmatch(name)
            if m:
                try:
                    out.append((int(m.group(1)), name, read_metadata(self._path(name))))
                except GlobalShardError:
                    continue  # not committed, or damaged: not complete
        return sorted(out, key=lambda c: c[0])

    def complete(self) -> list[tuple[int, Any]]:
        """(step, path) of every complete checkpoint, lowest step first."""
        return [(step, self._path(name)) for step, name, _ in self._complete()]

    def latest(self) -> tuple[int, Any] | None:
        """(step, path) of the checkpoint saved last, or None."""
        done = self._complete()
        if not done:
            return None
        newest = max(done, key=lambda c: (_began_ms(c[2]), c[0]))
        try:
            pointer = json.loads(self.store.read(POINTER_FILE) or b"null")
            named = next(c for c in done if c[1] == pointer["path"] and c[0] == int(pointer["step"]))
            # TODO(limitation): saves are ordered by the millisecond they began (their save
            # ids); a commit the pointer does not name, begun in the pointer's millisecond, loses.
            if _began_ms(named[2]) >= _began_ms(newest[2]):
                return named[0], self._path(named[1])
        except (ValueError, KeyError, TypeError, StopIteration, GlobalShardError):
            pass
        return newest[0], self._path(newest[1])

    def load_latest(self, state: Mapping[str, ShardedTensor], **kwargs: Any) -> dict[str, Any] | None:
        """:func:`~globalshard.load` ``state`` from :meth:`latest`: its trainer
        state, or None when there is no checkpoint. An asynchronous save in
        flight is waited for first (:meth:`wait`)."""
        self.wait()
        found = self.latest()
        if found is None:
            return None
        return load(state, found[1], comm=self.comm(), **kwargs)

    def _prune(self, keep: str) -> None:
        if self.keep_last is None:
            return
        done = self._complete()
        others = [c for c in sorted(done, key=lambda c: c[0], reverse=True) if c[1] != keep]
        kept = {keep, *(name for _, name, _ in others[:self.keep_last - 1])}
        # A base of a kept checkpoint is kept (spec section 2.3), and so are its own bases.
        bases = {name: [b.root for b in metadata.bases] for _, name, metadata in done}
        pending = [root for name in kept for root in bases.get(name, [])]
        while pending:
            root = pending.pop()
            if root not in kept:
                kept.add(root)
                pending += bases.get(root, [])
        for _, name, metadata in others:
            if name in kept:
                continue
            # Un-publish before deleting: a crash mid-delete leaves no half checkpoint.
            try:
                self.store.delete(f"{name}/{METADATA_FILE}")
            except GlobalShardError as e:
                _log.warning("could not remove %s: %s", self.store.describe(name), e)
                continue
            what = self._path(name)
            if metadata.stored_bytes() >= cleanup.BACKGROUND_DELETE_BYTES:  # as a save deletes what it replaced
                cleanup.delete_in_background(str(what), functools.partial(self.store.delete, name, tree=True))
            else:
                cleanup.remove_quietly(self.store, name)

    def _remove_leftovers(self) -> None:
        # Pointer files of managers killed between writing and renaming them.
        if self.store.locks:
            for name in self.store.list_dir():
                if is_temporary(name, POINTER_FILE):
                    cleanup.remove_quietly(self.store, name, tree=False)


def _began_ms(metadata: Metadata) -> int:
    """When the save began, from its save id (0 for version 1, which has none)."""
    return int(metadata.save_id[:12], 16) if metadata.save_id else 0
