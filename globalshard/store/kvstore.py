"""A checkpoint root in any TensorStore kvstore: object stores, memory,
OCDBT. Commits are conditional writes; there is no lock."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from globalshard.errors import ConcurrentSaveError, GlobalShardError, StorageError
from globalshard.format.metadata import MAX_FILE_BYTES
from globalshard.store.base import PIECE_BYTES, Sink, Stamp, Store, context, error_text, ts

__all__ = ["KvStore"]


class KvStore:
    """A checkpoint root that is a TensorStore kvstore ``spec`` (a JSON dict
    whose ``path``, if any, ends with ``/``)."""

    locks = False
    lists_cheaply = False

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._kv: Any = None
        self.process_shared = not _in_memory(spec)

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec}  # the open kvstore belongs to this process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"])  # type: ignore[misc]

    def __str__(self) -> str:
        return ts.KvStore.Spec(self.spec).to_json().get("path", "") or str(self.spec)

    def __repr__(self) -> str:
        return f"KvStore({self.spec!r})"

    def files(self, prefix: str) -> list[str]:
        start = prefix.rstrip("/") + "/"
        try:
            keys = self._kvs().list(ts.KvStore.KeyRange(start, start[:-1] + "0")).result()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot list {self.describe(prefix)}: {error_text(e)}") from None
        return sorted(k.decode("utf-8", "replace") for k in keys)

    def read_whole(self, name: str) -> bytes | None:
        try:
            r = self._kvs().read(name).result()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot read {self.describe(name)}: {error_text(e)}") from None
        return None if r.state == "missing" else bytes(r.value)

    def size(self, name: str) -> int | None:
        data = self.read_whole(name)  # a kvstore has no size without the value
        return None if data is None else len(data)

    def read_pieces(self, name: str, piece: int = PIECE_BYTES) -> Iterator[bytes] | None:
        # TODO(limitation): a kvstore's object is read whole (TensorStore reads values whole).
        data = self.read_whole(name)
        if data is None:
            return None
        return (data[k:k + piece] for k in range(0, max(len(data), 1), piece))

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[Sink]:
        """The pieces written are gathered, then written as one object (atomic)."""
        # TODO(limitation): a kvstore's object is written whole: its bytes are held in memory.
        sink = _Gathered()
        yield sink
        self.write(name, sink.data)

    def _parent(self) -> str:
        path = self.spec.get("path", "")
        if not path.strip("/"):
            raise StorageError(f"{self} is at the top of its kvstore: it has no sibling roots to hold a base")
        return path.rstrip("/").rpartition("/")[0]

    def sibling(self, name: str) -> KvStore:
        parent = self._parent()
        return KvStore({**self.spec, "path": f"{parent}/{name}/" if parent else f"{name}/"})

    def sibling_name(self, other: Store) -> str | None:
        if not isinstance(other, KvStore) or other.spec == self.spec or not self.spec.get("path", "").strip("/"):
            return None
        if {k: v for k, v in other.spec.items() if k != "path"} != {k: v for k, v in self.spec.items()
                                                                     if k != "path"}:
            return None
        parent, _, name = other.spec.get("path", "").rstrip("/").rpartition("/")
        return name if name and parent == self._parent() else None

    def describe(self, name: str) -> str:
        return f"{name} in {self.spec}"

    def kvstore(self, path: str = "") -> dict[str, Any]:
        spec = dict(self.spec)
        spec["path"] = spec.get("path", "") + (path + "/" if path else "")
        return spec

    def child(self, path: str = "") -> dict[str, Any]:
        return self.kvstore(path)

    def _kvs(self) -> Any:
        if self._kv is None:
            try:
                self._kv = ts.KvStore.open(self.spec, context=context()).result()
            except Exception as e:
                raise StorageError(f"cannot open {self.spec}: {error_text(e)}") from None
        return self._kv

    def read(self, name: str) -> bytes | None:
        return self.read_stamped(name)[0]

    def read_stamped(self, name: str) -> tuple[bytes | None, Stamp]:
        """The bytes (bounded by ``MAX_FILE_BYTES``) and the storage generation."""
        try:
            r = self._kvs().read(name).result()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot read {self.describe(name)}: {error_text(e)}") from None
        if r.state == "missing":
            return None, r.stamp.generation
        if len(r.value) > MAX_FILE_BYTES:
            raise StorageError(f"{self.describe(name)} holds {len(r.value)} bytes, more than the "
                               f"{MAX_FILE_BYTES} this library reads")
        return bytes(r.value), r.stamp.generation

    def write(self, name: str, data: bytes | bytearray) -> None:
        """One write, which TensorStore's kvstores apply atomically."""
        try:
            self._kvs().write(name, data).result()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot write {self.describe(name)}: {error_text(e)}") from None

    def commit(self, name: str, data: bytes, stamp: Stamp) -> None:
        """One conditional write (``if_equal=stamp``).

        Raises:
            ConcurrentSaveError: another save replaced ``name`` in between.
            StorageError: the write failed (nothing was replaced).
        """
        try:
            gen = self._kvs().write(name, data, if_equal=stamp).result()
        except (OSError, ValueError) as e:
            if isinstance(e, GlobalShardError):
                raise
            raise StorageError(f"cannot write {self.describe(name)}: {error_text(e)}") from None
        if not gen.generation:
            raise ConcurrentSaveError(
                f"{self.describe(name)} changed while this save was running: another save committed to "
                f"{self} first; this save is not committed and the other's checkpoint stands")

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        yield  # the commit is conditional instead

    def delete(self, name: str, *, tree: bool = False) -> None:
        end = name + ("0" if tree else "\x00")
        start = name + "/" if tree else name
        try:
            self._kvs().delete_range(ts.KvStore.KeyRange(start, end)).result()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot remove {self.describe(name)}: {error_text(e)}") from None

    def delete_empty_parents(self, paths: Sequence[str]) -> None:
        return None  # a kvstore has no directories

    def list_dir(self, prefix: str = "") -> list[str]:
        start = prefix + "/" if prefix else ""
        rng = ts.KvStore.KeyRange(start, prefix + "0" if prefix else "")
        try:
            keys = self._kvs().list(rng, strip_prefix_length=len(start)).result()
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot list {self.describe(prefix)}: {error_text(e)}") from None
        return sorted({k.decode("utf-8", "replace").split("/")[0] for k in keys})

    def linked_component(self, name: str) -> str | None:
        return None

    def escaping(self, paths: Sequence[str]) -> list[str]:
        return []


class _Gathered:
    """:meth:`KvStore.open_write`'s bytes, until the object is written: one
    buffer, grown in place (no second copy of the object to join pieces)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | memoryview, /) -> None:
        self.data += data


def _in_memory(spec: Any) -> bool:
    """Whether a kvstore spec keeps its data in this process's memory, at any depth."""
    if isinstance(spec, str):
        return spec.startswith("memory://")
    if isinstance(spec, dict):
        return spec.get("driver") == "memory" or any(_in_memory(v) for v in spec.values())
    if isinstance(spec, list):
        return any(_in_memory(v) for v in spec)
    return False
