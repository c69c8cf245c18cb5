"""Torch state that was dropped, refused or half-loaded without a word: each
case here failed before its fix (issue: nothing lost, nothing silently wrong)."""

import inspect
import io

import numpy as np
import pytest
import torch
from torch import nn
from torch_harness import run, values_of

import globalshard as gs
import globalshard_torch as gt

REPLICATED = gt.ShardingRules([(".*", gt.Replicated())])
ONE = gt.ParallelLayout()




class WithExtraState(nn.Module):
    """Like a Transformer Engine layer: FP8 scaling state kept outside parameters,
    returned as JSON, as a tensor, or as a BytesIO (TE has used each)."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.kind = kind
        self.amax = [1.0, float("inf")]

    def get_extra_state(self):
        if self.kind == "json":
            return {"amax": self.amax}
        if self.kind == "tensor":
            return torch.tensor(self.amax)
        return io.BytesIO(np.array(self.amax, np.float64).tobytes())

    def set_extra_state(self, state):
        if self.kind == "json":
            self.amax = state["amax"]
        elif self.kind == "tensor":
            self.amax = state.tolist()
        else:
            self.amax = np.frombuffer(state.getvalue(), np.float64).tolist()


def test_extra_state_round_trips_and_a_tp_change_is_named_not_dropped(tmp_path):
    model = nn.Sequential(WithExtraState("json"), WithExtraState("tensor"), WithExtraState("bytes"))
    for m in model:
        m.amax = [3.5, -2.0]
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED)
    target = nn.Sequential(WithExtraState("json"), WithExtraState("tensor"), WithExtraState("bytes"))
    gt.load_checkpoint(tmp_path / "c", model=target, layout=ONE, rules=REPLICATED)
    assert [m.amax for m in target] == [[3.5, -2.0]] * 3
    # At TP=2 there is no per-rank state to give back: every such module is named.
    tp2 = gt.ParallelLayout(tp_rank=0, tp_size=2)
    fresh = nn.Sequential(WithExtraState("json"), WithExtraState("tensor"), WithExtraState("bytes"))
    with pytest.raises(gs.MismatchError, match=r"(?s)0: WithExtraState's extra state is saved at TP=\[1\].*2: "):
        gt.load_checkpoint(tmp_path / "c", model=fresh, layout=tp2, rules=REPLICATED)
    gt.load_checkpoint(tmp_path / "c", model=fresh, layout=tp2, rules=REPLICATED, extra_state="skip")
    assert [m.amax for m in fresh] == [[1.0, float("inf")]] * 3  # kept as it was, by request


class NoExtraState(nn.Linear):
    """Like Megatron-Core's linear layers: get_extra_state is overridden and returns None."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        raise AssertionError("no state was saved, so none may be handed back")


@pytest.mark.parametrize("empty", [None, b"", torch.empty(0), {}])
def test_none_or_empty_extra_state_is_no_state_and_a_tp_change_loads_by_default(tmp_path, empty):
    class Empty(NoExtraState):
        def get_extra_state(self):
            return empty

    model = nn.Sequential(Empty(2, 2), Empty(2, 2))
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED)
    assert gs.read_trainer_state(tmp_path / "c")["extra_state"] == {}
    assert not [k for k in gs.read_metadata(tmp_path / "c").tensors if k.startswith("_extra_state.")]
    fresh = nn.Sequential(Empty(2, 2), Empty(2, 2))
    tp2 = gt.ParallelLayout(tp_rank=0, tp_size=2)
    gt.load_checkpoint(tmp_path / "c", model=fresh, layout=tp2, rules=REPLICATED)  # default arguments
    assert torch.equal(fresh[1].weight, model[1].weight)
    # A module that holds state now, with nothing saved for it, is still named.
    with pytest.raises(gs.MismatchError, match=r"0: WithExtraState's extra state is not in the checkpoint"):
        gt.load_checkpoint(tmp_path / "c", model=nn.Sequential(WithExtraState("json"), Empty(2, 2)), layout=tp2,
                           rules=gt.ShardingRules([(r"0\.lin\..*", gt.Replicated()), (".*", gt.Replicated())]))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = nn.Linear(2, 2, bias=False)
        self.amax = -1.0

    def get_extra_state(self):
        return {"amax": self.amax}

    def set_extra_state(self, state):
        self.amax = state["amax"]


