"""Real multi-process saves and loads: torch.multiprocessing, gloo on 127.0.0.1,
nn.Linear/Embedding modules, torch.optim.AdamW. Every parameter and Adam moment
after a load must equal, bit for bit, the slice of what the saving job held."""

import os

import numpy as np
import pytest
from torch_harness import Topo, assemble, run, topo_dict, values_of, write_expected

import globalshard as gs

# (saving topology, loading topology, parameter dtype, fp32 master weights)
CASES = [
    pytest.param(Topo(tp=2, pp=2), Topo(tp=4), "float32", False, id="tp2pp2-to-tp4 (tied embeddings PP2->1)"),
    pytest.param(Topo(tp=4), Topo(pp=2, vpp=2), "float32", False, id="tp4-to-pp2vpp2 (tied PP1->2, TP shrink)"),
    pytest.param(Topo(pp=2, vpp=2, dp=2), Topo(tp=2), "float32", False, id="pp2vpp2dp2-to-tp2 (VPP2->1, DP)"),
    pytest.param(Topo(tp=2, dp=2), Topo(pp=4), "float32", False, id="tp2dp2-to-pp4"),
    pytest.param(Topo(tp=2, pp=2), Topo(tp=1), "bfloat16", True, id="bf16 params, fp32 master+moments, to 1 process"),
    pytest.param(Topo(tp=1), Topo(tp=2, pp=2), "float32", False, id="tp1-to-tp2pp2"),
    pytest.param(Topo(tp=4), Topo(tp=2, dp=2), "float32", False, id="tp4-to-tp2dp2"),
    pytest.param(Topo(pp=2), Topo(tp=4), "float32", False, id="pp2-to-tp4 (TP 1->4)"),
]




@pytest.mark.parametrize("save_topo,load_topo,dtype,master", CASES)
def test_save_on_one_topology_load_on_another(tmp_path, save_topo, load_topo, dtype, master):
    ckpt, dumps, expect = str(tmp_path / "ckpt"), str(tmp_path / "dumps"), str(tmp_path / "expect")
    os.makedirs(dumps)
    saved = values_of(run(save_topo.world, "save_job", str(tmp_path / "save"), topo=topo_dict(save_topo), dtype=dtype,
                    path=ckpt, dump_dir=dumps, master=master))
    # Every rank writes its share, data-parallel replicas included (not only dp rank 0).
    assert all(s["bytes_written"] > 0 for s in saved), [s["bytes_written"] for s in saved]
    held = assemble(dumps)
    for item, arrays in held.items():
        for key, arr in arrays.items():
            if arr.ndim and arr.dtype.kind == "f":
                assert not np.isnan(arr.astype(np.float32)).any(), f"dump of {item} {key} incomplete"
    write_expected(held, expect)
    results = values_of(run(load_topo.world, "load_job", str(tmp_path / "load"), topo=topo_dict(load_topo), dtype=dtype,
                      path=ckpt, expect_dir=expect, master=master))
    for r, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {r}: {res['mismatches'][:10]}"
        assert res["trainer_state_step"] == 1
        assert res["n_state"] > 0
        assert res["betas"] == [0.9, 0.95]
        assert res["sched_last_epoch"] == 1 and res["lr"] == pytest.approx(1e-2 / 2)
        # RNG states only come back on the layout that saved them.
        assert res["rng_restored"] == (save_topo == load_topo)


def test_same_topology_resume_is_bit_exact_and_restores_rng(tmp_path):
    topo = Topo(tp=2, pp=2)
    ckpt, dumps = str(tmp_path / "ckpt"), str(tmp_path / "dumps")
    os.makedirs(dumps)
    # Uninterrupted: 2 steps. Interrupted: 1 step, save, load, 1 step.
    uninterrupted = str(tmp_path / "two")
    os.makedirs(uninterrupted)
    values_of(run(topo.world, "save_job", str(tmp_path / "a"), topo=topo_dict(topo), dtype="float32",
            path=str(tmp_path / "unused"), dump_dir=uninterrupted, steps=2))
    values_of(run(topo.world, "save_job", str(tmp_path / "b"), topo=topo_dict(topo), dtype="float32", path=ckpt,
            dump_dir=dumps))
    write_expected(assemble(dumps), str(tmp_path / "expect"))
    after = str(tmp_path / "after")
    os.makedirs(after)
    results = values_of(run(topo.world, "load_job", str(tmp_path / "c"), topo=topo_dict(topo), dtype="float32",
                            path=ckpt, expect_dir=str(tmp_path / "expect"), steps_after=1, after_dir=after))
    assert all(r["rng_restored"] for r in results)
    a, b = assemble(uninterrupted), assemble(after)
    for item in ("param", "exp_avg", "exp_avg_sq", "step"):
        for key in a[item]:
            assert a[item][key].tobytes() == b[item][key].tobytes(), (item, key)


