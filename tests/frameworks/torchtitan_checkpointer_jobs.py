"""torchtitan's trainer loop around a checkpointer built from its config, as
``Trainer`` builds and calls it (``config.checkpoint.build(...)``, ``load``,
``maybe_wait_for_staging``, ``save``, ``close``): ours
(``globalshard_torch.torchtitan.CheckpointManager``) beside torchtitan's own
DCP one, on the llama3 debugmodel (run by test_torchtitan_parallel.py)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer import CheckpointManager as DcpCheckpointManager
from torchtitan.components.checkpointer import ModelWrapper
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan_jobs import _loader, _local, _parameters, build

from globalshard_torch.torchtitan import CheckpointManager

MANAGERS = {"ours": CheckpointManager, "dcp": DcpCheckpointManager}
STEPS = 5


class TrainState(Stateful):
    """The trainer's own entry (``states={"train_state": trainer}``): its step and tokens seen."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = int(state["step"]), int(state["ntokens_seen"])


def _trainer(who: str, work: str, dp_shard: int, tp: int, seed: int, async_mode: str,
             exclude: tuple[str, ...] = (), initial: str | None = None, folder: str = "checkpoint",
             pp: int = 1, model: str = "llama3", **ours: Any) -> dict[str, Any]:
    parts, optimizers = build(dp_shard, tp, seed, work, pp=pp, model=model)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    loader = _loader(dist.get_rank() // (tp * pp), max(1, dist.get_world_size() // (tp * pp)), seed)
    train_state = TrainState()
    config = MANAGERS[who].Config(enable=True, folder=folder, interval=1, keep_latest_k=2, async_mode=async_mode,
                                  export_dtype="bfloat16", exclude_from_loading=list(exclude),
                                  initial_load_path=initial, **ours)
    manager = config.build(dataloader=loader, model_parts=parts, optimizers=optimizers, lr_schedulers=schedulers,
                           states={"train_state": train_state}, sd_adapter=None, base_folder=os.path.join(work, who))
    return {"parts": parts, "optimizers": optimizers, "schedulers": schedulers, "loader": loader,
            "train_state": train_state, "manager": manager}


def _step(t: dict[str, Any], step: int) -> None:
    """One training step of ``_trainer``'s parts, as a trainer takes it between saves."""
    for p in _parameters(t["parts"]):
        if p.requires_grad:
            p.grad = torch.sin(p.detach() * 3.0 + step) * 0.1
    t["manager"].maybe_wait_for_staging()
    t["optimizers"].step()
    t["schedulers"].step()


def train(rank: int, *, work: str, who: str, async_mode: str, pp: int = 1, model: str = "llama3",
          **ours: Any) -> dict[str, Any]:
    """At dp_shard=2 (or PP=2): a fresh start, then 5 steps with a checkpoint at each, the
    last one model only (in bf16), the 2 newest others kept. Returns the step folders left and
    each save's return value. ``model="llama3_lora"``: torchtitan's LoRA, its base frozen;
    ``ours``: our Config's own fields."""
    t = _trainer(who, work, 2 // pp, 1, 0, async_mode, pp=pp, model=model, **ours)
    manager, batches = t["manager"], iter(t["loader"])
    fresh = manager.load(step=-1)
    saved = []
    for step in range(1, STEPS + 1):
        t["train_state"].step = step
        t["train_state"].ntokens_seen += int(next(batches).numel())
        _step(t, step)
        saved.append(manager.save(step, last_step=step == STEPS))
    manager.maybe_wait_for_saving()
    manager.close()  # rank 0's purge thread finishes its deletions
    dist.barrier()
    folder = os.path.join(work, who, "checkpoint")
    return {"fresh_start": not fresh, "saved": saved, "steps": sorted(os.listdir(folder))}


def drifted(rank: int, *, work: str) -> dict[str, Any]:
    """Our checkpointer with ``check_replicas=True`` at dp_shard=2: a step whose copies
    agree saves; then rank 1's train state drifts (the tokens it counted), and the next
    save fails on both ranks, naming it. Returns the error and the steps committed."""
    import globalshard as gs

    t = _trainer("ours", work, 2, 1, 0, "disabled", folder="drift", check_replicas=True)
    t["train_state"].step, t["train_state"].ntokens_seen = 1, 100
    t["manager"].save(1)
    t["train_state"].step, t["train_state"].ntokens_seen = 2, 200 + rank
    try:
        t["manager"].save(2)
        error = None
    except gs.MismatchError as e:
        error = str(e)
    t["manager"].close()
    folder = os.path.join(work, "ours", "drift")
    committed = [n for n in os.listdir(folder) if os.path.exists(os.path.join(folder, n, "metadata.json"))]
    return {"error": error, "committed": sorted(committed)}


def resume(rank: int, *, work: str, model: str = "llama3") -> dict[str, Any]:
    """At TP=2, into models of other values, by each checkpointer from its own folder:
    the latest step each finds, then step 4 loaded (the last holds the model only),
    its dataloader left out (torchtitan's refuses another DP degree). Returns what
    differs between the two loads, tensor for tensor."""
    loaded = {}
    for who in MANAGERS:
        t = _trainer(who, work, 1, 2, 11, "disabled", exclude=("dataloader",), model=model)
        before = {k: _local(v).clone() for k, v in ModelWrapper(t["parts"]).state_dict().items()}
        assert t["manager"].load(step=4)
        t["latest"] = t["manager"]._find_load_step()
        t["changed"] = sum(not torch.equal(before[k], _local(v))
                           for k, v in ModelWrapper(t["parts"]).state_dict().items())
        loaded[who] = t
    ours, theirs = loaded["ours"], loaded["dcp"]
    # A new run started from that step's weights (initial_load_path, model only, its default): the
    # optimizer's state in the checkpoint is left, the new run's own kept.
    start = _trainer("ours", work, 1, 2, 13, "disabled", initial=os.path.join(work, "ours", "checkpoint", "step-4"),
                     folder="finetune", model=model)
    own = {k: _local(v).clone() for k, v in start["optimizers"].state_dict().items() if torch.is_tensor(v)}
    assert start["manager"].load(step=-1)

    def differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
        return sorted(k for k in b if (not torch.equal(_local(a[k]), _local(b[k])) if torch.is_tensor(b[k])
                                       else a[k] != b[k]))

    kept = start["optimizers"].state_dict()
    started = ModelWrapper(start["parts"]).state_dict()
    return {"initial_model": differ(started, ModelWrapper(ours["parts"]).state_dict()),
            "initial_optimizer_kept": all(torch.equal(_local(kept[k]), own[k]) for k in own) and len(own) > 10,
            "latest": [ours["latest"], theirs["latest"]], "changed": ours["changed"],
            "model": differ(ModelWrapper(ours["parts"]).state_dict(), ModelWrapper(theirs["parts"]).state_dict()),
            "optimizer": differ(ours["optimizers"].state_dict(), theirs["optimizers"].state_dict()),
            "schedulers": ours["schedulers"].state_dict() == theirs["schedulers"].state_dict(),
            "train_state": [[t["train_state"].step, t["train_state"].ntokens_seen] for t in (ours, theirs)]}


def lora_resumed(rank: int, *, work: str, async_mode: str) -> dict[str, Any]:
    """The LoRA run (``train`` with ``model="llama3_lora"``, dp_shard=2) resumed from step 4 at
    TP=2 by our checkpointer, then two steps trained and saved (steps 6 and 7), in the background
    (``async_mode``): the first while the newest step kept, step 5, is the model-only last step,
    which references nothing. Returns the step folders left."""
    t = _trainer("ours", work, 1, 2, 11, async_mode, exclude=("dataloader",), model="llama3_lora")
    manager = t["manager"]
    assert manager.load(step=4)
    for step in (6, 7):
        _step(t, step)
        manager.save(step)
    manager.maybe_wait_for_saving()
    manager.close()
    dist.barrier()
    return {"steps": sorted(os.listdir(os.path.join(work, "ours", "checkpoint")))}


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The SHA-256 of each tensor's bytes (values compared across processes without sending them)."""
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in state.items()}


def seed(rank: int, *, work: str) -> dict[str, str]:
    """torchtitan's ``create_seed_checkpoint`` (``train.py``: one process): the llama3
    debugmodel built on the CPU and initialised, not parallelized (as its trainer skips
    ``parallelize_fn`` for a seed), saved as step 0 by each checkpointer with
    ``save(curr_step=0, last_step=True)`` (the model only, in ``export_dtype``). Returns the
    seed's values (:func:`_digests`)."""
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan_models import spec

    model_spec = spec("llama3", ParallelismConfig())
    model = model_spec.model.build()
    torch.manual_seed(23)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    for who, manager_class in MANAGERS.items():
        config = manager_class.Config(enable=True, folder="checkpoint", create_seed_checkpoint=True)
        manager = config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                               states={"train_state": TrainState()}, sd_adapter=None,
                               base_folder=os.path.join(work, who))
        assert manager.save(curr_step=0, last_step=True)
        manager.close()
    return _digests({k: v.detach() for k, v in ModelWrapper([model]).state_dict().items()})


