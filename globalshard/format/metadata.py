"""metadata.json: the model, the strict parser, the writer.

``spec/FORMAT.md`` is the normative description; this module follows it. The
parser trusts nothing: every field is type-checked, every integer must be a
non-negative JSON integer below 2**63, every dtype name must be known (there is
no fallback), stored regions of a key must cover its global shape exactly once,
and every path must stay inside the checkpoint. All problems found are
reported together, each with its JSON path, in one :class:`MetadataError`.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from globalshard.dtypes import SUPPORTED_DTYPES, numpy_dtype
from globalshard.errors import LayoutError, MetadataError, format_problems
from globalshard.format.paths import HEX_DIGITS, METADATA_FILE, SAVES_DIR, TRAINER_STATE_FILE, is_save_id
from globalshard.format.strict_json import is_unicode, json_type, loads, member_path, short
from globalshard.format.trainer_state import MAX_DEPTH, TrainerStateRef, dump_trainer_state, parse_trainer_state
from globalshard.geometry import Box, cover_problems

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "TRAINER_STATE_FILE",
    "BaseRef",
    "Metadata",
    "StoredRegion",
    "TensorMetadata",
    "TrainerStateRef",
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_RANK",
    "READABLE_VERSIONS",
    "check_base_root",
    "check_relative_path",
    "is_save_id",
    "dump_trainer_state",
    "parse_metadata",
    "parse_trainer_state",
]

FORMAT_NAME = "globalshard"
FORMAT_VERSION = 2
#: Versions this library reads (spec/FORMAT.md section 2.4 for version 1).
READABLE_VERSIONS = (1, 2)
_RESERVED = frozenset({METADATA_FILE, TRAINER_STATE_FILE})
_MAX_INT = 2**63 - 1
#: TensorStore's limit on the rank of an array.
MAX_RANK = 32
#: The largest metadata.json or trainer state this library reads.
MAX_FILE_BYTES = 256 << 20


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: parsing, planning, saving and
    loading build many small objects and no cycles, and in a trainer holding
    millions of Python objects each collection the allocations trigger walks
    all of them. Process-wide while it lasts (other threads' cycles wait for
    it); not used by the background part of an asynchronous save."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


@dataclass(frozen=True, slots=True)
class StoredRegion:
    """One stored region: the global ``box`` it holds and where it lives.

    ``byte_offset`` None: ``path`` is the region's own array. Otherwise the
    region is packed: bytes ``[byte_offset, byte_offset + nbytes)`` of the
    pack (a 1-d uint8 array) at ``path`` (spec/FORMAT.md section 5.1).
    ``base``: None, the array is this checkpoint's; else the index of the
    base checkpoint (:attr:`Metadata.bases`) that stores it (section 5.2).
    ``sha256``: the SHA-256 of the region's bytes, when the writer recorded it.
    """

    box: Box
    path: str
    nbytes: int
    byte_offset: int | None = None
    base: int | None = None
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class BaseRef:
    """A base checkpoint (spec/FORMAT.md section 5.2): the sibling root
    ``root`` as it was at save ``save_id``."""

    root: str
    save_id: str


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    """Everything stored about one checkpoint key."""

    dtype: str
    global_shape: tuple[int, ...]
    regions: tuple[StoredRegion, ...]


@dataclass(frozen=True, slots=True)
class Metadata:
    """The parsed metadata.json of a checkpoint.

    ``tensors`` maps checkpoint keys to their :class:`TensorMetadata`;
    ``save_id`` names the save that wrote it (None in version 1).
    """

    tensors: Mapping[str, TensorMetadata]
    trainer_state: TrainerStateRef | None = None
    version: int = FORMAT_VERSION
    save_id: str | None = None
    #: The base checkpoints some regions are stored in (spec section 5.2).
    bases: tuple[BaseRef, ...] = ()

    def __post_init__(self) -> None:
        if self.version not in READABLE_VERSIONS:
            raise MetadataError(f"format version {self.version} is not one of {READABLE_VERSIONS}")
        if (self.version >= 2) != is_save_id(self.save_id):
            raise MetadataError(f"format version {self.version} with save_id {self.save_id!r}: version 2 "
                                "needs 32 lowercase hex digits, version 1 none")

    def stored_bytes(self) -> int:
        """Bytes of array data the checkpoint stores itself (checksums, metadata and bases aside)."""
        return sum(r.nbytes for t in self.tensors.values() for r in t.regions if r.base is None)

    def paths(self) -> list[str]:
        """Every path this checkpoint stores itself, each once: its arrays, packs
        and trainer state (not the arrays of its bases)."""
        out = list(dict.fromkeys(r.path for t in self.tensors.values() for r in t.regions if r.base is None))
        if self.trainer_state is not None:
            out.append(self.trainer_state.path)
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON document, keys and regions in a canonical order."""
        tensors = {}
        for key in sorted(self.tensors):
            t = self.tensors[key]
            tensors[key] = {
                "dtype": t.dtype,
                "global_shape": list(t.global_shape),
                "regions": [_region_json(r) for r in
                            (t.regions if len(t.regions) == 1 else sorted(t.regions, key=lambda r: r.box.offset))],
            }
        ts: dict[str, Any] | None = None
        if self.trainer_state is not None:
            ts = {"nbytes": self.trainer_state.nbytes, "sha256": self.trainer_state.sha256}
            if self.version >= 2:
                ts = {"path": self.trainer_state.path, **ts}
        if self.version == 1:
            return {"format": FORMAT_NAME, "version": 1, "tensors": tensors, "trainer_state": ts}
        out = {"format": FORMAT_NAME, "version": self.version, "save_id": self.save_id, "tensors": tensors,
               "trainer_state": ts}
        if self.bases:
            out["bases"] = [{"root": b.root, "save_id": b.save_id} for b in self.bases]
        return out

    def dumps(self) -> str:
        """Serialise to the text of metadata.json."""
        return json.dumps(self.to_json(), separators=(",", ":")) + "\n"


