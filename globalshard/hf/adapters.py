"""Low-rank adapters in a mapping: a rule's ``lora`` (its keys, its scale, and
which rows of ``B`` the adapted key takes when ``B`` adapts a fused tensor the
checkpoint stores split), and the checks of their shapes. Pure."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Lora", "Merge", "Rows", "b_rows", "lora_problems"]

#: Which rows of B an adapted key takes: (groups, part sizes, the key's part); see :class:`Lora`.
Rows = tuple[int, tuple[int, ...], int]
#: An adapter merged into a piece: A's key, B's key, the scale, B's rows (None: all, in order).
Merge = tuple[str, str, float, "Rows | None"]


@dataclass(frozen=True)
class Lora:
    """A rule's adapter: ``W + scale * B[rows] @ A``."""

    a: str
    b: str
    scale: float | None  # None: the params entry ``scale_name``, not set, needed once an adapter is found
    scale_name: str = ""
    #: B's rows: cut in proportions ``sizes``, each part's rows spread over ``groups`` equal blocks (as
    #: a grouped split); the key's rows are part ``part``'s, block by block (a fused wqkv's adapter,
    #: its weight stored as wq, wk, wv).
    rows: Rows | None = None


def b_rows(rows: Rows, total: int) -> np.ndarray:
    """The row of ``B`` (of ``total`` rows) for each row of the adapted key."""
    groups, sizes, part = rows
    per_group = [total // sum(sizes) * s // groups for s in sizes]
    block, start = total // groups, sum(per_group[:part])
    return np.concatenate([g * block + start + np.arange(per_group[part]) for g in range(groups)])


def lora_problems(key: str, shape: tuple[int, ...], a: str, a_shape: tuple[int, ...], b: str,
                  b_shape: tuple[int, ...], rows: Rows | None) -> list[str]:
    """What keeps ``B @ A`` (``B``'s ``rows``) from having the shape of ``key``."""
    if len(b_shape) == 2 and rows is not None:
        groups, sizes, _ = rows
        if b_shape[0] % sum(sizes) or any(b_shape[0] // sum(sizes) * s % groups for s in sizes):
            return [f"{key!r}: its adapter {b!r} {list(b_shape)} has rows that do not split in proportions "
                    f"{list(sizes)} in {groups} groups"]
        rows_of_key = len(b_rows(rows, b_shape[0]))
    else:
        rows_of_key = b_shape[0] if b_shape else -1
    if len(shape) != 2 or len(a_shape) != 2 or len(b_shape) != 2 or rows_of_key != shape[0] \
            or a_shape[1] != shape[1] or a_shape[0] != b_shape[1]:
        return [f"{key!r} {list(shape)}: its adapter {b!r} {list(b_shape)} @ {a!r} {list(a_shape)} "
                "does not have its shape"]
    return []
