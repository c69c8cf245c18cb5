"""The fast tier, with ranks as threads (globalshard.testing.comm): tier copies
on each node and the next, drained to the persistent tier; recovery onto
another layout from the nearest copies; losing nodes."""

import json
import os
import re
import shutil

import numpy as np
import pytest

import globalshard as gs
from globalshard.format.holdings import parse_holdings
from globalshard.testing.comm import run_ranks

ROWS, COLS = 24, 8
KEYS = ("a", "b", "c")


def values(step):
    return {k: (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1000 * i + step)
            for i, k in enumerate(KEYS)}


def rows_state(vals, rank, world):
    """Each key cut in ``world`` row blocks, one per rank (as TP or FSDP would)."""
    n = ROWS // world
    return {k: gs.ShardedTensor.from_offset(k, v[rank * n:(rank + 1) * n].copy(), global_shape=v.shape,
                                            global_offset=(rank * n, 0)) for k, v in vals.items()}


class StepNamed(gs.TieredManager):
    """Persisted steps named as torchtitan names them (``step-<n>``), bases included."""

    STEP_NAME = "step-{step}"
    STEP_PATTERN = re.compile(r"step-(\d+)")


def manager(tmp_path, comm, per_node=2, replicas=1, keep=2, nodes_map=None, named=gs.TieredManager):
    def node_dir(node):
        physical = nodes_map[node] if nodes_map is not None else node
        return str(tmp_path / "local" / f"node{physical}")

    tier = gs.LocalTier(node_dir, replicas=replicas, keep=keep, ranks_per_node=per_node)
    return named(tiers=[tier, str(tmp_path / "persistent")], comm=comm, keep_last=3)


def train(tmp_path, steps, world=8, **kw):
    def job(comm):
        m = manager(tmp_path, comm, **kw)
        for step in steps:
            m.save(step, rows_state(values(step), comm.rank, world), trainer_state={"loss": float(step)})
        m.wait()
        return m.persisted()

    results = run_ranks(world, job)
    assert all(r == steps[-1] for r in results), results


def resume(tmp_path, world, per_node, nodes_map=None, named=gs.TieredManager):
    def job(comm):
        m = manager(tmp_path, comm, per_node=per_node, nodes_map=nodes_map, named=named)
        targets = rows_state({k: np.zeros((ROWS, COLS), np.float32) for k in KEYS}, comm.rank, world)
        trainer = m.load_latest(targets)
        return trainer, {k: t.data for k, t in targets.items()}, m.recovery

    out = run_ranks(world, job)
    for r in out:
        assert not isinstance(r, BaseException), r
    return out


def check_values(out, world, step):
    n = ROWS // world
    for rank, (_, got, _) in enumerate(out):
        for k, v in values(step).items():
            assert np.array_equal(got[k], v[rank * n:(rank + 1) * n]), (rank, k)


def test_each_node_holds_its_own_arrays_and_the_previous_nodes(tmp_path):
    train(tmp_path, [10, 20, 30], keep=2)
    md = gs.read_metadata(tmp_path / "persistent" / "iter_0000030")
    for node in range(4):
        steps = sorted(os.listdir(tmp_path / "local" / f"node{node}"))
        assert steps == ["iter_0000020", "iter_0000030"], steps  # keep=2: the oldest copy pruned
        h = parse_holdings((tmp_path / "local" / f"node{node}" / "iter_0000030" / "holdings.json").read_bytes())
        assert h.metadata.save_id == md.save_id and h.node == node
        # own arrays plus the previous node's, each stored whole
        assert 0 < len(h.holds) < len(md.paths())
        for p in h.holds:
            assert (tmp_path / "local" / f"node{node}" / "iter_0000030" / p).exists(), p
    union = set()
    for node in range(4):
        union |= parse_holdings((tmp_path / "local" / f"node{node}" / "iter_0000030" / "holdings.json")
                                .read_bytes()).holds
    assert union == set(md.paths())  # every path of the step is on some node
    assert not (tmp_path / "local" / "node0" / "iter_0000030" / "metadata.json").exists()  # a copy, not a checkpoint
    assert not os.path.exists(tmp_path / "persistent" / ".drain")  # the drain's marks, gone once it committed
    assert json.loads((tmp_path / "persistent" / "latest").read_text())["step"] == 30


