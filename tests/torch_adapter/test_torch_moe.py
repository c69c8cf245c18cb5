"""Mixture of experts: expert-parallel layouts stored as global [num_experts, ...]
arrays, so EP and TP both change on load, and one-module-per-expert
(Megatron-Core's SequentialMLP, TE's GroupedLinear) and stacked grouped-GEMM
weights (torchtitan's GroupedExperts) load into each other."""

import itertools

import numpy as np
import pytest
import torch
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


def expert_slices(ref, layout):
    """Independently: this rank's experts, each cut by TP (fc1 rows, fc2 columns)."""
    per = E // layout.ep_size
    f = FFN // layout.tp_size
    t = layout.tp_rank
    experts = range(layout.ep_rank * per, (layout.ep_rank + 1) * per)
    return ([ref["fc1"][g, t * f:(t + 1) * f] for g in experts], [ref["fc2"][g, :, t * f:(t + 1) * f] for g in experts])


class MoE(nn.Module):
    def __init__(self, kind, layout):
        super().__init__()
        per, f = E // layout.ep_size, FFN // layout.tp_size
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


def layouts(tp, ep, dp):
    return [gt.ParallelLayout(tp_rank=t, tp_size=tp, dp_rank=d, dp_size=dp, ep_size=ep)
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
         ("sequential", (1, 1, 1), "te", (1, 2, 2))]


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
