"""One local file's bytes: bounded reads, reads a piece at a time, and
atomic replacement (a temporary name in the same directory, fsync, rename,
fsync of the directory: spec section 2.2)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from globalshard.errors import StorageError
from globalshard.format.metadata import MAX_FILE_BYTES
from globalshard.format.paths import temporary_name
from globalshard.store.base import error_text

__all__ = ["pieces", "read_to_end", "replacing", "sync_dir"]

T = TypeVar("T")


def read_to_end(fd: int, size: int, full: str) -> bytes:
    """A small file's bytes (one more asked for than ``size``, to see it grow)."""
    data = _read_up_to(fd, size + 1)
    if len(data) > MAX_FILE_BYTES:
        raise StorageError(f"{full} grew past {MAX_FILE_BYTES} bytes while being read")
    return data


def pieces(full: str, piece: int) -> Iterator[bytes]:
    """The bytes of the file at ``full``, exactly ``piece`` at a time (the
    last shorter, an empty file one empty piece). The file is opened when
    the first piece is asked for, never through a final symbolic link.

    Raises (while iterating):
        StorageError: naming the file, when it cannot be read or shrinks.
    """
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        left = os.fstat(fd).st_size
    except OSError as e:
        raise StorageError(f"cannot read {full}: {error_text(e)}") from None
    try:
        while True:
            want = min(piece, left)
            try:
                data = _read_up_to(fd, want)
            except OSError as e:
                raise StorageError(f"cannot read {full}: {error_text(e)}") from None
            if len(data) < want:
                raise StorageError(f"{full} shrank while it was being read")
            left -= want
            yield data
            if not left:
                return
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(final: str) -> Iterator[_FileSink]:
    """A file written through the sink this gives, under a temporary name
    beside ``final``: fsynced and renamed to ``final`` (and its directory
    fsynced) when the block ends, removed if the block raises.

    Raises:
        StorageError: naming ``final``, when a step of writing it fails.
    """
    directory, base = os.path.split(final)
    tmp = os.path.join(directory, temporary_name(base))
    try:
        f = _writing(final, lambda: _created(directory, tmp))
        with f:
            yield _FileSink(f, final)
            _writing(final, f.flush)
            _writing(final, lambda: os.fsync(f.fileno()))
        _writing(final, lambda: os.replace(tmp, final))
        _writing(final, lambda: sync_dir(directory))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def sync_dir(directory: str) -> None:
    """Fsync a directory: its new entries are durable only then."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FileSink:
    """:func:`replacing`'s temporary file, its errors naming the file written."""

    def __init__(self, f: Any, full: str) -> None:
        self._f, self._full = f, full

    def write(self, data: bytes | memoryview, /) -> None:
        _writing(self._full, lambda: self._f.write(data))


def _created(directory: str, tmp: str) -> Any:
    os.makedirs(directory, exist_ok=True)
    return open(tmp, "wb")


def _writing(full: str, step: Callable[[], T]) -> T:
    """``step()``, a step of writing ``full``: an OSError becomes a StorageError naming it."""
    try:
        return step()
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"cannot write {full}: {error_text(e)}") from None


def _read_up_to(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd``'s position, fewer at the end of the file: one
    read of all of them, as a regular file gives them (then no join copies
    the parts; a read stops short only past 2 GiB, or at the end)."""
    parts = []
    while n > 0:
        part = os.read(fd, n)
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)
