import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from globalshard import Box, GlobalShardError, LayoutError, Region, Segment, ShardedStateDict, ShardedTensor


def test_from_offset_plain_and_dtype_name():
    t = ShardedTensor.from_offset("w", np.zeros((2, 3), ml_dtypes.bfloat16), global_shape=(4, 3),
                                  global_offset=(2, 0))
    assert t.dtype == "bfloat16"
    assert t.regions == (Region(Box((0, 0), (2, 3)), Box((2, 0), (2, 3))),)
    assert t.global_shape == (4, 3) and t.replica_id == 0


def test_from_offset_outside_global_needs_padding():
    data = np.zeros((4, 3), np.float32)
    with pytest.raises(LayoutError, match="allow_padding"):
        ShardedTensor.from_offset("emb", data, global_shape=(10, 3), global_offset=(8, 0))
    t = ShardedTensor.from_offset("emb", data, global_shape=(10, 3), global_offset=(8, 0), allow_padding=True)
    assert t.regions[0].global_box == Box((8, 0), (2, 3))
    # A rank whose whole shard is padding holds no region.
    t = ShardedTensor.from_offset("emb", data, global_shape=(10, 3), global_offset=(12, 0), allow_padding=True)
    assert t.regions == ()


def test_from_segments_qkv_gqa():
    # 4 q heads, 2 kv heads, head dim 1, TP=2, rank 1: [q1; k1; v1]
    t = ShardedTensor.from_segments("qkv", np.zeros((4, 5), np.float32), global_shape=(8, 5), axis=0,
                                    segments=[Segment(0, 2, 2), Segment(2, 5, 1), Segment(3, 7, 1)])
    assert [str(r.global_box) for r in t.regions] == ["[2:4, 0:5]", "[5:6, 0:5]", "[7:8, 0:5]"]
    assert [str(r.local_box) for r in t.regions] == ["[0:2, 0:5]", "[2:3, 0:5]", "[3:4, 0:5]"]


def test_from_segments_on_axis_1_with_offset_on_axis_0():
    t = ShardedTensor.from_segments("w", np.zeros((2, 4)), global_shape=(4, 8), axis=1,
                                    segments=[(0, 6, 2), (2, 0, 2)], global_offset=(2, 0))
    assert [str(r.global_box) for r in t.regions] == ["[2:4, 6:8]", "[2:4, 0:2]"]


@pytest.mark.parametrize("segments,match", [
    ([(0, 0, 2), (3, 2, 1)], "uncovered"),           # local gap
    ([(0, 0, 2), (1, 2, 3)], "overlaps"),            # local overlap
    ([(0, 0, 2), (2, 1, 2)], "overlap globally"),    # global overlap
    ([(0, 0, 2), (2, 7, 2)], "beyond the global size"),
    ([(0, 0, 2)], "allow_padding"),                  # local tail not covered
])
def test_from_segments_rejects(segments, match):
    with pytest.raises(LayoutError, match=match):
        ShardedTensor.from_segments("k", np.zeros((4, 2)), global_shape=(8, 2), axis=0, segments=segments)


def test_from_segments_rejects_offset_on_segment_axis_and_bad_axis():
    with pytest.raises(LayoutError, match="global_offset"):
        ShardedTensor.from_segments("k", np.zeros((2, 2)), global_shape=(4, 2), axis=0,
                                    segments=[(0, 0, 2)], global_offset=(1, 0))
    with pytest.raises(LayoutError, match="axis"):
        ShardedTensor.from_segments("k", np.zeros((2, 2)), global_shape=(4, 2), axis=2, segments=[(0, 0, 2)])


