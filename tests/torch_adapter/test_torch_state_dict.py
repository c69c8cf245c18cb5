"""DCP-style entry points: globalshard_torch.save / load over nested state dicts."""

import io
import json
import math
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch_harness import run, values_of

import globalshard as gs
import globalshard_torch as gt
from globalshard.comm import json_digest
from globalshard.format.holdings import parse_holdings
from globalshard_torch.state_dict import region_digests, replica_keys


class Loader:
    """A Stateful dataloader position, as torchdata's StatefulDataLoader keeps one."""

    def __init__(self):
        self.epoch, self.index, self.seed_bytes = 0, 0, b"\x00\x01"

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed_bytes}

    def load_state_dict(self, state):
        self.epoch, self.index, self.seed_bytes = state["epoch"], state["index"], state["seed"]


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt, loader, scaler, ema):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "loader": loader, "scaler": scaler, "ema": ema,
            "step": 12, "best_loss": math.inf, "blob": b"\xffraw", "config": {"layers": [1, 2], "name": "x"}}


def test_a_nested_state_dict_round_trips_exactly(tmp_path):
    model, opt = _trained()
    loader = Loader()
    loader.epoch, loader.index, loader.seed_bytes = 3, 1234, b"\x07" * 5
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    ema = {"0.weight": model[0].weight.detach() * 0.5}
    gt.save(_state(model, opt, loader, scaler, ema), tmp_path / "c")
    assert "model.0.weight" in gs.read_metadata(tmp_path / "c").tensors
    assert "optim.state.0.weight.exp_avg" in gs.read_metadata(tmp_path / "c").tensors

    from torch.distributed.checkpoint.state_dict import set_state_dict

    model2 = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    loader2, scaler2 = Loader(), torch.amp.GradScaler("cpu")
    ema2 = {"0.weight": torch.zeros(3, 4)}
    state = _state(model2, opt2, loader2, scaler2, ema2)
    gt.load(state, tmp_path / "c")
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"]), n
        assert torch.equal(opt.state[a]["step"], opt2.state[b]["step"]), n
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.param_groups[0]["betas"] == (0.8, 0.9)
    assert (loader2.epoch, loader2.index, loader2.seed_bytes) == (3, 1234, b"\x07" * 5)
    assert scaler2.get_scale() == 512.0
    assert torch.equal(ema2["0.weight"], ema["0.weight"])
    assert state["step"] == 12 and state["best_loss"] == math.inf and state["blob"] == b"\xffraw"
    assert state["config"] == {"layers": [1, 2], "name": "x"}


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_an_async_save_holds_the_values_of_when_it_returned_as_dcp_async_save(tmp_path, mode):
    model, opt = _trained()
    loader = Loader()
    loader.index = 40
    saver = gs.AsyncSaver(mode)
    state = _state(model, opt, loader, torch.amp.GradScaler("cpu"), {"0.weight": model[0].weight.detach() * 2})
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    gt.save(state, tmp_path / "c", saver=saver)
    with torch.no_grad():  # training goes on while the writer writes
        for p in model.parameters():
            p.add_(100.0)
            opt.state[p]["exp_avg"].add_(100.0)
    loader.index = 41
    saver.wait()
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model2 = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    loader2 = Loader()
    state2 = _state(model2, opt2, loader2, torch.amp.GradScaler("cpu"), {"0.weight": torch.zeros(3, 4)})
    gt.load(state2, tmp_path / "c")
    set_state_dict(model2, opt2, model_state_dict=state2["model"], optim_state_dict=state2["optim"])
    for n, p in model2.named_parameters():
        assert torch.equal(p, held[n]) and torch.equal(opt2.state[p]["exp_avg"], moments[n]), n
    assert loader2.index == 40 and state2["step"] == 12


