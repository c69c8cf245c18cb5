"""A standalone copy of a checkpoint: every array it stores, and every array
it references in its bases (spec section 5.2), copied under one new save of
the destination, so that the copy loads without the bases. Chunks are copied
byte for byte (their checksums with them); only each array's attributes
change, to name the copy's save (spec section 5). The copy is read back and
checked before it commits."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Callable, Iterable
from typing import Any

from globalshard.checkpoint import cleanup
from globalshard.checkpoint.bases import check_bases
from globalshard.checkpoint.commit import what_is_there
from globalshard.checkpoint.loading import read_metadata
from globalshard.errors import GlobalShardError, LayoutError, MetadataError, StorageError, format_problems
from globalshard.format.metadata import Metadata, StoredRegion, TensorMetadata
from globalshard.format.paths import (
    METADATA_FILE,
    SAVES_DIR,
    TRAINER_STATE_FILE,
    array_dirs,
    arrays_prefix,
    new_save_id,
    pack_path,
    save_dir,
)
from globalshard.format.trainer_state import parse_trainer_state
from globalshard.format.zarr import PackExpect, array_attributes
from globalshard.io import open_engine
from globalshard.store import Store, open_root
from globalshard.store.base import copy_file

__all__ = ["copy"]

ZARR_JSON = "zarr.json"


def copy(source: Any, destination: Any, *, kvstore: Any = None, overwrite: bool = False,
         progress: Callable[[int], None] | None = None, drop: Iterable[str] = ()) -> Metadata:
    """Copy the checkpoint at ``source`` to ``destination`` (paths, URLs or
    kvstore specs, as for :func:`~globalshard.save`; with ``kvstore``, both
    inside it), whole: the arrays it references in its bases are copied too,
    so the copy stands alone (no ``bases``), as one new save committed
    atomically. One process; the trainer state comes along unchanged.
    ``progress``, if given, is called with each region's bytes once copied
    (their sum: the regions' ``nbytes``). ``drop``: keys (or ``fnmatch``
    patterns) left out of the copy, such as a release's optimizer state
    (``"optimizer.*"``); the trainer state still comes whole. Returns the
    copy's metadata.

    Raises:
        LayoutError: a ``drop`` pattern matches no key, or a dropped key
            shares a pack with a kept one (its bytes would come along).
        CheckpointNotFoundError: ``source`` holds no checkpoint.
        StorageError: a base of ``source`` is gone or was replaced (named),
            ``destination`` is ``source`` or one of its bases, an array does
            not read back whole, or a file cannot be read or written;
            nothing is committed then.
        MetadataError: the trainer state is missing or does not match its
            record (size, SHA-256).
        CheckpointExistsError: ``destination`` holds a checkpoint or other
            files, unless ``overwrite``.
    """
    src, dst = open_root(source, kvstore), open_root(destination, kvstore)
    if repr(src) == repr(dst):
        raise StorageError(f"cannot copy {src} onto itself")
    metadata = without_keys(read_metadata(source, kvstore=kvstore), drop)
    if src.sibling_name(dst) in {b.root for b in metadata.bases}:
        raise StorageError(f"{dst} is a base of {src}: replacing it would leave {src} unreadable; copy elsewhere")
    needed: dict[int, list[tuple[str, StoredRegion]]] = {}
    for key, t in metadata.tensors.items():
        for r in t.regions:
            if r.base is not None:
                needed.setdefault(r.base, []).append((key, r))
    holders = check_bases(src, metadata, needed)  # each base still holds the save referenced, and the regions
    save_id = new_save_id()
    with dst.lock():
        link = dst.linked_component(SAVES_DIR)
        if link is not None:
            raise StorageError(f"{dst.describe(link)} is a symbolic link; a copy writes nothing through links")
        previous, stamp = what_is_there(dst, overwrite)
        try:
            copied, origins = _copy_arrays(src, dst, metadata, holders, save_id, progress or (lambda n: None))
            _verify(dst, copied, origins)  # every chunk there and checksummed: a damaged source is not committed
            if metadata.trainer_state is not None:  # its bytes unchanged: its size and SHA-256 hold
                data = src.read(metadata.trainer_state.path)
                if data is None:
                    raise MetadataError(f"{src.describe(METADATA_FILE)} records a trainer state at "
                                        f"{metadata.trainer_state.path}, but it is missing")
                parse_trainer_state(data, metadata.trainer_state)  # its size and SHA-256, as a load checks them
                ref = dataclasses.replace(metadata.trainer_state, path=f"{save_dir(save_id)}/{TRAINER_STATE_FILE}")
                dst.write(ref.path, data)
                copied = dataclasses.replace(copied, trainer_state=ref)
            dst.commit(METADATA_FILE, copied.dumps().encode("utf-8"), stamp)
        except BaseException:
            cleanup.remove_quietly(dst, save_dir(save_id))
            raise
        cleanup.remove_superseded(dst, previous, save_id)
    return copied


def without_keys(metadata: Metadata, drop: Iterable[str], verb: str = "drop",
                 refusal: str = "cannot copy without these keys") -> Metadata:
    """``metadata`` without the keys ``drop`` matches (its ``bases`` as they are:
    a region's ``base`` indexes them); ``verb`` and ``refusal`` word its errors."""
    patterns = [drop] if isinstance(drop, str) else list(drop)
    if not patterns:
        return metadata
    dropped = {k for k in metadata.tensors if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
    problems = [f"{verb} {p!r} matches no key of {len(metadata.tensors)}" for p in patterns
                if not any(fnmatch.fnmatchcase(k, p) for k in metadata.tensors)]
    packs: dict[tuple[int | None, str], set[str]] = {}
    for key, t in metadata.tensors.items():
        for r in t.regions:
            if r.byte_offset is not None:
                packs.setdefault((r.base, r.path), set()).add(key)
    for (_, path), keys in sorted(packs.items(), key=lambda kv: kv[0][1]):
        if keys & dropped and keys - dropped:
            problems.append(f"{sorted(keys & dropped)[:3]} share the pack {path} with kept keys "
                            f"{sorted(keys - dropped)[:3]}: drop them all, or none")
    if problems:
        raise LayoutError(format_problems(refusal, problems))
    return dataclasses.replace(metadata, tensors={k: t for k, t in metadata.tensors.items() if k not in dropped})


def _copy_arrays(src: Store, dst: Store, metadata: Metadata, holders: dict[int, Store], save_id: str,
                 progress: Callable[[int], None]) -> tuple[Metadata, dict[str, str]]:
    """Copy every array (and pack) the regions name into ``save_id``'s
    directory of ``dst`` (``progress`` told each region's bytes once copied);
    the metadata naming the copies, and where each copy came from."""
    dirs = array_dirs(list(metadata.tensors))
    moved: dict[tuple[int | None, str], str] = {}  # (base or None, path) -> the copy's path
    packs = 0
    origins: dict[str, str] = {}
    tensors = {}
    for key in sorted(metadata.tensors):
        t = metadata.tensors[key]
        regions = []
        for n, r in enumerate(t.regions):
            where = (r.base, r.path)
            if where not in moved:
                if r.byte_offset is None:
                    moved[where] = f"{arrays_prefix(save_id)}{dirs[key]}/{n}"
                else:  # a pack, once for all its members
                    moved[where], packs = pack_path(save_id, 0, packs), packs + 1
                holder = holders[r.base] if r.base is not None else src
                ours = array_attributes(key, r.box.offset, save_id) if r.byte_offset is None else None
                _copy_array(holder, r.path, dst, moved[where], save_id, ours)
                origins[moved[where]] = holder.describe(r.path)
            progress(r.nbytes)
            regions.append(StoredRegion(r.box, moved[where], r.nbytes, r.byte_offset, None, r.sha256))
        tensors[key] = TensorMetadata(t.dtype, t.global_shape, tuple(regions))
    return Metadata(tensors, save_id=save_id), origins


def _verify(store: Store, metadata: Metadata, origins: dict[str, str]) -> None:
    """Read back every array of ``metadata`` in ``store``, checking its
    attributes, that every chunk is there and its crc32c.

    Raises:
        StorageError: naming the key and the array it was copied from.
    """
    engine = open_engine(store)
    packs: dict[str, list[tuple[str, tuple[int, ...], int, int]]] = {}
    save_id = metadata.save_id
    assert save_id is not None
    for key, t in sorted(metadata.tensors.items()):
        for r in t.regions:
            if r.byte_offset is not None:
                packs.setdefault(r.path, []).append((key, r.box.offset, r.byte_offset, r.nbytes))
                continue
            try:
                engine.verify(r.path, t.dtype, r.box.shape, array_attributes(key, r.box.offset, save_id))
            except GlobalShardError as e:
                raise StorageError(f"{key!r} {r.box} copied from {origins[r.path]} does not read back whole "
                                   f"(is the source damaged? globalshard verify checks it): {e}") from None
    for path, members in packs.items():
        try:
            engine.verify(path, "uint8", None, PackExpect(save_id, tuple(sorted(members, key=lambda m: m[2]))))
        except GlobalShardError as e:
            raise StorageError(f"the pack copied from {origins[path]} does not read back whole: {e}") from None


def _copy_array(src: Store, path: str, dst: Store, to: str, save_id: str, ours: dict[str, Any] | None) -> None:
    """Copy the array at ``path`` of ``src`` to ``to`` in ``dst``, its chunks as
    they are, its attributes ``ours`` (a region's array, of any version) or,
    for a pack, its own naming ``save_id``."""
    files = src.files(path)
    if f"{path}/{ZARR_JSON}" not in files:
        raise StorageError(f"{src.describe(path)}: no {ZARR_JSON}, so no array to copy")
    for name in files:
        if name != f"{path}/{ZARR_JSON}":  # a shard: its bytes as they are, a piece at a time
            if not copy_file(src, name, dst, to + name[len(path):]):
                raise StorageError(f"{src.describe(name)} disappeared while it was being copied")
            continue
        data = src.read(name)
        if data is None:
            raise StorageError(f"{src.describe(name)} disappeared while it was being copied")
        doc = json.loads(data)
        attributes = doc.setdefault("attributes", {})
        if ours is not None:  # version 1 arrays had none: the copy is a version 2 checkpoint
            attributes["globalshard"] = ours
        elif isinstance(attributes.get("globalshard"), dict):  # a pack keeps its members
            attributes["globalshard"]["save_id"] = save_id
        else:
            raise StorageError(f"{src.describe(name)}: a pack without its 'globalshard' attributes")
        dst.write(to + name[len(path):], json.dumps(doc, indent=1).encode("utf-8"))

