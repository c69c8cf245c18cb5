"""torch's ``ShardedTensor`` (``torch.distributed._shard``) in DCP-style state dicts:
the jobs of ``tests/torch_adapter/test_torch_sharded_tensor.py``.

FSDP1's ``SHARDED_STATE_DICT`` (what ``get_state_dict`` gives for an FSDP1
model) holds ShardedTensors made by FSDP1's own ``_create_chunk_sharded_tensor``
(each rank a chunk of the first axis, as ``torch.chunk`` cuts it: uneven, and
none at all for ranks past the last chunk); TorchRec's tables hold several
shards per rank. FSDP1 itself needs an accelerator, so the jobs build its
tensors with its own function. The oracle is DCP: the same state saved by
``torch.distributed.checkpoint`` and loaded into the same targets.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata, init_from_local_shards
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor

import globalshard_torch as gt

#: The global arrays of the state, by key.
FULL = {"model.w": torch.arange(21, dtype=torch.float32).reshape(7, 3),
        "model.tiny": torch.tensor([[5.0, 6.0]]),
        "model.grid": torch.arange(20, dtype=torch.float32).reshape(5, 4) * 0.5,
        "optim.state.w.exp_avg": torch.linspace(-1.0, 1.0, 21).reshape(7, 3)}


def fsdp1(full: torch.Tensor, group: Any = None) -> ShardedTensor:
    """``full`` as FSDP1's sharded state dict holds it on this rank (sharded over
    ``group``, by default the world)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    return _create_chunk_sharded_tensor(full.clone(), dist.get_rank(group), dist.get_world_size(group), 1, group)


def blocks(full: torch.Tensor, rows: list[int], cols: list[int], owner: Any) -> ShardedTensor:
    """``full`` cut at ``rows`` x ``cols`` (the cuts' starts), block ``(i, j)`` on rank ``owner(i, j)``:
    several shards per rank, as TorchRec's tables have them."""
    rank, local = dist.get_rank(), []
    r_ends, c_ends = [*rows[1:], full.shape[0]], [*cols[1:], full.shape[1]]
    for i, (r0, r1) in enumerate(zip(rows, r_ends)):
        for j, (c0, c1) in enumerate(zip(cols, c_ends)):
            if owner(i, j) == rank and r1 > r0 and c1 > c0:
                local.append(Shard(full[r0:r1, c0:c1].clone(), ShardMetadata([r0, c0], [r1 - r0, c1 - c0],
                                                                              f"rank:{rank}/cpu")))
    return init_from_local_shards(local, *full.shape)


def saved_state() -> dict[str, Any]:
    grid = blocks(FULL["model.grid"], [0, 3], [0, 2], lambda i, j: (i + j) % 2)  # two shards on each rank
    return {"model": {"w": fsdp1(FULL["model.w"]), "tiny": fsdp1(FULL["model.tiny"]), "grid": grid,
                      "scale": torch.tensor(2.0)},
            "optim": {"state": {"w": {"exp_avg": fsdp1(FULL["optim.state.w.exp_avg"]), "step": torch.tensor(3.0)}},
                      "lr": 0.1}}


def save_job(rank: int, *, path: str, dcp_path: str) -> int:
    """World 2: the state saved by DCP, and by globalshard in the background (the writer
    process) while training changes every shard. Returns this rank's local shard count."""
    import globalshard as gs

    state = saved_state()
    dcp_save(state, checkpoint_id=dcp_path)
    saver = gs.AsyncSaver("process")
    gt.save(state, path, saver=saver)
    for t in _leaves(state).values():
        for shard in t.local_shards() if isinstance(t, ShardedTensor) else []:
            shard.tensor.add_(1000.0)  # the checkpoint holds the values of the call
    saver.wait()
    return sum(len(t.local_shards()) for t in (state["model"]["w"], state["model"]["tiny"], state["model"]["grid"]))