def test_plain_constructor_checks_regions():
    data = np.zeros((4,))
    ok = ShardedTensor("k", data, (8,), (Region(Box((0,), (2,)), Box((6,), (2,))),
                                         Region(Box((2,), (2,)), Box((0,), (2,)))))
    assert len(ok.regions) == 2
    with pytest.raises(LayoutError, match="outside the local data shape"):
        ShardedTensor("k", data, (8,), (Region(Box((3,), (2,)), Box((0,), (2,))),))
    with pytest.raises(LayoutError, match="outside the global shape"):
        ShardedTensor("k", data, (8,), (Region(Box((0,), (4,)), Box((6,), (4,))),))
    with pytest.raises(LayoutError, match="outside every region"):
        ShardedTensor("k", data, (8,), (Region(Box((0,), (2,)), Box((0,), (2,))),))


def test_bad_inputs_are_layout_errors():
    with pytest.raises(LayoutError, match="numpy array"):
        ShardedTensor.from_offset("k", [1.0, 2.0], global_shape=(2,), global_offset=(0,))
    with pytest.raises(LayoutError, match="unsupported dtype"):
        ShardedTensor.from_offset("k", np.array(["a"]), global_shape=(1,), global_offset=(0,))
    with pytest.raises(LayoutError, match="non-empty string"):
        ShardedTensor.from_offset("", np.zeros(1), global_shape=(1,), global_offset=(0,))
    with pytest.raises(LayoutError, match="replica_id"):
        ShardedTensor.from_offset("k", np.zeros(1), global_shape=(1,), global_offset=(0,), replica_id=-1)
    with pytest.raises(LayoutError, match="dims"):
        ShardedTensor.from_offset("k", np.zeros(1), global_shape=(1, 1), global_offset=(0, 0))
    assert issubclass(LayoutError, GlobalShardError) and issubclass(LayoutError, ValueError)


def test_zero_d_and_zero_size():
    s = ShardedTensor.from_offset("s", np.array(3.0), global_shape=(), global_offset=())
    assert s.regions == (Region(Box((), ()), Box((), ())),)
    e = ShardedTensor.from_offset("e", np.zeros((0, 3)), global_shape=(0, 3), global_offset=(0, 0))
    assert e.regions == ()


def test_sharded_tensor_is_frozen():
    t = ShardedTensor.from_offset("w", np.zeros(2), global_shape=(2,), global_offset=(0,))
    with pytest.raises(AttributeError):
        t.key = "v"  # type: ignore[misc]


def test_state_dict_merge_and_validation():
    a = ShardedStateDict({"a": ShardedTensor.from_offset("w", np.zeros(2), global_shape=(4,), global_offset=(0,))})
    b = ShardedStateDict({"b": ShardedTensor.from_offset("w", np.zeros(2), global_shape=(4,), global_offset=(2,))})
    m = a.merge(b)
    assert list(m) == ["a", "b"] and len(a) == 1
    with pytest.raises(LayoutError, match="present in both"):
        m.merge(a)
    with pytest.raises(LayoutError, match="not a ShardedTensor"):
        ShardedStateDict({"x": np.zeros(2)})
    with pytest.raises(LayoutError, match="appears twice"):
        ShardedStateDict([("a", a["a"]), ("a", a["a"])])


