"""Megatron-Core's real tensors, against an independent slicer written from
Megatron-Core's own description of them (not from our rules)."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import globalshard as gs
import globalshard_torch as gt


def megatron_linear_qkv(q, k, v, num_heads, groups, tp, r):
    """Rank r's ``linear_qkv`` rows as Megatron-Core's SelfAttention holds
    them: the interleaved ``q1 q2 k1 v1 | q3 q4 k2 v2 | ...`` (each group's
    query heads, then its key head, then its value head) split evenly over
    TP, whole groups when TP divides the groups, a slice of one otherwise."""
    hn = k.shape[0] // groups
    qpg = num_heads // groups
    rows = []
    for g in range(groups):
        rows += [q[g * qpg * hn:(g + 1) * qpg * hn], k[g * hn:(g + 1) * hn], v[g * hn:(g + 1) * hn]]
    interleaved = np.concatenate(rows)
    n = interleaved.shape[0] // tp
    return interleaved[r * n:(r + 1) * n]


def blocked_qkv(q, k, v, tp, r, groups=None):
    """``[q_r; k_r; v_r]`` (PackedQKV's layout); with TP > kv heads, rank r
    holds kv head ``r // (tp / groups)`` whole (as vLLM replicates them)."""
    nq = q.shape[0] // tp
    if groups is not None and tp > groups:
        hd = k.shape[0] // groups
        g = r // (tp // groups)
        return np.concatenate([q[r * nq:(r + 1) * nq], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
    nk = k.shape[0] // tp
    return np.concatenate([q[r * nq:(r + 1) * nq], k[r * nk:(r + 1) * nk], v[r * nk:(r + 1) * nk]])


def shards(rule, locals_, tp, key="qkv"):
    out = {}
    for r, local in enumerate(locals_):
        placement = rule.place(tuple(local.shape), gt.ParallelLayout(tp_rank=r, tp_size=tp))
        t = torch.from_numpy(local)
        e = gt.Entry(f"r{r}", key, t, placement, True, t, r == 0)
        out.update(e.shards(f"r{r}", key, local))
    return out


@st.composite
def gqa(draw):
    groups = draw(st.sampled_from([1, 2, 4, 8]))
    num_heads = groups * draw(st.sampled_from([1, 2, 3]))
    hn = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 3))
    # Megatron-Core takes query groups that TP divides or that divide TP.
    tps = [t for t in (1, 2, 4, 8) if (groups % t == 0 or t % groups == 0) and ((num_heads + 2 * groups) * hn) % t == 0]
    # The blocked layout also takes TP above the kv heads (each kv head replicated).
    blocked = [t for t in (1, 2, 4, 8) if num_heads % t == 0 and (groups % t == 0 or t % groups == 0)]
    return num_heads, groups, hn, cols, draw(st.sampled_from(tps)), draw(st.sampled_from(tps)), \
        draw(st.sampled_from(blocked))


@given(gqa())
def test_megatron_qkv_is_stored_as_global_qkv_and_loads_into_any_tp_and_into_blocked(tmp_path_factory, case):
    num_heads, groups, hn, cols, tp_save, tp_load, tp_blocked = case
    rng = np.random.default_rng(num_heads * 100 + groups * 10 + hn)
    q = rng.standard_normal((num_heads * hn, cols)).astype(np.float32)
    k = rng.standard_normal((groups * hn, cols)).astype(np.float32)
    v = rng.standard_normal((groups * hn, cols)).astype(np.float32)
    rule = gt.MegatronQKV(num_heads, groups)
    path = tmp_path_factory.mktemp("qkv")
    gs.save(shards(rule, [megatron_linear_qkv(q, k, v, num_heads, groups, tp_save, r) for r in range(tp_save)],
                   tp_save), path, overwrite=True)
    assert np.array_equal(gs.read_array(path, "qkv"), np.concatenate([q, k, v]))  # plain, unfused global
    targets = shards(rule, [np.zeros_like(megatron_linear_qkv(q, k, v, num_heads, groups, tp_load, r))
                            for r in range(tp_load)], tp_load)
    gs.load(targets, path)
    for r in range(tp_load):
        assert np.array_equal(targets[f"r{r}"].data, megatron_linear_qkv(q, k, v, num_heads, groups, tp_load, r))
    locals_ = [np.zeros_like(blocked_qkv(q, k, v, tp_blocked, r, groups)) for r in range(tp_blocked)]
    gs.load(shards(gt.PackedQKV(num_heads, groups), locals_, tp_blocked), path)
    for r in range(tp_blocked):
        assert np.array_equal(locals_[r], blocked_qkv(q, k, v, tp_blocked, r, groups))


def test_megatron_qkv_refuses_what_megatron_core_refuses():
    import pytest

    with pytest.raises(gs.LayoutError, match="multiple or a divisor of the TP size"):
        gt.MegatronQKV(6, 3).place((6, 4), gt.ParallelLayout(tp_rank=0, tp_size=2))
    with pytest.raises(gs.LayoutError, match="do not split"):
        gt.MegatronQKV(6, 4).place((6, 4), gt.ParallelLayout())


def test_kv_heads_replicated_over_tp_are_stored_once_and_load_anywhere(tmp_path):
    # 8 query heads, 2 kv heads, TP=4 and TP=8: each kv head on 2 (4) ranks.
    num_heads, groups, hn, cols = 8, 2, 3, 2
    rng = np.random.default_rng(0)
    q = rng.standard_normal((num_heads * hn, cols)).astype(np.float32)
    k = rng.standard_normal((groups * hn, cols)).astype(np.float32)
    v = rng.standard_normal((groups * hn, cols)).astype(np.float32)
    rule = gt.PackedQKV(num_heads, groups)
    state = shards(rule, [blocked_qkv(q, k, v, 4, r, groups) for r in range(4)], 4)
    assert sorted(t.replica_id for t in state.values()) == [0] * 8 + [1] * 4  # 4 q parts, 2 kv heads x k, v
    gs.save(state, tmp_path / "c")
    assert np.array_equal(gs.read_array(tmp_path / "c", "qkv"), np.concatenate([q, k, v]))
    for tp in (8, 2, 1):
        locals_ = [np.zeros_like(blocked_qkv(q, k, v, tp, r, groups)) for r in range(tp)]
        gs.load(shards(rule, locals_, tp), tmp_path / "c")
        for r in range(tp):
            assert np.array_equal(locals_[r], blocked_qkv(q, k, v, tp, r, groups)), (tp, r)
