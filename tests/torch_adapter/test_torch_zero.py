"""Distributed optimizers: Megatron-Core's DistributedOptimizer layout and
torch's ZeroRedundancyOptimizer, saved and loaded across DP, TP and PP changes,
into plain optimizers and back. The ranks run as threads with a real
communicator (every save/load code path is the multi-rank one), and ZeRO over
gloo processes."""

import itertools
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch_harness import run, values_of

import globalshard as gs
import globalshard_torch as gt
from globalshard.testing.comm import run_ranks

VOCAB, H, HEADS, KV, HD, LAYERS = 10, 4, 8, 4, 2, 2
QKV_ROWS = (HEADS + 2 * KV) * HD
RULES = gt.ShardingRules([
    (r"embedding\.weight", gt.VocabParallel(VOCAB)),
    (r"layers\.\d+\.qkv\.weight", gt.PackedQKV(HEADS, KV)),
    (r"layers\.\d+\.proj\.weight", gt.RowParallel()),
    (r"layers\.\d+\.norm\.weight", gt.Replicated()),
])
ITEMS = ("exp_avg", "exp_avg_sq", "master")


# ----------------------------------------------------------------------- Megatron's buffer layout


@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.sampled_from([1, 2, 3, 4, 8]),
       st.none() | st.integers(1, 500))
def test_megatron_ranges_partition_every_parameter_exactly(sizes, dp, bucket_size):
    params = [torch.zeros(n) for n in sizes]
    covered = {id(p): np.zeros(p.numel(), int) for p in params}
    for r in range(dp):
        for p, start, stop in gt.megatron_param_ranges(params, dp_size=dp, dp_rank=r, bucket_size=bucket_size):
            covered[id(p)][start:stop] += 1
    assert all((c == 1).all() for c in covered.values())


def test_megatron_ranges_pad_params_to_64_and_buckets_to_lcm_dp_128():
    a, b, c = torch.zeros(100), torch.zeros(70), torch.zeros(5)
    # Reversed: c [0, 5), b [64, 134) -> bucket full (bucket_size 100), its end padded to 384
    # (lcm(3, 128)); a [384, 484) in a second bucket, padded to 768. Each of 3 ranks owns a third
    # of each bucket: rank 0 [0, 128) and [384, 512), rank 1 [128, 256) and [512, 640), rank 2 the rest.
    owned = [gt.megatron_param_ranges([a, b, c], dp_size=3, dp_rank=r, bucket_size=100) for r in range(3)]
    named = [[({id(a): "a", id(b): "b", id(c): "c"}[id(p)], s, e) for p, s, e in o] for o in owned]
    assert named == [[("c", 0, 5), ("b", 0, 64), ("a", 0, 100)], [("b", 64, 70)], []]


# ----------------------------------------------------------------------- a model, sliced independently


