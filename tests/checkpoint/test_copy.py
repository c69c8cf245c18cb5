"""A standalone copy of a checkpoint (gs.copy, `globalshard copy`): the arrays
its bases hold for it copied in, so that it loads once the bases are gone."""

import json
import os
import shutil
import subprocess
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


def lora_run(root):
    """step-0 (small tensors packed), step-1 references step-0's base; step-1's values."""
    rng = np.random.default_rng(3)
    base = {"base.w": rng.standard_normal((16, 8)).astype(np.float32), "base.norm": np.ones(8, np.float32)}
    gs.save(whole({**base, "lora": np.zeros(4, np.float32)}), root / "step-0", pack_below=64,
            trainer_state={"step": 0})
    values = {**base, "lora": np.full(4, 2.0, np.float32)}
    gs.save(whole(values), root / "step-1", base=root / "step-0", frozen=["base.*"], trainer_state={"step": 1})
    assert gs.read_metadata(root / "step-1").bases
    return values


def test_a_copy_stands_alone_once_its_base_is_gone(tmp_path):
    values = lora_run(tmp_path / "run")
    told: list[int] = []
    copied = gs.copy(tmp_path / "run" / "step-1", tmp_path / "eval" / "step-1", progress=told.append)
    assert sum(told) == sum(v.nbytes for v in values.values()) and len(told) == len(values)
    assert copied.bases == () and all(r.base is None for t in copied.tensors.values() for r in t.regions)
    assert copied.stored_bytes() == sum(v.nbytes for v in values.values())
    shutil.rmtree(tmp_path / "run")
    out = tmp_path / "eval" / "step-1"
    for k, v in values.items():
        assert np.array_equal(gs.read_array(out, k), v), k
        assert np.array_equal(reference_reader.Checkpoint(out).read(k), v), k
    assert gs.read_trainer_state(out) == {"step": 1}
    assert gs.Checkpoint(out).verify()[0] == []
    for r in gs.read_metadata(out).tensors["base.w"].regions:  # its arrays name the copy's save
        attributes = json.loads((out / r.path / "zarr.json").read_text())["attributes"]["globalshard"]
        assert attributes["save_id"] == copied.save_id and attributes["key"] == "base.w"
    assert sorted(os.listdir(out / "saves")) == [copied.save_id]


def test_a_copy_can_leave_keys_out(tmp_path):
    # A release of step-1's weights without its adapter: the base's arrays copied in, nothing of "lora".
    values = lora_run(tmp_path / "run")
    copied = gs.copy(tmp_path / "run" / "step-1", tmp_path / "release", drop=["lora"])
    assert sorted(copied.tensors) == ["base.norm", "base.w"] and copied.bases == ()
    shutil.rmtree(tmp_path / "run" / "step-0")  # the base: the copy stands without it
    for k in ("base.norm", "base.w"):
        assert np.array_equal(gs.read_array(tmp_path / "release", k), values[k])
    assert gs.read_trainer_state(tmp_path / "release") == {"step": 1}
    assert gs.Checkpoint(tmp_path / "release").verify()[0] == []
    # Without what the base held, the adapter alone copies with the base gone.
    adapter = gs.copy(tmp_path / "run" / "step-1", tmp_path / "adapter", drop=["base.*"])
    assert sorted(adapter.tensors) == ["lora"]
    assert np.array_equal(gs.read_array(tmp_path / "adapter", "lora"), values["lora"])


def test_a_copy_refuses_drops_it_cannot_honour_and_commits_nothing(tmp_path):
    lora_run(tmp_path / "run")
    with pytest.raises(gs.LayoutError, match=r"drop 'optimizer\.\*' matches no key"):
        gs.copy(tmp_path / "run" / "step-1", tmp_path / "out", drop=["optimizer.*"])
    # step-0 packs base.norm and lora together: dropping one would carry its bytes along in the other's pack.
    with pytest.raises(gs.LayoutError, match=r"\['lora'\] share the pack .* with kept keys \['base.norm'\]"):
        gs.copy(tmp_path / "run" / "step-0", tmp_path / "out", drop=["lora"])
    assert not (tmp_path / "out").exists()
    both = gs.copy(tmp_path / "run" / "step-0", tmp_path / "out", drop=["lora", "base.norm"])
    assert sorted(both.tensors) == ["base.w"]


