"""A rank's model parameters as entries: checkpoint key, tensor, and the place
of its local piece in the global array.

Parameters that are DTensors place themselves (their mesh and placements say
where they are); all others are placed by the model's ShardingRules on the
rank's ParallelLayout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import globalshard as gs
from globalshard.errors import LayoutError, format_problems
from globalshard_torch.parallel import ParallelLayout
from globalshard_torch.rules import Placement, ShardingRules

__all__ = ["Entry", "model_entries", "outside_mesh"]


@dataclass(frozen=True)
class Entry:
    """One local tensor of the model and where it belongs."""

    name: str  # local name, "chunk{c}/{module path}" when there are several chunks
    key: str  # checkpoint key (global layer index)
    tensor: torch.Tensor  # the local tensor (a DTensor's local shard)
    placement: Placement
    main: bool  # this rank's piece is the main replica of its region
    param: torch.Tensor  # the model's own object (a DTensor for DTensor parameters)
    scalar_main: bool  # the one rank whose per-parameter scalars (Adam's step) are the main copy

    def shard(self, key: str, data: np.ndarray) -> gs.ShardedTensor:
        """A ShardedTensor with this entry's layout for ``data`` (the parameter,
        or an optimizer moment of the same local shape)."""
        p = self.placement
        replica = 0 if self.main else 1
        if tuple(data.shape) != tuple(self.tensor.shape):
            raise LayoutError(
                f"{key!r}: local shape {data.shape} differs from the parameter's {tuple(self.tensor.shape)}"
            )
        if p.segments is not None:
            return gs.ShardedTensor.from_segments(
                key, data, global_shape=p.global_shape, axis=0, segments=p.segments,
                global_offset=p.global_offset, replica_id=replica, allow_padding=p.allow_padding,
            )
        return gs.ShardedTensor.from_offset(
            key, data, global_shape=p.global_shape, global_offset=p.global_offset, replica_id=replica,
            allow_padding=p.allow_padding,
        )


def _dtensor_placement(param: torch.Tensor) -> tuple[torch.Tensor, Placement, bool, bool]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        raise LayoutError(f"expected a DTensor, got {type(param).__name__}")
    mesh, placements = param.device_mesh, param.placements
    for pl in placements:
        # TODO(limitation): _StridedShard (FSDP2 + TP on one dim) and Partial are not mapped.
        if type(pl) not in (Shard, Replicate):
            raise LayoutError(f"DTensor placement {pl} is not supported (Shard and Replicate are)")
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    coord = mesh.get_coordinate()
    main = coord is not None and all(
        coord[i] == 0 for i, pl in enumerate(placements) if isinstance(pl, Replicate)
    )
    first = coord is not None and all(c == 0 for c in coord)
    placement = Placement(tuple(int(s) for s in param.shape), tuple(int(o) for o in offset))
    if tuple(shape) != tuple(local.shape):
        raise LayoutError(f"DTensor local shard {tuple(local.shape)} differs from its computed shape {tuple(shape)}")
    return local, placement, main, first


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def model_entries(
    chunks: nn.Module | Sequence[nn.Module],
    layout: ParallelLayout,
    rules: ShardingRules | None,
    *,
    layer_pattern: str = r"(^|\.)layers\.(\d+)(?=\.|$)",
) -> list[Entry]:
    """Every parameter and persistent buffer of this rank's model chunks.

    Args:
        chunks: the model, or its virtual-pipeline chunks in local order.
        layout: this rank's place; local layer indices become global ones.
        rules: how non-DTensor tensors are cut; every such name must match one.

    Raises:
        LayoutError: listing every tensor no rule matches or that a rule cannot place.
    """
    modules = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    if len(modules) != layout.vpp_size:
        raise LayoutError(f"{len(modules)} model chunks given, the layout has vpp_size={layout.vpp_size}")
    problems = _unsupported_state(modules)
    entries: list[Entry] = []
    for c, module in enumerate(modules):
        named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
        named += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if _persistent(module, n)]
        # The same tensor under several names (tied weights at PP=1) is stored
        # once, under the name its rule calls canonical, whatever the order in
        # which the modules were registered.
        names: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for name, tensor in named:
            names.setdefault(id(tensor), []).append(name)
            tensors[id(tensor)] = tensor
        for tid, aliases in names.items():
            tensor = tensors[tid]
            name = _canonical_alias(aliases, layout, c, layer_pattern, rules) if len(aliases) > 1 else aliases[0]
            label = f"chunk{c}/{name}" if len(modules) > 1 else name
            try:
                gname = layout.global_name(name, c, layer_pattern)
                if _is_dtensor(tensor):
                    if outside_mesh(tensor):
                        continue  # this rank is outside the DTensor's mesh: it holds nothing of it
                    local, placement, main, first = _dtensor_placement(tensor)
                    in_dp0 = layout.dp_rank == 0
                    entries.append(Entry(label, gname, local, placement, main and in_dp0, tensor, first and in_dp0))
                    continue
                if rules is None:
                    raise LayoutError("not a DTensor, and no sharding rules were given")
                key, rule, tied_copy = rules.resolve(gname)
                placement = rule.place(tuple(tensor.shape), layout)
                main = placement.tp_main and layout.dp_rank == 0 and not tied_copy
                entries.append(Entry(label, key, tensor, placement, main, tensor, main and layout.tp_rank == 0))
            except LayoutError as e:
                problems.append(f"{label}: {e}")
    if problems:
        raise LayoutError(format_problems("cannot place the model's tensors", problems))
    return entries


def outside_mesh(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor on a mesh that does not include this rank."""
    return _is_dtensor(tensor) and tensor.device_mesh.get_coordinate() is None  # type: ignore[attr-defined]


def _canonical_alias(aliases: list[str], layout: ParallelLayout, chunk: int, layer_pattern: str,
                     rules: ShardingRules | None) -> str:
    if rules is None:
        return aliases[0]
    for name in aliases:
        try:
            if not rules.resolve(layout.global_name(name, chunk, layer_pattern))[2]:
                return name
        except LayoutError:
            continue
    return aliases[0]


def _unsupported_state(modules: list[nn.Module]) -> list[str]:
    """State the adapter cannot save yet, named, so that nothing is dropped silently."""
    problems = []
    for c, module in enumerate(modules):
        for name, sub in module.named_modules():
            # TODO(limitation): nn.Module.get_extra_state() (Transformer Engine's FP8
            # scaling state) is not saved; a module that has it is refused.
            if type(sub).get_extra_state is not nn.Module.get_extra_state:
                where = f"chunk{c}/{name}" if len(modules) > 1 else (name or "the model")
                problems.append(f"{where}: {type(sub).__name__} keeps extra state (get_extra_state), which "
                                "globalshard_torch does not save yet; refusing rather than dropping it")
    return problems


def _persistent(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return leaf not in sub._non_persistent_buffers_set
