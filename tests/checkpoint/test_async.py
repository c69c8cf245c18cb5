"""Async save, in a writer process and in a thread: the caller gets control
back after a host snapshot; the checkpoint holds the values at that moment,
errors surface at wait(), one save runs at a time and the staging pool is
reused."""

import numpy as np
import pytest
import saver

import globalshard as gs
from globalshard.testing.comm import run_ranks

MODES = pytest.mark.parametrize("mode", ["process", "thread"])


@MODES
def test_the_checkpoint_holds_the_values_at_the_snapshot_on_every_rank(tmp_path, mode):
    from globalshard.checkpoint.writer import Writer

    writer = Writer()  # not started: both ranks' first saves start it

    def save(comm):
        state = saver.stamped_state(1, rank=comm.rank)
        s = gs.AsyncSaver(mode, writer=writer)
        s.save(state, tmp_path, trainer_state={"tag": 1}, comm=comm)
        for t in state.values():
            t.data[...] = -1  # training goes on while the save runs
        s.wait()
        return s.blocking_seconds, s.snapshot_seconds, s.last_mode

    try:
        for blocking, snapshot, ran in run_ranks(2, save):
            assert 0 < snapshot <= blocking and ran == mode
    finally:
        writer.close()
    assert saver.whose(tmp_path) == 1


@MODES
def test_a_load_while_a_save_is_in_flight_waits_for_its_collectives(tmp_path, mode):
    # Rank 0 loads at once, while its save's background reaches its first collective; rank 1 comes late. On one
    # communicator, rank 0's load and its save's background would gather with each other (a thread communicator
    # pairs whoever arrives) and mix their messages.
    import time

    def run(comm):
        gs.save(saver.stamped_state(1, rank=comm.rank), tmp_path / "a", comm=comm)
        s = gs.AsyncSaver(mode)
        s.save(saver.stamped_state(2, rank=comm.rank), tmp_path / "b", trainer_state={"tag": 2}, comm=comm)
        if comm.rank == 1:
            time.sleep(0.5)
        targets = saver.stamped_state(0, rank=comm.rank)
        gs.load(targets, tmp_path / "a", comm=comm)
        s.wait()
        return {name: t.data.copy() for name, t in targets.items()}, s.last_mode

    for rank, outcome in enumerate(run_ranks(2, run)):
        assert not isinstance(outcome, BaseException), f"rank {rank}: {outcome!r}"
        loaded, ran = outcome
        assert ran == mode
        for name, data in loaded.items():
            assert np.array_equal(data, saver.stamped_state(1, rank=rank)[name].data), (rank, name)
    assert saver.whose(tmp_path / "b") == 2


@MODES
def test_a_background_failure_is_raised_by_wait_and_commits_nothing(tmp_path, mode):
    saver.save_stamped(tmp_path, 1)
    (tmp_path / "saves").rename(tmp_path / "kept")
    (tmp_path / "saves").write_text("a file where the save directories go")
    s = gs.AsyncSaver(mode)
    s.save(saver.stamped_state(2), tmp_path, trainer_state={"tag": 2}, overwrite=True)  # planning succeeds
    with pytest.raises(gs.StorageError):
        s.wait()
    s.wait()  # reported once
    (tmp_path / "saves").unlink()
    (tmp_path / "kept").rename(tmp_path / "saves")
    assert saver.whose(tmp_path) == 1  # the previous checkpoint, untouched


EXITS = """
import os, sys
import numpy as np
import globalshard as gs
path, mode, how = sys.argv[1:4]
if how != "healthy":
    os.makedirs(path)
    open(os.path.join(path, "saves"), "w").write("a file where the save directories go")  # its writes fail
saver = gs.AsyncSaver(mode)
w = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 4 MiB: still being written at exit
saver.save({"w": gs.ShardedTensor.from_offset("w", w, global_shape=w.shape, global_offset=(0, 0))}, path)
if how == "waits":
    try:
        saver.wait()
    except gs.StorageError:
        print("raised")
"""


