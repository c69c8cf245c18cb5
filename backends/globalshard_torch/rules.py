"""Sharding rules: how each Megatron-style parameter is cut across TP ranks.

Rules are declared once per model, by regular expressions on parameter names
(with global layer indices), and turn a rank's local tensor into the place it
holds in the global array:

==========================  ==================================================
rule                        local tensor on TP rank r of T
==========================  ==================================================
``ColumnParallel()``        rows ``[r*n, (r+1)*n)`` (weight and bias split on the output axis)
``RowParallel()``           columns ``[r*n, (r+1)*n)`` (weight split on the input axis)
``Split(axis)``             the same on any axis
``VocabParallel(vocab)``    rows of a vocabulary padded to a multiple of T; padding rows in ``<key>#padding``
``Replicated()``            the whole tensor (norms, row-parallel biases, LoRA A of column-parallel layers)
``PackedQKV(heads, kv)``    ``[q_r; k_r; v_r]`` of a global ``[Q; K; V]``, grouped-query attention allowed
``MegatronQKV(heads, ng)``  Megatron-Core's ``linear_qkv``: per query group, its q heads, then k, then v (any ng/TP)
``PackedSwiGLU()``          ``[gate_r; up_r]`` of a global ``[gate; up]``
``Tied("embedding.weight")`` a copy of another parameter (tied input/output embeddings), stored once under its key
``FirstStage(rule)``        ``rule``, held by stage 0's chunk 0; the same name in another chunk is a copy of it
``Experts(E, inner)``       one module per expert (``local_experts.<i>.`` or ``weight<i>``), global ``[E, ...]``
``StackedExperts(E, inner)`` an EP rank's experts stacked on axis 0 (grouped GEMM), the same global ``[E, ...]``
==========================  ==================================================

LoRA adapters use the same rules: B of a column-parallel layer is
``ColumnParallel`` (of QKV: ``PackedQKV``; of SwiGLU: ``PackedSwiGLU``), A of
a row-parallel layer is ``RowParallel``, the other factor ``Replicated``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from globalshard import Box, Region, Segment
from globalshard.errors import LayoutError
from globalshard_torch.parallel import ParallelLayout

__all__ = [
    "ColumnParallel",
    "Experts",
    "FirstStage",
    "MegatronQKV",
    "PackedQKV",
    "PackedSwiGLU",
    "Placement",
    "Replicated",
    "RowParallel",
    "Rule",
    "ShardingRules",
    "Split",
    "StackedExperts",
    "Tied",
    "VocabParallel",
]


@dataclass(frozen=True)
class Placement:
    """Where a local tensor sits in its global array (what a ShardedTensor needs)."""

    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    segments: tuple[Segment, ...] | None = None  # along axis 0 when set
    allow_padding: bool = False
    tp_main: bool = True  # False on TP ranks that hold a copy of another rank's values
    regions: tuple[Region, ...] | None = None  # when set, the layout itself (DTensors, experts)
    expert: bool = False  # replicated over expert data parallelism, not dense DP
    local_view: tuple[int, ...] | None = None  # the local tensor seen with this shape (an expert axis of 1)
    segment_replicas: tuple[int, ...] | None = None  # per segment: 0 main, >0 a copy another TP rank also holds
    padded_rows: int | None = None  # axis 0 padded to this many rows on this layout; the rows past
    # global_shape[0] are stored in the key's padding companion (spec section 1)


class Rule:
    """Base of the rules: map a local shape on a layout to a Placement."""

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        raise NotImplementedError


@dataclass(frozen=True)
class Replicated(Rule):
    """Every TP rank holds the whole tensor; TP rank 0's copy is the main one."""

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        return Placement(local_shape, (0,) * len(local_shape), tp_main=layout.tp_rank == 0)


