"""save(..., check_replicas=True): copies of one box of one key that ranks hold
(data-parallel replicas, a tensor every rank holds) are compared before
anything is written; copies that differ are refused on every rank, naming
the key, the box and which ranks hold which values, and nothing is committed.
Without it a save keeps one copy's values, silently (the default: checking
reads every byte once more)."""

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import globalshard as gs
from globalshard.checkpoint.replicas import differing_replicas, region_checksums
from globalshard.dtypes import numpy_dtype
from globalshard.testing.comm import run_ranks


def piece(key, data, offset, gshape, replica):
    return gs.ShardedTensor.from_offset(key, data, global_shape=gshape, global_offset=offset, replica_id=replica)


def dp_state(rank, drift=None):
    """TP=2 x DP=2 as ranks 0-3 (TP rank = rank % 2): each holds its half of the rows of "w" and all of
    "norm"; DP rank 1's copies are replicas, and so are TP rank 1's copies of "norm". ``drift``: the rank
    whose "w" is one ulp off in one element, as an all-reduce left out would leave it."""
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    tp, dp = rank % 2, rank // 2
    mine = w[4 * tp:4 * tp + 4].copy()
    if rank == drift:
        mine[1, 2] = np.nextafter(mine[1, 2], np.float32(np.inf))
    return {"w": piece("w", mine, (4 * tp, 0), (8, 4), dp),
            "norm": piece("norm", np.ones(4, np.float32), (0,), (4,), int(rank > 0))}


def test_drifted_replicas_are_refused_on_every_rank_and_nothing_is_committed(tmp_path):
    def save(comm):
        try:
            gs.save(dp_state(comm.rank, drift=3), tmp_path / "c", comm=comm, check_replicas=True)
        except gs.MismatchError as e:
            return str(e)
        return None

    messages = run_ranks(4, save)
    assert all(m is not None and m == messages[0] for m in messages), messages
    # Rank 3 (TP rank 1, DP rank 1) drifted from rank 1, the main copy of rows 4-8; nothing else differs.
    assert "'w' [4:8, 0:4]: copies differ, 2 values held by: rank 1 (main); rank 3" in messages[0]
    assert "'norm'" not in messages[0] and "[0:4, 0:4]" not in messages[0]
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


def test_equal_replicas_save_and_the_unchecked_default_keeps_one_copy_silently(tmp_path):
    run_ranks(4, lambda comm: gs.save(dp_state(comm.rank), tmp_path / "equal", comm=comm, check_replicas=True))
    assert np.array_equal(gs.read_array(tmp_path / "equal", "w"), np.arange(32, dtype=np.float32).reshape(8, 4))
    # What the check prevents: unchecked, the drifted copy may be the one written (the planner writes
    # whichever copy balances the bytes), so the checkpoint holds one of two values, unannounced.
    run_ranks(4, lambda comm: gs.save(dp_state(comm.rank, drift=3), tmp_path / "unchecked", comm=comm))
    stored = gs.read_array(tmp_path / "unchecked", "w")[4:8]
    assert any(np.array_equal(stored, dp_state(rank, drift=3)["w"].data) for rank in (1, 3))


def test_ranks_that_disagree_on_checking_are_refused(tmp_path):
    def save(comm):
        try:
            gs.save(dp_state(comm.rank), tmp_path / "c", comm=comm, check_replicas=comm.rank == 0)
        except (gs.LayoutError, gs.CommError) as e:
            return type(e).__name__, str(e)
        return None

    outcomes = run_ranks(2, save)
    assert all(o is not None and "different check_replicas values" in o[1] for o in outcomes), outcomes


def test_copies_in_one_process_are_compared_too(tmp_path):
    # One process holding every rank's pieces (as a conversion script or a test does).
    state = {f"{name}@{rank}": t for rank in range(4) for name, t in dp_state(rank, drift=2).items()}
    with pytest.raises(gs.MismatchError, match=r"'w' \[0:4, 0:4\]: copies differ, 2 values held by: rank 0 \(main\); "
                                               r"rank 0$"):
        gs.save(state, tmp_path / "c", check_replicas=True)
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


def test_every_dtype_and_a_zero_dimensional_copy_are_compared_bit_for_bit(tmp_path):
    for dtype in ("float32", "bfloat16", "float8_e4m3fn", "int64", "bool", "complex64"):
        value = np.ones((3,), numpy_dtype(dtype))
        other = value.copy()
        other.view(np.uint8)[-1] ^= 1  # one bit of the last element
        sums = region_checksums([("a", piece("k", value, (0,), (3,), 0)), ("b", piece("k", other, (0,), (3,), 1))])
        with pytest.raises(gs.MismatchError, match="'k' \\[0:3\\]"):
            differing_replicas([sums])
    scalar = region_checksums([("a", piece("s", np.array(1.5, np.float32), (), (), 0)),
                               ("b", piece("s", np.array(-0.0, np.float32), (), (), 1))])
    with pytest.raises(gs.MismatchError, match=r"'s' \[\]: copies differ"):
        differing_replicas([scalar])


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 2), st.integers(0, 3), st.integers(0, 3)),
                min_size=1, max_size=30), st.integers(1, 4))
def test_a_box_is_refused_exactly_when_its_copies_hold_more_than_one_value(held, ranks):
    # (key, box start, value, rank): copies of the box [start, start + 2) of key, each holding a value.
    per_rank = [[] for _ in range(ranks)]
    values = {}
    for key, start, value, rank in held:
        per_rank[rank % ranks].append([key, [start], [2], value, len(per_rank[rank % ranks])])
        values.setdefault((key, start), set()).add(value)
    differ = sorted(f"'{k}' [{s}:{s + 2}]" for (k, s), v in values.items() if len(v) > 1)
    if not differ:
        differing_replicas(per_rank)
        return
    with pytest.raises(gs.MismatchError) as e:
        differing_replicas(per_rank)
    lines = str(e.value).splitlines()[1:]
    assert all(line.startswith("  - ") for line in lines)
    named = sorted(line[4:].split(": copies differ")[0] for line in lines)
    assert named == differ
