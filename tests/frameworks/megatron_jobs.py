"""Megatron-Core's real GPTModel on CPU ranks over gloo (run by test_megatron.py).

Scoped patches, in these processes only (never in the library): Megatron-Core
0.16 allocates buffers on ``torch.cuda.current_device()``, moves tied
embeddings with ``.cuda()`` and synchronizes CUDA in ``dist_checkpointing``;
on CPU those become the CPU and no-ops; the distributed optimizer also makes
tensors with ``device="cuda"`` (made on the CPU here) and accepts only
parameters whose ``.type()`` is a CUDA type (answered as CUDA while it is
built and steps). Its MoE router references
``te_general_gemm``, undefined without Transformer Engine: set to None, its
value when Transformer Engine is absent. MoE layers use the ``allgather``
token dispatcher (``alltoall`` creates a CUDA stream). Its ``model_parallel_cuda_manual_seed``
takes ``inference_rng_tracker=True`` (a CPU-capable tracker). Multi-latent attention:
its module takes Transformer Engine for present when Megatron's TE extension imports
without it (``HAVE_TE`` set False, as it is without TE), and Megatron's local
``DotProductAttention`` lacks MLA's separate key and value widths, so its
specs use ``CoreAttention`` below (softmax(q k^T * scale) v, causal) instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import textwrap
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import globalshard_torch as gt

torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment,method-assign]

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.tensor_parallel import random as mrandom  # noqa: E402
from megatron.core.transformer import multi_latent_attention  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group  # noqa: E402

moe_utils.te_general_gemm = None  # 0.16's router references it undefined without Transformer Engine
multi_latent_attention.HAVE_TE = False  # 0.16 sets it when its TE extension imports, TE absent or not


class CoreAttention(torch.nn.Module):
    """Causal softmax(q k^T * softmax_scale) v with Megatron's core attention signature,
    for multi-latent attention (whose values are narrower than its queries and keys)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 softmax_scale: float, **_: Any) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                **_: Any) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [batch, heads, seq, dim]
        scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
        out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)  # [seq, batch, heads * dim]


