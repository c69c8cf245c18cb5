"""Cached plans: a save whose structure matches a recent save of the same
ranks reuses its plan (rebased to its own save id); any change of structure
plans anew; ranks that do not all hold the plan all plan anew."""

import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import globalshard as gs
from globalshard.checkpoint import saving
from globalshard.checkpoint.plan_cache import PlanCache
from globalshard.planner import rebased
from globalshard.testing.comm import run_ranks
from globalshard.testing.strategies import layouts, make_shard, shapes


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    cache = PlanCache()
    monkeypatch.setattr(saving, "PLANS", cache)
    return cache


def _state(rank, values, tp=2, dtype=np.float32, key="w", replica=0, cut_cols=False):
    full = values.astype(dtype)
    axis = 1 if cut_cols else 0
    n = full.shape[axis] // tp
    part = full[:, rank * n:(rank + 1) * n] if cut_cols else full[rank * n:(rank + 1) * n]
    offset = (0, rank * n) if cut_cols else (rank * n, 0)
    return {key: gs.ShardedTensor.from_offset(key, part.copy(), global_shape=full.shape, global_offset=offset,
                                              replica_id=replica),
            "b": gs.ShardedTensor.from_offset("b", np.full((3,), 7, np.int32), global_shape=(3,),
                                              global_offset=(0,), replica_id=rank)}  # replicas: equal values


def _save_all(path, make, world=2, **kw):
    results = run_ranks(world, lambda comm: gs.save(make(comm.rank), path, comm=comm, overwrite=True, **kw))
    assert all(r is None for r in results), results


def test_a_repeated_save_reuses_the_plan_under_its_own_save_id(tmp_path, fresh_cache):
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    _save_all(tmp_path, lambda r: _state(r, values))
    first = gs.read_metadata(tmp_path)
    assert (fresh_cache.hits, fresh_cache.misses) == (0, 2)  # each rank planned
    _save_all(tmp_path, lambda r: _state(r, values + 1))
    second = gs.read_metadata(tmp_path)
    assert (fresh_cache.hits, fresh_cache.misses) == (2, 2)  # each rank reused
    assert second.save_id != first.save_id
    assert all(r.path.startswith(f"saves/{second.save_id}/") for t in second.tensors.values() for r in t.regions)
    assert gs.Checkpoint(tmp_path).verify()[0] == []
    assert np.array_equal(gs.read_array(tmp_path, "w"), values + 1)
    # The metadata is the one a fresh plan gives, but for the save id.
    assert dataclasses.replace(rebased(_plan_of(first), second.save_id).metadata, trainer_state=None) == \
        dataclasses.replace(second, trainer_state=None)


def _plan_of(metadata):
    return gs.planner.SavePlan(metadata, (), 2)


