"""torchtitan 0.3 as the oracle for DCP-style state: its own llama3
``debugmodel``, ``ModelWrapper``, ``OptimizersContainer`` and
``LRSchedulersContainer``, passed directly and flattened as its
CheckpointManager passes them, saved and loaded with globalshard and with
torch DCP; every model and optimizer tensor equal to DCP's load. Saved in the
background too (``saver=`` against DCP's ``async_save``) while a training
step runs: both hold the state of the call."""

import json

import pytest

pytest.importorskip("torchtitan.models.llama3")  # needs triton installed to import

import torch
from torch.distributed import checkpoint as dcp
from torchtitan.components.checkpointer import ModelWrapper
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.models.llama3 import model_registry

import globalshard as gs
import globalshard_torch as gt


def trainer(seed, steps):
    """A debugmodel with its optimizers and schedulers, after ``steps`` steps of random gradients."""
    torch.manual_seed(seed)
    model = model_registry("debugmodel", attn_backend="flex").model.build()
    config = default_adamw(lr=1e-3)
    config.implementation = "for-loop"  # "fused" is CUDA's
    optimizers = config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizers.step()
        schedulers.step()
    return model, optimizers, schedulers


def states(model, optimizers, schedulers, flattened):
    if flattened:  # as torchtitan's CheckpointManager hands them to DCP: model keys at the top
        return {**ModelWrapper(model).state_dict(), "optimizer": optimizers, "lr_scheduler": schedulers}
    return {"model": ModelWrapper(model), "optimizer": optimizers, "lr_scheduler": schedulers}


@pytest.mark.parametrize("flattened", [False, True])
def test_torchtitans_own_containers_round_trip_as_dcp_loads_them(tmp_path, flattened):
    saved = trainer(0, steps=2)
    gt.save(states(*saved, flattened), tmp_path / "ours")
    dcp.save(states(*saved, flattened), checkpoint_id=str(tmp_path / "dcp"))

    ours, theirs = trainer(5, steps=1), trainer(7, steps=1)  # state of their own, to be replaced
    ours_state = states(*ours, flattened)
    assert gt.load(ours_state, tmp_path / "ours") == gt.LoadedKeys([], [])
    if flattened:  # the model's tensors were filled in the flat dict: hand them to the model
        ours[0].load_state_dict({k: v for k, v in ours_state.items() if torch.is_tensor(v)})
    theirs_state = states(*theirs, flattened)
    dcp.load(theirs_state, checkpoint_id=str(tmp_path / "dcp"))
    if flattened:
        theirs[0].load_state_dict({k: v for k, v in theirs_state.items() if torch.is_tensor(v)})

    params = list(saved[0].named_parameters())
    assert len(params) > 40
    for (name, a), b, c in zip(params, ours[0].parameters(), theirs[0].parameters()):
        assert torch.equal(b, c) and torch.equal(b, a), name
    ours_opt, theirs_opt, saved_opt = (t[1].state_dict() for t in (ours, theirs, saved))
    assert set(ours_opt) == set(theirs_opt) and len(ours_opt) > 3 * len(params)
    for key, value in theirs_opt.items():
        if torch.is_tensor(value):
            assert torch.equal(ours_opt[key], value) and torch.equal(value, saved_opt[key]), key
        else:
            assert ours_opt[key] == value, key
    assert ours[2].state_dict() == theirs[2].state_dict() == saved[2].state_dict()


def test_an_async_save_holds_what_dcps_async_save_holds_while_training_goes_on(tmp_path):
    saved = trainer(0, steps=2)
    saver = gs.AsyncSaver("process")
    gt.save(states(*saved, True), tmp_path / "ours", saver=saver)
    future = dcp.async_save(states(*saved, True), checkpoint_id=str(tmp_path / "dcp"))
    for p in saved[0].parameters():  # a training step while both write
        p.grad = torch.randn_like(p)
    saved[1].step()
    saved[2].step()
    saver.wait()
    future.result()

    ours, theirs = trainer(5, steps=1), trainer(7, steps=1)
    ours_state, theirs_state = states(*ours, True), states(*theirs, True)
    assert gt.load(ours_state, tmp_path / "ours") == gt.LoadedKeys([], [])
    dcp.load(theirs_state, checkpoint_id=str(tmp_path / "dcp"))
    for model, state in ((ours[0], ours_state), (theirs[0], theirs_state)):
        model.load_state_dict({k: v for k, v in state.items() if torch.is_tensor(v)})
    moved = 0
    for (name, a), b, c in zip(saved[0].named_parameters(), ours[0].parameters(), theirs[0].parameters()):
        assert torch.equal(b, c), name
        moved += not torch.equal(a, b)  # the step after the save is not in either checkpoint
    assert moved == len(list(saved[0].parameters()))
    ours_opt, theirs_opt = ours[1].state_dict(), theirs[1].state_dict()
    assert set(ours_opt) == set(theirs_opt)
    for key, value in theirs_opt.items():
        assert torch.equal(ours_opt[key], value) if torch.is_tensor(value) else ours_opt[key] == value, key
    assert ours[2].state_dict() == theirs[2].state_dict() != saved[2].state_dict()