def _on_cpu(make: Any) -> Any:
    def made(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return make(*args, **kwargs)
    return made


@contextlib.contextmanager
def _distributed_optimizer_on_cpu() -> Iterator[None]:
    """While the block runs: tensors asked for on ``"cuda"`` are made on the CPU,
    and ``Tensor.type()`` answers ``torch.cuda.FloatTensor`` for CPU tensors (the
    distributed optimizer checks it)."""
    real_type = torch.Tensor.type
    factories = {name: getattr(torch, name) for name in ("tensor", "zeros", "empty", "ones", "full")}

    def as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = real_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = as_cuda  # type: ignore[method-assign,assignment]
    for name, make in factories.items():
        setattr(torch, name, _on_cpu(make))
    try:
        yield
    finally:
        torch.Tensor.type = real_type  # type: ignore[method-assign]
        for name, make in factories.items():
            setattr(torch, name, make)


SEQ, BATCH = 8, 2


#: The process groups there were before Megatron's parallel state made its own.
_BEFORE_MEGATRON: set[Any] = set()


def setup(m: dict[str, Any], tp: int, pp: int, ep: int = 1, vpp: int = 1, first: int | None = None,
          pp_layout: str | None = None, etp: int | None = None) -> gt.ParallelLayout:
    """Megatron-Core's parallel state for a layout, and the same layout for globalshard.

    ``vpp``: virtual pipeline chunks per stage; ``etp``: the experts' TP size
    (Megatron's ``expert_tensor_parallel_size``, TP's when None). An uneven pipeline, by
    Megatron's ``num_layers_in_first_pipeline_stage`` (``first``) or its
    ``pipeline_model_parallel_layout`` (``pp_layout``), is told to globalshard
    as Megatron assigns it (``stage_layers``)."""
    global _BEFORE_MEGATRON
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        # It forgets its groups but destroys only a few: each other one keeps its gloo threads (about 90 a
        # layout, 3,000 a rank after this module's scenarios, slowing every step after). Ours stays.
        for group in set(dist.distributed_c10d._world.pg_map) - _BEFORE_MEGATRON:
            dist.destroy_process_group(group)
    gt.default_comm()  # globalshard's communicator: made before Megatron's groups, kept across layouts
    _BEFORE_MEGATRON = set(dist.distributed_c10d._world.pg_map)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    torch.manual_seed(1)
    mrandom.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    cfg = config(m, vpp=vpp, first=first, pp_layout=pp_layout, etp=etp)
    stages = megatron_stage_layers(cfg) if first or pp_layout else None
    layout = gt.ParallelLayout(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                               pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp, vpp_size=vpp,
                               dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                               ep_size=ep, etp_size=etp, num_layers=NUM_LAYERS, stage_layers=stages)
    assert (layout.ep_rank, layout.expert_tp_rank, layout.expert_dp_rank) == (
        ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
    CONFIGS[layout] = cfg
    return layout


CONFIGS: dict[gt.ParallelLayout, TransformerConfig] = {}  # the config each layout's models are built with


def megatron_stage_layers(config: TransformerConfig) -> list[list[list[int]]]:
    """``stage_layers`` as Megatron-Core assigns layers, by docs/torch.md's recipe run as printed."""
    names: dict[str, Any] = {"config": config}
    exec(_recipe("  from functools import partial", "  layout = gt.ParallelLayout(..., vpp_size="), names)
    return names["stage_layers"]


def _recipe(first: str, after: str) -> str:
    """The lines of docs/torch.md from the one starting ``first`` to before ``after``, dedented."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "torch.md")) as f:
        doc = f.read()
    start = doc.index(first)
    return textwrap.dedent(doc[start:doc.index(after, start)])


NUM_LAYERS = 4


def config(m: dict[str, Any], vpp: int = 1, first: int | None = None,
           pp_layout: str | None = None, etp: int | None = None) -> TransformerConfig:
    moe = dict(num_moe_experts=m["experts"], moe_router_topk=2, moe_token_dispatcher_type="allgather",
               moe_aux_loss_coeff=0.0, moe_router_pre_softmax=bool(m.get("pre_softmax")),
               **({"moe_layer_freq": m["moe_freq"]} if m.get("moe_freq") else {}),
               **({"moe_shared_expert_intermediate_size": m["shared"], "moe_shared_expert_gate": True}
                  if m.get("shared") else {}))\
        if m.get("experts") else {}
    mtp = dict(mtp_num_layers=1) if m.get("mtp") else {}  # multi-token prediction (DeepSeek-V3's)
    precision = (dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16) if m.get("bf16")
                 else dict(pipeline_dtype=torch.float32))
    # A Llama: RMSNorm and SwiGLU (Megatron's defaults are LayerNorm and GeLU).
    llama = dict(normalization="RMSNorm", activation_func=torch.nn.functional.silu) if m.get("llama") else {}
    if m.get("mla"):  # a DeepSeek-V3: multi-latent attention, sigmoid routing with a bias, shared experts
        mla, kind = dict(m["mla"]), MLATransformerConfig
        moe |= dict(moe_ffn_hidden_size=mla.pop("expert_ffn"),
                    moe_shared_expert_intermediate_size=mla.pop("shared_ffn"),
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_topk_scaling_factor=mla.pop("scale"), moe_router_num_groups=mla.pop("groups"),
                    moe_router_group_topk=mla.pop("group_topk"))
        attention = dict(qk_layernorm=True, **mla)  # the latents' norms
    else:
        kind, attention = TransformerConfig, dict(qk_layernorm=bool(m.get("qk_norm")))  # a Qwen3
    return kind(**moe, **llama, **attention, **mtp,
                             add_qkv_bias=bool(m.get("qkv_bias")),  # a Qwen2
                             num_layers=NUM_LAYERS, hidden_size=m["hidden"],
                             num_attention_heads=m["heads"],
                             num_query_groups=m["groups"], ffn_hidden_size=m["ffn"],
                             gated_linear_unit=m["glu"], add_bias_linear=m["bias"], use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, **precision,
                             pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                             num_layers_in_first_pipeline_stage=first, pipeline_model_parallel_layout=pp_layout,
                             tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                             expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                             expert_tensor_parallel_size=etp)


def build(m: dict[str, Any], layout: gt.ParallelLayout) -> list[GPTModel]:
    """This rank's model: its virtual pipeline chunks, in local order (one without VPP)."""
    vpp, cfg = layout.vpp_size, CONFIGS[layout]
    spec = get_gpt_layer_local_spec(num_experts=m.get("experts"), qk_layernorm=cfg.qk_layernorm,
                                    multi_latent_attention=cfg.multi_latent_attention,
                                    normalization=cfg.normalization if m.get("llama") else None)
    stages = [c if vpp > 1 else None for c in range(vpp)]
    if m.get("moe_freq"):  # dense and MoE layers: Megatron's block spec (it then keys each layer apart)
        return [GPTModel(cfg, transformer_layer_spec=_attending(get_gpt_decoder_block_spec(
                             cfg, use_transformer_engine=False, normalization=cfg.normalization, vp_stage=stage)),
                         vocab_size=m["vocab"], max_sequence_length=SEQ, position_embedding_type="rope", **_rope(m),
                         share_embeddings_and_output_weights=m["tied"], vp_stage=stage,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage))
                for stage in stages]
    spec = _attending(spec)
    return [GPTModel(cfg, transformer_layer_spec=spec, vocab_size=m["vocab"], max_sequence_length=SEQ,
                     position_embedding_type="rope", **_rope(m), share_embeddings_and_output_weights=m["tied"],
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False, vp_stage=stage)
                     if m.get("mtp") else None,
                     vp_stage=stage, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage))
            for stage in stages]


