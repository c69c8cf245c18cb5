"""A reader of globalshard checkpoints written from FORMAT.md alone: json and
tensorstore, no globalshard import. It checks what the spec says a reader
MUST check and reads any global box of any tensor.

    python spec/reference_reader.py CHECKPOINT KEY [OFFSET SHAPE]   # prints the values as JSON
"""

import hashlib
import itertools
import json
import math
import os
import re
import sys

import numpy as np  # what tensorstore reads into
import tensorstore as ts

ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
            "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}
MAX_INT = 2**63 - 1


class Invalid(Exception):
    pass


def _strict_object(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise Invalid(f"repeated member {k!r}")
        out[k] = v
    return out


def _no_constant(name):
    raise Invalid(f"{name} is not JSON")


def _strict_int(text):
    if text == "-0":
        raise Invalid("-0 is not an integer of this format")
    return int(text)


def _parse(data, strict_int):
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_strict_object, parse_constant=_no_constant,
                         parse_int=_strict_int if strict_int else int)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Invalid(f"not JSON: {e}") from None
    _check_unicode(doc, 0)
    return doc


def _check_unicode(value, depth):
    if depth > 100:
        raise Invalid("nested more than 100 deep")
    if isinstance(value, str):
        value.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate
    elif isinstance(value, list):
        for v in value:
            _check_unicode(v, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, depth)
            _check_unicode(v, depth + 1)


def _int(value, where):
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise Invalid(f"{where}: not an integer in [0, 2^63-1]: {value!r}")
    return value