def test_a_copy_refuses_what_it_cannot_copy_whole_and_commits_nothing(tmp_path):
    lora_run(tmp_path / "run")
    with pytest.raises(gs.StorageError, match="onto itself"):
        gs.copy(tmp_path / "run" / "step-1", tmp_path / "run" / "step-1", overwrite=True)
    with pytest.raises(gs.StorageError, match="is a base of .*step-1.*unreadable"):
        gs.copy(tmp_path / "run" / "step-1", tmp_path / "run" / "step-0", overwrite=True)
    gs.copy(tmp_path / "run" / "step-1", tmp_path / "run" / "step-2")
    with pytest.raises(gs.CheckpointExistsError, match="already holds a checkpoint"):
        gs.copy(tmp_path / "run" / "step-1", tmp_path / "run" / "step-2")
    trainer = tmp_path / "run" / "step-2" / gs.read_metadata(tmp_path / "run" / "step-2").trainer_state.path
    trainer.write_text(trainer.read_text().replace("1", "2"))  # edited since it was saved
    with pytest.raises(gs.MetadataError, match="does not match the size and SHA-256"):
        gs.copy(tmp_path / "run" / "step-2", tmp_path / "run" / "step-3")
    assert not (tmp_path / "run" / "step-3" / "metadata.json").exists()
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.copy(tmp_path / "run" / "nothing", tmp_path / "out")
    # A chunk of the base gone: the copy fails, and leaves nothing that looks like a checkpoint.
    region = gs.read_metadata(tmp_path / "run" / "step-0").tensors["base.w"].regions[0]
    for name in os.listdir(tmp_path / "run" / "step-0" / region.path / "c"):
        shutil.rmtree(tmp_path / "run" / "step-0" / region.path / "c" / name)
    with pytest.raises(gs.StorageError, match=r"'base.w' .* copied from .*step-0.* does not read back whole"):
        gs.copy(tmp_path / "run" / "step-1", tmp_path / "out")
    assert not (tmp_path / "out" / "metadata.json").exists()
    assert not os.listdir(tmp_path / "out" / "saves")
    # The base replaced: named, nothing copied.
    gs.save(whole({"other": np.ones(2, np.float32)}), tmp_path / "run" / "step-0", overwrite=True)
    with pytest.raises(gs.StorageError, match="base step-0"):
        gs.copy(tmp_path / "run" / "step-1", tmp_path / "out2")
    assert not (tmp_path / "out2" / "metadata.json").exists()


def test_a_copy_over_a_checkpoint_replaces_it_whole(tmp_path):
    values = lora_run(tmp_path / "run")
    gs.save(whole({"old": np.ones(3, np.float32)}), tmp_path / "out")
    old = gs.read_metadata(tmp_path / "out").save_id
    gs.copy(tmp_path / "run" / "step-1", tmp_path / "out", overwrite=True)
    gs.wait_for_cleanup()
    assert sorted(gs.read_metadata(tmp_path / "out").tensors) == sorted(values)
    assert old not in os.listdir(tmp_path / "out" / "saves")  # what it replaced is deleted


def test_a_copy_between_kvstore_prefixes():
    root = "memory://copies/run/"
    base = {"w": np.arange(6, dtype=np.float32)}
    gs.save(whole(base), "s0", kvstore=root)
    gs.save(whole({**base, "a": np.ones(2, np.float32)}), "s1", kvstore=root, base="s0", frozen=["w"])
    gs.copy("s1", "alone", kvstore=root)
    assert gs.read_metadata("alone", kvstore=root).bases == ()
    assert np.array_equal(gs.read_array("alone", "w", kvstore=root), base["w"])


