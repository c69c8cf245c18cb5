"""A rank's model parameters as entries: checkpoint key, tensor, and the place
of its local piece in the global array.

Parameters that are DTensors place themselves (their mesh and placements say
where they are); all others are placed by the model's ShardingRules on the
rank's ParallelLayout.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

import globalshard as gs
from globalshard.errors import LayoutError, format_problems
from globalshard_torch.parallel import LAYERS, ParallelLayout
from globalshard_torch.rules import Placement, ShardingRules
from globalshard_torch.tensors import unusable

__all__ = ["Entry", "model_entries", "outside_mesh", "unwrapped_name"]


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
    # The same, ignoring data parallelism: for state that DP ranks partition (a
    # distributed optimizer) rather than replicate. None: as main / scalar_main.
    main_across_dp: bool | None = None
    scalar_main_across_dp: bool | None = None

    def regions(self) -> tuple[tuple[int, ...], list[tuple[gs.Region, bool]]]:
        """``(local shape, [(region, is a replica on every rank)])`` of this
        entry's layout, without its data. A region is a replica regardless of
        data parallelism when its segment is (kv heads shared by TP ranks)."""
        shape = tuple(self.tensor.shape)
        p = self.placement
        if p.segment_replicas is not None:
            assert p.segments is not None
            rest = shape[1:]
            return shape, [(gs.Region(gs.Box((seg.local_offset, *(0,) * len(rest)), (seg.length, *rest)),
                                      gs.Box((seg.global_offset, *p.global_offset[1:]), (seg.length, *rest))), rep > 0)
                           for seg, rep in zip(p.segments, p.segment_replicas)]
        t = self.shard(self.key, np.broadcast_to(np.zeros((), np.uint8), shape))
        return tuple(t.data.shape), [(r, False) for r in t.regions]

    def shards(self, name: str, key: str, data: np.ndarray) -> dict[str, gs.ShardedTensor]:
        """:meth:`shard` under ``name``; several (``name#i``) when parts of the
        local tensor are replicas of another TP rank's and the rest are not."""
        p = self.placement
        if p.padded_rows is not None:
            return self._padded(name, key, data)
        if p.segment_replicas is None:
            return {name: self.shard(key, data)}
        assert p.segments is not None
        self._check_shape(key, data)
        out = {}
        for i, (seg, rep) in enumerate(zip(p.segments, p.segment_replicas)):
            rows = data[seg.local_offset:seg.local_offset + seg.length]
            out[f"{name}#{i}"] = gs.ShardedTensor.from_offset(
                key, rows, global_shape=p.global_shape, global_offset=(seg.global_offset, *p.global_offset[1:]),
                replica_id=0 if self.main and rep == 0 else 1)
        return out

    def _check_shape(self, key: str, data: np.ndarray) -> None:
        if tuple(data.shape) != tuple(self.tensor.shape):
            raise LayoutError(f"{key!r}: local shape {data.shape} differs from the parameter's "
                              f"{tuple(self.tensor.shape)}")

    def padding(self) -> tuple[tuple[int, ...], gs.Region] | None:
        """Where this rank's padding rows go (spec section 1): the ``#padding``
        companion's global shape, and the region of the local tensor's padding
        rows in it; None when the layout pads none of this rank's rows."""
        p = self.placement
        if p.padded_rows is None:
            return None
        shape = tuple(self.tensor.shape)
        vocab, start, rest = p.global_shape[0], p.global_offset[0], shape[1:]
        true_rows = max(0, min(shape[0], vocab - start))
        if true_rows == shape[0]:
            return None
        rows, zeros = shape[0] - true_rows, (0,) * len(rest)
        return (p.padded_rows - vocab, *rest), gs.Region(gs.Box((true_rows, *zeros), (rows, *rest)),
                                                         gs.Box((start + true_rows - vocab, *zeros), (rows, *rest)))

    def _padded(self, name: str, key: str, data: np.ndarray) -> dict[str, gs.ShardedTensor]:
        """The true rows under ``key`` and the padding rows under its
        ``#padding`` companion (spec section 1), never both over one row."""
        p = self.placement
        self._check_shape(key, data)
        padding = self.padding()
        true_rows = data.shape[0] if padding is None else padding[1].local_box.offset[0]
        replica = 0 if self.main else 1
        out = {name: gs.ShardedTensor.from_offset(key, data[:true_rows], global_shape=p.global_shape,
                                                  global_offset=p.global_offset, replica_id=replica)}
        if padding is not None:
            shape, region = padding
            out[f"{name}#padding"] = gs.ShardedTensor.from_offset(
                key + gs.PADDING_SUFFIX, data[true_rows:], global_shape=shape, global_offset=region.global_box.offset,
                replica_id=replica)
        return out

    def shard(self, key: str, data: np.ndarray) -> gs.ShardedTensor:
        """A ShardedTensor with this entry's layout for ``data`` (the parameter,
        or an optimizer moment of the same local shape)."""
        p = self.placement
        replica = 0 if self.main else 1
        if p.segment_replicas is not None:
            raise LayoutError(f"{key!r}: part of this layout is another rank's replica; use Entry.shards")
        self._check_shape(key, data)
        if p.regions is not None:
            view = data.reshape(p.local_view) if p.local_view is not None else data
            return gs.ShardedTensor(key, view, p.global_shape, p.regions, replica)
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
    """Where a DTensor's local shard lies in its global array, as regions.

    Follows the placements left to right as DTensor does, tracking for each
    tensor dim the global indices the local shard holds: ``Shard`` takes a
    contiguous chunk of them, ``_StridedShard`` (FSDP2 over a TP-sharded dim)
    the strided set torch computes for it. Each dim's indices become
    contiguous runs, and the regions are their products: one region when the
    shard is a box, several when a strided shard is not.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        raise LayoutError(f"expected a DTensor, got {type(param).__name__}")
    mesh, placements = param.device_mesh, param.placements
    coord = mesh.get_coordinate()
    if coord is None:
        raise LayoutError("this rank is outside the DTensor's mesh")
    global_shape = tuple(int(s) for s in param.shape)
    indices = [np.arange(n, dtype=np.int64) for n in global_shape]
    for i, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        if not isinstance(pl, Shard) and type(pl).__name__ != "_StridedShard":
            raise LayoutError(f"DTensor placement {pl} is not supported: a Partial value is a pending sum, not "
                              "stored data; redistribute it to Replicate or Shard before saving")
        dim = pl.dim % len(global_shape)  # type: ignore[attr-defined]
        indices[dim] = _shard_indices(pl, indices[dim], mesh.size(i), coord[i])
    local = param.to_local()
    if tuple(len(ix) for ix in indices) != tuple(local.shape):
        raise LayoutError(f"DTensor local shard {tuple(local.shape)} differs from its computed shape "
                          f"{tuple(len(ix) for ix in indices)}")
    runs = [_runs(ix) for ix in indices]
    regions = tuple(
        gs.Region(gs.Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo)),
                  gs.Box(tuple(r[1] for r in combo), tuple(r[2] for r in combo)))
        for combo in itertools.product(*runs)
    ) if all(runs) else ()
    main = all(coord[i] == 0 for i, pl in enumerate(placements) if isinstance(pl, Replicate))
    first = all(c == 0 for c in coord)
    return local, Placement(global_shape, (0,) * len(global_shape), regions=regions), main, first


def _shard_indices(placement: Any, current: np.ndarray, chunks: int, rank: int) -> np.ndarray:
    """The part of ``current`` (global indices) that ``rank`` keeps under one
    Shard or _StridedShard placement of a mesh dim with ``chunks`` ranks."""
    from torch.distributed.tensor import Shard

    try:
        if type(placement).__name__ == "_StridedShard":
            from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

            size, offsets = placement.local_shard_size_and_offset(len(current), chunks, rank,
                                                                  _StridedShardOffsetMode.ALL)
            return current[np.asarray(offsets, dtype=np.int64)] if size else current[:0]
        size, offset = Shard.local_shard_size_and_offset(len(current), chunks, rank)
    except (AttributeError, ImportError, TypeError) as e:
        # TODO(limitation): _StridedShard needs torch's per-placement offsets (torch 2.13 has them).
        raise LayoutError(f"cannot compute the shard of {placement} with this torch version: {e}") from None
    return current[int(offset):int(offset) + int(size)] if size else current[:0]


def _runs(indices: np.ndarray) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of each contiguous run."""
    if not len(indices):
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(indices) != 1) + 1))
    ends = np.append(starts[1:], len(indices))
    return [(int(a), int(indices[a]), int(b - a)) for a, b in zip(starts, ends)]


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
    layer_pattern: str = LAYERS,
) -> list[Entry]:
    """Every parameter and persistent buffer of this rank's model chunks.

    Args:
        chunks: the model, or its virtual-pipeline chunks in local order.
        layout: this rank's place; local layer indices become global ones.
        rules: how non-DTensor tensors are cut; every such name must match one.
        layer_pattern: where a name holds its local layer number (the regex's
            second group), renumbered to the global one.

    Raises:
        LayoutError: listing every tensor no rule matches or that a rule cannot place.
    """
    modules = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    if len(modules) != layout.vpp_size:
        raise LayoutError(f"{len(modules)} model chunks given, the layout has vpp_size={layout.vpp_size}")
    problems: list[str] = []
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
            name = unwrapped_name(name)
            label = f"chunk{c}/{name}" if len(modules) > 1 else name
            try:
                gname = layout.global_name(name, c, layer_pattern)
                if _is_dtensor(tensor):
                    if outside_mesh(tensor):
                        continue  # this rank is outside the DTensor's mesh: it holds nothing of it
                    local, placement, main, first = _dtensor_placement(tensor)
                    in_dp0 = layout.dp_rank == 0
                    entries.append(Entry(label, gname, local, placement, main and in_dp0, tensor, first and in_dp0,
                                         main, first))
                    continue
                if rules is None:
                    raise LayoutError("not a DTensor, and no sharding rules were given")
                key, rule, tied_copy = rules.resolve_on(gname, layout, c)
                placement = rule.place(tuple(tensor.shape), layout)
                replica_rank = layout.expert_dp_rank if placement.expert else layout.dp_rank
                main = placement.tp_main and replica_rank == 0 and not tied_copy
                # Per-parameter scalars (Adam's step): one main copy per key, and all
                # experts share their key: the holder of global expert 0 keeps it.
                holds_first = not placement.expert or any(r.global_box.offset[0] == 0 for r in placement.regions or ())
                across = placement.tp_main and not tied_copy
                tp0 = (layout.expert_tp_rank if placement.expert else layout.tp_rank) == 0
                entries.append(Entry(label, key, tensor, placement, main, tensor, main and tp0 and holds_first,
                                     across, across and tp0 and holds_first))
            except LayoutError as e:
                problems.append(f"{label}: {e}")
    if problems:
        raise LayoutError(format_problems("cannot place the model's tensors", problems))
    return entries