@dataclass(frozen=True)
class Split(Rule):
    """Evenly split on ``axis`` across TP ranks, in rank order."""

    axis: int = 0

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        axis = _axis(self.axis, local_shape)
        n = local_shape[axis]
        gshape = tuple(s * layout.tp_size if d == axis else s for d, s in enumerate(local_shape))
        offset = tuple(layout.tp_rank * n if d == axis else 0 for d in range(len(local_shape)))
        return Placement(gshape, offset)


@dataclass(frozen=True)
class ColumnParallel(Split):
    """Split on the output axis (0): column-parallel weights and their biases."""

    axis: int = 0


@dataclass(frozen=True)
class RowParallel(Split):
    """Split on the input axis (1): row-parallel weights (their bias is Replicated)."""

    axis: int = 1


@dataclass(frozen=True)
class VocabParallel(Rule):
    """Vocabulary rows split across TP ranks after padding the vocabulary to a
    multiple of the TP size (so the padded size depends on TP). The key holds
    exactly the first ``vocab_size`` rows; the padding rows (trained where the
    loss runs over the padded vocabulary, as Megatron-Core's does) go to the
    key's ``#padding`` companion, so a same-layout resume is exact, and on
    another layout the rows inside both padded sizes carry over and the rest
    are zero (as Megatron-Core does)."""

    vocab_size: int
    axis: int = 0

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        axis = _axis(self.axis, local_shape)
        n = local_shape[axis]
        if n * layout.tp_size < self.vocab_size:
            raise LayoutError(
                f"vocabulary shard of {n} rows x TP {layout.tp_size} cannot hold a vocabulary of {self.vocab_size}"
            )
        gshape = tuple(self.vocab_size if d == axis else s for d, s in enumerate(local_shape))
        offset = tuple(layout.tp_rank * n if d == axis else 0 for d in range(len(local_shape)))
        # TODO(limitation): padding rows of a vocabulary split on an axis other than 0 are not stored.
        padded = n * layout.tp_size if axis == 0 and n * layout.tp_size > self.vocab_size else None
        return Placement(gshape, offset, allow_padding=True, padded_rows=padded)


@dataclass(frozen=True)
class PackedQKV(Rule):
    """Fused QKV: global rows ``[Q; K; V]`` with ``num_heads`` query heads and
    ``num_kv_heads`` key/value heads of equal size; TP rank r holds
    ``[q_r; k_r; v_r]``. Grouped-query attention: ``num_kv_heads < num_heads``.

    With TP larger than ``num_kv_heads`` (as vLLM lays it out), each kv head
    is held by ``TP / num_kv_heads`` consecutive ranks: rank r holds its own
    query heads and the key and value of head ``r // (TP / num_kv_heads)``;
    the first of those ranks holds the main copy, the others replicas."""

    num_heads: int
    num_kv_heads: int

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        tp, r = layout.tp_size, layout.tp_rank
        heads = self.num_heads + 2 * self.num_kv_heads
        if self.num_heads % tp or (self.num_kv_heads % tp and tp % self.num_kv_heads):
            raise LayoutError(f"fused QKV at TP={tp} does not fit {self.num_heads} query and {self.num_kv_heads} "
                              "key/value heads (query heads must divide by TP, and kv heads divide TP or be "
                              "divided by it)")
        if self.num_kv_heads % tp == 0:
            rows = local_shape[0] * tp
            if rows % heads:
                raise LayoutError(f"fused QKV of {local_shape[0]} local rows at TP={tp} does not fit "
                                  f"{self.num_heads} query and {self.num_kv_heads} key/value heads")
            hd = rows // heads
            q, kv = self.num_heads * hd // tp, self.num_kv_heads * hd // tp
            qh, kh = self.num_heads * hd, self.num_kv_heads * hd
            segments = (Segment(0, r * q, q), Segment(q, qh + r * kv, kv), Segment(q + kv, qh + kh + r * kv, kv))
            return Placement((rows, *local_shape[1:]), (0,) * len(local_shape), segments)
        # TP > kv heads: one kv head per rank, shared by `share` ranks.
        share = tp // self.num_kv_heads
        per_rank_q = self.num_heads // tp
        if local_shape[0] % (per_rank_q + 2):
            raise LayoutError(f"fused QKV of {local_shape[0]} local rows at TP={tp} is not {per_rank_q} query "
                              "heads plus one key and one value head")
        hd = local_shape[0] // (per_rank_q + 2)
        q, g = per_rank_q * hd, r // share
        qh, kh = self.num_heads * hd, self.num_kv_heads * hd
        segments = (Segment(0, r * q, q), Segment(q, qh + g * hd, hd), Segment(q + hd, qh + kh + g * hd, hd))
        rep = r % share
        return Placement((qh + 2 * kh, *local_shape[1:]), (0,) * len(local_shape), segments,
                         segment_replicas=(0, rep, rep))