class Layer(nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.qkv = nn.Linear(H, QKV_ROWS // tp, bias=False)
        self.proj = nn.Linear(HEADS * HD // tp, H, bias=False)
        self.norm = nn.LayerNorm(H, bias=False)


class Model(nn.Module):
    def __init__(self, tp, layers, vocab_rows=None):
        super().__init__()
        self.embedding = nn.Embedding(vocab_rows or -(-VOCAB // tp), H)
        self.layers = nn.ModuleList(Layer(tp) for _ in range(layers))


def reference(seed):
    rng = np.random.default_rng(seed)
    shapes = {"embedding.weight": (VOCAB, H)}
    for n in range(LAYERS):
        shapes |= {f"layers.{n}.qkv.weight": (QKV_ROWS, H), f"layers.{n}.proj.weight": (H, HEADS * HD),
                   f"layers.{n}.norm.weight": (H,)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def local_slice(key, g, tp, r, pad=None, rows=None):
    """Rank r's local tensor of global g, written from the rules' definitions: the
    vocabulary (``rows`` a rank, by default the fewest that hold it) has its padding
    rows zero, or the first rows of ``pad`` (a #padding companion)."""
    if key.startswith("embedding"):
        rows = rows or -(-VOCAB // tp)
        full = np.zeros((rows * tp, H), np.float32)
        full[:VOCAB] = g
        if pad is not None:
            n = min(len(pad), rows * tp - VOCAB)
            full[VOCAB:VOCAB + n] = pad[:n]
        return full[r * rows:(r + 1) * rows]
    if key.endswith("qkv.weight"):
        q, kv = HEADS * HD // tp, KV * HD // tp
        return np.concatenate([g[r * q:(r + 1) * q], g[HEADS * HD + r * kv:HEADS * HD + (r + 1) * kv],
                               g[(HEADS + KV) * HD + r * kv:(HEADS + KV) * HD + (r + 1) * kv]])
    if key.endswith("proj.weight"):
        n = g.shape[1] // tp
        return g[:, r * n:(r + 1) * n]
    return g


def build(tp, pp, tp_rank, pp_rank, dp_rank=0, dp=1, fill=None, vocab_rows=None):
    layout = gt.ParallelLayout(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, dp_rank=dp_rank,
                               dp_size=dp, num_layers=LAYERS)
    model = Model(tp, LAYERS // pp, vocab_rows)
    if pp > 1 and pp_rank > 0:
        del model.embedding  # the embedding lives on the first stage
    if fill is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                key = layout.global_name(name, 0)
                p.copy_(torch.from_numpy(local_slice(key, fill[key], tp, tp_rank, rows=vocab_rows)))
    return layout, model


def keyed_params(layout, model):
    return [(layout.global_name(n, 0), p) for n, p in model.named_parameters()]


def do_shards(layout, model, moments, bucket_size, empty=False, pads=None):
    """This rank's Megatron-style pieces of every moment, from the global moments (and
    the embedding's padding rows of each, ``pads``)."""
    key_of = {id(p): k for k, p in keyed_params(layout, model)}
    pieces = []
    for p, start, stop in gt.megatron_param_ranges([p for _, p in keyed_params(layout, model)],
                                                   dp_size=layout.dp_size, dp_rank=layout.dp_rank,
                                                   bucket_size=bucket_size):
        key = key_of[id(p)]
        state = {}
        for item in ITEMS:
            pad = None if pads is None else pads[item]
            rows = p.shape[0] if key.startswith("embedding") else None
            local = local_slice(key, moments[item][key], layout.tp_size, layout.tp_rank, pad, rows)
            flat = local.reshape(-1)[start:stop]
            state[item] = torch.zeros(stop - start) if empty else torch.from_numpy(flat.copy())
        state["step"] = torch.tensor(0.0 if empty else 3.0)
        pieces.append(gt.FlatShard(p, start, stop, state))
    return pieces


def topology(tp, pp, dp):
    return [(t, s, d) for d, s, t in itertools.product(range(dp), range(pp), range(tp))]


@pytest.mark.parametrize("save,load", [((2, 2, 4), (4, 1, 2)), ((4, 1, 2), (2, 2, 4)), ((2, 1, 3), (1, 1, 5))],
                         ids=["tp2pp2dp4-to-tp4dp2", "tp4dp2-to-tp2pp2dp4", "tp2dp3-to-dp5"])
def test_distributed_optimizer_state_reshards_across_dp_tp_and_pp(tmp_path, save, load):
    weights = reference(1)
    moments = {item: reference(10 + i) for i, item in enumerate(ITEMS)}
    hparams = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.003, betas=(0.8, 0.95))
    tp, pp, dp = save

    def save_rank(comm):
        t, s, d = topology(tp, pp, dp)[comm.rank]
        layout, model = build(tp, pp, t, s, d, dp, fill=weights)
        gt.save_checkpoint(tmp_path / "c", model=model, layout=layout, rules=RULES, comm=comm, optimizer=hparams,
                           optimizer_shards=do_shards(layout, model, moments, bucket_size=150))

    assert all(r is None for r in run_ranks(tp * pp * dp, save_rank)), "a saving rank failed"
    for item in ITEMS:
        for key, g in moments[item].items():
            assert np.array_equal(gs.read_array(tmp_path / "c", f"optimizer.{item}.{key}"), g), (item, key)
    assert float(gs.read_array(tmp_path / "c", f"optimizer.step.{next(iter(weights))}")) == 3.0

    tp, pp, dp = load

    def load_rank(comm):
        t, s, d = topology(tp, pp, dp)[comm.rank]
        layout, model = build(tp, pp, t, s, d, dp)
        pieces = do_shards(layout, model, moments, bucket_size=100, empty=True)
        inner = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.5)
        gt.load_checkpoint(tmp_path / "c", model=model, layout=layout, rules=RULES, comm=comm, optimizer=inner,
                           optimizer_shards=pieces)
        wrong = [f"{k}: weights" for k, p in keyed_params(layout, model)
                 if not np.array_equal(p.detach().numpy(), local_slice(k, weights[k], tp, t))]
        want = do_shards(layout, model, moments, bucket_size=100)
        for got, exp in zip(pieces, want):
            for item in (*ITEMS, "step"):
                if not torch.equal(got.state[item], exp.state[item]):
                    wrong.append(f"{item} [{got.start}, {got.stop})")
        if inner.param_groups[0]["lr"] != 0.003 or inner.param_groups[0]["betas"] != (0.8, 0.95):
            wrong.append("hyper-parameters")
        return wrong

    assert run_ranks(tp * pp * dp, load_rank) == [[]] * (tp * pp * dp)


@settings(max_examples=25)
@given(st.sampled_from([(4, 1, 1), (4, 2, 1), (2, 2, 4), (2, 1, 1), (1, 2, 4)]),
       st.sampled_from([(4, 1, 1), (4, 2, 4), (2, 1, 1), (2, 2, 4), (1, 2, 1)]),
       st.none() | st.integers(20, 200), st.none() | st.integers(20, 200))
def test_a_distributed_optimizers_vocabulary_padding_rows_keep_their_state(save, load, save_bucket, load_bucket):
    """Megatron-Core trains its vocabulary's padding rows (the loss runs over them), so
    their Adam state is not zero: a distributed optimizer's pieces keep it in each
    key's #padding companion, and a load on a layout that pads takes the rows it
    shares with the saving layout's padding, the rest zero (spec section 1).
    Layouts are (TP, DP, d): the vocabulary of 10 padded to a multiple of d x TP, as
    Megatron's make_vocab_size_divisible_by pads it (none to 6 padding rows)."""
    moments = {item: reference(40 + i) for i, item in enumerate(ITEMS)}

    def rows(tp, d):  # a rank's rows
        return -(-VOCAB // (d * tp)) * d

    tp, dp, d = save
    rng = np.random.default_rng(7)
    pads = {item: rng.standard_normal((rows(tp, d) * tp - VOCAB, H)).astype(np.float32) for item in ITEMS}
    with tempfile.TemporaryDirectory() as tmp:
        def save_rank(comm):
            t, s, r = topology(tp, 1, dp)[comm.rank]
            layout, model = build(tp, 1, t, s, r, dp, fill=reference(1), vocab_rows=rows(tp, d))
            gt.save_checkpoint(tmp, model=model, layout=layout, rules=RULES, comm=comm, overwrite=True,
                               optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(1))]),
                               optimizer_shards=do_shards(layout, model, moments, save_bucket, pads=pads))

        assert all(r is None for r in run_ranks(tp * dp, save_rank)), "a saving rank failed"
        stored = gs.read_metadata(tmp).tensors
        for item in ITEMS:
            key = f"optimizer.{item}.embedding.weight#padding"
            assert np.array_equal(gs.read_array(tmp, key), pads[item]) if len(pads[item]) else key not in stored

        def load_rank(comm, tp=load[0], dp=load[1], d=load[2]):
            t, s, r = topology(tp, 1, dp)[comm.rank]
            layout, model = build(tp, 1, t, s, r, dp, vocab_rows=rows(tp, d))
            pieces = do_shards(layout, model, moments, load_bucket, empty=True)
            for piece in pieces:  # what a load must overwrite, padding rows included
                for item in ITEMS:
                    piece.state[item].fill_(5.0)
            gt.load_checkpoint(tmp, model=model, layout=layout, rules=RULES, comm=comm, optimizer_shards=pieces,
                               optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(1))]))
            want = do_shards(layout, model, moments, load_bucket, pads=pads)
            return [f"{item} [{got.start}, {got.stop})" for got, exp in zip(pieces, want) for item in ITEMS
                    if not torch.equal(got.state[item], exp.state[item])]

        assert run_ranks(load[0] * load[1], load_rank) == [[]] * (load[0] * load[1])


def test_distributed_optimizer_and_plain_adamw_load_each_other(tmp_path):
    weights = reference(2)
    moments = {item: reference(20 + i) for i, item in enumerate(ITEMS)}
    # A plain AdamW at TP=1, DP=1 (master weights as "master"), saved...
    layout, model = build(1, 1, 0, 0, fill=weights)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(masters.values()), lr=0.02)
    for name, m in masters.items():
        key = layout.global_name(name, 0)
        opt.state[m] = {"exp_avg": torch.from_numpy(moments["exp_avg"][key].copy()),
                        "exp_avg_sq": torch.from_numpy(moments["exp_avg_sq"][key].copy()),
                        "step": torch.tensor(3.0)}
        m.data.copy_(torch.from_numpy(moments["master"][key]))
    gt.save_checkpoint(tmp_path / "plain", model=model, layout=layout, rules=RULES, optimizer=opt,
                       master_params=masters)

    # ... loads into a distributed optimizer at TP=2, DP=2 ...
    def load_rank(comm):
        t, s, d = topology(2, 1, 2)[comm.rank]
        lay, m = build(2, 1, t, s, d, 2)
        pieces = do_shards(lay, m, moments, bucket_size=None, empty=True)
        gt.load_checkpoint(tmp_path / "plain", model=m, layout=lay, rules=RULES, comm=comm,
                           optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), optimizer_shards=pieces)
        want = do_shards(lay, m, moments, bucket_size=None)
        bad = [f"{it} of [{g.start},{g.stop})" for g, w in zip(pieces, want) for it in (*ITEMS, "step")
               if not torch.equal(g.state[it], w.state[it])]
        gt.save_checkpoint(tmp_path / "dist", model=m, layout=lay, rules=RULES, comm=comm, optimizer_shards=pieces,
                           optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.02))
        return bad

    assert run_ranks(4, load_rank) == [[]] * 4
    # ... and back into the plain AdamW.
    layout, model = build(1, 1, 0, 0)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(masters.values()), lr=0.5)
    gt.load_checkpoint(tmp_path / "dist", model=model, layout=layout, rules=RULES, optimizer=opt,
                       master_params=masters)
    for name, m in masters.items():
        key = layout.global_name(name, 0)
        assert np.array_equal(opt.state[m]["exp_avg_sq"].numpy(), moments["exp_avg_sq"][key]), key
        assert np.array_equal(m.detach().numpy(), moments["master"][key]), key
    assert opt.param_groups[0]["lr"] == 0.02




