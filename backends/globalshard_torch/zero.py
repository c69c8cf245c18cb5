"""Distributed optimizers (ZeRO-1/2): each data-parallel rank holds the optimizer
state of only part of every parameter.

A :class:`FlatShard` is one rank's piece of one parameter's state: the flat
(C-order) range ``[start, stop)`` of the parameter's local (TP) tensor, and a
1-D tensor per state item holding exactly those elements (``exp_avg``,
``exp_avg_sq``, ``master`` for an fp32 main copy), plus 0-d items such as
``step``. ``save_checkpoint(..., optimizer_shards=...)`` stores each piece at
its place in the global array, under the same keys as an ordinary optimizer's
state (``optimizer.exp_avg.<param key>``), so a checkpoint saved by a
distributed optimizer at one DP and TP size loads into one at any other, or
into a plain optimizer, and back. No rank ever holds more than its own pieces.

:func:`megatron_param_ranges` computes which pieces a rank owns the way
Megatron-Core's ``DistributedOptimizer`` lays out its buffers (read from
``megatron/core/optimizer/param_layout.py`` and ``distrib_optimizer.py``):
parameters in reverse order, each start padded to 64 elements, a bucket closed
once it holds ``bucket_size`` elements (or at a shared embedding) with its end
padded to ``lcm(dp_size, 128)`` (and ``2**16`` with
``pad_buckets_for_high_nccl_busbw``), each DP rank owning an equal contiguous
slice of every bucket. :func:`zero_redundancy_shards` maps torch's
``ZeroRedundancyOptimizer``, which gives each rank whole parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from globalshard.errors import LayoutError

__all__ = ["FlatShard", "megatron_param_ranges", "zero_redundancy_shards"]


@dataclass
class FlatShard:
    """One DP rank's piece of one parameter's optimizer state (see the module docstring)."""

    param: torch.Tensor
    start: int
    stop: int
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        numel = _local(self.param).numel()
        if not 0 <= self.start <= self.stop <= numel:
            raise LayoutError(f"flat range [{self.start}, {self.stop}) is not inside a parameter of {numel} elements")
        for item, t in self.state.items():
            if t.ndim != 0 and (t.ndim != 1 or t.numel() != self.stop - self.start):
                raise LayoutError(f"optimizer state {item!r}: shape {tuple(t.shape)} does not hold the flat range "
                                  f"[{self.start}, {self.stop}) (a 1-D tensor of {self.stop - self.start}, or 0-d)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def megatron_param_ranges(
    params: Sequence[torch.Tensor],
    *,
    dp_size: int,
    dp_rank: int,
    bucket_size: int | None = None,
    pad_buckets_for_high_nccl_busbw: bool = False,
    new_bucket: Callable[[torch.Tensor], bool] = lambda p: bool(getattr(p, "shared_embedding", False)),
) -> list[tuple[torch.Tensor, int, int]]:
    """``(param, start, stop)``: the flat elements of each parameter of one
    buffer (one dtype; ``params`` in the order the model lists them) that DP
    rank ``dp_rank`` owns under Megatron-Core's distributed optimizer. Params
    it owns nothing of are left out.

    Reversed, ``b`` takes [0, 10) and ``a`` [64, 164) of one bucket padded to
    256; each of 2 ranks owns 128 elements:

    >>> import torch
    >>> a, b = torch.zeros(100), torch.zeros(10)
    >>> [(int(p.numel()), s, e) for p, s, e in megatron_param_ranges([a, b], dp_size=2, dp_rank=0)]
    [(10, 0, 10), (100, 0, 64)]
    >>> [(int(p.numel()), s, e) for p, s, e in megatron_param_ranges([a, b], dp_size=2, dp_rank=1)]
    [(100, 64, 100)]
    """
    if not 0 <= dp_rank < dp_size:
        raise LayoutError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
    divisor = math.lcm(dp_size, 128, 2**16) if pad_buckets_for_high_nccl_busbw else math.lcm(dp_size, 128)
    placed: list[tuple[torch.Tensor, int, int]] = []
    buckets: list[tuple[int, int]] = []
    start = bucket_start = 0
    open_bucket = False

    def close(end: int) -> int:
        padded = -(-end // divisor) * divisor
        buckets.append((bucket_start, padded))
        return padded

    for p in list(params)[::-1]:
        start = -(-start // 64) * 64
        if new_bucket(p) and open_bucket:
            bucket_start = start = close(start)
            open_bucket = False
        end = start + _local(p).numel()
        placed.append((p, start, end))
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or new_bucket(p):
            bucket_start = start = close(end)
            open_bucket = False
        else:
            start = end
    if open_bucket:
        close(end)
    owned = []
    for b_start, b_end in buckets:
        share = (b_end - b_start) // dp_size
        lo, hi = b_start + dp_rank * share, b_start + (dp_rank + 1) * share
        for p, s, e in placed:
            a, z = max(s, lo), min(e, hi)
            if z > a:
                owned.append((p, a - s, z - s))
    return owned


def zero_redundancy_shards(optimizer: Any, *, create: bool = False) -> list[FlatShard]:
    """The pieces of a ``torch.distributed.optim.ZeroRedundancyOptimizer``: each
    rank holds the whole state of the parameters in its partition. With
    ``create``, state not yet there is made (zeros) for a load to fill."""
    local = optimizer.optim
    out = []
    for group in local.param_groups:
        for p in group["params"]:
            state = local.state.get(p, {})
            if create and not state:
                state = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                         "step": torch.zeros((), dtype=torch.float32)}
                local.state[p] = state
            out.append(FlatShard(p, 0, _local(p).numel(),
                                 {k: v.view(-1) if v.ndim else v for k, v in state.items() if torch.is_tensor(v)}))
    return out