def moe_with_extra_state(ep_size, ep_rank):
    per = 4 // ep_size
    moe = nn.Module()
    moe.experts = nn.Module()
    moe.experts.local_experts = nn.ModuleList(Expert() for _ in range(per))
    for i, ex in enumerate(moe.experts.local_experts):
        ex.amax = float(ep_rank * per + i)  # the global expert index, to see where it lands
    return moe


@pytest.mark.parametrize(("ep_save", "ep_load"), [(2, 1), (1, 2), (2, 4)])
def test_an_experts_extra_state_follows_it_across_an_ep_change(tmp_path, ep_save, ep_load):
    from globalshard.testing.comm import run_ranks

    rules = gt.ShardingRules([(r".*experts.*", gt.Experts(4, gt.Replicated()))])

    def save(comm):
        layout = gt.ParallelLayout(dp_rank=comm.rank, dp_size=ep_save, ep_size=ep_save)
        gt.save_checkpoint(tmp_path / "c", model=moe_with_extra_state(ep_save, layout.ep_rank), layout=layout,
                           rules=rules, comm=comm)

    assert run_ranks(ep_save, save) == [None] * ep_save

    def load(comm):
        layout = gt.ParallelLayout(dp_rank=comm.rank, dp_size=ep_load, ep_size=ep_load)
        moe = moe_with_extra_state(ep_load, 0)
        for ex in moe.experts.local_experts:
            ex.amax = -1.0
        gt.load_checkpoint(tmp_path / "c", model=moe, layout=layout, rules=rules, comm=comm)
        return [ex.amax for ex in moe.experts.local_experts]

    per = 4 // ep_load
    assert run_ranks(ep_load, load) == [[float(r * per + i) for i in range(per)] for r in range(ep_load)]


def test_extra_state_that_needs_pickle_is_refused_by_name(tmp_path):
    class Opaque(WithExtraState):
        def get_extra_state(self):
            return object()

    with pytest.raises(gs.LayoutError, match=r"1: Opaque.get_extra_state\(\) returned a object"):
        gt.save_checkpoint(tmp_path / "c", model=nn.Sequential(nn.Linear(2, 2), Opaque("json")), layout=ONE,
                           rules=REPLICATED)
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_loading_optimizer_or_scheduler_state_that_was_never_saved_is_an_error(tmp_path):
    model = nn.Linear(3, 3)
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED)
    opt = torch.optim.AdamW(model.parameters(), lr=0.25)
    with pytest.raises(gs.MismatchError, match="no optimizer state"):
        gt.load_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, optimizer=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    with pytest.raises(gs.MismatchError, match="no LR scheduler state"):
        gt.load_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, scheduler=sched)
    gt.load_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED)  # the model alone loads


