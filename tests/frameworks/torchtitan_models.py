"""torchtitan 0.3's models as its trainer specifies them, with the shapes the framework tests use
(imported by the test processes and by the ranks of torchtitan_jobs.py; no patches here)."""

from __future__ import annotations

from typing import Any

from torchtitan.config.configs import ParallelismConfig
from torchtitan.models import llama3, qwen3
from torchtitan.models.llama3.sharding import set_llama3_sharding_config
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config


def spec(name: str, parallelism: ParallelismConfig) -> Any:
    """The model's spec, with the sharding its ``Config.update_from_config`` sets
    for ``parallelism`` (that method also imports torchtitan's whole trainer,
    whose data loading needs packages left out here)."""
    if name == "llama3":
        out = llama3.model_registry("debugmodel", attn_backend="flex")
        set_llama3_sharding_config(out.model, enable_sp=parallelism.enable_sequence_parallel)
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