@MODES
def test_a_script_that_exits_without_wait_commits_its_save_or_says_why_not(tmp_path, mode):
    # Before: in thread mode a save still writing when the script ended failed at the interpreter's shutdown
    # ("cannot schedule new futures after interpreter shutdown"), and nothing said so: the last checkpoint
    # was lost in silence. A failure no wait() raised was silent in both modes.
    import subprocess
    import sys

    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    said = "failed and was not committed; nothing raised it"
    for how in ("healthy", "fails", "waits"):
        path = tmp_path / how
        done = subprocess.run([sys.executable, str(script), str(path), mode, how], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        if how == "healthy":  # committed at exit, nothing said
            assert said not in done.stderr, done.stderr
            assert np.array_equal(gs.read_array(path, "w"), np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024))
        elif how == "fails":  # said on stderr, naming the path
            assert said in done.stderr and str(path) in done.stderr, done.stderr
        else:  # raised by wait(), so not said again
            assert done.stdout == "raised\n" and said not in done.stderr, done.stderr


@MODES
def test_join_waits_for_a_failed_save_and_leaves_its_error_to_wait(tmp_path, mode):
    assert gs.AsyncSaver(mode).join(timeout=0)  # nothing in flight
    saver.save_stamped(tmp_path, 1)
    (tmp_path / "saves").rename(tmp_path / "kept")
    (tmp_path / "saves").write_text("a file where the save directories go")
    s = gs.AsyncSaver(mode)
    s.save(saver.stamped_state(2), tmp_path, trainer_state={"tag": 2}, overwrite=True)
    assert s.join() and s.done()
    assert s.join(timeout=0)
    with pytest.raises(gs.StorageError):
        s.wait()


@MODES
def test_one_save_at_a_time_and_the_pool_is_reused(tmp_path, mode):
    s = gs.AsyncSaver(mode)
    state = saver.stamped_state(1)
    s.save(state, tmp_path / "a", trainer_state={"tag": 1})
    first = (s.pool.generation, s.pool.nbytes)
    assert first[1] >= sum(t.data.nbytes for t in state.values())
    s.save(saver.stamped_state(2), tmp_path / "a", trainer_state={"tag": 2}, overwrite=True)  # waits, then saves
    assert (s.pool.generation, s.pool.nbytes) == first  # the same buffer, not a new one
    s.wait()
    assert s.done() and saver.whose(tmp_path / "a") == 2
    with pytest.raises(gs.LayoutError):  # planning errors are raised by save() itself, nothing in flight
        s.save({"x": gs.ShardedTensor.from_offset("x", np.zeros(2), global_shape=(3,), global_offset=(0,))},
               tmp_path / "b")
    assert s.done()


def _shard(name, data):
    return gs.ShardedTensor.from_offset(name, data, global_shape=data.shape, global_offset=(0,) * data.ndim)


@MODES
def test_staged_arrays_are_waited_for_before_their_writes(tmp_path, mode):
    """A staged array is a private host copy still being filled (a device-to-host
    copy in flight, here a thread): save() returns without waiting for it, the
    background waits for it before its bytes are written (in process mode it
    then copies it into the pool, where the writer finds it, unless it is
    staged there already), and the checkpoint holds what the copy delivered.
    Unstaged arrays are snapshotted as before."""
    import threading

    host_copy = np.zeros((256, 64), np.float32)  # the pinned buffer the device copy fills
    plain = np.ones(8, np.float32)
    landed = threading.Event()
    waits = []

    def ready():
        waits.append(landed.is_set())
        assert landed.wait(30)

    s = gs.AsyncSaver(mode)
    s.save({"staged": _shard("a", host_copy), "plain": _shard("b", plain)}, tmp_path, staged={"staged": ready})
    assert s.pool.nbytes < (host_copy.nbytes if mode == "thread" else host_copy.nbytes + plain.nbytes + 8192)
    plain[:] = -1  # training goes on: the snapshot keeps the ones
    host_copy[:] = 3  # the device copy lands after save() returned
    landed.set()
    s.wait()
    assert len(waits) == 1  # waited once, in the background
    assert (gs.read_array(tmp_path, "a") == 3).all() and (gs.read_array(tmp_path, "b") == 1).all()


