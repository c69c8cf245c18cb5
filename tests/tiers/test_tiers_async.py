"""Asynchronous saves into the fast tier (``TieredManager.save(..., saver=)``),
ranks as threads: the call returns once the arrays are in the saver's pool;
the tier copies, their commit and the drain follow in the background and
hold the values of the call, whatever training does to the arrays next."""

import os
import shutil
import signal
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tiers import COLS, KEYS, ROWS, check_values, manager, resume, rows_state, values

import globalshard as gs


def holdings(tmp_path, node, step):
    return tmp_path / "local" / f"node{node}" / f"iter_{step:07d}" / "holdings.json"


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_an_asynchronous_save_returns_before_its_copies_are_written_and_they_hold_the_call_s_values(tmp_path, mode):
    world, gate = 8, threading.Event()  # 4 nodes of 2
    returned = threading.Barrier(world)

    def job(comm):
        m, saver = manager(tmp_path, comm), gs.AsyncSaver(mode)
        state = rows_state(values(10), comm.rank, world)
        # Key "a" is staged (a device copy in flight, say): its write waits for the gate.
        m.save(10, state, saver=saver, trainer_state={"loss": 1.5}, staged={"a": gate.wait})
        pending = not holdings(tmp_path, comm.rank // 2, 10).exists()
        for t in state.values():
            if t.key != "a":
                t.data[:] = -1  # training goes on: the copies hold the values of the call
        returned.wait()
        gate.set()
        m.wait()
        return pending and saver.blocking_seconds > 0, saver.last_mode, m.persisted()

    out = gs.testing.comm.run_ranks(world, job)
    assert all(not isinstance(r, BaseException) for r in out), out
    assert all(r == (True, mode, 10) for r in out), out
    for node in range(4):
        assert holdings(tmp_path, node, 10).exists()
    shutil.rmtree(tmp_path / "local" / "node2")  # recovered from the copies alone, on another cut
    shutil.rmtree(tmp_path / "persistent")
    out = resume(tmp_path, world=6, per_node=2, nodes_map=[0, 1, 3])
    check_values(out, 6, 10)
    assert all(trainer == {"loss": 1.5, "step": 10} for trainer, _, _ in out)


def test_a_writer_killed_mid_save_fails_it_on_every_rank_and_leaves_the_previous_step_whole(tmp_path):
    world = 4  # 2 nodes of 2, one writer process (this process's) for the four savers

    def job(comm):
        m, saver = manager(tmp_path, comm), gs.AsyncSaver("process")
        m.save(10, rows_state(values(10), comm.rank, world), saver=saver)
        m.wait()

        def die():
            if comm.rank == 1:
                os.kill(saver.writer.pid, signal.SIGKILL)

        m.save(20, rows_state(values(20), comm.rank, world), saver=saver, staged={"b": die})
        try:
            m.wait()
            failed = None
        except Exception as e:
            failed = e
        step_30_ok = None
        if failed is not None:  # the next save starts a new writer
            m.save(30, rows_state(values(30), comm.rank, world), saver=saver)
            m.wait()
            step_30_ok = m.persisted()
        return failed, step_30_ok

    out = gs.testing.comm.run_ranks(world, job)
    assert all(not isinstance(r, BaseException) for r in out), out
    for failed, persisted in out:
        assert isinstance(failed, gs.GlobalShardError), failed
        assert persisted == 30
    for node in range(2):  # step 20: never committed on any node, and pruned by step 30's commit
        assert holdings(tmp_path, node, 10).exists() and holdings(tmp_path, node, 30).exists()
        assert not (tmp_path / "local" / f"node{node}" / "iter_0000020").exists()
    # Nothing of step 20 reached the persistent tier (its drain never began): at most the lock of its directory.
    assert {p.name for p in (tmp_path / "persistent" / "iter_0000020").iterdir()} <= {".globalshard.lock"}
    shutil.rmtree(tmp_path / "persistent" / "iter_0000030")
    for node in range(2):
        shutil.rmtree(tmp_path / "local" / f"node{node}" / "iter_0000030")
    check_values(resume(tmp_path, world=2, per_node=1), 2, 10)  # step 10, whole


def test_a_step_saved_asynchronously_is_waited_for_before_a_recovery(tmp_path):
    """One process (no collective of the recovery waits for the background on its own)."""
    m, saver = manager(tmp_path, None, per_node=1), gs.AsyncSaver("thread")
    gate = threading.Timer(0.3, lambda: None)
    gate.start()
    m.save(10, rows_state(values(10), 0, 1), saver=saver, staged={"c": gate.join})
    targets = rows_state({k: np.zeros((ROWS, COLS), np.float32) for k in KEYS}, 0, 1)
    trainer = m.load_latest(targets)
    assert trainer == {"step": 10} and m.recovery.step == 10
    check_values([(trainer, {k: t.data for k, t in targets.items()}, m.recovery)], 1, 10)


def test_staged_without_a_saver_or_naming_no_array_of_the_state_is_refused(tmp_path):
    m = manager(tmp_path, None, per_node=1)
    with pytest.raises(gs.LayoutError, match="staged= needs saver="):
        m.save(1, rows_state(values(1), 0, 1), staged={"a": lambda: None})
    with pytest.raises(gs.LayoutError, match=r"staged names \['nope'\] are not in the state"):
        m.save(1, rows_state(values(1), 0, 1), saver=gs.AsyncSaver("thread"), staged={"nope": lambda: None})
    assert not (tmp_path / "local").exists() or not any((tmp_path / "local").rglob("iter_*"))


@settings(max_examples=12, deadline=None)
@given(mode=st.sampled_from(["process", "thread"]), saved=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       loaded=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_property_an_asynchronous_tiered_save_loads_the_values_of_the_call_under_any_cut(tmp_path_factory, mode,
                                                                                          saved, loaded, seed):
    """The rows cut one way (pieces of one rank), saved asynchronously, the
    arrays then overwritten; loaded from the tier under another cut (columns),
    they are the values of the call."""
    tmp = tmp_path_factory.mktemp("prop")
    rows, cols = sum(saved), sum(loaded)
    full = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    state, at = {}, 0
    for i, n in enumerate(saved):
        state[f"w{i}"] = gs.ShardedTensor.from_offset("w", full[at:at + n].copy(), global_shape=full.shape,
                                                      global_offset=(at, 0))
        at += n
    m = gs.TieredManager(tiers=[gs.LocalTier(str(tmp / "local")), str(tmp / "persistent")])
    m.save(1, state, saver=gs.AsyncSaver(mode))
    for t in state.values():
        t.data[:] = np.nan
    targets, at = {}, 0
    for i, n in enumerate(loaded):
        targets[f"w{i}"] = gs.ShardedTensor.from_offset("w", np.zeros((rows, n), np.float32),
                                                        global_shape=full.shape, global_offset=(0, at))
        at += n
    assert m.load_latest(targets) == {"step": 1}
    assert m.recovery.bytes_persistent == 0
    assert np.array_equal(np.concatenate([t.data for t in targets.values()], axis=1), full)
    m.wait()
    assert m.persisted() == 1
