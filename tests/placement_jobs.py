"""Any DTensor placement to any other, on 4 gloo ranks (hypothesis, the same
examples on every rank): the job of ``test_torch_dtensor.py``'s property."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import globalshard_torch as gt

#: Placements of one mesh dim, by name; "SS0" is FSDP2's _StridedShard over a TP-sharded dim 0.
KINDS = ["R", "S0", "S1", "SS0"]


def _placements(names: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def one(i: int, name: str) -> Any:
        if name == "R":
            return Replicate()
        if name == "SS0":  # split as FSDP2 splits a dim the next mesh dim shards too
            return _StridedShard(0, split_factor=2) if i == 0 and names[1:] == ("S0",) else Shard(0)
        return Shard(int(name[1]))

    return [one(i, n) for i, n in enumerate(names)]


@st.composite
def _layout(draw: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    mesh = draw(st.sampled_from([(4,), (2, 2)]))
    return mesh, tuple(draw(st.sampled_from(KINDS)) for _ in mesh)


def properties(rank: int, *, path: str) -> int:
    """A tensor of random (uneven) shape saved from a random placement on a 1-D or
    2-D mesh and loaded into another: every rank's local shard equals the global
    array's part DTensor gives it. Returns the number of examples run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes = {shape: init_device_mesh("cpu", shape, mesh_dim_names=("a", "b")[:len(shape)])
              for shape in [(4,), (2, 2)]}
    runs = []

    @settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.tuples(st.integers(1, 9), st.integers(1, 5)), _layout(), _layout(),
           st.sampled_from([torch.float32, torch.bfloat16]))
    def check(shape: tuple[int, int], saved: Any, loaded: Any, dtype: torch.dtype) -> None:
        full = (torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) * 0.25).to(dtype)
        where = [tempfile.mkdtemp(dir=path) if rank == 0 else None]
        dist.broadcast_object_list(where)
        # every rank holds the full tensor and keeps its part (as FSDP2 does: src_data_rank=None)
        state = {"w": distribute_tensor(full, meshes[saved[0]], _placements(saved[1]), src_data_rank=None)}
        gt.save(state, where[0])
        target = {"w": distribute_tensor(torch.zeros_like(full), meshes[loaded[0]], _placements(loaded[1]),
                                         src_data_rank=None)}
        gt.load(target, where[0])
        expected = distribute_tensor(full, meshes[loaded[0]], _placements(loaded[1]), src_data_rank=None)
        assert torch.equal(target["w"].to_local(), expected.to_local()), (shape, saved, loaded)
        assert torch.equal(target["w"].full_tensor(), full), (shape, saved, loaded)
        runs.append(1)

    check()
    return len(runs)