def test_a_copy_from_a_directory_to_a_bucket_url_and_back(tmp_path):
    values = lora_run(tmp_path / "run")
    gs.copy(tmp_path / "run" / "step-1", "memory://copies-url/eval/step-1/")
    gs.copy("memory://copies-url/eval/step-1/", tmp_path / "back")
    for k, v in values.items():
        assert np.array_equal(gs.read_array("memory://copies-url/eval/step-1/", k), v), k
        assert np.array_equal(gs.read_array(tmp_path / "back", k), v), k


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31), st.lists(st.booleans(), min_size=3, max_size=3), st.sampled_from([0, 32, 1024]))
def test_property_a_copy_reads_back_every_value_of_its_source(seed, frozen, pack_below):
    rng = np.random.default_rng(seed)
    old = {f"t{i}": rng.standard_normal((2 + i, 3)).astype(np.float32) for i in range(3)}
    new = {k: v if frozen[i] else v + 1 for i, (k, v) in enumerate(old.items())}
    root = tempfile.mkdtemp()
    try:
        gs.save(whole(old), os.path.join(root, "a"), pack_below=pack_below)
        gs.save(whole(new), os.path.join(root, "b"), base=os.path.join(root, "a"),
                frozen=[k for i, k in enumerate(old) if frozen[i]] or (), digests=True)
        gs.copy(os.path.join(root, "b"), os.path.join(root, "c"))
        shutil.rmtree(os.path.join(root, "a"))
        shutil.rmtree(os.path.join(root, "b"))
        for k, v in new.items():
            assert np.array_equal(gs.read_array(os.path.join(root, "c"), k), v)
        assert gs.Checkpoint(os.path.join(root, "c")).verify()[0] == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("source", ["examples/checkpoint", "examples/checkpoint-v1", *(
    f"vectors/{name}" for name in sorted(os.listdir(os.path.join(SPEC, "vectors")))
    if os.path.isfile(os.path.join(SPEC, "vectors", name, "metadata.json")))])
def test_every_spec_example_and_vector_copies_to_the_same_values(tmp_path, source):
    # Version 1 too: its arrays had no attributes; the copy is a version 2 checkpoint that has them.
    src = os.path.join(SPEC, source)
    copied = gs.copy(src, tmp_path / "copy")
    assert copied.version == gs.FORMAT_VERSION and copied.bases == ()
    for key in gs.read_metadata(src).tensors:
        assert np.array_equal(gs.read_array(src, key), gs.read_array(tmp_path / "copy", key), equal_nan=True), key
    assert gs.read_trainer_state(tmp_path / "copy") == gs.read_trainer_state(src)
    assert gs.Checkpoint(tmp_path / "copy").verify()[0] == []


def test_a_copy_of_a_region_above_the_small_file_bound_holds_a_piece_at_a_time(tmp_path):
    """A region of 264 MiB (its shard file above the 256 MiB bound on the
    small files a load reads whole) copies, its bytes as they are, while the
    copying process's memory rises by well under the file's size: each file
    travels a piece at a time. In a process of its own, whose peak resident
    memory the kernel keeps (``VmHWM``, reset just before the copy)."""
    script = f"""
import numpy as np, globalshard as gs
a = np.arange(66 << 20, dtype=np.float32)
state = {{"w": gs.ShardedTensor.from_offset("w", a, global_shape=a.shape, global_offset=(0,))}}
gs.save(state, {str(tmp_path / "src")!r})
del state
del a
def status(key):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key))) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
gs.copy({str(tmp_path / "src")!r}, {str(tmp_path / "dst")!r})
print(status("VmHWM") - before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    shards = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "src") for f in fs if f == "0"]
    assert len(shards) == 1 and os.path.getsize(shards[0]) > 256 << 20
    rise = int(out.stdout.split()[-1])
    assert rise < 96 << 20, f"the copy's memory rose by {rise >> 20} MiB for a file of {os.path.getsize(shards[0])}"
    targets = whole({"w": np.zeros(66 << 20, np.float32)})
    gs.load(targets, tmp_path / "dst")
    assert np.array_equal(targets["w"].data, np.arange(66 << 20, dtype=np.float32))