@MODES
def test_a_staged_copy_that_fails_fails_the_save_and_commits_nothing(tmp_path, mode):
    saver.save_stamped(tmp_path, 1)

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    s = gs.AsyncSaver(mode)
    state = saver.stamped_state(2)
    name = sorted(state)[0]
    s.save(state, tmp_path, trainer_state={"tag": 2}, overwrite=True, staged={name: broken})
    with pytest.raises(gs.StorageError, match="never became ready .*RuntimeError: CUDA error"):
        s.wait()
    assert saver.whose(tmp_path) == 1  # the previous checkpoint, untouched
    with pytest.raises(gs.LayoutError, match="staged names \\['nope'\\] are not in the state"):
        s.save(saver.stamped_state(3), tmp_path, overwrite=True, staged={"nope": broken})


def test_the_writer_process_writes_every_array_file_and_the_trainer_none(tmp_path):
    """Process mode: the trainer's interpreter opens no file of the save it
    writes (counted with an audit hook in a fresh trainer process); thread
    mode opens them all in the trainer."""
    import json
    import subprocess
    import sys

    from repo import TESTS

    script = f"""
import json, os, sys
sys.path.insert(0, {TESTS!r})
import saver
import globalshard as gs
root, mode = sys.argv[1], sys.argv[2]
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args and
                 "/saves/" in str(args[0]) else None)
s = gs.AsyncSaver(mode)
s.save(saver.stamped_state(1), root, trainer_state={{"tag": 1}})
s.wait()
print(json.dumps({{"opened": len(opened), "mode": s.last_mode}}))
"""
    counts = {}
    for mode in ("process", "thread"):
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / mode), mode], capture_output=True,
                             text=True, check=True)
        counts[mode] = json.loads(out.stdout.splitlines()[-1])
        assert saver.whose(tmp_path / mode) == 1
    assert counts["process"] == {"opened": 0, "mode": "process"}, counts
    assert counts["thread"]["opened"] >= len(saver.stamped_state(1)), counts


def test_a_writer_killed_between_saves_is_started_again(tmp_path):
    import os
    import signal
    import time

    s = gs.AsyncSaver("process")
    s.save(saver.stamped_state(1), tmp_path / "a", trainer_state={"tag": 1})
    s.wait()
    first = s.writer.pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while s.writer.alive() and time.monotonic() < deadline:  # the signal lands, the child is reaped
        time.sleep(0.01)
    s.save(saver.stamped_state(2), tmp_path / "b", trainer_state={"tag": 2})
    s.wait()
    assert s.last_mode == "process" and s.writer.pid != first
    assert saver.whose(tmp_path / "a") == 1 and saver.whose(tmp_path / "b") == 2


def test_a_root_another_process_cannot_reach_is_written_by_a_thread():
    s = gs.AsyncSaver("process")
    s.save(saver.stamped_state(1), "memory://async-thread-fallback/", trainer_state={"tag": 1})
    s.wait()
    assert s.last_mode == "thread" and saver.whose("memory://async-thread-fallback/") == 1


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="process, thread"):
        gs.AsyncSaver("fork")


def test_a_subclassed_store_is_written_by_a_thread_with_its_own_methods(tmp_path):
    """The writer process would open the class a store's description names,
    without a subclass's behaviour: such a store's saves stay in this process."""
    from globalshard.store import LocalStore

    written = []

    class Recording(LocalStore):
        def write(self, name, data):
            written.append(name)
            super().write(name, data)

    s = gs.AsyncSaver("process")
    s.save(saver.stamped_state(1), Recording(str(tmp_path)), trainer_state={"tag": 1})
    s.wait()
    assert s.last_mode == "thread" and saver.whose(tmp_path) == 1
    assert any("trainer_state" in name for name in written), written


