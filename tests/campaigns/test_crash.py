"""Crash consistency: a saving process is SIGKILLed at points spread over
every phase of a save that replaces a checkpoint (planning, array writes,
trainer state, the commit, the cleanup, the manager's pointer and pruning).
After each kill the previous checkpoint loads bit-exactly, or the new one
does, whole; and the next save succeeds and leaves no leftovers.

Kill points are the save's own filesystem operations, counted with CPython
audit hooks in the saving process (tests/saver.py), plus timed kills while
TensorStore's threads write the arrays. CI runs a few per case; set
GLOBALSHARD_CRASH_POINTS (e.g. 50) for the full campaign
(``make reliability``), which also writes the counts to
$GLOBALSHARD_RELIABILITY_REPORT.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import saver
from repo import TESTS

import globalshard as gs

HERE = TESTS  # saver.py
POINTS = int(os.environ.get("GLOBALSHARD_CRASH_POINTS", "8"))
FULL = POINTS >= 50  # the documented campaign: 50 points per case, not a CI sample
REPORT = os.environ.get("GLOBALSHARD_RELIABILITY_REPORT")


def _record(case, tried, survived, killed):
    if REPORT:
        data = json.load(open(REPORT)) if os.path.exists(REPORT) else {}
        data.setdefault("crash", {})[case] = {"kill_points": tried, "previous_or_new_whole": survived,
                                              "process_killed": killed}
        json.dump(data, open(REPORT, "w"), indent=1)


def _spread(n, k):
    """k kill points spread evenly over 1..n, first and last included."""
    if k >= n:
        return list(range(1, n + 1))
    return sorted({1 + round(i * (n - 1) / (k - 1)) for i in range(k)})


def _saver(*args, env=None):
    return subprocess.run([sys.executable, os.path.join(HERE, "saver.py"), *args], capture_output=True, text=True,
                          timeout=300, env=env)


def _check_after_kill(path, expect_new, **kw):
    """The checkpoint at ``path`` is the previous one (tag 1) or the new one
    (tag 2), whole; the next save succeeds and sweeps every leftover."""
    tag = saver.whose(path, **kw)
    assert tag in (1, expect_new), tag
    saver.save_stamped(path, 3, overwrite=True, **kw)
    assert saver.whose(path, **kw) == 3
    return tag


@pytest.mark.parametrize("pack_below", [0, 1 << 20], ids=["arrays", "packed"])
def test_sigkill_at_every_phase_of_a_local_overwrite(tmp_path, pack_below):
    # Packed: the new save packs its twelve 128 KiB layer regions; the one after it does not.
    base = tmp_path / "base"
    saver.save_stamped(base, 1)
    shutil.copytree(base, tmp_path / "count")
    packing = ["--pack-below", str(pack_below)]
    counted = _saver(str(tmp_path / "count"), "--tag", "2", "--overwrite", "--count", *packing)
    assert counted.returncode == 0, counted.stderr
    events, duration = json.loads(counted.stdout)["events"], json.loads(counted.stdout)["seconds"]
    points = [("at", k) for k in _spread(events, max(2, POINTS - POINTS // 4))]
    points += [("after", duration * (i + 0.5) / max(1, POINTS // 4)) for i in range(max(1, POINTS // 4))]
    killed = killed_at = survived = 0
    outcomes = {1: 0, 2: 0}
    for n, (how, when) in enumerate(points):
        ckpt = tmp_path / f"k{n}"
        shutil.copytree(base, ckpt)
        out = _saver(str(ckpt), "--tag", "2", "--overwrite", f"--kill-{how}", str(when), *packing)
        killed += out.returncode == -9
        killed_at += how == "at" and out.returncode == -9
        assert out.returncode in (0, -9), out.stderr
        outcomes[_check_after_kill(ckpt, 2)] += 1
        assert sorted(os.listdir(ckpt / "saves")) == [gs.read_metadata(ckpt).save_id]
        assert not [f for f in os.listdir(ckpt) if ".tmp-" in f]
        survived += 1
        shutil.rmtree(ckpt)
    # Nearly every operation-counted point lands inside the save; a timed one may miss (the counted run,
    # with its audit hook, is slower than the runs it times: both timed points of 8 missed once in CI).
    at_points = sum(how == "at" for how, _ in points)
    assert killed_at >= 0.8 * at_points
    assert outcomes[1] and outcomes[2], outcomes  # kills before and after the commit both happened
    _record("local, single process" + (", packed" if pack_below else ""), len(points), survived, killed)


def test_sigkill_during_the_background_part_of_an_async_save(tmp_path):
    base = tmp_path / "base"
    saver.save_stamped(base, 1)
    shutil.copytree(base, tmp_path / "count")
    counted = _saver(str(tmp_path / "count"), "--tag", "2", "--overwrite", "--async-save", "--count")
    assert counted.returncode == 0, counted.stderr
    events, duration = json.loads(counted.stdout)["events"], json.loads(counted.stdout)["seconds"]
    n = POINTS // 2 if FULL else 3
    points = [("at", k) for k in _spread(events, n)] + [("after", duration * (i + 0.5) / n) for i in range(n)]
    killed = 0
    for i, (how, when) in enumerate(points):
        ckpt = tmp_path / f"a{i}"
        shutil.copytree(base, ckpt)
        out = _saver(str(ckpt), "--tag", "2", "--overwrite", "--async-save", f"--kill-{how}", str(when))
        assert out.returncode in (0, -9), out.stderr
        killed += out.returncode == -9
        _check_after_kill(ckpt, 2)
        shutil.rmtree(ckpt)
    _record("async save (kills in the snapshot and in the background)", len(points), len(points), killed)


def test_sigkill_of_the_writer_process_keeps_the_previous_checkpoint(tmp_path):
    """The writer process of an async save is killed at points spread over its
    work (array writes, trainer state, the commit, the cleanup): the trainer's
    wait() raises, or the save had committed; the previous or the new
    checkpoint loads whole, and the next save (a new writer) succeeds."""
    base = tmp_path / "base"
    saver.save_stamped(base, 1)
    shutil.copytree(base, tmp_path / "count")
    counted = _saver(str(tmp_path / "count"), "--tag", "2", "--overwrite", "--async-save",
                     "--writer-count", str(tmp_path / "events"))
    assert counted.returncode == 0, counted.stderr
    events = int((tmp_path / "events").read_text())
    assert events > 10, events  # the writer did the work: its files, not the trainer's
    points = _spread(events, POINTS if FULL else 4)
    failed = outcomes = 0
    seen = {1: 0, 2: 0}
    for k in points:
        ckpt = tmp_path / f"w{k}"
        shutil.copytree(base, ckpt)
        out = _saver(str(ckpt), "--tag", "2", "--overwrite", "--async-save", "--writer-kill-at", str(k))
        assert out.returncode in (0, 3), (out.returncode, out.stderr)
        if out.returncode == 3:
            failed += 1
            assert "WriterDied" in out.stdout and "previous checkpoint stands" in out.stdout, out.stdout
        seen[_check_after_kill(ckpt, 2)] += 1
        outcomes += 1
        shutil.rmtree(ckpt)
    assert failed >= 1 and seen[1] >= 1, (failed, seen)  # kills before the commit happened
    _record("async save, the writer process killed", len(points), outcomes, failed)


def test_sigkill_of_one_rank_of_a_gloo_save(tmp_path):
    from torch_harness import run_tolerating_deaths

    base = tmp_path / "base"
    saver.save_stamped(base, 1)
    shutil.copytree(base, tmp_path / "count")
    counts = run_tolerating_deaths(2, "crash_rank_job", str(tmp_path / "o"), path=str(tmp_path / "count"),
                                   victim=0, kill_at=0, tag=2)
    assert all(o["ok"] for o in counts), counts
    per_rank = [json.loads(o["value"])["events"] for o in counts]
    tried = survived = killed = 0
    for victim in (0, 1):
        for k in _spread(per_rank[victim], POINTS // 2 if FULL else 2):
            ckpt = tmp_path / f"r{victim}k{k}"
            shutil.copytree(base, ckpt)
            outcomes = run_tolerating_deaths(2, "crash_rank_job", str(tmp_path / "o"), path=str(ckpt),
                                             victim=victim, kill_at=k, tag=2)
            killed += outcomes[victim].get("type") == "killed"
            tried += 1
            _check_after_kill(ckpt, 2)
            survived += 1
            shutil.rmtree(ckpt)
    assert killed >= 0.8 * tried
    _record("local, one rank of a 2-rank gloo save", tried, survived, killed)


def test_sigkill_during_an_s3_overwrite(s3):
    spec, _client, _ = s3
    spec_json = json.dumps(spec)
    env = dict(os.environ)
    path = "crash/run"
    saver.save_stamped(path, 1, kvstore=spec)
    counted = _saver(path, "--tag", "2", "--overwrite", "--kvstore", spec_json, "--count", env=env)
    assert counted.returncode == 0, counted.stderr
    duration = json.loads(counted.stdout)["seconds"]  # the save alone, as the kill timer sees it
    saver.save_stamped(path, 1, overwrite=True, kvstore=spec)
    n = POINTS if FULL else 3
    outcomes = {1: 0, 2: 0}
    killed = 0
    for i in range(n):
        out = _saver(path, "--tag", "2", "--overwrite", "--kvstore", spec_json, "--kill-after",
                     str(duration * (i + 0.5) / (n + 1)), env=env)
        assert out.returncode in (0, -9), out.stderr
        killed += out.returncode == -9
        tag = saver.whose(path, kvstore=spec)
        outcomes[tag] = outcomes.get(tag, 0) + 1
        assert tag in (1, 2)
        saver.save_stamped(path, 1, overwrite=True, kvstore=spec)  # the next save succeeds; back to the base
        assert saver.whose(path, kvstore=spec) == 1
    _record("S3 (moto on 127.0.0.1)", n, n, killed)


def test_sigkill_during_a_managed_save_keeps_a_loadable_latest(tmp_path):
    pytest.importorskip("torch")
    from globalshard_torch.checkpoint import CheckpointManager

    root = tmp_path / "base"
    manager = CheckpointManager(root, keep_last=2)
    for step in (1, 2):
        manager.save_with(step, lambda p, s=step: saver.save_stamped(p, s))
    shutil.copytree(root, tmp_path / "count")
    counted = _saver(str(tmp_path / "count"), "--tag", "3", "--manager", "--count")
    assert counted.returncode == 0, counted.stderr
    events = json.loads(counted.stdout)["events"]
    # The kill points that matter here are the last ones: pointer swap, pruning.
    points = _spread(events, POINTS // 2 if FULL else 3)
    killed = 0
    for k in points:
        r = tmp_path / f"m{k}"
        shutil.copytree(root, r)
        out = _saver(str(r), "--tag", "3", "--manager", "--kill-at", str(k))
        assert out.returncode in (0, -9), out.stderr
        killed += out.returncode == -9
        m = CheckpointManager(r, keep_last=2)
        step, path = m.latest()
        assert step in (2, 3) and saver.whose(path) == step
        m.save_with(4, lambda p: saver.save_stamped(p, 4))
        assert m.latest()[0] == 4 and [s for s, _ in m.complete()][-1] == 4
        assert not [f for f in os.listdir(r) if ".tmp-" in f]
        shutil.rmtree(r)
    _record("checkpoint manager (pointer and pruning)", len(points), len(points), killed)
