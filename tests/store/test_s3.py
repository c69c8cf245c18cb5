"""A checkpoint on S3: a real S3-compatible server (moto) on 127.0.0.1, reached
through TensorStore's s3 kvstore driver."""

import time
import uuid

import numpy as np
import pytest

import globalshard as gs
from globalshard.store import open_root
from globalshard.testing.store import StoreTests


def shards(full, tp, fill=True):
    n = full.shape[0] // tp
    return {f"tp{r}": gs.ShardedTensor.from_offset(
        "w", full[r * n:(r + 1) * n].copy() if fill else np.zeros((n, full.shape[1]), full.dtype),
        global_shape=full.shape, global_offset=(r * n, 0)) for r in range(tp)}


def test_s3_round_trip_across_layouts(s3):
    spec, client, _ = s3
    full = np.random.default_rng(0).standard_normal((12, 5)).astype(np.float32)
    gs.save(shards(full, 4), "runs/a/iter_0000100", kvstore=spec, trainer_state={"step": 100})
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix="runs/a/")["Contents"]]
    assert "runs/a/iter_0000100/metadata.json" in keys
    targets = shards(full, 3, fill=False)
    stats = gs.IOStats()
    assert gs.load(targets, "runs/a/iter_0000100", kvstore=spec, stats=stats) == {"step": 100}
    assert np.array_equal(np.concatenate([t.data for t in targets.values()]), full)
    assert stats.bytes_needed == full.nbytes
    with pytest.raises(gs.CheckpointExistsError):
        gs.save(shards(full, 4), "runs/a/iter_0000100", kvstore=spec)


def test_s3_packed_checkpoint_round_trips_and_damage_names_the_pack(s3):
    spec, client, _ = s3
    rng = np.random.default_rng(1)
    values = {f"b{i}": rng.standard_normal(i + 1).astype(np.float32) for i in range(20)}
    state = {k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,)) for k, v in values.items()}
    state |= shards(np.arange(24, dtype=np.float32).reshape(8, 3), 2)
    gs.save(state, "runs/p", kvstore=spec, pack_below=4096)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix="runs/p/saves/")["Contents"]]
    assert {k.split("/")[4] for k in keys} == {"packs"}  # runs/p/saves/<id>/packs: every region here is small
    targets = {k: gs.ShardedTensor.from_offset(k, np.zeros_like(v), global_shape=v.shape, global_offset=(0,))
               for k, v in values.items()}
    gs.load(targets, "runs/p", kvstore=spec)
    assert all(np.array_equal(targets[k].data, v) for k, v in values.items())
    assert np.array_equal(gs.read_array("runs/p", "w", kvstore=spec), np.arange(24, dtype=np.float32).reshape(8, 3))
    assert gs.Checkpoint("runs/p", kvstore=spec).verify()[0] == []
    chunk = next(k for k in keys if not k.endswith("zarr.json"))
    body = client.get_object(Bucket="ckpt", Key=chunk)["Body"].read()
    client.put_object(Bucket="ckpt", Key=chunk, Body=bytes([body[0] ^ 1]) + body[1:])
    pack = chunk.split("/c/")[0][len("runs/p/"):]
    with pytest.raises(gs.StorageError) as e:
        gs.load(targets, "runs/p", kvstore=spec)
    assert pack in str(e.value)


def test_s3_damage_is_detected(s3):
    spec, client, _ = s3
    full = np.arange(24, dtype=np.float32).reshape(8, 3)
    gs.save(shards(full, 2), "runs/b", kvstore=spec)
    chunk = next(o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix="runs/b/saves/")["Contents"]
                 if not o["Key"].endswith(("zarr.json", "trainer_state.json")))
    body = client.get_object(Bucket="ckpt", Key=chunk)["Body"].read()
    client.put_object(Bucket="ckpt", Key=chunk, Body=bytes([body[0] ^ 1]) + body[1:])
    with pytest.raises(gs.StorageError):
        gs.read_array("runs/b", "w", kvstore=spec)
    client.delete_object(Bucket="ckpt", Key=chunk)
    with pytest.raises(gs.StorageError):
        gs.load(shards(full, 1, fill=False), "runs/b", kvstore=spec)
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.read_metadata("runs/none", kvstore=spec)


def test_s3_shared_reads_get_each_chunk_once_per_group(s3):
    """Three data-parallel replicas load the same TP=2 halves: with shared_reads each
    chunk is fetched from the object store once per group instead of once per rank
    (GET requests counted in the S3 server's own log)."""
    from globalshard.testing.comm import run_ranks

    spec, _, log_path = s3
    full = np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32)
    gs.save(shards(full, 4), "runs/c", kvstore=spec)
    prefix = "GET /ckpt/runs/c/saves/"

    def chunk_gets() -> int:
        with open(log_path) as f:
            return sum(1 for line in f if prefix in line and "zarr.json" not in line)

    def load(share: bool) -> tuple[list[np.ndarray], int]:
        before = chunk_gets()
        stats = [gs.IOStats() for _ in range(3)]

        def rank(comm):
            targets = shards(full, 2, fill=False)
            gs.load(targets, "runs/c", kvstore=spec, comm=comm, shared_reads=share, stats=stats[comm.rank])
            return np.concatenate([t.data for t in targets.values()])

        out = run_ranks(3, rank)
        time.sleep(0.5)  # the server writes its log line after answering
        return out, chunk_gets() - before, [s.bytes_read for s in stats]

    plain, plain_gets, plain_read = load(False)
    shared, shared_gets, shared_read = load(True)
    for got in plain + shared:
        assert isinstance(got, np.ndarray) and np.array_equal(got, full), got
    # 4 stored regions of one chunk each. Without sharing each rank fetches all 4 (the
    # threads here share TensorStore's cache, so fewer than 12 GETs show up in the log).
    assert shared_gets == 4 and plain_gets >= 4, (plain_gets, shared_gets)
    assert sum(shared_read) * 3 == sum(plain_read)


class TestS3Store(StoreTests):
    """The Store contract on a real S3 server: conditional commits are S3's own."""

    @pytest.fixture
    def store(self, s3):
        spec, _, _ = s3
        return open_root({**spec, "path": f"store-{uuid.uuid4().hex}/"})


def test_the_checkpoint_manager_runs_on_s3(s3):
    spec, client, _ = s3
    root = {**spec, "path": "managed/"}
    mgr = gs.CheckpointManager(root, keep_last=2)
    w = np.arange(8, dtype=np.float32)
    for step in (1, 2, 3):
        mgr.save(step, {"w": gs.ShardedTensor.from_offset("w", w * step, global_shape=(8,), global_offset=(0,))})
    assert [s for s, _ in mgr.complete()] == [2, 3] and mgr.latest() == (3, mgr.path(3))
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix="managed/").get("Contents", [])]
    assert not [k for k in keys if k.startswith("managed/iter_0000001/")]  # pruned, every object of it
    assert "managed/latest" in keys
    target = {"w": gs.ShardedTensor.from_offset("w", np.zeros(8, np.float32), global_shape=(8,), global_offset=(0,))}
    assert mgr.load_latest(target)["step"] == 3 and np.array_equal(target["w"].data, w * 3)