def hybrid_save_job(rank: int, *, path: str, dcp_path: str) -> int:
    """World 4 as FSDP1's HYBRID_SHARD keeps it: each half of the world ([0, 1], [2, 3])
    shards the model, the other half holds a copy. Saved by globalshard and by DCP.
    Returns this rank's local shard count."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    mine = groups[rank // 2]
    state = {"model": {"w": fsdp1(FULL["model.w"], mine), "tiny": fsdp1(FULL["model.tiny"], mine)},
             "optim": {"state": {"w": {"exp_avg": fsdp1(FULL["optim.state.w.exp_avg"], mine)}}}}
    gt.save(state, path)
    dcp_save(state, checkpoint_id=dcp_path)
    return sum(len(t.local_shards()) for t in _leaves(state).values())


def _targets(into: str) -> dict[str, Any]:
    """Empty targets of another layout: ``"dtensor"`` (FSDP1 to FSDP2 or TP: Shard(1),
    uneven), ``"sharded"`` (ShardedTensors cut otherwise: columns, rows, other blocks)."""
    def zeros(key: str) -> torch.Tensor:
        return torch.zeros_like(FULL[key])

    if into == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = {"w": distribute_tensor(zeros("model.w"), mesh, [Shard(1)]),
                 "tiny": distribute_tensor(zeros("model.tiny"), mesh, [Replicate()]),
                 "grid": distribute_tensor(zeros("model.grid"), mesh, [Shard(0)]), "scale": torch.tensor(0.0)}
        exp_avg = distribute_tensor(zeros("optim.state.w.exp_avg"), mesh, [Shard(0)])
    else:
        model = {"w": blocks(zeros("model.w"), [0], [0, 2], lambda i, j: j),
                 "tiny": blocks(zeros("model.tiny"), [0], [0, 1], lambda i, j: 1 - j),
                 "grid": fsdp1(zeros("model.grid")), "scale": torch.tensor(0.0)}
        exp_avg = blocks(zeros("optim.state.w.exp_avg"), [0, 1, 4, 6], [0], lambda i, j: i % 2)
    return {"model": model, "optim": {"state": {"w": {"exp_avg": exp_avg, "step": torch.tensor(0.0)}}, "lr": 0.0}}


def _pieces(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """This rank's pieces of ``t`` with their global offsets."""
    if isinstance(t, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in t.local_shards()]
    if hasattr(t, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return [(tuple(offset), t.to_local())]
    return [((0,) * t.ndim, t)]


def _leaves(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_job(rank: int, *, path: str, dcp_path: str, into: str) -> dict[str, Any]:
    """World 2: the checkpoint loaded into ``into`` targets by globalshard and by DCP.
    Returns the keys where they differ, the keys whose pieces are not the global
    array's slices, and the pieces this rank held."""
    ours, theirs = _targets(into), _targets(into)
    assert gt.load(ours, path) == gt.LoadedKeys([], [])
    dcp_load(theirs, checkpoint_id=dcp_path)
    mine, dcps = _leaves(ours), _leaves(theirs)
    differ, wrong, pieces = [], [], 0
    for key, value in mine.items():
        if not torch.is_tensor(value):
            differ += [] if value == dcps[key] else [key]
            continue
        for (offset, piece), (_, their_piece) in zip(_pieces(value), _pieces(dcps[key]), strict=True):
            pieces += 1
            differ += [] if torch.equal(piece, their_piece) else [key]
            if key in FULL:
                box = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
                wrong += [] if torch.equal(piece, FULL[key][box]) else [key]
    return {"differ": differ, "wrong": wrong, "pieces": pieces, "scale": float(mine["model.scale"]),
            "step": float(mine["optim.state.w.step"]), "lr": mine["optim.lr"]}


@st.composite
def _grid(draw: Any, shape: tuple[int, int]) -> tuple[list[int], list[int]]:
    rows = sorted({0, *draw(st.lists(st.integers(1, shape[0] - 1), max_size=3))}) if shape[0] > 1 else [0]
    cols = sorted({0, *draw(st.lists(st.integers(1, shape[1] - 1), max_size=3))}) if shape[1] > 1 else [0]
    return rows, cols


def properties(rank: int, *, path: str) -> int:
    """In one process (hypothesis): a global array cut into blocks (several shards on the
    rank) saved as a ShardedTensor, loaded into another cut and into a plain tensor:
    every piece equals what DCP loads from its own save of the same state. Returns
    the number of examples run."""
    runs = []

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.tuples(st.integers(1, 6), st.integers(1, 5)).flatmap(
        lambda shape: st.tuples(st.just(shape), _grid(shape), _grid(shape))),
        st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    def check(cut: Any, dtype: torch.dtype) -> None:
        shape, saved, loaded = cut
        full = (torch.randn(shape, generator=torch.Generator().manual_seed(len(runs))) * 100).to(dtype)
        ours, theirs = tempfile.mkdtemp(dir=path), tempfile.mkdtemp(dir=path)
        state = {"t": blocks(full, *saved, lambda i, j: 0)}
        gt.save(state, ours)
        dcp_save(state, checkpoint_id=theirs)
        for target in ("sharded", "plain"):
            mine, dcps = ({"t": blocks(torch.zeros_like(full), *loaded, lambda i, j: 0) if target == "sharded"
                           else torch.zeros_like(full)} for _ in range(2))
            gt.load(mine, ours)
            dcp_load(dcps, checkpoint_id=theirs)
            for (offset, piece), (_, their_piece) in zip(_pieces(mine["t"]), _pieces(dcps["t"]), strict=True):
                box = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
                assert torch.equal(piece, their_piece) and torch.equal(piece, full[box]), (shape, saved, loaded)
        runs.append(1)

    check()
    return len(runs)


def plain_load(path: str) -> dict[str, np.ndarray]:
    """The checkpoint loaded into plain tensors in this process (no process group)."""
    state = {"model": {k: torch.zeros_like(FULL[f"model.{k}"]) for k in ("w", "tiny", "grid")}
             | {"scale": torch.tensor(0.0)},
             "optim": {"state": {"w": {"exp_avg": torch.zeros(7, 3), "step": torch.tensor(0.0)}}, "lr": 0.0}}
    gt.load(state, path)
    return {k: v.numpy() for k, v in _leaves(state).items() if torch.is_tensor(v)}
