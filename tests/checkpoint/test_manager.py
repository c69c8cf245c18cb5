"""The core's CheckpointManager, on a local directory and on a kvstore: the
same retention, pointer and recovery rules wherever the root is."""

import json
import uuid

import numpy as np
import pytest

import globalshard as gs
from globalshard.store import open_root


def state(value, n=4):
    return {"w": gs.ShardedTensor.from_offset("w", np.full(n, value, np.float32), global_shape=(n,),
                                              global_offset=(0,))}


def target(n=4):
    return state(0.0, n)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    return str(tmp_path / "run") if request.param == "local" else f"memory://manager-{uuid.uuid4().hex}/"


def steps(mgr):
    return [s for s, _ in mgr.complete()]


def test_keeps_the_last_n_and_resumes_from_the_latest(root):
    mgr = gs.CheckpointManager(root, keep_last=2)
    assert mgr.latest() is None and mgr.load_latest(target()) is None
    for step in (100, 200, 300):
        mgr.save(step, state(step))
    assert steps(mgr) == [200, 300]
    with pytest.raises(gs.CheckpointNotFoundError):
        gs.read_metadata(mgr.path(100))  # pruned
    assert mgr.latest() == (300, mgr.path(300))
    t = target()
    assert mgr.load_latest(t)["step"] == 300 and (t["w"].data == 300).all()
    assert json.loads(mgr.store.read("latest")) == {"step": 300, "path": "iter_0000300"}


def test_a_rewind_resumes_from_the_step_saved_last(root):
    mgr = gs.CheckpointManager(root)
    for step in (100, 200, 50):
        mgr.save(step, state(step))
    assert mgr.latest() == (50, mgr.path(50))


def test_a_commit_the_pointer_never_heard_of_wins_and_a_stale_pointer_is_ignored(root):
    import time

    mgr = gs.CheckpointManager(root)
    mgr.save(100, state(100))
    # Saves are ordered by the millisecond their save id says they began; within one
    # millisecond the pointer wins (a CI run on an in-memory store saw both in one).
    time.sleep(0.002)
    gs.save(state(200), mgr.path(200), trainer_state={"step": 200})  # killed before the pointer moved
    assert mgr.latest() == (200, mgr.path(200))
    store = open_root(root)
    store.write("latest", json.dumps({"step": 7, "path": "iter_0000007"}).encode())  # a pruned step
    assert mgr.latest() == (200, mgr.path(200))
    store.write("latest", b"not json")
    assert mgr.latest() == (200, mgr.path(200))


def test_a_save_that_died_before_its_commit_is_not_complete(root):
    mgr = gs.CheckpointManager(root, keep_last=1)
    mgr.save(100, state(100))
    store = open_root(root)
    store.write("iter_0000200/saves/0123/arrays/w/zarr.json", b"{}")  # arrays, no metadata.json
    assert steps(mgr) == [100] and mgr.latest() == (100, mgr.path(100))
    mgr.save(300, state(300))
    assert steps(mgr) == [300]


def test_a_large_pruned_checkpoint_is_unpublished_at_once_and_deleted_in_the_background(root, monkeypatch):
    from globalshard.checkpoint import cleanup

    monkeypatch.setattr(cleanup, "BACKGROUND_DELETE_BYTES", 1)
    mgr = gs.CheckpointManager(root, keep_last=1)
    mgr.save(100, state(100))
    mgr.save(200, state(200))
    assert steps(mgr) == [200]  # unpublished when save returned
    gs.wait_for_cleanup()
    store = open_root(root)
    assert "iter_0000100" not in store.list_dir()


def test_bad_arguments_are_refused(root):
    with pytest.raises(ValueError, match="keep_last"):
        gs.CheckpointManager(root, keep_last=0)
    with pytest.raises(ValueError, match="non-negative"):
        gs.CheckpointManager(root).save(-1, state(1))


def pointer(mgr):
    return json.loads(open_root(mgr.root).read("latest"))["step"]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_an_async_save_moves_the_pointer_and_prunes_once_committed_and_a_failed_one_neither(tmp_path, mode):
    mgr, saver = gs.CheckpointManager(tmp_path, keep_last=1), gs.AsyncSaver(mode)
    mgr.save(1, state(1.0))
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "saves").write_text("a file where the save directories go")  # its writes fail
    mgr.save(2, state(2.0), saver=saver)  # planned: returns, writes in the background
    assert steps(mgr) == [1] and pointer(mgr) == 1
    with pytest.raises(gs.StorageError):
        mgr.wait()
    assert steps(mgr) == [1] and pointer(mgr) == 1  # nothing pruned for a save that did not commit
    (tmp_path / "iter_0000002" / "saves").unlink()

    held = state(3.0)
    mgr.save(3, held, saver=saver)
    held["w"].data[:] = -1  # training goes on
    mgr.wait()
    assert steps(mgr) == [3] and pointer(mgr) == 3  # published once committed, and step 1 pruned then
    assert mgr.load_latest(t := target()) == {"step": 3} and (t["w"].data == 3.0).all()

    # A failure already raised by the saver's own wait(): the manager's next save publishes nothing for it.
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / "saves").write_text("no room")
    mgr.save(4, state(4.0), saver=saver)
    with pytest.raises(gs.StorageError):
        saver.wait()
    mgr.save(5, state(5.0), saver=saver)  # publishes nothing for step 4; step 3 stays until 5 commits
    assert steps(mgr) == [3] and pointer(mgr) == 3
    assert mgr.load_latest(target())["step"] == 5  # waits for step 5, publishes it
    assert steps(mgr) == [5] and pointer(mgr) == 5


def test_async_saves_of_several_ranks_are_published_before_the_next_save_and_load(tmp_path):
    from globalshard.testing.comm import run_ranks

    def run(comm):
        mgr, saver = gs.CheckpointManager(tmp_path, keep_last=2, comm=comm), gs.AsyncSaver("thread")
        for step in (1, 2, 3):
            piece = gs.ShardedTensor.from_offset("w", np.full(2, step + comm.rank, np.float32), global_shape=(4,),
                                                 global_offset=(2 * comm.rank,))
            mgr.save(step, {"w": piece}, saver=saver)
        got = {"w": gs.ShardedTensor.from_offset("w", np.zeros(4, np.float32), global_shape=(4,), global_offset=(0,))}
        return mgr.load_latest(got)["step"], got["w"].data.tolist(), steps(mgr)

    for outcome in run_ranks(2, run):
        assert outcome == (3, [3.0, 3.0, 4.0, 4.0], [2, 3]), outcome
