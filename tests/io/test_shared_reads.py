"""Shared reads: bytes several ranks need are read once, verified, and sent.

Ranks are threads with a real point-to-point exchange (globalshard.testing.comm);
the gloo version is in tests/torch_adapter/test_torch_distributed.py.
"""

import os
import shutil
import tempfile

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import globalshard as gs
from globalshard import shared
from globalshard.shared import needs_of, plan_sharing
from globalshard.testing.comm import ThreadComm, run_ranks
from globalshard.testing.strategies import expected_target, layouts, make_shard, random_values, shapes


@st.composite
def cases(draw):
    shape = draw(shapes(min_dims=0, max_dims=3, max_side=8))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int16"]))
    value = random_values(shape, dtype, draw(st.integers(0, 2**32)))
    save = draw(layouts(shape))
    loads = [draw(layouts(shape, replicas=False)) for _ in range(draw(st.integers(1, 2)))]
    ranks = [draw(st.integers(0, len(loads) - 1)) for _ in range(draw(st.integers(2, 4)))]
    target_dtype = draw(st.sampled_from([dtype, "float64"]))
    limits = draw(st.sampled_from([(64, 128), (1 << 20, 4 << 20)]))  # tiny: many pieces and windows
    return value, save, loads, ranks, target_dtype, limits


@given(cases())
def test_property_shared_reads_fill_targets_like_plain_reads(case):
    value, save, loads, ranks, target_dtype, (piece, window) = case
    directory = tempfile.mkdtemp()
    saved = (shared._PIECE_BYTES, shared.WINDOW_BYTES)
    shared._PIECE_BYTES, shared.WINDOW_BYTES = piece, window
    try:
        gs.save({f"s{i}": make_shard("k", spec, value, seed=i) for i, spec in enumerate(save)}, directory)
        stats = [gs.IOStats() for _ in ranks]
        plain = [gs.IOStats() for _ in ranks]

        def load(comm: ThreadComm, share: bool):
            targets = {f"t{i}": make_shard("k", spec, value, dtype=target_dtype, fill="junk", seed=i)
                       for i, spec in enumerate(loads[ranks[comm.rank]])}
            gs.load(targets, directory, comm=comm, shared_reads=share,
                    stats=(stats if share else plain)[comm.rank])
            return targets

        results = run_ranks(len(ranks), lambda comm: load(comm, True))
        plain_results = run_ranks(len(ranks), lambda comm: load(comm, False))
        for targets, again in zip(results, plain_results):
            assert isinstance(targets, dict), targets
            for name, t in targets.items():
                expected = expected_target(t, value)
                assert expected.tobytes() == t.data.tobytes(), (name, t.data, expected)
                assert again[name].data.tobytes() == t.data.tobytes()
        # What was sent was received; each rank got all it needed, some of it from others.
        assert sum(s.bytes_sent for s in stats) == sum(s.bytes_received for s in stats)
        assert [s.bytes_needed for s in stats] == [p.bytes_needed for p in plain]
        # Ranks with the same layout read disjoint parts of what they need in common.
        if len(set(ranks)) == 1 and value.size:
            assert sum(s.bytes_received for s in stats) > 0
    finally:
        shared._PIECE_BYTES, shared.WINDOW_BYTES = saved
        shutil.rmtree(directory, ignore_errors=True)


def test_owners_balance_and_every_shared_box_has_one_owner():
    # Four ranks need the same 4 stored reads of 400 bytes; rank 3 also reads 1000 alone.
    common = [[f"a/{n}", -1, [0], [100], "float32"] for n in range(4)]
    needs = [list(common) for _ in range(4)]
    needs[3].append(["b/0", -1, [0], [250], "float32"])
    pieces = plan_sharing(needs)
    assert sorted(p.path for p in pieces) == [f"a/{n}" for n in range(4)]
    assert all(p.needers == (0, 1, 2, 3) for p in pieces)
    assert sorted(p.owner for p in pieces) == [0, 0, 1, 2]  # rank 3 already reads 1000 bytes
    # A read is cut along its first axis into pieces that tile it.
    shared._PIECE_BYTES, saved = 40, shared._PIECE_BYTES  # 5 rows of 8 bytes
    try:
        cut = plan_sharing([[["x", -1, [5, 0], [9, 2], "float32"]]] * 2)
    finally:
        shared._PIECE_BYTES = saved
    assert [(p.box.offset, p.box.shape) for p in cut] == [((5, 0), (5, 2)), ((10, 0), (4, 2))]
    assert all(p.read == gs.Box((5, 0), (9, 2)) for p in cut)


