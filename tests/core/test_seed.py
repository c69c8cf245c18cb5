"""The seed pull request's test list, each case through real TensorStore files.

Layouts are built the way Megatron-style trainers cut tensors; the core knows
nothing of TP, QKV or layers: only keys, boxes and segments.
"""

import itertools
import json
import os

import ml_dtypes
import numpy as np
import pytest

import globalshard as gs
from globalshard import Box, Segment, ShardedTensor

RNG = np.random.default_rng(1234)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def junk_like(shape, dtype):
    return np.full(shape, 77, dtype=dtype)


# ----------------------------------------------------------------------- layouts


def column_parallel(key, full, tp, *, axis=0, fill=True, dtype=None):
    """Rank r of TP holds rows (or columns) [r*n/tp, (r+1)*n/tp)."""
    dtype = dtype or full.dtype
    n = full.shape[axis] // tp
    out = {}
    for r in range(tp):
        sl = [slice(None)] * full.ndim
        sl[axis] = slice(r * n, (r + 1) * n)
        data = full[tuple(sl)].astype(dtype) if fill else junk_like(full[tuple(sl)].shape, dtype)
        offset = tuple(r * n if d == axis else 0 for d in range(full.ndim))
        out[f"{key}@tp{r}"] = ShardedTensor.from_offset(key, data, global_shape=full.shape, global_offset=offset)
    return out


def qkv_segments(r, tp, nq, nkv, hd):
    q, kv = nq * hd // tp, nkv * hd // tp
    return [Segment(0, r * q, q), Segment(q, nq * hd + r * kv, kv), Segment(q + kv, (nq + nkv) * hd + r * kv, kv)]


def packed(key, full, tp, segments_of, *, fill=True, dtype=None):
    """Rank r holds the concatenation of its segments (QKV, SwiGLU, LoRA-B)."""
    dtype = dtype or full.dtype
    out = {}
    for r in range(tp):
        segs = segments_of(r)
        local = np.concatenate([full[s.global_offset:s.global_offset + s.length] for s in segs]).astype(dtype)
        if not fill:
            local = junk_like(local.shape, dtype)
        out[f"{key}@tp{r}"] = ShardedTensor.from_segments(key, local, global_shape=full.shape, axis=0,
                                                          segments=segs)
    return out


def swiglu_segments(r, tp, ffn):
    f = ffn // tp
    return [Segment(0, r * f, f), Segment(f, ffn + r * f, f)]


def gather_packed(state, full_shape, dtype):
    """Reassemble the global array from loaded targets (independent of the library)."""
    out = np.full(full_shape, np.nan, dtype)
    for t in state.values():
        for r in t.regions:
            out[r.global_box.slices] = t.data[r.local_box.slices]
    return out


# ----------------------------------------------------------------------- TP planning