@given(st.data())
def test_flat_ranges_of_segmented_local_tensors_cover_the_global_array_exactly(data):
    # Each of `tp` ranks holds [a_r; b_r; padding] of a global [A; B] (a fused,
    # padded layout); a distributed optimizer cuts each rank's flattened local
    # tensor into DP ranges at arbitrary points. Saved under one cut, loaded
    # under another, every element comes back; padding is neither saved nor read.
    import tempfile

    import globalshard as gs
    from globalshard.geometry import Region

    tp = data.draw(st.integers(1, 3))
    rows_a, rows_b, cols, pad = (data.draw(st.integers(1, 3)) * tp, data.draw(st.integers(1, 3)) * tp,
                                 data.draw(st.integers(1, 4)), data.draw(st.integers(0, 2)))
    full = np.arange((rows_a + rows_b) * cols, dtype=np.float32).reshape(rows_a + rows_b, cols)
    na, nb = rows_a // tp, rows_b // tp
    local_shape = (na + nb + pad, cols)

    def regions(r):
        return [Region(Box((0, 0), (na, cols)), Box((r * na, 0), (na, cols))),
                Region(Box((na, 0), (nb, cols)), Box((rows_a + r * nb, 0), (nb, cols)))]

    def local(r):
        out = np.full(local_shape, -1, np.float32)
        out[:na], out[na:na + nb] = full[r * na:(r + 1) * na], full[rows_a + r * nb:rows_a + (r + 1) * nb]
        return out.reshape(-1)

    def cuts():
        n = local_shape[0] * cols
        points = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})
        return list(itertools.pairwise(points))

    state = {}
    for r in range(tp):
        flat = local(r)
        for k, (a, b) in enumerate(cuts()):
            piece = flat[a:b].copy()
            for i, t in enumerate(gs.shards_from_flat_range("w", piece, global_shape=full.shape, start=a,
                                                            local_shape=local_shape, regions=regions(r))):
                assert np.shares_memory(t.data, piece)  # views of the rank's own piece: nothing gathered
                state[f"{r}.{k}.{i}"] = t
    with tempfile.TemporaryDirectory() as d:
        gs.save(state, d)
        assert np.array_equal(gs.read_array(d, "w"), full)
        for r in range(tp):
            want = local(r)
            for a, b in cuts():
                got = np.full(b - a, 7, np.float32)
                targets = {f"t{i}": t for i, t in enumerate(gs.shards_from_flat_range(
                    "w", got, global_shape=full.shape, start=a, local_shape=local_shape, regions=regions(r)))}
                gs.load(targets, d)
                real = want[a:b] != -1  # padding elements keep what they held
                assert np.array_equal(got[real], want[a:b][real]) and (got[~real] == 7).all()


@given(data=st.data())
def test_overlaps_itself_is_true_exactly_when_two_elements_share_bytes(data):
    from globalshard.layout import overlaps_itself

    ndim = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    itemsize = data.draw(st.sampled_from([1, 2, 4, 8]))
    strides = tuple(data.draw(st.lists(st.integers(-3, 12), min_size=ndim, max_size=ndim)))
    strides = tuple(s * itemsize for s in strides)
    # A buffer that every element lies in, and a view of it starting where negative strides stay inside.
    low = sum(s * (n - 1) for s, n in zip(strides, shape) if s < 0 and n)
    high = sum(s * (n - 1) for s, n in zip(strides, shape) if s > 0 and n)
    buf = np.zeros(high - low + itemsize, np.uint8)
    view = np.lib.stride_tricks.as_strided(buf[-low:].view(f"V{itemsize}"), shape, strides)
    offsets = [sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))]
    starts = sorted(offsets)
    shares = any(b - a < itemsize for a, b in itertools.pairwise(starts))
    assert overlaps_itself(view) == shares, (shape, strides, itemsize)


def test_a_load_into_a_broadcast_view_is_refused_naming_its_key(tmp_path):
    import globalshard as gs

    full = np.arange(6, dtype=np.float32).reshape(2, 3)
    gs.save({"w": ShardedTensor.from_offset("w", full, global_shape=(2, 3), global_offset=(0, 0))}, tmp_path / "c")
    row = np.zeros(3, np.float32)
    target = np.lib.stride_tricks.as_strided(row, (2, 3), (0, 4), writeable=True)
    # Before, the load returned with the last row in both: [3, 4, 5].
    with pytest.raises(LayoutError, match=r"elements share memory .*\['w'\]"):
        gs.load({"w": ShardedTensor.from_offset("w", target, global_shape=(2, 3), global_offset=(0, 0))},
                tmp_path / "c")
    assert row.tolist() == [0, 0, 0]
    strided = np.zeros((2, 6), np.float32)[:, ::2]  # gaps, no overlap: loads
    gs.load({"w": ShardedTensor.from_offset("w", strided, global_shape=(2, 3), global_offset=(0, 0))}, tmp_path / "c")
    assert np.array_equal(strided, full)
