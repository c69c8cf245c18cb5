"""Removing keys from a committed checkpoint in place (spec section 2.5): a
new ``metadata.json`` of the same save without them, committed as a save
commits, then the arrays only they used deleted. What Megatron-Core's
``dist_checkpointing.remove_sharded_tensors`` asks of a strategy."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from globalshard.checkpoint import cleanup
from globalshard.checkpoint.commit import remember_commit
from globalshard.checkpoint.copying import without_keys
from globalshard.checkpoint.loading import read_metadata
from globalshard.errors import ConcurrentSaveError, StorageError
from globalshard.format.metadata import Metadata, StoredRegion, parse_metadata
from globalshard.format.paths import METADATA_FILE
from globalshard.store import open_root

__all__ = ["remove_keys"]


def remove_keys(path: Any, keys: Iterable[str], *, kvstore: Any = None) -> Metadata:
    """Remove ``keys`` (keys or ``fnmatch`` patterns) from the checkpoint at
    ``path`` in place, as one commit: readers see it with them or without
    them, never in between. The arrays only they used are deleted after the
    commit; nothing is written but ``metadata.json``. One process, while no
    save to ``path`` runs (on a filesystem its lock is held). A checkpoint
    that references a removed key in this one as its base then fails to
    load, naming it. Returns the new metadata.

    Raises:
        CheckpointNotFoundError: ``path`` holds no checkpoint.
        LayoutError: a pattern matches no key, or a key shares a pack with a
            kept one; nothing changes then.
        StorageError: a version 1 checkpoint (``globalshard copy`` makes a
            version 2 one); ConcurrentSaveError: a save committed meanwhile.
    """
    store = open_root(path, kvstore)
    if store.read(METADATA_FILE) is None:  # checked before the lock, which would make the directory
        read_metadata(path, kvstore=kvstore)  # raises, saying what the path holds, as a load does
    cleanup.wait_for_cleanup()  # a save's background deletion holds the lock until it is done
    with store.lock():
        data, stamp = store.read_stamped(METADATA_FILE)
        if data is None:
            raise ConcurrentSaveError(f"{store.describe(METADATA_FILE)} disappeared while keys were being removed")
        found = parse_metadata(data, source=store.describe(METADATA_FILE))
        if found.save_id is None:
            raise StorageError(f"{store} is a version 1 checkpoint, which cannot be edited in place; "
                               "`globalshard copy` it (a version 2 copy) and remove the keys from the copy")
        kept = _used_bases_only(without_keys(found, keys, "remove", "cannot remove these keys"))
        text = kept.dumps().encode("utf-8")
        store.commit(METADATA_FILE, text, stamp)
        remember_commit(store, text, kept)
        gone = sorted(set(found.paths()) - set(kept.paths()))
        for name in gone:
            cleanup.remove_quietly(store, name)
        store.delete_empty_parents(gone)
    return kept


def _used_bases_only(metadata: Metadata) -> Metadata:
    """``metadata`` with the bases its regions still use, renumbered in their order."""
    used = sorted({r.base for t in metadata.tensors.values() for r in t.regions if r.base is not None})
    if len(used) == len(metadata.bases):
        return metadata
    number = {old: new for new, old in enumerate(used)}

    def renumbered(r: StoredRegion) -> StoredRegion:
        return r if r.base is None else dataclasses.replace(r, base=number[r.base])

    tensors = {k: dataclasses.replace(t, regions=tuple(map(renumbered, t.regions)))
               for k, t in metadata.tensors.items()}
    return dataclasses.replace(metadata, tensors=tensors, bases=tuple(metadata.bases[b] for b in used))