class OutputFirst(nn.Module):
    """Registers the output layer before the embedding it is tied to."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(3, 5, bias=False)
        self.embedding = nn.Embedding(5, 3)
        self.lm_head.weight = self.embedding.weight


TIED = gt.ShardingRules([(r"embedding\.weight", gt.Replicated()), (r"lm_head\.weight", gt.Tied("embedding.weight"))])


@pytest.mark.parametrize("cls", [OutputFirst])
def test_tied_weights_do_not_depend_on_declaration_order(tmp_path, cls):
    model = cls()
    with torch.no_grad():
        model.embedding.weight.copy_(torch.arange(15.0).reshape(5, 3))
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=TIED)
    assert list(gs.read_metadata(tmp_path / "c").tensors) == ["embedding.weight"]
    target = cls()
    gt.load_checkpoint(tmp_path / "c", model=target, layout=ONE, rules=TIED)
    assert torch.equal(target.lm_head.weight, model.embedding.weight)


def _schedulers(opt):
    S = torch.optim.lr_scheduler
    return {
        "ReduceLROnPlateau": S.ReduceLROnPlateau(opt, patience=1),
        "StepLR": S.StepLR(opt, 2),
        "MultiStepLR": S.MultiStepLR(opt, [1, 3]),
        "ExponentialLR": S.ExponentialLR(opt, 0.9),
        "CosineAnnealingLR": S.CosineAnnealingLR(opt, 10),
        "CosineAnnealingWarmRestarts": S.CosineAnnealingWarmRestarts(opt, 3),
        "OneCycleLR": S.OneCycleLR(opt, max_lr=1.0, total_steps=20),
        "CyclicLR": S.CyclicLR(opt, 0.01, 0.1, step_size_up=3),
        "LinearLR": S.LinearLR(opt, total_iters=4),
        "ConstantLR": S.ConstantLR(opt, total_iters=4),
        "PolynomialLR": S.PolynomialLR(opt, total_iters=4),
    }


@pytest.mark.parametrize("name", list(_schedulers(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))))
def test_every_standard_scheduler_round_trips_exactly(tmp_path, name):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = _schedulers(opt)[name]
    for step in range(3):
        opt.step()
        if name == "ReduceLROnPlateau":
            sched.step(float(step))  # no improvement: best stays, bad epochs count
        else:
            sched.step()
    saved = sched.state_dict()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, optimizer=opt, scheduler=sched)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched2 = _schedulers(opt2)[name]
    gt.load_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, optimizer=opt2, scheduler=sched2)
    restored = sched2.state_dict()
    for key, value in saved.items():
        if callable(value) or inspect.isfunction(value):
            continue
        got = restored[key]
        if isinstance(value, float) and value != value:
            assert got != got, key
        else:
            assert got == value, (key, got, value)
    if name == "ReduceLROnPlateau":
        assert saved["mode_worse"] == float("inf")  # the value that JSON cannot hold


def test_submesh_dtensor_ranks_outside_the_mesh_contribute_nothing(tmp_path):
    ckpt, dump = str(tmp_path / "ckpt"), str(tmp_path / "w.npy")
    values_of(run(3, "submesh_save_job", str(tmp_path / "s"), path=ckpt, dump=dump))
    got = gs.read_array(ckpt, "w")
    assert np.array_equal(got, np.load(dump))
    assert gs.read_array(ckpt, "optimizer.exp_avg.w").shape == (4, 3)


def test_a_load_failing_on_one_rank_changes_nothing_on_any_rank(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, optimizer=opt)
    results = values_of(run(2, "failing_load_job", str(tmp_path / "l"), path=str(tmp_path / "c")))
    assert results[1]["outcome"].startswith("MissingKeyError"), results[1]
    assert results[0]["outcome"].startswith("CommError"), results[0]
    for r in results:
        assert r["untouched"] and r["no_state"] and r["lr"] == 0.5, r


def test_ema_shadows_and_per_rank_state_round_trip(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    ema = {n: p.detach() * 0.5 + 1 for n, p in model.named_parameters()}
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, shadows={"ema": ema},
                       rank_state={"sampler_index": 1234, "epoch": 2})
    assert "ema.0.weight" in gs.read_metadata(tmp_path / "c").tensors
    target = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    result = gt.load_checkpoint(tmp_path / "c", model=nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)), layout=ONE,
                                rules=REPLICATED, shadows={"ema": target})
    assert all(torch.equal(target[n], ema[n]) for n in ema)
    assert result.rank_state == {"sampler_index": 1234, "epoch": 2}
    # On another layout there is no such rank: None, said plainly.
    other = gt.load_checkpoint(tmp_path / "c", model=nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)),
                               layout=gt.ParallelLayout(tp_rank=0, tp_size=2), rules=REPLICATED)
    assert other.rank_state is None and not other.rng_restored
    with pytest.raises(gs.LayoutError, match="'missing' is not a tensor of the model"):
        gt.save_checkpoint(tmp_path / "d", model=model, layout=ONE, rules=REPLICATED,
                           shadows={"ema": {"missing": torch.zeros(1)}})
    with pytest.raises(gs.MismatchError, match=r"swa.0.weight.*no such key"):
        gt.load_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED,
                           shadows={"ema": target, "swa": {"0.weight": torch.zeros(2, 3)}})


class Wrapper(nn.Module):
    """What DDP (module.) and torch.compile (_orig_mod.) do to parameter names."""

    def __init__(self, inner, attr):
        super().__init__()
        setattr(self, attr, inner)


def test_wrapped_models_save_and_load_under_plain_names(tmp_path):
    plain = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    wrapped = Wrapper(Wrapper(plain, "_orig_mod"), "module")
    assert next(iter(dict(wrapped.named_parameters()))) == "module._orig_mod.0.weight"
    gt.save_checkpoint(tmp_path / "c", model=wrapped, layout=ONE, rules=REPLICATED)
    assert set(gs.read_metadata(tmp_path / "c").tensors) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    target = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    gt.load_checkpoint(tmp_path / "c", model=target, layout=ONE, rules=REPLICATED)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), target.parameters()))
    own = Wrapper(nn.Linear(2, 2), "module")  # a model's own submodule named 'module' deeper down keeps it
    assert {e.key for e in gt.model_entries(nn.Sequential(own), ONE, REPLICATED)} == {"0.module.weight",
                                                                                     "0.module.bias"}


def test_activation_checkpointed_layers_save_and_load_under_their_plain_names(tmp_path):
    # torch's checkpoint_wrapper (torchtitan's and FSDP's activation checkpointing) puts
    # _checkpoint_wrapped_module in its parameters' names; its state_dict(), and DCP's keys, drop it.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    wrapped = nn.Sequential(checkpoint_wrapper(plain[0]), plain[1])
    assert "0._checkpoint_wrapped_module.weight" in dict(wrapped.named_parameters())
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
    wrapped(torch.randn(2, 2)).sum().backward()
    opt.step()
    gt.save_checkpoint(tmp_path / "c", model=wrapped, layout=ONE, rules=REPLICATED, optimizer=opt)
    assert set(gs.read_metadata(tmp_path / "c").tensors) >= {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert set(wrapped.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    # Resumed without activation checkpointing, and with it again.
    target = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.1)
    gt.load_checkpoint(tmp_path / "c", model=target, layout=ONE, rules=REPLICATED, optimizer=target_opt)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), target.parameters()))
    assert torch.equal(target_opt.state[target[0].weight]["exp_avg"], opt.state[plain[0].weight]["exp_avg"])
    again = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 3)), nn.LayerNorm(3))
    gt.load_checkpoint(tmp_path / "c", model=again, layout=ONE, rules=REPLICATED)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), again.parameters()))


def test_async_save_through_the_adapter_keeps_the_snapshot(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    saver = gs.AsyncSaver()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, optimizer=opt, saver=saver)
    opt.step()  # training continues while the save is written
    saver.wait()
    target = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    gt.load_checkpoint(tmp_path / "c", model=target, layout=ONE, rules=REPLICATED)
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())


class Net(nn.Module):
    def __init__(self, norm=True):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        if norm:
            self.norm = nn.LayerNorm(3)


def test_load_checkpoint_is_strict_by_default_and_reports_keys(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.norm(model.proj(torch.randn(2, 3))).sum().backward()
    opt.step()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=ONE, rules=REPLICATED, optimizer=opt)
    lacking = Net(norm=False)
    with pytest.raises(gs.MismatchError, match=r"(?s)no rank's model reads.*'norm.bias'.*'norm.weight'"):
        gt.load_checkpoint(tmp_path / "c", model=lacking, layout=ONE, rules=REPLICATED)
    result = gt.load_checkpoint(tmp_path / "c", model=lacking, layout=ONE, rules=REPLICATED, strict=False)
    assert result.unexpected_keys == ["norm.bias", "norm.weight"] and result.missing_keys == []
    assert torch.equal(lacking.proj.weight, model.proj.weight)
    # With an optimizer, the norm's optimizer state is unexpected too.
    opt2 = torch.optim.AdamW(lacking.parameters(), lr=0.1)
    result = gt.load_checkpoint(tmp_path / "c", model=lacking, layout=ONE, rules=REPLICATED, optimizer=opt2,
                                strict=False)
    assert "optimizer.exp_avg.norm.weight" in result.unexpected_keys and "norm.weight" in result.unexpected_keys
    # A model with more than the checkpoint: strict names the key; strict=False leaves it and lists it.
    gt.save_checkpoint(tmp_path / "small", model=Net(norm=False), layout=ONE, rules=REPLICATED)
    full = Net()
    before = full.norm.weight.detach().clone()
    with pytest.raises(gs.MissingKeyError, match="norm.weight"):
        gt.load_checkpoint(tmp_path / "small", model=full, layout=ONE, rules=REPLICATED)
    result = gt.load_checkpoint(tmp_path / "small", model=full, layout=ONE, rules=REPLICATED, strict=False)
    assert result.missing_keys == ["norm.bias", "norm.weight"] and result.unexpected_keys == []
    assert torch.equal(full.norm.weight, before)
    assert gt.load_checkpoint(tmp_path / "c", model=Net(), layout=ONE, rules=REPLICATED).unexpected_keys == []


class GroupedExperts(nn.Module):
    """As Transformer Engine's GroupedLinear: all of an EP rank's experts in one
    module (weight0, weight1, ...), one extra state for all of them."""

    def __init__(self, per, ep_rank):
        super().__init__()
        for i in range(per):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.zeros(2, 2)))
        self.amax = float(ep_rank)

    def get_extra_state(self):
        return {"amax": self.amax}

    def set_extra_state(self, state):
        self.amax = state["amax"]


def test_a_grouped_experts_modules_state_stays_per_ep_rank_and_an_ep_change_is_named(tmp_path):
    from globalshard.testing.comm import run_ranks

    rules = gt.ShardingRules([(r".*experts.*", gt.Experts(4, gt.Replicated()))])
    path = str(tmp_path)

    def model(ep, ep_rank):
        m = nn.Module()
        m.experts = nn.Module()
        m.experts.linear_fc1 = GroupedExperts(4 // ep, ep_rank)
        return m

    def save(comm):
        layout = gt.ParallelLayout(dp_rank=comm.rank, dp_size=2, ep_size=2)
        gt.save_checkpoint(path, model=model(2, layout.ep_rank), layout=layout, rules=rules, comm=comm)

    assert run_ranks(2, save) == [None, None]

    def load(comm, ep):
        layout = gt.ParallelLayout(dp_rank=comm.rank, dp_size=2, ep_size=ep)
        m = model(ep, -1)
        m.experts.linear_fc1.amax = -1.0
        gt.load_checkpoint(path, model=m, layout=layout, rules=rules, comm=comm)
        return m.experts.linear_fc1.amax

    assert run_ranks(2, lambda comm: load(comm, 2)) == [0.0, 1.0]  # each EP rank its own, not the other's
    errors = run_ranks(2, lambda comm: load(comm, 1))
    assert all(isinstance(e, gs.MismatchError) and "saved per EP rank at EP=[2], loading at EP=1" in str(e)
               for e in errors), errors


V, H = 5, 3  # a vocabulary of 5 padded to a multiple of TP: 6 rows at TP=2 and TP=3, 8 at TP=4
VOCAB_RULES = gt.ShardingRules([(r"emb\.weight", gt.VocabParallel(V))])


def _vocab_model(tp):
    rows = -(-V // tp)
    m = nn.Module()
    m.emb = nn.Embedding(rows, H)
    return m


def _padded_global(tp):
    return -(-V // tp) * tp


@pytest.mark.parametrize("tp_load", [2, 4, 3, 1])
def test_trained_vocabulary_padding_rows_and_their_moments_are_kept(tmp_path, tp_load):
    from globalshard.testing.comm import run_ranks

    saved = torch.arange(6 * H, dtype=torch.float32).reshape(6, H) + 1  # row 5 is padding, trained
    moments = {}

    def save(comm):
        layout = gt.ParallelLayout(tp_rank=comm.rank, tp_size=2)
        m = _vocab_model(2)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        with torch.no_grad():
            m.emb.weight.copy_(saved[3 * comm.rank:3 * comm.rank + 3])
        m.emb.weight.grad = torch.ones_like(m.emb.weight) * (comm.rank + 1)
        opt.step()
        moments[comm.rank] = (m.emb.weight.detach().clone(), opt.state[m.emb.weight]["exp_avg"].clone())
        gt.save_checkpoint(tmp_path / "c", model=m, layout=layout, rules=VOCAB_RULES, optimizer=opt, comm=comm)

    assert run_ranks(2, save) == [None, None]
    weight = torch.cat([moments[0][0], moments[1][0]])  # the saving layout's 6 rows
    exp_avg = torch.cat([moments[0][1], moments[1][1]])
    assert gs.read_array(tmp_path / "c", "emb.weight").shape == (V, H)  # the key is exactly the true vocabulary
    assert np.array_equal(gs.read_array(tmp_path / "c", "emb.weight"), weight[:V].numpy())

    def load(comm):
        layout = gt.ParallelLayout(tp_rank=comm.rank, tp_size=tp_load)
        m = _vocab_model(tp_load)
        with torch.no_grad():
            m.emb.weight.fill_(-7.0)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        result = gt.load_checkpoint(tmp_path / "c", model=m, layout=layout, rules=VOCAB_RULES, optimizer=opt,
                                    comm=comm)  # strict: rows a smaller padding leaves are not unexpected
        assert result.unexpected_keys == [] and result.missing_keys == []
        return m.emb.weight.detach().clone(), opt.state[m.emb.weight]["exp_avg"].clone()

    got = run_ranks(tp_load, load)
    assert not [g for g in got if isinstance(g, BaseException)], got
    rows = _padded_global(tp_load)
    both = min(rows, 6)  # rows inside both padded sizes carry over, the rest are zero
    expect_w, expect_m = torch.zeros(rows, H), torch.zeros(rows, H)
    expect_w[:both], expect_m[:both] = weight[:both], exp_avg[:both]
    assert torch.equal(torch.cat([w for w, _ in got]), expect_w)
    assert torch.equal(torch.cat([m for _, m in got]), expect_m)
