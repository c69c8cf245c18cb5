"""Every Store passes the same tests (globalshard.testing.store.StoreTests);
the engine is chosen when a save or load starts, never at import."""

import os
import uuid

import numpy as np
import pytest

import globalshard as gs
from globalshard.io import LocalEngine, TensorStoreEngine, engine_name, open_engine
from globalshard.store import KvStore, LocalStore, open_root
from globalshard.testing.store import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(tmp_path / "root")


class TestMemoryKvStore(StoreTests):
    @pytest.fixture
    def store(self):
        return open_root(f"memory://store-tests-{uuid.uuid4().hex}/")


def test_open_root_picks_the_store_from_what_the_caller_names(tmp_path):
    assert isinstance(open_root(tmp_path), LocalStore)
    assert isinstance(open_root(str(tmp_path)), LocalStore)
    assert isinstance(open_root(f"file://{tmp_path}/"), LocalStore)  # a file kvstore is a directory
    assert isinstance(open_root({"driver": "file", "path": str(tmp_path)}), LocalStore)
    assert isinstance(open_root("memory://x/"), KvStore)
    inside = open_root("run/step1", kvstore="memory://base/")
    assert isinstance(inside, KvStore) and inside.spec["path"] == "base/run/step1/"
    store = open_root(tmp_path)
    assert open_root(store) is store
    with pytest.raises(gs.StorageError, match="relative inside it"):
        open_root("../escape", kvstore="memory://base/")
    with pytest.raises(gs.StorageError, match="not a checkpoint location"):
        open_root("nonsense-driver://x")


def test_the_engine_follows_the_environment_when_a_save_starts(tmp_path, monkeypatch):
    local, kv = open_root(tmp_path), open_root("memory://engines/")
    monkeypatch.delenv("GLOBALSHARD_IO", raising=False)
    monkeypatch.delenv("GLOBALSHARD_LOCAL_IO", raising=False)
    assert type(open_engine(local)) is LocalEngine and type(open_engine(kv)) is TensorStoreEngine
    monkeypatch.setenv("GLOBALSHARD_IO", "tensorstore")  # read now, not at import
    assert type(open_engine(local)) is TensorStoreEngine
    assert type(open_engine(local, io="localio")) is LocalEngine  # passed in wins
    monkeypatch.delenv("GLOBALSHARD_IO")
    monkeypatch.setenv("GLOBALSHARD_LOCAL_IO", "tensorstore")  # the old name still works
    assert engine_name() == "tensorstore"
    monkeypatch.setenv("GLOBALSHARD_LOCAL_IO", "direct")
    assert engine_name() == "localio"
    monkeypatch.setenv("GLOBALSHARD_IO", "mmap")
    with pytest.raises(ValueError, match="GLOBALSHARD_IO"):
        gs.save({"w": gs.ShardedTensor.from_offset("w", np.ones(2), global_shape=(2,), global_offset=(0,))},
                tmp_path / "c")
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


def test_the_engine_passed_in_wins_over_the_environment_in_every_call(tmp_path, monkeypatch):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {"w": gs.ShardedTensor.from_offset("w", w, global_shape=(3, 4), global_offset=(0, 0))}
    monkeypatch.setenv("GLOBALSHARD_IO", "mmap")  # not an engine: only a call that reads it fails
    used = []
    for cls in (LocalEngine, TensorStoreEngine):
        for method in ("write", "open"):
            real = getattr(cls, method)

            def spy(self, *a, real=real, cls=cls, method=method, **k):
                used.append((cls.__name__, method))
                return real(self, *a, **k)

            monkeypatch.setattr(cls, method, spy)
    gs.save(state, tmp_path / "a", io="tensorstore")
    saver = gs.AsyncSaver(mode="thread")
    saver.save(state, tmp_path / "b", io="localio")
    saver.wait()
    assert used == [("TensorStoreEngine", "write"), ("LocalEngine", "write")]
    used.clear()
    target = {"w": gs.ShardedTensor.from_offset("w", np.zeros_like(w), global_shape=(3, 4), global_offset=(0, 0))}
    gs.load(target, tmp_path / "a", io="localio")
    assert np.array_equal(target["w"].data, w)
    assert np.array_equal(gs.read_array(tmp_path / "b", "w", io="tensorstore"), w)
    assert np.array_equal(gs.Checkpoint(tmp_path / "b", io="localio").read_array("w"), w)
    assert used == [("LocalEngine", "open"), ("TensorStoreEngine", "open"), ("LocalEngine", "open")]
    with pytest.raises(ValueError, match="io=, or GLOBALSHARD_IO"):
        gs.save(state, tmp_path / "c")
    with pytest.raises(ValueError, match="not 'mmap'"):
        gs.load(target, tmp_path / "a")
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


@pytest.mark.parametrize("io", ["localio", "tensorstore"])
def test_either_engine_writes_what_the_other_reads(tmp_path, monkeypatch, io):
    other = {"localio": "tensorstore", "tensorstore": "localio"}[io]
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    monkeypatch.setenv("GLOBALSHARD_IO", io)
    gs.save({"w": gs.ShardedTensor.from_offset("w", w, global_shape=(4, 6), global_offset=(0, 0))}, tmp_path)
    monkeypatch.setenv("GLOBALSHARD_IO", other)
    assert np.array_equal(gs.read_array(tmp_path, "w"), w)


def test_only_in_memory_kvstores_are_not_shared_between_processes(tmp_path):
    assert open_root(tmp_path).process_shared
    assert open_root({"driver": "ocdbt", "base": f"file://{tmp_path}/"}).process_shared
    assert not open_root("memory://x/").process_shared
    assert not open_root({"driver": "ocdbt", "base": "memory://y/"}).process_shared


def test_a_local_file_read_in_pieces_is_never_read_through_a_link_and_a_shrinking_one_fails(tmp_path):
    store = LocalStore(tmp_path / "root")
    store.write("a/data", b"x" * 100)
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", tmp_path / "root" / "a" / "link")
    with pytest.raises(gs.StorageError, match="a/link"):
        list(store.read_pieces("a/link", 10))
    with pytest.raises(gs.StorageError, match="a/link.*not a regular file"):
        store.size("a/link")
    pieces = store.read_pieces("a/data", 40)
    assert next(pieces) == b"x" * 40
    os.truncate(tmp_path / "root" / "a" / "data", 50)  # cut short between two pieces
    with pytest.raises(gs.StorageError, match="a/data shrank while it was being read"):
        list(pieces)
