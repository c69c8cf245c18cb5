"""What happens to real files: corruption, loss, escapes, failed and concurrent saves."""

import json
import os
import shutil

import numpy as np
import pytest

import globalshard as gs
from globalshard import ShardedTensor
from globalshard.storage import CHUNK_BYTES, chunk_shape
from globalshard.testing.comm import ThreadComm, run_ranks

RNG = np.random.default_rng(7)


def shard(key, data, offset, gshape, **kw):
    return ShardedTensor.from_offset(key, data, global_shape=gshape, global_offset=offset, **kw)


def small_checkpoint(path, trainer_state=None):
    full = RNG.standard_normal((8, 4)).astype(np.float32)
    state = {f"r{r}": shard("w", full[r * 4:(r + 1) * 4].copy(), (r * 4, 0), (8, 4)) for r in range(2)}
    gs.save(state, path, trainer_state=trainer_state)
    return full


def target(shape=(8, 4), dtype=np.float32):
    return {"t": shard("w", np.full(shape, 5, dtype), (0,) * len(shape), shape)}


def array(root, key="w", n=0):
    """The directory of ``key``'s n-th stored region, as metadata.json names it."""
    return root / gs.read_metadata(root).tensors[key].regions[n].path


def trainer_state_file(root):
    return root / gs.read_metadata(root).trainer_state.path


def chunk_files(path):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path / "saves") for f in fs
                  if f not in ("zarr.json", "trainer_state.json"))


def test_save_writes_zarr3_with_crc32c(tmp_path):
    small_checkpoint(tmp_path)
    for d, _, files in os.walk(tmp_path / "saves"):
        if "zarr.json" in files:
            meta = json.load(open(os.path.join(d, "zarr.json")))
            assert meta["zarr_format"] == 3
            assert [c["name"] for c in meta["codecs"]] == ["bytes", "crc32c"]


def test_large_regions_are_sharded_into_inner_chunks_and_read_partially(tmp_path):
    full = RNG.standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB: above CHUNK_BYTES
    gs.save({"a": shard("big", full, (0, 0), full.shape)}, tmp_path)
    zarr = json.load(open(array(tmp_path, "big") / "zarr.json"))
    assert zarr["codecs"][0]["name"] == "sharding_indexed"
    assert zarr["codecs"][0]["configuration"]["chunk_shape"] == list(chunk_shape((2048, 1024), 4)) == [512, 512]
    stats = gs.IOStats()
    part = {"p": shard("big", np.zeros((256, 1024), np.float32), (512, 0), full.shape)}
    gs.load(part, tmp_path, stats=stats)
    assert np.array_equal(part["p"].data, full[512:768])
    assert stats.bytes_needed == 256 * 1024 * 4
    assert stats.bytes_read <= 2 * CHUNK_BYTES < full.nbytes  # two inner chunks, not the 8 MiB region


def test_row_cut_regions_get_whole_rows_others_near_cubic_chunks(tmp_path):
    full = RNG.standard_normal((2048, 1024)).astype(np.float32)
    halves = {f"c{j}": shard("cols", np.ascontiguousarray(full[:, j * 512:(j + 1) * 512]), (0, j * 512), full.shape)
              for j in range(2)}
    rows = {f"r{i}": shard("rows", full[i * 1024:(i + 1) * 1024], (i * 1024, 0), full.shape) for i in range(2)}
    gs.save({**halves, **rows}, tmp_path)
    md = gs.read_metadata(tmp_path)
    chunks = {key: json.load(open(tmp_path / md.tensors[key].regions[0].path / "zarr.json"))
              ["codecs"][0]["configuration"]["chunk_shape"] for key in ("cols", "rows")}
    assert chunks == {"cols": list(chunk_shape((2048, 512), 4)), "rows": [256, 1024]}
    assert chunk_shape((2048, 512), 4) == (512, 512)
    # Rows go straight into row-cut targets at any degree: no waste.
    stats = gs.IOStats()
    eighth = {"e": shard("rows", np.zeros((256, 1024), np.float32), (768, 0), full.shape)}
    gs.load(eighth, tmp_path, stats=stats)
    assert np.array_equal(eighth["e"].data, full[768:1024])
    assert stats.bytes_read == stats.bytes_needed


