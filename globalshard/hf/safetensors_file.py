"""Safetensors files: their dtype names, a strict header parser, and
:class:`SafetensorsSource`, which reads any global box of a checkpoint key
from a Hugging Face directory by file offsets (a mapping in reverse).

The format (an 8-byte little-endian header length, a JSON header of
``dtype``, ``shape`` and ``data_offsets`` per tensor, then the raw
little-endian bytes) is read here by offsets because the ``safetensors``
package's numpy API has no bfloat16.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from globalshard.dtypes import numpy_dtype
from globalshard.errors import MismatchError
from globalshard.geometry import Box
from globalshard.hf.naming import DamagedFileError, ExportError, NameMapping
from globalshard.hf.patterns import compile_key, from_halves
from globalshard.hf.pieces import HfTensor, _inverse, _Rule

#: Our dtype names and safetensors' (which has no fnuz float8 types).
# TODO(limitation): float8_e4m3fnuz, float8_e5m2fnuz and complex128 have no safetensors
# name: exporting them needs --dtype.
SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
    "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


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
        weight_map: dict[str, str] | None = None
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = dict(json.load(f)["weight_map"])
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ExportError(f"{index}: not a safetensors index ({e})") from None
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise ExportError(f"{directory}: no .safetensors files")
        headers: dict[str, dict[str, _Entry]] = {}
        for name in files:
            if not isinstance(name, str) or os.path.basename(name) != name:
                raise ExportError(f"{index}: file name {name!r} is not inside the directory")
            headers[name] = read_header(os.path.join(directory, name))
        self.entries: dict[str, _Entry] = {}
        if weight_map is not None:  # each name from the file the index names, as transformers reads them
            for tensor, file in sorted(weight_map.items()):
                if tensor not in headers[file]:
                    raise DamagedFileError(f"{index} names {tensor!r} in {file}, which does not hold it")
                self.entries[tensor] = headers[file][tensor]
        else:
            for name, header in headers.items():
                if twice := sorted(set(header) & set(self.entries)):
                    raise DamagedFileError(f"{directory}: {twice[0]!r} is in both "
                                           f"{os.path.basename(self.entries[twice[0]].file)} and {name} "
                                           "(and no model.safetensors.index.json says which holds it)")
                self.entries |= header
        self.mapping = mapping or NameMapping.identity()
        #: Stacked keys the files hold only some of, or in disagreeing shapes: why each is not in ``keys``.
        self.incomplete: dict[str, str] = {}
        self.keys = self._invert()

    def _invert(self) -> dict[str, tuple[str, tuple[int, ...], list[HfTensor]]]:
        """Checkpoint key -> (dtype, global shape, its pieces), from the names present.

        A name may back several keys: rules for alternative layouts of one
        tensor (torchtitan's ``wq`` of its state dict and its fused ``wqkv``
        parameter) each read it; a model asks for the keys it has. A stacked
        rule's key is the tensors its fields number, one after the other on
        its leading axes."""
        out: dict[str, tuple[str, tuple[int, ...], list[HfTensor]]] = {}
        others = self.mapping.renumbered_from()  # from these numbers on, a renumbered prefix's layers
        for rule in self.mapping.rules:
            targets = [rule.name] if rule.name is not None else [p.name for p in rule.parts]
            if rule.mxfp4 is not None:  # its scales, filled with the blocks' fields
                targets.append(rule.mxfp4)
            first = compile_key(targets[0], "mapping")
            stacks: dict[str, dict[tuple[int, ...], tuple[str, tuple[int, ...], list[HfTensor]]]] = {}
            for name in sorted(self.entries):
                m = first.fullmatch(name)
                fields = m.groupdict() if m is not None else {}
                if m is None or not all(fields.get(f, "").isdigit() for f in rule.stacked):
                    continue
                if any(f in others and int(fields[f]) >= others[f] for f in rule.stacked):
                    continue  # Megatron's multi-token prediction layers are not its stacked decoder's
                key = _fill(rule.key, fields)
                if key in out:  # the first rule that gives a key reads it, as the first a key matches exports it
                    continue
                lead = tuple(int(fields[f]) for f in rule.stacked)
                found = self._pieces(rule, key, [_fill(t, fields) for t in targets], name, lead)
                if rule.stacked:
                    stacks.setdefault(key, {})[lead] = found
                else:
                    out[key] = found
            for key, by_lead in stacks.items():
                stacked = self._stacked(key, rule.stacked, by_lead)
                if stacked is not None:
                    out[key] = stacked
        for key in list(out):  # the same tensors under a renumbered prefix (torchtitan's mtp_layers.{n}.)
            for original in self.mapping.originals(key):
                out.setdefault(original, out[key])
        return out

    def _pieces(self, rule: _Rule, key: str, names: list[str], name: str,
                lead: tuple[int, ...]) -> tuple[str, tuple[int, ...], list[HfTensor]]:
        """The dtype, shape and pieces of the array ``names`` make under ``rule``."""
        if rule.mxfp4 is not None:  # the key's array is the blocks dequantized by their scales
            e, scales = self.entries[name], names[1]
            s = self.entries.get(scales)
            if e.dtype != "uint8" or len(e.shape) < 2 or s is None or s.dtype != "uint8" or s.shape != e.shape[:-1]:
                raise ExportError(f"{name!r}: MXFP4 blocks are uint8 [..., groups, bytes] beside their uint8 scales "
                                  f"[..., groups] {scales!r}; the files hold {e.dtype} {list(e.shape)} and "
                                  f"{'nothing' if s is None else f'{s.dtype} {list(s.shape)}'}")
            below = (*e.shape[:-2], e.shape[-2] * e.shape[-1] * 2)
            return "bfloat16", below, [HfTensor(name, key, Box.full(below), lead=lead, mxfp4=scales)]
        missing = [n for n in names if n not in self.entries]
        if missing:
            raise ExportError(f"{key!r}: {self.directory} lacks {missing} (needed with {name!r})")
        entries = [self.entries[n] for n in names]
        if len({e.dtype for e in entries}) != 1:
            raise ExportError(f"{key!r}: {names} have different dtypes")
        axis, groups = rule.axis, rule.groups
        if rule.axes is not None:  # the key's array is the file's tensor transposed back
            e = entries[0]
            if len(rule.axes) != len(e.shape):
                raise ExportError(f"{name!r}: {list(e.shape)} has {len(e.shape)} axes, the mapping transposes "
                                  f"{key!r} by axes {list(rule.axes)}")
            below = tuple(e.shape[i] for i in _inverse(rule.axes))
            return e.dtype, below, [HfTensor(name, key, Box.full(below), lead=lead, axes=rule.axes)]
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
                                       None, g * rows, lead))
            start += rows if rule.name is None else 0
        return entries[0].dtype, tuple(shape), pieces

    def _stacked(self, key: str, fields: tuple[str, ...], by_lead: Mapping[tuple[int, ...], tuple[
            str, tuple[int, ...], list[HfTensor]]]) -> tuple[str, tuple[int, ...], list[HfTensor]] | None:
        """A stacked key: its arrays at every index of its leading axes. None, and the reason in
        :attr:`incomplete`, when some are missing or they disagree (a model that asks for another
        form of the key, a MoE's per-layer keys, is not refused for it)."""
        counts = tuple(max(lead[i] for lead in by_lead) + 1 for i in range(len(fields)))
        missing = [lead for lead in np.ndindex(*counts) if tuple(int(i) for i in lead) not in by_lead]
        kinds = {(dtype, shape) for dtype, shape, _ in by_lead.values()}
        if missing:
            self.incomplete[key] = (f"{self.directory} lacks its {list(fields)} {missing[:8]} "
                                    f"(it has {len(by_lead)} of {math.prod(counts)})")
        elif len(kinds) != 1:
            self.incomplete[key] = f"its {list(fields)} differ in dtype or shape: {sorted(kinds)}"
        if missing or len(kinds) != 1:
            return None
        ((dtype, shape),) = kinds
        return dtype, counts + shape, [p for lead in sorted(by_lead) for p in by_lead[lead][2]]

    def read(self, key: str, box: Box, out: np.ndarray) -> int:
        """Fill ``out`` (shape ``box.shape``) with ``box`` of ``key``; returns bytes read."""
        if key not in self.keys:
            raise MismatchError(f"{key!r}: not in {self.directory} under the mapping "
                                f"({self.incomplete.get(key, f'{len(self.keys)} keys found')})")
        _, _, pieces = self.keys[key]
        nbytes = 0
        for p in pieces:
            part = p.stored_box(p.box).intersect(box)  # a stacked key's piece: one index of its leading axes
            if part is None or part.volume == 0:
                continue
            e = self.entries[p.name]
            local = p.to_hf(Box(part.offset[len(p.lead):], part.shape[len(p.lead):]))  # in the file's tensor
            if p.mxfp4 is not None:
                values = _read_mxfp4(e, self.entries[p.mxfp4], local, p.mxfp4)
            elif p.axes is not None:  # the file's rows it spans, transposed back
                values = _read_rows(e, local).transpose(_inverse(p.axes))
            elif p.rotary is None:
                values = _read_rows(e, local)
            else:
                values = _read_rotary(e, local, p.box.shape[0] // p.rotary)
            dst = Box(tuple(a - b for a, b in zip(part.offset, box.offset)), part.shape).view(out)  # 0-d too
            dst[...] = values if values.dtype == out.dtype else values.astype(out.dtype)
            nbytes += values.nbytes
        return nbytes

    def names(self, key: str) -> set[str]:
        """The files' tensors that :meth:`read` reads for ``key`` (MXFP4 scales too)."""
        return {n for p in self.keys[key][2] for n in (p.name, p.mxfp4) if n is not None}


def _fill(template: str, fields: Mapping[str, str]) -> str:
    return template.format(**fields)


#: The 16 values of a 4-bit MXFP4 element (E2M1), by its bits.
_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _read_mxfp4(blocks: _Entry, scales: _Entry, box: Box, name: str) -> np.ndarray:
    """``box`` of MXFP4 ``blocks`` dequantized (float32), as the OCP MX format and transformers'
    ``convert_moe_packed_tensors`` read them: in each group of ``2 * bytes`` values along the last
    axis, byte ``j`` holds value ``2j`` in its low 4 bits and ``2j + 1`` in its high ones, each scaled
    by 2 ** (the group's scale - 127). Only the groups the box spans are read. ``name``: the
    scales' tensor, for errors."""
    per = blocks.shape[-1] * 2
    first, last = box.offset[-1] // per, -(-(box.offset[-1] + box.shape[-1]) // per)
    lead = (box.offset[:-1], box.shape[:-1])
    raw = _read_rows(blocks, Box((*lead[0], first, 0), (*lead[1], last - first, blocks.shape[-1])))
    exp = _read_rows(scales, Box((*lead[0], first), (*lead[1], last - first)))
    if (exp == 255).any():  # E8M0's NaN
        raise DamagedFileError(f"{scales.file}: {name!r}: an MXFP4 scale is 255, which is no number (NaN)")
    values = np.empty((*raw.shape[:-1], per), np.float32)
    values[..., 0::2] = _FP4[raw & 0x0F]
    values[..., 1::2] = _FP4[raw >> 4]
    with np.errstate(over="ignore"):  # checked below
        values = np.ldexp(values, exp.astype(np.int32)[..., None] - 127).reshape(*raw.shape[:-2], -1)
    if not np.isfinite(values).all():
        raise DamagedFileError(f"{scales.file}: {name!r}: MXFP4 values beyond float32's range (a scale of "
                               f"2 ** {int(exp.max()) - 127})")
    start = box.offset[-1] - first * per
    return values[..., start:start + box.shape[-1]]


def _read_rotary(e: _Entry, box: Box, unit: int) -> np.ndarray:
    """``box`` of a tensor stored with its rotary rows in halves (``unit`` rows
    a head), in the interleaved order: the whole heads it spans are read and
    permuted back."""
    first, last = box.offset[0] // unit, -(-(box.offset[0] + box.shape[0]) // unit)
    rows = _read_rows(e, Box((first * unit, *(0 for _ in e.shape[1:])), ((last - first) * unit, *e.shape[1:])))
    rows = from_halves(rows, last - first)
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