def _rope(m: dict[str, Any]) -> dict[str, Any]:
    """GPTModel's rotary arguments: its base, and Llama 3.1's scaling (``rope_scaling``: its factor)."""
    return dict(rotary_base=m.get("rotary_base", 10000),
                **({"rope_scaling": True, "rope_scaling_factor": m["rope_scaling"]} if m.get("rope_scaling") else {}))


def _attending(spec: Any) -> Any:
    """``spec`` (a layer's, or a block's layers') with ``CoreAttention`` for multi-latent attention."""
    for layer in getattr(spec, "layer_specs", [spec]):
        attention = layer.submodules.self_attention
        if attention.module is multi_latent_attention.MLASelfAttention:
            attention.submodules.core_attention = CoreAttention
    return spec


def rules(m: dict[str, Any]) -> gt.ShardingRules:
    """The rules a Megatron-Core GPTModel (local layer spec) needs."""
    layer = r"(decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\."
    fc1 = gt.PackedSwiGLU() if m["glu"] else gt.ColumnParallel()
    vocab = m.get("true_vocab", m["vocab"])  # GPTModel gets the padded size, as Megatron's trainer pads it
    return gt.ShardingRules([
        # With MTP, the stage of its layers (the last) holds the word embeddings again.
        (r"embedding\.word_embeddings\.weight", gt.FirstStage(gt.VocabParallel(vocab))),
        (r"output_layer\.weight", gt.Tied("embedding.word_embeddings.weight") if m["tied"]
         else gt.VocabParallel(vocab)),
        (layer + r"self_attention\.linear_qkv\.(weight|bias)", gt.MegatronQKV(m["heads"], m["groups"])),
        (layer + r"self_attention\.linear_proj\.weight", gt.RowParallel()),
        (layer + r"mlp\.linear_fc1\.(weight|bias)", fc1),
        (layer + r"mlp\.linear_fc2\.weight", gt.RowParallel()),
        (layer + r"mlp\.router\.weight", gt.Replicated()),
        (layer + r"mlp\.experts\.local_experts\.\d+\.linear_fc1\.weight", gt.Experts(m.get("experts") or 1, fc1)),
        (layer + r"mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight",
         gt.Experts(m.get("experts") or 1, gt.RowParallel())),
        (r"mtp\.layers\.\d+\.eh_proj\.weight", gt.ColumnParallel()),
        (r".*(layernorm\.(weight|bias)|norm\.(weight|bias)|linear_proj\.bias|linear_fc2\.bias)", gt.Replicated()),
    ])


def global_name(layout: gt.ParallelLayout, name: str, chunk: int, m: dict[str, Any]) -> str:
    name = layout.global_name(name, chunk)
    return "embedding.word_embeddings.weight" if m["tied"] and name == "output_layer.weight" else name