@pytest.mark.parametrize("damage", ["delete", "truncate", "flip", "empty"])
def test_damaged_chunk_is_an_error_never_zeros(tmp_path, damage):
    small_checkpoint(tmp_path)
    victim = chunk_files(tmp_path)[0]
    data = open(victim, "rb").read()
    if damage == "delete":
        os.remove(victim)
    elif damage == "truncate":
        open(victim, "wb").write(data[:-3])
    elif damage == "flip":
        open(victim, "wb").write(bytes([data[0] ^ 0x40]) + data[1:])
    else:
        open(victim, "wb").write(b"")
    with pytest.raises(gs.StorageError) as info:
        gs.load(target(), tmp_path)
    assert os.path.relpath(os.path.dirname(os.path.dirname(victim)), tmp_path) in str(info.value)


def test_damaged_sharded_chunk_is_an_error(tmp_path):
    full = RNG.standard_normal((1200, 1024)).astype(np.float32)
    gs.save({"a": shard("big", full, (0, 0), full.shape)}, tmp_path)
    victim = chunk_files(tmp_path)[0]
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 3] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    with pytest.raises(gs.StorageError, match="DATA_LOSS|checksum|Digest"):
        gs.read_array(tmp_path, "big")


def test_missing_or_altered_zarr_json(tmp_path):
    small_checkpoint(tmp_path)
    meta_file = array(tmp_path, "w", 1) / "zarr.json"
    meta = json.load(open(meta_file))
    meta["data_type"] = "int32"
    json.dump(meta, open(meta_file, "w"))
    with pytest.raises(gs.StorageError, match="arrays/w/1"):
        gs.load(target(), tmp_path)
    os.remove(meta_file)
    with pytest.raises(gs.StorageError, match="arrays/w/1"):
        gs.load(target(), tmp_path)


def test_missing_array_is_found_before_any_target_byte_is_written(tmp_path):
    small_checkpoint(tmp_path)
    shutil.rmtree(array(tmp_path, "w", 1))
    t = target()
    with pytest.raises(gs.StorageError):
        gs.load(t, tmp_path)
    assert (t["t"].data == 5).all()


def test_trainer_state_tampering(tmp_path):
    small_checkpoint(tmp_path, trainer_state={"step": 1})
    p = trainer_state_file(tmp_path)
    p.write_text(p.read_text().replace("1", "2"))
    with pytest.raises(gs.MetadataError, match="SHA-256"):
        gs.load(target(), tmp_path)
    p.unlink()
    with pytest.raises(gs.MetadataError, match="missing"):
        gs.load(target(), tmp_path)


def test_not_a_checkpoint(tmp_path):
    for where in [tmp_path / "nothing-here", tmp_path]:
        with pytest.raises(gs.CheckpointNotFoundError, match="no metadata.json"):
            gs.load(target(), where)
        with pytest.raises(gs.CheckpointNotFoundError):
            gs.read_metadata(where)
        with pytest.raises(gs.CheckpointNotFoundError):
            gs.read_array(where, "w")


def array_linked_outside(tmp_path):
    """A checkpoint whose first array directory is a symlink to another checkpoint's."""
    small_checkpoint(tmp_path / "ckpt")
    small_checkpoint(tmp_path / "elsewhere")
    victim = array(tmp_path / "ckpt")
    shutil.rmtree(victim)
    os.symlink(array(tmp_path / "elsewhere"), victim)
    return tmp_path / "ckpt"


def test_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    with pytest.raises(gs.MetadataError, match="outside the checkpoint"):
        gs.load(target(), array_linked_outside(tmp_path))
    # A symlinked chunk file deeper down, too.
    shutil.rmtree(tmp_path / "ckpt")
    small_checkpoint(tmp_path / "ckpt")
    chunk = chunk_files(tmp_path / "ckpt")[0]
    os.remove(chunk)
    os.symlink(chunk_files(tmp_path / "elsewhere")[0], chunk)
    with pytest.raises(gs.MetadataError, match="outside the checkpoint"):
        gs.load(target(), tmp_path / "ckpt")