def test_per_pattern_param_groups_of_two_optimizer_classes_round_trip_as_dcp_loads_them(tmp_path):
    # torchtitan 0.3's ParamGroupConfig (its qwen3_debugmodel_moe_param_groups): an AdamW without weight decay
    # for the embeddings and output, an Adam for the MoE routers, an AdamW for the rest; one container.
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan_models import spec

    betas = {"betas": (0.9, 0.95), "eps": 1e-8, "foreach": False}
    config = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"(?:tok_embeddings|output)\.", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 8e-4, "weight_decay": 0.0, **betas}),
        ParamGroupConfig(pattern=r"\.router\.gate\.", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-4, **betas}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 8e-4, "weight_decay": 0.1, **betas})])

    def moe(seed):
        torch.manual_seed(seed)
        model = spec("qwen3", ParallelismConfig()).model.build()
        optimizers = config.build(model_parts=[model])
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizers.step()
        return model, optimizers

    saved = moe(0)
    assert [type(o).__name__ for o in saved[1].optimizers] == ["AdamW", "Adam"]
    state = {**ModelWrapper(saved[0]).state_dict(), "optimizer": saved[1]}
    gt.save(state, tmp_path / "ours")
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    loaded = {}
    for who, seed in (("ours", 5), ("dcp", 7)):
        model, optimizers = moe(seed)
        fresh = {**ModelWrapper(model).state_dict(), "optimizer": optimizers}
        if who == "ours":
            assert gt.load(fresh, tmp_path / "ours") == gt.LoadedKeys([], [])
        else:
            dcp.load(fresh, checkpoint_id=str(tmp_path / "dcp"))
        loaded[who] = optimizers.state_dict()
    ours, theirs, before = loaded["ours"], loaded["dcp"], saved[1].state_dict()
    assert set(ours) == set(theirs) == set(before) and len(theirs) > 300
    for key, value in theirs.items():
        if torch.is_tensor(value):
            assert torch.equal(ours[key], value) and torch.equal(value, before[key]), key
        else:
            assert ours[key] == value == before[key], key
    assert theirs["param_groups.layers.0.moe.router.gate.weight.lr"] == 1e-4  # the routers' own Adam


def test_our_checkpointer_refuses_to_pass_over_newer_dcp_steps_in_its_folder(tmp_path):
    # A run that switches to our checkpointer in a folder torchtitan's own one wrote: resuming from an older
    # step, or starting afresh, would silently lose the training of the newer DCP steps.
    from types import SimpleNamespace

    from globalshard_torch.torchtitan import CheckpointManager

    folder = tmp_path / "checkpoint"
    gt.save({"w": torch.ones(2)}, folder / "step-3")
    (folder / "step-2").mkdir()
    (folder / "step-2" / ".metadata").write_bytes(b"dcp")
    (folder / "step-4").mkdir()  # a save that never committed: no checkpoint
    assert CheckpointManager._find_load_step(SimpleNamespace(folder=str(folder))) == 3
    (folder / "step-5").mkdir()
    (folder / "step-5" / ".metadata").write_bytes(b"dcp")
    with pytest.raises(ValueError, match=r"step-5 holds a DCP checkpoint, newer than any globalshard one .*latest: 3"):
        CheckpointManager._find_load_step(SimpleNamespace(folder=str(folder)))


def test_our_checkpointers_purge_keeps_the_steps_kept_ones_reference(tmp_path, caplog):
    # torchtitan's retention (keep_latest_k newest steps) would delete a LoRA run's first step, whose frozen base
    # the later steps reference (spec section 2.3). A step it cannot read stops the purge rather than guess.
    import queue
    from types import SimpleNamespace

    from globalshard_torch.torchtitan import CheckpointManager

    folder = tmp_path / "checkpoint"
    gt.save({"base": torch.ones(4), "adapter": torch.zeros(2)}, folder / "step-1")
    for step in (2, 3):
        gt.save({"base": torch.ones(4), "adapter": torch.full((2,), float(step))}, folder / f"step-{step}",
                base=folder / "step-1", frozen=["base"])
    (folder / "step-4").mkdir()  # in flight: not committed yet
    def manager(where=folder, saving=("", None)):  # as a run's checkpointer: it reads each metadata.json once
        return SimpleNamespace(folder=str(where), keep_latest_k=2, _should_purge=lambda: True,
                               purge_thread=object(), purge_queue=queue.Queue(), _bases_of={}, _saving=saving)

    running = manager()
    CheckpointManager._purge_stale_checkpoints(running)
    assert list(running.purge_queue.queue) == [str(folder / "step-2")]
    (folder / "step-3" / "metadata.json").write_text("{")
    running = manager()  # a run started afterwards
    CheckpointManager._purge_stale_checkpoints(running)
    assert running.purge_queue.empty() and "not purging" in caplog.text
    # torchtitan purges once a save has begun: the step still being saved in the background (step-3) will
    # reference step-1, which no committed step kept (step-2) does. It is kept; forgotten, it would go.
    other = tmp_path / "resumed"
    gt.save({"base": torch.ones(4)}, other / "step-1")
    gt.save({"base": torch.ones(4)}, other / "step-2")
    (other / "step-3").mkdir()
    for saving, purged in ((("step-3", "step-1"), []), (("", None), ["step-1"])):
        running = manager(other, saving)
        CheckpointManager._purge_stale_checkpoints(running)
        assert list(running.purge_queue.queue) == [str(other / n) for n in purged], saving