def _region_json(r: StoredRegion) -> dict[str, Any]:
    out: dict[str, Any] = {"offset": list(r.box.offset), "shape": list(r.box.shape), "path": r.path,
                           "nbytes": r.nbytes}
    if r.byte_offset is not None:
        out["byte_offset"] = r.byte_offset
    if r.base is not None:
        out["base"] = r.base
    if r.sha256 is not None:
        out["sha256"] = r.sha256
    return out


#: What a base's root may not hold (spec section 5.2): a separator, a backslash, a control character.
_BAD_ROOT = re.compile(r"[/\\\x00-\x1f\x7f]")


def check_base_root(root: Any) -> str | None:
    """Why ``root`` cannot name a base (spec section 5.2), or None if it can."""
    if not isinstance(root, str) or not root:
        return f"must be a non-empty string, got {short(root)}"
    if root in (".", "..") or _BAD_ROOT.search(root) or len(root) > 255 or not is_unicode(root):
        return f"{short(root)} is not one path component (no '/', '\\', control character, '.' or '..')"
    return None


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= HEX_DIGITS


#: A drive letter (``C:``), which would make a path absolute on Windows.
_DRIVE = re.compile(r"[A-Za-z]:")

#: A backslash or a control character: never in a stored path.
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f\\]")


def check_relative_path(path: Any) -> str | None:
    """Why ``path`` may not name stored data inside a checkpoint, or None if it may.

    Paths are relative, ``/``-separated, valid Unicode, with no empty, ``.`` or
    ``..`` component, no backslash or control character, and never under a
    name reserved at the root.
    """
    if not isinstance(path, str):
        return f"must be a string, got {type(path).__name__}"
    if not path or len(path) > 4096:
        return "must be a non-empty string of at most 4096 characters"
    if not is_unicode(path):
        return f"{path!r} is not valid Unicode (a lone surrogate)"
    if path.startswith("/") or _DRIVE.match(path):
        return f"{path!r} is absolute; paths are relative to the checkpoint"
    if _FORBIDDEN.search(path):
        return f"{path!r} holds a backslash or a control character"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return f"{path!r} has an empty, '.' or '..' component"
    if parts[0] in _RESERVED:
        return f"{path!r} would collide with {parts[0]}"
    return None


