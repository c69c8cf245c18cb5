"""JSON as the format reads it (spec/FORMAT.md sections 3 and 4): one
document, no repeated member names, no ``NaN``/``Infinity``, valid Unicode,
and, for metadata.json, no ``-0`` integer."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from globalshard.errors import MetadataError


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # some key repeats: name the first
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate object key {k!r}")
            seen.add(k)
    return out


def _no_negative_zero(text: str) -> int:
    if text == "-0":
        raise ValueError("-0 is not an integer of this format (write 0)")
    return int(text)


#: Where an integer -0 could be: the text holds none if this finds nothing.
_MAYBE_NEGATIVE_ZERO = re.compile(r"-0(?![.\deE])")


def loads(data: bytes | str, what: str, *, strict_integers: bool = False) -> Any:
    """The one JSON document in ``data``; a :class:`MetadataError` naming ``what`` otherwise.
    ``strict_integers`` also refuses the integer ``-0`` (metadata.json's rule)."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        # Each integer goes through Python only when the text may hold a -0.
        check = strict_integers and _MAYBE_NEGATIVE_ZERO.search(text) is not None
        return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_reject_constant,
                          parse_int=_no_negative_zero if check else None)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MetadataError(f"{what}: not a valid JSON document: {e}") from None


def is_unicode(text: str) -> bool:
    r"""Whether ``text`` holds no lone surrogate (JSON's ``\ud800`` escapes decode to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_type(v: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def short(v: Any) -> str:
    """A value as JSON, cut to 40 characters, for messages."""
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def member_path(parent: str, key: str) -> str:
    """The JSON path of member ``key`` of ``parent``: ``$.tensors["w"]``."""
    return f"{parent}[{json.dumps(key)}]"
