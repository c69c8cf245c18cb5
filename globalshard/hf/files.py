"""Mapping files: the shipped ones by name, and a file's ``extends`` merged in.

Reads JSON only (a mapping never runs code); what the JSON means is
:class:`globalshard.hf.NameMapping`'s.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from globalshard.hf.errors import ExportError

# TODO(limitation): shipped mappings cover Llama, Qwen2 (and Qwen2-MoE and Mixtral from Megatron-Core), Qwen3 (dense
# and MoE, a MoE's expert bias only by skipping it: Hugging Face's Qwen3 MoE has none) and DeepSeek-V3 from torchtitan
# and Megatron-Core (routed with a sigmoid), and gpt-oss from torchtitan (its expert bias only by skipping it too);
# other architectures need a mapping file of their own.
MAPPINGS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "mappings")


def shipped_mappings() -> list[str]:
    """The names of the mappings ``globalshard/mappings/`` ships, for ``--map NAME``."""
    return sorted(f[:-len(".json")] for f in os.listdir(MAPPINGS_DIR) if f.endswith(".json"))


def read_mapping(path: str, seen: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """A mapping file's JSON (or a shipped one's, by name) and its path, the
    mapping it ``extends`` merged in: its rules after this one's (the first
    rule a key matches applies), its params, skip patterns and config keys
    under this one's (a config key set to null is left out)."""
    if not os.path.exists(path) and re.fullmatch(r"[a-z0-9_-]+", path):
        if path not in shipped_mappings():
            raise ExportError(f"no mapping {path!r}: no such file, nor a shipped mapping "
                              f"({', '.join(shipped_mappings())})")
        path = os.path.join(MAPPINGS_DIR, f"{path}.json")
    if os.path.realpath(path) in seen:
        raise ExportError(f"{path}: 'extends' goes round in a circle: {' -> '.join(seen)}")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read the mapping {path}: {e}") from None
    if not isinstance(doc, dict) or "extends" not in doc:
        return doc, path
    base = doc["extends"]
    if not isinstance(base, str) or not base:
        raise ExportError(f"{path}: extends: the name of a shipped mapping or a path, got {base!r}")
    if not re.fullmatch(r"[a-z0-9_-]+", base):  # a path, from the extending file's directory
        base = os.path.join(os.path.dirname(path), base)
    parent, _ = read_mapping(base, (*seen, os.path.realpath(path)))
    for field, kind in (("tensors", list), ("skip", list), ("renumber", list), ("params", dict), ("config", dict)):
        for d, at in ((doc, path), (parent, base)):
            if d.get(field) is not None and not isinstance(d[field], kind):
                raise ExportError(f"{at}: {field} must be a JSON {'list' if kind is list else 'object'}")
    config = {**(parent.get("config") or {}), **(doc.get("config") or {})}
    return {**{k: v for k, v in doc.items() if k != "extends"},
            "tensors": [*(doc.get("tensors") or []), *(parent.get("tensors") or [])],
            "skip": [*(parent.get("skip") or []), *(doc.get("skip") or [])],
            "renumber": [*(doc.get("renumber") or []), *(parent.get("renumber") or [])],
            "params": {**(parent.get("params") or {}), **(doc.get("params") or {})},
            "config": {k: v for k, v in config.items() if v is not None}
            if "config" in doc or "config" in parent else None}, path


def param_names(doc: dict[str, Any]) -> set[str]:
    """The params a mapping (its JSON, ``extends`` merged in) reads: those it gives a
    default, and those its rules (sizes, groups, rotary heads, scales) and config name."""
    return set(doc.get("params") or {}) | set(_named([doc.get("tensors"), doc.get("config"), doc.get("renumber")]))


def _named(node: Any) -> Iterator[str]:
    """The params a mapping's rules or config read by name."""
    if isinstance(node, list):
        for x in node:
            yield from _named(x)
    elif isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str) and k in ("$param", "size", "groups", "rotary", "scale", "divide", "offset"):
                yield v
            elif k == "sizes" and isinstance(v, list):  # a lora's rows
                yield from (s for s in v if isinstance(s, str))
            else:
                yield from _named(v)