def test_a_lost_node_comes_back_from_its_replicas_on_another_layout(tmp_path):
    train(tmp_path, [10, 20])
    shutil.rmtree(tmp_path / "local" / "node2")  # node 2 is gone; the job comes back on nodes 0, 1 and 3
    shutil.rmtree(tmp_path / "persistent")  # and nothing was persisted: only the copies remain
    out = resume(tmp_path, world=6, per_node=2, nodes_map=[0, 1, 3])  # 6 ranks: another cut of every key
    check_values(out, 6, 20)
    assert all(trainer == {"loss": 20.0, "step": 20} for trainer, _, _ in out)
    recoveries = [rec for _, _, rec in out]
    assert all(rec.step == 20 and rec.bytes_persistent == 0 for rec in recoveries)
    assert sum(rec.bytes_peer for rec in recoveries) > 0  # some rows came from another node


@pytest.mark.parametrize("window", [None, 40])
def test_the_pieces_peers_send_travel_in_windows_of_bounded_size(tmp_path, monkeypatch, window):
    """With windows of 40 bytes (a piece: a stored read of 1 to 3 rows of 32
    bytes), a recovery after a node is lost takes many exchanges (what each
    carries: test_routing.py) and fills every target as one exchange does."""
    if window is not None:
        monkeypatch.setattr("globalshard.tiers.recovery._WINDOW", window)
    train(tmp_path, [10])
    shutil.rmtree(tmp_path / "local" / "node2")
    out = resume(tmp_path, world=6, per_node=2, nodes_map=[0, 1, 3])
    check_values(out, 6, 10)
    windows = {rec.windows for _, _, rec in out}
    peer = sum(rec.bytes_peer for _, _, rec in out)
    assert peer > 0 and len(windows) == 1  # every rank took part in every exchange
    assert windows == {1} if window is None else windows.pop() > 1


def test_losing_more_adjacent_nodes_than_replicas_reads_exactly_their_arrays_from_the_persistent_tier(tmp_path):
    train(tmp_path, [10])
    md = gs.read_metadata(tmp_path / "persistent" / "iter_0000010")
    lost = set()
    for node in (1, 2):
        h = parse_holdings((tmp_path / "local" / f"node{node}" / "iter_0000010" / "holdings.json").read_bytes())
        lost |= h.holds
    survivors = set()
    for node in (0, 3):
        survivors |= parse_holdings((tmp_path / "local" / f"node{node}" / "iter_0000010" / "holdings.json")
                                    .read_bytes()).holds
    shutil.rmtree(tmp_path / "local" / "node1")
    shutil.rmtree(tmp_path / "local" / "node2")
    only_lost = set(md.paths()) - survivors  # node 1's own arrays: on nodes 1 and 2 only
    assert only_lost and only_lost <= lost
    nbytes = sum(r.nbytes for t in md.tensors.values() for r in t.regions if r.path in only_lost)
    out = resume(tmp_path, world=4, per_node=2, nodes_map=[0, 3])
    check_values(out, 4, 10)
    assert sum(rec.bytes_persistent for _, _, rec in out) == nbytes  # exactly what no surviving node holds
    assert set().union(*(rec.paths_persistent for _, _, rec in out)) == only_lost


def test_a_step_whole_nowhere_falls_back_to_the_newest_older_one_saying_why(tmp_path, caplog):
    train(tmp_path, [10, 20])
    shutil.rmtree(tmp_path / "persistent" / "iter_0000020")  # step 20 not persisted...
    for node in (1, 2):  # ...and two adjacent nodes lost: step 20 is whole nowhere
        shutil.rmtree(tmp_path / "local" / f"node{node}" / "iter_0000020")
    with caplog.at_level("WARNING", logger="globalshard"):
        out = resume(tmp_path, world=8, per_node=2)
    check_values(out, 8, 10)
    assert all(rec.step == 10 for _, _, rec in out)
    assert any("passing over step 20" in m and "not persisted" in m for m in caplog.messages), caplog.messages


