"""Containment under a local root: whether stored paths stay inside it
(spec section 2.2: no reads through a symbolic link out of the checkpoint)
and hold nothing but directories and regular files."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

__all__ = ["escaping", "inside"]


def escaping(root_path: str, paths: Sequence[str]) -> list[str]:
    """Paths below the directory ``root_path`` that escape it through a
    symlink, or hold anything but directories and regular files (a FIFO
    would hang a read): one problem each, naming the path.

    Each directory's real path is resolved once (one ``lstat`` per path
    component across all paths, not a ``realpath`` per path), and entries
    are typed from ``scandir``: a load of thousands of small arrays pays
    a few system calls per file.
    """
    base = root_path.rstrip(os.sep) or os.sep
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


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both absolute)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
