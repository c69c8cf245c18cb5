"""The bytes under one checkpoint root (spec sections 2, 2.1 and 2.2).

:class:`Store` is the seam between the format and where its bytes live: a
local directory (:class:`~globalshard.store.local.LocalStore`) or any
TensorStore kvstore (:class:`~globalshard.store.kvstore.KvStore`). Everything
above it (saving, loading, the manager) is written once against it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

__all__ = ["PIECE_BYTES", "Sink", "Stamp", "Store", "context", "copy_file", "error_text", "ts"]


class _OnFirstUse:
    """The ``tensorstore`` module, imported when one of its names is first
    used: a process that only reads and writes local files (an asynchronous
    save's writer process, a local save or load) never loads it, which
    keeps 7.5 MiB of anonymous memory and a tenth of a second of import out
    of it."""

    def __getattr__(self, name: str) -> Any:
        import tensorstore

        return getattr(tensorstore, name)


if TYPE_CHECKING:
    import tensorstore as ts
else:
    ts = _OnFirstUse()

#: Identifies one version of a file for :meth:`Store.commit`: a storage
#: generation, or the bytes themselves on a filesystem.
Stamp = Any


@functools.cache
def context() -> ts.Context:
    """One TensorStore context for the process (made on first use): the
    memory kvstore persists across calls, and the chunk cache is off (every
    byte is read once, straight into its target)."""
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}})


#: The bytes of a piece a copy holds at a time (:meth:`Store.read_pieces`).
PIECE_BYTES = 16 << 20


class Sink(Protocol):
    """Where :meth:`Store.open_write` takes a file's bytes, in order."""

    def write(self, data: bytes | memoryview, /) -> None:
        """Append ``data`` (a failure is a :class:`~globalshard.errors.StorageError` naming the file)."""
        ...


@runtime_checkable
class Store(Protocol):
    """The small files and the namespace under one checkpoint root.

    Every method names files by their path relative to the root (``/``
    separated). Errors are :class:`~globalshard.errors.StorageError` naming the
    file; a commit that lost a race is a
    :class:`~globalshard.errors.ConcurrentSaveError`.
    """

    #: Whether writers exclude each other with :meth:`lock` (a filesystem):
    #: a save directory no commit lists is then a leftover whatever its age,
    #: and temporary files of atomic replacement can be left by a crash.
    locks: bool
    #: Whether another process of this host reaches the same root (not an
    #: in-memory kvstore): an asynchronous save's writer process then writes
    #: it, opening it from :func:`globalshard.store.portable`'s description.
    process_shared: bool
    #: Whether :meth:`list_dir` of the root is cheap (a directory), not a
    #: listing of every key under a prefix (a bucket): errors list it for hints.
    lists_cheaply: bool

    def files(self, prefix: str) -> list[str]:
        """Every file below ``prefix`` (names relative to the root, sorted); none
        through a symbolic link."""
        ...

    def read_whole(self, name: str) -> bytes | None:
        """A file's bytes, or None if there is none, with no bound on its size
        (a stored array's shard, copied between tiers)."""
        ...

    def size(self, name: str) -> int | None:
        """A file's size in bytes, or None if there is none (a kvstore reads
        the object to tell)."""
        ...

    def read_pieces(self, name: str, piece: int = PIECE_BYTES) -> Iterator[bytes] | None:
        """A file's bytes in order, exactly ``piece`` bytes at a time (the
        last piece shorter, an empty file one empty piece), or None if there
        is none: a copy holds a piece at a time, not the file (a kvstore reads
        the object whole first). Reads never follow a final symbolic link.

        Raises (while iterating):
            StorageError: naming the file, when a read fails.
        """
        ...

    def open_write(self, name: str) -> AbstractContextManager[Sink]:
        """A file written piece by piece through the :class:`Sink` this gives:
        it appears whole when the block ends, or not at all if the block
        raises (a kvstore writes the object once, at the end).

        Raises:
            StorageError: naming the file, when a write fails.
        """
        ...

    def sibling(self, name: str) -> Store:
        """The store of the root ``name`` beside this one (a base, spec section 5.2).

        Raises:
            StorageError: this root has no parent to hold siblings.
        """
        ...

    def sibling_name(self, other: Store) -> str | None:
        """``other``'s name if it is a root beside this one (not this one), else None."""
        ...

    def describe(self, name: str) -> str:
        """``name`` as a message shows it (a full path where there is one)."""
        ...

    def read(self, name: str) -> bytes | None:
        """The bytes of a regular file, or None if there is none (bounded by
        :data:`~globalshard.format.metadata.MAX_FILE_BYTES`)."""
        ...

    def read_stamped(self, name: str) -> tuple[bytes | None, Stamp]:
        """:meth:`read`, with the :data:`Stamp` a later :meth:`commit` checks."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Write a file: it appears whole or not at all."""
        ...

    def commit(self, name: str, data: bytes, stamp: Stamp) -> None:
        """Replace ``name`` with ``data`` only if it is still the version
        ``stamp`` names: the commit of a save (spec section 2.2)."""
        ...

    def lock(self) -> AbstractContextManager[None]:
        """Hold the writers' lock of the root for a save (nothing where
        commits are conditional instead)."""
        ...

    def delete(self, name: str, *, tree: bool = False) -> None:
        """Delete a file (or, with ``tree``, everything under a prefix), if present."""
        ...

    def delete_empty_parents(self, paths: Sequence[str]) -> None:
        """Delete the directories above ``paths`` that are now empty, never the root."""
        ...

    def list_dir(self, prefix: str = "") -> list[str]:
        """Names directly below the root (or below ``prefix/``), sorted."""
        ...

    def linked_component(self, name: str) -> str | None:
        """The first component of ``name`` that is a symbolic link, or None."""
        ...

    def escaping(self, paths: Sequence[str]) -> list[str]:
        """Problems of stored paths that leave the root or are not regular files."""
        ...

    def kvstore(self, path: str = "") -> dict[str, Any]:
        """The TensorStore kvstore spec of ``path`` below the root (a directory)."""
        ...

    def child(self, path: str = "") -> Any:
        """``path`` below the root as a caller names a root (a directory, or a
        kvstore spec): what ``open_root`` and ``globalshard.save`` accept."""
        ...


def error_text(e: BaseException) -> str:
    """An exception's message without the spec TensorStore appends to it."""
    text = str(e)
    cut = text.find(" [tensorstore_spec=")
    return text[:cut] if cut > 0 else text


def copy_file(source: Store, name: str, target: Store, to: str | None = None) -> bool:
    """Copy the file ``name`` of ``source`` to ``to`` (by default the same
    name) in ``target``, a piece at a time: it appears there whole or not at
    all. False if ``source`` holds no such file (nothing is written).

    Raises:
        StorageError: naming the file whose read or write failed.
    """
    pieces = source.read_pieces(name)
    if pieces is None:
        return False
    with target.open_write(name if to is None else to) as out:
        for piece in pieces:
            out.write(piece)
    return True