def test_existing_checkpoint_is_not_overwritten_by_accident(tmp_path):
    full = small_checkpoint(tmp_path, trainer_state={"step": 1})
    with pytest.raises(gs.CheckpointExistsError, match="overwrite=True"):
        small_checkpoint(tmp_path)
    t = target()
    assert gs.load(t, tmp_path) == {"step": 1}
    assert np.array_equal(t["t"].data, full)
    old = trainer_state_file(tmp_path)
    new = RNG.standard_normal((8, 4)).astype(np.float32)
    gs.save({"a": shard("w", new, (0, 0), (8, 4))}, tmp_path, overwrite=True)
    t = target()
    assert gs.load(t, tmp_path) == {}  # the old trainer state went with the old checkpoint
    assert np.array_equal(t["t"].data, new)
    assert not old.exists()
    assert os.listdir(tmp_path / "saves") == [gs.read_metadata(tmp_path).save_id]


def test_failed_save_leaves_no_checkpoint(tmp_path):
    # A layout error: found while planning, before anything is written.
    with pytest.raises(gs.LayoutError, match="held by no main replica"):
        gs.save({"a": shard("w", np.zeros((2, 2)), (0, 0), (4, 2))}, tmp_path)
    assert not (tmp_path / "metadata.json").exists()
    # A bad trainer state: found before anything is written.
    with pytest.raises(gs.MetadataError, match="JSON"):
        gs.save({"a": shard("w", np.zeros((4, 2)), (0, 0), (4, 2))}, tmp_path, trainer_state={"x": (1, 2)})
    assert not (tmp_path / "metadata.json").exists()
    # A storage error while writing: a file sits where an array directory must go.
    os.makedirs(tmp_path / "blocked")
    (tmp_path / "blocked" / "arrays").write_text("not a directory")
    blocked = {"driver": "file", "path": str(tmp_path / "blocked" / "arrays" / "x")}
    with pytest.raises(gs.StorageError):
        gs.save({"a": shard("w", np.zeros((4, 2)), (0, 0), (4, 2))}, blocked)
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.read_metadata(tmp_path)


def test_replicas_are_written_once_and_mismatched_replicas_rejected(tmp_path):
    full = RNG.standard_normal((4,)).astype(np.float32)
    state = {f"dp{d}": shard("norm", full.copy(), (0,), (4,), replica_id=d) for d in range(3)}
    gs.save(state, tmp_path)
    assert len(gs.read_metadata(tmp_path).tensors["norm"].regions) == 1
    bad = {"a": shard("norm", full.copy(), (0,), (4,)), "b": shard("norm", full.copy(), (0,), (4,))}
    with pytest.raises(gs.LayoutError, match="replica_id > 0"):
        gs.save(bad, tmp_path / "bad")
    mixed = {"a": shard("norm", full.copy(), (0,), (4,)), "b": shard("norm", full.astype(np.float64), (0,), (4,),
                                                                       replica_id=1)}
    with pytest.raises(gs.LayoutError, match="dtype"):
        gs.save(mixed, tmp_path / "mixed")


def test_missing_key_and_shape_mismatch_report_everything_before_writing(tmp_path):
    small_checkpoint(tmp_path)
    targets = {"a": shard("w", np.zeros((4, 4), np.float32), (0, 0), (4, 4)),
               "b": shard("W", np.zeros((8, 4), np.float32), (0, 0), (8, 4))}
    with pytest.raises(gs.MismatchError) as info:
        gs.load(targets, tmp_path)
    text = str(info.value)
    assert "'a' (key 'w')" in text and "(4, 4)" in text and "'b' (key 'W')" in text
    assert "similar keys: ['w']" in text
    # A target named as its key (every torch state dict's) is named once.
    with pytest.raises(gs.MismatchError) as info:
        gs.load({"w": shard("w", np.zeros((4, 4), np.float32), (0, 0), (4, 4))}, tmp_path)
    assert str(info.value).splitlines()[1].startswith("  - 'w': global shape (4, 4) asked for")


def test_read_only_target_is_refused(tmp_path):
    small_checkpoint(tmp_path)
    t = target()
    t["t"].data.flags.writeable = False
    with pytest.raises(gs.LayoutError, match="read-only"):
        gs.load(t, tmp_path)