@dataclass(frozen=True)
class MegatronQKV(Rule):
    """Megatron-Core's fused ``linear_qkv`` (weight, bias, or the LoRA B of
    it): rows interleaved per query group, each group's
    ``num_heads/num_query_groups`` query heads, then its key head, then its
    value head (``q1 q2 k1 v1 | q3 q4 k2 v2 | ...``), split evenly across TP
    ranks as a ``ColumnParallelLinear``. With ``num_query_groups`` a multiple
    of TP each rank holds whole groups; with TP a multiple of
    ``num_query_groups`` (fewer kv heads than ranks, which Megatron-Core also
    accepts) a rank holds a slice of one group, as
    ``SelfAttention.get_query_key_value_tensors`` gathers it.

    Stored as the same global ``[Q; K; V]`` as :class:`PackedQKV`, so a
    checkpoint saved with one loads into the other.
    """

    num_heads: int
    num_query_groups: int

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        tp, r = layout.tp_size, layout.tp_rank
        np_, ng = self.num_heads, self.num_query_groups
        if ng <= 0 or np_ % ng:
            raise LayoutError(f"{np_} query heads do not split into {ng} query groups")
        if ng % tp and tp % ng:
            raise LayoutError(f"{ng} query groups at TP={tp}: Megatron-Core needs num_query_groups to be a "
                              "multiple or a divisor of the TP size")
        rows = local_shape[0] * tp
        if rows % (np_ + 2 * ng):
            raise LayoutError(f"fused QKV of {local_shape[0]} local rows at TP={tp} is not {ng} groups of "
                              f"{np_ // ng} query + 1 key + 1 value heads")
        hn = rows // (np_ + 2 * ng)
        q = (np_ // ng) * hn
        group_rows = q + 2 * hn
        # Each group's pieces in the interleaved order: (offset in the group, global row, length).
        pieces = [(0, 0, q), (q, np_ * hn, hn), (q + hn, (np_ + ng) * hn, hn)]
        lo, hi = r * local_shape[0], (r + 1) * local_shape[0]
        segments = []
        for g in range(lo // group_rows, -(-hi // group_rows)):
            for within, global_base, length in pieces:
                start = g * group_rows + within
                a, b = max(start, lo), min(start + length, hi)
                if a < b:
                    step = q if within == 0 else hn
                    segments.append(Segment(a - lo, global_base + g * step + (a - start), b - a))
        return Placement((rows, *local_shape[1:]), (0,) * len(local_shape), tuple(segments))


@dataclass(frozen=True)
class PackedSwiGLU(Rule):
    """Fused SwiGLU input projection: global rows ``[gate; up]``, TP rank r
    holds ``[gate_r; up_r]``."""

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        tp, r = layout.tp_size, layout.tp_rank
        if local_shape[0] % 2:
            raise LayoutError(f"fused gate/up of {local_shape[0]} local rows is not [gate_r; up_r]")
        f = local_shape[0] // 2
        rows = local_shape[0] * tp
        segments = (Segment(0, r * f, f), Segment(f, tp * f + r * f, f))
        return Placement((rows, *local_shape[1:]), (0,) * len(local_shape), segments)


def _inner_regions(p: Placement, local_shape: tuple[int, ...]) -> list[Region]:
    """A placement's regions (one box, or one per segment along axis 0)."""
    if p.regions is not None:
        return list(p.regions)
    if p.allow_padding:
        raise LayoutError("a padded layout (VocabParallel) cannot hold experts")
    if p.segments is None:
        return [Region(Box((0,) * len(local_shape), local_shape), Box(p.global_offset, local_shape))]
    rest = local_shape[1:]
    return [Region(Box((seg.local_offset,) + (0,) * len(rest), (seg.length, *rest)),
                   Box((seg.global_offset, *p.global_offset[1:]), (seg.length, *rest))) for seg in p.segments]


def _with_expert_axis(regions: list[Region], local_expert: int | None, global_expert: int) -> list[Region]:
    """Regions of one expert with the expert axis in front, on both sides: the
    local tensor stacks experts (``local_expert``), or is viewed with a
    leading axis of one (None)."""
    lo = 0 if local_expert is None else local_expert
    return [Region(Box((lo, *r.local_box.offset), (1, *r.local_box.shape)),
                   Box((global_expert, *r.global_box.offset), (1, *r.global_box.shape))) for r in regions]


_LOCAL_EXPERT = re.compile(r"(?:^|\.)local_experts\.(\d+)(?=\.)|(?<=\.)(weight|bias)(\d+)$")


@dataclass(frozen=True)
class Experts(Rule):
    """One module per expert (Megatron-Core's ``SequentialMLP``:
    ``...experts.local_experts.<i>.linear_fc1.weight``; or Transformer Engine's
    ``GroupedLinear``: ``...experts.linear_fc1.weight<i>``). Local expert i of
    EP rank e is global expert ``e * num_experts / ep_size + i``; ``inner``
    cuts one expert across the expert TP (``ParallelLayout.etp_size``). Stored, index removed from the key, as one
    global ``[num_experts, *expert_shape]`` array, the same as
    :class:`StackedExperts`, so either layout loads the other."""

    num_experts: int
    inner: Rule = field(default_factory=lambda: ColumnParallel())

    def bind(self, name: str, layout: ParallelLayout) -> tuple[str, Rule]:
        """The key (local expert index removed) and the rule for this expert."""
        matches = list(_LOCAL_EXPERT.finditer(name))
        if not matches:
            raise LayoutError(f"{name!r}: no local expert index ('local_experts.<i>.' or 'weight<i>')")
        m = matches[-1]
        if m.group(1) is not None:
            local = int(m.group(1))
            key = name[:m.start()] + name[m.end():]
        else:
            local = int(m.group(3))
            key = name[:m.start()] + m.group(2)
        per_rank = _experts_per_rank(self.num_experts, layout)
        if local >= per_rank:
            raise LayoutError(f"{name!r}: local expert {local}, but each of {layout.ep_size} EP ranks holds "
                              f"{per_rank} of {self.num_experts} experts")
        return key, _OneExpert(self.inner, layout.ep_rank * per_rank + local, self.num_experts)

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        raise LayoutError("Experts places a parameter through its name: use ShardingRules.resolve")


@dataclass(frozen=True)
class _OneExpert(Rule):
    inner: Rule
    expert: int
    num_experts: int

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        p = self.inner.place(local_shape, layout.for_experts())
        regions = _with_expert_axis(_inner_regions(p, local_shape), None, self.expert)
        return Placement((self.num_experts, *p.global_shape), (0,) * (len(local_shape) + 1), regions=tuple(regions),
                         tp_main=p.tp_main, expert=True, local_view=(1, *local_shape))


@dataclass(frozen=True)
class StackedExperts(Rule):
    """This EP rank's experts stacked in one tensor ``[experts per rank,
    *expert_shape]`` (grouped GEMM; torchtitan's ``GroupedExperts``); ``inner``
    cuts each expert across the expert TP. Stored as the global ``[num_experts,
    *expert_shape]`` array :class:`Experts` uses."""

    num_experts: int
    inner: Rule = field(default_factory=lambda: ColumnParallel())

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        per_rank = _experts_per_rank(self.num_experts, layout)
        if not local_shape or local_shape[0] != per_rank:
            raise LayoutError(f"stacked experts of shape {local_shape}: expected {per_rank} experts on axis 0 "
                              f"({self.num_experts} over EP={layout.ep_size})")
        p = self.inner.place(local_shape[1:], layout.for_experts())
        inner = _inner_regions(p, local_shape[1:])
        regions = [r for j in range(per_rank)
                   for r in _with_expert_axis(inner, j, layout.ep_rank * per_rank + j)]
        return Placement((self.num_experts, *p.global_shape), (0,) * len(local_shape), regions=tuple(regions),
                         tp_main=p.tp_main, expert=True)


def _experts_per_rank(num_experts: int, layout: ParallelLayout) -> int:
    if num_experts % layout.ep_size:
        raise LayoutError(f"{num_experts} experts do not split over EP={layout.ep_size}")
    return num_experts // layout.ep_size


@dataclass(frozen=True)
class Tied(Rule):
    """This parameter holds the same values as ``canonical`` (tied embeddings):
    stored once, under ``canonical``'s key and with its rule, this copy being a
    replica. On load both are filled from the same stored values."""

    canonical: str


@dataclass(frozen=True)
class FirstStage(Rule):
    """``rule``, for a parameter the pipeline's first (virtual) stage holds
    (stage 0, chunk 0) and another chunk holds again under the same name:
    Megatron-Core's word embeddings, which its multi-token-prediction stage
    keeps a copy of. The copy is a replica on save and is filled from the same
    stored values on load."""

    rule: Rule

    def place(self, local_shape: tuple[int, ...], layout: ParallelLayout) -> Placement:
        return self.rule.place(local_shape, layout)


def _axis(axis: int, shape: tuple[int, ...]) -> int:
    if not -len(shape) <= axis < len(shape):
        raise LayoutError(f"axis {axis} does not exist in a tensor of shape {shape}")
    return axis % len(shape)


class ShardingRules:
    r"""Ordered ``(regex, rule)`` pairs; a name takes the first rule whose regex
    matches it entirely. A name that no rule matches is an error, never a guess.

    >>> rules = ShardingRules([(r"embedding\.weight", VocabParallel(1003)), (r".*norm.*", Replicated())])
    >>> rules.resolve("final_norm.weight")
    ('final_norm.weight', Replicated(), False)
    """

    def __init__(self, rules: Sequence[tuple[str, Rule]]) -> None:
        self._rules = [(re.compile(p), r) for p, r in rules]
        for pattern, rule in rules:
            if not isinstance(rule, Rule):
                raise LayoutError(f"rule for {pattern!r} is not a Rule: {rule!r}")

    def rule_for(self, name: str) -> Rule | None:
        for pattern, rule in self._rules:
            if pattern.fullmatch(name):
                return rule
        return None

    def resolve(self, name: str) -> tuple[str, Rule, bool]:
        """``(checkpoint key, rule giving the layout, is a tied copy)`` for a global name."""
        rule = self.rule_for(name)
        if rule is None:
            raise LayoutError(f"no sharding rule matches parameter {name!r}")
        if isinstance(rule, Tied):
            target = self.rule_for(rule.canonical)
            if target is None or isinstance(target, Tied):
                raise LayoutError(f"{name!r} is tied to {rule.canonical!r}, which has no (untied) rule")
            return rule.canonical, target, True
        return name, rule, False

    def resolve_on(self, name: str, layout: ParallelLayout, chunk: int = 0) -> tuple[str, Rule, bool]:
        """:meth:`resolve` in virtual chunk ``chunk`` of this rank: per-expert rules
        bound to its experts, a :class:`FirstStage` tensor a copy outside stage 0's chunk 0."""
        key, rule, tied = self.resolve(name)
        if isinstance(rule, FirstStage):
            rule, tied = rule.rule, tied or layout.pp_rank > 0 or chunk > 0
        if isinstance(rule, Experts):
            key, rule = rule.bind(key, layout)
        return key, rule, tied