def test_zero_redundancy_optimizer_saves_its_partitions_and_loads_anywhere(tmp_path):
    ckpt = str(tmp_path / "c")
    held = values_of(run(2, "zero_save_job", str(tmp_path / "s"), path=ckpt))[0]
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    gt.load_checkpoint(ckpt, model=model, layout=gt.ParallelLayout(), rules=gt.ShardingRules([(".*", gt.Replicated())]),
                       optimizer=opt)
    for name, p in model.named_parameters():
        assert np.array_equal(p.detach().numpy(), np.array(held["params"][name], np.float32)), name
        assert np.array_equal(opt.state[p]["exp_avg_sq"].numpy(), np.array(held["exp_avg_sq"][name], np.float32))
    assert opt.param_groups[0]["lr"] == 0.01
    # And back into ZeRO, on 2 ranks: each rank gets its own partition's state.
    for r in values_of(run(2, "zero_load_job", str(tmp_path / "l"), path=ckpt, expect=held)):
        assert r == [], r


def test_distributed_optimizer_over_gloo_loads_into_one_plain_adamw(tmp_path):
    ckpt = str(tmp_path / "c")
    values_of(run(4, "do_save_job", str(tmp_path / "s"), path=ckpt))
    moments = {item: reference(30 + i) for i, item in enumerate(ITEMS)}
    layout, model = build(1, 1, 0, 0)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(list(masters.values()), lr=0.5)
    gt.load_checkpoint(ckpt, model=model, layout=layout, rules=RULES, optimizer=opt, master_params=masters)
    for name, m in masters.items():
        key = layout.global_name(name, 0)
        assert np.array_equal(opt.state[m]["exp_avg"].numpy(), moments["exp_avg"][key]), key
        assert np.array_equal(m.detach().numpy(), moments["master"][key]), key
        assert float(opt.state[m]["step"]) == 3.0
    assert np.array_equal(model.embedding.weight.detach().numpy(), reference(3)["embedding.weight"])
    assert opt.param_groups[0]["lr"] == 0.004