@pytest.mark.parametrize("src,dst", [(2, 4), (4, 2)])
def test_tp_resharding_plans_only_overlapping_reads(tmp_path, src, dst):
    full = rand(16, 6)
    gs.save(column_parallel("w", full, src), tmp_path)
    md = gs.read_metadata(tmp_path)
    targets = column_parallel("w", full, dst, fill=False)
    plan = gs.LoadPlanner().plan(md, [gs.ShardInfo.of(t) for t in targets.values()])
    stored = {r.path: r.box for r in md.tensors["w"].regions}
    for tp, target in zip(plan.targets, targets.values()):
        want = target.regions[0].global_box
        # Every read comes from a stored region that overlaps the target, and only those.
        read_from = {r.path for r in tp.reads}
        assert read_from == {p for p, b in stored.items() if b.intersect(want) is not None}
        assert len(tp.reads) == max(1, src // dst)
        assert sum(r.stored_box.volume for r in tp.reads) == want.volume
    stats = gs.IOStats()
    gs.load(targets, tmp_path, stats=stats)
    assert stats.bytes_needed == full.nbytes
    assert np.array_equal(gather_packed(targets, full.shape, np.float32), full)


def test_row_parallel_split_on_input_axis(tmp_path):
    full = rand(6, 16)
    gs.save(column_parallel("proj", full, 4, axis=1), tmp_path)
    targets = column_parallel("proj", full, 2, axis=1, fill=False)
    gs.load(targets, tmp_path)
    for r, t in enumerate(targets.values()):
        assert np.array_equal(t.data, full[:, r * 8:(r + 1) * 8])


def test_uneven_shards_with_explicit_offsets(tmp_path):
    full = rand(10, 3)
    cuts = [0, 3, 7, 10]
    state = {f"s{i}": ShardedTensor.from_offset("w", full[a:b].copy(), global_shape=(10, 3), global_offset=(a, 0))
             for i, (a, b) in enumerate(itertools.pairwise(cuts))}
    gs.save(state, tmp_path)
    assert [r.box.offset[0] for r in gs.read_metadata(tmp_path).tensors["w"].regions] == [0, 3, 7]
    targets = {f"t{i}": ShardedTensor.from_offset("w", junk_like((b - a, 3), np.float32), global_shape=(10, 3),
                                                  global_offset=(a, 0))
               for i, (a, b) in enumerate([(0, 5), (5, 9), (9, 10)])}
    gs.load(targets, tmp_path)
    for t in targets.values():
        off = t.regions[0].global_box.offset[0]
        assert np.array_equal(t.data, full[off:off + t.data.shape[0]])


def test_two_dimensional_cut(tmp_path):
    full = rand(8, 12)
    state = {f"{i}{j}": ShardedTensor.from_offset("w", full[i * 4:(i + 1) * 4, j * 3:(j + 1) * 3].copy(),
                                                  global_shape=full.shape, global_offset=(i * 4, j * 3))
             for i in range(2) for j in range(4)}
    gs.save(state, tmp_path)
    targets = {f"{j}": ShardedTensor.from_offset("w", junk_like((8, 4), np.float32), global_shape=full.shape,
                                                 global_offset=(0, j * 4)) for j in range(3)}
    gs.load(targets, tmp_path)
    for j, t in enumerate(targets.values()):
        assert np.array_equal(t.data, full[:, j * 4:(j + 1) * 4])


# ----------------------------------------------------------------------- packed layouts


# Every (heads, kv heads) with every TP change both can be cut by (kv heads divisible by TP).
QKV_CASES = [
    (nq, nkv, src, dst)
    for nq, nkv in [(8, 8), (8, 4), (8, 2)]
    for src, dst in [(2, 1), (1, 2), (2, 4), (4, 2), (4, 1), (1, 4)]
    if nkv % src == 0 and nkv % dst == 0
]


@pytest.mark.parametrize("nq,nkv,src,dst", QKV_CASES)
def test_packed_qkv_with_gqa_across_tp(tmp_path, nq, nkv, src, dst):
    hd, hidden = 2, 5
    full = rand((nq + 2 * nkv) * hd, hidden)
    gs.save(packed("qkv", full, src, lambda r: qkv_segments(r, src, nq, nkv, hd)), tmp_path)
    targets = packed("qkv", full, dst, lambda r: qkv_segments(r, dst, nq, nkv, hd), fill=False)
    gs.load(targets, tmp_path)
    for r, t in enumerate(targets.values()):
        expected = np.concatenate([full[s.global_offset:s.global_offset + s.length]
                                   for s in qkv_segments(r, dst, nq, nkv, hd)])
        assert np.array_equal(t.data, expected), f"rank {r}"
    # The stored form is the global [Q; K; V], whatever TP saved it.
    assert np.array_equal(gs.read_array(tmp_path, "qkv"), full)


@pytest.mark.parametrize("src,dst", [(2, 1), (1, 2)])
def test_packed_swiglu_gate_up(tmp_path, src, dst):
    ffn, hidden = 8, 3
    full = rand(2 * ffn, hidden)  # [gate; up]
    gs.save(packed("fc1", full, src, lambda r: swiglu_segments(r, src, ffn)), tmp_path)
    md = gs.read_metadata(tmp_path)
    assert [r.box.offset[0] for r in md.tensors["fc1"].regions] == [i * ffn // src for i in range(2 * src)]
    targets = packed("fc1", full, dst, lambda r: swiglu_segments(r, dst, ffn), fill=False)
    gs.load(targets, tmp_path)
    for r, t in enumerate(targets.values()):
        f = ffn // dst
        assert np.array_equal(t.data[:f], full[r * f:(r + 1) * f])            # gate_r
        assert np.array_equal(t.data[f:], full[ffn + r * f:ffn + (r + 1) * f])  # up_r


def test_packed_lora_b_of_swiglu_and_qkv_with_adam_moments(tmp_path):
    """LoRA-B shares the packed layout of the layer it adapts; Adam moments share the
    parameter's sharding with their own dtype (bf16 parameter, fp32 moments)."""
    ffn, rank, nq, nkv, hd = 4, 2, 4, 2, 2
    b_fc1 = rand(2 * ffn, rank).astype(ml_dtypes.bfloat16)
    b_qkv = rand((nq + 2 * nkv) * hd, rank).astype(ml_dtypes.bfloat16)
    m_fc1, v_fc1 = rand(2 * ffn, rank), np.abs(rand(2 * ffn, rank))
    src, dst = 2, 1
    state = {}
    state |= packed("lora_b.fc1", b_fc1, src, lambda r: swiglu_segments(r, src, ffn))
    state |= packed("lora_b.qkv", b_qkv, src, lambda r: qkv_segments(r, src, nq, nkv, hd))
    state |= packed("optim.exp_avg.lora_b.fc1", m_fc1, src, lambda r: swiglu_segments(r, src, ffn))
    state |= packed("optim.exp_avg_sq.lora_b.fc1", v_fc1, src, lambda r: swiglu_segments(r, src, ffn))
    gs.save(state, tmp_path)
    md = gs.read_metadata(tmp_path)
    assert md.tensors["lora_b.fc1"].dtype == "bfloat16"
    assert md.tensors["optim.exp_avg.lora_b.fc1"].dtype == "float32"
    targets = {}
    targets |= packed("lora_b.fc1", b_fc1, dst, lambda r: swiglu_segments(r, dst, ffn), fill=False)
    targets |= packed("lora_b.qkv", b_qkv, dst, lambda r: qkv_segments(r, dst, nq, nkv, hd), fill=False)
    targets |= packed("optim.exp_avg.lora_b.fc1", m_fc1, dst, lambda r: swiglu_segments(r, dst, ffn), fill=False)
    targets |= packed("optim.exp_avg_sq.lora_b.fc1", v_fc1, dst, lambda r: swiglu_segments(r, dst, ffn), fill=False)
    gs.load(targets, tmp_path)
    assert np.array_equal(targets["lora_b.fc1@tp0"].data, b_fc1)
    assert np.array_equal(targets["lora_b.qkv@tp0"].data, b_qkv)
    assert np.array_equal(targets["optim.exp_avg.lora_b.fc1@tp0"].data, m_fc1)
    assert np.array_equal(targets["optim.exp_avg_sq.lora_b.fc1@tp0"].data, v_fc1)


# ----------------------------------------------------------------------- PP / VPP


def layer_weights(n_layers, hidden=4):
    return {i: rand(hidden, hidden) for i in range(n_layers)}


def stage_state(weights, layers, fill=True):
    return {f"local{j}.w": ShardedTensor.from_offset(
        f"layers.{g}.w", weights[g].copy() if fill else junk_like(weights[g].shape, np.float32),
        global_shape=weights[g].shape, global_offset=(0, 0)) for j, g in enumerate(layers)}


def test_pp_stage_change_loads_only_that_stages_keys(tmp_path):
    weights = layer_weights(8)
    # PP=2 saves: stage 0 holds layers 0-3, stage 1 layers 4-7 (two "ranks" in one call).
    state = stage_state(weights, range(0, 4)) | {f"s1.{k}": v for k, v in stage_state(weights, range(4, 8)).items()}
    gs.save(state, tmp_path)
    # PP=4, stage 2: layers 4-5 only.
    targets = stage_state(weights, [4, 5], fill=False)
    plan = gs.LoadPlanner().plan(gs.read_metadata(tmp_path), [gs.ShardInfo.of(t) for t in targets.values()])
    assert {p.split("/")[3] for p in plan.arrays} == {"layers.4.w", "layers.5.w"}
    stats = gs.IOStats()
    gs.load(targets, tmp_path, stats=stats)
    assert stats.arrays == 2 and stats.bytes_needed == 2 * weights[4].nbytes
    assert np.array_equal(targets["local0.w"].data, weights[4])
    assert np.array_equal(targets["local1.w"].data, weights[5])


def interleaved_layers(pp, vpp, n_layers):
    """Global layer indices of (stage, chunk) under Megatron's interleaved schedule."""
    per_chunk = n_layers // (pp * vpp)
    return {(s, c): [(c * pp + s) * per_chunk + i for i in range(per_chunk)] for s in range(pp) for c in range(vpp)}


@pytest.mark.parametrize("src,dst", [((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 2), (4, 1)), ((4, 1), (2, 2))])
def test_vpp_layouts_load_through_global_layer_keys(tmp_path, src, dst):
    n_layers = 8
    weights = layer_weights(n_layers)
    state = {}
    for (s, c), layers in interleaved_layers(*src, n_layers).items():
        # The saving job names layers locally (chunk c, local index j); keys are global.
        for j, g in enumerate(layers):
            state[f"stage{s}.chunk{c}.layers.{j}"] = ShardedTensor.from_offset(
                f"layers.{g}.w", weights[g].copy(), global_shape=weights[g].shape, global_offset=(0, 0))
    gs.save(state, tmp_path, trainer_state={"parallel_config": {"pp": src[0], "vpp": src[1]}})
    seen = {}
    for (_, c), layers in interleaved_layers(*dst, n_layers).items():
        targets = {f"chunk{c}.layers.{j}": ShardedTensor.from_offset(
            f"layers.{g}.w", junk_like((4, 4), np.float32), global_shape=(4, 4), global_offset=(0, 0))
            for j, g in enumerate(layers)}
        ts = gs.load(targets, tmp_path)
        assert ts["parallel_config"] == {"pp": src[0], "vpp": src[1]}
        for j, g in enumerate(layers):
            assert np.array_equal(targets[f"chunk{c}.layers.{j}"].data, weights[g])
            seen[g] = True
    assert sorted(seen) == list(range(n_layers))


# ----------------------------------------------------------------------- padding and dtypes


def test_vocab_tail_padding(tmp_path):
    vocab, hidden = 10, 3
    full = rand(vocab, hidden)

    def vocab_parallel(tp, fill):
        per = -(-vocab // tp)  # padded vocab / tp
        out = {}
        for r in range(tp):
            local = junk_like((per, hidden), np.float32)
            if fill:
                real = full[r * per:(r + 1) * per]
                local[: len(real)] = real
            out[f"tp{r}"] = ShardedTensor.from_offset("emb", local, global_shape=(vocab, hidden),
                                                      global_offset=(r * per, 0), allow_padding=True)
        return out

    gs.save(vocab_parallel(4, True), tmp_path)  # 12 rows, 2 of padding, never stored
    md = gs.read_metadata(tmp_path)
    assert sum(r.box.volume for r in md.tensors["emb"].regions) == vocab * hidden
    targets = vocab_parallel(3, False)  # 4 rows per rank, 2 of padding on the last
    gs.load(targets, tmp_path)
    assert np.array_equal(np.concatenate([t.data for t in targets.values()])[:vocab], full)
    assert np.array_equal(targets["tp2"].data[2:], np.zeros((2, hidden), np.float32))  # padding zero-filled


def test_bf16_to_fp32_is_exact_and_fp32_to_bf16_needs_permission(tmp_path):
    full = rand(6, 4).astype(ml_dtypes.bfloat16)
    gs.save(column_parallel("w", full, 2), tmp_path / "bf16")
    targets = column_parallel("w", full, 3, dtype=np.float32, fill=False)
    gs.load(targets, tmp_path / "bf16")
    assert np.array_equal(np.concatenate([t.data for t in targets.values()]), full.astype(np.float32))

    full32 = rand(6, 4)
    gs.save(column_parallel("w", full32, 2), tmp_path / "fp32")
    narrow = column_parallel("w", full32, 1, dtype=ml_dtypes.bfloat16, fill=False)
    before = narrow["w@tp0"].data.copy()
    with pytest.raises(gs.CastError, match="allow_lossy_cast"):
        gs.load(narrow, tmp_path / "fp32")
    assert np.array_equal(narrow["w@tp0"].data, before)  # nothing touched
    gs.load(narrow, tmp_path / "fp32", allow_lossy_cast=True)
    assert np.array_equal(narrow["w@tp0"].data, full32.astype(ml_dtypes.bfloat16))


# ----------------------------------------------------------------------- metadata and trainer state


def test_metadata_and_trainer_state_round_trip(tmp_path):
    full = rand(4, 2).astype(ml_dtypes.bfloat16)
    trainer = {"step": 100, "consumed_samples": 6400, "model_config": {"hidden": 2},
               "parallel_config": {"tp": 2, "pp": 2, "vpp": 2, "dp": 1},
               "lr_scheduler": {"last_epoch": 100, "base_lrs": [0.001]}}
    gs.save(column_parallel("w", full, 2), tmp_path, trainer_state=trainer)
    md = gs.read_metadata(tmp_path)
    assert md.tensors["w"].global_shape == (4, 2) and md.tensors["w"].dtype == "bfloat16"
    doc = json.loads((tmp_path / "metadata.json").read_text())
    assert set(doc) == {"format", "version", "save_id", "tensors", "trainer_state"}  # no iteration, no configs
    assert "iteration" not in json.dumps(doc) and "parallel_config" not in json.dumps(doc)
    targets = column_parallel("w", full, 1, fill=False)
    assert gs.load(targets, tmp_path) == trainer


def test_load_without_trainer_state_returns_empty_dict(tmp_path):
    gs.save(column_parallel("w", rand(2, 2), 1), tmp_path)
    assert gs.load(column_parallel("w", rand(2, 2), 1, fill=False), tmp_path) == {}
    assert not os.path.exists(tmp_path / "trainer_state.json")


def test_rejections_reach_the_api(tmp_path):
    gs.save(column_parallel("w", rand(4, 2), 2), tmp_path)
    doc = json.loads((tmp_path / "metadata.json").read_text())
    doc["tensors"]["w"]["dtype"] = "fp8"
    (tmp_path / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(gs.MetadataError, match=r'\$\.tensors\["w"\]\.dtype'):
        gs.load(column_parallel("w", rand(4, 2), 1, fill=False), tmp_path)
    doc["tensors"]["w"]["dtype"] = "float32"
    doc["tensors"]["w"]["regions"][1]["offset"] = [2.0, 0]
    (tmp_path / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(gs.MetadataError, match=r"regions\[1\]\.offset\[0\]"):
        gs.read_metadata(tmp_path)
    with pytest.raises(gs.LayoutError, match="uncovered"):
        ShardedTensor.from_segments("qkv", rand(4, 2), global_shape=(8, 2), axis=0,
                                    segments=[Segment(0, 0, 1), Segment(2, 4, 2)])
    with pytest.raises(gs.LayoutError, match="overlap"):
        ShardedTensor.from_segments("qkv", rand(4, 2), global_shape=(8, 2), axis=0,
                                    segments=[Segment(0, 0, 3), Segment(2, 4, 2)])


def test_read_array_any_box_and_dtype(tmp_path):
    full = rand(9, 7)
    gs.save(column_parallel("w", full[:8], 4), tmp_path)
    got = gs.read_array(tmp_path, "w", Box((1, 2), (5, 3)))
    assert np.array_equal(got, full[1:6, 2:5])
    assert np.array_equal(gs.read_array(tmp_path, "w", (slice(3, 7), slice(None))), full[3:7])
    assert gs.read_array(tmp_path, "w", dtype="float64").dtype == np.float64
    with pytest.raises(gs.CastError):
        gs.read_array(tmp_path, "w", dtype="bfloat16")
    with pytest.raises(gs.MismatchError, match="outside the global shape"):
        gs.read_array(tmp_path, "w", Box((0, 0), (9, 7)))
    with pytest.raises(gs.MismatchError, match="similar keys"):
        gs.read_array(tmp_path, "W")


def test_zero_flat_partitions_save_and_load_into_tp(tmp_path):
    """Distributed-optimizer (ZeRO) state: each DP rank owns a flat slice of every
    parameter, cut with no regard for rows. It loads into a TP layout and back."""
    full = rand(6, 10)
    flat = full.ravel()
    bounds = [0, 13, 29, 41, 60]  # uneven, mid-row cuts over 4 DP ranks
    state = {}
    for d, (a, b) in enumerate(itertools.pairwise(bounds)):
        for i, t in enumerate(gs.shards_from_flat_range("exp_avg.w", flat[a:b].copy(), global_shape=full.shape,
                                                        start=a)):
            state[f"dp{d}.{i}"] = t
    gs.save(state, tmp_path)
    targets = column_parallel("exp_avg.w", full, 2, fill=False)
    gs.load(targets, tmp_path)
    assert np.array_equal(gather_packed(targets, full.shape, np.float32), full)
    # And back into another flat partition: the loaded views fill the flat buffers in place.
    flat_targets, buffers = {}, []
    for d, (a, b) in enumerate(itertools.pairwise([0, 30, 60])):
        buf = np.zeros(b - a, np.float32)
        buffers.append((a, b, buf))
        for i, t in enumerate(gs.shards_from_flat_range("exp_avg.w", buf, global_shape=full.shape, start=a)):
            flat_targets[f"dp{d}.{i}"] = t
    gs.load(flat_targets, tmp_path)
    for a, b, buf in buffers:
        assert np.array_equal(buf, flat[a:b])
