"""Key patterns and rotary row orders: the helpers a mapping, an export and a
read of Hugging Face files share. Pure."""

from __future__ import annotations

import re

import numpy as np

from globalshard.hf.errors import ExportError

__all__ = ["compile_key", "from_halves", "numbered", "to_halves"]


def to_halves(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of whole heads from the interleaved rotary order to halves."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def from_halves(rows: np.ndarray, heads: int) -> np.ndarray:
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def numbered(prefix: str, n: int) -> str:
    """A prefix with one ``{field}``, numbered ``n``."""
    return re.sub(r"\{\w+\}", str(n), prefix, count=1)


def compile_key(key: str, where: str) -> re.Pattern[str]:
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
