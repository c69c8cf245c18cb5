"""Stored arrays (spec section 5): the one zarr.json writer, chunk shapes,
the checksum rule, and what an array says of itself.

Each stored region is one zarr v3 array: one chunk holding the whole region,
``[bytes (little-endian), crc32c]``, when it is at most :data:`CHUNK_BYTES`;
otherwise one ``sharding_indexed`` shard holding the whole region, split into
inner chunks of at most :data:`CHUNK_BYTES`, each and the shard index carrying
a crc32c, so a load reads only the inner chunks it needs.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from globalshard.dtypes import numpy_dtype

__all__ = ["ATTRIBUTE", "CHUNK_BYTES", "PackExpect", "array_attributes", "attribute_problem", "chunk_shape",
           "is_checksummed", "le_bytes", "from_le", "pack_attributes", "zarr_json"]

#: Upper bound on the bytes of one (inner) chunk: the unit a load reads.
CHUNK_BYTES = 1 << 20

#: The member of a stored array's zarr.json attributes that names its key, box and save.
ATTRIBUTE = "globalshard"


def chunk_shape(shape: Sequence[int], itemsize: int, limit: int | None = None, *,
                cut: Sequence[int] = ()) -> tuple[int, ...]:
    """The inner chunk shape for a stored region of at most ``limit`` bytes.

    ``cut``: the axes along which the region is a part of its tensor. A region
    cut along its first axis only (TP of a column-parallel weight, FSDP, or
    both) is mostly loaded cut along that axis too: it gets chunks of whole
    rows, the region's rows split evenly into as few chunks as fit (a shard
    stores every inner chunk whole, so an uneven last chunk would store
    padding), which are contiguous pieces of such targets and are read
    straight into them, with no waste whatever the new degree. Any other
    region (or one whose rows exceed ``limit``) has its longest axis halved
    until the chunk fits: near-cubic chunks keep the waste small whichever
    axis a load cuts.

    >>> chunk_shape((4096, 4096), 4)
    (512, 512)
    >>> chunk_shape((4096, 4096), 4, cut=(0,))
    (64, 4096)
    >>> chunk_shape((256, 3640), 4, cut=(0,))  # 72 rows fit: 4 chunks of 64, not 3 of 72 and one of 40
    (64, 3640)
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
            chunks = -(-shape[0] // (limit // row))
            return (-(-shape[0] // chunks), *shape[1:])
    chunk = list(shape)
    while chunk and math.prod(chunk) * itemsize > limit and max(chunk) > 1:
        axis = chunk.index(max(chunk))
        chunk[axis] = -(-chunk[axis] // 2)
    return tuple(chunk)


def _bytes_codec(itemsize: int) -> dict[str, Any]:
    return {"name": "bytes"} if itemsize == 1 else {"name": "bytes", "configuration": {"endian": "little"}}


def _fill_value(dtype: str) -> Any:
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    if dtype.startswith(("int", "uint")):
        return 0
    return 0.0


def zarr_json(dtype: str, shape: Sequence[int], attributes: dict[str, Any], *,
              cut: Sequence[int] = ()) -> dict[str, Any]:
    """The zarr.json of a stored region holding ``attributes`` (under
    :data:`ATTRIBUTE`): one chunk of the whole region, or one shard of it
    split into :func:`chunk_shape` chunks (``cut`` as there)."""
    shape = tuple(shape)
    inner = chunk_shape(shape, numpy_dtype(dtype).itemsize, cut=cut)
    # TODO(limitation): no compression codec; zarr3 allows zstd/blosc before crc32c.
    plain = [_bytes_codec(numpy_dtype(dtype).itemsize), {"name": "crc32c"}]
    if inner == shape:
        grid, codecs = list(shape), plain
    else:
        grid = [-(-s // c) * c for s, c in zip(shape, inner)]
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(inner), "codecs": plain, "index_location": "end",
            "index_codecs": [_bytes_codec(8), {"name": "crc32c"}]}}]
    return {
        "zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": _fill_value(dtype), "codecs": codecs, "attributes": {ATTRIBUTE: attributes},
    }


def is_checksummed(codecs: Any) -> bool:
    """Whether a zarr v3 codec chain covers every stored byte with crc32c
    (spec section 5: an array that does not is never read)."""
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
        return is_checksummed(conf.get("codecs")) and "crc32c" in [
            c.get("name") for c in conf.get("index_codecs") or [] if isinstance(c, dict)]
    return False


def array_attributes(key: str, offset: Sequence[int], save_id: str) -> dict[str, Any]:
    """What a stored array says of itself (spec section 5): checked on load."""
    return {"key": key, "offset": [int(o) for o in offset], "save_id": save_id}


def pack_attributes(save_id: str, members: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """What a pack says of itself (spec section 5.1): its save and members
    ``[key, offset, byte_offset, nbytes]``; checked on load."""
    return {"save_id": save_id, "members": [[k, [int(o) for o in off], int(b), int(n)] for k, off, b, n in members]}


@dataclass(frozen=True, slots=True)
class PackExpect:
    """What a pack a load reads must say of itself: its save, and (at least)
    these members, each ``[key, offset, byte_offset, nbytes]``."""

    save_id: str
    members: tuple[tuple[str, tuple[int, ...], int, int], ...]


#: What an array a load reads must say of itself: its :func:`array_attributes`,
#: a :class:`PackExpect` for a pack, or None (version 1 records nothing).
Expect = dict[str, Any] | PackExpect | None


def _member(entry: Any) -> tuple[Any, ...] | None:
    """A pack's ``[key, offset, byte_offset, nbytes]`` entry as a tuple, or None
    unless it is exactly that: a string, a list of integers, two integers
    (``64.0`` or ``true`` is not an integer of this format)."""
    if type(entry) is list and len(entry) == 4 and type(entry[0]) is str and type(entry[1]) is list \
            and type(entry[2]) is int and type(entry[3]) is int and all(type(v) is int for v in entry[1]):
        return (entry[0], tuple(entry[1]), entry[2], entry[3])
    return None


def attribute_problem(where: str, attributes: Any, shape: tuple[int, ...], want: Expect) -> str | None:
    """Why an array's zarr.json ``attributes`` do not name what metadata.json
    expects of the array at ``where`` (named in the message), or None."""
    got = attributes.get(ATTRIBUTE) if isinstance(attributes, dict) else None
    if isinstance(want, PackExpect):
        if not isinstance(got, dict) or got.get("save_id") != want.save_id:
            saved = got.get("save_id") if isinstance(got, dict) else None
            return (f"{where}: the pack says it belongs to save {short_json(saved)}, "
                    f"metadata.json expects {want.save_id}")
        listed = got.get("members")
        members = {_member(m) for m in listed} if isinstance(listed, list) else set()
        size = shape[0] if len(shape) == 1 else 0
        for key, offset, byte_offset, nbytes in want.members:
            entry = [key, list(offset), byte_offset, nbytes]
            if (key, tuple(offset), byte_offset, nbytes) not in members:
                return (f"{where}: the pack does not list {short_json(entry)} "
                        "([key, offset, byte_offset, nbytes]) as metadata.json expects")
            if byte_offset + nbytes > size:
                return (f"{where}: {key!r} at byte {byte_offset} ({nbytes} bytes) lies past the "
                        f"end of the pack ({size} bytes)")
        return None
    if want is not None and got != want:
        return f"{where}: the array says it holds {short_json(got)}, metadata.json expects {short_json(want)}"
    return None


def short_json(value: Any) -> str:
    """``value`` as JSON, cut to 200 characters for a message."""
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."


_LITTLE = sys.byteorder == "little"


def le_bytes(array: np.ndarray) -> np.ndarray:
    """A packed region's bytes (spec section 5.1): its elements in C order,
    little-endian; a view of ``array`` when it already is that."""
    if _LITTLE and array.flags.c_contiguous and array.dtype.isnative:  # the usual case, in two steps
        return array.reshape(-1).view(np.uint8)
    flat = np.ascontiguousarray(array).reshape(-1)
    if not flat.dtype.isnative:
        flat = flat.astype(flat.dtype.newbyteorder("="))
    if not _LITTLE:  # the format's bytes are little-endian
        flat = flat.byteswap()
    return flat.view(np.uint8)


def from_le(data: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Little-endian stored bytes (:func:`le_bytes`) as values of ``dtype``."""
    values = data.view(dtype)
    return values.byteswap() if not _LITTLE and dtype.itemsize > 1 else values