def test_shared_reads_between_dp_replicas_over_gloo(tmp_path):
    """Saved at TP=2 x PP=2, loaded at TP=2 x DP=2 twice: each rank reading everything
    it needs, then with shared_reads=True, where the two DP replicas read half each
    and send it to the other over gloo. Same values; the group reads half."""
    ckpt, dumps, expect = str(tmp_path / "ckpt"), str(tmp_path / "dumps"), str(tmp_path / "expect")
    os.makedirs(dumps)
    values_of(run(4, "save_job", str(tmp_path / "save"), topo=topo_dict(Topo(tp=2, pp=2)), dtype="bfloat16",
                  path=ckpt, dump_dir=dumps))
    write_expected(assemble(dumps), expect)
    load_topo = topo_dict(Topo(tp=2, dp=2))
    plain, shared = (values_of(run(4, "load_job", str(tmp_path / name), topo=load_topo, dtype="bfloat16", path=ckpt,
                                   expect_dir=expect, shared_reads=flag))
                     for name, flag in (("plain", False), ("shared", True)))
    for r, res in enumerate(plain + shared):
        assert res["mismatches"] == [], f"rank {r % 4}: {res['mismatches'][:10]}"
    assert all(p["bytes_sent"] == p["bytes_received"] == 0 for p in plain)
    assert all(s["bytes_received"] > 0 and s["bytes_sent"] > 0 for s in shared)  # both replicas share the reading
    assert sum(s["bytes_sent"] for s in shared) == sum(s["bytes_received"] for s in shared)
    # Each rank gets what it read before, part of it now from another rank; the group
    # reads at most half (tensors replicated over TP too are read once instead of 4 times).
    assert [s["bytes_read"] + s["bytes_received"] for s in shared] == [p["bytes_read"] for p in plain]
    assert sum(s["bytes_read"] for s in shared) * 2 <= sum(p["bytes_read"] for p in plain)
    assert [s["bytes_needed"] for s in shared] == [p["bytes_needed"] for p in plain]


def test_a_packed_checkpoint_of_four_ranks_loads_on_other_layouts(tmp_path):
    """Every tensor of the model is small: with pack_below each of the four saving
    ranks stores its regions in a pack of its own; loads at TP=4, and at TP=2 x
    DP=2 with shared reads, find every parameter and moment bit for bit."""
    ckpt, dumps, expect = str(tmp_path / "ckpt"), str(tmp_path / "dumps"), str(tmp_path / "expect")
    os.makedirs(dumps)
    values_of(run(4, "save_job", str(tmp_path / "save"), topo=topo_dict(Topo(tp=2, pp=2)), dtype="float32",
                  path=ckpt, dump_dir=dumps, pack_below=1 << 20))
    md = gs.read_metadata(ckpt)
    regions = [r for t in md.tensors.values() for r in t.regions]
    assert all(r.byte_offset is not None for r in regions)
    assert {r.path.split("/")[-2] for r in regions} == {"0", "1", "2", "3"}  # every rank wrote its own pack
    write_expected(assemble(dumps), expect)
    for name, topo, shared in (("tp4", Topo(tp=4), False), ("tp2dp2", Topo(tp=2, dp=2), True)):
        results = values_of(run(topo.world, "load_job", str(tmp_path / name), topo=topo_dict(topo), dtype="float32",
                                path=ckpt, expect_dir=expect, shared_reads=shared))
        for r, res in enumerate(results):
            assert res["mismatches"] == [], f"{name} rank {r}: {res['mismatches'][:10]}"
            assert res["n_state"] > 0 and res["trainer_state_step"] == 1
        if shared:
            assert sum(res["bytes_received"] for res in results) > 0


def test_a_rank_failing_mid_save_commits_nothing_and_fails_every_rank(tmp_path):
    topo = Topo(tp=2)
    ckpt, dumps = str(tmp_path / "ckpt"), str(tmp_path / "dumps")
    os.makedirs(dumps)
    outcomes = run(topo.world, "save_job", str(tmp_path / "save"), topo=topo_dict(topo), dtype="float32",
                   path=ckpt, dump_dir=dumps, fail_rank=1)
    assert not outcomes[1]["ok"] and outcomes[1]["type"] == "StorageError", outcomes[1]
    assert not outcomes[0]["ok"] and outcomes[0]["type"] == "CommError", outcomes[0]
    assert "rank(s) [1]" in outcomes[0]["message"]
    assert not os.path.exists(os.path.join(ckpt, "metadata.json"))


def test_a_rank_that_dies_does_not_hang_the_others(tmp_path):
    import time

    ckpt = str(tmp_path / "ckpt")
    start = time.monotonic()
    outcomes = run(2, "crash_job", str(tmp_path / "crash"), path=ckpt, timeout_s=20)
    assert outcomes[1]["type"] == "exited"
    assert not outcomes[0]["ok"] and outcomes[0]["type"] == "CommError", outcomes[0]
    assert time.monotonic() - start < 100  # the survivor gave up instead of waiting forever
    assert not os.path.exists(os.path.join(ckpt, "metadata.json"))