def _ints(value, where, n=None):
    if not isinstance(value, list) or (n is not None and len(value) != n) or len(value) > 32:
        raise Invalid(f"{where}: not a list of {n if n is not None else 'at most 32'} integers")
    return [_int(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _path(value, where):
    parts = value.split("/") if isinstance(value, str) else []
    if (not parts or len(value) > 4096 or value.startswith("/") or re.match(r"^[A-Za-z]:", value) or "\\" in value
            or any(ord(c) < 32 or ord(c) == 127 for c in value) or any(p in ("", ".", "..") for p in parts)
            or parts[0] in ("metadata.json", "trainer_state.json")):
        raise Invalid(f"{where}: not a relative path: {value!r}")
    return value


def _members(obj, names, where, optional=()):
    if not isinstance(obj, dict) or not set(names) <= set(obj) <= set(names) | set(optional):
        raise Invalid(f"{where}: must be an object with exactly {sorted(names)} (and optionally {list(optional)})")


class Checkpoint:
    # TODO(limitation): local directories only; a kvstore root would read metadata.json
    # and the trainer state through tensorstore's KvStore instead of open().
    def __init__(self, root):
        self.root = os.path.realpath(root)
        meta = _parse(self._file("metadata.json"), strict_int=True)
        _members(meta, ["format", "version", "save_id", "tensors", "trainer_state"], "$", optional=["bases"])
        if meta["format"] != "globalshard" or meta["version"] != 2 or type(meta["version"]) is not int:
            raise Invalid("$: not a globalshard version 2 checkpoint")
        if not isinstance(meta["save_id"], str) or not re.fullmatch(r"[0-9a-f]{32}", meta["save_id"]):
            raise Invalid("$.save_id: not 32 lowercase hex digits")
        if not isinstance(meta["tensors"], dict):
            raise Invalid("$.tensors: not an object")
        self.save_id, self.tensors, paths, packs = meta["save_id"], meta["tensors"], [], {}
        self.bases = meta.get("bases", [])  # section 5.2: sibling roots holding some regions' arrays
        if not isinstance(self.bases, list):
            raise Invalid("$.bases: not a list")
        for i, b in enumerate(self.bases):
            _members(b, ["root", "save_id"], f"$.bases[{i}]")
            root = b["root"]
            if not isinstance(root, str) or not root or root in (".", "..") or len(root) > 255 or \
                    re.search(r"[/\\\x00-\x1f\x7f]", root) or not re.fullmatch(r"[0-9a-f]{32}", str(b["save_id"])):
                raise Invalid(f"$.bases[{i}]: not one path component and a save id")
            if b["save_id"] == self.save_id or [x["root"] for x in self.bases].count(root) > 1:
                raise Invalid(f"$.bases[{i}]: repeats a root, or names this checkpoint's own save")
        used = set()
        for key, t in self.tensors.items():
            where = f"$.tensors[{json.dumps(key)}]"
            _members(t, ["dtype", "global_shape", "regions"], where)
            if not key or t["dtype"] not in ITEMSIZE:
                raise Invalid(f"{where}: empty key or unknown dtype {t['dtype']!r}")
            shape = _ints(t["global_shape"], f"{where}.global_shape")
            if math.prod(shape) * ITEMSIZE[t["dtype"]] > MAX_INT or not isinstance(t["regions"], list):
                raise Invalid(f"{where}: too large, or regions not a list")
            boxes = []
            for i, r in enumerate(t["regions"]):
                at = f"{where}.regions[{i}]"
                _members(r, ["offset", "shape", "path", "nbytes"], at, optional=["byte_offset", "base", "sha256"])
                if "sha256" in r and not (isinstance(r["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", r["sha256"])):
                    raise Invalid(f"{at}.sha256: not 64 lowercase hex digits")
                if "base" in r:
                    b = _int(r["base"], f"{at}.base")
                    if b >= len(self.bases) or not str(r["path"]).startswith(f"saves/{self.bases[b]['save_id']}/"):
                        raise Invalid(f"{at}: no such base, or a path outside that base's save")
                    used.add(b)
                off, shp = _ints(r["offset"], f"{at}.offset", len(shape)), _ints(r["shape"], f"{at}.shape", len(shape))
                if 0 in shp or any(o + s > g for o, s, g in zip(off, shp, shape)):
                    raise Invalid(f"{at}: empty, or outside the global shape")
                if _int(r["nbytes"], f"{at}.nbytes") != math.prod(shp) * ITEMSIZE[t["dtype"]]:
                    raise Invalid(f"{at}.nbytes: not shape x item size")
                if "byte_offset" in r:  # a packed region: packs may be shared, their members may not overlap
                    start = _int(r["byte_offset"], f"{at}.byte_offset")
                    packs.setdefault(_path(r["path"], f"{at}.path"), []).append((start, start + r["nbytes"]))
                else:
                    paths.append(_path(r["path"], f"{at}.path"))
                boxes.append((off, shp))
            # Exact cover: volumes add up to the whole, and no two regions overlap.
            if sum(math.prod(s) for _, s in boxes) != math.prod(shape) or any(
                    all(a < c + w and c < a + v for a, v, c, w in zip(o1, s1, o2, s2))
                    for i, (o1, s1) in enumerate(boxes) for (o2, s2) in boxes[i + 1:]):
                raise Invalid(f"{where}.regions: do not cover the global array exactly once")
        if used != set(range(len(self.bases))):
            raise Invalid("$.bases: an entry no region uses")
        ref = meta["trainer_state"]
        self.trainer_state = {}
        if ref is not None:
            _members(ref, ["path", "nbytes", "sha256"], "$.trainer_state")
            paths.append(_path(ref["path"], "$.trainer_state.path"))
            data = self._file(ref["path"])
            if len(data) != _int(ref["nbytes"], "$.trainer_state.nbytes") or \
                    hashlib.sha256(data).hexdigest() != ref["sha256"]:
                raise Invalid(f"{ref['path']}: size or SHA-256 differs from metadata.json")
            self.trainer_state = _parse(data, strict_int=False)
            if not isinstance(self.trainer_state, dict):
                raise Invalid(f"{ref['path']}: not a JSON object")
        paths += list(packs)
        if len(set(paths)) != len(paths) or any(b.startswith(a + "/") for a in paths for b in paths):
            raise Invalid("$: paths repeat, or one is a directory of another")
        for pack, ranges in packs.items():
            ranges.sort()
            if any(b[0] < a[1] for a, b in itertools.pairwise(ranges)):
                raise Invalid(f"{pack}: packed regions overlap")

    def _file(self, path):
        full = os.path.realpath(os.path.join(self.root, path))
        if not full.startswith(self.root + os.sep) or not os.path.isfile(full):
            raise Invalid(f"{path}: not a regular file inside the checkpoint")
        with open(full, "rb") as f:
            return f.read()

    def _base(self, b, key, r, dtype):
        """Section 5.2: the base that stores region ``r`` of ``key``, checked."""
        ref = self.bases[b]
        try:
            base = Checkpoint(os.path.join(os.path.dirname(self.root), ref["root"]))
        except (Invalid, OSError) as e:
            raise Invalid(f"{key!r} lies in the base {ref['root']}, which cannot be read: {e}") from None
        if base.save_id != ref["save_id"]:
            raise Invalid(f"{key!r} lies in save {ref['save_id']} of the base {ref['root']}, which was replaced")
        theirs = base.tensors.get(key)
        want = {k: v for k, v in r.items() if k not in ("base", "sha256")}
        if theirs is None or theirs["dtype"] != dtype or not any(
                "base" not in x and {k: v for k, v in x.items() if k != "sha256"} == want for x in theirs["regions"]):
            raise Invalid(f"the base {ref['root']} does not store {key!r} {r['offset']} at {r['path']}")
        return base

    def read(self, key, offset=None, shape=None):
        """The global box ``offset``/``shape`` (default: all) of ``key``, as a numpy array."""
        t = self.tensors[key]
        gshape = t["global_shape"]
        offset, shape = offset or [0] * len(gshape), shape if shape is not None else gshape
        out = np.zeros(shape, dtype=ts.dtype(t["dtype"]).numpy_dtype)
        for r in t["regions"]:
            lo = [max(a, b) for a, b in zip(offset, r["offset"])]
            hi = [min(a + s, b + w) for a, s, b, w in zip(offset, shape, r["offset"], r["shape"])]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            holder = self._base(r["base"], key, r, t["dtype"]) if "base" in r else self
            store = holder._open(r["path"])
            meta = store.spec().to_json()["metadata"]
            if not _has_crc32c(meta["codecs"]):
                raise Invalid(f"{r['path']}: a chunk without crc32c")
            attributes = meta.get("attributes", {}).get("globalshard")
            src = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, r["offset"]))
            dst = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset))
            if "byte_offset" in r:  # section 5.1: bytes of a uint8 pack that lists this region
                start, n = r["byte_offset"], r["nbytes"]
                if store.dtype.name != "uint8" or store.rank != 1 or start + n > store.shape[0]:
                    raise Invalid(f"{r['path']}: not a uint8 pack holding bytes [{start}, {start + n})")
                listed = attributes.get("members") if isinstance(attributes, dict) else None
                if attributes.get("save_id") != holder.save_id or not isinstance(listed, list) or \
                        json.dumps([key, r["offset"], start, n]) not in map(json.dumps, listed):  # 64.0 is not 64
                    raise Invalid(f"{r['path']}: the pack does not list {key!r} {r['offset']} of this save")
                raw = self._read(store[start:start + n], r["path"])
                values = raw.view(np.dtype(out.dtype).newbyteorder("<")).reshape(r["shape"])
                out[dst] = values[src] if src else values
                continue
            if store.dtype.name != t["dtype"] or list(store.shape) != r["shape"]:
                raise Invalid(f"{r['path']}: not {t['dtype']} {r['shape']}")
            if attributes != {"key": key, "offset": r["offset"], "save_id": holder.save_id}:
                raise Invalid(f"{r['path']}: its attributes name another key, box or save")
            out[dst] = self._read(store[src] if src else store, r["path"])
        return out

    def _open(self, path):
        full = os.path.realpath(os.path.join(self.root, path))
        if not full.startswith(self.root + os.sep):
            raise Invalid(f"{path}: outside the checkpoint")
        try:
            return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": full + "/"},
                            "fill_missing_data_reads": False}, open=True, read=True).result()
        except ValueError as e:
            raise Invalid(f"{path}: {e}") from None

    @staticmethod
    def _read(view, path):
        try:  # TensorStore verifies every chunk's crc32c; a missing chunk is an error, never zeros
            return view.read().result()
        except ValueError as e:
            raise Invalid(f"{path}: {e}") from None


def _has_crc32c(codecs):
    names = [c["name"] for c in codecs]
    i = next(i for i, n in enumerate(names) if n in ("bytes", "sharding_indexed"))
    if "crc32c" in names[i + 1:]:
        return True
    conf = codecs[i].get("configuration", {})
    return names[i] == "sharding_indexed" and _has_crc32c(conf["codecs"]) and \
        "crc32c" in [c["name"] for c in conf["index_codecs"]]


if __name__ == "__main__":
    ckpt = Checkpoint(sys.argv[1])
    box = (json.loads(sys.argv[3]), json.loads(sys.argv[4])) if len(sys.argv) > 4 else (None, None)
    print(json.dumps(ckpt.read(sys.argv[2], *box).tolist()))