def _save_two_regions(path):
    full = np.arange(48, dtype=np.float32).reshape(8, 6)
    gs.save({"a": gs.ShardedTensor.from_offset("w", full[:4], global_shape=(8, 6), global_offset=(0, 0)),
             "b": gs.ShardedTensor.from_offset("w", full[4:], global_shape=(8, 6), global_offset=(4, 0))}, path)
    return full


def test_a_damaged_piece_fails_every_rank_and_names_the_file(tmp_path):
    _save_two_regions(tmp_path)
    md = gs.read_metadata(tmp_path)
    region = md.tensors["w"].regions[1]
    chunk = tmp_path / region.path / "c" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 0xFF
    chunk.write_bytes(bytes(raw))

    def load(comm):
        target = gs.ShardedTensor.from_offset("w", np.zeros((8, 6), np.float32), global_shape=(8, 6),
                                              global_offset=(0, 0))
        gs.load({"w": target}, tmp_path, comm=comm, shared_reads=True)

    results = run_ranks(2, load)
    owner = plan_sharing([needs_of_full(md)] * 2)[1].owner
    assert isinstance(results[owner], gs.StorageError) and region.path in str(results[owner]), results
    other = results[1 - owner]
    assert isinstance(other, gs.CommError) and f"rank(s) [{owner}]" in str(other), results


def needs_of_full(md):
    plan = gs.LoadPlanner().plan(md, [gs.ShardInfo("w", "float32", (8, 6), (8, 6),
                                                   (gs.Region(gs.Box.full((8, 6)), gs.Box.full((8, 6))),))])
    return needs_of(plan)


def test_a_communicator_without_exchange_is_refused_before_reading(tmp_path):
    _save_two_regions(tmp_path)

    class JsonOnly:
        """Only what a plain load needs: rank, world_size, all_gather, barrier."""

        def __init__(self, comm):
            self._comm, self.rank, self.world_size = comm, comm.rank, comm.world_size

        def all_gather(self, obj):
            return self._comm.all_gather(obj)

        def barrier(self):
            self._comm.barrier()

    def load(comm):
        target = np.full((8, 6), 7, np.float32)
        try:
            gs.load({"w": gs.ShardedTensor.from_offset("w", target, global_shape=(8, 6), global_offset=(0, 0))},
                    tmp_path, comm=JsonOnly(comm), shared_reads=True)
        except gs.CommError as e:
            return str(e), target
        return None, target

    for message, target in run_ranks(2, load):
        assert message is not None and "exchange()" in message and "JsonOnly" in message
        assert (target == 7).all()  # nothing read


def test_one_process_ignores_shared_reads(tmp_path):
    full = _save_two_regions(tmp_path)
    target = gs.ShardedTensor.from_offset("w", np.zeros((8, 6), np.float32), global_shape=(8, 6),
                                          global_offset=(0, 0))
    stats = gs.IOStats()
    gs.load({"w": target}, tmp_path, shared_reads=True, stats=stats)
    assert np.array_equal(target.data, full) and stats.bytes_received == 0


def test_reading_leaves_no_open_files_behind(tmp_path):
    _save_two_regions(tmp_path)
    before = len(os.listdir("/proc/self/fd"))

    def load(comm):
        t = gs.ShardedTensor.from_offset("w", np.zeros((8, 6), np.float32), global_shape=(8, 6),
                                         global_offset=(0, 0))
        gs.load({"w": t}, tmp_path, comm=comm, shared_reads=True)

    assert run_ranks(3, load) == [None, None, None]
    assert len(os.listdir("/proc/self/fd")) <= before + 2