def test_replicated_kv_heads_with_plain_and_distributed_optimizer_state(tmp_path):
    # 4 query heads, 1 kv head, head dim 2, hidden 3, TP=2: the kv head lives on both TP ranks.
    rule = gt.ShardingRules([(r"qkv\.weight", gt.PackedQKV(4, 1))])
    rng = np.random.default_rng(5)
    glob = {name: rng.standard_normal((12, 3)).astype(np.float32) for name in ("w", "exp_avg", "master")}

    def local(g, r):
        return np.concatenate([g[r * 4:(r + 1) * 4], g[8:10], g[10:12]])  # q_r (2 heads), k, v

    def run_rank(comm, distributed):
        tp_rank, dp_rank = comm.rank % 2, comm.rank // 2
        layout = gt.ParallelLayout(tp_rank=tp_rank, tp_size=2, dp_rank=dp_rank, dp_size=comm.world_size // 2)
        model = nn.Module()
        model.qkv = nn.Linear(3, 8, bias=False)
        with torch.no_grad():
            model.qkv.weight.copy_(torch.from_numpy(local(glob["w"], tp_rank)))
        hp = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.01)
        if distributed:
            pieces = [gt.FlatShard(p, s, e, {it: torch.from_numpy(local(glob[it], tp_rank).reshape(-1)[s:e].copy())
                                             for it in ("exp_avg", "master")})
                      for p, s, e in gt.megatron_param_ranges([model.qkv.weight], dp_size=layout.dp_size,
                                                              dp_rank=dp_rank)]
            gt.save_checkpoint(tmp_path / "d", model=model, layout=layout, rules=rule, comm=comm, optimizer=hp,
                               optimizer_shards=pieces)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            opt.state[model.qkv.weight] = {"exp_avg": torch.from_numpy(local(glob["exp_avg"], tp_rank))}
            gt.save_checkpoint(tmp_path / "p", model=model, layout=layout, rules=rule, comm=comm, optimizer=opt)

    assert run_ranks(2, lambda c: run_rank(c, False)) == [None, None]
    assert run_ranks(4, lambda c: run_rank(c, True)) == [None] * 4
    for ckpt, items in (("p", ("exp_avg",)), ("d", ("exp_avg", "master"))):
        assert np.array_equal(gs.read_array(tmp_path / ckpt, "qkv.weight"), glob["w"])
        for item in items:
            assert np.array_equal(gs.read_array(tmp_path / ckpt, f"optimizer.{item}.qkv.weight"), glob[item])


