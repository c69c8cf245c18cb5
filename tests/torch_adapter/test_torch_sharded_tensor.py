"""torch's ShardedTensor (FSDP1's sharded state dict, TorchRec's tables) in
DCP-style state dicts: saved at its shards' offsets and loaded into any other
cut, DTensors or plain tensors, as DCP loads its own save of the same state
(jobs in ``tests/sharded_tensor_jobs.py``)."""

import numpy as np
import pytest
import sharded_tensor_jobs as jobs
from torch_harness import run, values_of

import globalshard as gs
import globalshard_torch as gt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_tensor")
    ckpt, ref = str(tmp / "ckpt"), str(tmp / "dcp")
    # Rank 0: w's first 4 rows, tiny's only row, 2 grid blocks; rank 1: w's last 3 rows, no tiny, 2 blocks.
    assert values_of(run(2, "sharded_tensor_jobs:save_job", str(tmp / "s"), path=ckpt, dcp_path=ref)) == [4, 3]
    return tmp, ckpt, ref


def test_each_shard_is_stored_at_its_offsets_and_read_whole_in_one_process(saved):
    _, ckpt, _ = saved
    for key, full in jobs.FULL.items():
        assert np.array_equal(gs.read_array(ckpt, key), full.numpy()), key
    stored = gs.read_metadata(ckpt).tensors
    assert len(stored["model.grid"].regions) == 4 and len(stored["model.w"].regions) == 2
    assert len(stored["model.tiny"].regions) == 1  # the rank past the last chunk holds none
    got = jobs.plain_load(ckpt)
    assert all(np.array_equal(got[k], v.numpy()) for k, v in jobs.FULL.items())
    assert got["model.scale"] == 2.0 and got["optim.state.w.step"] == 3.0


@pytest.mark.parametrize("into", ["dtensor", "sharded"])
def test_an_fsdp1_state_dict_loads_into_another_layout_as_dcp_loads_it(saved, into):
    # "dtensor": FSDP1 to FSDP2 or TP (Shard(1), uneven; Replicate); "sharded": other cuts, several per rank.
    tmp, ckpt, ref = saved
    for got in values_of(run(2, "sharded_tensor_jobs:load_job", str(tmp / into), path=ckpt, dcp_path=ref,
                             into=into)):
        assert got["differ"] == [] and got["wrong"] == [], got
        assert got["pieces"] >= 5 and got["scale"] == 2.0 and got["step"] == 3.0 and got["lr"] == 0.1


def test_any_cut_of_a_sharded_tensor_round_trips_as_through_dcp(tmp_path):
    (examples,) = values_of(run(1, "sharded_tensor_jobs:properties", str(tmp_path / "r"), path=str(tmp_path)))
    assert examples == 25


def test_hybrid_sharded_copies_are_stored_once_as_dcp_stores_them(tmp_path):
    # FSDP1's HYBRID_SHARD: ranks [0, 1] and [2, 3] each shard the model; the halves are copies.
    import torch
    from torch.distributed.checkpoint import load as dcp_load

    ckpt, ref = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    counts = values_of(run(4, "sharded_tensor_jobs:hybrid_save_job", str(tmp_path / "s"), path=ckpt, dcp_path=ref))
    assert counts == [3, 2, 3, 2]
    stored = gs.read_metadata(ckpt).tensors
    assert [len(stored[k].regions) for k in ("model.w", "model.tiny", "optim.state.w.exp_avg")] == [2, 1, 2]
    ours = {"model": {"w": torch.zeros(7, 3), "tiny": torch.zeros(1, 2)},
            "optim": {"state": {"w": {"exp_avg": torch.zeros(7, 3)}}}}
    theirs = {"model": {"w": torch.zeros(7, 3), "tiny": torch.zeros(1, 2)},
              "optim": {"state": {"w": {"exp_avg": torch.zeros(7, 3)}}}}
    assert gt.load(ours, ckpt) == gt.LoadedKeys([], [])
    dcp_load(theirs, checkpoint_id=ref)
    for (key, mine), (_, dcps) in zip(jobs._leaves(ours).items(), jobs._leaves(theirs).items(), strict=True):
        assert torch.equal(mine, dcps) and torch.equal(mine, jobs.FULL[key]), key
