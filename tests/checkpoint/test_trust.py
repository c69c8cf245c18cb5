"""Nothing lost, nothing silently wrong: each test here names a defect found
by trying to break the library (spec/FORMAT.md sections 2-5), and failed
before its fix."""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
import unicodedata

import numpy as np
import pytest
import saver
from hypothesis import given
from hypothesis import strategies as st
from repo import TESTS

import globalshard as gs
from globalshard import ShardedTensor
from globalshard.format.metadata import MAX_FILE_BYTES
from globalshard.store import open_root
from globalshard.testing.comm import ThreadComm, run_ranks

HERE = TESTS  # saver.py


def shard(key, data, offset, gshape, **kw):
    return ShardedTensor.from_offset(key, data, global_shape=gshape, global_offset=offset, **kw)


def whole(key, shape, dtype=np.float32):
    return {key: shard(key, np.zeros(shape, dtype), (0,) * len(shape), shape)}


def saved_dirs(root):
    return sorted(os.listdir(root / "saves"))


# ----------------------------------------------------------------------- replacing a checkpoint


@pytest.fixture(scope="module")
def pool():
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as p:
        p.map(time.sleep, [0, 0])  # both workers up and importing before the first race
        yield p


@pytest.mark.parametrize("overwrite", [False, True])
def test_racing_saves_end_with_one_whole_winner(tmp_path, pool, overwrite):
    trials = int(os.environ.get("GLOBALSHARD_RACE_TRIALS", "6"))
    wins: dict[int, int] = {}
    for trial in range(trials):
        path = str(tmp_path / f"t{trial}")
        if overwrite:
            saver.save_stamped(path, 9)
        start = time.time() + 0.3
        a, b = 2 * trial + 1, 2 * trial + 2
        outcomes = dict(zip((a, b), pool.map(saver.race, [(path, a, overwrite, start, None),
                                                         (path, b, overwrite, start + 0.002 * trial, None)])))
        winners = [t for t, o in outcomes.items() if o == "ok"]
        losers = [o for o in outcomes.values() if o != "ok"]
        assert winners, outcomes
        allowed = ("ConcurrentSaveError",) if overwrite else ("ConcurrentSaveError", "CheckpointExistsError")
        assert all(o.startswith(allowed) for o in losers), outcomes
        if not overwrite:
            assert len(winners) == 1, outcomes  # the second may never replace the first without overwrite
        final = saver.whose(path)  # asserts every tensor is that one writer's
        assert final in winners, (final, outcomes)
        assert saved_dirs(tmp_path / f"t{trial}") == [gs.read_metadata(path).save_id]  # nothing of the loser
        wins[len(winners)] = wins.get(len(winners), 0) + 1
    report = os.environ.get("GLOBALSHARD_RELIABILITY_REPORT")
    if report:
        data = json.load(open(report)) if os.path.exists(report) else {}
        data.setdefault("racing saves", {})["overwrite" if overwrite else "no overwrite"] = {
            "trials": trials, "one_whole_checkpoint": trials, "mixed": 0,
            "both_committed_one_after_the_other": wins.get(2, 0), "one_committed_one_clear_error": wins.get(1, 0)}
        json.dump(data, open(report, "w"), indent=1)


def test_a_kvstore_commit_that_lost_the_race_is_refused_and_cleans_up():
    # The conditional write itself, deterministically: someone commits between
    # this save's start and its commit.
    root = "memory://race-cas/"
    saver.save_stamped(root, 1)
    location = open_root(root)
    data, stamp = location.read_stamped("metadata.json")
    saver.save_stamped(root, 2, overwrite=True)
    with pytest.raises(gs.ConcurrentSaveError, match="another save committed"):
        location.commit("metadata.json", data, stamp)
    assert saver.whose(root) == 2


