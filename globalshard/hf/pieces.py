"""The pieces a mapping cuts a checkpoint key into: :class:`HfTensor` (a
Hugging Face name, the box of the key it holds, its rotary order, transpose
and merged adapter), the parsed rules that make them, and the pure
functions that cut a key's shape by a rule. No file is read here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from globalshard.geometry import Box
from globalshard.hf.adapters import Lora, Merge

__all__ = ["HfTensor"]


@dataclass(frozen=True)
class _Part:
    name: str
    size: int
    rotary: int | None = None  # heads whose rows are in the interleaved rotary order


@dataclass(frozen=True)
class _Renumber:
    pattern: re.Pattern[str]  # the checkpoint's prefix (``mtp_layers.{n}.``), matched at a key's start
    key: str
    as_pattern: re.Pattern[str]  # the prefix the rules read it under (``layers.{layer}.``)
    as_key: str
    offset: str  # the params name of the number added


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    key: str
    name: str | None
    axis: int
    parts: tuple[_Part, ...]
    rotary: int | None = None
    lora: Lora | None = None
    groups: int = 1
    stacked: tuple[str, ...] = ()  # fields numbered by the key's leading axes
    axes: tuple[int, ...] | None = None  # the Hugging Face tensor is the key's array transposed by these
    mxfp4: str | None = None  # the name is MXFP4 blocks and this its scales (read only)


@dataclass(frozen=True)
class HfTensor:
    """A Hugging Face tensor: ``box`` of checkpoint key ``key``.

    ``rotary``: the box's rows are, per head of that many, in the
    interleaved rotary order, and the Hugging Face tensor has them in
    halves. ``lora``: the keys of the adapter merged into it and its scale.
    ``at``: where the box starts in the Hugging Face tensor's first axis
    (a grouped split makes one tensor of several boxes, in order).
    ``lead``: the indices on the key's leading axes that a stacked rule
    numbers (its layers); ``box`` is then a box of the array below them.
    ``axes``: the Hugging Face tensor is the whole array (``box``)
    transposed by them, as ``numpy.transpose`` takes them: its axis ``i``
    is the array's axis ``axes[i]``. ``mxfp4``: the name holds MXFP4 blocks
    (``[..., groups, 16]`` bytes, two 4-bit values each) and this names their
    scales (``[..., groups]``, exponents biased by 127); the array is them
    dequantized, ``[..., groups * 32]`` (read only).
    """

    name: str
    key: str
    box: Box
    rotary: int | None = None
    lora: Merge | None = None
    at: int = 0
    lead: tuple[int, ...] = ()
    axes: tuple[int, ...] | None = None
    mxfp4: str | None = None

    def stored_box(self, box: Box) -> Box:
        """``box`` (a box of this piece's array) as a box of the stored key."""
        return Box(self.lead + box.offset, (1,) * len(self.lead) + box.shape) if self.lead else box

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of this piece in the Hugging Face tensor."""
        return self.box.shape if self.axes is None else tuple(self.box.shape[a] for a in self.axes)

    def to_hf(self, box: Box) -> Box:
        """``box`` of this piece's array (within :attr:`box`) as a box of the Hugging Face
        tensor: from where the piece starts in it (``at``), ``axes`` applied."""
        offset = tuple(o - b for o, b in zip(box.offset, self.box.offset))
        offset = (offset[0] + self.at, *offset[1:]) if offset else ()
        if self.axes is None:
            return Box(offset, box.shape)
        return Box(tuple(offset[a] for a in self.axes), tuple(box.shape[a] for a in self.axes))

    def from_hf(self, box: Box) -> Box:
        """A box of the Hugging Face tensor as a box of this piece's array (:meth:`to_hf` undone)."""
        offset, shape = box.offset, box.shape
        if self.axes is not None:
            back = _inverse(self.axes)
            offset, shape = tuple(offset[a] for a in back), tuple(shape[a] for a in back)
        offset = (offset[0] - self.at, *offset[1:]) if offset else ()
        return Box(tuple(o + b for o, b in zip(offset, self.box.offset)), shape)


def _inverse(axes: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``axes``.

    >>> _inverse((2, 0, 1))
    (1, 2, 0)
    """
    out = [0] * len(axes)
    for i, a in enumerate(axes):
        out[a] = i
    return tuple(out)


def _rule_pieces(rule: _Rule, key: str, shape: tuple[int, ...], fields: dict[str, str],
                 lora: Merge | None, lead: tuple[int, ...]) -> tuple[list[HfTensor], list[str]]:
    """The pieces one rule cuts an array of ``shape`` into (the key's, or one
    array of a stacked key's, at ``lead``), and the problems it finds."""
    if rule.name is not None:
        piece = HfTensor(rule.name.format(**fields), key, Box.full(shape), rule.rotary, lora, lead=lead, axes=rule.axes)
        if rule.axes is not None and len(rule.axes) != len(shape):
            return [], [f"{key!r}: axes {list(rule.axes)} for {'an array' if lead else 'a tensor'} of "
                        f"{len(shape)} axes {list(shape)}"]
        return [piece], _rotary_problems(piece)
    if rule.axis >= len(shape):
        return [], [f"{key!r}: split on axis {rule.axis} of a {len(shape)}-d tensor"]
    total, units = shape[rule.axis], sum(p.size for p in rule.parts)
    sizes = [total // units * p.size for p in rule.parts]
    if total % units or any(n % rule.groups for n in sizes):
        return [], [f"{key!r}: axis {rule.axis} of {total} does not split in proportions "
                    f"{[p.size for p in rule.parts]}{f' in {rule.groups} groups' if rule.groups > 1 else ''}"]
    pieces: list[HfTensor] = []
    problems: list[str] = []
    block, start = total // rule.groups, 0
    for p, n in zip(rule.parts, sizes):
        rows = n // rule.groups
        heads = p.rotary // rule.groups if p.rotary is not None else None
        for g in range(rule.groups):  # a part of a grouped split: its rows of every group
            offset = tuple(g * block + start if a == rule.axis else 0 for a in range(len(shape)))
            size = tuple(rows if a == rule.axis else s for a, s in enumerate(shape))
            pieces.append(HfTensor(p.name.format(**fields), key, Box(offset, size), heads, lora, g * rows, lead))
            problems += _rotary_problems(pieces[-1])
        start += rows
    return pieces, problems


def _hf_shapes(pieces: Sequence[HfTensor]) -> dict[str, tuple[int, ...]]:
    """Each Hugging Face tensor's shape: its pieces' boxes one after the other on axis 0."""
    out: dict[str, tuple[int, ...]] = {}
    for p in pieces:
        have = out.get(p.name)
        out[p.name] = p.shape if have is None else (have[0] + p.shape[0], *have[1:])
    return out


def _rotary_problems(p: HfTensor) -> list[str]:
    if p.rotary is None:
        return []
    rows = p.box.shape[0] if p.box.shape else 0
    if rows % (2 * p.rotary):
        return [f"{p.name!r} ({p.key!r}): {rows} rows are not {p.rotary} heads of an even head size"]
    return []
