"""torchtitan 0.3's models as its trainer specifies them, with the shapes the framework tests use
(imported by the test processes and by the ranks of torchtitan_jobs.py; no patches here)."""

from __future__ import annotations

from typing import Any

from torchtitan.components.lora import LoRAConverter
from torchtitan.config.configs import ParallelismConfig
from torchtitan.models import deepseek_v3, gpt_oss, llama3, qwen3
from torchtitan.models.common.rope import ComplexRoPE
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
from torchtitan.models.gpt_oss.sharding import set_gpt_oss_sharding_config
from torchtitan.models.llama3.sharding import set_llama3_sharding_config
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config


def spec(name: str, parallelism: ParallelismConfig) -> Any:
    """The model's spec, with the sharding its ``Config.update_from_config`` sets
    for ``parallelism`` (that method also imports torchtitan's whole trainer,
    whose data loading needs packages left out here)."""
    if name in ("llama3", "llama3_lora"):  # "llama3_lora": torchtitan's LoRA, on attention's and the FFN's outputs
        converters = [LoRAConverter.Config(rank=8, alpha=16.0, target_modules=["wo", "w2"])]
        out = llama3.model_registry("debugmodel", attn_backend="flex",
                                    converters=converters if name == "llama3_lora" else None)
        set_llama3_sharding_config(out.model, enable_sp=parallelism.enable_sequence_parallel)
        return out
    if name.startswith("deepseek_v3"):  # small, routed as DeepSeek-V3 is (and Hugging Face's form of it): sigmoid,
        # groups; its rotary embedding and attention scaled by YaRN as in every deepseek_v3 recipe (debugmodel's
        # mscale); "deepseek_v3_mtp": with a multi-token prediction layer (debugmodel_mtp's num_mtp_layers=1)
        out = deepseek_v3.model_registry("debugmodel", attn_backend="flex",
                                         num_mtp_layers=1 if name == "deepseek_v3_mtp" else 0)
        out.model.layers = deepseek_v3._build_dsv3_layers(
            n_layers=3, n_dense_layers=1, dim=out.model.dim, n_heads=4, q_lora_rank=0, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mscale=0.70, dense_hidden_dim=128,
            moe_hidden_dim=64, num_experts=8, num_shared_experts=2, router_top_k=3, router_score_func="sigmoid",
            router_num_expert_groups=4, router_num_limited_groups=2, router_route_scale=2.5, router_route_norm=True,
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=16, max_seq_len=4096 * 4, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                    beta_fast=32.0, beta_slow=1.0, original_seq_len=4096))
        if name == "deepseek_v3_mtp":
            out.model.mtp_layers = deepseek_v3._build_mtp_layers(out.model.layers[-1], dim=out.model.dim,
                                                                 num_mtp_layers=1)
        set_deepseek_v3_sharding_config(out.model, enable_sp=parallelism.enable_sequence_parallel,
                                        enable_ep=parallelism.expert_parallel_degree > 1)
        return out
    if name == "gpt_oss":  # debugmodel's attention (64 heads of 64, 8 kv heads, sinks, YaRN, a window of 128 on
        # even layers), routing and experts, with 8 experts of 64 (not 2880) in 2 layers (not 4)
        out = gpt_oss.model_registry("debugmodel", attn_backend="flex")
        out.model.layers = gpt_oss._build_gptoss_layers(
            dim=out.model.dim, n_layers=2, hidden_dim=64, num_experts=8, top_k=4, load_balance_coeff=1e-3,
            attn_backend="flex", moe_comm_backend="standard", rope=out.model.layers[0].attention.rope)
        set_gpt_oss_sharding_config(out.model, enable_sp=parallelism.enable_sequence_parallel,
                                    enable_ep=parallelism.expert_parallel_degree > 1)
        return out
    if name.endswith("_lora"):  # another model with torchtitan's LoRA on each layer's linears (fused wqkv too;
        # gpt-oss's experts are not Linear modules)
        out = spec(name[:-len("_lora")], parallelism)
        linears = ["wqkv", "wo"] if name.startswith("gpt_oss") else ["wqkv", "wo", "w1", "w3", "w2"]
        lora = LoRAConverter.Config(rank=8, alpha=16.0, target_modules=linears)
        out.model = lora.build().convert(out.model)
        return out
    if name == "qwen3_tied":  # debugmodel: tied embeddings, fused QKV with 8 KV heads of 16; 2 layers (not 8)
        out = qwen3.model_registry("debugmodel", attn_backend="flex")
        attention = out.model.layers[0].attention
        out.model.layers = qwen3._build_qwen3_layers(
            n_layers=2, dim=out.model.dim, n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads,
            head_dim=attention.head_dim, hidden_dim=512, attn_backend="flex", rope=attention.rope)
        set_qwen3_sharding_config(out.model, enable_sp=parallelism.enable_sequence_parallel, enable_ep=False)
        return out
    out = qwen3.model_registry("debugmodel_moe", attn_backend="flex")
    # debugmodel_moe's own attention, with 8 experts of 64 (not 64 of 768) in 2 layers (not 8).
    attention = out.model.layers[0].attention
    out.model.layers = qwen3._build_qwen3_moe_layers(
        n_layers=2, dim=out.model.dim, n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim, moe_hidden_dim=64, num_experts=8, top_k=2, attn_backend="flex",
        moe_comm_backend="standard", rope=attention.rope)
    set_qwen3_sharding_config(out.model, enable_sp=parallelism.enable_sequence_parallel,
                              enable_ep=parallelism.expert_parallel_degree > 1)
    return out
