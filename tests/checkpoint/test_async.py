"""Async save: the caller gets control back after a host snapshot; the
checkpoint holds the values at that moment, errors surface at wait(), one save
runs at a time and the snapshot buffer is reused."""

import numpy as np
import pytest
import saver

import globalshard as gs
from globalshard.testing.comm import run_ranks


def test_the_checkpoint_holds_the_values_at_the_snapshot_on_every_rank(tmp_path):
    def save(comm):
        state = saver.stamped_state(1, rank=comm.rank)
        s = gs.AsyncSaver()
        s.save(state, tmp_path, trainer_state={"tag": 1}, comm=comm)
        for t in state.values():
            t.data[...] = -1  # training goes on while the save runs
        s.wait()
        return s.blocking_seconds, s.snapshot_seconds

    for blocking, snapshot in run_ranks(2, save):
        assert 0 < snapshot <= blocking
    assert saver.whose(tmp_path) == 1


def test_a_background_failure_is_raised_by_wait_and_commits_nothing(tmp_path):
    saver.save_stamped(tmp_path, 1)
    (tmp_path / "saves").rename(tmp_path / "kept")
    (tmp_path / "saves").write_text("a file where the save directories go")
    s = gs.AsyncSaver()
    s.save(saver.stamped_state(2), tmp_path, trainer_state={"tag": 2}, overwrite=True)  # planning succeeds
    with pytest.raises(gs.StorageError):
        s.wait()
    s.wait()  # reported once
    (tmp_path / "saves").unlink()
    (tmp_path / "kept").rename(tmp_path / "saves")
    assert saver.whose(tmp_path) == 1  # the previous checkpoint, untouched


def test_one_save_at_a_time_and_the_buffer_is_reused(tmp_path):
    s = gs.AsyncSaver()
    s.save(saver.stamped_state(1), tmp_path / "a", trainer_state={"tag": 1})
    first = s._buffer
    s.save(saver.stamped_state(2), tmp_path / "a", trainer_state={"tag": 2}, overwrite=True)  # waits, then saves
    assert s._buffer is first
    s.wait()
    assert s.done() and saver.whose(tmp_path / "a") == 2
    with pytest.raises(gs.LayoutError):  # planning errors are raised by save() itself, nothing in flight
        s.save({"x": gs.ShardedTensor.from_offset("x", np.zeros(2), global_shape=(3,), global_offset=(0,))},
               tmp_path / "b")
    assert s.done()


def _shard(name, data):
    return gs.ShardedTensor.from_offset(name, data, global_shape=data.shape, global_offset=(0,) * data.ndim)


def test_staged_arrays_are_waited_for_before_their_writes_and_not_copied(tmp_path):
    """A staged array is a private host copy still being filled (a device-to-host
    copy in flight, here a thread): save() returns without waiting for it, the
    writer waits just before writing it, and the checkpoint holds what the copy
    delivered. Unstaged arrays are snapshotted as before."""
    import threading

    host_copy = np.zeros((256, 64), np.float32)  # the pinned buffer the device copy fills
    plain = np.ones(8, np.float32)
    landed = threading.Event()
    waits = []

    def ready():
        waits.append(landed.is_set())
        assert landed.wait(30)

    s = gs.AsyncSaver()
    s.save({"staged": _shard("a", host_copy), "plain": _shard("b", plain)}, tmp_path, staged={"staged": ready})
    assert s._buffer.nbytes == plain.nbytes  # only the unstaged array was copied
    plain[:] = -1  # training goes on: the snapshot keeps the ones
    host_copy[:] = 3  # the device copy lands after save() returned
    landed.set()
    s.wait()
    assert len(waits) == 1  # waited once, in the background
    assert (gs.read_array(tmp_path, "a") == 3).all() and (gs.read_array(tmp_path, "b") == 1).all()


def test_a_staged_copy_that_fails_fails_the_save_and_commits_nothing(tmp_path):
    saver.save_stamped(tmp_path, 1)

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    s = gs.AsyncSaver()
    state = saver.stamped_state(2)
    name = sorted(state)[0]
    s.save(state, tmp_path, trainer_state={"tag": 2}, overwrite=True, staged={name: broken})
    with pytest.raises(gs.StorageError, match="never became ready .*RuntimeError: CUDA error"):
        s.wait()
    assert saver.whose(tmp_path) == 1  # the previous checkpoint, untouched
    with pytest.raises(gs.LayoutError, match="staged names \\['nope'\\] are not in the state"):
        s.save(saver.stamped_state(3), tmp_path, overwrite=True, staged={"nope": broken})