def test_loads_during_an_overwrite_see_one_checkpoint_whole_or_fail_clearly(tmp_path):
    path = str(tmp_path / "c")
    saver.save_stamped(path, 1)
    script = (f"import sys; sys.path.insert(0, {HERE!r})\nimport saver\n"
              f"for tag in range(2, 8):\n    saver.save_stamped({path!r}, tag, overwrite=True)\n")
    writer = subprocess.Popen([sys.executable, "-c", script])
    seen, failed = set(), 0
    try:
        deadline = time.monotonic() + 120
        while writer.poll() is None and time.monotonic() < deadline:
            try:
                seen.add(saver.whose(path))  # asserts the checkpoint is one writer's, whole
            except gs.GlobalShardError as e:
                assert "replaced by another save" in str(e) or "no metadata.json" not in str(e), e
                failed += 1
    finally:
        writer.wait(timeout=120)
    assert writer.returncode == 0
    assert seen and seen <= set(range(1, 8)), seen
    assert saver.whose(path) == 7


def test_a_handle_opened_before_an_overwrite_never_reads_the_new_arrays(tmp_path):
    saver.save_stamped(tmp_path, 1)
    old = gs.Checkpoint(tmp_path)
    saver.save_stamped(tmp_path, 2, overwrite=True)
    with pytest.raises(gs.StorageError, match="replaced by another save"):
        old.load(whole("layer0.w", (saver.ROWS, saver.COLS)))
    assert old.trainer_state == {"tag": 1}


def test_a_failed_overwrite_keeps_the_previous_checkpoint(tmp_path):
    saver.save_stamped(tmp_path, 1)
    bad = saver.stamped_state(2)
    bad["k0.tp1"] = shard("layer0.w", np.zeros((3, 3), np.float32), (0, 0), (saver.ROWS, saver.COLS))
    with pytest.raises(gs.LayoutError):
        gs.save(bad, tmp_path, overwrite=True)

    class FailingWrites(ThreadComm):
        """Rank 1, once planning is done, finds a file where its array directory must go."""

        def all_gather(self, obj):
            out = super().all_gather(obj)
            if self.gathers == 1 and self.rank == 1:
                arrays = tmp_path / "saves" / out[0]["value"]["save_id"] / "arrays" / "layer0.w"
                os.makedirs(arrays, exist_ok=True)
                (arrays / "1").write_text("in the way")
            return out

    def save(comm):
        comm.__class__ = FailingWrites
        gs.save(saver.stamped_state(3, rank=comm.rank), tmp_path, trainer_state={"tag": 3}, comm=comm,
                overwrite=True)

    results = run_ranks(2, save)
    assert isinstance(results[1], gs.StorageError) and isinstance(results[0], gs.CommError), results
    assert saver.whose(tmp_path) == 1
    assert saved_dirs(tmp_path) == [gs.read_metadata(tmp_path).save_id]


# ----------------------------------------------------------------------- what a save may delete


def test_a_save_never_deletes_files_it_did_not_write(tmp_path):
    (tmp_path / "arrays").mkdir()
    (tmp_path / "arrays" / "notes.txt").write_text("mine")
    (tmp_path / "train.log").write_text("also mine")
    with pytest.raises(gs.CheckpointExistsError, match="not empty and holds no checkpoint.*'arrays'"):
        saver.save_stamped(tmp_path, 1)
    saver.save_stamped(tmp_path, 1, overwrite=True)
    saver.save_stamped(tmp_path, 2, overwrite=True)
    assert (tmp_path / "arrays" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "train.log").read_text() == "also mine"
    assert saver.whose(tmp_path) == 2


def test_a_save_never_deletes_keys_it_did_not_write_on_a_kvstore():
    root = "memory://foreign-keys/"
    location = open_root(root)
    location.write("arrays/theirs", b"x")
    with pytest.raises(gs.CheckpointExistsError, match="not empty"):
        saver.save_stamped(root, 1)
    saver.save_stamped(root, 1, overwrite=True)
    saver.save_stamped(root, 2, overwrite=True)
    assert location.read("arrays/theirs") == b"x"