def test_a_main_copy_the_pieces_leave_out_is_refused_on_save_and_on_load(tmp_path):
    """Megatron-Core's DistributedOptimizer on bf16 parameters steps fp32 main
    copies of them. A piece that gives their Adam moments but not the copy
    (``master``) would save without it, and a load would leave the copy as it
    was (a fresh run's values, which the next step writes back to the model):
    both are refused, naming the parameter."""
    model = nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    rules = gt.ShardingRules([(r"weight", gt.Replicated())])
    main = model.weight.detach().float().view(-1).clone().requires_grad_()
    opt = torch.optim.AdamW([main], lr=0.1)
    main.grad = torch.ones_like(main)
    opt.step()
    state = opt.state[main]

    def pieces(with_master):
        held = {k: state[k] for k in ("exp_avg", "exp_avg_sq", "step")}
        return [gt.FlatShard(model.weight, 0, main.numel(), {**held, "master": main} if with_master else held)]

    with pytest.raises(gs.LayoutError, match=r"'weight'.*torch.float32 copy.*'master'"):
        gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=opt,
                           optimizer_shards=pieces(False))
    assert not (tmp_path / "c").exists()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=opt,
                       optimizer_shards=pieces(True))
    with pytest.raises(gs.LayoutError, match=r"'weight'.*torch.float32 copy.*'master'"):
        gt.load_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=opt,
                           optimizer_shards=pieces(False))
    saved = main.detach().clone()
    with torch.no_grad():
        main.zero_()
    gt.load_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=opt,
                       optimizer_shards=pieces(True))
    assert torch.equal(main.detach(), saved)