def scramble(chunks: list[GPTModel], layout: gt.ParallelLayout, m: dict[str, Any], salt: str) -> None:
    """Values unlike any initialisation, equal on every replica (DP, and TP for
    replicated tensors, and both ends of tied embeddings), so the model is
    one consistent global model whatever its layout."""
    def fill(t: torch.Tensor, key: str) -> None:
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little"))
        t.copy_(torch.randn(t.shape, generator=g) * 0.3)

    with torch.no_grad():
        for chunk, model in enumerate(chunks):
            for name, p in model.named_parameters():
                sharded = getattr(p, "tensor_model_parallel", False)
                fill(p, f"{salt}/{global_name(layout, name, chunk, m)}/{layout.tp_rank if sharded else 0}")
            for name, b in model.named_buffers():  # a router's expert bias (replicated), which routes
                if name.endswith("router.expert_bias"):
                    fill(b, f"{salt}/{global_name(layout, name, chunk, m)}")


def logits(chunks: list[GPTModel], layout: gt.ParallelLayout) -> list[float] | None:
    """The full logits of a fixed batch, run by hand through the pipeline's
    chunks in Megatron's order (chunk 0 of every stage, then chunk 1, ...;
    send/recv between stages, around the ring between chunks) and gathered
    over TP; returned by the rank that holds them whole (last stage, TP rank 0,
    DP rank 0). With multi-token prediction, whose forward needs labels: the
    per-token loss and the MTP block's hidden states instead."""
    ids = (torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) * 7) % 50
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    mtp = bool(chunks[0].config.mtp_num_layers)
    labels = {"labels": torch.roll(ids, -1, dims=1)} if mtp else {}
    hidden_shape = (SEQ, BATCH, chunks[0].config.hidden_size)
    mtp_out: list[torch.Tensor] = []
    with torch.no_grad():
        for c, model in enumerate(chunks):
            model.eval()
            if getattr(model, "mtp_process", False):
                model.mtp.register_forward_hook(lambda _m, _i, out: mtp_out.append(out))
            first, last = c == 0 and ps.is_pipeline_first_stage(), c == len(chunks) - 1 and ps.is_pipeline_last_stage()
            if not first:
                recv = torch.empty(hidden_shape)
                dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(recv)
            out = model(ids, pos, mask, **labels)
            if not last:
                dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        if not last:
            return None
    if mtp:  # the loss is reduced over TP already, and the hidden states are whole
        full = torch.cat([out.flatten(), mtp_out[0].flatten()])
    else:
        parts = [torch.empty_like(out) for _ in range(layout.tp_size)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=-1)
    return full.flatten().tolist() if layout.tp_rank == 0 and layout.dp_rank == 0 else None


def _named(chunks: list[GPTModel], layout: gt.ParallelLayout) -> dict[str, torch.Tensor]:
    return {layout.global_name(n, c): p.detach().clone()
            for c, model in enumerate(chunks) for n, p in model.named_parameters()}


def _megatron(chunks: list[GPTModel]) -> dict[str, Any]:
    """The sharded state dict Megatron's trainer saves: one entry per chunk
    (``model0``, ``model1``, ... with VPP; its keys are global). The metadata
    names the data-parallel group, as the trainer's does: an MTP stage's
    embedding copy needs it."""
    meta = ensure_metadata_has_dp_cp_group(None)
    return {f"model{c}": chunk.sharded_state_dict(metadata=meta) for c, chunk in enumerate(chunks)}


def saved_with_globalshard(path: str, save: dict[str, int],
                           model: dict[str, Any]) -> tuple[list[GPTModel], Any, Any]:
    """A model at layout ``save`` with values unlike any initialisation, its logits, saved to ``path``."""
    layout = setup(model, **save)
    a = build(model, layout)
    scramble(a, layout, model, "saved")
    before = logits(a, layout)
    gt.save_checkpoint(path, model=a, layout=layout, rules=rules(model))
    return a, layout, before