def test_nothing_anywhere_is_none(tmp_path):
    out = resume(tmp_path, world=2, per_node=1)
    assert all(trainer is None and rec is None for trainer, _, rec in out)


def test_a_step_asked_for_is_read_from_the_nearest_copies_or_the_persistent_tier(tmp_path):
    train(tmp_path, [10, 20, 30], keep=2)  # the nodes keep 20 and 30; the persistent tier all three

    def job(comm):
        m = manager(tmp_path, comm)
        out = {}
        for step in (20, 10, 40):
            found = m.open_latest(step)
            if found is None:
                out[step] = None
                continue
            targets = rows_state({k: np.zeros((ROWS, COLS), np.float32) for k in KEYS}, comm.rank, 8)
            found.load(targets)
            out[step] = (found.step, found.recovery.bytes_persistent, {k: t.data for k, t in targets.items()})
        return out

    n = ROWS // 8
    for rank, out in enumerate(run_ranks(8, job)):
        assert out[40] is None
        for step, from_persistent in ((20, False), (10, True)):
            got, persistent_bytes, held = out[step]
            assert got == step and (persistent_bytes > 0) == from_persistent, (step, persistent_bytes)
            for k, v in values(step).items():
                assert np.array_equal(held[k], v[rank * n:(rank + 1) * n]), (rank, step, k)


def test_a_copy_being_written_is_no_copy(tmp_path):
    train(tmp_path, [10], world=4)
    node = tmp_path / "local" / "node0" / "iter_0000010"
    (node / "holdings.json").unlink()  # the commit record of node 0's copy never landed
    shutil.rmtree(tmp_path / "persistent")
    out = resume(tmp_path, world=4, per_node=2)
    check_values(out, 4, 10)  # node 1 holds node 0's arrays too (replicas=1 of 2 nodes)
    assert all(rec.bytes_persistent == 0 for _, _, rec in out)


def test_bad_tiers_are_refused():
    with pytest.raises(gs.LayoutError, match="one LocalTier, then"):
        gs.TieredManager(tiers=["/tmp/x"])
    with pytest.raises(gs.LayoutError, match="do not make nodes"):
        gs.LocalTier("/tmp/x", ranks_per_node=3).nodes(gs.SingleProcessComm())


def test_a_nodes_ranks_default_to_the_launchers_local_world_size(monkeypatch):
    comm = type("Eight", (), {"rank": 5, "world_size": 8})()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc-per-node=4 on 2 nodes
    nodes = gs.LocalTier("/tmp/x").nodes(comm)
    assert (nodes.count, nodes.node_of(5), list(nodes.ranks_of(1))) == (2, 1, [4, 5, 6, 7])
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert gs.LocalTier("/tmp/x").nodes(comm).count == 8  # no launcher: a node per rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(gs.LayoutError, match="8 ranks do not make nodes of 3"):
        gs.LocalTier("/tmp/x").nodes(comm)


def test_rank_0_commits_a_drain_only_once_every_mark_is_in_place_not_while_one_is_written(tmp_path, monkeypatch):
    """A mark is written as a temporary file renamed into place: rank 0 once
    counted the temporary file, committed, and deleted the marks' directory
    under the last rank's rename (seen in CI: that step not persisted, and
    the next save's collectives broken). Here rank 3's rename waits until
    rank 0 has had time to list the temporary file."""
    import re
    import time

    import globalshard.store.local as local_store

    replace = os.replace

    def slow_mark(src, dst, *args, **kwargs):
        if re.search(r"/\.drain/[0-9a-f]+/3$", str(dst)):
            time.sleep(0.5)
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(local_store.os, "replace", slow_mark)
    train(tmp_path, [10, 20])  # every rank: step 20 persisted, so step 10's drain did not break the next save