def test_big_endian_and_strided_arrays(tmp_path):
    full = RNG.standard_normal((6, 4))
    big = full.astype(">f8")
    gs.save({"a": shard("w", big, (0, 0), (6, 4))}, tmp_path)
    strided = np.zeros((6, 8))[:, ::2]
    t = {"t": shard("w", strided, (0, 0), (6, 4))}
    gs.load(t, tmp_path)
    assert np.array_equal(strided, full)
    be_target = np.zeros((6, 4), ">f8")
    gs.load({"t": shard("w", be_target, (0, 0), (6, 4))}, tmp_path)
    assert np.array_equal(be_target, full)


@pytest.mark.parametrize("kind", ["memory", "ocdbt", "file-url"])
def test_other_kvstores(tmp_path, kind):
    where = {
        "memory": "memory://ckpt-test/",
        "ocdbt": {"driver": "ocdbt", "base": f"file://{tmp_path}/ocdbt/"},
        "file-url": f"file://{tmp_path}/url/",
    }[kind]
    full = RNG.standard_normal((8, 4)).astype(np.float32)
    state = {f"r{r}": shard("w", full[r * 4:(r + 1) * 4].copy(), (r * 4, 0), (8, 4)) for r in range(2)}
    gs.save(state, where, trainer_state={"kind": kind}, overwrite=True)
    t = target()
    assert gs.load(t, where) == {"kind": kind}
    assert np.array_equal(t["t"].data, full)
    assert gs.read_metadata(where).tensors["w"].global_shape == (8, 4)
    with pytest.raises(gs.CheckpointExistsError):
        gs.save(state, where)


def test_unknown_kvstore_is_a_storage_error():
    with pytest.raises(gs.StorageError):
        gs.read_metadata({"driver": "no-such-driver"})


# ----------------------------------------------------------------------- several ranks


def tp_dp_shards(rank, full, tp, dp):
    """Rank = dp_rank * tp + tp_rank; columns split over TP, DP ranks are replicas."""
    tp_rank, dp_rank = rank % tp, rank // tp
    n = full.shape[0] // tp
    out = {}
    for k in range(4):  # four parameters, so writers can spread over DP
        out[f"p{k}"] = shard(f"layer{k}.w", (full[tp_rank * n:(tp_rank + 1) * n] + k).copy(), (tp_rank * n, 0),
                             full.shape, replica_id=dp_rank)
    return out


def test_multi_rank_save_all_ranks_write_then_load_elsewhere(tmp_path):
    full = RNG.standard_normal((8, 6)).astype(np.float32)
    tp, dp = 2, 2
    stats = [gs.IOStats() for _ in range(tp * dp)]

    def save(comm: ThreadComm):
        gs.save(tp_dp_shards(comm.rank, full, tp, dp), tmp_path, comm=comm, trainer_state={"step": 5},
                stats=stats[comm.rank])
        return comm.gathers

    results = run_ranks(tp * dp, save)
    assert all(isinstance(r, int) for r in results), results
    assert all(s.bytes_written > 0 for s in stats), [s.bytes_written for s in stats]  # DP replicas write too
    assert sum(s.bytes_written for s in stats) == 4 * full.nbytes  # each region exactly once

    def load(comm: ThreadComm):
        # TP=3 over rows would not divide 8: load at TP=1 on each of 3 ranks instead.
        t = {f"p{k}": shard(f"layer{k}.w", np.zeros_like(full), (0, 0), full.shape) for k in range(4)}
        ts = gs.load(t, tmp_path, comm=comm)
        return ts, [t[f"p{k}"].data for k in range(4)]

    for ts, datas in run_ranks(3, load):
        assert ts == {"step": 5}
        for k in range(4):
            assert np.array_equal(datas[k], full + k)