def test_megatron_param_groups_are_matched_by_what_names_them_when_their_number_changes(tmp_path):
    """Megatron-Core's MoE optimizer has groups of its own for the experts only
    when EP > 1, so a distributed optimizer's groups change in number across
    EP sizes. With pieces, groups that carry Megatron's identifier keys
    (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) get the
    hyperparameters of the saved group with the same identity, or of the one
    that differs only in is_expert_parallel; a group with neither is refused,
    naming it. Without those keys a change of number is refused."""
    model = nn.Linear(4, 3, bias=False)
    rules = gt.ShardingRules([(r"weight", gt.Replicated())])

    def ident(expert, wd_mult):
        return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": expert, "is_decoupled_lr": False}

    def adam(groups, lrs):
        extra = [nn.Parameter(torch.zeros(1)) for _ in groups[1:]]
        return torch.optim.AdamW([{"params": [p], **g, "lr": lr} for p, g, lr in
                                  zip([model.weight, *extra], groups, lrs)])

    piece = [gt.FlatShard(model.weight, 0, 12, {"exp_avg": torch.arange(12.0)})]
    saved = adam([ident(False, 1.0), ident(False, 0.0), ident(True, 1.0)], [0.1, 0.2, 0.3])
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=saved,
                       optimizer_shards=piece)
    now = adam([ident(False, 0.0), ident(False, 1.0)], [9.0, 9.0])
    gt.load_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=now,
                       optimizer_shards=piece)
    assert [g["lr"] for g in now.param_groups] == [0.2, 0.1]
    # The other way (EP=1 saved, EP > 1 loaded): an experts' group takes the dense group that differs only there.
    gt.save_checkpoint(tmp_path / "d", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=now,
                       optimizer_shards=piece)
    grown = adam([ident(False, 1.0), ident(True, 0.0), ident(False, 0.0)], [9.0, 9.0, 9.0])
    gt.load_checkpoint(tmp_path / "d", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=grown,
                       optimizer_shards=piece)
    assert [g["lr"] for g in grown.param_groups] == [0.1, 0.2, 0.2]
    assert [g["is_expert_parallel"] for g in grown.param_groups] == [False, True, False]  # what names it stays
    unknown = adam([ident(False, 1.0), ident(False, 0.5)], [9.0, 9.0])
    with pytest.raises(gs.MismatchError, match=r"param group 1 .*'wd_mult': 0.5.* no saved group"):
        gt.load_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=unknown,
                           optimizer_shards=piece)
    plain = torch.optim.AdamW([{"params": [model.weight]}, {"params": [nn.Parameter(torch.zeros(1))]}])
    with pytest.raises(gs.MismatchError, match="the checkpoint has 3 optimizer param groups, the optimizer 2"):
        gt.load_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=plain,
                           optimizer_shards=piece)
