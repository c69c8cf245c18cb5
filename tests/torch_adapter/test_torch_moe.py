"""Mixture of experts: expert-parallel layouts stored as global [num_experts, ...]
arrays, so EP and TP both change on load, and one-module-per-expert
(Megatron-Core's SequentialMLP, TE's GroupedLinear) and stacked grouped-GEMM
weights (torchtitan's GroupedExperts) load into each other."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch_harness import run, values_of

import globalshard as gs
import globalshard_torch as gt

E, FFN, HIDDEN = 4, 6, 3


def reference():
    rng = np.random.default_rng(3)
    return {"fc1": rng.standard_normal((E, FFN, HIDDEN)).astype(np.float32),
            "fc2": rng.standard_normal((E, HIDDEN, FFN)).astype(np.float32),
            "router": rng.standard_normal((E, HIDDEN)).astype(np.float32)}


def megatron_expert_ranks(layout):
    """Independently, from Megatron-Core's description: a stage's ranks are
    numbered ``tp_rank + tp * dp_rank``; experts cut that number in ``tp-ep-dp``
    order with the expert TP size: ``(expert tp rank, ep rank, expert dp rank)``."""
    etp = layout.etp_size or layout.tp_size
    n = layout.tp_rank + layout.tp_size * layout.dp_rank
    return n % etp, n // etp % layout.ep_size, n // (etp * layout.ep_size)


def expert_slices(ref, layout):
    """Independently: this rank's experts, each cut by the expert TP (fc1 rows, fc2 columns)."""
    per = E // layout.ep_size
    f = FFN // (layout.etp_size or layout.tp_size)
    t, ep, _ = megatron_expert_ranks(layout)
    experts = range(ep * per, (ep + 1) * per)
    return ([ref["fc1"][g, t * f:(t + 1) * f] for g in experts], [ref["fc2"][g, :, t * f:(t + 1) * f] for g in experts])


class MoE(nn.Module):
    def __init__(self, kind, layout):
        super().__init__()
        per, f = E // layout.ep_size, FFN // (layout.etp_size or layout.tp_size)
        self.router = nn.Linear(HIDDEN, E, bias=False)
        self.experts = nn.Module()
        if kind == "sequential":  # Megatron-Core SequentialMLP naming
            self.experts.local_experts = nn.ModuleList()
            for _ in range(per):
                ex = nn.Module()
                ex.linear_fc1 = nn.Linear(HIDDEN, f, bias=False)
                ex.linear_fc2 = nn.Linear(f, HIDDEN, bias=False)
                self.experts.local_experts.append(ex)
        elif kind == "te":  # Transformer Engine GroupedLinear naming: weight0, weight1, ...
            self.experts.linear_fc1 = nn.Module()
            self.experts.linear_fc2 = nn.Module()
            for i in range(per):
                self.experts.linear_fc1.register_parameter(f"weight{i}", nn.Parameter(torch.zeros(f, HIDDEN)))
                self.experts.linear_fc2.register_parameter(f"weight{i}", nn.Parameter(torch.zeros(HIDDEN, f)))
        else:  # stacked grouped GEMM
            self.experts.linear_fc1 = nn.Module()
            self.experts.linear_fc2 = nn.Module()
            self.experts.linear_fc1.register_parameter("weight", nn.Parameter(torch.zeros(per, f, HIDDEN)))
            self.experts.linear_fc2.register_parameter("weight", nn.Parameter(torch.zeros(per, HIDDEN, f)))

    def expert_tensors(self, kind):
        per = len(self.experts.local_experts) if kind == "sequential" else None
        if kind == "sequential":
            return ([m.linear_fc1.weight for m in self.experts.local_experts],
                    [m.linear_fc2.weight for m in self.experts.local_experts])
        if kind == "te":
            n = len(list(self.experts.linear_fc1.parameters()))
            return ([getattr(self.experts.linear_fc1, f"weight{i}") for i in range(n)],
                    [getattr(self.experts.linear_fc2, f"weight{i}") for i in range(n)])
        del per
        return (list(self.experts.linear_fc1.weight), list(self.experts.linear_fc2.weight))


def rules(kind):
    if kind == "stacked":
        fc1, fc2 = gt.StackedExperts(E, gt.ColumnParallel()), gt.StackedExperts(E, gt.RowParallel())
    else:
        fc1, fc2 = gt.Experts(E, gt.ColumnParallel()), gt.Experts(E, gt.RowParallel())
    return gt.ShardingRules([(r".*router.*", gt.Replicated()), (r".*linear_fc1.*", fc1), (r".*linear_fc2.*", fc2)])


def layouts(tp, ep, dp, etp=None):
    return [gt.ParallelLayout(tp_rank=t, tp_size=tp, dp_rank=d, dp_size=dp, ep_size=ep, etp_size=etp)
            for d, t in itertools.product(range(dp), range(tp))]