CHANGES = {
    "values only": (lambda r, v: _state(r, v + 5), True),
    "shape": (lambda r, v: _state(r, np.zeros((8, 8))), False),
    "dtype": (lambda r, v: _state(r, v, dtype=np.float64), False),
    "key": (lambda r, v: _state(r, v, key="w2"), False),
    "cut": (lambda r, v: _state(r, v, cut_cols=True), False),
    "replica id": (lambda r, v: {**_state(r, v), "b": gs.ShardedTensor.from_offset(
        "b", np.full((3,), 7, np.int32), global_shape=(3,), global_offset=(0,), replica_id=1 - r)}, False),
    "a tensor added": (lambda r, v: {**_state(r, v), "c": gs.ShardedTensor.from_offset(
        "c", np.ones(2, np.float32), global_shape=(2,), global_offset=(0,), replica_id=r)}, False),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_any_change_of_structure_plans_anew(tmp_path, fresh_cache, change):
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    _save_all(tmp_path, lambda r: _state(r, values))
    make, reused = CHANGES[change]
    _save_all(tmp_path, lambda r: make(r, values))
    assert fresh_cache.hits == (2 if reused else 0), change
    expected = {k: None for k in ("w", "w2", "b", "c")}
    md = gs.read_metadata(tmp_path)
    for key in md.tensors:
        expected[key] = gs.read_array(tmp_path, key)
    # Loaded back whole, each key equals what the second save's ranks held.
    for rank in (0, 1):
        for name, t in make(rank, values).items():
            for region in t.regions:
                assert np.array_equal(expected[t.key][region.global_box.slices], t.data[region.local_box.slices]) \
                    or t.replica_id != 0, (change, name)


def test_another_pack_below_or_world_size_plans_anew(tmp_path, fresh_cache):
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    _save_all(tmp_path, lambda r: _state(r, values))
    _save_all(tmp_path, lambda r: _state(r, values), pack_below=1024)
    assert fresh_cache.hits == 0
    _save_all(tmp_path, lambda r: _state(r, values, tp=4), world=4)
    assert fresh_cache.hits == 0
    assert np.array_equal(gs.read_array(tmp_path, "w"), values)


def test_ranks_that_do_not_all_hold_the_plan_all_plan_anew(tmp_path, monkeypatch):
    """Each rank its own cache (as processes have); rank 1 forgets its plans
    between the saves: no rank reuses, none waits for the others, the save is whole."""
    caches = {0: PlanCache(), 1: PlanCache()}
    me = threading.local()

    class PerRank:
        def __getattr__(self, name):
            return getattr(caches[me.rank], name)

    monkeypatch.setattr(saving, "PLANS", PerRank())
    values = np.arange(48, dtype=np.float32).reshape(8, 6)

    def save(comm, v, forget=False):
        me.rank = comm.rank
        if forget and comm.rank == 1:
            caches[1].clear()
        gs.save(_state(comm.rank, v), tmp_path, comm=comm, overwrite=True)

    assert run_ranks(2, lambda comm: save(comm, values)) == [None, None]
    assert [c.misses for c in caches.values()] == [1, 1]
    assert run_ranks(2, lambda comm: save(comm, values + 2, forget=True)) == [None, None]
    assert [c.hits for c in caches.values()] == [0, 0]
    assert np.array_equal(gs.read_array(tmp_path, "w"), values + 2)
    assert run_ranks(2, lambda comm: save(comm, values + 3)) == [None, None]  # both hold it again
    assert [c.hits for c in caches.values()] == [1, 1]
    assert np.array_equal(gs.read_array(tmp_path, "w"), values + 3)


def test_the_cache_holds_the_most_recent_plans_only():
    cache = PlanCache(size=2)
    plan = gs.SavePlanner().plan([[gs.ShardInfo.of(gs.ShardedTensor.from_offset(
        "w", np.zeros(2, np.float32), global_shape=(2,), global_offset=(0,)))]])
    for key in "abc":
        cache.put(key, plan)
    assert sorted(cache.held()) == ["b", "c"]
    cache.reuse("b", plan, 0, "1" * 32)
    cache.put("d", plan)
    assert sorted(cache.held()) == ["b", "d"]


@st.composite
def plans(draw):
    shape = draw(shapes(min_dims=1, max_dims=3, max_side=6))
    value = np.zeros(shape, np.float32)
    ranks = draw(st.integers(1, 3))
    per_rank = [[] for _ in range(ranks)]
    for key in ("a", "b"):
        for spec in draw(layouts(shape)):
            per_rank[draw(st.integers(0, ranks - 1))].append(gs.ShardInfo.of(make_shard(key, spec, value)))
    return per_rank, draw(st.sampled_from([0, 64, 1 << 20]))


@given(plans(), st.text("0123456789abcdef", min_size=32, max_size=32),
       st.text("0123456789abcdef", min_size=32, max_size=32))
def test_property_a_rebased_plan_is_the_plan_of_the_new_save_id(case, a, b):
    per_rank, pack_below = case
    planner = gs.SavePlanner()
    assert rebased(planner.plan(per_rank, save_id=a, pack_below=pack_below), b) == \
        planner.plan(per_rank, save_id=b, pack_below=pack_below)


def test_a_save_trusts_its_own_last_commit_only_while_the_bytes_are_the_same(s3):
    """Rank 0 keeps the model of the metadata.json it committed, to find what
    the next save replaces without parsing it; when another process has
    committed since, the bytes differ and what that process wrote is what
    gets replaced and deleted. (On S3, where no lock sweeps leftovers, a
    stale model would leave the other process's arrays behind.)"""
    import json
    import subprocess
    import sys

    from repo import TESTS

    spec, client, _ = s3
    path = "plan-cache/run"

    def saved_ids():
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix=path + "/saves/").get("Contents", [])]
        return sorted({k.split("/")[3] for k in keys})

    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    _save_all(path, lambda r: _state(r, values), kvstore=spec)
    _save_all(path, lambda r: _state(r, values + 1), kvstore=spec)  # replaces its own last commit
    assert saved_ids() == [gs.read_metadata(path, kvstore=spec).save_id]
    script = (f"import json, sys; sys.path.insert(0, {TESTS!r})\nimport saver\n"
              f"saver.save_stamped({path!r}, 5, overwrite=True, kvstore=json.loads({json.dumps(spec)!r}))\n")
    subprocess.run([sys.executable, "-c", script], check=True)
    assert saved_ids() == [gs.read_metadata(path, kvstore=spec).save_id]
    _save_all(path, lambda r: _state(r, values + 2), kvstore=spec)
    gs.wait_for_cleanup()
    assert saved_ids() == [gs.read_metadata(path, kvstore=spec).save_id]
    assert np.array_equal(gs.read_array(path, "w", kvstore=spec), values + 2)
