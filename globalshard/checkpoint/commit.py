"""What a save replaces, and what the last commit of this process was:
rank 0's part of the commit protocol (spec section 2.1) around the store's
conditional commit."""

from __future__ import annotations

import threading
from typing import Any

from globalshard.errors import CheckpointExistsError, MetadataError
from globalshard.format.metadata import Metadata, parse_metadata
from globalshard.format.paths import METADATA_FILE, is_ours
from globalshard.store import Store

__all__ = ["remember_commit", "what_is_there"]


#: The metadata.json this process last committed at each root (its bytes and
#: model): a save that finds those same bytes there replaces that checkpoint,
#: and need not parse it again in the part of rank 0's save that the caller
#: waits for. Two entries at most.
_COMMITTED: dict[str, tuple[bytes, Metadata]] = {}
_COMMITTED_LOCK = threading.Lock()


def remember_commit(store: Store, data: bytes, metadata: Metadata) -> None:
    """Note that this process committed ``data`` (parsed: ``metadata``) at ``store``."""
    with _COMMITTED_LOCK:
        _COMMITTED.pop(repr(store), None)
        _COMMITTED[repr(store)] = (data, metadata)
        while len(_COMMITTED) > 2:
            del _COMMITTED[next(iter(_COMMITTED))]


def _parsed(store: Store, data: bytes) -> Metadata:
    with _COMMITTED_LOCK:
        known = _COMMITTED.get(repr(store))
    if known is not None and known[0] == data:  # the same bytes parse to the same model
        return known[1]
    return parse_metadata(data, source=store.describe(METADATA_FILE))


def what_is_there(store: Store, overwrite: bool) -> tuple[Metadata | None, Any]:
    """The checkpoint a save would replace (and the stamp its commit checks),
    refusing what the caller did not ask to replace."""
    data, stamp = store.read_stamped(METADATA_FILE)
    if data is None:
        foreign = [n for n in store.list_dir() if not is_ours(n)]
        if foreign and not overwrite:
            raise CheckpointExistsError(
                f"{store} is not empty and holds no checkpoint ({', '.join(map(repr, foreign[:5]))}"
                f"{', ...' if len(foreign) > 5 else ''}); pass overwrite=True to save into it anyway "
                "(nothing already there is deleted)"
            )
        return None, stamp
    try:
        previous = _parsed(store, data)
    except MetadataError as e:
        raise CheckpointExistsError(
            f"{store.describe(METADATA_FILE)} exists but is not a valid globalshard checkpoint, so a save "
            f"cannot tell what it may delete; remove it by hand if it is not needed ({e})"
        ) from None
    if not overwrite:
        raise CheckpointExistsError(f"{store} already holds a checkpoint; pass overwrite=True to replace it")
    return previous, stamp
