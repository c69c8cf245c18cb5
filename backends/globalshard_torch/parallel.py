"""Where a rank sits in a TP x PP (x VPP) x DP job, and which global layer each
of its local layers is.

Checkpoint keys use global layer indices (``layers.13.mlp...``), so a stage
holding local layer 1 of virtual chunk 2 under one layout and a stage holding
it as local layer 5 under another read and write the same key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from globalshard.errors import LayoutError

__all__ = ["LAYERS", "ParallelLayout"]

# Where a parameter name holds its local layer number (the second group): the first
# ``layers.<i>`` component, except Megatron-Core's multi-token-prediction layers
# (``mtp.layers.<i>``), which it numbers apart from the decoder's and keeps on one stage.
LAYERS = r"(^|\.)(?<!mtp\.)layers\.(\d+)(?=\.|$)"


@dataclass(frozen=True)
class ParallelLayout:
    """A rank's place in the parallel job.

    Args:
        tp_rank, tp_size: tensor-parallel rank and size.
        pp_rank, pp_size: pipeline stage and number of stages.
        vpp_size: virtual pipeline chunks per stage (1: no interleaving).
        dp_rank, dp_size: data-parallel rank and size.
        ep_size: expert-parallel size. The ranks of a stage are numbered
            ``tp_rank + tp_size * dp_rank``, and the experts cut that number
            in Megatron-Core's ``tp-ep-dp`` order: expert TP rank fastest,
            then ``ep_rank``, then the expert data-parallel rank. With the
            expert TP equal to TP: ``ep_rank = dp_rank % ep_size`` and the
            expert data-parallel rank is ``dp_rank // ep_size``.
        etp_size: expert tensor-parallel size (Megatron-Core's
            ``expert_tensor_parallel_size``); None: ``tp_size``.
        num_layers: transformer layers in the whole model.
        stage_layers: a custom assignment: ``stage_layers[pp_rank][chunk]``
            lists the global layer indices of that chunk, in local order. When
            None, Megatron's interleaved assignment: chunk ``c`` of stage ``s``
            holds layers ``[(c * pp_size + s) * n, +n)`` with
            ``n = num_layers / (pp_size * vpp_size)``.
        groups: process groups for the trainer's own use (tp, pp, dp); not
            used by the checkpoint and not compared.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    ep_size: int = 1
    etp_size: int | None = None
    num_layers: int = 0
    stage_layers: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    groups: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        for name in ("tp", "pp", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                problems.append(f"{name}_rank {rank} is not in [0, {name}_size={size})")
        if self.vpp_size < 1:
            problems.append(f"vpp_size {self.vpp_size} < 1")
        if self.etp_size is None:
            if self.ep_size < 1 or self.dp_size % self.ep_size:
                problems.append(f"ep_size {self.ep_size} does not divide dp_size {self.dp_size}")
        elif self.etp_size < 1 or self.ep_size < 1 or (self.tp_size * self.dp_size) % (self.etp_size * self.ep_size):
            problems.append(f"etp_size {self.etp_size} x ep_size {self.ep_size} does not divide tp_size x dp_size = "
                            f"{self.tp_size * self.dp_size}")
        if self.stage_layers is not None:
            stages = tuple(tuple(tuple(int(i) for i in chunk) for chunk in st) for st in self.stage_layers)
            object.__setattr__(self, "stage_layers", stages)
            if len(stages) != self.pp_size or any(len(st) != self.vpp_size for st in stages):
                problems.append(f"stage_layers must be {self.pp_size} stages x {self.vpp_size} chunks")
            else:
                flat = sorted(i for st in stages for chunk in st for i in chunk)
                if flat != list(range(len(flat))):
                    problems.append("stage_layers must hold every layer 0..n-1 exactly once")
                object.__setattr__(self, "num_layers", len(flat))
        elif self.num_layers % (self.pp_size * self.vpp_size):
            problems.append(
                f"num_layers {self.num_layers} is not divisible by pp_size * vpp_size = {self.pp_size * self.vpp_size}"
                "; pass stage_layers for an uneven assignment"
            )
        if problems:
            raise LayoutError("invalid parallel layout: " + "; ".join(problems))

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def chunk_layers(self, chunk: int, pp_rank: int | None = None) -> tuple[int, ...]:
        """Global indices of the layers of virtual chunk ``chunk`` of a stage, in local order."""
        s = self.pp_rank if pp_rank is None else pp_rank
        if not 0 <= chunk < self.vpp_size:
            raise LayoutError(f"chunk {chunk} is not in [0, vpp_size={self.vpp_size})")
        if self.stage_layers is not None:
            return self.stage_layers[s][chunk]
        n = self.num_layers // (self.pp_size * self.vpp_size)
        first = (chunk * self.pp_size + s) * n
        return tuple(range(first, first + n))

    def global_layer(self, chunk: int, local: int) -> int:
        layers = self.chunk_layers(chunk)
        if not 0 <= local < len(layers):
            raise LayoutError(
                f"local layer {local} is not in chunk {chunk} of stage {self.pp_rank} ({len(layers)} layers)"
            )
        return layers[local]

    @property
    def expert_tp_size(self) -> int:
        return self.tp_size if self.etp_size is None else self.etp_size

    @property
    def expert_tp_rank(self) -> int:
        return (self.tp_rank + self.tp_size * self.dp_rank) % self.expert_tp_size

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (Megatron-Core's tp-ep-dp order)."""
        return (self.tp_rank + self.tp_size * self.dp_rank) // self.expert_tp_size % self.ep_size

    @property
    def expert_dp_rank(self) -> int:
        """Which copy of its experts this rank holds (0: the main one)."""
        return (self.tp_rank + self.tp_size * self.dp_rank) // (self.expert_tp_size * self.ep_size)

    def for_experts(self) -> ParallelLayout:
        """This rank as its experts are cut: TP is the expert TP, and DP the
        rest of the stage's ranks, in the same order (itself when they agree)."""
        if self.expert_tp_size == self.tp_size:
            return self
        etp, position = self.expert_tp_size, self.tp_rank + self.tp_size * self.dp_rank
        return replace(self, tp_rank=position % etp, tp_size=etp, dp_rank=position // etp,
                       dp_size=self.tp_size * self.dp_size // etp, etp_size=None)

    def global_name(self, name: str, chunk: int, pattern: str = LAYERS) -> str:
        """``name`` with its local layer index replaced by the global one."""

        def swap(m: re.Match[str]) -> str:
            return f"{m.group(1)}layers.{self.global_layer(chunk, int(m.group(2)))}"

        return re.sub(pattern, swap, name, count=1)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in (
            "tp_rank", "tp_size", "pp_rank", "pp_size", "vpp_size", "dp_rank", "dp_size", "ep_size", "num_layers")}
        if self.expert_tp_size != self.tp_size:
            out["etp_size"] = self.etp_size
        out["stage_layers"] = None if self.stage_layers is None else [[list(c) for c in st] for st in self.stage_layers]
        return out

    def config_json(self) -> dict[str, Any]:
        """The job-wide configuration (no per-rank fields), for trainer_state.json."""
        out = self.to_json()
        for k in ("tp_rank", "pp_rank", "dp_rank"):
            del out[k]
        return out
