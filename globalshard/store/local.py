"""A checkpoint root in a local directory: flock, temporary file + fsync +
rename, no reads or deletes through symbolic links, containment checks."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from typing import Any

from globalshard.errors import ConcurrentSaveError, GlobalShardError, StorageError
from globalshard.format.metadata import MAX_FILE_BYTES
from globalshard.format.paths import LOCK_FILE, temporary_name
from globalshard.store.base import Stamp, Store, error_text

__all__ = ["LocalStore", "inside", "sync_dir"]


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
        full = os.path.join(self.path, name)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"cannot read {full}: {error_text(e)}") from None
        try:
            return _read_to_end(fd, os.fstat(fd).st_size, full)
        finally:
            os.close(fd)

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
            return _read_to_end(fd, st.st_size, full)
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
            return _read_to_end(fd, st.st_size, full)
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
        """Write a file atomically: a temporary name in the same directory,
        fsync, rename, fsync of the directory."""
        try:
            self._replace(name, data)
        except OSError as e:
            raise StorageError(f"cannot write {self.describe(name)}: {error_text(e)}") from None

    def _replace(self, name: str, data: bytes) -> None:
        final = os.path.join(self.path, name)
        directory, base = os.path.split(final)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, temporary_name(base))
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        sync_dir(directory)

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
            self._replace(name, data)
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
        but directories and regular files (a FIFO would hang a read).

        Each directory's real path is resolved once (one ``lstat`` per path
        component across all paths, not a ``realpath`` per path), and entries
        are typed from ``scandir``: a load of thousands of small arrays pays
        a few system calls per file.
        """
        base = self.path.rstrip(os.sep) or os.sep
        root = os.path.realpath(base)
        real: dict[str, str] = {base: root}

        def resolve(path: str) -> str:
            found = real.get(path)
            if found is None:
                parent, name = os.path.split(path)
                found = os.path.join(resolve(parent), name)
                if os.path.islink(found):
                    found = os.path.realpath(found)
                real[path] = found
            return found

        def scan(directory: str, problems: list[str]) -> None:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        if not inside(os.path.realpath(entry.path), root):
                            problems.append(f"{entry.path} leads outside the checkpoint through a symlink")
                        elif not entry.is_dir() and not _is_regular(entry.path):
                            problems.append(f"{entry.path} is not a regular file")
                    elif entry.is_dir(follow_symlinks=False):
                        scan(entry.path, problems)
                    elif not entry.is_file(follow_symlinks=False):
                        problems.append(f"{entry.path} is not a regular file")

        bad = []
        for path in paths:
            top = os.path.join(base, path)
            problems: list[str] = []
            if not inside(resolve(top), root):
                problems.append(f"{top} leads outside the checkpoint")
            else:
                try:
                    scan(top, problems)
                except (FileNotFoundError, NotADirectoryError):
                    pass  # missing or not an array: opening it says so, naming the file
            if problems:
                bad.append(f"{path!r}: {problems[0]}")
        return bad


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


def _read_to_end(fd: int, size: int, full: str) -> bytes:
    """A small file's bytes (one more asked for than ``size``, to see it grow)."""
    parts, left = [], size + 1
    while left > 0:
        part = os.read(fd, min(left, 1 << 24))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    data = b"".join(parts)
    if len(data) > MAX_FILE_BYTES:
        raise StorageError(f"{full} grew past {MAX_FILE_BYTES} bytes while being read")
    return data


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def sync_dir(directory: str) -> None:
    """Fsync a directory: its new entries are durable only then."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both absolute)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
