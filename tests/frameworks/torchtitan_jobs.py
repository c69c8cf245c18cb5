"""torchtitan 0.3's models parallelized by their own ``parallelize_fn`` on CPU
ranks over gloo (run by test_torchtitan_parallel.py): the models of
torchtitan_models.py (the llama3 debugmodel, a small Qwen3 MoE for expert
parallelism, Qwen3's dense debugmodel with tied embeddings, a small
DeepSeek-V3).

Scoped patches, in these processes only: torchtitan picks its device type
when imported ("cuda" without a GPU); here it is the CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.utils as tt_utils
from torch.distributed import checkpoint as dcp
from torchtitan.components.checkpointer import ModelWrapper
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan_models import spec

import globalshard_torch as gt

tt_utils.device_type = tt_parallel_dims.device_type = "cpu"


def build(dp_shard: int, tp: int, seed: int, work: str, *, ep: int = 1, pp: int = 1, schedule: str = "1F1B",
          model: str = "llama3", backend: str = "partial_dtensor") -> tuple[list[Any], Any]:
    """The model as torchtitan's trainer builds it (meta, parallelize, to_empty, init):
    its parts (one per pipeline stage of this rank; the whole model without PP, as
    the trainer's ``model_parts``), and their AdamW.

    ``backend`` is torchtitan's ``spmd_backend``, set as its trainer sets it:
    ``partial_dtensor`` (DTensors for TP, EP and FSDP2, what torchtitan before 0.3
    always used) or ``full_dtensor`` (every parameter a DTensor over the whole
    mesh before FSDP2 shards it). 0.3's default ``spmd_types`` needs a
    ``fully_shard`` that turns its annotations into DTensors, which torch 2.13's
    lacks ("all parameters must be DTensors on the full SPMD mesh").
    With ``pp`` > 1, the trainer's ``pipelining_fn`` splits the model into stages
    (``schedule`` chooses how many per rank) and parallelizes each. A MoE's
    load-balancing ``expert_bias_E`` (a buffer its optimizer hook moves by the
    routed token counts) is set to values of its own.
    """
    # TODO(limitation): 0.3's default spmd_types backend is not tested (torch 2.13's fully_shard refuses it).
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, tensor_parallel_degree=tp,
                                    expert_parallel_degree=ep, pipeline_parallel_degree=pp,
                                    pipeline_parallel_schedule=schedule, spmd_backend=backend)
    tt_dist_utils.set_spmd_backend(backend)  # as its trainer does, before the model is built
    model_spec = spec(model, parallelism)
    key = (dp_shard, tp, ep, pp, backend)  # one ParallelDims per layout, as one trainer has one
    dims = _DIMS[key] = _DIMS.get(key) or ParallelDims.from_config(parallelism, dist.get_world_size())
    with torch.device("meta"):
        whole = model_spec.model.build()
    common = dict(parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                  compile_config=CompileConfig(), ac_config=None, dump_folder=work)
    if pp > 1:
        _, parts, _, _ = model_spec.pipelining_fn(whole, **common, device=torch.device("cpu"),
                                                  model_config=model_spec.model,
                                                  parallelize_fn=model_spec.parallelize_fn,
                                                  loss_fn=cross_entropy_loss)
    else:
        parts = [model_spec.parallelize_fn(whole, **common)]
    torch.manual_seed(seed)
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
            for name, buffer in part.named_buffers():
                if name.endswith("expert_bias_E"):
                    _local(buffer).copy_(torch.sin(torch.arange(buffer.shape[0]) + seed))  # replicated on its mesh
    config = default_adamw(lr=1e-3)
    config.implementation = "for-loop"
    return parts, config.build(model_parts=parts)


_DIMS: dict[tuple[Any, ...], ParallelDims] = {}  # full_dtensor's second model must share the first's meshes


def state(parts: list[Any], optimizers: Any) -> dict[str, Any]:
    """As torchtitan's CheckpointManager hands its state to DCP: model keys at the top."""
    return {**ModelWrapper(parts).state_dict(), "optimizer": optimizers}


def _parameters(parts: list[Any]) -> list[torch.Tensor]:
    return [p for part in parts for p in part.parameters()]


def train(rank: int, *, work: str, dp_shard: int, tp: int, ep: int = 1, pp: int = 1, schedule: str = "1F1B",
          name: str = "llama3", backend: str = "partial_dtensor") -> dict[str, Any]:
    """Two AdamW steps (gradients a function of the weights, so equal on every replica),
    then the state saved with globalshard and with DCP."""
    parts, optimizers = build(dp_shard, tp, 0, work, ep=ep, pp=pp, schedule=schedule, model=name, backend=backend)
    for _ in range(2):
        for p in _parameters(parts):
            p.grad = torch.sin(p.detach() * 3.0) * 0.1
        optimizers.step()
    # Every copy that ranks hold (replicated DTensors, plain buffers such as the MoE expert bias) compared first.
    gt.save(state(parts, optimizers), os.path.join(work, "ours"), check_replicas=True)
    dcp.save(state(parts, optimizers), checkpoint_id=os.path.join(work, "dcp"))
    return {"tensors": len(ModelWrapper(parts).state_dict()), "parts": len(parts)}


def sharpened(rank: int, *, work: str, name: str, scale: float) -> int:
    """``name`` built in one process with its attention's projections ``scale`` times
    torchtitan's initial ones (attention that is not near uniform, so that how it scales
    scores and rotates positions shows in the logits), saved with globalshard."""
    (part,), optimizers = build(1, 1, 3, work, model=name)
    with torch.no_grad():
        scaled = [p.mul_(scale) for n, p in part.named_parameters() if ".attention.w" in n]
    gt.save(state([part], optimizers), os.path.join(work, "ours"))
    return len(scaled)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reload(rank: int, *, work: str, dp_shard: int, tp: int, ep: int = 1, pp: int = 1, schedule: str = "1F1B",
           name: str = "llama3", backend: str = "partial_dtensor") -> dict[str, Any]:
    """Load what ``train`` saved into this layout (and ``backend``) with globalshard
    (default arguments) and with DCP, each into a model of other values; every tensor compared."""
    loaded = {}
    for who, seed in (("ours", 5), ("dcp", 7)):
        parts, optimizers = build(dp_shard, tp, seed, work, ep=ep, pp=pp, schedule=schedule, model=name,
                                  backend=backend)
        for p in _parameters(parts):  # optimizer state of its own, to be replaced
            p.grad = torch.cos(p.detach())
        optimizers.step()
        sd = state(parts, optimizers)
        if who == "ours":
            missing = gt.load(sd, os.path.join(work, "ours"))
        else:
            dcp.load(sd, checkpoint_id=os.path.join(work, "dcp"))
        ModelWrapper(parts).load_state_dict({k: v for k, v in sd.items() if k != "optimizer"})
        loaded[who] = (parts, optimizers)
    ours, theirs = (ModelWrapper(loaded[n][0]).state_dict() for n in ("ours", "dcp"))
    buffers = [k for part in loaded["dcp"][0] for k, _ in part.named_buffers() if k in theirs]
    differ = sorted(k for k in theirs if not torch.equal(_local(ours[k]), _local(theirs[k])))
    ours_opt, theirs_opt = (loaded[n][1].state_dict() for n in ("ours", "dcp"))
    opt_tensors = [k for k, v in theirs_opt.items() if torch.is_tensor(v)]
    opt_differ = sorted(k for k in opt_tensors if not torch.equal(_local(ours_opt[k]), _local(theirs_opt[k])))
    opt_differ += sorted(k for k, v in theirs_opt.items() if not torch.is_tensor(v) and ours_opt[k] != v)
    out: dict[str, Any] = {"tensors": len(theirs), "optimizer_tensors": len(opt_tensors), "differ": differ,
                           "optimizer_differ": opt_differ, "missing": missing.missing_keys,
                           "unexpected": missing.unexpected_keys, "buffers": len(buffers),
                           "tied": [p.tok_embeddings.weight is p.lm_head.weight for p in loaded["ours"][0]
                                    if getattr(p, "enable_weight_tying", False)]}
    if dist.get_world_size() == 1 and name == "llama3":
        out["logits"] = logits(loaded["ours"][0]).flatten().tolist()
    return out


def _loader(dp_rank: int, dp_size: int, seed: int) -> Any:
    """torchtitan's ``ParallelAwareDataloader`` (a torchdata StatefulDataLoader whose
    state is keyed by its DP rank) over this rank's share of 64 samples, shuffled."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    samples = [torch.tensor([dp_rank * 1000 + i]) for i in range(64)]
    return ParallelAwareDataloader(samples, dp_rank=dp_rank, dp_world_size=dp_size, batch_size=4, shuffle=True,
                                   generator=torch.Generator().manual_seed(seed + dp_rank))


def dataloader(rank: int, *, work: str) -> dict[str, Any]:
    """Each DP rank's dataloader three batches in, saved beside a step count with
    globalshard and with DCP (as torchtitan's CheckpointManager holds it, under
    ``dataloader``), then loaded by each into a fresh loader of another seed: the
    batches that follow, against the ones the saved loader gives next."""
    size = dist.get_world_size()
    loader = _loader(rank, size, 0)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    for name, save in (("ours", gt.save), ("dcp", None)):
        state = {"dataloader": loader, "step": 3}
        if save is None:
            dcp.save(state, checkpoint_id=os.path.join(work, name))
        else:
            save(state, os.path.join(work, name))
    expected = [next(batches).flatten().tolist() for _ in range(2)]
    out: dict[str, Any] = {"expected": expected}
    for name in ("ours", "dcp"):
        fresh = _loader(rank, size, 99)
        state = {"dataloader": fresh, "step": 0}
        if name == "ours":
            gt.load(state, os.path.join(work, name))
        else:
            dcp.load(state, checkpoint_id=os.path.join(work, name))
        following = iter(fresh)
        out[name] = [next(following).flatten().tolist() for _ in range(2)]
        out[f"{name}_fresh"] = [next(iter(_loader(rank, size, 99))).flatten().tolist()]
    return out


def from_hf(rank: int, *, work: str, hf: str, dp_shard: int, tp: int, ep: int = 1, name: str = "llama3",
            mapping: str = "torchtitan_llama3", params: dict[str, float] | None = None,
            strict: bool = True) -> dict[str, Any]:
    """A Hugging Face folder read by ``load_hf`` straight into torchtitan's parallelized
    model (its fused ``wqkv`` DTensors, a MoE's experts over EP), its parameters
    compared with DCP's load of the original state."""
    (model,), _ = build(dp_shard, tp, 11, work, ep=ep, model=name)
    got = gt.load_hf(hf, model, gt.ParallelLayout(num_layers=len(model.layers)), None, mapping=mapping,
                     params=params or {"heads": 16, "kv_heads": 16}, strict=strict)
    (reference,), optimizers = build(dp_shard, tp, 13, work, ep=ep, model=name)
    sd = state([reference], optimizers)
    dcp.load(sd, checkpoint_id=os.path.join(work, "dcp"))
    ModelWrapper(reference).load_state_dict({k: v for k, v in sd.items() if k != "optimizer"})
    ours, theirs = (dict(m.named_parameters()) for m in (model, reference))
    return {"tensors": len(theirs), "unread": got["unread"], "skipped": got["skipped"],
            "differ": sorted(k for k in theirs if not torch.equal(_local(ours[k]), _local(theirs[k])))}


def from_transformers(rank: int, *, work: str, hf: str, dp_shard: int, tp: int, ep: int, name: str, mapping: str,
                      params: dict[str, float], length: int = 16) -> dict[str, Any]:
    """A model transformers wrote (``save_pretrained``) read by ``load_hf`` straight into
    torchtitan's parallelized ``name``, as a fine-tune starts: torchtitan's logits of a fixed
    batch (routed without a MoE's load-balancing bias, which the files do not hold)."""
    (model,), _ = build(dp_shard, tp, 11, work, ep=ep, model=name)
    got = gt.load_hf(hf, model, gt.ParallelLayout(num_layers=len(model.layers)), None, mapping=mapping,
                     params=params)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in ModelWrapper(model).state_dict().items()}
    full = {k: torch.zeros_like(v) if k.endswith("expert_bias_E") else v for k, v in full.items()}
    return {"logits": logits([model], name, full, length).flatten().tolist() if rank == 0 else None,
            "skipped": got["skipped"], "unread": got["unread"]}


def exported(rank: int, *, work: str, name: str, hf: str, mapping: str, params: dict[str, float],
             zero_expert_bias: bool = False, length: int = 16) -> dict[str, Any]:
    """What ``train`` saved, loaded into one process, exported to Hugging Face with
    ``mapping`` and opened by transformers: the largest difference of its logits from
    torchtitan's forward of the same weights, and each exported tensor beside what
    torchtitan's own state dict adapter (``to_hf``) makes of them. With
    ``zero_expert_bias``, torchtitan's forward routes without its load-balancing
    expert bias, which Hugging Face's architecture does not have."""
    import transformers
    from safetensors import safe_open

    from globalshard.hf import NameMapping, export

    out = export(os.path.join(work, "ours"), hf, mapping=NameMapping.load(mapping, params))
    (part,), optimizers = build(1, 1, 5, work, model=name)
    sd = state([part], optimizers)
    gt.load(sd, os.path.join(work, "ours"))
    ModelWrapper(part).load_state_dict({k: v for k, v in sd.items() if k != "optimizer"})
    ours = {}
    for file in sorted(os.listdir(hf)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(hf, file), "pt") as f:
                ours |= {k: f.get_tensor(k) for k in f.keys()}
    model_spec = spec(name, ParallelismConfig())
    full = {k: _local(v) for k, v in ModelWrapper(part).state_dict().items()}
    theirs = model_spec.state_dict_adapter(model_spec.model, None).to_hf(dict(full))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        hf_logits = model(tokens(length)).logits
    if zero_expert_bias:
        full = {k: torch.zeros_like(v) if k.endswith("expert_bias_E") else v for k, v in full.items()}
    diff = (logits([part], name, full, length) - hf_logits).abs().max().item()
    # Each layer's attention window in torchtitan's model config (gpt_oss), and as transformers read the export.
    windows = [getattr(getattr(layer, "attention", None), "sliding_window_size", None)
               for layer in getattr(model_spec.model, "layers", [])]
    return {"skipped": out["skipped"], "architecture": type(model).__name__, "logits_diff": diff,
            "logits_max": hf_logits.abs().max().item(), "windows": windows,
            "layer_types": getattr(model.config, "layer_types", None),
            "sliding_window": getattr(model.config, "sliding_window", None),
            "only_ours": sorted(set(ours) - set(theirs)), "only_theirs": sorted(set(theirs) - set(ours)),
            "differ": sorted(k for k in set(ours) & set(theirs) if not torch.equal(ours[k], theirs[k]))}


def tokens(length: int = 16) -> torch.Tensor:
    """The fixed batch the logits are compared on: 2 sequences of ``length`` tokens."""
    return (torch.arange(2 * length).reshape(2, length) * 37) % 2048


def logits(parts: list[Any], name: str = "llama3", full: dict[str, torch.Tensor] | None = None,
           length: int = 16) -> torch.Tensor:
    """torchtitan's forward of a fixed batch (one document: a causal flex-attention mask), in
    float32: the same weights (or ``full``) in an unparallelized model (FSDP2's mixed precision
    policy would compute in bfloat16)."""
    plain = spec(name, ParallelismConfig()).model.build()
    if full is None:
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in ModelWrapper(parts).state_dict().items()}
    ModelWrapper(plain).load_state_dict(full)
    positions = torch.arange(length).unsqueeze(0).expand(2, length)
    plain.eval()
    with torch.no_grad(), _gpt_oss_on_cpu(name):
        out = plain(tokens(length), positions, plain.get_attention_masks(positions))
    return out[0] if isinstance(out, list) else out  # with MTP layers: the main head's, then theirs