def scenario(rank: int, *, path: str, save: dict[str, int], load: dict[str, int], model: dict[str, Any],
             name: str) -> dict[str, Any]:
    """Save at ``save`` with globalshard and with Megatron's dist_checkpointing;
    load at ``load`` with each (globalshard with its default arguments);
    every tensor and the logits compared."""
    ours, theirs = os.path.join(path, name, "globalshard"), os.path.join(path, name, "megatron")
    a, layout, before = saved_with_globalshard(ours, save, model)
    if rank == 0:
        os.makedirs(theirs, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_megatron(a), theirs)
    del a

    layout = setup(model, **load)
    b = build(model, layout)
    scramble(b, layout, model, "fresh")
    result = gt.load_checkpoint(ours, model=b, layout=layout, rules=rules(model))
    c = build(model, layout)
    scramble(c, layout, model, "fresh")
    loaded = dist_checkpointing.load(_megatron(c), theirs)
    for i, chunk in enumerate(c):
        chunk.load_state_dict(loaded.get(f"model{i}", {}))  # a chunk without layers holds nothing
    ours_t, theirs_t = _named(b, layout), _named(c, layout)
    differ = sorted(k for k in ours_t if not torch.equal(ours_t[k], theirs_t[k]))
    after = logits(b, layout)
    return {"differ": differ, "tensors": len(ours_t), "unexpected": result.unexpected_keys,
            "before": before, "after": after}


def export_scenario(rank: int, *, path: str, save: dict[str, int], load: dict[str, int], model: dict[str, Any],
                    name: str, export: str) -> dict[str, Any]:
    """Saved at ``save`` with globalshard, exported by ``globalshard export
    --map <export>`` and opened by transformers as the architecture its
    ``config.json`` names (its logits and class name returned by rank 0); the
    exported folder then read back by ``load_hf`` into a fresh model at
    ``load`` (its logits returned by the rank that holds them)."""
    import transformers

    from globalshard.cli import main as cli

    ckpt, hf = os.path.join(path, name, "ckpt"), os.path.join(path, name, "hf")
    a, layout, before = saved_with_globalshard(ckpt, save, model)
    del a
    params = {"heads": model["heads"], "kv_heads": model["groups"], "rms_norm_eps": 1e-5, "rope_theta": 10000}
    exported = architecture = None
    if rank == 0:
        args = [f"--param={k}={v}" for k, v in params.items()]
        assert cli(["export", ckpt, hf, "--map", export, *args]) == 0
        reference = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        ids = (torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) * 7) % 50
        with torch.no_grad():
            exported = reference(ids).logits.flatten().tolist()
        architecture = type(reference).__name__
    dist.barrier()
    layout = setup(model, **load)
    b = build(model, layout)
    scramble(b, layout, model, "fresh")
    gt.load_hf(hf, b, layout, rules(model), mapping=export, params=params)
    return {"before": before, "exported": exported, "architecture": architecture, "after": logits(b, layout)}


def trained(model: dict[str, Any], layout: gt.ParallelLayout, salt: str) -> tuple[GPTModel, Any, Any]:
    """A GPTModel in Megatron's DDP wrapper with its distributed optimizers (one for
    the experts' own buffers with MoE, chained), after one Adam step (gradients a
    function of the weights, so equal on every replica)."""
    (gpt,) = build(model, layout)
    scramble([gpt], layout, model, salt)
    # TODO(limitation): torch's AdamW only (Megatron's CPU fallback), not its fused Adams.
    # bf16 parameters: wrapped in Float16Module as Megatron's trainer does; the optimizer keeps fp32 main copies.
    wrapped = Float16Module(gpt.config, gpt) if model.get("bf16") else gpt
    ddp = DistributedDataParallel(config=gpt.config, module=wrapped, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    with _distributed_optimizer_on_cpu():
        # A learning rate of the saving run's own, so a load that left the groups as they were shows.
        lr = 1e-2 if salt == "saved" else 3e-3
        chained = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, use_distributed_optimizer=True,
                                                         bf16=bool(model.get("bf16"))), [ddp])
    for p in ddp.parameters():
        p.main_grad.copy_(torch.sin(p.detach() * 3.0))
    ddp.finish_grad_sync()
    with _distributed_optimizer_on_cpu():
        chained.step()
    return gpt, ddp, chained


def main_shards(chained: Any) -> list[tuple[Any, torch.Tensor, torch.Tensor, bool]]:
    """``(its DistributedOptimizer, model parameter, the optimizer's shard of it, whether
    that shard is an fp32 main copy of a bf16 parameter)`` for every parameter this rank steps."""
    return [(opt, p, shard, master) for opt in chained.chained_optimizers for models, shards, master in (
        (opt.model_fp32_groups, opt.shard_fp32_groups, False),
        (opt.model_float16_groups, opt.shard_fp32_from_float16_groups, True))
        for params, group in zip(models, shards) for p, shard in zip(params, group)]


