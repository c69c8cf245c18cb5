"""DTensor parameters (Shard, Replicate, uneven shards, 1-D and 2-D meshes)
place themselves: no rules. Moments stay DTensors with the parameter's placements."""

import pytest
from torch_harness import dtensor_single_process_load, run, values_of

import globalshard as gs

SAVE_1D = {"w_uneven": ["S0"], "w_cols": ["S1"], "bias": ["R"]}          # 5 rows over 2 ranks: 3 + 2
SAVE_2D = {"w_uneven": ["S0", "S1"], "w_cols": ["R", "S0"], "bias": ["R", "R"]}
LOAD_1D = {"w_uneven": ["S1"], "w_cols": ["R"], "bias": ["S0"]}




@pytest.mark.parametrize("save_mesh,save_pl,load_mesh,load_pl", [
    ([2], SAVE_1D, [2], LOAD_1D),
    ([2, 2], SAVE_2D, [2], LOAD_1D),
    ([2], SAVE_1D, [2, 2], SAVE_2D),
], ids=["1d-to-1d", "2d-to-1d", "1d-to-2d"])
def test_dtensor_resharding(tmp_path, save_mesh, save_pl, load_mesh, load_pl):
    ckpt, dump = str(tmp_path / "ckpt"), str(tmp_path / "held.npz")
    values_of(run(save_mesh[0] * (save_mesh[1] if len(save_mesh) > 1 else 1), "dtensor_save_job", str(tmp_path / "s"),
            mesh_shape=save_mesh, placements=save_pl, path=ckpt, dump=dump))
    results = values_of(run(load_mesh[0] * (load_mesh[1] if len(load_mesh) > 1 else 1), "dtensor_load_job",
                      str(tmp_path / "l"), mesh_shape=load_mesh, placements=load_pl, path=ckpt, dump=dump))
    assert all(r == [] for r in results), results
    # And into one process with plain tensors.
    assert dtensor_single_process_load(ckpt, dump) == []


@pytest.mark.parametrize("rows", [8, 7])
def test_fsdp2_over_tp_strided_shards_are_mapped_exactly(tmp_path, rows):
    import numpy as np

    import globalshard as gs

    ckpt = str(tmp_path / "ckpt")
    saved = values_of(run(4, "strided_job", str(tmp_path / "s"), path=ckpt, rows=rows, save=True))
    assert np.array_equal(gs.read_array(ckpt, "w"), np.arange(rows * 3, dtype=np.float32).reshape(rows, 3))
    assert all(s["regions"] >= 1 for s in saved)
    assert all(r["ok"] for r in values_of(run(4, "strided_job", str(tmp_path / "l"), path=ckpt, rows=rows, save=False)))


def test_partial_placements_are_refused_by_name(tmp_path):
    for message in values_of(run(2, "partial_job", str(tmp_path / "p"), path=str(tmp_path / "ckpt"))):
        assert message.startswith("layer.w: ") and "Partial" in message and "pending sum" in message


def test_any_placement_on_a_1d_or_2d_mesh_loads_into_any_other(tmp_path):
    # Replicate, Shard on either dim, both mesh dims on one tensor dim, FSDP2's _StridedShard; uneven shapes.
    assert values_of(run(4, "placement_jobs:properties", str(tmp_path / "r"), path=str(tmp_path))) == [30] * 4


def test_a_lora_fine_tune_resumed_on_another_mesh_references_its_frozen_base(tmp_path):
    # Saved at 2 ranks with the weight in row halves, then at 4 ranks in column quarters with frozen=:
    # the weight is recorded with the base's cut, referenced, and only the adapter is written.
    from lora_jobs import BASE

    run_dir = tmp_path / "run"
    assert sum(values_of(run(2, "lora_jobs:save", str(tmp_path / "a"), path=str(run_dir / "step-1"), base=None,
                             dim=0, scale=1.0))) > BASE.numel() * 4
    written = values_of(run(4, "lora_jobs:save", str(tmp_path / "b"), path=str(run_dir / "step-2"),
                            base=str(run_dir / "step-1"), dim=1, scale=2.0))
    assert sum(written) == 2 * 8 * 4  # the adapter, once
    regions = gs.read_metadata(run_dir / "step-2").tensors["model.layer.weight"].regions
    assert [(r.box.offset, r.box.shape, r.base) for r in regions] == [((0, 0), (8, 8), 0), ((8, 0), (8, 8), 0)]
    for out in values_of(run(2, "lora_jobs:load", str(tmp_path / "c"), path=str(run_dir / "step-2"))):
        assert out["weight"] == BASE.tolist() and out["lora_a"] == [[2.0] * 8] * 2 and out["step"] == 2