def test_a_rank_failing_mid_save_fails_every_rank_and_commits_nothing(tmp_path):
    full = RNG.standard_normal((8, 6)).astype(np.float32)

    class Saboteur(ThreadComm):
        """Rank 1, once planning is done, finds a file where its array directory must go."""

        def all_gather(self, obj):
            out = super().all_gather(obj)
            if self.gathers == 1:  # 1: planning (every rank is past it), 2: writing, 3: commit
                arrays = tmp_path / "saves" / out[0]["value"]["save_id"] / "arrays"
                os.makedirs(arrays, exist_ok=True)
                (arrays / "only.on.rank1").write_text("in the way")
            return out

    def save(comm: ThreadComm):
        if comm.rank == 1:
            comm.__class__ = Saboteur
        state = tp_dp_shards(comm.rank, full, 2, 1)
        if comm.rank == 1:
            state["mine"] = shard("only.on.rank1", np.ones(3, np.float32), (0,), (3,))
        gs.save(state, tmp_path, comm=comm)

    results = run_ranks(2, save)
    assert isinstance(results[1], gs.StorageError), results
    assert isinstance(results[0], gs.CommError) and "rank(s) [1]" in str(results[0])
    assert not (tmp_path / "metadata.json").exists()
    assert os.listdir(tmp_path / "saves") == []  # the failed save removed what it wrote
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.load(target(), tmp_path)


def test_inconsistent_ranks_fail_planning_on_every_rank(tmp_path):
    def save(comm: ThreadComm):
        dtype = np.float32 if comm.rank == 0 else np.float64
        gs.save({"w": shard("w", np.zeros((2, 2), dtype), (comm.rank * 2, 0), (4, 2))}, tmp_path, comm=comm)

    results = run_ranks(2, save)
    assert all(isinstance(r, gs.LayoutError) and "rank 1 has dtype float64" in str(r) for r in results), results
    assert not (tmp_path / "metadata.json").exists()


def test_a_rank_failing_to_load_fails_every_rank(tmp_path):
    small_checkpoint(tmp_path)

    def load(comm: ThreadComm):
        key = "w" if comm.rank == 0 else "nope"
        gs.load({"t": shard(key, np.zeros((8, 4), np.float32), (0, 0), (8, 4))}, tmp_path, comm=comm)

    results = run_ranks(2, load)
    assert isinstance(results[1], gs.MismatchError)
    assert isinstance(results[0], gs.CommError)


def test_write_window_smaller_than_the_state(tmp_path, monkeypatch):
    # With a window of one array, writes drain as they go; the result is the same checkpoint.
    monkeypatch.setattr(gs.storage, "WRITE_WINDOW_BYTES", 64)
    full = RNG.standard_normal((16, 8)).astype(np.float32)
    state = {f"r{r}": shard("w", full[r * 2:(r + 1) * 2].copy(), (r * 2, 0), (16, 8)) for r in range(8)}
    gs.save(state, tmp_path)
    assert np.array_equal(gs.read_array(tmp_path, "w"), full)


def test_error_classes_also_match_the_builtin_a_caller_would_catch(tmp_path):
    small_checkpoint(tmp_path)
    with pytest.raises(KeyError):
        gs.load({"t": shard("nope", np.zeros(2, np.float32), (0,), (2,))}, tmp_path)
    with pytest.raises(KeyError):
        gs.read_array(tmp_path, "nope")
    with pytest.raises(TypeError):
        gs.save({"a": shard("w", np.zeros(2), (0,), (2,))}, tmp_path / "x", trainer_state={"t": (1,)})
    with pytest.raises(TypeError):
        gs.load(target(dtype=np.float16), tmp_path)  # CastError
    with pytest.raises(FileNotFoundError):
        gs.read_metadata(tmp_path / "x")
    with pytest.raises(gs.MetadataError):  # no metadata.json: not a checkpoint
        gs.read_metadata(tmp_path / "x")


def test_rejected_overwrite_keeps_the_old_checkpoint(tmp_path):
    full = small_checkpoint(tmp_path, trainer_state={"step": 1})
    with pytest.raises(gs.LayoutError):  # a gap: refused while planning
        gs.save({"a": shard("w", np.zeros((2, 4), np.float32), (0, 0), (8, 4))}, tmp_path, overwrite=True)
    t = target()
    assert gs.load(t, tmp_path) == {"step": 1}
    assert np.array_equal(t["t"].data, full)


def test_file_url_roots_get_the_local_checks(tmp_path):
    ckpt = array_linked_outside(tmp_path)
    with pytest.raises(gs.MetadataError, match="outside the checkpoint"):
        gs.load(target(), f"file://{ckpt}/")


