"""Removing keys from a committed checkpoint in place (gs.remove_keys, spec
section 2.5): one commit of the same save without them, their arrays deleted
after it; refusals change nothing."""

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo import SPEC

import globalshard as gs

sys.path.insert(0, SPEC)
import reference_reader


def whole(values):
    return {k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,) * v.ndim)
            for k, v in values.items()}


def trained(seed=0):
    rng = np.random.default_rng(seed)
    return {"model.w": rng.standard_normal((6, 4)).astype(np.float32),
            "model.b": rng.standard_normal(4).astype(np.float32),
            "optimizer.state.model.w.exp_avg": rng.standard_normal((6, 4)).astype(np.float32),
            "optimizer.state.model.w.exp_avg_sq": rng.standard_normal((6, 4)).astype(np.float32)}


def test_removed_keys_leave_the_same_save_and_their_arrays_are_deleted(tmp_path):
    values = trained()
    gs.save(whole(values), tmp_path / "c", trainer_state={"step": 7})
    before = gs.read_metadata(tmp_path / "c")
    after = gs.remove_keys(tmp_path / "c", ["optimizer.*"])
    assert sorted(after.tensors) == ["model.b", "model.w"] and after.save_id == before.save_id
    assert gs.read_metadata(tmp_path / "c") == after
    for key, t in before.tensors.items():
        for r in t.regions:
            assert (tmp_path / "c" / r.path).exists() == key.startswith("model."), key
    for key in after.tensors:
        assert np.array_equal(gs.read_array(tmp_path / "c", key), values[key])
        assert np.array_equal(reference_reader.Checkpoint(tmp_path / "c").read(key), values[key])
    assert gs.read_trainer_state(tmp_path / "c") == {"step": 7}
    assert gs.Checkpoint(tmp_path / "c").verify()[0] == []


def test_a_reader_that_opened_it_before_fails_on_a_removed_key_never_reads_another(tmp_path):
    values = trained(1)
    gs.save(whole(values), tmp_path / "c")
    opened = gs.Checkpoint(tmp_path / "c")
    gs.remove_keys(tmp_path / "c", ["optimizer.state.model.w.exp_avg"])
    kept = whole({"model.w": np.zeros((6, 4), np.float32)})
    opened.load(kept)
    assert np.array_equal(kept["model.w"].data, values["model.w"])
    with pytest.raises(gs.StorageError, match="exp_avg"):
        opened.load(whole({"optimizer.state.model.w.exp_avg": np.zeros((6, 4), np.float32)}))


def test_removing_what_references_a_base_drops_the_base_and_a_removed_base_region_is_refused(tmp_path):
    base = {"base.w": np.arange(12, dtype=np.float32).reshape(3, 4), "base.n": np.ones(4, np.float32)}
    gs.save(whole({**base, "lora": np.zeros(2, np.float32)}), tmp_path / "s0")
    gs.save(whole({**base, "lora": np.ones(2, np.float32)}), tmp_path / "s1", base=tmp_path / "s0",
            frozen=["base.*"])
    gs.save(whole({**base, "lora": np.full(2, 2.0, np.float32)}), tmp_path / "s2", base=tmp_path / "s0",
            frozen=["base.*"])
    alone = gs.remove_keys(tmp_path / "s1", ["base.*"])  # nothing left references s0: no bases
    assert alone.bases == () and sorted(alone.tensors) == ["lora"]
    assert (tmp_path / "s0" / "metadata.json").exists()  # a base's arrays are never deleted from a dependant
    assert np.array_equal(gs.read_array(tmp_path / "s1", "lora"), np.ones(2, np.float32))
    gs.remove_keys(tmp_path / "s0", ["base.n"])  # s2 references it there: s2 fails, naming it
    with pytest.raises(gs.StorageError, match="base.n"):
        gs.read_array(tmp_path / "s2", "base.n")
    assert np.array_equal(gs.read_array(tmp_path / "s2", "base.w"), base["base.w"])


def test_what_cannot_be_removed_is_refused_and_nothing_changes(tmp_path):
    values = trained(2)
    gs.save(whole(values), tmp_path / "packed", pack_below=1024)  # every key in one pack
    text = (tmp_path / "packed" / "metadata.json").read_bytes()
    with pytest.raises(gs.LayoutError, match="matches no key"):
        gs.remove_keys(tmp_path / "packed", ["lr_scheduler.*"])
    with pytest.raises(gs.LayoutError, match="cannot remove these keys(.|\n)*share the pack"):
        gs.remove_keys(tmp_path / "packed", ["optimizer.*"])
    assert (tmp_path / "packed" / "metadata.json").read_bytes() == text
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.remove_keys(tmp_path / "nothing", ["x"])
    shutil.copytree(os.path.join(SPEC, "examples", "checkpoint-v1"), tmp_path / "v1")
    key = next(iter(gs.read_metadata(tmp_path / "v1").tensors))
    with pytest.raises(gs.StorageError, match="version 1"):
        gs.remove_keys(tmp_path / "v1", [key])


@settings(max_examples=25)
@given(st.lists(st.booleans(), min_size=4, max_size=4).filter(lambda r: any(r)), st.integers(0, 2**31))
def test_property_the_kept_keys_read_back_and_the_removed_ones_are_gone(removed, seed):
    values = trained(seed)
    root = tempfile.mkdtemp()
    try:
        gs.save(whole(values), os.path.join(root, "c"))
        drop = [k for k, r in zip(values, removed) if r]
        after = gs.remove_keys(os.path.join(root, "c"), drop)
        assert sorted(after.tensors) == sorted(k for k in values if k not in drop)
        for key in after.tensors:
            assert np.array_equal(gs.read_array(os.path.join(root, "c"), key), values[key])
        for key in drop:
            with pytest.raises(gs.MismatchError):
                gs.read_array(os.path.join(root, "c"), key)
        assert gs.Checkpoint(os.path.join(root, "c")).verify()[0] == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
