"""Where a checkpoint's bytes live: :func:`open_root` turns what a caller
names (a directory, a kvstore URL or spec) into a :class:`Store`."""

from __future__ import annotations

import os
from typing import Any

from globalshard.errors import StorageError
from globalshard.format.metadata import check_relative_path
from globalshard.store.base import Stamp, Store, error_text, ts
from globalshard.store.kvstore import KvStore
from globalshard.store.local import LocalStore

__all__ = ["KvStore", "LocalStore", "Stamp", "Store", "from_portable", "open_root", "portable"]


def open_root(where: Any, kvstore: Any = None) -> Store:
    """The store of a checkpoint root.

    Args:
        where: a filesystem path; a kvstore URL (``"memory://"``,
            ``"gs://bucket/run/"``, ``"file:///abs/dir/"``); a kvstore spec
            dict (``{"driver": "ocdbt", "base": "file:///abs/dir/"}``); or a
            :class:`Store`, returned as it is.
        kvstore: a kvstore spec or URL to resolve ``where`` in: the root is
            then ``where``, a relative path, inside that kvstore.

    A ``file`` kvstore is a :class:`LocalStore` whatever options its spec
    carries: its small files, checks and lock go through the filesystem.

    Raises:
        StorageError: ``where`` names no root.
    """
    if isinstance(where, Store) and kvstore is None:
        return where
    if isinstance(where, (str, os.PathLike)) and not os.fspath(where):
        raise StorageError("the checkpoint path is empty (use '.' for the current directory)")
    if kvstore is not None:
        base = open_root(kvstore)
        relative = os.fspath(where).strip("/") if isinstance(where, (str, os.PathLike)) else None
        if not relative or check_relative_path(relative) is not None:
            raise StorageError(f"with kvstore=, the path must be relative inside it, got {where!r}")
        where = base.kvstore(relative)
    if isinstance(where, os.PathLike) or (isinstance(where, str) and "://" not in where):
        return LocalStore(where)
    try:
        spec = ts.KvStore.Spec(where).to_json() if isinstance(where, str) else dict(where)
        ts.KvStore.Spec(spec)
    except Exception as e:
        raise StorageError(f"not a checkpoint location: {where!r}: {error_text(e)}") from None
    # TODO(limitation): OCDBT written by several processes needs TensorStore's
    # coordinator configured by the caller in the spec; it is not set up here.
    path = spec.get("path", "")
    if path and not path.endswith("/"):
        spec["path"] = path + "/"
    if spec.get("driver") == "file":
        return LocalStore(os.path.abspath(spec.get("path", "") or "."), spec)
    return KvStore(spec)


def portable(store: Store) -> dict[str, Any] | None:
    """``store`` as JSON that :func:`from_portable` opens in another process
    (a writer process), or None: its root is not reachable from there (an
    in-memory kvstore), or it is a kind of store this package does not know."""
    if not store.process_shared:
        return None
    if type(store) is LocalStore:  # not a subclass: the other process would open the class, not the subclass
        return {"local": store.path, "spec": store.spec}
    if type(store) is KvStore:
        return {"kvstore": store.spec}
    return None


def from_portable(doc: Any) -> Store:
    """The store :func:`portable` described.

    Raises:
        StorageError: ``doc`` describes no store.
    """
    if isinstance(doc, dict) and isinstance(doc.get("local"), str) and isinstance(doc.get("spec"), dict):
        return LocalStore(doc["local"], doc["spec"])
    if isinstance(doc, dict) and isinstance(doc.get("kvstore"), dict):
        return KvStore(doc["kvstore"])
    raise StorageError(f"not a store's description: {doc!r}")