def test_a_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "plain").write_text("hello")
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.read_metadata(tmp_path / "plain")


@pytest.mark.parametrize("kvstore", ["memory://kv-option/", {"driver": "ocdbt", "base": "memory://kv-ocdbt/"}])
def test_kvstore_option_resolves_the_path_inside_it(kvstore):
    full = RNG.standard_normal((8, 4)).astype(np.float32)
    state = {f"r{r}": shard("w", full[r * 4:(r + 1) * 4].copy(), (r * 4, 0), (8, 4)) for r in range(2)}
    gs.save(state, "run1/iter_0000100", kvstore=kvstore, trainer_state={"step": 100}, overwrite=True)
    t = target()
    assert gs.load(t, "run1/iter_0000100", kvstore=kvstore) == {"step": 100}
    assert np.array_equal(t["t"].data, full)
    assert np.array_equal(gs.read_array("run1/iter_0000100", "w", kvstore=kvstore), full)
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.read_metadata("run1/iter_0000200", kvstore=kvstore)
    with pytest.raises(gs.StorageError, match="relative"):
        gs.read_metadata("../escape", kvstore=kvstore)


def test_a_broken_communicator_is_a_comm_error(tmp_path):
    class Broken:
        rank, world_size = 0, 2

        def all_gather(self, obj):
            raise TimeoutError("peer gone")

        def barrier(self):
            pass

    with pytest.raises(gs.CommError, match="peer gone"):
        gs.save({"a": shard("w", np.zeros(2), (0,), (2,))}, tmp_path, comm=Broken())


def test_checkpoint_handle_parses_once_and_loads(tmp_path, monkeypatch):
    full = small_checkpoint(tmp_path, trainer_state={"step": 3})
    ckpt = gs.Checkpoint(tmp_path)
    assert ckpt.metadata.tensors["w"].global_shape == (8, 4) and ckpt.trainer_state == {"step": 3}
    calls = []
    monkeypatch.setattr(gs.checkpoint.loading, "parse_metadata", lambda *a, **k: calls.append(1))
    t = target()
    state = ckpt.load(t)
    assert np.array_equal(t["t"].data, full) and calls == []  # no second parse
    state["step"] = 99
    assert ckpt.trainer_state == {"step": 3}


@pytest.mark.parametrize("pack_below", [0, 1 << 20])
def test_saves_and_loads_pause_the_cyclic_gc_and_restore_it(tmp_path, pack_below):
    # A load or save makes objects per tensor and per chunk (none in a cycle):
    # in a trainer holding millions of objects each collection they set off walks
    # all of them. None may run inside (at most the young generations' one or two
    # as the collector comes back on; unpaused, 3,000 tensors set off 10-90); the
    # collector is back on after, also when the call fails, and stays off if the
    # caller had turned it off.
    import gc
    state = {f"t{i}": shard(f"t{i}", np.full(3, i, np.float32), (0,), (3,)) for i in range(3000)}
    targets = {k: shard(k, np.zeros(3, np.float32), (0,), (3,)) for k in state}
    collections = []

    def count(phase, info):
        collections.append(info["generation"])

    def inside(call, *args, **kwargs):
        gc.collect()  # what the test itself allocated is not the call's
        collections.clear()
        gc.callbacks.append(count)
        try:
            return call(*args, **kwargs)
        finally:
            gc.callbacks.remove(count)

    try:
        inside(gs.save, state, tmp_path / "c", pack_below=pack_below)
        assert len(collections) <= 2 and 2 not in collections and gc.isenabled(), collections
        inside(gs.load, targets, tmp_path / "c")
        assert len(collections) <= 2 and 2 not in collections and gc.isenabled(), collections
        assert all(t.data[0] == int(k[1:]) for k, t in targets.items())
        with pytest.raises(gs.MissingKeyError):
            inside(gs.load, {"x": shard("x", np.zeros(3, np.float32), (0,), (3,))}, tmp_path / "c")
        assert gc.isenabled()
        gc.disable()
        gs.load(targets, tmp_path / "c")
        assert not gc.isenabled()
    finally:
        gc.enable()
