"""Name mappings: which checkpoint keys become which Hugging Face tensors.

:class:`NameMapping` parses a mapping file (its format is in
:mod:`globalshard.hf`) and cuts a checkpoint's keys into :class:`HfTensor`
pieces (:mod:`globalshard.hf.pieces`): a name, the global box of the key it
holds, its rotary order, transpose and the adapter merged into it. Pure: no
file is read but the mapping itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from globalshard.hf.adapters import Lora, Merge, lora_problems
from globalshard.hf.errors import DamagedFileError, ExportError
from globalshard.hf.files import MAPPINGS_DIR, param_names, read_mapping, shipped_mappings
from globalshard.hf.patterns import compile_key, numbered
from globalshard.hf.pieces import HfTensor, _Part, _Renumber, _Rule, _rule_pieces
from globalshard.layout import is_padding_key

__all__ = ["NameMapping", "HfTensor", "ExportError", "DamagedFileError", "MAPPINGS_DIR", "shipped_mappings"]


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
        takes = param_names(doc)
        if unknown := sorted(set(params or {}) - takes):  # a misspelt name would leave its default in place
            raise ExportError(f"{where}: no rule or config of this mapping reads params {unknown}; "
                              f"it reads {sorted(takes)}")
        self.where = where
        self._adapters: list[re.Pattern[str]] | None = None
        self.rules: list[_Rule] = []
        for i, t in enumerate(doc.get("tensors") or []):
            at = f"{where}: tensors[{i}]"
            if not isinstance(t, dict) or not isinstance(t.get("key"), str):
                raise ExportError(f"{at}: needs a string 'key'")
            rotary = self._count(t, "rotary", at)
            lora = self._lora(t.get("lora"), f"{at}.lora")
            stacked = self._stacked(t, at)
            if stacked and lora is not None:
                raise ExportError(f"{at}: a stacked key merges no adapter")
            axes = self._axes(t, at)
            mxfp4 = t.get("mxfp4")
            if mxfp4 is not None and (not isinstance(mxfp4, str) or not isinstance(t.get("name"), str) or
                                      any(t.get(f) is not None for f in ("rotary", "lora", "axes", "stacked"))):
                raise ExportError(f"{at}.mxfp4: the name of the scales of the MXFP4 blocks 'name' holds, on a rule "
                                  f"without rotary, lora, axes or stacked; got {mxfp4!r}")
            split = t.get("split")
            if split is None:
                if not isinstance(t.get("name"), str):
                    raise ExportError(f"{at}: needs a string 'name' or a 'split'")
                self.rules.append(_Rule(compile_key(t["key"], at), t["key"], t["name"], 0, (), rotary, lora,
                                        stacked=stacked, axes=axes, mxfp4=mxfp4))
                continue
            if axes is not None:
                raise ExportError(f"{at}.axes: a split's parts are not transposed (only a rule with a 'name' is)")
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
            self.rules.append(_Rule(compile_key(t["key"], at), t["key"], None, axis, tuple(parts), rotary, lora,
                                    groups, stacked))
        self.skip = [re.compile(p) for p in doc.get("skip") or []]
        self.renumber = [self._renumbering(r, f"{where}: renumber[{i}]")
                         for i, r in enumerate(doc.get("renumber") or [])]
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

    def _stacked(self, doc: Mapping[str, Any], at: str) -> tuple[str, ...]:
        """``doc["stacked"]``: the fields that number the key's leading axes, in order."""
        stacked = doc.get("stacked", [])
        if not isinstance(stacked, list) or not all(isinstance(f, str) and f.isidentifier() for f in stacked):
            raise ExportError(f"{at}.stacked: a list of field names, got {stacked!r}")
        in_key = [f for f in stacked if "{" + f + "}" in doc["key"]]
        if in_key or len(set(stacked)) != len(stacked):
            raise ExportError(f"{at}.stacked: {stacked} must be distinct fields that the key does not hold")
        return tuple(stacked)

    @staticmethod
    def _axes(doc: Mapping[str, Any], at: str) -> tuple[int, ...] | None:
        """``doc["axes"]``: a permutation of the array's axes (its length is checked against each key's)."""
        axes = doc.get("axes")
        if axes is None:
            return None
        if not isinstance(axes, list) or any(isinstance(a, bool) or not isinstance(a, int) for a in axes) \
                or sorted(axes) != list(range(len(axes))):
            raise ExportError(f"{at}.axes: a permutation of the axes (as numpy.transpose takes one: [0, 2, 1]), "
                              f"got {axes!r}")
        if doc.get("rotary") is not None or doc.get("lora") is not None:
            raise ExportError(f"{at}.axes: a transposed tensor has no 'rotary' rows and merges no 'lora' adapter")
        return tuple(axes)

    def _renumbering(self, doc: Any, at: str) -> _Renumber:
        """A ``renumber`` entry: keys under one numbered prefix read as under another, after the
        other's ``offset`` (a params name) entries (torchtitan's ``mtp_layers.{n}.`` as ``layers.{n}.``)."""
        ok = isinstance(doc, dict) and all(isinstance(doc.get(f), str) for f in ("key", "as", "offset"))
        prefixes = [compile_key(doc[f], at) for f in ("key", "as")] if ok else []
        if not ok or any(p.groups != 1 for p in prefixes):
            raise ExportError(f"{at}: needs 'key' and 'as', prefixes with one {{field}} each, and 'offset', "
                              f"a params name; got {doc!r}")
        return _Renumber(prefixes[0], doc["key"], prefixes[1], doc["as"], doc["offset"])

    def renumbered(self, key: str) -> str:
        """``key`` as the rules read it (export): under a ``renumber`` entry's ``as`` prefix."""
        for r in self.renumber:
            m = r.pattern.match(key)
            if m is not None:
                offset = self._count({"offset": r.offset}, "offset", f"{key!r}: renumber {r.key!r}")
                return numbered(r.as_key, int(m.group(1)) + offset) + key[m.end():]
        return key

    def renumbered_from(self) -> dict[str, int]:
        """Each ``renumber`` ``as`` prefix's field, and its offset (given): from there on, numbers of other keys."""
        return {next(iter(r.as_pattern.groupindex)): self.params[r.offset] for r in self.renumber
                if isinstance(self.params.get(r.offset), int)}

    def originals(self, key: str) -> list[str]:
        """The checkpoint keys that a key the rules give (reading back) also is: under each
        ``renumber`` entry whose ``as`` prefix it has, at or after its offset (when given)."""
        out = []
        for r in self.renumber:
            m = r.as_pattern.match(key)
            offset = self.params.get(r.offset)
            if m is not None and isinstance(offset, int) and m.group(1).isdigit() and int(m.group(1)) >= offset:
                out.append(numbered(r.key, int(m.group(1)) - offset) + key[m.end():])
        return out

    def _lora(self, doc: Any, at: str) -> Lora | None:
        if doc is None:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("A"), str) or not isinstance(doc.get("B"), str):
            raise ExportError(f"{at}: needs string key patterns 'A' and 'B'")
        rows = doc.get("rows")
        if rows is not None:
            sizes = rows.get("sizes") if isinstance(rows, dict) else None
            part = rows.get("part") if isinstance(rows, dict) else None
            if not isinstance(sizes, list) or not sizes or isinstance(part, bool) or not isinstance(part, int) \
                    or not 0 <= part < len(sizes):
                raise ExportError(f"{at}.rows: needs a non-empty 'sizes' list and a 'part' index into it")
            rows = (self._count(rows, "groups", f"{at}.rows", default=1),
                    tuple(self._count({"size": s}, "size", f"{at}.rows.sizes[{i}]") for i, s in enumerate(sizes)),
                    part)
        scale = doc.get("scale", 1)
        if isinstance(scale, str) and scale not in self.params:  # asked for only when the checkpoint holds one
            return Lora(doc["A"], doc["B"], None, scale, rows)
        scale = self._param(scale, f"{at}.scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ExportError(f"{at}.scale: a number or the name of one in params, got {scale!r}")
        return Lora(doc["A"], doc["B"], float(scale), rows=rows)

    @classmethod
    def load(cls, path: str, params: Mapping[str, float] | None = None) -> NameMapping:
        """A mapping file, or the name of a shipped one (``"llama"``), with the
        mappings it ``extends`` merged in."""
        doc, path = read_mapping(path, ())
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
        unset: dict[str, list[tuple[str, str, str]]] = {}  # a lora scale's unset param -> (key, A, B) merged by it
        merged = self._merged(shapes)
        for key in sorted(shapes):
            shape = shapes[key]
            if is_padding_key(key):  # rows a training layout padded: not part of the model (spec section 1)
                skipped.append(key)
                continue
            if key in merged:
                continue
            try:
                read_as = self.renumbered(key)
            except ExportError as e:
                problems.append(str(e))
                continue
            for rule in self.rules:
                m = rule.pattern.fullmatch(read_as)
                if m is None:
                    continue
                fields = m.groupdict()
                lora: Merge | None = None
                if rule.lora is not None:
                    a, b = rule.lora.a.format(**fields), rule.lora.b.format(**fields)
                    if a in shapes and b in shapes:
                        if rule.lora.scale is None:  # reported once per param, below
                            unset.setdefault(rule.lora.scale_name, []).append((key, a, b))
                        else:
                            lora = (a, b, rule.lora.scale, rule.lora.rows)
                            problems += lora_problems(key, shape, a, shapes[a], b, shapes[b], rule.lora.rows)
                    elif a in shapes or b in shapes:
                        problems.append(f"{key!r}: the checkpoint has only one of its adapter's {a!r} and {b!r}")
                if rule.mxfp4 is not None:  # TODO(limitation): export writes no MXFP4 (gpt-oss's are read only)
                    problems.append(f"{key!r}: its rule ({rule.key!r} as MXFP4 {rule.name!r}) only reads files; "
                                    "export writes no MXFP4 (put a rule that writes the key before it)")
                    break
                n = len(rule.stacked)
                if len(shape) < n:
                    problems.append(f"{key!r}: {len(shape)} axes, fewer than its stacked fields {list(rule.stacked)}")
                    break
                for lead in np.ndindex(*shape[:n]):  # one array per index of the stacked axes (one without)
                    numbered = fields | {f: str(i) for f, i in zip(rule.stacked, lead)}
                    got, trouble = _rule_pieces(rule, key, shape[n:], numbered, lora, tuple(int(i) for i in lead))
                    pieces += got
                    problems += trouble
                    if trouble:
                        break
                break
            else:
                if any(s.fullmatch(key) for s in self.skip):
                    skipped.append(key)
                else:
                    unmapped.append(key)
        for name, merging in unset.items():
            key, a, b = merging[0]
            count = f" ({len(merging)} tensors merge an adapter scaled by it)" if len(merging) > 1 else ""
            problems.append(f"params {name!r} is not set: {key!r} merges its adapter {a!r}, {b!r} scaled by it, "
                            f"which the checkpoint does not record{count}: set it (--param {name}=...)")
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

    def is_adapter(self, key: str) -> bool:
        """Whether ``key`` names an adapter (a ``lora`` rule's A or B), which
        reading files back leaves as the model made it: the files hold the
        tensor it adapts (merged, or a fine-tune's starting weights)."""
        if self._adapters is None:  # compiled once: asked for each key a model has and the files lack
            self._adapters = [compile_key(p, self.where) for r in self.rules if r.lora is not None
                              for p in (r.lora.a, r.lora.b)]
        return any(p.fullmatch(key) for p in self._adapters)

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