def from_seed(rank: int, *, work: str) -> dict[str, Any]:
    """A run at dp_shard=2 starting from the seed (``load(step=-1)``, as its trainer calls it:
    step 0 loads the model only), by each checkpointer from its own folder: the model keys
    whose full values differ between the two, and the latest step each found."""
    full = {}
    for who in MANAGERS:
        t = _trainer(who, work, 2, 1, 99, "disabled")
        assert t["manager"].load(step=-1)
        full[who] = {k: _local(v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                     for k, v in ModelWrapper(t["parts"]).state_dict().items()}
    return {"differ": sorted(k for k in full["ours"] if not torch.equal(full["ours"][k], full["dcp"][k])),
            "tensors": len(full["ours"]), "values": _digests(full["ours"])}


def failed(rank: int, *, work: str, async_mode: str) -> dict[str, Any]:
    """An async save whose background part fails (a file where the step's save
    directories go): what ``save`` returned, the error ``maybe_wait_for_saving``
    raised, and the step the checkpointer then finds (none: nothing looks committed)."""
    t = _trainer("ours", work, 2, 1, 0, async_mode)
    manager = t["manager"]
    step = os.path.join(work, "ours", "checkpoint", "step-1")
    if rank == 0:
        os.makedirs(step)
        with open(os.path.join(step, "saves"), "w") as f:
            f.write("not a directory")
    dist.barrier()
    returned = manager.save(1)
    try:
        manager.maybe_wait_for_saving()
        error = None
    except Exception as e:
        error = type(e).__name__
    manager.close()
    dist.barrier()
    found = manager._find_load_step()
    # A healthy async save still in flight when the trainer closes its checkpointer (a run that ran out of data
    # before its last step): close() lets it finish, before the trainer destroys the process group it uses.
    config = CheckpointManager.Config(enable=True, folder="closed", interval=1, async_mode=async_mode)
    closing = config.build(dataloader=t["loader"], model_parts=t["parts"], optimizers=t["optimizers"],
                           lr_schedulers=t["schedulers"], states={"train_state": t["train_state"]}, sd_adapter=None,
                           base_folder=os.path.join(work, "ours"))
    closing.save(1)
    closing.close()
    committed_at_close = os.path.exists(os.path.join(work, "ours", "closed", "step-1", "metadata.json"))
    dist.barrier()
    return {"returned": returned, "error": error, "found": found,
            "committed": os.path.exists(os.path.join(step, "metadata.json")), "committed_at_close": committed_at_close}


def hugging_face(rank: int, *, work: str) -> dict[str, Any]:
    """torchtitan's Hugging Face paths through our checkpointer (they stay torchtitan's): a
    last step saved as safetensors (``last_save_in_hf``, float32), then a new run started
    from that folder (``initial_load_in_hf``). Returns the model tensors that differ."""
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan_models import spec

    model_spec = spec("llama3", ParallelismConfig(data_parallel_shard_degree=2))
    trained = _trainer("ours", work, 2, 1, 0, "disabled", folder="hf_run")
    adapter = model_spec.state_dict_adapter(model_spec.model, None)
    config = CheckpointManager.Config(enable=True, folder="hf_run", interval=10, last_save_in_hf=True,
                                      export_dtype="float32")
    manager = config.build(dataloader=None, model_parts=trained["parts"], optimizers=trained["optimizers"],
                           lr_schedulers=trained["schedulers"], states={"train_state": TrainState()},
                           sd_adapter=adapter, base_folder=os.path.join(work, "hf"))
    for p in _parameters(trained["parts"]):
        p.grad = torch.sin(p.detach() * 3.0) * 0.1
    trained["optimizers"].step()
    assert manager.save(2, last_step=True)
    manager.close()
    dist.barrier()
    files = sorted(os.listdir(os.path.join(work, "hf", "hf_run", "step-2")))
    fresh = _trainer("ours", work, 2, 1, 17, "disabled", folder="unused")
    config = CheckpointManager.Config(enable=True, folder="started", initial_load_in_hf=True,
                                      initial_load_path=os.path.join(work, "hf", "hf_run", "step-2"))
    starter = config.build(dataloader=None, model_parts=fresh["parts"], optimizers=fresh["optimizers"],
                           lr_schedulers=fresh["schedulers"], states={"train_state": TrainState()},
                           sd_adapter=adapter, base_folder=os.path.join(work, "hf"))
    assert starter.load(step=-1)
    ours, theirs = (ModelWrapper(t["parts"]).state_dict() for t in (fresh, trained))
    return {"files": files, "differ": sorted(k for k in theirs if not torch.equal(_local(ours[k]), _local(theirs[k]))),
            "tensors": len(theirs)}


def lora_exported(rank: int, *, work: str, hf: str) -> dict[str, Any]:
    """Step 4 of the LoRA run (``train`` with ``model="llama3_lora"``) exported to Hugging
    Face by rank 0, its adapters merged (``lora_scale`` = alpha / rank = 16 / 8), and opened
    by transformers: its logits beside torchtitan's forward of the step's LoRA model (and of
    the same with its adapters zeroed: what an export that dropped them would give). Then the
    export read by ``load_hf`` into a fresh LoRA model at dp_shard=2, as a fine-tune starts
    from Hugging Face weights: its adapters left as torchtitan initialised them."""
    import transformers
    from torchtitan_jobs import logits

    import globalshard_torch as gt
    from globalshard.hf import NameMapping, export

    params = {"heads": 16, "kv_heads": 16, "lora_scale": 2.0}
    merged = None
    if rank == 0:
        out = export(os.path.join(work, "ours", "checkpoint", "step-4"), hf,
                     mapping=NameMapping.load("torchtitan_llama3", params))
        merged = out["merged"]
    dist.barrier()
    t = _trainer("ours", work, 2, 1, 5, "disabled", folder="unused", model="llama3_lora")
    sd = ModelWrapper(t["parts"]).state_dict()
    gt.load(sd, os.path.join(work, "ours", "checkpoint", "step-4"), strict=False)
    ModelWrapper(t["parts"]).load_state_dict(sd)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
    tuned = logits(t["parts"], "llama3_lora", full)
    dropped = logits(t["parts"], "llama3_lora", {k: torch.zeros_like(v) if "lora_b" in k else v
                                                 for k, v in full.items()})
    (fresh,), _ = build(2, 1, 17, work, model="llama3_lora")
    adapters = {k: _local(p).clone() for k, p in fresh.named_parameters() if "lora_" in k}
    got = gt.load_hf(hf, fresh, gt.ParallelLayout(num_layers=len(fresh.layers)), None, mapping="torchtitan_llama3",
                     params=params)
    started = logits([fresh], "llama3_lora")
    kept = all(torch.equal(_local(p), adapters[k]) for k, p in fresh.named_parameters() if "lora_" in k)
    out = {"merged": merged, "skipped": got["skipped"], "unread": got["unread"], "adapters_kept": kept}
    if rank == 0:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        with torch.no_grad():
            theirs = model((torch.arange(2 * 16).reshape(2, 16) * 37) % 2048).logits
        scale = theirs.abs().max().item()
        out |= {name: (x - theirs).abs().max().item() / scale
                for name, x in (("tuned", tuned), ("dropped", dropped), ("started", started))}
    return out


def _full_digests(t: dict[str, Any]) -> dict[str, str]:
    """:func:`_digests` of the model's and the optimizer's full tensors (gathered, on every rank)."""
    state = {**{f"model.{k}": v for k, v in ModelWrapper(t["parts"]).state_dict().items()},
             **{f"optimizer.{k}": v for k, v in t["optimizers"].state_dict().items() if torch.is_tensor(v)}}
    return _digests({k: _local(v.full_tensor() if hasattr(v, "full_tensor") else v).detach().reshape(-1).clone()
                     for k, v in state.items()})  # 0-d (Adam's step) as 1-d: viewed as bytes


def tiered(rank: int, *, work: str, phase: str, async_mode: str = "disabled", model: str = "llama3",
           step: int = -1) -> dict[str, Any]:
    """Our checkpointer with a fast tier (``local_folder``), each rank a node of its
    own (``LOCAL_WORLD_SIZE=1``, a directory each). ``phase="train"``: at dp_shard=2,
    steps 1 to 4 saved, then closed; the full values at step 4 (:func:`_full_digests`)
    and the train state. ``phase="resume"``: at TP=2, into a model of other values,
    ``load(step)`` as the trainer calls it (-1: the newest step; else its ``load_step``): the
    same, and where the bytes came from.
    ``model="llama3_lora"``: torchtitan's LoRA, each step referencing step 1's frozen base."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    local = os.path.join(work, "local", "node{node}")
    if phase == "train":
        t = _trainer("ours", work, 2, 1, 0, async_mode, folder="tiered", model=model, local_folder=local)
        manager, batches = t["manager"], iter(t["loader"])
        assert not manager.load(step=-1)
        for step in range(1, 5):
            t["train_state"].step = step
            t["train_state"].ntokens_seen += int(next(batches).numel())
            _step(t, step)
            assert manager.save(step)
        manager.maybe_wait_for_saving()
        values = _full_digests(t)
        manager.close()  # the last step copied to the folder before it returns
        dist.barrier()
        return {"values": values, "train_state": [t["train_state"].step, t["train_state"].ntokens_seen],
                "folder": sorted(os.listdir(os.path.join(work, "ours", "tiered"))),
                "local": sorted(os.listdir(local.format(node=rank)))}
    t = _trainer("ours", work, 1, 2, 11, "disabled", exclude=("dataloader",), folder="tiered", model=model,
                 local_folder=local)
    assert t["manager"].load(step=step)
    recovery = t["manager"].recovery
    out = {"values": _full_digests(t), "train_state": [t["train_state"].step, t["train_state"].ntokens_seen],
           "step": recovery.step, "bytes_persistent": recovery.bytes_persistent,
           "bytes_near": recovery.bytes_local + recovery.bytes_peer}
    t["manager"].close()
    return out