def flat_shards(gpt: GPTModel, chained: Any, layout: gt.ParallelLayout,
                ddp: Any) -> tuple[list[gt.FlatShard], bool]:
    """This rank's pieces of the Adam state, as Megatron's DistributedOptimizers hold them
    (by docs/torch.md's recipe), and whether megatron_param_ranges gives the same ranges."""
    names: dict[str, Any] = {"chained": chained, "gt": gt}  # docs/torch.md's pieces, run as printed
    exec(_recipe("  pieces = []", "  gt.save_checkpoint(path, model=ddp"), names)
    pieces: list[gt.FlatShard] = names["pieces"]
    assert len(pieces) == len(main_shards(chained))
    # Megatron's DDP keeps experts (allreduce=False) in buffers of their own, sharded over expert DP.
    dense = [p for p in gpt.parameters() if getattr(p, "allreduce", True)]
    experts = [p for p in gpt.parameters() if not getattr(p, "allreduce", True)]
    expert_dp = layout.tp_size * layout.dp_size // (layout.expert_tp_size * layout.ep_size)
    ours = gt.megatron_param_ranges(dense, dp_size=layout.dp_size, dp_rank=layout.dp_rank, bucket_size=ddp.bucket_size)
    if experts:
        ours += gt.megatron_param_ranges(experts, dp_size=expert_dp, dp_rank=layout.expert_dp_rank,
                                         bucket_size=ddp.bucket_size)
    same = sorted((id(p), s, e) for p, s, e in ours) == sorted((id(f.param), f.start, f.stop) for f in pieces)
    return pieces, same


def _differences(x: GPTModel, x_opt: Any, y: GPTModel, y_opt: Any, layout: gt.ParallelLayout) -> list[str]:
    """Where two models with their distributed optimizers differ: Adam moments, main
    parameters, param groups' hyperparameters and model tensors."""
    out = []
    for j, ((x_part, _, a, _), (y_part, _, b, _)) in enumerate(zip(main_shards(x_opt), main_shards(y_opt),
                                                                   strict=True)):
        for item in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(x_part.optimizer.state[a][item], y_part.optimizer.state[b][item]):
                out.append(f"shard {j} {item}")
        if not torch.equal(a, b):
            out.append(f"shard {j} main param")
    out += _group_differences(x_opt, y_opt)
    x_t, y_t = _named([x], layout), _named([y], layout)
    return out + sorted(k for k in x_t if not torch.equal(x_t[k], y_t[k]))


def _group_differences(x_opt: Any, y_opt: Any) -> list[str]:
    """The hyperparameters in which two optimizers' param groups differ. Megatron's load also
    writes a per-group "step" (its fused Adams'; torch's AdamW counts per parameter): left out."""
    out = []
    for n, (x, y) in enumerate(zip(x_opt.param_groups, y_opt.param_groups, strict=True)):
        keys = sorted(k for k in set(x) | set(y) if k not in ("params", "step") and x.get(k) != y.get(k))
        if keys:
            out.append(f"param group {n}: " + ", ".join(f"{k} {x.get(k)!r} vs {y.get(k)!r}" for k in keys))
    return out


def _keeping_step(opt: Any) -> Any:
    set_state = opt._set_main_param_and_optimizer_states

    def keeping_step(model_param: Any, tensors: dict[str, torch.Tensor]) -> None:
        group, order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        set_state(model_param, tensors)
        if step is not None:
            state["step"] = step

    return keeping_step


