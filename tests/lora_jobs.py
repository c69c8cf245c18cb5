"""A LoRA fine-tune's DCP-style state saved with ``frozen=`` on one mesh and
again on another (gloo ranks): its frozen base is referenced, not rewritten."""

from __future__ import annotations

from typing import Any

import torch

import globalshard as gs
import globalshard_torch as gt

BASE = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8) / 7


def save(rank: int, *, path: str, base: str | None, dim: int, scale: float) -> int:
    """The frozen weight sharded on ``dim`` of a mesh of every rank, the adapter
    (scaled by ``scale``) replicated; saved with ``base=`` (the base frozen)
    when given. Returns the bytes this rank wrote."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    state: dict[str, Any] = {
        "model": {"layer.weight": distribute_tensor(BASE, mesh, [Shard(dim)]),
                  "layer.lora_a": distribute_tensor(torch.full((2, 8), scale), mesh, [Replicate()])},
        "step": int(scale)}
    stats = gs.IOStats()
    gt.save(state, path, base=base, frozen=["model.layer.weight"] if base else (), stats=stats)
    return stats.bytes_written


def load(rank: int, *, path: str) -> dict[str, Any]:
    """Every value read back on this mesh (its shards of the weight, whole)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    state: dict[str, Any] = {
        "model": {"layer.weight": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)]),
                  "layer.lora_a": torch.zeros(2, 8)}, "step": 0}
    gt.load(state, path)
    return {"weight": state["model"]["layer.weight"].full_tensor().tolist(),
            "lora_a": state["model"]["layer.lora_a"].tolist(), "step": state["step"]}