def _chunk_offsets(root, key):
    """Where the inner chunks of ``key``'s one stored shard start in its file (from the shard index)."""
    import json

    from globalshard.io import localio

    directory = root / gs.read_metadata(root).tensors[key].regions[0].path
    layout = localio.parse(str(directory), json.loads((directory / "zarr.json").read_text()))
    count = int(np.prod([o // i for o, i in zip(layout.outer, layout.inner)]))
    data = open(layout.file_of((0, 0)), "rb").read()
    return np.frombuffer(data[len(data) - 16 * count - 4:-4], "<u8").reshape(count, 2)


def test_the_writer_process_writes_shards_around_the_page_cache(tmp_path):
    """Process mode writes each shard unbuffered (io/localio/unbuffered.py): its
    inner chunks start at multiples of 4096 bytes, straight from the staging
    pool, whose large arrays start at multiples of 4096 too; a synchronous save
    stores them back to back. Both load the same values."""
    value = np.arange(3 << 20, dtype=np.float32).reshape(1536, 2048)  # 12 MiB: a shard of 1 MiB chunks
    small = np.arange(1000, dtype=np.float32)
    state = {"w": _shard("w", value), "b": _shard("b", small)}
    s = gs.AsyncSaver("process")
    s.save(state, tmp_path / "async")
    s.wait()
    assert s.last_mode == "process"
    gs.save(state, tmp_path / "sync")
    written, synchronous = _chunk_offsets(tmp_path / "async", "w"), _chunk_offsets(tmp_path / "sync", "w")
    assert (written[:, 1] == synchronous[:, 1]).all() and len(written) > 1  # the same chunks
    assert (written[:, 0] % 4096 == 0).all()
    assert list(synchronous[:, 0]) == [k * synchronous[0, 1] for k in range(len(synchronous))]
    for name in ("async", "sync"):
        assert np.array_equal(gs.read_array(tmp_path / name, "w"), value)
        assert np.array_equal(gs.read_array(tmp_path / name, "b"), small)
        assert gs.Checkpoint(tmp_path / name).verify()[0] == []


def test_a_writer_of_local_saves_never_loads_tensorstore(tmp_path):
    """TensorStore is imported on first use (store/base.py): the writer
    process of local saves, whose memory is counted against an async save's,
    never maps it; a save to a kvstore from the same trainer still works."""
    s = gs.AsyncSaver("process")
    state = {"w": _shard("w", np.arange(3 << 18, dtype=np.float32).reshape(768, 1024))}
    for step in range(2):
        s.save(state, tmp_path / f"s{step}")
        s.wait()
    assert s.last_mode == "process"
    with open(f"/proc/{s.writer.pid}/maps") as maps:
        assert "_tensorstore" not in maps.read()
    gs.save(state, "memory://lazy/ckpt")
    assert np.array_equal(gs.read_array("memory://lazy/ckpt", "w"), state["w"].data)


def test_ranks_sharing_a_writer_start_one_process_and_each_gets_its_own_reply(tmp_path):
    # Ranks run as threads of one process share its writer; before 2026-12-05
    # two that found it not started each started one, and a job sent to the
    # first could wait forever for its reply on the second's connection.
    import threading

    from globalshard.checkpoint.writer import Writer
    from globalshard.store import open_root

    writer, ranks = Writer(), 4
    store = open_root(tmp_path)
    together = threading.Barrier(ranks)
    pids: list[int | None] = []
    errors: list[BaseException] = []

    def rank(k: int) -> None:
        try:
            together.wait()
            writer.ensure()
            pids.append(writer.pid)
            writer.call("remove", store, f"nothing-{k}")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(k,), daemon=True) for k in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads), "a rank still waits for its reply"
        assert not errors, errors
        assert len(pids) == ranks and len(set(pids)) == 1 and writer.alive(), pids
    finally:
        writer.close()