def test_our_checkpointer_bases_a_step_on_the_step_holding_the_bytes(tmp_path, caplog):
    # The step holding most of what the previous step references (never a chain of steps), or the previous
    # step itself; nothing when no parameter is frozen; everything written when the previous step is damaged.
    from types import SimpleNamespace

    from torchtitan.components.checkpointer import MODEL

    from globalshard_torch.torchtitan import CheckpointManager

    folder = tmp_path / "checkpoint"
    model = torch.nn.Linear(2, 2)
    model.weight.requires_grad_(False)
    manager = SimpleNamespace(states={MODEL: ModelWrapper(model)}, reference_unchanged=True,
                              _committed_steps=CheckpointManager._committed_steps)
    manager._has_frozen = lambda: CheckpointManager._has_frozen(manager)

    def base(step):
        return CheckpointManager._base(manager, str(folder / f"step-{step}"))

    assert base(1) == (None, True)  # the first: digests recorded, so that later steps can reference it
    gt.save({"w": torch.ones(4), "a": torch.zeros(2)}, folder / "step-1", digests=True)
    assert base(2) == (str(folder / "step-1"), True)
    gt.save({"w": torch.ones(4), "a": torch.ones(2)}, folder / "step-2", base=folder / "step-1")
    (folder / "step-3").mkdir()  # not committed
    assert base(3) == (str(folder / "step-1"), True) == base(4)
    assert base(2) == (str(folder / "step-1"), True)  # a step saved again: the steps below it
    manager.reference_unchanged = False
    assert base(4) == (None, None)
    manager.reference_unchanged = True
    model.weight.requires_grad_(True)
    assert base(4) == (None, None)
    model.weight.requires_grad_(False)
    (folder / "step-2" / "metadata.json").write_text("{")
    assert base(4) == (None, True) and "references no base" in caplog.text


@pytest.mark.parametrize("name", ["qwen3_tied_lora", "gpt_oss_lora"])
def test_a_torchtitan_model_with_lora_exports_merged_with_its_logits(tmp_path, name):
    # torchtitan's LoRAConverter on a Qwen3 (its fused wqkv, wo, w1, w3, w2 of each layer) or a gpt-oss (wqkv
    # and wo: its experts are not Linear modules), its adapters as training leaves them, saved (wqkv's weight
    # as wq, wk, wv, its adapter fused) and exported by the shipped mapping: transformers runs the merged model
    # with torchtitan's logits.
    import transformers
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan_jobs import logits
    from torchtitan_models import spec

    from globalshard.hf import ExportError, NameMapping, export

    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec(name, ParallelismConfig()).model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for n, p in model.named_parameters():
            if "lora_b" in n:  # torchtitan starts B at zero; training moves it
                p.normal_(0.0, 0.02)
            elif name == "gpt_oss_lora":  # weights of a trained model's scale (its initial ones give flat logits)
                p.normal_(1.0 if n.endswith("norm.weight") else 0.0, 0.02 if "lora_a" in n else 0.1)
    state = {k: v.clone() for k, v in ModelWrapper(model).state_dict().items()}
    gt.save(state, tmp_path / "ckpt")
    if name == "gpt_oss_lora":  # its expert bias let go (zero after init_weights), as Hugging Face's GptOss has none
        (tmp_path / "map.json").write_text(json.dumps({"extends": "torchtitan_gpt_oss",
                                                       "skip": [r"layers\..*\.moe\.expert_bias_E"]}))
        mapping, params, merging, adapted = str(tmp_path / "map.json"), {"heads": 64, "kv_heads": 8, "top_k": 4}, 8, 2
    else:
        mapping, params, merging, adapted = "torchtitan_qwen3", {"heads": 16, "kv_heads": 8}, 14, 5
    # Asked for once, not for each of the 2 layers' adapted tensors (wq, wk, wv, wo, and w1, w3, w2).
    with pytest.raises(ExportError, match=r"params 'lora_scale' is not set: .*lora_a\.weight.*"
                                          rf"\({merging} tensors merge an adapter scaled by it\).*--param lora_scale="):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load(mapping, params))
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                 mapping=NameMapping.load(mapping, params | {"lora_scale": 2.0}))  # alpha 16 / rank 8
    assert out["merged"] == sorted(k for k in state if "lora_" in k) and len(out["merged"]) == 2 * adapted * 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf((torch.arange(2 * 16).reshape(2, 16) * 37) % 2048).logits
    scale = theirs.abs().max().item()
    tuned = logits([model], name, state)
    dropped = logits([model], name, {k: torch.zeros_like(v) if "lora_b" in k else v for k, v in state.items()})
    assert (tuned - theirs).abs().max().item() / scale < 1e-5 < 100 * 1e-5 < \
        (dropped - theirs).abs().max().item() / scale
