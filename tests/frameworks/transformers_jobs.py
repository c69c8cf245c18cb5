"""transformers' own distributed loading (``from_pretrained`` with a
``DistributedConfig``: TP, FSDP2 and EP meshes of DTensors) on CPU ranks over
gloo (run by test_transformers_parallel.py). Its Qwen3-MoE has a packed
``gate_up_proj`` per expert, which its TP plan cuts as ``_StridedShard``."""

from __future__ import annotations

import glob
from typing import Any

import numpy as np
import torch
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers.distributed import DistributedConfig

import globalshard_torch as gt


def _full(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every model and optimizer tensor of ``get_state_dict``'s two dicts, whole, by one flat key."""
    out = {f"model.{k}": _full(v) for k, v in model_sd.items()}
    out.update({f"optim.{k}.{m}": _full(v) for k, state in optim_sd["state"].items() for m, v in state.items()})
    return out


def build(hf: str, kind: str, sizes: dict[str, int]) -> tuple[Any, Any]:
    """The model as ``from_pretrained`` parallelizes it for ``sizes`` (DistributedConfig
    keyword arguments; none: one process), and an AdamW over it."""
    config = DistributedConfig(**sizes) if sizes else None
    model = getattr(transformers, kind).from_pretrained(hf, distributed_config=config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def step(model: Any, optimizer: Any) -> None:
    """One AdamW step, gradients a function of the weights (equal on every replica)."""
    for p in model.parameters():
        p.grad = torch.sin(p.detach() * 3.0)
    optimizer.step()


def train(rank: int, *, hf: str, kind: str, sizes: dict[str, int], path: str, dump: str) -> dict[str, Any]:
    """One step, then the model and optimizer saved as DCP-style state; each rank
    writes every tensor it holds whole (``full_tensor``) to ``dump`` + ``.<rank>.npz``,
    to compare loads with (with PP, each stage holds its own)."""
    model, optimizer = build(hf, kind, sizes)
    step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    gt.save({"model": model_sd, "optim": optim_sd}, path, check_replicas=True)  # its copies compared first
    np.savez(f"{dump}.{rank}.npz", **_whole(model_sd, optim_sd))
    return {"placements": {k: str(getattr(v, "placements", "")) for k, v in model_sd.items()}}


def reload(rank: int, *, hf: str, kind: str, sizes: dict[str, int], path: str, dump: str,
           initial: str) -> dict[str, Any]:
    """Into this layout: ``initial`` (the Hugging Face weights saved from one
    process), each local shard against the one ``from_pretrained`` cuts for this
    layout; then what ``train`` saved, every tensor whole against its dump."""
    model, optimizer = build(hf, kind, sizes)
    cut = {k: _local(v).clone() for k, v in model.state_dict().items()}
    weights = {k: v for k, v in get_state_dict(model, optimizer)[0].items()}
    with torch.no_grad():
        for v in weights.values():
            _local(v).zero_()
    gt.load({"model": weights}, initial)
    as_cut = sorted(k for k in cut if not torch.equal(_local(weights[k]), cut[k]))
    step(model, optimizer)  # state of its own, to be replaced
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    gt.load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    held = {k: v for name in sorted(glob.glob(f"{dump}.*.npz")) for k, v in np.load(name).items()}
    got = _whole(*get_state_dict(model, optimizer))
    return {"tensors": len(got), "differ": sorted(k for k in held if not np.array_equal(got.get(k), held[k])),
            "unknown": sorted(set(got) - set(held)), "cut": len(cut), "not_as_cut": as_cut}
