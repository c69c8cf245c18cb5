"""Async save: the caller gets control back after a host snapshot; the
checkpoint holds the values at that moment, errors surface at wait(), one save
runs at a time and the snapshot buffer is reused."""

import numpy as np
import pytest
import saver
from threadcomm import run_ranks

import globalshard as gs


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