def _streams():
    written = io.BytesIO()
    torch.save({"amax": torch.arange(3.0)}, written)  # left at its end, as torch.save leaves it
    middle = io.BytesIO(b"abcdef")
    middle.seek(2)
    return {"written": written, "middle": middle, "empty": io.BytesIO(), "nested": {"s": io.BytesIO(b"\x00\xff")},
            "raw": b"\x01\x02"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bytesio_leaves_come_back_as_dcp_gives_them(tmp_path):
    import torch.distributed.checkpoint as dcp

    gt.save(_streams(), tmp_path / "gs")
    dcp.save(_streams(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    ours, theirs = [{"written": io.BytesIO(b"old"), "middle": io.BytesIO(), "empty": io.BytesIO(b"x"),
                     "nested": {"s": None}, "raw": io.BytesIO()} for _ in range(2)]
    written = ours["written"]
    gt.load(ours, tmp_path / "gs")
    dcp.load(theirs, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)

    def seen(state):
        return {k: (type(v).__name__, v.getvalue(), v.tell()) if isinstance(v, io.BytesIO) else v
                for k, v in [*state.items(), ("nested.s", state["nested"]["s"])] if k != "nested"}

    assert seen(ours) == seen(theirs)
    assert seen(ours)["middle"] == ("BytesIO", b"abcdef", 2) and ours["raw"] == b"\x01\x02"
    assert ours["written"] is written  # the state dict's own stream, filled
    written.seek(0)
    assert torch.equal(torch.load(written, weights_only=True)["amax"], torch.arange(3.0))


def test_numpy_arrays_are_stored_as_arrays_and_come_back_as_numpy(tmp_path):
    # A sampler's permutation, a metric's history: arrays, not pickles. The state dict's own array is
    # filled when it fits; otherwise the entry is replaced, as DCP replaces it.
    perm = np.random.default_rng(0).permutation(10)
    history = np.linspace(0.0, 1.0, 6, dtype=np.float32).reshape(2, 3)
    gt.save({"sampler": {"perm": perm, "epoch": 3}, "history": history, "scalar": np.array(2.5)}, tmp_path / "c")
    assert gs.read_metadata(tmp_path / "c").tensors["sampler.perm"].dtype == "int64"
    mine = np.zeros(10, np.int64)
    state = {"sampler": {"perm": mine, "epoch": 0}, "history": None, "scalar": np.zeros(3)}
    gt.load(state, tmp_path / "c")
    assert state["sampler"]["perm"] is mine and np.array_equal(mine, perm) and state["sampler"]["epoch"] == 3
    assert state["history"].dtype == np.float32 and np.array_equal(state["history"], history)
    assert state["scalar"].shape == () and state["scalar"] == 2.5  # another shape held: replaced
    with pytest.raises(gs.LayoutError, match="a numpy array that cannot be stored"):
        gt.save({"names": np.array(["a", "b"])}, tmp_path / "d")
    with pytest.raises(gs.LayoutError, match="bit_generator.state"):
        gt.save({"rng": np.random.get_state()}, tmp_path / "e")


def test_tuples_come_back_as_tuples_as_dcp_gives_them_back(tmp_path):
    # random.getstate() is a tuple holding a tuple; random.setstate() refuses lists. Loaded into
    # a state dict holding None there (what a fresh job has before it restores), or a list.
    import random

    random.seed(5)
    saved = random.getstate()
    gt.save({"rng": saved, "sched": {"betas": (0.9, 0.95), "ms": [(1, 2), [3, (4,)]], "e": ()}}, tmp_path / "c")
    state = {"rng": None, "sched": {"betas": [0.0, 0.0], "ms": None, "e": None}}
    gt.load(state, tmp_path / "c")
    assert state["sched"] == {"betas": (0.9, 0.95), "ms": [(1, 2), [3, (4,)]], "e": ()}
    assert type(state["sched"]["ms"]) is list and type(state["sched"]["betas"]) is tuple
    random.setstate(state["rng"])
    assert state["rng"] == saved


def test_a_tuple_the_saved_value_does_not_have_is_named(tmp_path, monkeypatch):
    # A writer that recorded tuples at paths its value lacks (the trainer state checksummed as written).
    from globalshard_torch import state_dict

    monkeypatch.setattr(state_dict, "_tuple_paths", lambda value: [[5]])
    gt.save({"sched": {"ms": [(1, 2)]}}, tmp_path / "c")
    monkeypatch.undo()
    with pytest.raises(gs.MetadataError, match=r"sched\.ms: the trainer state's 'state_dict_tuples' names a tuple "
                                               r"at \[5\] that the saved value does not have"):
        gt.load({"sched": {"ms": None}}, tmp_path / "c")


class ScaledLinear(nn.Linear):
    """As a Transformer Engine module: its extra state (an FP8 amax) is an io.BytesIO
    of torch.save, so it sits in ``model.state_dict()`` as ``_extra_state``."""

    def __init__(self):
        super().__init__(2, 2)
        self.amax = torch.zeros(4)

    def get_extra_state(self):
        state = io.BytesIO()
        torch.save(self.amax, state)
        return state

    def set_extra_state(self, state):
        state.seek(0)
        self.amax = torch.load(state, weights_only=True)


def test_a_model_state_dict_holding_bytesio_extra_state_round_trips(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(), ScaledLinear())
    model[1].amax = torch.tensor([1.0, 2.5, -3.0, 4.0])
    sd = model.state_dict()
    assert isinstance(sd["1._extra_state"], io.BytesIO)
    gt.save({"model": sd}, tmp_path / "c")
    assert "model.1._extra_state" in gs.read_metadata(tmp_path / "c").tensors  # raw bytes, never pickled JSON
    fresh = nn.Sequential(ScaledLinear(), ScaledLinear())
    target = fresh.state_dict()
    gt.load({"model": target}, tmp_path / "c")
    fresh.load_state_dict(target)
    assert torch.equal(fresh[1].amax, model[1].amax) and torch.equal(fresh[1].weight, model[1].weight)


def test_wrapper_prefixes_are_normalised(tmp_path):
    model, _ = _trained()
    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    gt.save({"model": wrapped}, tmp_path / "c")
    plain = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    sd = plain.state_dict()
    gt.load({"model": sd}, tmp_path / "c")
    plain.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_what_cannot_be_saved_or_found_is_named(tmp_path):
    with pytest.raises(gs.LayoutError, match=r"hook: function cannot be saved"):
        gt.save({"w": torch.ones(2), "hook": lambda: 1}, tmp_path / "a")
    with pytest.raises(gs.LayoutError, match="flatten to this key"):
        gt.save({"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)}, tmp_path / "b")
    gt.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(gs.MismatchError, match=r"'v'.*: no such key"):
        gt.load({"w": torch.zeros(2), "v": torch.zeros(2)}, tmp_path / "c")  # named by its key
    target = torch.zeros(3)
    with pytest.raises(gs.MismatchError, match="global shape"):
        gt.load({"w": target}, tmp_path / "c")




def test_a_state_dict_on_the_meta_device_loads_into_tensors_made_for_it_as_dcp_does(tmp_path):
    # A model built on the meta device, its state dict loaded rather than initialized. Before, the load
    # returned as if it had filled them, and every tensor stayed on the meta device, holding nothing.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    loader = Loader()
    gt.save({"model": model.state_dict(), "ema": [model[0].weight.detach() * 2], "loader": loader},
            tmp_path / "c")
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    sd = {"model": empty.state_dict(), "ema": [torch.empty(3, 4, device="meta")], "loader": Loader()}
    assert gt.load(sd, tmp_path / "c") == gt.LoadedKeys([], [])
    for name, value in model.state_dict().items():
        assert sd["model"][name].device.type == "cpu" and torch.equal(sd["model"][name], value), name
    assert torch.equal(sd["ema"][0], model[0].weight.detach() * 2)
    empty.load_state_dict(sd["model"], assign=True)
    assert torch.equal(empty(torch.ones(2, 4)), model(torch.ones(2, 4)))


def test_meta_tensors_not_loaded_stay_as_they_were_and_are_not_saved(tmp_path):
    gt.save({"w": torch.arange(3.0)}, tmp_path / "c")
    sd = {"w": torch.empty(3, device="meta"), "extra": torch.empty(2, device="meta")}
    assert gt.load(sd, tmp_path / "c", strict=False) == gt.LoadedKeys(["extra"], [])
    assert torch.equal(sd["w"], torch.arange(3.0)) and sd["extra"].is_meta  # not made up: reported missing
    failing = {"w": torch.empty(4, device="meta")}
    with pytest.raises(gs.MismatchError, match="global shape"):
        gt.load(failing, tmp_path / "c")
    assert failing["w"].is_meta  # a failed load changes nothing
    with torch.device("meta"):
        meta_model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(gs.LayoutError, match=r"(?s)model\.0\.weight: on the meta device: it holds no data.*"
                                             r"model\.0\.bias: on the meta device"):
        gt.save({"model": meta_model.state_dict()}, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_an_expanded_target_is_refused_and_lazy_views_round_trip(tmp_path):
    rows = torch.arange(6.0).reshape(2, 3)
    z = torch.tensor([1 + 2j, 3 - 4j])
    # Conjugate and negative views hold other values in their memory: saved as they read. Before, a
    # RuntimeError from numpy() naming no key.
    gt.save({"rows": rows, "z": z.conj(), "neg": torch.tensor([1.0, -2.0])._neg_view()}, tmp_path / "c")
    assert np.array_equal(gs.read_array(tmp_path / "c", "z"), np.array([1 - 2j, 3 + 4j], np.complex64))
    assert np.array_equal(gs.read_array(tmp_path / "c", "neg"), np.array([-1.0, 2.0], np.float32))
    row = torch.zeros(3)
    # Before, the load returned with the last row in both: [3, 4, 5].
    with pytest.raises(gs.LayoutError, match=r"elements share memory .*'rows'"):
        gt.load({"rows": row.expand(2, 3), "z": torch.zeros(2, dtype=torch.complex64),
                 "neg": torch.zeros(2)}, tmp_path / "c")
    assert row.tolist() == [0.0, 0.0, 0.0]
    into_z, into_neg = torch.zeros(2, dtype=torch.complex64).conj(), torch.zeros(2)._neg_view()
    gt.load({"rows": torch.zeros(2, 3), "z": into_z, "neg": into_neg}, tmp_path / "c")
    assert torch.equal(into_z, z.conj()) and torch.equal(into_neg, torch.tensor([-1.0, 2.0]))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated, still made
def test_sparse_quantized_and_unstored_dtypes_are_named_by_their_keys(tmp_path):
    # Before: numpy's TypeError for a sparse tensor, and "unsupported tensor dtype" for the others,
    # neither naming the key.
    state = {"dense": torch.ones(2), "sparse": torch.eye(3).to_sparse(),
             "quantized": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
             "scales": torch.ones(4).to(torch.float8_e8m0fnu)}
    with pytest.raises(gs.LayoutError, match=r"(?s)sparse: a torch.sparse_coo tensor: only dense .*to_dense\(\).*"
                                             r"quantized: dtype torch.qint8 is not one the format stores.*"
                                             r"scales: dtype torch.float8_e8m0fnu"):
        gt.save(state, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    gt.save({"dense": torch.ones(2), "sparse": torch.ones(3)}, tmp_path / "d")
    with pytest.raises(gs.MismatchError, match=r"sparse: a torch.sparse_coo tensor"):
        gt.load({"dense": torch.zeros(2), "sparse": torch.zeros(3).to_sparse()}, tmp_path / "d")


class NamedOptimizer(torch.optim.Optimizer, Stateful):
    """As torchtitan's OptimizersContainer: an Optimizer that declares itself
    Stateful, its state dict keyed by parameter name."""

    def __init__(self, model):
        self.model, self.inner = model, torch.optim.AdamW(model.parameters(), lr=0.01)
        torch.optim.Optimizer.__init__(self, list(model.parameters()), {})

    def step(self, closure=None):
        return self.inner.step(closure)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.inner)

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.inner, state_dict)


@pytest.mark.parametrize("flattened", [False, True])
def test_an_optimizer_that_is_stateful_saves_and_loads_as_dcp_does(tmp_path, flattened):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = NamedOptimizer(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    def state(m, o):  # flattened: model keys at the top, as torchtitan's CheckpointManager passes them
        return {**m.state_dict(), "optimizer": o} if flattened else {"model": m.state_dict(), "optimizer": o}

    gt.save(state(model, opt), tmp_path / "c")
    model2 = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt2 = NamedOptimizer(model2)
    model2(torch.randn(2, 4)).sum().backward()
    opt2.step()  # state of its own, to be replaced
    sd = state(model2, opt2)
    assert gt.load(sd, tmp_path / "c") == gt.LoadedKeys([], [])
    model2.load_state_dict({k: v for k, v in (sd if flattened else sd["model"]).items() if k != "optimizer"})
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(opt.inner.state[a]["exp_avg_sq"], opt2.inner.state[b]["exp_avg_sq"]), n


def test_a_plain_optimizer_module_or_non_dict_is_refused_with_what_to_pass(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(gs.LayoutError, match=r"optim: a torch optimizer's own state dict .*get_optimizer_state_dict"):
        gt.save({"model": model.state_dict(), "optim": torch.optim.SGD(model.parameters(), lr=1.0)},
                tmp_path / "a")
    with pytest.raises(gs.LayoutError, match=r"net: a module: pass its state_dict"):
        gt.save({"net": model}, tmp_path / "b")
    with pytest.raises(gs.LayoutError, match=r"a state dict is a dict .* got a str"):
        gt.save("a string", tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with pytest.raises(gs.LayoutError, match=r"got a list"):
        gt.load([torch.zeros(1)], tmp_path / "c")


def test_strict_by_default_and_the_keys_reported_either_way(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    gt.save({"model": model.state_dict(), "step": 4}, tmp_path / "c")
    lacking = nn.Sequential(nn.Linear(4, 3))  # no norm: the checkpoint's 1.weight and 1.bias are read by nothing
    with pytest.raises(gs.MismatchError, match=r"(?s)no rank's state dict asks for.*'model.1.bias'.*'model.1.weight'"):
        gt.load({"model": lacking.state_dict(), "step": 0}, tmp_path / "c")
    sd = {"model": lacking.state_dict(), "extra": torch.full((2,), 7.0)}
    got = gt.load(sd, tmp_path / "c", strict=False)
    assert got == gt.LoadedKeys(["extra"], ["model.1.bias", "model.1.weight", "step"])
    assert torch.equal(sd["model"]["0.weight"], model[0].weight.detach())
    assert torch.equal(sd["extra"], torch.full((2,), 7.0))


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_load_while_an_async_save_is_in_flight_waits_for_it_instead_of_crossing_its_collectives(tmp_path, mode):
    # Before: the load's collectives and the save's background ones crossed on the shared gloo group (a hang,
    # or gloo aborting the process).
    for got in values_of(run(2, "load_during_async_save_job", str(tmp_path / "r"), path=str(tmp_path), mode=mode)):
        assert got == {"first": True, "second": True}


@pytest.mark.parametrize("saver", [None, "process"])
def test_dtensor_state_dicts_reshard_between_placements(tmp_path, saver):
    # saver: as DCP's async_save, the parameters changed on every rank while the writer writes.
    ckpt, dump = str(tmp_path / "ckpt"), str(tmp_path / "held.npz")
    values_of(run(2, "state_dict_save_job", str(tmp_path / "s"), path=ckpt, dump=dump, saver=saver))
    held = dict(np.load(dump))
    for got in values_of(run(2, "state_dict_load_job", str(tmp_path / "l"), path=ckpt)):
        assert np.array_equal(np.array(got["w"], np.float32), held["w"])
        assert np.array_equal(np.array(got["b"], np.float32), held["b"])
        assert np.array_equal(np.array(got["exp_avg.w"], np.float32), held["exp_avg.w"])
        assert got["lr"] == 0.1 and got["step"] == 7
    # And into one process, plain tensors.
    assert np.array_equal(gs.read_array(ckpt, "model.w"), held["w"])


def test_dtensors_on_the_meta_device_load_as_dcp_loads_them(tmp_path):
    # torchtitan's order (a model built on the meta device, sharded) with the load in place of the
    # initialization: each DTensor is made on its mesh's device with its own placements, as DCP makes it.
    outcomes = values_of(run(2, "meta_state_dict_job", str(tmp_path / "r"), path=str(tmp_path / "gs"),
                             dcp_path=str(tmp_path / "dcp")))
    full = np.arange(30, dtype=np.float32).reshape(6, 5)
    for rank, got in enumerate(outcomes):
        assert got["ours"] == got["dcp"], rank
        assert np.array_equal(np.array(got["ours"]["w"]), full)
        assert np.array_equal(np.array(got["ours"]["w_local"]), full[:, :3] if rank == 0 else full[:, 3:])
        assert got["ours"]["w_device"] == got["ours"]["scale_device"] == "cpu"
        assert got["ours"]["scale"] == [0.5] * 3


def test_dtensors_on_a_tp_sub_mesh_with_data_parallel_copies_save_once(tmp_path):
    # Each DTensor's mesh is the "tp" half of a (dp=2, tp=2) world; the other half
    # holds a copy. DCP writes one of them; so must we, and the load must see it.
    ckpt, ref, dump = str(tmp_path / "ckpt"), str(tmp_path / "dcp"), str(tmp_path / "held.npz")
    values_of(run(4, "tp_by_dp_job", str(tmp_path / "s"), path=ckpt, dcp_path=ref, dump=dump))
    held = dict(np.load(dump))
    for name, key in [("w", "model.w"), ("b", "model.b"), ("counts", "model.counts"),
                      ("exp_avg.w", "optim.state.w.exp_avg"), ("exp_avg_sq.b", "optim.state.b.exp_avg_sq")]:
        assert np.array_equal(gs.read_array(ckpt, key), held[name]), key
    # And into one process, as DCP loads its own save of the same state.
    from torch.distributed.checkpoint import load as dcp_load

    model = {"w": torch.zeros(8, 3), "b": torch.zeros(3), "counts": torch.zeros(4)}
    theirs = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    gt.load({"model": model}, ckpt, strict=False)
    dcp_load(theirs, checkpoint_id=ref)
    assert all(torch.equal(model[k], theirs["model"][k]) for k in model)



def test_what_only_some_ranks_hold_is_saved_from_them(tmp_path):
    # Pipeline stages: each rank holds keys the other does not (tensors, JSON values,
    # bytes); every key is stored once, from the lowest rank that holds it.
    ckpt = str(tmp_path / "ckpt")
    values_of(run(2, "stages_job", str(tmp_path / "s"), path=ckpt))
    state = {"model": {"layers.0.weight": torch.zeros(2, 3), "layers.1.weight": torch.zeros(2, 3),
                       "step": torch.tensor(0)},
             "optim": {"layers.0.lr": 0.0, "layers.1.lr": 0.0, "rng": b""}, "stage": {"0": b"", "1": b""},
             "extra": {"0": io.BytesIO(), "1": None}, "epoch": 0, "shapes": {"0": None, "1": None}, "both": None}
    stream = state["extra"]["0"]
    assert gt.load(state, ckpt) == gt.LoadedKeys([], [])
    assert torch.equal(state["model"]["layers.0.weight"], torch.full((2, 3), 1.0))
    assert torch.equal(state["model"]["layers.1.weight"], torch.full((2, 3), 2.0))
    assert state["model"]["step"].item() == 5 and state["epoch"] == 2
    assert state["optim"] == {"layers.0.lr": 0.1, "layers.1.lr": 0.2, "rng": bytes([9, 7])}
    assert state["stage"] == {"0": bytes([0, 7]), "1": bytes([1, 7])}
    assert state["extra"]["0"] is stream  # filled in place
    assert [(s.getvalue(), s.tell()) for s in state["extra"].values()] == [(bytes([0, 5, 5]), 1), (bytes([1, 5, 5]), 2)]
    assert state["shapes"] == {"0": (0, "x"), "1": (1, "x")} and type(state["both"]) is list
    assert state["both"] == [3, (1, 2)]  # rank 0's, its tuple where rank 0 had it


def test_a_process_group_as_comm_saves_and_loads_over_its_ranks_only(tmp_path):
    # DCP's process_group: two replica groups of an HSDP mesh each save a checkpoint of their own,
    # concurrently, and load the other's under another placement.
    outcomes = values_of(run(4, "replica_groups_job", str(tmp_path / "s"), root=str(tmp_path)))
    assert outcomes == [{"equal": True, "row": 1 - r // 2, "blob": [1 - r // 2], "reused": True} for r in range(4)]
    for row in range(2):
        stored = gs.read_metadata(tmp_path / f"row{row}").tensors["w"]
        assert [r.box.offset for r in stored.regions] == [(0, 0), (4, 0)]  # each row's 2 ranks wrote a half
        assert np.array_equal(gs.read_array(tmp_path / f"row{row}", "w"), np.arange(32.0).reshape(8, 4) + 100 * row)


def saved_on_two_nodes_then_resumed_on_the_second(tmp_path, job, step):
    """``job`` saving on 2 nodes of 2 gloo ranks (asynchronously, persisted up
    to ``step``), then, the first node's directory deleted, resuming on the
    second node's 2 ranks: their outcomes."""
    saved = values_of(run(4, job, str(tmp_path / "s"), root=str(tmp_path), save=True))
    assert saved == [{"mode": "process", "persisted": step}] * 4
    shutil.rmtree(tmp_path / "local" / "node0")
    return values_of(run(2, job, str(tmp_path / "r"), root=str(tmp_path), save=False))


def test_a_state_dict_saved_into_the_tiers_recovers_from_the_copies_onto_another_mesh(tmp_path):
    # FSDP2-over-TP DTensors saved asynchronously into a TieredManager by 2 nodes of 2 ranks; the
    # first node lost, the second alone recovers them (its copy of the first node's arrays
    # included, all in its own directory) on a mesh of 2 with other placements, as
    # gt.load(state, manager.open_latest()).
    for o in saved_on_two_nodes_then_resumed_on_the_second(tmp_path, "tier_state_dict_job", step=7):
        assert o["w"] and o["m"] and o["step"] == 7 and o["rng"] and o["bytes_persistent"] == 0, o
        assert o["bytes_local"] > 0 and o["bytes_peer"] == 0, o


def test_a_lora_state_dict_recovers_from_the_tier_copies_of_its_base_and_resumes_on_another_cut(tmp_path):
    # 2 nodes of 2 gloo ranks save a frozen weight in row quarters (step 1), then an adapter step
    # referencing it, asynchronously; the first node lost, the second alone recovers both in columns
    # from its own directory (its copies of step 1 and of the first node's arrays), and its next
    # save, given the digests of what it loaded, references the weight in the base's row cut.
    out = saved_on_two_nodes_then_resumed_on_the_second(tmp_path, "tier_lora_job", step=2)
    for o in out:
        assert o["w"] and o["lora"] and o["bytes_persistent"] == 0 and o["bytes_local"] > 0, o
        assert o["w_referenced_in_the_base_cut"], o
    assert sum(o["bytes_written"] for o in out) == 2 * 8 * 4  # the adapter alone (written by one rank)


def test_a_tiered_save_of_a_state_dict_refuses_what_the_tiers_cannot_do(tmp_path):
    manager = gt.TieredManager(tiers=[gs.LocalTier(str(tmp_path / "local")), str(tmp_path / "persistent")])
    for bad in ({"overwrite": True}, {"kvstore": {"driver": "memory"}}):
        with pytest.raises(gs.LayoutError, match="a TieredManager's save takes none of"):
            gt.save({"w": torch.ones(2)}, manager.target(1), **bad)
    assert not (tmp_path / "local").exists() or not any((tmp_path / "local").iterdir())
    gt.save({"w": torch.ones(2), "n": (1, 2)}, manager.target(1), pack_below=1 << 20)
    manager.wait()
    assert gs.read_metadata(manager.path(1)).tensors["w"].regions[0].byte_offset is not None  # packed
    state = {"w": torch.zeros(2), "n": None}
    gt.load(state, manager.open_latest())
    assert torch.equal(state["w"], torch.ones(2)) and state["n"] == (1, 2)
    assert gs.read_metadata(manager.path(1)).tensors["w"].global_shape == (2,)  # drained to the persistent tier


def test_a_lora_state_dict_in_the_tiers_references_its_frozen_base(tmp_path):
    # A fine-tune's frozen weights saved once into the tiers; later steps reference them in that
    # persisted step (gt.save(..., base=, frozen=)), and the tiers hold only the adapter.
    manager = gt.TieredManager(tiers=[gs.LocalTier(str(tmp_path / "local")), str(tmp_path / "persistent")],
                               keep_last=1)
    base_w, saver = torch.arange(64.0).reshape(8, 8), gs.AsyncSaver()
    gt.save({"model": {"w": base_w, "lora_a": torch.zeros(2, 8)}}, manager.target(1), saver=saver)
    for step in (2, 3):
        adapter = torch.full((2, 8), float(step))
        gt.save({"model": {"w": base_w, "lora_a": adapter}}, manager.target(step), saver=saver,
                base=manager.path(1), frozen=["model.w"])
    manager.wait()
    md = gs.read_metadata(manager.path(3))
    assert [b.root for b in md.bases] == ["iter_0000001"] and md.tensors["model.w"].regions[0].base == 0
    assert not (tmp_path / "persistent" / "iter_0000002").exists()  # pruned; step 1 kept as step 3's base
    held = parse_holdings((tmp_path / "local" / "iter_0000003" / "holdings.json").read_bytes()).holds
    assert held == set(md.paths()) and not any("model.w" in p for p in held)
    state = {"model": {"w": torch.zeros(8, 8), "lora_a": torch.zeros(2, 8)}}
    found = manager.open_latest()
    gt.load(state, found)
    assert torch.equal(state["model"]["w"], base_w) and torch.equal(state["model"]["lora_a"], torch.full((2, 8), 3.0))
    # the base's bytes too from the node's tier copy of step 1 (kept while step 3's copy references it)
    assert found.recovery.bytes_persistent == 0 and found.recovery.bytes_local == (64 + 16) * 4
    # Resumed: what is still as loaded from step 1 (unchanged=, no key named) is referenced there again.
    known = region_digests({"model.w": state["model"]["w"]}, {"model.w"})
    stats = gs.IOStats()
    gt.save({"model": {"w": state["model"]["w"], "lora_a": torch.full((2, 8), 4.0)}}, manager.target(4),
            base=manager.path(1), unchanged=known, stats=stats)
    manager.wait()
    md = gs.read_metadata(manager.path(4))
    assert md.tensors["model.w"].regions[0].base == 0 and md.tensors["model.lora_a"].regions[0].base is None
    assert stats.bytes_written == 16 * 4 and not any("model.w" in p for p in md.paths())


def test_a_process_group_the_rank_is_not_in_is_refused():
    import torch.distributed as dist

    with pytest.raises(ValueError, match="not in"):
        gt.resolve_comm(dist.GroupMember.NON_GROUP_MEMBER)


def test_a_rank_on_two_meshes_of_the_same_dims_is_named(tmp_path):
    outcomes = values_of(run(3, "overlapping_meshes_job", str(tmp_path / "s"), path=str(tmp_path / "c")))
    assert outcomes[1].startswith("LayoutError") and "b: on a mesh of dims and shape" in outcomes[1], outcomes[1]
    assert "name the two meshes' dims apart" in outcomes[1]
    assert all(o.startswith("CommError") for o in (outcomes[0], outcomes[2])), outcomes
    assert not (tmp_path / "c" / "metadata.json").exists()


@given(pp=st.integers(1, 3), dp=st.integers(1, 4), tp=st.integers(1, 4), fsdp=st.booleans())
def test_each_key_is_written_by_one_holder(pp, dp, tp, fsdp):
    # pp x dp x tp ranks, as a torchtitan run holds its state: each stage's weights on its
    # "tp" meshes (one per data-parallel copy) or, with fsdp, on the stage's ("dp", "tp")
    # mesh; its optimizer's step counts as plain tensors, and one key every rank holds.
    # Exactly one holder of each key writes it: the lowest rank, or the lowest mesh.
    world = pp * dp * tp
    on = {}  # rank -> {key: (kind, holder)}
    for rank in range(world):
        stage, d = rank // (dp * tp), rank // tp % dp
        meshes = [(["tp"], [tp], (stage * dp + d) * tp)] + ([(["dp", "tp"], [dp, tp], stage * dp * tp)] if fsdp else [])
        names, shape, low = meshes[-1]
        kind, holder = (json.dumps([names, shape]), low) if int(np.prod(shape)) < world else (None, None)
        on[rank] = {f"layers.{stage}.step": ("", rank), "rng": ("", rank)}
        if kind is not None:  # a mesh over the whole world has no copies: not described
            on[rank][f"layers.{stage}.w"] = (kind, holder)
    lists = {json_digest(sorted((k, kind) for k, (kind, _) in keys.items())):
             sorted((k, kind) for k, (kind, _) in keys.items()) for keys in on.values()}
    digests = [json_digest(sorted((k, kind) for k, (kind, _) in on[r].items())) for r in range(world)]
    holders = [{kind: h for kind, h in on[r].values()} for r in range(world)]
    writers: dict[str, set[int]] = {}
    for rank in range(world):
        replicas = replica_keys(rank, digests, holders, lists)
        assert replicas <= set(on[rank])
        for key in set(on[rank]) - replicas:
            writers.setdefault(key, set()).add(on[rank][key][1])
    for key in {k for keys in on.values() for k in keys}:
        lowest = min(h for keys in on.values() for k, (_, h) in keys.items() if k == key)
        assert writers[key] == {lowest}, (key, writers[key])


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8,
           torch.bool, torch.complex64]


@st.composite
def _tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype.is_floating_point or dtype.is_complex:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    else:
        t = torch.randint(0, 100, shape, generator=g).to(dtype)
    return t.mT if t.dim() >= 2 and draw(st.booleans()) else t  # non-contiguous views too


@st.composite
def _arrays(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_, np.complex64]))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    values = np.random.default_rng(draw(st.integers(0, 2**31))).integers(-9, 9, shape)
    return values.astype(dtype)


@st.composite
def _streams_drawn(draw):
    stream = io.BytesIO(draw(st.binary(max_size=40)))
    stream.seek(draw(st.integers(0, len(stream.getvalue()))))
    return stream


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8) | st.floats(allow_nan=False),
    # (No empty dicts: DCP saves none inside a list, then asks for it at load.)
    # Tuples too (random.getstate() is one): JSON keeps them as lists, and the load gives them back as tuples.
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text("xyz", min_size=1, max_size=2), inner, min_size=1, max_size=3),
    max_leaves=6)
_NAMES = st.text("abcdefgh", min_size=1, max_size=3)
_LEAVES = _tensors() | st.binary(max_size=20) | _streams_drawn() | _arrays() | _JSON
_STATES = st.dictionaries(_NAMES, st.recursive(
    _LEAVES, lambda inner: st.dictionaries(_NAMES, inner, min_size=1, max_size=3) | st.lists(_tensors(), min_size=1,
                                                                                            max_size=3),
    max_leaves=8), min_size=1, max_size=5)


def _target(value):
    """What a loading job holds before the load: the same containers, tensors of its own values,
    empty streams, None for every other leaf."""
    if torch.is_tensor(value):
        return torch.zeros_like(value).contiguous()
    if isinstance(value, np.ndarray):
        return np.zeros_like(value)
    if isinstance(value, dict):
        return {k: _target(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_target(v) for v in value]
    return io.BytesIO() if isinstance(value, io.BytesIO) else None


def _plain_view(value):
    if torch.is_tensor(value):
        return ("tensor", value.dtype, tuple(value.shape), value.reshape(-1).contiguous().view(torch.uint8).tolist()
                if value.numel() else [])
    if isinstance(value, io.BytesIO):
        return ("stream", value.getvalue(), value.tell())
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return {k: _plain_view(v) for k, v in value.items()}
    if isinstance(value, list) and any(torch.is_tensor(v) for v in value):
        return [_plain_view(v) for v in value]
    return value


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@settings(max_examples=40)
@given(state=_STATES)
def test_any_state_dict_loads_as_dcp_loads_it(tmp_path_factory, state):
    # DCP as the oracle: tensors of every dtype (non-contiguous, 0-d, empty), bytes, streams, numpy
    # arrays and JSON values, nested in dicts and lists of tensors, come back equal to what was saved
    # and to what DCP's own load of the same state gives.
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("s")
    note(repr(state))
    expected = _plain_view(state)
    gt.save(state, root / "gs")
    dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    ours, theirs = _target(state), _target(state)
    assert gt.load(ours, root / "gs") == gt.LoadedKeys([], [])
    dcp.load(theirs, checkpoint_id=str(root / "dcp"), no_dist=True)
    assert _plain_view(ours) == expected
    assert _plain_view(theirs) == expected


@pytest.mark.parametrize("saver", [None, "process"])
def test_copies_that_drifted_apart_are_refused_with_check_replicas(tmp_path, saver):
    # A plain tensor is taken as equal on every rank that holds it, a replicated DTensor and data-parallel
    # replicas too: unchecked, a save keeps one copy. check_replicas=True compares them before anything is
    # written, on both ranks, sync and async alike (the async save raises before it returns).
    for got in values_of(run(2, "replica_drift_job", str(tmp_path / "r"), path=str(tmp_path), saver=saver)):
        assert "'model.running_mean' [0:4]: copies differ, 2 values held by: rank 0 (main); rank 1" in \
            got["state_dict"], got
        assert "'model.w'" not in got["state_dict"] and "'model.norm'" not in got["state_dict"]
        assert "'bias' [0:2]: copies differ" in got["checkpoint"] and "'weight'" not in got["checkpoint"], got
        assert not got["state_dict_committed"] and not got["checkpoint_committed"]
