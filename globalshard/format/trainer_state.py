"""trainer_state.json (spec/FORMAT.md section 4): free-form JSON, written
exactly or refused, non-finite floats tagged, checked against the size and
SHA-256 that metadata.json records."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from globalshard.errors import MetadataError, TrainerStateError, format_problems
from globalshard.format.paths import METADATA_FILE, TRAINER_STATE_FILE
from globalshard.format.strict_json import is_unicode, json_type, loads, member_path, short

__all__ = ["MAX_DEPTH", "TrainerStateRef", "dump_trainer_state", "parse_trainer_state"]

#: Nesting depth of trainer-state JSON, on save and on load.
MAX_DEPTH = 100
_FLOAT_TAG = "$float"
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclass(frozen=True, slots=True)
class TrainerStateRef:
    """Where the trainer state lives, with its size and SHA-256, so a stale or
    edited copy is caught. Version 1 checkpoints keep it at trainer_state.json."""

    nbytes: int
    sha256: str
    path: str = TRAINER_STATE_FILE


def _encode_json_value(value: Any, where: str, depth: int, problems: list[str]) -> Any:
    """``value`` as exact JSON: non-finite floats tagged (spec section 4); what
    JSON would give back as something else is a problem naming its path."""
    if depth > MAX_DEPTH:
        problems.append(f"{where}: nested more than {MAX_DEPTH} deep")
        return None
    if isinstance(value, str):
        if not is_unicode(value):
            problems.append(f"{where}: {short(value)} is not valid Unicode (a lone surrogate)")
        return value
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [_encode_json_value(v, f"{where}[{i}]", depth + 1, problems) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if set(value) == {_FLOAT_TAG}:
            problems.append(f"{where}: an object whose only member is {_FLOAT_TAG!r} is reserved for "
                            "non-finite floats")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                problems.append(f"{where}: key {k!r} is a {type(k).__name__}; JSON keys are strings")
                continue
            if not is_unicode(k):
                problems.append(f"{where}: key {k!r} is not valid Unicode")
                continue
            out[k] = _encode_json_value(v, member_path(where, k), depth + 1, problems)
        return out
    hint = " (use a list)" if isinstance(value, tuple) else ""
    problems.append(f"{where}: {type(value).__name__} is not a JSON type{hint}")
    return None


def _decode_json_value(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise MetadataError(f"{TRAINER_STATE_FILE}: nested more than {MAX_DEPTH} deep")
    if isinstance(value, str):
        if not is_unicode(value):
            raise MetadataError(f"{TRAINER_STATE_FILE}: {short(value)} is not valid Unicode (a lone surrogate)")
        return value
    if isinstance(value, list):
        return [_decode_json_value(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _FLOAT_TAG in value:
            tag = value[_FLOAT_TAG]
            if not isinstance(tag, str) or tag not in _NON_FINITE:
                raise MetadataError(f"{TRAINER_STATE_FILE}: {_FLOAT_TAG!r} must be one of "
                                    f"{sorted(_NON_FINITE)}, got {short(tag)}")
            return _NON_FINITE[tag]
        bad = [k for k in value if not is_unicode(k)]
        if bad:
            raise MetadataError(f"{TRAINER_STATE_FILE}: key {short(bad[0])} is not valid Unicode (a lone surrogate)")
        return {k: _decode_json_value(v, depth + 1) for k, v in value.items()}
    return value


def dump_trainer_state(state: Any, path: str = TRAINER_STATE_FILE) -> tuple[bytes, TrainerStateRef]:
    """The bytes of the trainer state file for ``state`` and their reference.

    Only what JSON round-trips exactly is accepted: dicts with string keys,
    lists, strings, floats, ints, booleans and None. Non-finite floats are
    written as ``{"$float": "inf"}`` (spec section 4). A tuple, a numpy scalar
    or an int key would come back as something else, so each is an error
    naming its JSON path; so is nesting deeper than ``MAX_DEPTH``.

    Raises:
        TrainerStateError: (a MetadataError and a TypeError) ``state`` is not a
        dict of exact JSON values.
    """
    if not isinstance(state, dict):
        raise TrainerStateError(f"trainer_state must be a dict, got {type(state).__name__}")
    problems: list[str] = []
    encoded = _encode_json_value(state, "$", 0, problems)
    if problems:
        raise TrainerStateError(format_problems("trainer_state cannot be stored as JSON exactly", problems))
    data = (json.dumps(encoded, indent=1, allow_nan=False) + "\n").encode("utf-8")
    return data, TrainerStateRef(len(data), hashlib.sha256(data).hexdigest(), path)


def parse_trainer_state(data: bytes, ref: TrainerStateRef) -> dict[str, Any]:
    """Check the trainer state against its reference in metadata.json and parse it."""
    if len(data) != ref.nbytes or hashlib.sha256(data).hexdigest() != ref.sha256:
        raise MetadataError(
            f"{ref.path} does not match the size and SHA-256 recorded in "
            f"{METADATA_FILE} ({len(data)} bytes, expected {ref.nbytes}): it was modified, "
            "truncated, or belongs to another save"
        )
    doc = loads(data, ref.path)
    if not isinstance(doc, dict):
        raise MetadataError(f"{ref.path}: $ must be an object, got {json_type(doc)}")
    try:
        out = _decode_json_value(doc)
    except RecursionError:
        raise MetadataError(f"{ref.path}: nested more than {MAX_DEPTH} deep") from None
    if not isinstance(out, dict):
        raise MetadataError(f"{ref.path}: $ must be an object, got a tagged {json_type(out)}")
    return out