def distopt_scenario(rank: int, *, path: str, save: dict[str, int], load: dict[str, int], model: dict[str, Any],
                     name: str, distopt: bool) -> dict[str, Any]:
    """Megatron-Core's distributed optimizer saved at ``save`` with globalshard (its
    pieces as FlatShards) and with dist_checkpointing (``fully_reshardable``), loaded
    at ``load`` by each into another distributed optimizer; every Adam moment and
    param group's hyperparameters compared."""
    ours, theirs = os.path.join(path, name, "globalshard"), os.path.join(path, name, "megatron")
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    layout = setup(model, **save)
    gpt, ddp, opt = trained(model, layout, "saved")
    pieces, same_ranges_saved = flat_shards(gpt, opt, layout, ddp)
    gt.save_checkpoint(ours, model=ddp, layout=layout, rules=rules(model), optimizer=opt, optimizer_shards=pieces)
    if rank == 0:
        os.makedirs(theirs, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": gpt.sharded_state_dict(),
                             "optimizer": opt.sharded_state_dict(gpt.sharded_state_dict(), metadata=meta)}, theirs)
    del gpt, ddp, opt

    layout = setup(model, **load)
    b, b_ddp, b_opt = trained(model, layout, "fresh")
    b_pieces, same_ranges_loaded = flat_shards(b, b_opt, layout, b_ddp)
    result = gt.load_checkpoint(ours, model=b_ddp, layout=layout, rules=rules(model), optimizer=b_opt,
                                optimizer_shards=b_pieces)
    c, _, c_opt = trained(model, layout, "other")
    loaded = dist_checkpointing.load({"model": c.sharded_state_dict(), "optimizer": c_opt.sharded_state_dict(
        c.sharded_state_dict(), is_loading=True, metadata=meta)}, theirs)
    c.load_state_dict(loaded["model"])
    # Megatron's fully_reshardable format keeps param, exp_avg and exp_avg_sq (its fused Adams count
    # steps per group); torch's AdamW, its CPU fallback, also holds a per-parameter "step", which
    # Megatron's load then looks for in what it read: set aside while each parameter's state is set.
    for part in c_opt.chained_optimizers:
        part._set_main_param_and_optimizer_states = _keeping_step(part)
    c_opt.load_state_dict(loaded["optimizer"])
    differ = _differences(b, b_opt, c, c_opt, layout)
    return {"differ": differ, "tensors": len(main_shards(b_opt)), "masters": sum(m for *_, m in main_shards(b_opt)),
            "unexpected": result.unexpected_keys, "same_ranges": same_ranges_saved and same_ranges_loaded}


def distopt_roundtrip_scenario(rank: int, *, path: str, save: dict[str, int], load: dict[str, int],
                               model: dict[str, Any], name: str, roundtrip: bool) -> dict[str, Any]:
    """Megatron's distributed optimizers saved at ``save``, loaded at ``load``, saved
    there and loaded back at ``save`` into fresh ones: every Adam moment, main
    parameter, model tensor and param group's hyperparameters equal the first
    run's (for layouts dist_checkpointing itself does not load across: a MoE
    ChainedOptimizer at EP > 1 saves as chained_0/chained_1, at EP=1 as one)."""
    first, second = os.path.join(path, name, "first"), os.path.join(path, name, "second")
    layout = setup(model, **save)
    a, a_ddp, a_opt = trained(model, layout, "saved")
    gt.save_checkpoint(first, model=a_ddp, layout=layout, rules=rules(model), optimizer=a_opt,
                       optimizer_shards=flat_shards(a, a_opt, layout, a_ddp)[0])
    layout = setup(model, **load)
    b, b_ddp, b_opt = trained(model, layout, "fresh")
    b_pieces, _ = flat_shards(b, b_opt, layout, b_ddp)
    gt.load_checkpoint(first, model=b_ddp, layout=layout, rules=rules(model), optimizer=b_opt,
                       optimizer_shards=b_pieces)
    lrs = sorted({g["lr"] for g in b_opt.param_groups})
    gt.save_checkpoint(second, model=b_ddp, layout=layout, rules=rules(model), optimizer=b_opt,
                       optimizer_shards=b_pieces)
    del b, b_ddp, b_opt
    layout = setup(model, **save)
    c, c_ddp, c_opt = trained(model, layout, "other")
    gt.load_checkpoint(second, model=c_ddp, layout=layout, rules=rules(model), optimizer=c_opt,
                       optimizer_shards=flat_shards(c, c_opt, layout, c_ddp)[0])
    differ = _differences(a, a_opt, c, c_opt, layout)
    return {"differ": differ, "tensors": len(main_shards(c_opt)), "lrs_between": lrs,
            "optimizers": [len(a_opt.chained_optimizers), len(c_opt.chained_optimizers)]}


def scenarios(rank: int, *, path: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kinds = {"export": export_scenario, "distopt": distopt_scenario, "roundtrip": distopt_roundtrip_scenario}
    return [next((f for k, f in kinds.items() if case.get(k)), scenario)(rank, path=path, **case) for case in cases]