def test_the_marks_a_failed_drain_left_go_with_the_next_drain_that_commits(tmp_path):
    # Before, they stayed in the persistent tier until removed by hand.
    stale = tmp_path / "persistent" / ".drain" / ("0" * 32)
    stale.mkdir(parents=True)
    (stale / "0").write_bytes(b"")  # rank 0's mark of a drain whose other ranks never finished
    train(tmp_path, [10])
    assert not (tmp_path / "persistent" / ".drain").exists()


def test_small_regions_packed_are_copied_drained_and_recovered_as_packs(tmp_path):
    def job(comm):
        m = manager(tmp_path, comm)
        state = rows_state(values(10), comm.rank, 8)  # 3 rows x 8 float32 per rank: 96-byte regions
        m.save(10, state, pack_below=1 << 20, trainer_state={"loss": 0.5})
        m.wait()
        return m.persisted()

    assert gs.testing.comm.run_ranks(8, job) == [10] * 8
    md = gs.read_metadata(tmp_path / "persistent" / "iter_0000010")
    packs = {r.path for t in md.tensors.values() for r in t.regions}
    assert all(r.byte_offset is not None for t in md.tensors.values() for r in t.regions)
    assert len(packs) == 8  # one pack per rank, holding its three keys' regions
    for node in range(4):
        held = parse_holdings((tmp_path / "local" / f"node{node}" / "iter_0000010" / "holdings.json").read_bytes())
        assert len(held.holds & packs) == 4  # its two ranks' packs and the previous node's two
    shutil.rmtree(tmp_path / "local" / "node2")
    shutil.rmtree(tmp_path / "persistent")
    out = resume(tmp_path, world=6, per_node=2, nodes_map=[0, 1, 3])
    check_values(out, 6, 10)
    assert all(rec.bytes_persistent == 0 for _, _, rec in out)