def test_a_metadata_json_that_is_not_ours_is_never_replaced(tmp_path):
    (tmp_path / "metadata.json").write_text('{"model_type": "llama"}')
    with pytest.raises(gs.CheckpointExistsError, match="not a valid globalshard checkpoint"):
        saver.save_stamped(tmp_path, 1, overwrite=True)
    assert (tmp_path / "metadata.json").read_text() == '{"model_type": "llama"}'


def test_an_empty_path_is_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: saver.save_stamped("", 1), lambda: gs.read_metadata(""), lambda: gs.load({}, "")):
        with pytest.raises(gs.StorageError, match="empty"):
            call()
    assert os.listdir(tmp_path) == []


def test_leftovers_of_killed_saves_are_swept_by_the_next_save(tmp_path):
    saver.save_stamped(tmp_path, 1)
    dead = "0" * 12 + "a" * 20
    os.makedirs(tmp_path / "saves" / dead / "arrays" / "x")
    (tmp_path / ".metadata.json.tmp-0123").write_text("half")
    (tmp_path / "saves" / "not-a-save-id").mkdir()  # not of this format's naming: left alone
    saver.save_stamped(tmp_path, 2, overwrite=True)
    assert saved_dirs(tmp_path) == sorted([gs.read_metadata(tmp_path).save_id, "not-a-save-id"])
    assert not (tmp_path / ".metadata.json.tmp-0123").exists()


def test_a_second_local_save_while_one_holds_the_lock_fails_at_once(tmp_path):
    location = open_root(tmp_path)
    with location.lock():
        with pytest.raises(gs.ConcurrentSaveError, match="another save .* is running"):
            saver.save_stamped(tmp_path, 1)
    saver.save_stamped(tmp_path, 1)  # released


@pytest.fixture
def paused_deletion(monkeypatch):
    """Every replaced checkpoint counts as large (deleted in the background),
    and its deletion waits for the event the fixture yields."""
    from globalshard.checkpoint import cleanup

    monkeypatch.setattr(cleanup, "BACKGROUND_DELETE_BYTES", 1)
    release = threading.Event()
    real = cleanup.remove_superseded

    def paused(location, previous, save_id):
        if previous is not None:  # a first save only sweeps leftovers, in its own thread
            assert release.wait(60)
        real(location, previous, save_id)

    monkeypatch.setattr(cleanup, "remove_superseded", paused)
    yield release
    release.set()
    gs.wait_for_cleanup()


def test_a_large_replaced_checkpoint_is_deleted_after_save_returns_under_the_lock(tmp_path, paused_deletion):
    saver.save_stamped(tmp_path, 1)
    old = gs.read_metadata(tmp_path).save_id
    saver.save_stamped(tmp_path, 2, overwrite=True)  # returns with the old one still there
    new = gs.read_metadata(tmp_path).save_id
    assert saved_dirs(tmp_path) == sorted([old, new])
    assert saver.whose(tmp_path) == 2
    with pytest.raises(gs.ConcurrentSaveError):  # another writer finds the lock held
        with open_root(tmp_path).lock():
            pass
    # The next save of this process waits for the deletion instead of failing.
    errors = []
    third = threading.Thread(target=lambda: errors.extend(
        [e for e in [_raised(saver.save_stamped, tmp_path, 3, overwrite=True)] if e]))
    third.start()
    third.join(0.5)
    assert third.is_alive() and saved_dirs(tmp_path) == sorted([old, new])
    paused_deletion.set()
    third.join(60)
    assert not third.is_alive() and errors == []
    gs.wait_for_cleanup()
    assert saved_dirs(tmp_path) == [gs.read_metadata(tmp_path).save_id]
    assert saver.whose(tmp_path) == 3
    with open_root(tmp_path).lock():  # released
        pass