class _Parser:
    def __init__(self) -> None:
        self.problems: list[str] = []
        self._paths: dict[str, str | None] = {}  # check_relative_path of each path seen (packs share theirs)

    def path_problem(self, path: Any) -> str | None:
        if type(path) is not str:
            return check_relative_path(path)
        if path not in self._paths:
            self._paths[path] = check_relative_path(path)
        return self._paths[path]

    def bad(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")

    def obj(self, value: Any, where: str, required: tuple[str, ...],
            optional: tuple[str, ...] = ()) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.bad(where, f"must be an object, got {json_type(value)}")
            return None
        for k in required:
            if k not in value:
                self.bad(where, f"missing field {k!r}")
        for k in value:
            if k not in required and k not in optional:
                self.bad(f"{where}.{k}", "unknown field")
        return value

    def uint(self, value: Any, where: str) -> int | None:
        if type(value) is not int:
            self.bad(where, f"must be a non-negative integer, got {json_type(value)} {short(value)}")
            return None
        if not 0 <= value <= _MAX_INT:
            self.bad(where, f"{value} is outside [0, 2**63 - 1]")
            return None
        return value

    def uints(self, value: Any, where: str, length: int | None = None) -> tuple[int, ...] | None:
        if type(value) is list and (length is None or len(value) == length):
            for v in value:  # the usual case, without a call per integer
                if type(v) is not int or not 0 <= v <= _MAX_INT:
                    break
            else:
                return tuple(value)
        if not isinstance(value, list):
            self.bad(where, f"must be an array of integers, got {json_type(value)}")
            return None
        out = [self.uint(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if any(v is None for v in out):
            return None
        if length is not None and len(out) != length:
            self.bad(where, f"has {len(out)} entries, expected {length}")
            return None
        return tuple(v for v in out if v is not None)


def parse_metadata(data: bytes | str, *, source: str = METADATA_FILE, fast: bool = True) -> Metadata:
    """Parse and validate the text of a metadata.json (format version 2, or 1).

    ``fast=False`` takes every tensor through the general checks (the result
    is the same: tests compare the two).

    Raises:
        MetadataError: listing every problem found, each with its JSON path
        (``$.tensors["w"].regions[2].offset[0]``).
    """
    with gc_paused():
        return _parse_metadata(data, source, fast)


def _whose(doc: Any) -> str:
    """What a metadata.json another library wrote is, when it says (Megatron-Core's
    dist_checkpointing names its backends), and where globalshard's part is."""
    if not isinstance(doc, dict) or not isinstance(doc.get("sharded_backend"), str):
        return ""
    backend = doc["sharded_backend"]
    where = " (its globalshard checkpoint is the 'globalshard' directory beside this file)" \
        if backend == "globalshard" else ""
    return f": it is Megatron-Core dist_checkpointing's, sharded backend {backend[:80]!r}{where}"


def _parse_metadata(data: bytes | str, source: str, fast: bool) -> Metadata:
    doc = loads(data, source, strict_integers=True)
    p = _Parser()
    version = doc.get("version") if isinstance(doc, dict) else None
    known = type(version) is int and version in READABLE_VERSIONS
    members = ("format", "version", "tensors", "trainer_state") if version == 1 else \
        ("format", "version", "save_id", "tensors", "trainer_state")
    top = p.obj(doc, "$", members, ("bases",) if version == 2 else ()) if known or not isinstance(doc, dict) \
        else doc
    if top is None:
        raise MetadataError(format_problems(f"{source} is not a globalshard metadata document", p.problems))
    if top.get("format") != FORMAT_NAME:
        p.bad("$.format", f"must be {FORMAT_NAME!r}, got {short(top.get('format'))}")
    if not known:
        p.bad("$.version", f"unsupported format version {short(version)}; this library reads versions "
                           f"{', '.join(map(str, READABLE_VERSIONS))}")
    if p.problems:
        raise MetadataError(format_problems(f"{source} is not a globalshard metadata document{_whose(doc)}",
                                            p.problems))
    assert isinstance(version, int)
    save_id = None
    if version >= 2:
        save_id = top.get("save_id")
        if not is_save_id(save_id):
            p.bad("$.save_id", f"must be 32 lowercase hex digits, got {short(save_id)}")

    bases = _parse_bases(p, top.get("bases", []), save_id)
    tensors: dict[str, TensorMetadata] = {}
    raw_tensors = top.get("tensors")
    if not isinstance(raw_tensors, dict):
        p.bad("$.tensors", f"must be an object, got {json_type(raw_tensors)}")
        raw_tensors = {}
    all_paths: dict[str, str | _RegionAt] = {}
    # pack path -> (byte_offset, end, JSON path) of its members
    packs: dict[str, list[tuple[int, int, str | _RegionAt]]] = {}
    for key, raw in raw_tensors.items():
        if not key:
            p.bad(member_path("$.tensors", key), "a checkpoint key may not be empty")
        elif not is_unicode(key):
            p.bad(member_path("$.tensors", key), "a checkpoint key must be valid Unicode (it holds a lone surrogate)")
            continue
        t = _whole_tensor(p, key, raw, all_paths, packs, version) if fast else None
        if t is None:
            t = _parse_tensor(p, raw, member_path("$.tensors", key), all_paths, packs, version, bases)
        if t is not None:
            tensors[key] = t

    ts_ref = None
    raw_ts = top.get("trainer_state")
    if raw_ts is not None:
        fields = ("nbytes", "sha256") if version == 1 else ("path", "nbytes", "sha256")
        o = p.obj(raw_ts, "$.trainer_state", fields)
        if o is not None:
            nbytes = p.uint(o.get("nbytes"), "$.trainer_state.nbytes")
            digest = o.get("sha256")
            ts_path = TRAINER_STATE_FILE
            if version >= 2:
                raw_path = o.get("path")
                why = check_relative_path(raw_path)
                if why is not None:
                    p.bad("$.trainer_state.path", why)
                elif raw_path in all_paths:
                    p.bad("$.trainer_state.path", f"{raw_path!r} is also used by {all_paths[raw_path]}")
                else:
                    ts_path = str(raw_path)
                    all_paths[ts_path] = "$.trainer_state"
            if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= HEX_DIGITS):
                p.bad("$.trainer_state.sha256", "must be 64 lowercase hex digits")
            elif nbytes is not None:
                ts_ref = TrainerStateRef(nbytes, digest, ts_path)
    _check_nesting(p, all_paths)
    _check_packs(p, packs)
    used = {r.base for t in tensors.values() for r in t.regions}
    for i, b in enumerate(bases):
        if i not in used and not p.problems:
            p.bad(f"$.bases[{i}]", f"base {b.root!r} is used by no region")
    if p.problems:
        raise MetadataError(format_problems(f"{source} is invalid", p.problems))
    return Metadata(tensors, ts_ref, version, save_id, tuple(bases))


def _parse_bases(p: _Parser, raw: Any, save_id: Any) -> list[BaseRef]:
    if not isinstance(raw, list):
        p.bad("$.bases", f"must be an array, got {json_type(raw)}")
        return []
    out: list[BaseRef] = []
    roots: dict[str, int] = {}
    for i, b in enumerate(raw):
        where = f"$.bases[{i}]"
        o = p.obj(b, where, ("root", "save_id"))
        if o is None:
            continue
        root, sid = o.get("root"), o.get("save_id")
        why = check_base_root(root)
        if why is not None:
            p.bad(f"{where}.root", why)
        elif root in roots:
            p.bad(f"{where}.root", f"{short(root)} is also $.bases[{roots[root]}]")
        if not is_save_id(sid):
            p.bad(f"{where}.save_id", f"must be 32 lowercase hex digits, got {short(sid)}")
        elif sid == save_id:
            p.bad(f"{where}.save_id", "is this checkpoint's own save_id")
        if why is None and is_save_id(sid) and root not in roots:
            roots[str(root)] = i
            out.append(BaseRef(str(root), str(sid)))
        else:
            out.append(BaseRef("", "0" * 32))  # a placeholder: the index still names it, the parse fails
    return out


#: Each dtype's item size, and the members of a tensor and of a region.
_ITEMSIZE = {name: numpy_dtype(name).itemsize for name in SUPPORTED_DTYPES}
_TENSOR_FIELDS = frozenset(("dtype", "global_shape", "regions"))
_REGION_FIELDS = frozenset(("offset", "shape", "path", "nbytes"))
_PACKED_FIELDS = _REGION_FIELDS | {"byte_offset"}


class _RegionAt:
    """``$.tensors[key].regions[0]``, spelled out only for a message."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __str__(self) -> str:
        return f"{member_path('$.tensors', self.key)}.regions[0]"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _whole_tensor(p: _Parser, key: str, raw: Any, all_paths: dict[str, str | _RegionAt],
                  packs: dict[str, list[tuple[int, int, str | _RegionAt]]], version: int) -> TensorMetadata | None:
    """The commonest tensor, one non-empty region holding all of it, checked in
    few steps; None for anything else, valid or not, which
    :func:`_parse_tensor` then checks (and names the problems of)."""
    if type(raw) is not dict or raw.keys() != _TENSOR_FIELDS:
        return None
    dtype, shape, regions = raw["dtype"], raw["global_shape"], raw["regions"]
    itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None or type(shape) is not list or len(shape) > MAX_RANK or type(regions) is not list \
            or len(regions) != 1:
        return None
    r = regions[0]
    if type(r) is not dict:
        return None
    fields: Any = r.keys()
    sha256 = None
    if "sha256" in fields:  # recorded by a save that may be a base (section 5.2)
        sha256 = r["sha256"]
        if version < 2 or not _is_sha256(sha256):
            return None
        fields = fields - {"sha256"}
    packed = fields == _PACKED_FIELDS and version >= 2
    if not packed and fields != _REGION_FIELDS:
        return None
    offset, path, nbytes = r["offset"], r["path"], r["nbytes"]
    byte_offset = r["byte_offset"] if packed else None
    volume = itemsize
    for v in shape:  # bool is not int here, nor is 1.0
        if type(v) is not int or not 0 < v <= _MAX_INT:
            return None
        volume *= v
    if volume > _MAX_INT or type(nbytes) is not int or nbytes != volume or r["shape"] != shape \
            or type(offset) is not list or len(offset) != len(shape) or type(path) is not str \
            or p.path_problem(path) is not None:
        return None
    for v in offset:  # each a 0 of type int (not False, nor 0.0)
        if type(v) is not int or v:
            return None
    for v in r["shape"]:  # equal to shape's ints, but maybe True or 1.0
        if type(v) is not int:
            return None
    if packed:
        if type(byte_offset) is not int or not 0 <= byte_offset <= _MAX_INT:
            return None
        if path in all_paths and path not in packs:
            return None
        at = _RegionAt(key)
        all_paths.setdefault(path, at)
        packs.setdefault(path, []).append((byte_offset, byte_offset + nbytes, at))
    elif path in all_paths:
        return None
    else:
        all_paths[path] = _RegionAt(key)
    gshape = tuple(shape)
    return TensorMetadata(dtype, gshape, (StoredRegion(Box._trusted((0,) * len(gshape), gshape), path, nbytes,
                                                       byte_offset, None, sha256),))


def _parse_tensor(p: _Parser, raw: Any, where: str, all_paths: dict[str, str | _RegionAt],
                  packs: dict[str, list[tuple[int, int, str | _RegionAt]]], version: int,
                  bases: Sequence[BaseRef] = ()) -> TensorMetadata | None:
    o = p.obj(raw, where, ("dtype", "global_shape", "regions"))
    if o is None:
        return None
    before = len(p.problems)
    dtype = o.get("dtype")
    itemsize = None
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
        p.bad(f"{where}.dtype", f"unknown dtype {short(dtype)}; known: {', '.join(SUPPORTED_DTYPES)}")
    else:
        itemsize = numpy_dtype(dtype).itemsize
    raw_shape = o.get("global_shape")
    if isinstance(raw_shape, list) and len(raw_shape) > MAX_RANK:
        p.bad(f"{where}.global_shape", f"has {len(raw_shape)} axes; at most {MAX_RANK} are supported")
        return None
    gshape = p.uints(raw_shape, f"{where}.global_shape")
    if gshape is not None and itemsize is not None and math.prod(gshape) * itemsize > _MAX_INT:
        p.bad(f"{where}.global_shape", f"{gshape} of {dtype} holds 2**63 bytes or more")
        return None
    raw_regions = o.get("regions")
    if not isinstance(raw_regions, list):
        p.bad(f"{where}.regions", f"must be an array, got {json_type(raw_regions)}")
        return None
    if gshape is None:
        return None
    bounds = Box._trusted((0,) * len(gshape), gshape)  # parsed: a tuple of non-negative ints
    regions: list[StoredRegion] = []
    region_where: list[str] = []
    for i, rr in enumerate(raw_regions):
        rw = f"{where}.regions[{i}]"
        r = p.obj(rr, rw, ("offset", "shape", "path", "nbytes"),
                  ("byte_offset", "base", "sha256") if version >= 2 else ())
        if r is None:
            continue
        offset = p.uints(r.get("offset"), f"{rw}.offset", len(gshape))
        shape = p.uints(r.get("shape"), f"{rw}.shape", len(gshape))
        nbytes = p.uint(r.get("nbytes"), f"{rw}.nbytes")
        packed = "byte_offset" in r
        byte_offset = p.uint(r.get("byte_offset"), f"{rw}.byte_offset") if packed else None
        base = p.uint(r.get("base"), f"{rw}.base") if "base" in r else None
        if base is not None and base >= len(bases):
            p.bad(f"{rw}.base", f"is {base}, but $.bases has {len(bases)} entries")
            base = None
        sha256 = r.get("sha256")
        if sha256 is not None and not _is_sha256(sha256):
            p.bad(f"{rw}.sha256", "must be 64 lowercase hex digits")
        raw_path = r.get("path")
        why = p.path_problem(raw_path)
        path = raw_path if isinstance(raw_path, str) else ""
        if why is None and base is not None and not path.startswith(f"{SAVES_DIR}/{bases[base].save_id}/"):
            why = f"{short(path)} is not below {SAVES_DIR}/{bases[base].save_id}/, the save of $.bases[{base}]"
        if why is not None:
            p.bad(f"{rw}.path", why)
        elif path in all_paths and not (packed and path in packs):
            if path in packs:
                p.bad(f"{rw}.path", f"{path!r} is a pack of {all_paths[path]} (regions with a byte_offset); "
                                    "this region has none")
            elif packed:  # said once per path: the regions after it would repeat it
                p.bad(f"{rw}.path", f"{path!r} is the array of {all_paths[path]}, which has no byte_offset; "
                                    "this region has one (a pack's path is only packed regions')")
                packs.setdefault(path, [])
            else:
                p.bad(f"{rw}.path", f"{path!r} is also used by {all_paths[path]}")
        else:
            all_paths.setdefault(path, rw)
            if packed and byte_offset is not None and nbytes is not None:
                packs.setdefault(path, []).append((byte_offset, byte_offset + nbytes, rw))
        if offset is None or shape is None or nbytes is None or why is not None or (packed and byte_offset is None) \
                or ("base" in r and base is None):
            continue
        box = Box._trusted(offset, shape)
        if box.is_empty:
            p.bad(rw, "a stored region must hold at least one element")
            continue
        if box != bounds and not bounds.contains(box):  # a whole-tensor region needs no check
            p.bad(rw, f"box {box} is outside the global shape {gshape}")
            continue
        if itemsize is not None and nbytes != box.volume * itemsize:
            p.bad(f"{rw}.nbytes", f"is {nbytes}, but {box.volume} elements of {dtype} take {box.volume * itemsize}")
        regions.append(StoredRegion(box, path, nbytes, byte_offset, base, sha256))
        region_where.append(rw)
    if len(p.problems) > before:
        return None
    try:
        gaps, overlaps = cover_problems(bounds, [r.box for r in regions])
    except LayoutError as e:
        p.bad(f"{where}.regions", str(e))
        return None
    for g in gaps:
        p.bad(f"{where}.regions", f"global elements {g} are not stored in any region")
    for i, j in overlaps:
        p.bad(f"{where}.regions", f"{region_where[i]} {regions[i].box} overlaps {region_where[j]} {regions[j].box}")
    if gaps or overlaps:
        return None
    return TensorMetadata(str(dtype), gshape, tuple(regions))


def _check_packs(p: _Parser, packs: dict[str, list[tuple[int, int, str | _RegionAt]]]) -> None:
    # Members of one pack hold disjoint byte ranges (spec section 3).
    for path, members in packs.items():
        members.sort(key=lambda m: (m[0], m[1]))  # equal ranges stay in the document's order
        for (_, end, where), (start, _, other) in itertools.pairwise(members):
            if start < end:
                p.bad(f"{other}.byte_offset", f"bytes from {start} of pack {path!r} overlap {where}, "
                                              f"which ends at {end}")


def _check_nesting(p: _Parser, all_paths: dict[str, str | _RegionAt]) -> None:
    # Each stored array is a directory; one may not sit inside another.
    for path, where in all_paths.items():
        parts = path.split("/")
        for k in range(1, len(parts)):
            parent = "/".join(parts[:k])
            if parent in all_paths:
                p.bad(f"{where}.path", f"{path!r} lies inside {parent!r} ({all_paths[parent]})")
                break
