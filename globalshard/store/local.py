"""A checkpoint root in a local directory: flock, temporary file + fsync +
rename, no reads or deletes through symbolic links, containment checks."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from globalshard.errors import ConcurrentSaveError, GlobalShardError, StorageError
from globalshard.format.metadata import MAX_FILE_BYTES
from globalshard.format.paths import LOCK_FILE
from globalshard.store.base import PIECE_BYTES, Sink, Stamp, Store, error_text
from globalshard.store.containment import escaping, inside
from globalshard.store.files import pieces, read_to_end, replacing, sync_dir

__all__ = ["LocalStore", "sync_dir"]


class LocalStore:
    """A checkpoint root that is a local directory.

    Args:
        path: the directory (made absolute; created by the first write).
        spec: the TensorStore kvstore spec its arrays are opened with (a
            ``file`` driver spec with its options); by default the plain one.
    """

    locks = True
    process_shared = True
    lists_cheaply = True

    def __init__(self, path: str | os.PathLike[str], spec: dict[str, Any] | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.spec = spec if spec is not None else {"driver": "file", "path": self.path.rstrip("/") + "/"}

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"LocalStore({self.path!r})"

    def files(self, prefix: str) -> list[str]:
        top = os.path.join(self.path, prefix)
        out = []
        for directory, _, names in os.walk(top):  # does not descend into linked directories
            for n in names:
                full = os.path.join(directory, n)
                if not os.path.islink(full):
                    out.append(os.path.relpath(full, self.path).replace(os.sep, "/"))
        return sorted(out)

    def read_whole(self, name: str) -> bytes | None:
        pieces = self.read_pieces(name, 1 << 62)  # one piece: the file
        return None if pieces is None else b"".join(pieces)

    def size(self, name: str) -> int | None:
        full = os.path.join(self.path, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"cannot read {full}: {error_text(e)}") from None
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"{full} is not a regular file")
        return st.st_size

    def read_pieces(self, name: str, piece: int = PIECE_BYTES) -> Iterator[bytes] | None:
        full = os.path.join(self.path, name)
        return pieces(full, piece) if os.path.lexists(full) else None

    def sibling(self, name: str) -> LocalStore:
        path = os.path.join(os.path.dirname(self.path), name)
        spec = dict(self.spec)
        spec["path"] = path.rstrip("/") + "/"
        return LocalStore(path, spec)

    def sibling_name(self, other: Store) -> str | None:
        if not isinstance(other, LocalStore) or other.path == self.path:
            return None
        parent, name = os.path.split(other.path)
        return name if parent == os.path.dirname(self.path) and name else None

    def describe(self, name: str) -> str:
        return os.path.join(self.path, name)

    def kvstore(self, path: str = "") -> dict[str, Any]:
        spec = dict(self.spec)
        spec["path"] = spec.get("path", "") + (path + "/" if path else "")
        return spec

    def child(self, path: str = "") -> str:
        return f"{self.path.rstrip('/')}/{path}" if path else self.path

    # ------------------------------------------------------------ reading

    def read(self, name: str) -> bytes | None:
        """The bytes of a file at the root, or None if there is none.

        Only a regular file inside the root (after symlinks) is read, never
        more than ``MAX_FILE_BYTES``: a FIFO, a device or a link out of the
        checkpoint is an error, not a hang or a huge allocation.
        """
        try:
            return self._read(name)
        except OSError as e:
            raise StorageError(f"cannot read {self.describe(name)}: {error_text(e)}") from None

    def read_stamped(self, name: str) -> tuple[bytes | None, Stamp]:
        data = self.read(name)
        return data, data

    def _read(self, name: str) -> bytes | None:
        full = os.path.join(self.path, name)
        if not os.path.lexists(full):
            return None
        real = os.path.realpath(full)
        if not inside(real, os.path.realpath(self.path)):
            raise StorageError(f"{full} leads outside the checkpoint (to {real}); refusing to read it")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StorageError(f"{full} is not a regular file; refusing to read it")
            if st.st_size > MAX_FILE_BYTES:
                raise StorageError(f"{full} holds {st.st_size} bytes, more than the {MAX_FILE_BYTES} "
                                   "this library reads")
            return read_to_end(fd, st.st_size, full)
        finally:
            os.close(fd)

    def read_checked(self, name: str) -> bytes | None:
        """:meth:`read` of a file below paths :meth:`escaping` accepted: a
        regular file opened without following a final symlink (a symlink goes
        the long way), no realpath per file."""
        full = os.path.join(self.path, name)
        try:
            fd = os.open(full, _READ_CHECKED)
        except FileNotFoundError:
            return None
        except OSError:
            return self._read(name)  # a symlink (ELOOP), or an error it names the same way
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                return self._read(name)  # refuses it with the usual message
            return read_to_end(fd, st.st_size, full)
        finally:
            os.close(fd)

    def prefetch(self, names: Sequence[str]) -> None:
        """Ask the kernel to start reading ``names`` (below paths :meth:`escaping`
        accepted) into the page cache, without waiting, so that on a cold cache
        the small files a load reads one after the other arrive together. A file
        that cannot be opened is skipped (its read reports it); nothing is asked
        when the first is cached already (a warm load: the opens would only cost)."""
        if not names or not hasattr(os, "posix_fadvise") or _cached(os.path.join(self.path, names[0])):
            return
        for name in names:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(self.path, name), _READ_CHECKED)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    # ------------------------------------------------------------ writing

    def write(self, name: str, data: bytes) -> None:
        """Write a file atomically (tmp, fsync, rename, fsync of the directory)."""
        with self.open_write(name) as out:
            out.write(data)

    def open_write(self, name: str) -> AbstractContextManager[Sink]:
        """:meth:`write` piece by piece: the temporary file is renamed into
        place when the block ends, and removed if it raises."""
        return replacing(os.path.join(self.path, name))

    def commit(self, name: str, data: bytes, stamp: Stamp) -> None:
        """Replace ``name`` if it still holds ``stamp``. The caller holds
        :meth:`lock`; the check guards against writers that ignore it.

        Raises:
            ConcurrentSaveError: another save replaced ``name`` in between.
            StorageError: the write failed (nothing was replaced).
        """
        try:
            if self._read(name) != stamp:
                raise ConcurrentSaveError(
                    f"{self.describe(name)} changed while this save was running: another save committed to "
                    f"{self} first; this save is not committed and the other's checkpoint stands")
            self.write(name, data)
        except OSError as e:
            if isinstance(e, GlobalShardError):
                raise
            raise StorageError(f"cannot write {self.describe(name)}: {error_text(e)}") from None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive ``flock`` on ``.globalshard.lock`` (spec section 2.2): a
        second writer fails at once; the lock of a killed process is released
        by the OS.

        Raises:
            ConcurrentSaveError: another save holds the lock.
        """
        # TODO(limitation): flock, which network filesystems may not honour across hosts.
        try:
            os.makedirs(self.path, exist_ok=True)
            # Never through a link: a planted one would make the save create a file elsewhere.
            fd = os.open(os.path.join(self.path, LOCK_FILE),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            why = "it is a symbolic link" if os.path.islink(os.path.join(self.path, LOCK_FILE)) else error_text(e)
            raise StorageError(f"cannot create {self.describe(LOCK_FILE)}: {why}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StorageError(f"{self.describe(LOCK_FILE)} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConcurrentSaveError(
                    f"another save to {self} is running (it holds {self.describe(LOCK_FILE)}); "
                    "wait for it to finish"
                ) from None
            yield
        finally:
            os.close(fd)  # releases the lock

    # ------------------------------------------------------------ namespace

    def delete(self, name: str, *, tree: bool = False) -> None:
        try:
            link = self.linked_component(name)
            if link is not None:
                raise StorageError(f"{self.describe(link)} is a symbolic link; nothing is deleted through it")
            target = os.path.join(self.path, name)
            if tree and os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            elif os.path.lexists(target) and not os.path.isdir(target):
                os.unlink(target)
            else:
                return
            sync_dir(os.path.dirname(target))
        except OSError as e:
            raise StorageError(f"cannot remove {self.describe(name)}: {error_text(e)}") from None

    def delete_empty_parents(self, paths: Sequence[str]) -> None:
        for path in paths:
            parent = os.path.dirname(path)
            if parent and self.linked_component(parent) is not None:
                continue  # never through a link
            while parent:
                try:
                    os.rmdir(os.path.join(self.path, parent))
                except OSError:  # not empty, or already gone
                    break
                parent = os.path.dirname(parent)

    def list_dir(self, prefix: str = "") -> list[str]:
        try:
            link = self.linked_component(prefix) if prefix else None
            if link is not None:
                raise StorageError(f"{self.describe(link)} is a symbolic link; nothing is listed through it")
            directory = os.path.join(self.path, prefix)
            return sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        except OSError as e:
            raise StorageError(f"cannot list {self.describe(prefix)}: {error_text(e)}") from None

    def linked_component(self, name: str) -> str | None:
        """The first component of ``name`` that is a symbolic link (a save
        creates, writes and deletes nothing through one), or None."""
        parts = [p for p in name.split("/") if p]
        for k in range(1, len(parts) + 1):
            prefix = "/".join(parts[:k])
            try:
                if stat.S_ISLNK(os.lstat(os.path.join(self.path, prefix)).st_mode):
                    return prefix
            except (FileNotFoundError, NotADirectoryError):
                return None
        return None

    def escaping(self, paths: Sequence[str]) -> list[str]:
        """Stored paths that escape the root through a symlink, or hold anything
        but directories and regular files (see :func:`~globalshard.store.containment.escaping`)."""
        return escaping(self.path, paths)


#: How :meth:`LocalStore.read_checked` and :meth:`LocalStore.prefetch` open a file:
#: never through a final symlink, never blocking on a FIFO.
_READ_CHECKED = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _cached(path: str) -> bool:
    """Whether the first byte of ``path`` is in the page cache (a read that may
    not wait, ``RWF_NOWAIT``, gets it); False where that cannot be told."""
    nowait = getattr(os, "RWF_NOWAIT", 0)
    with contextlib.suppress(OSError):  # EAGAIN: not cached; EOPNOTSUPP: the file system cannot say
        fd = os.open(path, _READ_CHECKED)
        try:
            return nowait != 0 and os.preadv(fd, [bytearray(1)], 0, nowait) == 1
        finally:
            os.close(fd)
    return False