def _files_below(root):
    return {os.path.relpath(os.path.join(d, f), root): os.path.join(d, f)
            for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("window", [None, 40])
def test_files_travel_to_the_next_nodes_in_pieces_of_bounded_size(tmp_path, monkeypatch, window):
    """With windows of 40 bytes, each rank's shard files (over 100 bytes) go to
    the next node in several pieces over several exchanges; every copy is the
    sender's file byte for byte, nothing half-written is left, and the copies
    alone bring back a lost node."""
    if window is not None:
        monkeypatch.setattr("globalshard.tiers.saving._WINDOW", window)
    sent = {}  # by rank, the bytes each exchange call sends (the thread communicator's own exchange does the work)
    real = gs.testing.comm.ThreadComm.exchange

    def exchange(self, sends, recvs):
        sent.setdefault(self.rank, []).append(sum(a.nbytes for _, _, a in sends))
        return real(self, sends, recvs)

    monkeypatch.setattr(gs.testing.comm.ThreadComm, "exchange", exchange)
    train(tmp_path, [10])
    # Each rank's first exchange sends its list of files, its last what it holds to its node's lead.
    windows = [n for calls in sent.values() for n in calls[1:-1]]
    assert max(windows) <= window if window is not None else len(windows) == 8  # one exchange a rank: one window
    step = "iter_0000010"
    for node in range(4):
        own = _files_below(tmp_path / "local" / f"node{node}" / step)
        nxt = _files_below(tmp_path / "local" / f"node{(node + 1) % 4}" / step)
        held = parse_holdings((tmp_path / "local" / f"node{node}" / step / "holdings.json").read_bytes()).holds
        theirs = parse_holdings((tmp_path / "local" / f"node{(node + 1) % 4}" / step / "holdings.json")
                                .read_bytes()).holds
        mine = [name for name in own if any(name.startswith(p + "/") for p in held & theirs)]  # its own
        assert mine and all(open(own[n], "rb").read() == open(nxt[n], "rb").read() for n in mine)
        assert max(os.path.getsize(own[n]) for n in mine) > 40  # files larger than a window
        assert not [n for n in own if ".tmp-" in os.path.basename(n)], own  # no temporary files left
    shutil.rmtree(tmp_path / "local" / "node2")
    shutil.rmtree(tmp_path / "persistent")
    out = resume(tmp_path, world=6, per_node=2, nodes_map=[0, 1, 3])
    check_values(out, 6, 10)


def test_a_region_larger_than_the_small_file_bound_is_copied_drained_and_recovered(tmp_path):
    """A rank's region of 260 MiB (a shard file above the 256 MiB bound on
    the small files a load reads whole): the tier save sends it to the next
    node and drains it in pieces, and it comes back from either place."""
    width = 65 << 20  # float32 x 2 rows: 260 MiB a rank

    def state(rank, fill):
        data = np.full((1, width), fill + rank, np.float32)
        return {"w": gs.ShardedTensor.from_offset("w", data, global_shape=(2, width), global_offset=(rank, 0))}

    def save(comm):
        m = manager(tmp_path, comm, per_node=1)
        m.save(10, state(comm.rank, 7.0))
        m.wait()
        return m.persisted()

    assert run_ranks(2, save) == [10, 10]
    assert max(os.path.getsize(p) for p in _files_below(tmp_path / "persistent").values()) > 256 << 20
    for lose in ("persistent", "local/node0"):
        shutil.rmtree(tmp_path / lose)

        def load(comm):
            m = manager(tmp_path, comm, per_node=1)
            targets = state(comm.rank, 0.0)
            m.load_latest(targets)
            return bool((targets["w"].data == 7.0 + comm.rank).all())

        assert run_ranks(2, load) == [True, True], lose


def test_each_saves_metadata_crosses_once_when_ranks_agree_on_the_step(tmp_path, monkeypatch):
    """Four nodes hold copies of two steps, which the persistent tier holds
    too: the ranks learn every node's copies, but each save's metadata is
    sent by one rank (2 documents in all, not one per node and per tier),
    and the recovery is as before."""
    train(tmp_path, [10, 20])
    docs = []  # the metadata documents each all_gather call sends
    real = gs.testing.comm.ThreadComm.all_gather

    def all_gather(self, obj):
        docs.append(json.dumps(obj).count('"tensors"'))
        return real(self, obj)

    monkeypatch.setattr(gs.testing.comm.ThreadComm, "all_gather", all_gather)
    out = resume(tmp_path, world=8, per_node=2)
    check_values(out, 8, 20)
    assert sum(docs) == 2, docs


def test_a_replication_that_fails_midway_leaves_no_half_file_and_the_previous_step_whole(tmp_path, monkeypatch):
    """Files cut into 40-byte pieces, and the link between nodes fails at
    the third exchange, when some received files are partly written: every
    rank's save raises, no node holds a temporary or partial file of the
    step, no node commits it, and the step before it is recovered whole."""
    train(tmp_path, [10])
    monkeypatch.setattr("globalshard.tiers.saving._WINDOW", 40)
    calls = {}
    real = gs.testing.comm.ThreadComm.exchange

    def exchange(self, sends, recvs):
        calls[self.rank] = calls.get(self.rank, 0) + 1
        if calls[self.rank] == 3:
            raise ConnectionResetError("the link to the next node went down")
        return real(self, sends, recvs)

    monkeypatch.setattr(gs.testing.comm.ThreadComm, "exchange", exchange)

    def job(comm):
        manager(tmp_path, comm).save(20, rows_state(values(20), comm.rank, 8))

    errors = run_ranks(8, job)
    assert all(isinstance(e, gs.GlobalShardError) for e in errors), errors
    monkeypatch.setattr(gs.testing.comm.ThreadComm, "exchange", real)
    for node in range(4):
        step = tmp_path / "local" / f"node{node}" / "iter_0000020"
        names = list(_files_below(step)) if step.exists() else []
        assert "holdings.json" not in names and not [n for n in names if ".tmp-" in n], names
        sender = _files_below(tmp_path / "local" / f"node{(node + 3) % 4}" / "iter_0000020")
        for n in set(names) & set(sender):  # a file received is whole: equal to its sender's
            assert open(step / n, "rb").read() == open(sender[n], "rb").read(), n
    shutil.rmtree(tmp_path / "persistent")
    out = resume(tmp_path, world=8, per_node=2)
    check_values(out, 8, 10)


def test_the_lists_of_files_and_paths_go_to_the_ranks_that_use_them_not_to_every_rank(tmp_path, monkeypatch):
    """A tiered save sends each rank's list of files to the ranks of the next
    nodes that receive them, and what each rank holds to its node's lead,
    point to point: no rank's list reaches the all-gathers (only their sizes
    do), and rank 0's metadata alone names the step's arrays there."""
    payloads = []  # (rank, JSON) of every all_gather call
    real = gs.testing.comm.ThreadComm.all_gather

    def all_gather(self, obj):
        payloads.append((self.rank, json.dumps(obj)))
        return real(self, obj)

    monkeypatch.setattr(gs.testing.comm.ThreadComm, "all_gather", all_gather)
    train(tmp_path, [10])
    assert payloads and not [r for r, p in payloads if "zarr.json" in p]
    assert not [r for r, p in payloads if r != 0 and "/arrays/" in p]
    monkeypatch.setattr(gs.testing.comm.ThreadComm, "all_gather", real)
    shutil.rmtree(tmp_path / "local" / "node1")
    shutil.rmtree(tmp_path / "persistent")
    check_values(resume(tmp_path, world=6, per_node=2, nodes_map=[0, 2, 3]), 6, 10)


def test_a_persisted_steps_own_commit_wins_over_its_tier_copies_metadata(tmp_path):
    """Keys removed in place from the persisted step (``gs.remove_keys``, one
    commit of the same save) stay removed in a recovery that reads the tier
    copies, which still list them: the persistent tier's commit of a save is
    its last word, as a plain load of it says."""
    train(tmp_path, [10])
    gs.remove_keys(tmp_path / "persistent" / "iter_0000010", ["c"])

    def job(comm):
        return sorted(manager(tmp_path, comm).open_latest().metadata.tensors)

    assert run_ranks(8, job) == [["a", "b"]] * 8
    out = run_ranks(8, lambda comm: manager(tmp_path, comm).load_latest(
        rows_state({"c": np.zeros((ROWS, COLS), np.float32)}, comm.rank, 8)))
    assert all(isinstance(e, gs.MissingKeyError) and "'c'" in str(e) for e in out), out


def test_a_tiered_save_compares_replicas_when_asked_and_keeps_the_previous_step(tmp_path):
    # Every rank also holds "norm" whole (rank 0's the main copy); rank 3's drifted. Asked to compare copies,
    # the step is refused on every rank before any node writes it, and step 10 stays the newest everywhere.
    def job(comm, drift):
        m = manager(tmp_path, comm)
        norm = np.full(4, 0.5 + (1e-3 if comm.rank == drift else 0), np.float32)
        state = rows_state(values(10), comm.rank, 4) | {"norm": gs.ShardedTensor.from_offset(
            "norm", norm, global_shape=(4,), global_offset=(0,), replica_id=int(comm.rank > 0))}
        try:
            m.save(10 if drift is None else 20, state, check_replicas=True)
            m.wait()
        except gs.MismatchError as e:
            return str(e)
        return None

    assert run_ranks(4, lambda comm: job(comm, None)) == [None] * 4
    refused = run_ranks(4, lambda comm: job(comm, 3))
    assert all(r is not None and "'norm' [0:4]: copies differ, 2 values held by: rank 0 (main), rank 1, rank 2; "
               "rank 3" in r for r in refused), refused
    assert not (tmp_path / "persistent" / "iter_0000020" / "metadata.json").exists()  # its lock file at most
    assert json.loads((tmp_path / "persistent" / "latest").read_text())["step"] == 10
    assert all(sorted(os.listdir(tmp_path / "local" / f"node{n}")) == ["iter_0000010"] for n in range(2))
