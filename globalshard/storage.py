"""Where checkpoints live, and the only module that talks to TensorStore.

A checkpoint root is a local directory or any TensorStore kvstore (a spec
dict, or a URL such as ``"memory://"``, ``"gs://bucket/run/"``, or an OCDBT
spec). Each stored region is one zarr v3 array:

* one chunk holding the whole region, with the ``crc32c`` codec, when it
  is small (at most ``CHUNK_BYTES``);
* otherwise one ``sharding_indexed`` shard holding the whole region, split
  into inner chunks of at most ``CHUNK_BYTES``, each and the shard index
  carrying a crc32c, so a load reads only the inner chunks it needs.

Reads run with ``fill_missing_data_reads: false`` and writes with
``store_data_equal_to_fill_value: true``: a chunk that is absent on disk is an
error, never a block of zeros.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import itertools
import json
import math
import os
import re
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from globalshard import localio
from globalshard.dtypes import cast_into, numpy_dtype
from globalshard.errors import ConcurrentSaveError, GlobalShardError, MetadataError, StorageError, format_problems
from globalshard.geometry import Box
from globalshard.metadata import MAX_FILE_BYTES, check_relative_path
from globalshard.planner import LoadPlan, PackedRegion

__all__ = ["CHUNK_BYTES", "READ_WINDOW_BYTES", "WRITE_WINDOW_BYTES", "ArrayItem", "IOStats", "Location", "PackExpect",
           "PackItem", "chunk_shape"]

#: Upper bound on the bytes of one (inner) chunk: the unit a load reads.
CHUNK_BYTES = 1 << 20

#: Bytes one verification reads before it waits for them (its memory bound).
VERIFY_WINDOW_BYTES = 64 << 20

#: The member of a stored array's zarr.json attributes that names its key, box and save.
ATTRIBUTE = "globalshard"

#: The writers' lock file at a local root (spec section 2.2).
LOCK_FILE = ".globalshard.lock"
#: Temporary files this library creates start with this (``.metadata.json.tmp-<hex>``).
_TMP_PREFIX = "."

#: From this many arrays in one save, local writes are made durable by one
#: ``syncfs`` of the filesystem rather than an fsync per file and directory.
SYNCFS_MIN_ARRAYS = 64

#: Bytes of writes in flight at once. TensorStore copies what it is given to
#: write, so this bounds the extra memory a save needs.
WRITE_WINDOW_BYTES = 64 << 20

#: Bytes of packs (spec section 5.1) in host memory and not yet written:
#: whole packs assembled for TensorStore; locally, only copies of members
#: that were not contiguous little-endian bytes (the rest is written from
#: the members themselves).
PACK_WINDOW_BYTES = 32 << 20

#: Bytes of reads in flight at once: TensorStore decodes each chunk into a
#: buffer of its own before copying it into the target, so this bounds the
#: memory a load needs beyond its targets.
READ_WINDOW_BYTES = 32 << 20

#: How arrays in local directories are read and written: ``direct`` (default:
#: :mod:`globalshard.localio`, the same zarr v3 files without TensorStore in
#: the way) or ``tensorstore``. Object stores always use TensorStore.
LOCAL_IO = os.environ.get("GLOBALSHARD_LOCAL_IO", "direct")
if LOCAL_IO not in ("direct", "tensorstore"):
    raise ImportError(f"GLOBALSHARD_LOCAL_IO must be 'direct' or 'tensorstore', not {LOCAL_IO!r}")

# One context for the process: the memory kvstore persists across calls, and
# the chunk cache is off (every byte is read once, straight into its target).
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})


@dataclass(slots=True)
class IOStats:
    """Figures of one save or load, filled in when passed as ``stats=``.

    ``bytes_needed``: stored bytes the targets need (load) or this rank wrote
    (save). ``bytes_read``: bytes of the distinct whole chunks a load touched,
    each counted once however many targets share it, which is what storage
    reads; the ratio of the two is the read amplification. With shared reads,
    ``bytes_received`` and ``bytes_sent`` count the pieces other ranks read
    for this one and this one read for others.
    """

    arrays: int = 0
    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


def chunk_shape(shape: Sequence[int], itemsize: int, limit: int | None = None, *,
                cut: Sequence[int] = ()) -> tuple[int, ...]:
    """The inner chunk shape for a stored region of at most ``limit`` bytes.

    ``cut``: the axes along which the region is a part of its tensor. A region
    cut along its first axis only (TP of a column-parallel weight, FSDP, or
    both) is mostly loaded cut along that axis too: it gets chunks of whole
    rows, as many as fit, which are contiguous pieces of such targets and are
    read straight into them, with no waste whatever the new degree. Any other
    region (or one whose rows exceed ``limit``) has its longest axis halved
    until the chunk fits: near-cubic chunks keep the waste small whichever
    axis a load cuts.

    >>> chunk_shape((4096, 4096), 4)
    (512, 512)
    >>> chunk_shape((4096, 4096), 4, cut=(0,))
    (64, 4096)
    >>> chunk_shape((10, 3), 4)
    (10, 3)
    """
    limit = CHUNK_BYTES if limit is None else limit
    # TODO(limitation): a region under the limit is one chunk, so a target that
    # needs part of it reads all of it (bounded by CHUNK_BYTES of waste).
    if tuple(cut) == (0,) and len(shape) > 1 and math.prod(shape) * itemsize > limit:
        # TODO(limitation): a load that cuts such a region along another axis reads whole rows.
        row = math.prod(shape[1:]) * itemsize
        if 0 < row <= limit:
            return (min(shape[0], limit // row), *shape[1:])
    chunk = list(shape)
    while chunk and math.prod(chunk) * itemsize > limit and max(chunk) > 1:
        axis = chunk.index(max(chunk))
        chunk[axis] = -(-chunk[axis] // 2)
    return tuple(chunk)


_BYTES = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


class ArrayItem(NamedTuple):
    """One stored array to write: ``data`` under ``path``, with ``attributes``
    (from :func:`array_attributes`) in its zarr.json; ``cut``: the axes
    along which the region is a part of its tensor (see :func:`chunk_shape`);
    ``ready``: see below."""

    path: str
    dtype: str
    data: np.ndarray
    attributes: dict[str, Any]
    cut: tuple[int, ...] = ()
    #: Blocks until ``data`` holds its values (a device-to-host copy still in
    #: flight); called before its bytes are written. None: ready now.
    ready: Callable[[], None] | None = None


class PackItem(NamedTuple):
    """One pack to write (spec section 5.1): ``nbytes`` bytes at ``path``,
    holding ``members``, each ``(byte_offset, data, ready)`` (``ready`` as in
    :class:`ArrayItem`), with ``attributes`` from :func:`pack_attributes`.
    The pack is built in host memory once its members are ready."""

    path: str
    nbytes: int
    members: tuple[tuple[int, np.ndarray, Callable[[], None] | None], ...]
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PackExpect:
    """What a pack a load reads must say of itself: its save, and (at least)
    these members, each ``[key, offset, byte_offset, nbytes]``."""

    save_id: str
    members: tuple[tuple[str, tuple[int, ...], int, int], ...]


def pack_attributes(save_id: str, members: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """What a pack says of itself (spec section 5.1): its save and members
    ``[key, offset, byte_offset, nbytes]``; checked on load."""
    return {"save_id": save_id, "members": [[k, [int(o) for o in off], int(b), int(n)] for k, off, b, n in members]}


def pack_expect(save_id: str, regions: Mapping[int, PackedRegion]) -> PackExpect:
    """The :class:`PackExpect` of the packed regions a load reads from one pack."""
    return PackExpect(save_id, tuple((r.key, r.box.offset, b, r.nbytes) for b, r in sorted(regions.items())))


def _member(entry: Any) -> tuple[Any, ...] | None:
    """A pack's ``[key, offset, byte_offset, nbytes]`` entry as a tuple, or None
    unless it is exactly that: a string, a list of integers, two integers
    (``64.0`` or ``true`` is not an integer of this format)."""
    if type(entry) is list and len(entry) == 4 and type(entry[0]) is str and type(entry[1]) is list \
            and type(entry[2]) is int and type(entry[3]) is int and all(type(v) is int for v in entry[1]):
        return (entry[0], tuple(entry[1]), entry[2], entry[3])
    return None


_LITTLE = sys.byteorder == "little"


def _le_bytes(array: np.ndarray) -> np.ndarray:
    """A packed region's bytes (spec section 5.1): its elements in C order,
    little-endian; a view of ``array`` when it already is that."""
    if _LITTLE and array.flags.c_contiguous and array.dtype.isnative:  # the usual case, in two steps
        return array.reshape(-1).view(np.uint8)
    flat = np.ascontiguousarray(array).reshape(-1)
    if not flat.dtype.isnative:
        flat = flat.astype(flat.dtype.newbyteorder("="))
    if sys.byteorder == "big":  # the format's bytes are little-endian
        flat = flat.byteswap()
    return flat.view(np.uint8)


def _pack_data(item: PackItem) -> tuple[np.ndarray | None, str | None]:
    """A pack's bytes, assembled once its members are ready (for TensorStore,
    which writes from one array); or why it cannot be."""
    data = np.zeros(item.nbytes, np.uint8)
    for byte_offset, array, ready in item.members:
        why = _wait_ready(ready)
        if why is not None:
            return None, why
        flat = _le_bytes(array)
        data[byte_offset:byte_offset + flat.nbytes] = flat
    return data, None


def item_bytes(item: ArrayItem | PackItem) -> int:
    return item.nbytes if isinstance(item, PackItem) else item.data.nbytes


def _create_spec(kvstore: dict[str, Any], dtype: str, shape: tuple[int, ...],
                 attributes: dict[str, Any] | None = None, cut: tuple[int, ...] = ()) -> dict[str, Any]:
    inner = chunk_shape(shape, numpy_dtype(dtype).itemsize, cut=cut)
    # TODO(limitation): no compression codec; zarr3 allows zstd/blosc before crc32c.
    if inner == tuple(shape):
        grid, codecs = list(shape), _BYTES
    else:
        grid = [-(-s // c) * c for s, c in zip(shape, inner)]
        codecs = [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(inner), "codecs": _BYTES, "index_codecs": _BYTES, "index_location": "end",
            },
        }]
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "codecs": codecs,
            "attributes": {ATTRIBUTE: attributes or {}},
        },
    }


def array_attributes(key: str, offset: Sequence[int], save_id: str) -> dict[str, Any]:
    """What a stored array says of itself (spec section 5): checked on load."""
    return {"key": key, "offset": [int(o) for o in offset], "save_id": save_id}


def _checksummed(codecs: Any) -> bool:
    """Whether a zarr v3 codec chain covers every stored byte with crc32c."""
    if not isinstance(codecs, list) or not codecs:
        return False
    names = [c.get("name") if isinstance(c, dict) else None for c in codecs]
    to_bytes = next((i for i, n in enumerate(names) if n in ("bytes", "sharding_indexed")), None)
    if to_bytes is None:
        return False
    if "crc32c" in names[to_bytes + 1:]:
        return True
    if names[to_bytes] == "sharding_indexed":
        conf = codecs[to_bytes].get("configuration") or {}
        return _checksummed(conf.get("codecs")) and "crc32c" in [
            c.get("name") for c in conf.get("index_codecs") or [] if isinstance(c, dict)]
    return False


def _error_text(e: BaseException) -> str:
    text = str(e)
    # TensorStore appends the whole spec as [tensorstore_spec='...']: noise here.
    cut = text.find(" [tensorstore_spec=")
    return text[:cut] if cut > 0 else text


class Location:
    """A checkpoint root: a local directory, or a TensorStore kvstore.

    Args:
        where: a filesystem path; a kvstore URL (``"memory://"``,
            ``"gs://bucket/run/"``, ``"file:///abs/dir/"``); or a kvstore spec
            dict (``{"driver": "ocdbt", "base": "file:///abs/dir/"}``).
        kvstore: a kvstore spec or URL to resolve ``where`` in: the root is
            then ``where``, a relative path, inside that kvstore.
    """

    def __init__(self, where: Any, kvstore: Any = None) -> None:
        #: The root as a local directory when it is one (however it was named):
        #: the filesystem's checks (containment, file types, lock) apply to it.
        self.local: str | None = None
        if isinstance(where, (str, os.PathLike)) and not os.fspath(where):
            raise StorageError("the checkpoint path is empty (use '.' for the current directory)")
        if kvstore is not None:
            base = Location(kvstore)
            relative = os.fspath(where).strip("/") if isinstance(where, (str, os.PathLike)) else None
            if not relative or check_relative_path(relative) is not None:
                raise StorageError(f"with kvstore=, the path must be relative inside it, got {where!r}")
            where = base.array_kvstore(relative)
        if isinstance(where, os.PathLike) or (isinstance(where, str) and "://" not in where):
            self.local = os.path.abspath(os.fspath(where))
            self.kvstore: dict[str, Any] = {"driver": "file", "path": self.local.rstrip("/") + "/"}
        else:
            try:
                spec = ts.KvStore.Spec(where).to_json() if isinstance(where, str) else dict(where)
                ts.KvStore.Spec(spec)
            except Exception as e:
                raise StorageError(f"not a checkpoint location: {where!r}: {_error_text(e)}") from None
            # TODO(limitation): OCDBT written by several processes needs TensorStore's
            # coordinator configured by the caller in the spec; it is not set up here.
            path = spec.get("path", "")
            if path and not path.endswith("/"):
                spec["path"] = path + "/"
            self.kvstore = spec
            if spec.get("driver") == "file":
                # A local directory, whatever options the spec carries: its
                # small files, checks and lock go through the filesystem.
                self.local = os.path.abspath(spec.get("path", "") or ".")
        self._kv: Any = None

    def __str__(self) -> str:
        if self.local is not None:
            return self.local
        return ts.KvStore.Spec(self.kvstore).to_json().get("path", "") or str(self.kvstore)

    def describe(self, name: str) -> str:
        return os.path.join(self.local, name) if self.local is not None else f"{name} in {self.kvstore}"

    def array_kvstore(self, path: str) -> dict[str, Any]:
        spec = dict(self.kvstore)
        spec["path"] = spec.get("path", "") + path + "/"
        return spec

    # ------------------------------------------------------------ small files

    def _kvs(self) -> Any:
        if self._kv is None:
            try:
                self._kv = ts.KvStore.open(self.kvstore, context=_CONTEXT).result()
            except Exception as e:
                raise StorageError(f"cannot open {self.kvstore}: {_error_text(e)}") from None
        return self._kv

    def read_file(self, name: str) -> bytes | None:
        """The bytes of a file at the root, or None if there is none.

        On a filesystem only a regular file inside the root (after symlinks) is
        read, never more than ``MAX_FILE_BYTES``: a FIFO, a device or a link
        out of the checkpoint is an error, not a hang or a huge allocation.
        """
        return self.read_stamped(name)[0]

    def read_stamped(self, name: str) -> tuple[bytes | None, Any]:
        """``(bytes or None, stamp)``: the stamp identifies this version of the
        file for :meth:`commit` (a storage generation, or the bytes locally)."""
        try:
            if self.local is not None:
                data = self._read_local(name)
                return data, data
            r = self._kvs().read(name).result()
            if r.state == "missing":
                return None, r.stamp.generation
            if len(r.value) > MAX_FILE_BYTES:
                raise StorageError(f"{self.describe(name)} holds {len(r.value)} bytes, more than the "
                                   f"{MAX_FILE_BYTES} this library reads")
            return bytes(r.value), r.stamp.generation
        except (OSError, ValueError) as e:
            if isinstance(e, StorageError):
                raise
            raise StorageError(f"cannot read {self.describe(name)}: {_error_text(e)}") from None

    def _read_local(self, name: str) -> bytes | None:
        assert self.local is not None
        full = os.path.join(self.local, name)
        if not os.path.lexists(full):
            return None
        real = os.path.realpath(full)
        if not _inside(real, os.path.realpath(self.local)):
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

    def _read_checked(self, name: str) -> bytes | None:
        """:meth:`_read_local` for a file below paths :meth:`check_contained`
        accepted: a regular file opened without following a final symlink
        (a symlink goes the long way), no realpath per file."""
        assert self.local is not None
        full = os.path.join(self.local, name)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError:
            return self._read_local(name)  # a symlink (ELOOP), or an error it names the same way
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                return self._read_local(name)  # refuses it with the usual message
            return _read_to_end(fd, st.st_size, full)
        finally:
            os.close(fd)

    def write_file(self, name: str, data: bytes) -> None:
        """Write a file below the root atomically: it appears whole or not at all.

        Locally: a temporary name in the same directory, fsync, rename, fsync
        of the directory. On a kvstore: one write, which TensorStore's
        kvstores apply atomically.
        """
        try:
            if self.local is None:
                self._kvs().write(name, data).result()
                return
            self._replace_local(name, data)
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot write {self.describe(name)}: {_error_text(e)}") from None

    def _replace_local(self, name: str, data: bytes) -> None:
        assert self.local is not None
        final = os.path.join(self.local, name)
        directory, base = os.path.split(final)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{_TMP_PREFIX}{base}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        _sync_dir(directory)

    def commit(self, name: str, data: bytes, stamp: Any) -> None:
        """Replace ``name`` with ``data`` only if it is still the version
        ``stamp`` (from :meth:`read_stamped`) named: the commit of a save.

        Locally the caller holds :meth:`lock`; the check guards against
        writers that ignore it. On a kvstore it is one conditional write.

        Raises:
            ConcurrentSaveError: another save replaced ``name`` in between.
            StorageError: the write failed (nothing was replaced).
        """
        lost = ConcurrentSaveError(
            f"{self.describe(name)} changed while this save was running: another save committed to "
            f"{self} first; this save is not committed and the other's checkpoint stands"
        )
        try:
            if self.local is None:
                gen = self._kvs().write(name, data, if_equal=stamp).result()
                if not gen.generation:
                    raise lost
                return
            if self._read_local(name) != stamp:
                raise lost
            self._replace_local(name, data)
        except (OSError, ValueError) as e:
            if isinstance(e, GlobalShardError):
                raise
            raise StorageError(f"cannot write {self.describe(name)}: {_error_text(e)}") from None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the writers' lock of the root for a save (spec section 2.2).

        On a filesystem an exclusive ``flock`` on ``.globalshard.lock``: a
        second writer fails at once; the lock of a killed process is released
        by the OS. On a kvstore nothing: the commit is conditional instead.

        Raises:
            ConcurrentSaveError: another save holds the lock.
        """
        if self.local is None:
            yield
            return
        # TODO(limitation): flock, which network filesystems may not honour across hosts.
        try:
            os.makedirs(self.local, exist_ok=True)
            # Never through a link: a planted one would make the save create a file elsewhere.
            fd = os.open(os.path.join(self.local, LOCK_FILE),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            why = "it is a symbolic link" if os.path.islink(os.path.join(self.local, LOCK_FILE)) else _error_text(e)
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

    def remove(self, name: str, *, tree: bool = False) -> None:
        """Remove a file (or, with ``tree``, everything under a prefix), if present."""
        try:
            if self.local is None:
                end = name + ("0" if tree else "\x00")
                start = name + "/" if tree else name
                self._kvs().delete_range(ts.KvStore.KeyRange(start, end)).result()
                return
            link = self.linked_component(name)
            if link is not None:
                raise StorageError(f"{self.describe(link)} is a symbolic link; nothing is deleted through it")
            target = os.path.join(self.local, name)
            if tree and os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            elif os.path.lexists(target) and not os.path.isdir(target):
                os.unlink(target)
            else:
                return
            _sync_dir(os.path.dirname(target))
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot remove {self.describe(name)}: {_error_text(e)}") from None

    def remove_empty_parents(self, paths: Sequence[str]) -> None:
        """Remove the directories above ``paths`` that are now empty, up to but
        never including the root (a local root's array tree; a kvstore has no
        directories)."""
        if self.local is None:
            return
        for path in paths:
            parent = os.path.dirname(path)
            if parent and self.linked_component(parent) is not None:
                continue  # never through a link
            while parent:
                try:
                    os.rmdir(os.path.join(self.local, parent))
                except OSError:  # not empty, or already gone
                    break
                parent = os.path.dirname(parent)

    def listing(self, prefix: str = "") -> list[str]:
        """Names directly below the root (or below ``prefix/``): files and directories."""
        try:
            if self.local is not None:
                link = self.linked_component(prefix) if prefix else None
                if link is not None:
                    raise StorageError(f"{self.describe(link)} is a symbolic link; nothing is listed through it")
                directory = os.path.join(self.local, prefix)
                return sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            start = prefix + "/" if prefix else ""
            rng = ts.KvStore.KeyRange(start, prefix + "0" if prefix else "")
            keys = self._kvs().list(rng, strip_prefix_length=len(start)).result()
            return sorted({k.decode("utf-8", "replace").split("/")[0] for k in keys})
        except (OSError, ValueError) as e:
            raise StorageError(f"cannot list {self.describe(prefix)}: {_error_text(e)}") from None

    def linked_component(self, name: str) -> str | None:
        """The first component of ``name`` below a local root that is a
        symbolic link (a save creates, writes and deletes nothing through
        one), or None; always None on a kvstore."""
        if self.local is None:
            return None
        parts = [p for p in name.split("/") if p]
        for k in range(1, len(parts) + 1):
            prefix = "/".join(parts[:k])
            try:
                if stat.S_ISLNK(os.lstat(os.path.join(self.local, prefix)).st_mode):
                    return prefix
            except (FileNotFoundError, NotADirectoryError):
                return None
        return None

    def check_contained(self, paths: Sequence[str]) -> list[str]:
        """Stored paths that escape the root through a symlink, or hold anything
        but directories and regular files (a FIFO would hang a read), on local
        roots; nothing to check on a kvstore.

        Each directory's real path is resolved once (one ``lstat`` per path
        component across all paths, not a ``realpath`` per path), and entries
        are typed from ``scandir``: a load of thousands of small arrays pays
        a few system calls per file.
        """
        if self.local is None:
            return []
        base = self.local.rstrip(os.sep) or os.sep
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
                        if not _inside(os.path.realpath(entry.path), root):
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
            if not _inside(resolve(top), root):
                problems.append(f"{top} leads outside the checkpoint")
            else:
                try:
                    scan(top, problems)
                except (FileNotFoundError, NotADirectoryError):
                    pass  # missing or not an array: opening it says so, naming the file
            if problems:
                bad.append(f"{path!r}: {problems[0]}")
        return bad

    # ------------------------------------------------------------ arrays

    def write_arrays(self, items: Sequence[ArrayItem | PackItem], stats: IOStats | None = None) -> None:
        """Store each :class:`ArrayItem` (and :class:`PackItem`) as a zarr v3
        array, all in parallel; packs are built at most
        :data:`PACK_WINDOW_BYTES` at a time.

        Raises:
            StorageError: listing every array that could not be written.
        """
        start = time.perf_counter()
        if self._direct():
            self._write_direct(items)
        else:
            self._write_tensorstore(items)
        if stats is not None:
            stats.arrays += len(items)
            stats.bytes_written += sum(item_bytes(item) for item in items)
            stats.seconds += time.perf_counter() - start

    def _direct(self) -> bool:
        return self.local is not None and LOCAL_IO == "direct"

    def _write_direct(self, items: Sequence[ArrayItem | PackItem]) -> None:
        assert self.local is not None
        pool = localio.pool()
        problems: list[str] = []
        futures: list[tuple[str, Any]] = []
        directories: set[str] = set()
        made: set[str] = set()
        packs: collections.deque[tuple[int, list[Any]]] = collections.deque()  # packs' copies being written
        pack_bytes = 0
        # Many arrays: one syncfs at the end instead of an fsync per file and directory.
        batch = len(items) >= SYNCFS_MIN_ARRAYS and localio.has_syncfs()
        for item in items:
            # TODO(limitation): unless packed (save(pack_below=)), every array is two files
            # (zarr.json, its chunk or shard) and its own directories: thousands of small
            # arrays cost more than the same bytes in a few (bench/small_tensors.py).
            path = item.path
            if isinstance(item, PackItem):
                while packs and pack_bytes + item.nbytes > PACK_WINDOW_BYTES:  # bound the copies in memory
                    nbytes, done = packs.popleft()
                    concurrent.futures.wait(done)
                    pack_bytes -= nbytes
                first = len(futures)
                copied = self._write_pack(item, pool, futures, problems, made, directories, fsync=not batch)
                if copied:
                    packs.append((copied, [f for _, f in futures[first:]]))
                    pack_bytes += copied
                continue
            dtype, array, attributes, cut = item.dtype, item.data, item.attributes, item.cut
            why = _wait_ready(item.ready)  # earlier arrays are being written meanwhile
            if why is not None:
                problems.append(f"{self.describe(path)}: {why}")
                continue
            directory = os.path.join(self.local, path)
            if not array.dtype.isnative:
                array = array.astype(array.dtype.newbyteorder("="))
            shape = tuple(array.shape)
            inner: tuple[int, ...] | None = chunk_shape(shape, array.dtype.itemsize, cut=cut)
            doc = localio.zarr_json(dtype, shape, None if inner == shape else inner, {ATTRIBUTE: attributes})
            try:
                leaf = os.path.join(directory, "c", *["0"] * (array.ndim - 1)) if array.ndim else directory
                _make_dirs(self.local, leaf, made)
                for f in localio.write_array(directory, array, doc, pool, fsync=not batch, mkdirs=False):
                    futures.append((path, f))
            except OSError as e:
                problems.append(f"{self.describe(path)}: {e.strerror or e}")
                continue
            child = os.path.join(directory, "c", *["0"] * (array.ndim - 1)) if array.ndim else directory
            while _inside(child, self.local) and child not in directories:
                directories.add(child)
                child = os.path.dirname(child)
        for path, f in futures:
            try:
                f.result()
            except OSError as e:
                problems.append(f"{self.describe(path)}: {e.strerror or e}")
        if not problems and batch:
            try:
                localio.syncfs(self.local)
            except OSError as e:
                problems.append(f"{self.local}: {e.strerror or e}")
        elif not problems:
            # New directory entries are durable only once their directory is synced.
            for f in [pool.submit(_sync_dir, d) for d in sorted(directories)]:
                try:
                    f.result()
                except OSError as e:
                    problems.append(f"{e.filename}: {e.strerror or e}")
        if problems:
            raise StorageError(format_problems("cannot write the checkpoint's arrays", problems))

    def _write_pack(self, item: PackItem, pool: Any, futures: list[tuple[str, Any]], problems: list[str],
                    made: set[str], directories: set[str], *, fsync: bool) -> int:
        """Start writing one pack from its members' own bytes (:func:`localio.write_pack`),
        once each is ready; returns the bytes copied on the way (members that
        were not contiguous little-endian bytes)."""
        assert self.local is not None
        members, copied = [], 0
        for byte_offset, array, ready in item.members:
            why = _wait_ready(ready)
            if why is not None:
                problems.append(f"{self.describe(item.path)}: {why}")
                return copied
            flat = _le_bytes(array)
            copied += 0 if np.may_share_memory(flat, array) else flat.nbytes
            members.append((byte_offset, flat))
        directory = os.path.join(self.local, item.path)
        leaf = os.path.join(directory, "c")
        inner = chunk_shape((item.nbytes,), 1)
        doc = localio.zarr_json("uint8", (item.nbytes,), None if inner == (item.nbytes,) else inner,
                                {ATTRIBUTE: item.attributes})
        try:
            _make_dirs(self.local, leaf, made)
            futures += [(item.path, f) for f in localio.write_pack(directory, members, doc, pool, fsync=fsync)]
        except OSError as e:
            problems.append(f"{self.describe(item.path)}: {e.strerror or e}")
            return copied
        child = leaf
        while _inside(child, self.local) and child not in directories:
            directories.add(child)
            child = os.path.dirname(child)
        return copied

    def _write_tensorstore(self, items: Sequence[ArrayItem | PackItem]) -> None:
        opened: list[tuple[str, Any, Any, Any]] = []
        problems: list[str] = []
        for item in items:
            if isinstance(item, PackItem):
                spec = _create_spec(self.array_kvstore(item.path), "uint8", (item.nbytes,), item.attributes)
                source: Any = item
            else:
                spec = _create_spec(self.array_kvstore(item.path), item.dtype, tuple(item.data.shape),
                                    item.attributes, item.cut)
                source = item.data
            try:
                opened.append((item.path, source, item.ready if not isinstance(item, PackItem) else None,
                               ts.open(spec, create=True, delete_existing=True, context=_CONTEXT)))
            except Exception as e:
                problems.append(f"{self.describe(item.path)}: {_error_text(e)}")
        pending: list[tuple[str, Any, int]] = []
        in_flight = 0

        def settle(path: str, future: Any) -> None:
            try:
                future.result()
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")

        for path, array, ready, future in opened:
            if isinstance(array, PackItem):  # built now: the window below bounds what is held
                array, why = _pack_data(array)
            else:
                why = _wait_ready(ready)
            if why is not None or array is None:
                problems.append(f"{self.describe(path)}: {why}")
                continue
            try:
                store = future.result()
                if not array.dtype.isnative:
                    array = array.astype(array.dtype.newbyteorder("="))
                pending.append((path, store.write(array), array.nbytes))
                in_flight += array.nbytes
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
            while in_flight > WRITE_WINDOW_BYTES and pending:
                done_path, done, nbytes = pending.pop(0)
                settle(done_path, done)
                in_flight -= nbytes
        for path, future, _ in pending:
            settle(path, future)
        if problems:
            raise StorageError(format_problems("cannot write the checkpoint's arrays", problems))

    def open_plan(self, plan: LoadPlan, expected: Mapping[str, dict[str, Any] | PackExpect | None]) -> OpenedPlan:
        """Open every stored array and pack a load plan reads, and check it, reading no data.

        Each array must stay inside the root, open with the shape and dtype of
        metadata.json, carry a crc32c on every chunk, and say in its zarr.json
        attributes that it holds the key, offset and save ``expected[path]``
        names (None: a version 1 checkpoint, which records none). Each pack
        must be a 1-d uint8 array that names the save and lists every packed
        region read from it (a :class:`PackExpect`), each inside it.

        Raises:
            MetadataError: a path escapes the checkpoint.
            StorageError: every array that is missing, damaged or not the one
            metadata.json names, each named by its file.
        """
        problems = self.check_contained(sorted([*plan.arrays, *plan.packs]))
        if problems:
            raise MetadataError(format_problems("checkpoint paths escape the checkpoint", problems))
        futures = {}
        files: dict[str, localio.ArrayFile] = {}
        direct = self._direct()
        wanted: list[tuple[str, str, tuple[int, ...] | None]] = [
            *((path, dtype, tuple(shape)) for path, (dtype, shape) in plan.arrays.items()),
            *((path, "uint8", None) for path in plan.packs)]
        for path, dtype, shape in wanted:
            # zarr.json files are read one after the other: for 2,000 small arrays that
            # took half the time of a pool of threads warm (they contend for the GIL)
            # and the same cold (bench/small_tensors.py).
            if direct:
                try:
                    found = self._open_direct(path, dtype, shape, expected.get(path))
                except StorageError as e:
                    problems.append(str(e))
                    continue
                if found is not None:
                    files[path] = found
                    continue
            try:
                futures[path] = self._open_tensorstore(path, dtype, shape)
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
        stores: dict[str, Any] = {}
        for path, future in futures.items():
            try:
                store = future.result()
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
                continue
            why = self._not_the_array(path, store, expected.get(path))
            if why is not None:
                problems.append(why)
            else:
                stores[path] = store
        if problems:
            raise StorageError(format_problems("cannot open the checkpoint's arrays", problems))
        return OpenedPlan(plan, stores, files)

    def _open_tensorstore(self, path: str, dtype: str, shape: tuple[int, ...] | None) -> Any:
        """Open a stored array (``shape`` None: a pack, of one axis) for reading: a future."""
        spec = {"driver": "zarr3", "kvstore": self.array_kvstore(path), "fill_missing_data_reads": False}
        if shape is None:
            return ts.open(spec, open=True, read=True, dtype=ts.dtype(dtype), rank=1, context=_CONTEXT)
        return ts.open(spec, open=True, read=True, dtype=ts.dtype(dtype), shape=shape, context=_CONTEXT)

    def _open_direct(self, path: str, dtype: str, shape: tuple[int, ...] | None,
                     want: dict[str, Any] | PackExpect | None) -> localio.ArrayFile | None:
        """A local array's layout from its zarr.json, checked like TensorStore's
        open plus :meth:`_not_the_array` (``shape`` None: a pack, of one axis);
        None if :mod:`localio` cannot serve it.

        Raises:
            StorageError: the array is missing or is not the one named.
        """
        assert self.local is not None
        name = f"{path}/zarr.json"
        raw = self._read_checked(name)
        if raw is None:
            raise StorageError(f"{self.describe(path)}: the array is missing (no zarr.json)")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise StorageError(f"{self.describe(name)}: not valid JSON ({e})") from None
        layout = localio.parse(os.path.join(self.local, path), doc)
        if layout is None:
            return None
        if shape is None and (layout.dtype != dtype or len(layout.shape) != 1):
            raise StorageError(f"{self.describe(name)}: the array is {layout.dtype} {list(layout.shape)}, "
                               f"metadata.json names a pack: {dtype} of one axis")
        if shape is not None and (layout.dtype != dtype or layout.shape != shape):
            raise StorageError(f"{self.describe(name)}: the array is {layout.dtype} {list(layout.shape)}, "
                               f"metadata.json says {dtype} {list(shape)}")
        why = self._attribute_problem(path, layout.attributes, layout.shape, want)
        if why is not None:
            raise StorageError(why)
        return layout

    def _attribute_problem(self, path: str, attributes: Any, shape: tuple[int, ...],
                           want: dict[str, Any] | PackExpect | None) -> str | None:
        """Why an array's attributes do not name what metadata.json expects there, or None."""
        got = attributes.get(ATTRIBUTE) if isinstance(attributes, dict) else None
        if isinstance(want, PackExpect):
            if not isinstance(got, dict) or got.get("save_id") != want.save_id:
                saved = got.get("save_id") if isinstance(got, dict) else None
                return (f"{self.describe(path)}: the pack says it belongs to save {_short_json(saved)}, "
                        f"metadata.json expects {want.save_id}")
            listed = got.get("members")
            members = {_member(m) for m in listed} if isinstance(listed, list) else set()
            size = shape[0] if len(shape) == 1 else 0
            for key, offset, byte_offset, nbytes in want.members:
                entry = [key, list(offset), byte_offset, nbytes]
                if (key, tuple(offset), byte_offset, nbytes) not in members:
                    return (f"{self.describe(path)}: the pack does not list {_short_json(entry)} "
                            "([key, offset, byte_offset, nbytes]) as metadata.json expects")
                if byte_offset + nbytes > size:
                    return (f"{self.describe(path)}: {key!r} at byte {byte_offset} ({nbytes} bytes) lies past the "
                            f"end of the pack ({size} bytes)")
            return None
        if want is not None and got != want:
            return (f"{self.describe(path)}: the array says it holds {_short_json(got)}, "
                    f"metadata.json expects {_short_json(want)}")
        return None

    def _not_the_array(self, path: str, store: Any, want: dict[str, Any] | PackExpect | None) -> str | None:
        """Why an opened array may not be read as the one metadata.json names, or None."""
        codecs = store.codec.to_json().get("codecs")
        if not _checksummed(codecs):
            names = [c.get("name") for c in codecs or [] if isinstance(c, dict)]
            return (f"{self.describe(path)}: its chunks carry no crc32c checksum (codecs {names}); "
                    "unverifiable data is not read")
        if want is not None:
            attributes = (store.spec().to_json().get("metadata") or {}).get("attributes") or {}
            return self._attribute_problem(path, attributes, tuple(store.shape), want)
        return None

    def verify_array(self, path: str, dtype: str, shape: tuple[int, ...] | None,
                     want: dict[str, Any] | PackExpect | None) -> int:
        """Read every chunk of one stored array, verifying its checksums, one
        window of chunks at a time (memory stays bounded whatever the array's
        size). Returns the bytes read. A pack: ``shape`` None, ``want`` the
        :class:`PackExpect` of every region metadata.json places in it.

        Raises:
            MetadataError: the path escapes the checkpoint.
            StorageError: the array is missing, damaged or not the one named.
        """
        problems = self.check_contained([path])
        if problems:
            raise MetadataError(format_problems("checkpoint paths escape the checkpoint", problems))
        layout = self._open_direct(path, dtype, shape, want) if self._direct() else None
        if layout is not None:
            nbytes, problems = localio.Reader(localio.pool()).verify(layout)
            if problems:
                raise StorageError(format_problems(f"{self.describe(path)} is damaged", problems))
            return nbytes
        try:
            store = self._open_tensorstore(path, dtype, shape).result()
        except Exception as e:
            raise StorageError(f"{self.describe(path)}: {_error_text(e)}") from None
        why = self._not_the_array(path, store, want)
        if why is not None:
            raise StorageError(why)
        shape = tuple(store.shape)
        chunk = _read_chunk(store)
        itemsize = numpy_dtype(dtype).itemsize
        window: list[Any] = []
        window_bytes = total = 0
        try:
            for index in np.ndindex(*[-(-s // c) for s, c in zip(shape, chunk)]):
                box = Box._trusted(tuple(i * c for i, c in zip(index, chunk)),
                                   tuple(min(c, s - i * c) for i, c, s in zip(index, chunk, shape)))
                window.append(_at(store, box).read())
                window_bytes += box.volume * itemsize
                if window_bytes >= VERIFY_WINDOW_BYTES:
                    total += sum(f.result().nbytes for f in window)
                    window, window_bytes = [], 0
            total += sum(f.result().nbytes for f in window)
        except Exception as e:
            raise StorageError(f"{self.describe(path)}: {_error_text(e)}") from None
        return total

    def read_opened(self, opened: OpenedPlan, datas: Sequence[np.ndarray], stats: IOStats | None = None) -> None:
        """Execute an opened load plan: fill ``datas[i]`` for each target.

        Reads run in parallel, straight into the targets where no conversion
        is needed; padding is zero-filled.

        Raises:
            StorageError: missing, truncated or corrupted data, naming the file.
        """
        start = time.perf_counter()
        plan, stores = opened.plan, opened.stores
        # TODO(limitation): a chunk found corrupt or missing while reading raises
        # after other reads may already have landed in the targets; checking
        # every chunk first would read everything twice.
        pending: collections.deque[tuple[str, Any, np.ndarray | None, Box, int]] = collections.deque()
        problems: list[str] = []
        needed = in_flight = 0
        touched: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        chunks = {p: _read_chunk(s) for p, s in stores.items()}

        def settle_oldest() -> int:
            path, future, staged_into, box, nbytes = pending.popleft()
            try:
                value = future.result()
                if staged_into is not None:
                    cast_into(box.view(staged_into), value)
            except Exception as e:
                problems.append(f"{self.describe(path)}: {_error_text(e)}")
            return nbytes

        # TODO(limitation): object stores go through TensorStore (portable crc32c, a
        # decode buffer and a copy per chunk).
        files = opened.files
        requests = []
        packed: dict[str, dict[int, list[tuple[np.ndarray, Box, Box]]]] = {}  # pack -> byte_offset -> uses
        for tp in plan.targets:
            data = datas[tp.target]
            stored_dtype = numpy_dtype(tp.stored_dtype)
            # Reads through TensorStore write straight into a target of the stored dtype.
            direct = bool(stores) and data.dtype == stored_dtype and data.dtype.isnative
            view = ts.array(data, copy=False, write=True) if direct else None
            itemsize = stored_dtype.itemsize
            for r in tp.reads:
                if r.byte_offset is not None:
                    needed += r.stored_box.volume * itemsize
                    uses = packed.get(r.path)
                    if uses is None:
                        uses = packed[r.path] = {}
                    uses.setdefault(r.byte_offset, []).append((data, r.stored_box, r.target_box))
                    continue
                if r.path in files:
                    needed += r.stored_box.volume * itemsize
                    requests.append((files[r.path], r.stored_box, data, r.target_box))
                    continue
                src = _at(stores[r.path], r.stored_box)
                nbytes = r.stored_box.volume * itemsize
                needed += nbytes
                touched.setdefault(r.path, []).append(_chunk_span(r.stored_box, chunks[r.path]))
                if view is not None:
                    pending.append((r.path, _at(view, r.target_box).write(src), None, r.target_box, nbytes))
                else:
                    pending.append((r.path, src.read(), data, r.target_box, nbytes))
                in_flight += nbytes
                while in_flight > READ_WINDOW_BYTES and len(pending) > 1:
                    in_flight -= settle_oldest()
        while pending:
            settle_oldest()
        read_direct = 0
        if requests:
            read_direct, more = localio.Reader(localio.pool()).read(requests)
            problems += more
        if packed and not problems:
            read_direct += self._read_packed(opened, packed, problems, touched, chunks)
        if problems:
            raise StorageError(format_problems("cannot read the checkpoint's arrays", problems))
        for tp in plan.targets:
            for box in tp.padding:
                datas[tp.target][box.slices] = 0
        if stats is not None:
            stats.arrays += len(stores) + len(files)
            stats.bytes_needed += needed
            stats.bytes_read += read_direct
            for path, spans in touched.items():
                itemsize = numpy_dtype(plan.arrays[path][0]).itemsize if path in plan.arrays else 1
                stats.bytes_read += _union_volume(spans) * math.prod(chunks[path]) * itemsize
            stats.seconds += time.perf_counter() - start


    def _read_packed(self, opened: OpenedPlan, packed: dict[str, dict[int, list[tuple[np.ndarray, Box, Box]]]],
                     problems: list[str], touched: dict[str, list[Any]], chunks: dict[str, tuple[int, ...]]) -> int:
        """Fill the targets' parts of packed regions: ``packed[pack][byte_offset]``
        lists ``(target, stored_box, target_box)``. Each region's bytes are read
        once: from a local pack straight into the target when it takes the whole
        region as it is stored (all such regions in one go, each pack's reads
        starting while the next pack's are put together), otherwise through at
        most :data:`READ_WINDOW_BYTES` of staging at a time. Returns the bytes
        of chunks read through :mod:`localio`."""
        plan = opened.plan
        files = opened.files
        direct: dict[str, list[tuple[int, np.ndarray]]] = {}  # pack -> (byte_offset, target bytes)
        staged: list[tuple[str, int]] = []

        def local_packs() -> Iterator[tuple[localio.ArrayFile, list[tuple[int, np.ndarray]]]]:
            for path, regions in packed.items():
                if not _LITTLE or path not in files:
                    staged.extend((path, byte_offset) for byte_offset in regions)
                    continue
                members: list[tuple[int, np.ndarray]] = []
                stored = plan.packs[path]
                for byte_offset, uses in regions.items():
                    into = _whole_region_bytes(uses, stored[byte_offset])
                    if into is None:
                        staged.append((path, byte_offset))
                    else:
                        members.append((byte_offset, into))
                if members:
                    direct[path] = members
                    yield files[path], members

        total, more = localio.read_packs(localio.pool(), local_packs(), sum(
            r.nbytes for path in packed if path in files for r in plan.packs[path].values()))
        problems += [self._naming_members(p, opened, direct) for p in more]
        staged.sort()
        start = 0
        while start < len(staged) and not problems:
            window: dict[str, list[tuple[int, np.ndarray]]] = {}
            staged_bytes = 0
            while start < len(staged) and (not window or staged_bytes < READ_WINDOW_BYTES):
                path, byte_offset = staged[start]
                start += 1
                # TODO(limitation): a target that needs part of a packed region reads all of
                # it (fewer than pack_below bytes) and the pack chunks holding it.
                into = np.empty(plan.packs[path][byte_offset].nbytes, np.uint8)
                staged_bytes += into.nbytes
                window.setdefault(path, []).append((byte_offset, into))
            total += self._read_pack_window(opened, window, problems, touched, chunks)
            if problems:
                break
            for path, members in window.items():
                for byte_offset, into in members:
                    region = plan.packs[path][byte_offset]
                    values = _from_le(into, numpy_dtype(region.dtype)).reshape(region.box.shape)
                    for target, stored_box, target_box in packed[path][byte_offset]:
                        cast_into(target_box.view(target), stored_box.view(values))
        return total

    def _read_pack_window(self, opened: OpenedPlan, window: dict[str, list[tuple[int, np.ndarray]]],
                          problems: list[str], touched: dict[str, list[Any]],
                          chunks: dict[str, tuple[int, ...]]) -> int:
        """Read packed regions: ``window[pack]`` lists ``(byte_offset, into)``,
        each region's bytes into its ``into``; problems name the regions they
        affect. Returns the bytes of chunks read through :mod:`localio`."""
        total = 0
        local = [(opened.files[path], members) for path, members in window.items() if path in opened.files]
        pending = []
        for path, members in window.items():
            if path not in opened.files:
                for byte_offset, into in members:
                    box = Box._trusted((byte_offset,), (into.nbytes,))
                    touched.setdefault(path, []).append(_chunk_span(box, chunks[path]))
                    pending.append((path, into, _at(opened.stores[path], box).read()))
        if local:
            total, more = localio.read_packs(localio.pool(), local, sum(i.nbytes for _, m in local for _, i in m))
            problems += [self._naming_members(p, opened, window) for p in more]
        failed: dict[str, None] = {}  # each damaged chunk fails every member read from it: say it once
        for path, into, future in pending:
            try:
                into[...] = future.result()
            except Exception as e:
                failed.setdefault(f"{self.describe(path)}: {_error_text(e)}")
        problems += [self._naming_members(p, opened, window) for p in failed]
        return total

    def _naming_members(self, problem: str, opened: OpenedPlan,
                        window: dict[str, list[tuple[int, np.ndarray]]]) -> str:
        """A problem met reading a pack, with the packed regions it affects:
        those in the damaged inner chunk when the problem names one."""
        packs = opened.plan.packs
        for path, members in window.items():
            if self.describe(path) in problem or path in problem:
                regions = sorted((b, packs[path][b]) for b, _ in members)
                found = re.search(r"\(inner chunk \[(\d+)\]\)", problem)
                layout = opened.files.get(path)
                if found and layout is not None and layout.outer[0] >= layout.shape[0]:  # one file: its index
                    size = layout.chunk[0]
                    lo = int(found.group(1)) * size
                    regions = [(b, r) for b, r in regions if b < lo + size and b + r.nbytes > lo]
                names = ", ".join(f"{r.key!r} {r.box}" for _, r in regions[:5])
                more = f" and {len(regions) - 5} more" if len(regions) > 5 else ""
                return f"{problem} (packed regions it holds: {names}{more})"
        return problem


def _whole_region_bytes(uses: list[tuple[np.ndarray, Box, Box]], region: PackedRegion) -> np.ndarray | None:
    """The target's bytes when one target takes a whole packed region as it is
    stored (same dtype, contiguous, little-endian host), else None."""
    if len(uses) != 1:
        return None
    target, stored_box, target_box = uses[0]
    dtype = target.dtype
    if stored_box.shape != region.box.shape or dtype != numpy_dtype(region.dtype) or not dtype.isnative:
        return None
    out = target_box.view(target)
    if not out.flags.c_contiguous:
        return None
    return out.reshape(-1).view(np.uint8)


def _from_le(data: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Little-endian stored bytes as values of ``dtype``."""
    values = data.view(dtype)
    return values.byteswap() if sys.byteorder == "big" and dtype.itemsize > 1 else values


@dataclass(frozen=True, slots=True)
class OpenedPlan:
    """A load plan whose arrays are all open and checked: nothing read yet."""

    plan: LoadPlan
    stores: dict[str, Any]
    #: Local arrays read by :mod:`localio` instead of TensorStore.
    files: dict[str, localio.ArrayFile] = dataclasses.field(default_factory=dict)


def _wait_ready(ready: Callable[[], None] | None) -> str | None:
    """Wait until an array's data holds its values; why it never will, or None."""
    if ready is None:
        return None
    try:
        ready()
    except Exception as e:  # a failed device copy: this array is not written
        return f"its data never became ready ({type(e).__name__}: {e})"
    return None


def _short_json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."


def _chunk_span(box: Box, chunk: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chunk indices ``[lo, hi)`` a box touches, per axis."""
    return (tuple(o // c for o, c in zip(box.offset, chunk)),
            tuple(-(-(o + s) // c) for o, s, c in zip(box.offset, box.shape, chunk)))


def _union_volume(spans: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """How many chunks the spans touch together, each counted once: storage
    reads a chunk once however many targets need parts of it."""
    spans = list(set(spans))
    if len(spans) == 1:
        lo, hi = spans[0]
        return math.prod(h - l for l, h in zip(lo, hi))
    if not spans or not spans[0][0]:
        return 1 if spans else 0
    cuts = sorted({lo[0] for lo, _ in spans} | {hi[0] for _, hi in spans})
    total = 0
    for c, n in itertools.pairwise(cuts):
        active = [(lo[1:], hi[1:]) for lo, hi in spans if lo[0] <= c and hi[0] >= n]
        if active:
            total += (n - c) * _union_volume(active)
    return total


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


def _make_dirs(root: str, leaf: str, made: set[str]) -> None:
    """Create ``leaf`` and its parents below ``root``, each tried once per process
    whether or not another rank made it first (so each rank's filesystem calls
    are the same on every run)."""
    levels = []
    while leaf != root and _inside(leaf, root) and leaf not in made:
        levels.append(leaf)
        leaf = os.path.dirname(leaf)
    for level in reversed(levels):
        try:
            os.mkdir(level)
        except FileExistsError:
            if not os.path.isdir(level):
                raise
        made.add(level)


def _sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _at(store: Any, box: Box) -> Any:
    return store[box.slices] if box.ndim else store


def _read_chunk(store: Any) -> tuple[int, ...]:
    shape = store.chunk_layout.read_chunk.shape
    return tuple(shape) if shape is not None else tuple(store.shape)