def shards_of(kind, layout, fill):
    model = MoE(kind, layout)
    ref = reference()
    fc1, fc2 = model.expert_tensors(kind)
    if fill:
        with torch.no_grad():
            model.router.weight.copy_(torch.from_numpy(ref["router"]))
            want1, want2 = expert_slices(ref, layout)
            for t, w in zip(fc1 + fc2, want1 + want2):
                t.copy_(torch.from_numpy(w))
    entries = gt.model_entries(model, layout, rules(kind))
    return model, {f"{layout.dp_rank}.{layout.tp_rank}.{e.name}": e.shard(e.key, gt.numpy_view(e.tensor.detach()))
                   for e in entries}


CASES = [("sequential", (1, 2, 2), "stacked", (2, 1, 1)),
         ("stacked", (2, 2, 4), "sequential", (1, 4, 4)),
         ("te", (2, 4, 4), "sequential", (2, 1, 2)),
         ("sequential", (1, 1, 1), "te", (1, 2, 2)),
         # An expert TP other than TP (Megatron-Core's expert_tensor_parallel_size): (tp, ep, dp, etp).
         ("sequential", (2, 2, 1, 1), "stacked", (1, 1, 2)),
         ("te", (2, 2, 2, 1), "sequential", (2, 1, 1)),
         ("stacked", (1, 2, 2), "te", (2, 2, 2, 1)),
         ("sequential", (3, 1, 2, 6), "sequential", (6, 2, 2, 3))]


@pytest.mark.parametrize("save_kind,save_cfg,load_kind,load_cfg", CASES)
def test_experts_reshard_across_ep_tp_and_layouts(tmp_path, save_kind, save_cfg, load_kind, load_cfg):
    state = {}
    for layout in layouts(*save_cfg):
        state.update(shards_of(save_kind, layout, fill=True)[1])
    gs.save(state, tmp_path / "c")
    ref = reference()
    md = gs.read_metadata(tmp_path / "c")
    assert set(md.tensors) == {"router.weight", "experts.linear_fc1.weight", "experts.linear_fc2.weight"}
    assert np.array_equal(gs.read_array(tmp_path / "c", "experts.linear_fc1.weight"), ref["fc1"])
    assert np.array_equal(gs.read_array(tmp_path / "c", "experts.linear_fc2.weight"), ref["fc2"])
    for layout in layouts(*load_cfg):
        model, targets = shards_of(load_kind, layout, fill=False)
        gs.load(targets, tmp_path / "c")
        fc1, fc2 = model.expert_tensors(load_kind)
        want1, want2 = expert_slices(ref, layout)
        for got, want in zip(fc1 + fc2, want1 + want2):
            assert np.array_equal(got.detach().numpy(), want), layout
        assert np.array_equal(model.router.weight.detach().numpy(), ref["router"])


def test_expert_rules_name_their_problems():
    layout = gt.ParallelLayout(dp_rank=1, dp_size=2, ep_size=2)
    with pytest.raises(gs.LayoutError, match="local expert 2, but each of 2 EP ranks holds 2"):
        rules("sequential").resolve_on("experts.local_experts.2.linear_fc1.weight", layout)
    with pytest.raises(gs.LayoutError, match="do not split over EP=2"):
        gt.StackedExperts(3).place((1, 2, 3), layout)
    with pytest.raises(gs.LayoutError, match="does not divide dp_size"):
        gt.ParallelLayout(dp_size=3, ep_size=2)
    with pytest.raises(gs.LayoutError, match="etp_size 1 x ep_size 4 does not divide tp_size x dp_size = 2"):
        gt.ParallelLayout(tp_size=2, ep_size=4, etp_size=1)


@given(st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 4]),
       st.sampled_from([None, 1, 2, 3, 4, 6, 8]))
def test_every_rank_of_a_stage_holds_one_place_in_the_expert_grid(tp, dp, ep, etp):
    """(expert TP rank, EP rank, expert DP rank) numbers the stage's ranks
    exactly once, and the experts' own view of a rank agrees with it."""
    if (tp * dp) % ((etp or tp) * ep):
        return
    ranks = layouts(tp, ep, dp, etp)
    places = [(lay.expert_tp_rank, lay.ep_rank, lay.expert_dp_rank) for lay in ranks]
    assert places == [megatron_expert_ranks(lay) for lay in ranks]
    assert len(set(places)) == tp * dp
    for lay in ranks:
        view = lay.for_experts()
        assert (view.tp_rank, view.tp_size) == (lay.expert_tp_rank, etp or tp)
        assert (view.ep_rank, view.expert_dp_rank) == (lay.ep_rank, lay.expert_dp_rank)




def test_experts_with_adam_state_over_gloo_then_one_process(tmp_path):
    ckpt = str(tmp_path / "c")
    held = values_of(run(2, "moe_save_job", str(tmp_path / "s"), path=ckpt))
    layout = gt.ParallelLayout()
    model = MoE("stacked", layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    gt.load_checkpoint(ckpt, model=model, layout=layout, rules=rules("stacked"), optimizer=opt)
    fc1 = model.experts.linear_fc1.weight
    assert np.array_equal(fc1.detach().numpy(), np.concatenate([np.array(h["fc1"]) for h in held]))
    assert np.array_equal(opt.state[fc1]["exp_avg"].numpy(), np.concatenate([np.array(h["exp_avg"]) for h in held]))
    assert float(opt.state[fc1]["step"]) == 1.0 and opt.param_groups[0]["lr"] == 0.01