def refuse_unusable(entries: Sequence[Entry], doing: str) -> None:
    """Raises :class:`LayoutError` naming every entry whose tensor can be
    neither saved nor loaded into (:func:`~globalshard_torch.tensors.unusable`:
    on the meta device, as a model built there and not materialized; sparse;
    of a dtype the format does not store)."""
    problems = [f"{e.name}: {why}" for e in entries if (why := unusable(e.tensor)) is not None]
    if problems:
        raise LayoutError(format_problems(f"cannot {doing}", problems))


#: Components wrappers add to the names of what they wrap, anywhere in a name, as DCP's
#: keys leave them out: torch.compile, activation checkpointing (``checkpoint_wrapper``), FSDP1.
_WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def unwrapped_name(name: str) -> str:
    """``name`` without the components wrappers add: ``_orig_mod`` (torch.compile),
    ``_checkpoint_wrapped_module`` (activation checkpointing) and
    ``_fsdp_wrapped_module`` (FSDP1), of the model or of any submodule, anywhere,
    and the leading ``module`` (DDP wraps the whole model), so a wrapped model's
    names are a plain one's."""
    parts = [p for p in name.split(".") if p not in _WRAPPERS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts) if parts else name


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


def _persistent(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return leaf not in sub._non_persistent_buffers_set
