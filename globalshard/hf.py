"""Hugging Face safetensors, both ways, through a name mapping.

* :func:`export`: a checkpoint's global tensors into safetensors files of
  bounded size plus ``model.safetensors.index.json``; fused layouts (global
  ``[Q; K; V]``, ``[gate; up]``) split into the names a Hugging Face model
  uses. Each tensor is read and written in windows of rows, so memory stays
  at one window whatever the model's size.
* :class:`SafetensorsSource`: any global box of any checkpoint key, read from
  a Hugging Face safetensors directory by file offsets (the same mapping in
  reverse), for loaders that fill a parallel layout straight from it.

The safetensors format (an 8-byte little-endian header length, a JSON header
of ``dtype``, ``shape`` and ``data_offsets`` per tensor, then the raw
little-endian bytes) is simple and fixed; it is written here by streaming
because the ``safetensors`` package needs whole tensors in memory, and read
here by offsets because its numpy API has no bfloat16. The tests check both
directions against the ``safetensors`` package itself.

A mapping file (JSON; ``globalshard/mappings/`` ships ``llama`` for the
demo's model, ``megatron_gpt`` for Megatron-Core's GPTModel and
``torchtitan_llama3``, each to Hugging Face's ``LlamaForCausalLM``)::

    {"params": {"heads": 32, "kv_heads": 8, "rope_theta": 500000.0},
     "tensors": [
       {"key": "layers.{layer}.attn.qkv.weight", "split": {"axis": 0, "parts": [
           {"name": "model.layers.{layer}.self_attn.q_proj.weight", "size": "heads", "rotary": "heads"},
           {"name": "model.layers.{layer}.self_attn.k_proj.weight", "size": "kv_heads", "rotary": "kv_heads"},
           {"name": "model.layers.{layer}.self_attn.v_proj.weight", "size": "kv_heads"}]},
        "lora": {"A": "layers.{layer}.attn.qkv_lora_A", "B": "layers.{layer}.attn.qkv_lora_B", "scale": 1}},
       {"key": "final_norm", "name": "model.norm.weight"}],
     "skip": ["optimizer\\\\..*"],
     "config": {"model_type": "llama", "num_attention_heads": {"$param": "heads"},
                "hidden_size": {"$shape": "model.norm.weight", "axis": 0}}}

``{field}`` in a key matches one dot-free name part (``{layer}``: digits)
and is substituted into the names. A split's part sizes are proportions
(numbers or ``params`` names) of the axis. Every checkpoint key must match
a rule or a ``skip`` pattern: nothing is left out silently.

* ``lora``: the checkpoint holds a low-rank adapter of the tensor, ``W +
  scale * B @ A`` (``B`` of shape ``[rows, r]``, ``A`` of ``[r, cols]``);
  export writes the merged tensor and reports ``A`` and ``B`` as merged. An
  adapter no rule merges matches no rule: an error naming it, never a
  silent drop of what training learned.
* ``rotary`` (on a name or a split part): the tensor's rows are, per head of
  that many heads, in the interleaved rotary order (pairs ``2i, 2i + 1``, as
  Meta's Llama and torchtitan rotate them); Hugging Face rotates halves
  (``i, i + head_dim / 2``). Export permutes the rows of each head, and
  reading back permutes them back, as torchtitan's own state dict adapter
  and Hugging Face's conversion script do.
* ``groups`` (on a split of axis 0): the axis is that many equal blocks,
  each holding every part's share in order (``q1 q2 k1 v1 | q3 q4 k2 v2``,
  as Megatron-Core's ``linear_qkv`` and torchtitan's fused ``wqkv`` lay out
  grouped-query attention); a part's tensor is its rows of every block.
  Part sizes are proportions of the whole axis, as without groups.
* ``config``: written as ``config.json`` beside the files. Values are JSON,
  or one of ``{"$param": name}``, ``{"$shape": hf_name, "axis": i}``
  (``"divide": param`` divides it), ``{"$count": hf_name_with_{layer}}``
  (how many layers have it), ``{"$present": hf_name}``, ``{"$absent":
  hf_name}``, ``{"$dtype": hf_name}`` (its exported dtype, for
  ``torch_dtype``). Without it no ``config.json`` is written (nor removed).

``params`` are numbers; sizes, heads and layer counts must be positive
integers.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from globalshard.checkpoint import Checkpoint
from globalshard.dtypes import canonical_name, numpy_dtype
from globalshard.errors import GlobalShardError, MismatchError, StorageError
from globalshard.geometry import Box
from globalshard.layout import is_padding_key

__all__ = ["NameMapping", "export", "SafetensorsSource", "parse_size", "SAFETENSORS_DTYPES"]

#: Our dtype names and safetensors' (which has no fnuz float8 types).
# TODO(limitation): float8_e4m3fnuz, float8_e5m2fnuz and complex128 have no safetensors
# name: exporting them needs --dtype.
SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
    "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}

#: Bytes of one tensor read and written at a time by :func:`export`.
WINDOW_BYTES = 64 << 20

MAPPINGS_DIR = os.path.join(os.path.dirname(__file__), "mappings")


class ExportError(GlobalShardError, ValueError):
    """A mapping, a dtype or a safetensors file that cannot be used as asked."""


class DamagedFileError(ExportError, StorageError):
    """A safetensors file whose header or data is damaged or inconsistent
    (a :class:`~globalshard.errors.StorageError`, as any damaged data)."""


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000; ``"512MiB"``, ``"100kB"``, plain bytes.

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size("1000")
    (5000000000, 2097152, 1000)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKMGT]?i?B?)\s*", text)
    if not m:
        raise ExportError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * scale)


# --------------------------------------------------------------------------- mapping


@dataclass(frozen=True)
class _Part:
    name: str
    size: int
    rotary: int | None = None  # heads whose rows are in the interleaved rotary order


@dataclass(frozen=True)
class _Lora:
    a: str
    b: str
    scale: float


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    key: str
    name: str | None
    axis: int
    parts: tuple[_Part, ...]
    rotary: int | None = None
    lora: _Lora | None = None
    groups: int = 1


@dataclass(frozen=True)
class HfTensor:
    """A Hugging Face tensor: ``box`` of checkpoint key ``key``.

    ``rotary``: the box's rows are, per head of that many, in the
    interleaved rotary order, and the Hugging Face tensor has them in
    halves. ``lora``: the keys of the adapter merged into it and its scale.
    ``at``: where the box starts in the Hugging Face tensor's first axis
    (a grouped split makes one tensor of several boxes, in order).
    """

    name: str
    key: str
    box: Box
    rotary: int | None = None
    lora: tuple[str, str, float] | None = None
    at: int = 0


class NameMapping:
    """Checkpoint keys <-> Hugging Face names (module docstring).

    Renames and splits only: no values change.
    """

    def __init__(self, doc: Any, *, params: Mapping[str, float] | None = None, where: str = "mapping") -> None:
        if not isinstance(doc, dict):
            raise ExportError(f"{where}: a mapping is a JSON object")
        self.params = {str(k): v for k, v in dict(doc.get("params") or {}).items()} | dict(params or {})
        for k, v in self.params.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ExportError(f"{where}: params.{k} must be a number, got {v!r}")
        self.where = where
        self.rules: list[_Rule] = []
        for i, t in enumerate(doc.get("tensors") or []):
            at = f"{where}: tensors[{i}]"
            if not isinstance(t, dict) or not isinstance(t.get("key"), str):
                raise ExportError(f"{at}: needs a string 'key'")
            rotary = self._count(t, "rotary", at)
            lora = self._lora(t.get("lora"), f"{at}.lora")
            split = t.get("split")
            if split is None:
                if not isinstance(t.get("name"), str):
                    raise ExportError(f"{at}: needs a string 'name' or a 'split'")
                self.rules.append(_Rule(_compile(t["key"], at), t["key"], t["name"], 0, (), rotary, lora))
                continue
            if not isinstance(split, dict) or not isinstance(split.get("parts"), list) or not split["parts"]:
                raise ExportError(f"{at}.split: needs a non-empty 'parts' list")
            axis = split.get("axis", 0)
            if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
                raise ExportError(f"{at}.split.axis: a non-negative integer, got {axis!r}")
            groups = self._count(split, "groups", f"{at}.split", default=1)
            if groups > 1 and axis != 0:
                raise ExportError(f"{at}.split: groups split axis 0 only")
            parts = []
            for j, p in enumerate(split["parts"]):
                if not isinstance(p, dict) or not isinstance(p.get("name"), str):
                    raise ExportError(f"{at}.split.parts[{j}]: needs a string 'name'")
                size = self._count(p, "size", f"{at}.split.parts[{j}]", default=1)
                parts.append(_Part(p["name"], size, self._count(p, "rotary", f"{at}.split.parts[{j}]")))
            for j, part in enumerate(parts):
                if part.rotary is not None and part.rotary % groups:
                    raise ExportError(f"{at}.split.parts[{j}].rotary: {part.rotary} heads in {groups} groups")
            self.rules.append(_Rule(_compile(t["key"], at), t["key"], None, axis, tuple(parts), rotary, lora,
                                    groups))
        self.skip = [re.compile(p) for p in doc.get("skip") or []]
        config = doc.get("config")
        if config is not None and not isinstance(config, dict):
            raise ExportError(f"{where}: config must be a JSON object")
        self.config: dict[str, Any] | None = config

    def _param(self, value: Any, at: str) -> Any:
        """``value``, or the params entry it names."""
        if not isinstance(value, str):
            return value
        if value not in self.params:
            raise ExportError(f"{at}: {value!r} is not in params {sorted(self.params)} "
                              f"(set it with --param {value}=...)")
        return self.params[value]

    def _count(self, doc: Mapping[str, Any], field: str, at: str, default: int | None = None) -> Any:
        """``doc[field]``: a positive integer, or the name of a params entry holding one."""
        value = self._param(doc.get(field, default), f"{at}.{field}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ExportError(f"{at}.{field}: a positive integer or the name of one in params, got {value!r}")
        return value

    def _lora(self, doc: Any, at: str) -> _Lora | None:
        if doc is None:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("A"), str) or not isinstance(doc.get("B"), str):
            raise ExportError(f"{at}: needs string key patterns 'A' and 'B'")
        scale = self._param(doc.get("scale", 1), f"{at}.scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ExportError(f"{at}.scale: a number or the name of one in params, got {scale!r}")
        return _Lora(doc["A"], doc["B"], float(scale))

    @classmethod
    def load(cls, path: str, params: Mapping[str, float] | None = None) -> NameMapping:
        """A mapping file, or the name of a shipped one (``"llama"``)."""
        if not os.path.exists(path) and re.fullmatch(r"[a-z0-9_-]+", path):
            path = os.path.join(MAPPINGS_DIR, f"{path}.json")
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ExportError(f"cannot read the mapping {path}: {e}") from None
        return cls(doc, params=params, where=path)

    @classmethod
    def identity(cls) -> NameMapping:
        return cls({"tensors": [{"key": "{name}", "name": "{name}"}]})

    def pieces(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[list[HfTensor], list[str]]:
        """Every Hugging Face tensor of the checkpoint keys with these global
        shapes, and the keys skipped. Raises naming every key no rule maps.
        The adapters merged into a tensor are in its pieces' ``lora``."""
        pieces: list[HfTensor] = []
        skipped: list[str] = []
        unmapped: list[str] = []
        problems: list[str] = []
        merged = self._merged(shapes)
        for key in sorted(shapes):
            shape = shapes[key]
            if is_padding_key(key):  # rows a training layout padded: not part of the model (spec section 1)
                skipped.append(key)
                continue
            if key in merged:
                continue
            for rule in self.rules:
                m = rule.pattern.fullmatch(key)
                if m is None:
                    continue
                fields = m.groupdict()
                lora = None
                if rule.lora is not None:
                    a, b = rule.lora.a.format(**fields), rule.lora.b.format(**fields)
                    if a in shapes and b in shapes:
                        lora = (a, b, rule.lora.scale)
                        problems += _lora_problems(key, shape, a, shapes[a], b, shapes[b])
                    elif a in shapes or b in shapes:
                        problems.append(f"{key!r}: the checkpoint has only one of its adapter's {a!r} and {b!r}")
                if rule.name is not None:
                    pieces.append(HfTensor(rule.name.format(**fields), key, Box.full(shape), rule.rotary, lora))
                    problems += _rotary_problems(pieces[-1])
                    break
                if rule.axis >= len(shape):
                    problems.append(f"{key!r}: split on axis {rule.axis} of a {len(shape)}-d tensor")
                    break
                total, units = shape[rule.axis], sum(p.size for p in rule.parts)
                sizes = [total // units * p.size for p in rule.parts]
                if total % units or any(n % rule.groups for n in sizes):
                    problems.append(f"{key!r}: axis {rule.axis} of {total} does not split in proportions "
                                    f"{[p.size for p in rule.parts]}"
                                    f"{f' in {rule.groups} groups' if rule.groups > 1 else ''}")
                    break
                block, start = total // rule.groups, 0
                for p, n in zip(rule.parts, sizes):
                    rows = n // rule.groups
                    heads = p.rotary // rule.groups if p.rotary is not None else None
                    for g in range(rule.groups):  # a part of a grouped split: its rows of every group
                        offset = tuple(g * block + start if a == rule.axis else 0 for a in range(len(shape)))
                        size = tuple(rows if a == rule.axis else s for a, s in enumerate(shape))
                        pieces.append(HfTensor(p.name.format(**fields), key, Box(offset, size), heads, lora, g * rows))
                        problems += _rotary_problems(pieces[-1])
                    start += rows
                break
            else:
                if any(s.fullmatch(key) for s in self.skip):
                    skipped.append(key)
                else:
                    unmapped.append(key)
        if unmapped:
            problems.append(f"{len(unmapped)} keys match no rule and no 'skip' pattern: "
                            f"{unmapped[:8]}{' ...' if len(unmapped) > 8 else ''}")
        names = [p.name for p in pieces if p.at == 0]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"several tensors map to the same names: {dupes[:8]}")
        if problems:
            raise ExportError("the mapping does not fit the checkpoint:\n" + "\n".join(f"  - {p}" for p in problems))
        return pieces, skipped

    def _merged(self, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
        """The adapter keys some rule merges into a tensor of the checkpoint."""
        out: set[str] = set()
        for key in shapes:
            for rule in self.rules:
                m = rule.pattern.fullmatch(key)
                if m is not None:
                    if rule.lora is not None:
                        fields = m.groupdict()
                        out |= {rule.lora.a.format(**fields), rule.lora.b.format(**fields)} & set(shapes)
                    break
        return out

    def hf_config(self, pieces: Sequence[HfTensor], out_dtype: Mapping[str, str]) -> dict[str, Any] | None:
        """The ``config.json`` the mapping describes for these tensors, or None."""
        if self.config is None:
            return None
        shapes = _hf_shapes(pieces)

        def value(v: Any, at: str) -> Any:
            if isinstance(v, list):
                return [value(x, f"{at}[{i}]") for i, x in enumerate(v)]
            if not isinstance(v, dict):
                return v
            directive = [k for k in v if k.startswith("$")]
            if not directive:
                return {k: value(x, f"{at}.{k}") for k, x in v.items()}
            kind, arg = directive[0], v[directive[0]]
            if kind == "$param":
                return self._param(arg, f"{self.where}: {at} needs params.{arg}")
            if kind in ("$present", "$absent"):
                return (arg in shapes) == (kind == "$present")
            if kind == "$count":
                pattern = _compile(arg, at)
                return len({n for n in shapes if pattern.fullmatch(n)})
            if arg not in shapes:
                raise ExportError(f"{self.where}: {at} reads {arg!r}, which the export does not write")
            if kind == "$dtype":
                return out_dtype[arg]
            if kind == "$shape":
                n = shapes[arg][int(v.get("axis", 0))]
                if "divide" in v:
                    d = self._count(v, "divide", at)
                    if n % d:
                        raise ExportError(f"{self.where}: {at}: {n} does not divide by {d}")
                    n //= d
                return n
            raise ExportError(f"{self.where}: {at}: unknown directive {kind!r}")

        return {k: value(v, f"config.{k}") for k, v in self.config.items()}


def _hf_shapes(pieces: Sequence[HfTensor]) -> dict[str, tuple[int, ...]]:
    """Each Hugging Face tensor's shape: its pieces' boxes one after the other on axis 0."""
    out: dict[str, tuple[int, ...]] = {}
    for p in pieces:
        have = out.get(p.name)
        out[p.name] = p.box.shape if have is None else (have[0] + p.box.shape[0], *have[1:])
    return out


def _lora_problems(key: str, shape: tuple[int, ...], a: str, a_shape: tuple[int, ...], b: str,
                   b_shape: tuple[int, ...]) -> list[str]:
    if len(shape) != 2 or len(a_shape) != 2 or len(b_shape) != 2 or b_shape[0] != shape[0] \
            or a_shape[1] != shape[1] or a_shape[0] != b_shape[1]:
        return [f"{key!r} {list(shape)}: its adapter {b!r} {list(b_shape)} @ {a!r} {list(a_shape)} "
                "does not have its shape"]
    return []


def _rotary_problems(p: HfTensor) -> list[str]:
    if p.rotary is None:
        return []
    rows = p.box.shape[0] if p.box.shape else 0
    if rows % (2 * p.rotary):
        return [f"{p.name!r} ({p.key!r}): {rows} rows are not {p.rotary} heads of an even head size"]
    return []


def _to_halves(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of whole heads from the interleaved rotary order to halves."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _from_halves(rows: np.ndarray, heads: int) -> np.ndarray:
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _compile(key: str, where: str) -> re.Pattern[str]:
    out, last = [], 0
    for m in re.finditer(r"\{(\w+)\}", key):
        out.append(re.escape(key[last:m.start()]))
        field = m.group(1)
        out.append(rf"(?P<{field}>\d+)" if field == "layer" else
                   rf"(?P<{field}>.+)" if field == "name" else rf"(?P<{field}>[^.]+)")
        last = m.end()
    out.append(re.escape(key[last:]))
    try:
        return re.compile("".join(out))
    except re.error as e:
        raise ExportError(f"{where}: bad key pattern {key!r}: {e}") from None


# --------------------------------------------------------------------------- export


def export(checkpoint: str | Checkpoint, out: str, *, mapping: NameMapping | None = None, dtype: str | None = None,
           max_shard_size: int = 5 * 10**9, progress: Callable[[int], None] | None = None,
           kvstore: Any = None) -> dict[str, Any]:
    """Write the checkpoint's tensors as Hugging Face safetensors in ``out``.

    ``dtype`` converts floating-point tensors (integers and bools keep
    theirs); a narrowing conversion is what was asked for, so it is allowed.
    Files hold at most ``max_shard_size`` bytes of tensors (a larger tensor
    gets a file of its own). ``progress(nbytes)`` follows the reads. A
    mapping with a ``config`` also writes ``config.json``. What an earlier
    export left in ``out`` (``model*.safetensors`` files this export does
    not write, the index, and ``config.json`` when this export writes one)
    is replaced once the new files are in place, so that no reader picks a
    stale ``model.safetensors`` over the new index; nothing else in ``out``
    is touched.

    Returns:
        The index written to ``model.safetensors.index.json``, plus
        ``"skipped"``: the checkpoint keys the mapping's ``skip`` left out,
        ``"merged"``: the adapter keys merged into the tensors they adapt,
        and ``"config"``: the ``config.json`` written, or None.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint, kvstore=kvstore)
    tensors = ckpt.metadata.tensors
    mapping = mapping or NameMapping.identity()
    pieces, skipped = mapping.pieces({k: t.global_shape for k, t in tensors.items()})
    out_dtype = {}
    for p in pieces:
        stored = tensors[p.key].dtype
        want = canonical_name(np.dtype(numpy_dtype(dtype))) if dtype and _is_float(stored) else stored
        if want not in SAFETENSORS_DTYPES:
            raise ExportError(f"{p.key!r}: safetensors has no {want} (choose another with --dtype)")
        if p.lora is not None and not _is_float(stored):
            raise ExportError(f"{p.key!r}: an adapter merges into floating-point tensors only, not {stored}")
        out_dtype[p.name] = want
    config = mapping.hf_config(pieces, out_dtype)
    # Files of bounded size, in the order the mapping lists the tensors (a tensor: its pieces, in order).
    by_name: dict[str, list[HfTensor]] = {}
    for p in pieces:
        by_name.setdefault(p.name, []).append(p)
    files: list[list[HfTensor]] = [[]]
    size = 0
    for name, members in by_name.items():
        n = sum(p.box.volume for p in members) * numpy_dtype(out_dtype[name]).itemsize
        if files[-1] and size + n > max_shard_size:
            files.append([])
            size = 0
        files[-1] += members
        size += n
    os.makedirs(out, exist_ok=True)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    weight_map: dict[str, str] = {}
    total = 0
    for name, members in zip(names, files):
        total += _write_file(ckpt, os.path.join(out, name), members, out_dtype, progress)
        weight_map |= {p.name: name for p in members}
    index = {"metadata": {"total_size": total, "format": "pt", "source": "globalshard",
                          "save_id": ckpt.metadata.save_id},
             "weight_map": dict(sorted(weight_map.items()))}
    if config is not None:
        _write_atomically(os.path.join(out, "config.json"), json.dumps(config, indent=2).encode("utf-8"))
    _write_atomically(os.path.join(out, "model.safetensors.index.json"),
                      json.dumps(index, indent=2).encode("utf-8"))
    for stale in sorted(os.listdir(out)):
        if _EXPORTED.fullmatch(stale) and stale not in names:
            os.unlink(os.path.join(out, stale))
    merged = sorted({key for p in pieces if p.lora is not None for key in p.lora[:2]})
    return {**index, "skipped": skipped, "merged": merged, "config": config}


#: The files an export writes (and so may replace): one file, or numbered shards.
_EXPORTED = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _windows(ckpt: Checkpoint, p: HfTensor) -> Iterator[tuple[Box, np.ndarray]]:
    """The piece's values in Hugging Face's order, a window of rows at a time,
    with its adapter merged and its rotary rows in halves."""
    stored = numpy_dtype(ckpt.metadata.tensors[p.key].dtype)
    if p.rotary is None and p.lora is None:
        for window in p.box.row_windows(stored.itemsize, WINDOW_BYTES):
            yield window, ckpt.read_array(p.key, window)
        return
    rows = p.box.shape[0]
    unit = rows // p.rotary if p.rotary else 1  # whole heads per window
    row_bytes = math.prod(p.box.shape[1:]) * stored.itemsize
    step = max(1, WINDOW_BYTES // max(1, row_bytes * unit)) * unit
    a = ckpt.read_array(p.lora[0], Box.full(ckpt.metadata.tensors[p.lora[0]].global_shape)) if p.lora else None
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        window = Box((p.box.offset[0] + r0, *p.box.offset[1:]), (n, *p.box.shape[1:]))
        buf = ckpt.read_array(p.key, window)
        if p.lora is not None and a is not None:
            _, b_key, scale = p.lora
            rank = a.shape[0]
            b = ckpt.read_array(b_key, Box((window.offset[0], 0), (n, rank)))
            cols = slice(window.offset[1], window.offset[1] + window.shape[1])
            merged = buf.astype(np.float64) + scale * (b.astype(np.float64) @ a[:, cols].astype(np.float64))
            buf = merged.astype(buf.dtype)
        if p.rotary is not None:
            buf = _to_halves(buf, n // unit)
        yield window, buf


def _write_file(ckpt: Checkpoint, path: str, pieces: Sequence[HfTensor], out_dtype: Mapping[str, str],
                progress: Callable[[int], None] | None) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in _hf_shapes(pieces).items():  # a tensor's pieces are consecutive, in order
        n = math.prod(shape) * numpy_dtype(out_dtype[name]).itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[out_dtype[name]], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for p in pieces:
                stored = ckpt.metadata.tensors[p.key].dtype
                for window, buf in _windows(ckpt, p):
                    if out_dtype[p.name] != stored:
                        buf = buf.astype(numpy_dtype(out_dtype[p.name]))
                    if buf.size:  # little-endian bytes, written from the array itself (no copy)
                        f.write(np.ascontiguousarray(buf.astype(buf.dtype.newbyteorder("<"), copy=False))
                                .reshape(-1).view(np.uint8).data)
                    if progress is not None:
                        progress(window.volume * numpy_dtype(stored).itemsize)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return offset


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- import


@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


def read_header(path: str) -> dict[str, _Entry]:
    """The tensors of one safetensors file, checked as strictly as the
    safetensors package checks them: a UTF-8 JSON object header, known
    dtypes, sizes matching dtype and shape, and byte ranges that, in order,
    are disjoint and cover the data area exactly.

    Raises:
        DamagedFileError: naming the file and the tensor.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > min(size - 8, 100 << 20):
                raise DamagedFileError(f"{path}: header length {n} does not fit the file of {size} bytes")
            header = json.loads(f.read(n).decode("utf-8"))
    except DamagedFileError:
        raise
    except (OSError, ValueError) as e:
        raise DamagedFileError(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise DamagedFileError(f"{path}: the header is not a JSON object")
    out, spans = {}, []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _FROM_SAFETENSORS[t["dtype"]]
            shape = tuple(int(s) for s in t["shape"])
            begin, end = (int(v) for v in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DamagedFileError(f"{path}: tensor {name!r} has an unusable entry {t!r}") from None
        if min(shape, default=0) < 0 or begin < 0 or end - begin != math.prod(shape) * numpy_dtype(dtype).itemsize:
            raise DamagedFileError(f"{path}: tensor {name!r}: offsets {begin}..{end} do not hold {dtype} "
                                   f"{list(shape)}")
        spans.append((begin, end, name))
        out[name] = _Entry(path, dtype, shape, 8 + n + begin)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise DamagedFileError(f"{path}: tensor {name!r} starts at byte {begin} of the data, where the tensors "
                                   f"before it end at {at} ({'overlapping' if begin < at else 'a gap'})")
        at = end
    if 8 + n + at != size:
        raise DamagedFileError(f"{path}: the tensors end at byte {8 + n + at}, the file at {size} "
                               "(truncated, or bytes no tensor holds)")
    return out


class SafetensorsSource:
    """A Hugging Face safetensors directory (``model.safetensors`` or an index),
    read through a mapping in reverse: :meth:`read` gives any global box of
    a checkpoint key, reading only the bytes of the rows it covers."""

    def __init__(self, directory: str, mapping: NameMapping | None = None) -> None:
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ExportError(f"{index}: not a safetensors index ({e})") from None
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise ExportError(f"{directory}: no .safetensors files")
        self.entries: dict[str, _Entry] = {}
        for name in files:
            if os.path.basename(name) != name:
                raise ExportError(f"{index}: file name {name!r} is not inside the directory")
            self.entries |= read_header(os.path.join(directory, name))
        self.mapping = mapping or NameMapping.identity()
        self.keys = self._invert()

    def _invert(self) -> dict[str, tuple[str, tuple[int, ...], list[HfTensor]]]:
        """Checkpoint key -> (dtype, global shape, its pieces), from the names present.

        A name may back several keys: rules for alternative layouts of one
        tensor (torchtitan's ``wq`` of its state dict and its fused ``wqkv``
        parameter) each read it; a model asks for the keys it has."""
        out: dict[str, tuple[str, tuple[int, ...], list[HfTensor]]] = {}
        for rule in self.mapping.rules:
            targets = [rule.name] if rule.name is not None else [p.name for p in rule.parts]
            first = _compile(targets[0], "mapping")
            for name in sorted(self.entries):
                m = first.fullmatch(name)
                if m is None:
                    continue
                fields = m.groupdict()
                key = _fill(rule.key, fields)
                names = [_fill(t, fields) for t in targets]
                missing = [n for n in names if n not in self.entries]
                if missing:
                    raise ExportError(f"{key!r}: {self.directory} lacks {missing} (needed with {name!r})")
                entries = [self.entries[n] for n in names]
                if len({e.dtype for e in entries}) != 1:
                    raise ExportError(f"{key!r}: {names} have different dtypes")
                axis, groups = rule.axis, rule.groups
                shape = list(entries[0].shape)
                if rule.name is None:
                    shape[axis] = sum(e.shape[axis] for e in entries)
                rotary = [rule.rotary] if rule.name is not None else [p.rotary for p in rule.parts]
                for n, e, heads in zip(names, entries, rotary):
                    if heads is not None and (not e.shape or e.shape[0] % (2 * heads)):
                        raise ExportError(f"{n!r}: {list(e.shape)} is not {heads} rotary heads of an even size")
                    if groups > 1 and (not e.shape or e.shape[axis] % groups):
                        raise ExportError(f"{n!r}: {list(e.shape)} does not split into {groups} groups")
                pieces, start = [], 0
                block = shape[axis] // groups if shape else 0
                for n, e, heads in zip(names, entries, rotary):
                    rows = e.shape[axis] // groups if e.shape else 0
                    for g in range(groups):
                        offset = tuple(g * block + start if a == axis else 0 for a in range(len(e.shape)))
                        size = tuple(rows if a == axis else s for a, s in enumerate(e.shape))
                        pieces.append(HfTensor(n, key, Box(offset, size), None if heads is None else heads // groups,
                                            None, g * rows))
                    start += rows if rule.name is None else 0
                out[key] = (entries[0].dtype, tuple(shape), pieces)
        return out

    def read(self, key: str, box: Box, out: np.ndarray) -> int:
        """Fill ``out`` (shape ``box.shape``) with ``box`` of ``key``; returns bytes read."""
        if key not in self.keys:
            raise MismatchError(f"{key!r}: not in {self.directory} under the mapping "
                                f"({len(self.keys)} keys found)")
        _, _, pieces = self.keys[key]
        nbytes = 0
        for p in pieces:
            part = p.box.intersect(box)
            if part is None or part.volume == 0:
                continue
            e = self.entries[p.name]
            shift = [a - b for a, b in zip(part.offset, p.box.offset)]
            local = Box((shift[0] + p.at, *shift[1:]) if shift else (), part.shape)
            values = _read_rows(e, local) if p.rotary is None else _read_rotary(e, local, p.box.shape[0] // p.rotary)
            dst = out[tuple(slice(a - b, a - b + s) for a, b, s in zip(part.offset, box.offset, part.shape))]
            dst[...] = values if values.dtype == out.dtype else values.astype(out.dtype)
            nbytes += values.nbytes
        return nbytes


def _fill(template: str, fields: Mapping[str, str]) -> str:
    return template.format(**fields)


def _read_rotary(e: _Entry, box: Box, unit: int) -> np.ndarray:
    """``box`` of a tensor stored with its rotary rows in halves (``unit`` rows
    a head), in the interleaved order: the whole heads it spans are read and
    permuted back."""
    first, last = box.offset[0] // unit, -(-(box.offset[0] + box.shape[0]) // unit)
    rows = _read_rows(e, Box((first * unit, *(0 for _ in e.shape[1:])), ((last - first) * unit, *e.shape[1:])))
    rows = _from_halves(rows, last - first)
    r0 = box.offset[0] - first * unit
    return rows[(slice(r0, r0 + box.shape[0]), *(slice(o, o + s) for o, s in zip(box.offset[1:], box.shape[1:])))]


def _read_rows(e: _Entry, box: Box) -> np.ndarray:
    """``box`` of a stored tensor: the rows it spans are read, then sliced."""
    dtype = numpy_dtype(e.dtype).newbyteorder("<")
    if not e.shape:
        with open(e.file, "rb") as f:
            return np.frombuffer(os.pread(f.fileno(), dtype.itemsize, e.start), dtype).reshape(())
    row = math.prod(e.shape[1:]) * dtype.itemsize
    first, count = box.offset[0], box.shape[0]
    with open(e.file, "rb") as f:
        raw = os.pread(f.fileno(), row * count, e.start + row * first)
    if len(raw) != row * count:
        raise DamagedFileError(f"{e.file}: ends inside a tensor (truncated?)")
    rows = np.frombuffer(raw, dtype).reshape((count, *e.shape[1:]))
    return rows[(slice(None), *(slice(o, o + s) for o, s in zip(box.offset[1:], box.shape[1:])))]
