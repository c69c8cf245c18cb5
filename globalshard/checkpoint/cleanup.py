"""Deleting what a commit made obsolete: the replaced checkpoint's arrays,
leftovers of saves that died (spec sections 2.1 and 2.2), large deletions
in a background thread."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from globalshard.errors import GlobalShardError
from globalshard.format.metadata import Metadata
from globalshard.format.paths import METADATA_FILE, SAVES_DIR, TRAINER_STATE_FILE, is_save_id, is_temporary
from globalshard.store import Store

__all__ = ["BACKGROUND_DELETE_BYTES", "delete_in_background", "remove_quietly", "remove_superseded", "wait_for_cleanup"]

_log = logging.getLogger("globalshard")

#: An unlisted save directory on a root without a lock older than this is a leftover (spec 2.2).
_LEFTOVER_AGE_MS = 24 * 3600 * 1000

#: A replaced checkpoint storing at least this many bytes is deleted by a
#: background thread of rank 0 once the new one is committed, so that save
#: returns without waiting for it. The thread holds the root's lock until it is done.
BACKGROUND_DELETE_BYTES = 64 << 20

_deleting: list[threading.Thread] = []  # this process's background deletions still running
_deleting_lock = threading.Lock()


def wait_for_cleanup() -> None:
    """Wait until this process has finished deleting the checkpoints its saves replaced.

    A save that replaces a checkpoint of :data:`BACKGROUND_DELETE_BYTES` or
    more returns once the new one is committed and deletes the old one in a
    background thread of rank 0, holding the root's lock meanwhile. The next
    save of this process waits for it first, and so does the interpreter at
    exit; call this to wait earlier (before copying or removing the
    directory, say)."""
    while True:
        with _deleting_lock:
            if not _deleting:
                return
            thread = _deleting[0]
        thread.join()
        with _deleting_lock:
            if thread in _deleting:
                _deleting.remove(thread)


def delete_in_background(what: str, delete: Callable[[], None], *,
                         holding: contextlib.ExitStack | None = None) -> None:
    """Run ``delete`` in a thread that :func:`wait_for_cleanup` (so the next
    save) waits for, then close ``holding`` (a lock it keeps meanwhile). Not a
    daemon: the interpreter waits for it at exit. A failure is logged, naming
    ``what``: what it deletes is no longer part of any checkpoint."""

    def run() -> None:
        with holding if holding is not None else contextlib.nullcontext():
            try:
                delete()
            except BaseException:  # nothing committed depends on it: say so, raise nowhere
                _log.exception("deleting %s failed", what)

    thread = threading.Thread(target=run, name="globalshard-delete")
    with _deleting_lock:
        _deleting.append(thread)
    thread.start()


def remove_quietly(store: Store, name: str, *, tree: bool = True) -> None:
    try:
        store.delete(name, tree=tree)
    except GlobalShardError as e:
        _log.warning("could not remove %s: %s", store.describe(name), e)


def remove_superseded(store: Store, previous: Metadata | None, save_id: str) -> None:
    """After a commit: delete what the replaced checkpoint listed, then (under
    the lock, or when old enough) leftovers of saves that died (spec 2.1, 2.2).
    Failures are logged, not raised: the new checkpoint is committed."""
    if previous is not None:
        for path in previous.paths():
            is_array = previous.trainer_state is None or path != previous.trainer_state.path
            remove_quietly(store, path, tree=is_array)
        if previous.version == 1:
            remove_quietly(store, TRAINER_STATE_FILE, tree=False)
            store.delete_empty_parents([p for p in previous.paths() if p != TRAINER_STATE_FILE])
    now_ms = int(time.time() * 1000)
    try:
        for name in store.list_dir(SAVES_DIR):
            if name == save_id or not is_save_id(name):
                continue
            # TODO(limitation): on a kvstore nothing tells a dead save from a running one,
            # so an unlisted save directory is swept only once it is a day old.
            if store.locks or now_ms - int(name[:12], 16) > _LEFTOVER_AGE_MS:
                remove_quietly(store, f"{SAVES_DIR}/{name}")
        if store.locks:
            for name in store.list_dir():
                if is_temporary(name, METADATA_FILE):
                    remove_quietly(store, name, tree=False)
    except GlobalShardError as e:
        _log.warning("could not look for leftovers of earlier saves in %s: %s", store, e)