def test_removing_keys_waits_for_the_background_deletion_of_the_save_before(tmp_path, paused_deletion):
    saver.save_stamped(tmp_path, 1)
    saver.save_stamped(tmp_path, 2, overwrite=True)  # its replaced checkpoint's deletion holds the lock
    key = sorted(gs.read_metadata(tmp_path).tensors)[0]
    errors = []
    remover = threading.Thread(target=lambda: errors.extend(
        [e for e in [_raised(gs.remove_keys, tmp_path, [key])] if e]))
    remover.start()
    remover.join(0.5)
    assert remover.is_alive() and key in gs.read_metadata(tmp_path).tensors  # waiting, not refused
    paused_deletion.set()
    remover.join(60)
    assert not remover.is_alive() and errors == [] and key not in gs.read_metadata(tmp_path).tensors


def _raised(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except BaseException as e:  # handed back to the test's thread
        return e
    return None


def test_a_small_replaced_checkpoint_is_gone_when_save_returns(tmp_path):
    saver.save_stamped(tmp_path, 1)
    saver.save_stamped(tmp_path, 2, overwrite=True)  # 7.5 MiB: below BACKGROUND_DELETE_BYTES
    assert saved_dirs(tmp_path) == [gs.read_metadata(tmp_path).save_id]


def test_the_interpreter_finishes_a_background_deletion_before_it_exits(tmp_path):
    script = (f"import sys; sys.path.insert(0, {HERE!r})\nimport saver\nfrom globalshard.checkpoint import cleanup\n"
              f"cleanup.BACKGROUND_DELETE_BYTES = 1\nsaver.save_stamped({str(tmp_path)!r}, 1)\n"
              f"saver.save_stamped({str(tmp_path)!r}, 2, overwrite=True)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert saved_dirs(tmp_path) == [gs.read_metadata(tmp_path).save_id]
    assert saver.whose(tmp_path) == 2


def test_an_async_save_hands_a_large_deletion_to_the_background_too(tmp_path, paused_deletion):
    saver.save_stamped(tmp_path, 1)
    old = gs.read_metadata(tmp_path).save_id
    async_saver = gs.AsyncSaver()
    async_saver.save(saver.stamped_state(2), tmp_path, trainer_state={"tag": 2}, overwrite=True)
    async_saver.wait()  # committed; the deletion is still paused
    assert old in saved_dirs(tmp_path) and saver.whose(tmp_path) == 2
    paused_deletion.set()
    gs.wait_for_cleanup()
    assert saved_dirs(tmp_path) == [gs.read_metadata(tmp_path).save_id]


# ----------------------------------------------------------------------- what a reader accepts


def _strip_crc32c(array_dir):
    meta = json.loads((array_dir / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "crc32c"]
    meta["codecs"] = meta["codecs"][:1]
    (array_dir / "zarr.json").write_text(json.dumps(meta))
    for d, _, files in os.walk(array_dir / "c"):
        for f in files:
            p = os.path.join(d, f)
            data = open(p, "rb").read()
            open(p, "wb").write(data[:-4])  # the chunk as it would be stored with no checksum


def test_arrays_without_crc32c_are_refused_by_every_reader(tmp_path):
    saver.save_stamped(tmp_path, 1)
    region = gs.read_metadata(tmp_path).tensors["layer0.w"].regions[0]
    _strip_crc32c(tmp_path / region.path)
    with pytest.raises(gs.StorageError, match="no crc32c"):
        saver.whose(tmp_path)
    with pytest.raises(gs.StorageError, match="no crc32c"):
        gs.read_array(tmp_path, "layer0.w")
    problems, _ = gs.Checkpoint(tmp_path).verify()
    assert len(problems) == 1 and "no crc32c" in problems[0] and region.path in problems[0]
    out = subprocess.run([sys.executable, "-m", "globalshard.cli", "verify", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 1 and "no crc32c" in out.stderr and "checksummed" not in out.stdout


def test_a_consistently_edited_metadata_json_cannot_swap_arrays(tmp_path):
    saver.save_stamped(tmp_path, 1)
    doc = json.loads((tmp_path / "metadata.json").read_text())
    a, b = doc["tensors"]["layer0.w"]["regions"], doc["tensors"]["layer1.w"]["regions"]
    a[0]["path"], b[0]["path"] = b[0]["path"], a[0]["path"]
    (tmp_path / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(gs.StorageError, match="says it holds .*layer1.w.* expects .*layer0.w"):
        saver.whose(tmp_path)
    # Two regions of one key swapped (offsets exchanged).
    saver.save_stamped(tmp_path / "b", 1)
    doc = json.loads((tmp_path / "b" / "metadata.json").read_text())
    r = doc["tensors"]["layer0.w"]["regions"]
    r[0]["path"], r[1]["path"] = r[1]["path"], r[0]["path"]
    (tmp_path / "b" / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(gs.StorageError, match="offset"):
        gs.read_array(tmp_path / "b", "layer0.w")


def test_bytes_read_counts_each_stored_chunk_once(tmp_path):
    full = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # 16 KiB: one chunk
    gs.save({"w": shard("w", full, (0, 0), full.shape)}, tmp_path)
    quarters = {f"q{i}": shard("w", np.zeros((16, 64), np.float32), (16 * i, 0), full.shape) for i in range(4)}
    stats = gs.IOStats()
    gs.load(quarters, tmp_path, stats=stats)
    assert stats.bytes_needed == full.nbytes
    assert stats.bytes_read == full.nbytes  # the chunk is read once, not four times


def test_a_huge_declared_region_allocates_nothing_before_its_array_is_checked(tmp_path):
    n = 1 << 40
    doc = {"format": "globalshard", "version": 2, "save_id": "1" * 32, "trainer_state": None,
           "tensors": {"huge": {"dtype": "uint8", "global_shape": [n], "regions": [
               {"offset": [0], "shape": [n], "path": "saves/x/huge", "nbytes": n}]}}}
    (tmp_path / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(gs.StorageError, match="saves/x/huge"):
        gs.read_array(tmp_path, "huge")
    problems, nbytes = gs.Checkpoint(tmp_path).verify()
    assert nbytes == 0 and len(problems) == 1 and "saves/x/huge" in problems[0]


def _with_timeout(fn, seconds=20):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the reader hung"
    return box


def test_small_files_are_read_only_when_regular_inside_the_root_and_bounded(tmp_path):
    saver.save_stamped(tmp_path / "c", 1)
    ckpt = tmp_path / "c"
    md = ckpt / "metadata.json"
    (tmp_path / "copy.json").write_bytes(md.read_bytes())
    md.unlink()
    md.symlink_to(tmp_path / "copy.json")  # a symlink to a copy outside the root
    assert "leads outside" in str(_with_timeout(lambda: gs.read_metadata(ckpt))["error"])
    md.unlink()
    md.symlink_to("/dev/zero")
    assert "leads outside" in str(_with_timeout(lambda: gs.read_metadata(ckpt))["error"])
    md.unlink()
    os.mkfifo(md)  # a FIFO would block an open() forever
    error = _with_timeout(lambda: gs.read_metadata(ckpt))["error"]
    assert isinstance(error, gs.StorageError) and "not a regular file" in str(error)
    md.unlink()
    with open(md, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: costs no disk
    error = _with_timeout(lambda: gs.read_metadata(ckpt))["error"]
    assert isinstance(error, gs.StorageError) and "more than" in str(error)
    md.write_bytes((tmp_path / "copy.json").read_bytes())
    assert saver.whose(ckpt) == 1
    # The trainer state, and a FIFO among the arrays.
    ts_file = ckpt / gs.read_metadata(ckpt).trainer_state.path
    ts_file.unlink()
    os.mkfifo(ts_file)
    assert "not a regular file" in str(_with_timeout(lambda: gs.read_trainer_state(ckpt))["error"])
    saver.save_stamped(tmp_path / "d", 1)
    chunk = tmp_path / "d" / gs.read_metadata(tmp_path / "d").tensors["layer0.w"].regions[0].path / "c" / "0" / "0"
    chunk.unlink()
    os.mkfifo(chunk)
    error = _with_timeout(lambda: saver.whose(tmp_path / "d"))["error"]
    assert isinstance(error, gs.MetadataError) and "not a regular file" in str(error)


def test_a_file_spec_with_options_still_gets_the_filesystem_checks(tmp_path):
    saver.save_stamped(tmp_path / "c", 1)
    saver.save_stamped(tmp_path / "elsewhere", 1)
    md = gs.read_metadata(tmp_path / "c")
    victim = tmp_path / "c" / md.tensors["layer0.w"].regions[0].path
    shutil.rmtree(victim)
    other = gs.read_metadata(tmp_path / "elsewhere").tensors["layer0.w"].regions[0].path
    os.symlink(tmp_path / "elsewhere" / other, victim)
    spec = {"driver": "file", "path": str(tmp_path / "c"), "file_io_sync": False}
    with pytest.raises(gs.MetadataError, match="outside the checkpoint"):
        saver.whose(spec)


# ----------------------------------------------------------------------- keys and paths

_TRICKY = st.sampled_from(["a/b", "../../etc/passwd", "/abs", "x\x00y", "k" * 300, "W", "w", ".", "..",
                           "caf\u00e9", "cafe\u0301", "%2F", "a%2Fb", "CON", " ", "\u212b", "\u00c5"])


@given(st.lists(_TRICKY | st.text(min_size=1, max_size=40), min_size=1, max_size=8, unique=True))
def test_keys_never_share_storage_nor_leave_the_root(keys):
    import tempfile

    keys = [k for k in keys if k.encode("utf-8", "surrogatepass") == k.encode("utf-8", "replace")]
    if not keys:
        return
    with tempfile.TemporaryDirectory() as outer:
        root = os.path.join(outer, "ckpt")
        state = {f"n{i}": shard(k, np.full(3, i, np.int32), (0,), (3,)) for i, k in enumerate(keys)}
        gs.save(state, root)
        for dirpath, dirnames, filenames in os.walk(outer):
            for name in dirnames + filenames:
                assert os.path.realpath(os.path.join(dirpath, name)).startswith(root), (keys, dirpath, name)
        dirs = [r.path for t in gs.read_metadata(root).tensors.values() for r in t.regions]
        folded = {unicodedata.normalize("NFC", d).casefold() for d in dirs}
        assert len(folded) == len(dirs)  # distinct even on case-insensitive, normalising filesystems
        for i, k in enumerate(keys):
            assert (gs.read_array(root, k) == i).all(), k


# ----------------------------------------------------------------------- storage faults


def _saver(*args, preexec=None):
    return subprocess.run([sys.executable, os.path.join(HERE, "saver.py"), *args], capture_output=True, text=True,
                          preexec_fn=preexec, timeout=300)


def test_a_full_disk_mid_save_keeps_the_previous_checkpoint(tmp_path):
    import resource

    saver.save_stamped(tmp_path, 1)

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file above 1 MiB: "disk full"

    out = _saver(str(tmp_path), "--tag", "2", "--overwrite", "--ignore-sigxfsz", preexec=small_disk)
    assert out.returncode != 0 and "StorageError" in out.stderr and "File too large" in out.stderr, out.stderr
    assert saver.whose(tmp_path) == 1
    assert saved_dirs(tmp_path) == [gs.read_metadata(tmp_path).save_id]  # the failed save cleaned up
    saver.save_stamped(tmp_path, 3, overwrite=True)
    assert saver.whose(tmp_path) == 3


def test_a_read_only_directory_is_a_clear_error_and_changes_nothing(tmp_path):
    # chattr +i holds even for root (these machines run as root, where chmod does not).
    saver.save_stamped(tmp_path / "c", 1)
    if not shutil.which("chattr") or \
            subprocess.run(["chattr", "+i", str(tmp_path / "c")], capture_output=True).returncode != 0:
        pytest.skip("this filesystem cannot make a directory immutable")
    try:
        with pytest.raises(gs.StorageError, match="metadata.json.*Operation not permitted"):
            saver.save_stamped(tmp_path / "c", 2, overwrite=True)  # arrays written, the commit refused
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "c")], check=True)
    assert saver.whose(tmp_path / "c") == 1
    assert saved_dirs(tmp_path / "c") == [gs.read_metadata(tmp_path / "c").save_id]


def test_a_load_failing_on_one_rank_writes_no_byte_on_any_rank(tmp_path):
    saver.save_stamped(tmp_path, 1)

    def load(comm):
        targets = whole("layer0.w", (saver.ROWS, saver.COLS))
        targets["layer0.w"].data[:] = -1
        if comm.rank == 1:  # a key its pipeline stage expects but the checkpoint lacks
            targets["extra"] = shard("layer99.w", np.zeros(3, np.float32), (0,), (3,))
        try:
            gs.load(targets, tmp_path, comm=comm)
            outcome = "loaded"
        except gs.GlobalShardError as e:
            outcome = type(e).__name__
        return outcome, bool((targets["layer0.w"].data == -1).all())

    results = run_ranks(2, load)
    assert results == [("CommError", True), ("MissingKeyError", True)], results


# --------------------------------------------------------------------------- links planted in the root


def _one(value=1.0):
    return {"w": ShardedTensor.from_offset("w", np.full((4,), value, np.float32), global_shape=(4,),
                                           global_offset=(0,))}


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_symlink_planted_as_saves_makes_the_save_fail_and_touches_nothing_outside(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    gs.save(_one(1.0), root)
    from globalshard.api import new_save_id
    from globalshard.format.metadata import is_save_id

    old_id = new_save_id()
    assert is_save_id(old_id)
    (outside / old_id).mkdir(parents=True)  # looks like a save id: the sweep would delete it
    (outside / old_id / "precious").write_bytes(b"keep")
    before = _tree(outside)
    shutil.rmtree(root / "saves")
    os.symlink(outside, root / "saves")
    with pytest.raises(gs.StorageError, match=r"saves is a symbolic link"):
        gs.save(_one(2.0), root, overwrite=True)
    assert _tree(outside) == before and (outside / old_id / "precious").read_bytes() == b"keep"
    # The sweep and removals never follow it either.
    loc = open_root(root)
    with pytest.raises(gs.StorageError, match="symbolic link"):
        loc.delete(f"saves/{old_id}", tree=True)
    with pytest.raises(gs.StorageError, match="symbolic link"):
        loc.list_dir("saves")
    assert _tree(outside) == before


def test_a_dangling_symlink_planted_as_the_lock_creates_nothing_outside(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside / "created", root / ".globalshard.lock")
    with pytest.raises(gs.StorageError, match=r"\.globalshard\.lock: it is a symbolic link"):
        gs.save(_one(), root)
    assert _tree(outside) == [] and not (root / "metadata.json").exists()


def test_a_digit_before_a_colon_is_no_drive_letter():
    from globalshard.format.metadata import check_relative_path

    assert check_relative_path("1:x/0") is None
    assert check_relative_path("C:x/0") is not None and check_relative_path("z:/0") is not None


def test_lone_surrogates_in_trainer_state_values_are_refused_both_ways(tmp_path):
    with pytest.raises(gs.TrainerStateError, match=r"\$\[\"name\"\].*not valid Unicode"):
        gs.save(_one(), tmp_path / "a", trainer_state={"name": "bad \ud800 value"})
    assert not (tmp_path / "a" / "metadata.json").exists()
    with pytest.raises(gs.TrainerStateError, match="not valid Unicode"):
        gs.save(_one(), tmp_path / "b", trainer_state={"list": ["ok", "\udfff"]})
    # A file written by another writer with an escaped lone surrogate is refused on read.
    from globalshard.format.metadata import TrainerStateRef, parse_trainer_state

    data = b'{"name": "\\ud800"}'
    ref = TrainerStateRef(len(data), __import__("hashlib").sha256(data).hexdigest(), "trainer_state.json")
    with pytest.raises(gs.MetadataError, match="not valid Unicode"):
        parse_trainer_state(data, ref)
