"""Cold reads without root: drop a checkpoint's files from the page cache."""

from __future__ import annotations

import os

__all__ = ["evict"]


def evict(root: str | os.PathLike[str]) -> None:
    """Drop every file under ``root`` from the page cache (fsync, then
    POSIX_FADV_DONTNEED), so the next read comes from the disk."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