@contextlib.contextmanager
def _gpt_oss_on_cpu(name: str) -> Iterator[None]:
    """gpt-oss's forward on the CPU, in float32 (scoped patches, for ``name`` "gpt_oss*" only):

    * flex attention uncompiled: its sinks need the attention's log-sum-exp, and torch.compile's
      CPU flex attention refuses ``return_lse``;
    * the experts' grouped matmuls in float32: GptOssGroupedExperts casts its tokens and weights
      to bfloat16 and returns bfloat16 (which a float32 model cannot scatter-add: "Expected
      self.dtype to be equal to src.dtype"), so ``Tensor.bfloat16`` is the identity while they run.
    """
    if not name.startswith("gpt_oss"):
        yield
        return
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    compiled, experts, bfloat16 = FlexAttention.__dict__["_compiled_flex_attn"], GptOssGroupedExperts.forward, \
        torch.Tensor.bfloat16

    def in_float32(self: Any, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        torch.Tensor.bfloat16 = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            return experts(self, x, counts)
        finally:
            torch.Tensor.bfloat16 = bfloat16  # type: ignore[method-assign]

    FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
    GptOssGroupedExperts.forward = in_float32
    try:
        yield
    finally:
        FlexAttention._compiled_flex_attn = compiled
        GptOssGroupedExperts.forward = experts
