"""A small Llama trained with real TP, PP (with virtual stages) and DP on CPU/gloo.

The model is Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotary position
embedding in halves, grouped-query attention, SwiGLU, tied embeddings, q/k/v/o
biases as ``attention_bias=True``) with a LoRA adapter on the fused QKV: the
``llama`` mapping exports it, adapter merged, to a folder transformers opens
with the same logits.

Tensor parallelism: column-parallel linears (fused QKV with grouped-query
attention, its kv heads replicated when TP exceeds them, fused SwiGLU
gate/up, LoRA-B of QKV) and row-parallel linears with all-reduces, a
vocabulary-parallel embedding and cross-entropy over a vocabulary padded
to a multiple of TP. Pipeline parallelism: stages exchange activations and
gradients with send/recv over several micro-batches; virtual chunks follow
Megatron's interleaved layer assignment. Data parallelism: gradient
all-reduce. Tied input/output embeddings (two copies across PP stages,
their gradients summed). AdamW, warmup + cosine LR, deterministic data.

Every topology starts from the same global initial weights and sees the same
global batches, so losses agree across topologies up to float32 reduction
order. ``train(...)`` is the entry point of one process; ``run(...)`` spawns a
whole job.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import globalshard as gs
import globalshard_torch as gt


@dataclass(frozen=True)
class Config:
    vocab: int = 251  # no TP size divides it
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 4  # grouped-query attention
    head_dim: int = 8
    ffn: int = 128
    layers: int = 4
    seq: int = 16
    global_batch: int = 8  # sequences per step, whatever the topology
    micro_batch: int = 2  # sequences per micro-batch on one DP rank
    lora_rank: int = 4
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    experts: int = 0  # > 0: every MLP is a mixture of experts (top-2 routing), experts split over EP
    lr: float = 3e-3
    warmup: int = 2
    total_steps: int = 12
    seed: int = 0


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    distopt: bool = False  # a distributed optimizer: each DP rank holds the Adam state of its flat ranges
    ep: int = 1  # expert parallelism, carved out of DP (Megatron-Core's tp-ep-dp order)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}"] + ([f"VPP={self.vpp}"] if self.vpp > 1 else [])
        parts += ([f"DP={self.dp}"] if self.dp > 1 else []) + ([f"EP={self.ep}"] if self.ep > 1 else [])
        parts += ["DistOpt"] if self.distopt else []
        return "/".join(parts)


def rules(cfg: Config) -> gt.ShardingRules:
    return gt.ShardingRules([
        (r"embedding\.weight", gt.VocabParallel(cfg.vocab)),
        (r"lm_head\.weight", gt.Tied("embedding.weight")),
        (r"layers\.\d+\.attn\.qkv\.(weight|bias)", gt.PackedQKV(cfg.heads, cfg.kv_heads)),
        (r"layers\.\d+\.attn\.qkv_lora_B", gt.PackedQKV(cfg.heads, cfg.kv_heads)),
        (r"layers\.\d+\.attn\.proj\.weight", gt.RowParallel()),
        (r"layers\.\d+\.mlp\.gate_up\.weight", gt.PackedSwiGLU()),
        (r"layers\.\d+\.mlp\.down\.weight", gt.RowParallel()),
        (r"layers\.\d+\.mlp\.router\.weight", gt.Replicated()),
        (r"layers\.\d+\.mlp\.experts\.local_experts\.\d+\.gate_up\.weight", gt.Experts(cfg.experts, gt.PackedSwiGLU())),
        (r"layers\.\d+\.mlp\.experts\.local_experts\.\d+\.down\.weight", gt.Experts(cfg.experts, gt.RowParallel())),
        (r".*(norm|bias|lora_A)", gt.Replicated()),
    ])


# --------------------------------------------------------------------------- process groups


class Groups:
    """This rank's place and its TP, DP and embedding groups, and the TP ranks
    that hold the same kv heads (when TP exceeds the kv heads)."""

    def __init__(self, topo: Topology, rank: int, kv_heads: int):
        self.topo = topo
        self.tp_rank = rank % topo.tp
        self.pp_rank = (rank // topo.tp) % topo.pp
        self.dp_rank = rank // (topo.tp * topo.pp)
        grid = [(t, p, d) for d in range(topo.dp) for p in range(topo.pp) for t in range(topo.tp)]
        self.tp = self._mine(rank, topo.tp > 1, {(p, d): [self.rank_of(t, p, d) for t in range(topo.tp)]
                                                 for _, p, d in grid})
        self.dp = self._mine(rank, topo.dp > 1, {(t, p): [self.rank_of(t, p, d) for d in range(topo.dp)]
                                                 for t, p, _ in grid})
        self.embedding = self._mine(rank, topo.pp > 1, {(t, d): [self.rank_of(t, 0, d), self.rank_of(t, topo.pp - 1, d)]
                                                        for t, _, d in grid})
        ep = topo.ep
        self.ep = self._mine(rank, ep > 1, {(t, p, d // ep): [self.rank_of(t, p, d // ep * ep + i) for i in range(ep)]
                                            for t, p, d in grid})
        self.expert_dp = self._mine(rank, topo.dp // ep > 1,
                                    {(t, p, d % ep): [self.rank_of(t, p, d % ep + i * ep) for i in range(topo.dp // ep)]
                                     for t, p, d in grid})
        share = max(1, topo.tp // kv_heads)
        self.kv_share = self._mine(rank, share > 1, {(t // share, p, d): [self.rank_of(t // share * share + i, p, d)
                                                                          for i in range(share)]
                                                     for t, p, d in grid})

    @staticmethod
    def _mine(rank: int, needed: bool, groups: dict[Any, list[int]]) -> Any:
        """Create every group (every rank takes part, in the same order); return this rank's."""
        mine = None
        for ranks in groups.values():
            g = dist.new_group(ranks) if needed else None
            if rank in ranks:
                mine = g
        return mine

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return (dp_rank * self.topo.pp + pp_rank) * self.topo.tp + tp_rank

    def layout(self, cfg: Config) -> gt.ParallelLayout:
        t = self.topo
        return gt.ParallelLayout(tp_rank=self.tp_rank, tp_size=t.tp, pp_rank=self.pp_rank, pp_size=t.pp,
                                 vpp_size=t.vpp, dp_rank=self.dp_rank, dp_size=t.dp, ep_size=t.ep,
                                 num_layers=cfg.layers)


# --------------------------------------------------------------------------- tensor-parallel pieces


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (input of column-parallel layers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (output of row-parallel layers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group is not None else x


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group is not None else x


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary across TP ranks (padding masked)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, vocab: int, group: Any):
        local_v = logits.shape[-1]
        cols = torch.arange(start, start + local_v)
        logits = logits.masked_fill(cols >= vocab, float("-inf"))
        big = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - big.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(-1)
        mine = (target >= start) & (target < start + local_v)
        picked = torch.where(mine, shifted.gather(-1, (target - start).clamp(0, local_v - 1).unsqueeze(-1))
                             .squeeze(-1), torch.zeros_like(total))
        if group is not None:
            dist.all_reduce(total, group=group)
            dist.all_reduce(picked, group=group)
        loss = total.log() - picked
        ctx.save_for_backward(exp / total.unsqueeze(-1), target, mine)
        ctx.start = start
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        softmax, target, mine = ctx.saved_tensors
        grad = softmax.clone()
        idx = (target - ctx.start).clamp(0, grad.shape[-1] - 1).unsqueeze(-1)
        grad.scatter_add_(-1, idx, -mine.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def local_kv_heads(cfg: Config, tp: int) -> int:
    """kv heads a TP rank holds: a share of them, or one replicated over TP / kv_heads ranks."""
    return max(1, cfg.kv_heads // tp)


def rotary(cfg: Config, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position (seq, head_dim), as Hugging Face's Llama computes them."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.arange(seq).float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on halves: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: Config, tp: int):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        rows = (cfg.heads // tp + 2 * local_kv_heads(cfg, tp)) * cfg.head_dim
        self.norm = nn.Parameter(torch.empty(cfg.hidden))
        self.qkv = nn.Linear(cfg.hidden, rows, bias=True)
        self.qkv_lora_A = nn.Parameter(torch.empty(cfg.lora_rank, cfg.hidden))
        self.qkv_lora_B = nn.Parameter(torch.empty(rows, cfg.lora_rank))
        self.proj = nn.Linear(cfg.heads * cfg.head_dim // tp, cfg.hidden, bias=True)

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        c, tp = self.cfg, self.tp
        normed = rms_norm(x, self.norm, c.rms_norm_eps)
        lora = copy_to_tp(normed @ self.qkv_lora_A.t(), group) @ self.qkv_lora_B.t()
        qkv = self.qkv(copy_to_tp(normed, group)) + lora
        nq, nkv, hd = c.heads // tp, local_kv_heads(c, tp), c.head_dim
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        b, s = x.shape[:2]
        cos, sin = rotary(c, s)
        q = apply_rotary(q.view(b, s, nq, hd).transpose(1, 2), cos, sin)
        k = apply_rotary(k.view(b, s, nkv, hd).transpose(1, 2), cos, sin).repeat_interleave(nq // nkv, dim=1)
        v = v.view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        out = (att @ v).transpose(1, 2).reshape(b, s, nq * hd)
        y = reduce_from_tp(nn.functional.linear(out, self.proj.weight), group) + self.proj.bias
        return x + y


class Expert(nn.Module):
    """SwiGLU on normalised input: fused [gate; up] column-parallel, down row-parallel."""

    def __init__(self, cfg: Config, tp: int):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn // tp, bias=False)
        self.down = nn.Linear(cfg.ffn // tp, cfg.hidden, bias=False)

    def forward(self, h: torch.Tensor, group: Any) -> torch.Tensor:
        gate, up = self.gate_up(copy_to_tp(h, group)).chunk(2, dim=-1)
        return reduce_from_tp(self.down(nn.functional.silu(gate) * up), group)


class MLP(Expert):
    """The dense MLP block: its norm, then SwiGLU, added to the residual."""

    def __init__(self, cfg: Config, tp: int):
        super().__init__(cfg, tp)
        self.eps = cfg.rms_norm_eps
        self.norm = nn.Parameter(torch.empty(cfg.hidden))

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        return x + super().forward(rms_norm(x, self.norm, self.eps), group)


class _GatherFromEP(torch.autograd.Function):
    """All-gather the EP group's tokens forward; backward, the sum of every rank's
    gradient for this rank's tokens (all-reduce, then this rank's slice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        n = g.shape[0] // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * n:(r + 1) * n].contiguous(), None


class _ScatterToEP(torch.autograd.Function):
    """Sum the EP group's partial outputs and keep this rank's tokens forward;
    backward, all-gather the gradients of every rank's tokens."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        n = x.shape[0] // dist.get_world_size(group)
        r = dist.get_rank(group)
        return x[r * n:(r + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class MoE(nn.Module):
    """A mixture of SwiGLU experts with top-2 routing (Mixtral's: softmax, top 2,
    renormalised). Each EP rank holds ``experts / ep`` of them; tokens are
    exchanged the way Megatron's ``allgather`` dispatcher does: every rank of
    the EP group runs its experts on the group's tokens, and the partial
    outputs are summed back to the rank that owns each token."""

    def __init__(self, cfg: Config, tp: int, ep: int):
        super().__init__()
        self.cfg, self.ep_group = cfg, None  # the EP group is set once the process groups exist
        self.ep_rank = 0
        self.norm = nn.Parameter(torch.empty(cfg.hidden))
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = nn.Module()
        self.experts.local_experts = nn.ModuleList(Expert(cfg, tp) for _ in range(cfg.experts // ep))

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        c = self.cfg
        h = rms_norm(x, self.norm, c.rms_norm_eps).reshape(-1, c.hidden)
        top, index = self.router(h).softmax(-1).topk(2, dim=-1)
        weights = torch.zeros(h.shape[0], c.experts).scatter(1, index, top / top.sum(-1, keepdim=True))
        if self.ep_group is not None:
            h, weights = _GatherFromEP.apply(h, self.ep_group), _GatherFromEP.apply(weights, self.ep_group)
        first = self.ep_rank * len(self.experts.local_experts)
        out = sum(weights[:, first + i:first + i + 1] * expert(h, group)
                  for i, expert in enumerate(self.experts.local_experts))
        if self.ep_group is not None:
            out = _ScatterToEP.apply(out, self.ep_group)
        return x + out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: Config, tp: int, ep: int = 1):
        super().__init__()
        self.attn = Attention(cfg, tp)
        self.mlp: nn.Module = MoE(cfg, tp, ep) if cfg.experts else MLP(cfg, tp)

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        return self.mlp(self.attn(x, group), group)


def padded_vocab(cfg: Config, tp: int) -> int:
    return -(-cfg.vocab // tp) * tp


class Chunk(nn.Module):
    """One virtual pipeline chunk of one stage: maybe the embedding, its layers, maybe the head."""

    def __init__(self, cfg: Config, layout: gt.ParallelLayout, chunk: int):
        super().__init__()
        tp = layout.tp_size
        self.first = layout.is_first_stage and chunk == 0
        self.last = layout.is_last_stage and chunk == layout.vpp_size - 1
        self.vocab_start = layout.tp_rank * (padded_vocab(cfg, tp) // tp)
        if self.first:
            self.embedding = nn.Embedding(padded_vocab(cfg, tp) // tp, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, tp, layout.ep_size) for _ in layout.chunk_layers(chunk))
        if self.last:
            self.final_norm = nn.Parameter(torch.empty(cfg.hidden))
            self.lm_head = nn.Module()
            if self.first:
                self.lm_head.weight = self.embedding.weight  # PP=1: one tensor under two names
            else:
                self.lm_head.weight = nn.Parameter(torch.empty(padded_vocab(cfg, tp) // tp, cfg.hidden))
        self.cfg = cfg

    def embed(self, tokens: torch.Tensor, group: Any) -> torch.Tensor:
        n = self.embedding.weight.shape[0]
        local = tokens - self.vocab_start
        mine = (local >= 0) & (local < n)
        out = self.embedding(local.clamp(0, n - 1)) * mine.unsqueeze(-1)
        return reduce_from_tp(out, group)

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, group)
        return x

    def head(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        """This rank's columns of the logits (its part of the padded vocabulary)."""
        return copy_to_tp(rms_norm(x, self.final_norm, self.cfg.rms_norm_eps), group) @ self.lm_head.weight.t()

    def loss(self, x: torch.Tensor, targets: torch.Tensor, group: Any) -> torch.Tensor:
        logits = self.head(x, group)
        return _VocabParallelCE.apply(logits, targets, self.vocab_start, self.cfg.vocab, group).mean()


# --------------------------------------------------------------------------- initial weights, data


def global_init(cfg: Config) -> dict[str, np.ndarray]:
    """The global initial value of every parameter (what TP=1/PP=1 would hold)."""
    rng = np.random.default_rng(cfg.seed)
    qkv = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim

    def w(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"embedding.weight": w(cfg.vocab, cfg.hidden), "final_norm": np.ones(cfg.hidden, np.float32)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        out |= {p + "attn.norm": np.ones(cfg.hidden, np.float32), p + "attn.qkv.weight": w(qkv, cfg.hidden),
                p + "attn.qkv.bias": w(qkv),
                p + "attn.qkv_lora_A": w(cfg.lora_rank, cfg.hidden), p + "attn.qkv_lora_B": w(qkv, cfg.lora_rank),
                p + "attn.proj.weight": w(cfg.hidden, cfg.heads * cfg.head_dim),
                p + "attn.proj.bias": np.zeros(cfg.hidden, np.float32),
                p + "mlp.norm": np.ones(cfg.hidden, np.float32)}
        if cfg.experts:  # per global expert (the checkpoint stacks them as one array per layer)
            out[p + "mlp.router.weight"] = w(cfg.experts, cfg.hidden, scale=0.5)
            for e in range(cfg.experts):
                out |= {p + f"mlp.experts.local_experts.{e}.gate_up.weight": w(2 * cfg.ffn, cfg.hidden),
                        p + f"mlp.experts.local_experts.{e}.down.weight": w(cfg.hidden, cfg.ffn)}
        else:
            out |= {p + "mlp.gate_up.weight": w(2 * cfg.ffn, cfg.hidden), p + "mlp.down.weight": w(cfg.hidden, cfg.ffn)}
    return out


def local_part(cfg: Config, key: str, g: np.ndarray, tp: int, r: int) -> np.ndarray:
    """What TP rank r of T holds of a global initial value (vocabulary padding: zeros)."""
    if key == "embedding.weight":
        n = padded_vocab(cfg, tp) // tp
        out = np.zeros((n, g.shape[1]), g.dtype)
        part = g[r * n:(r + 1) * n]
        out[: len(part)] = part
        return out
    if key.endswith(("qkv.weight", "qkv.bias", "qkv_lora_B")):
        hd = cfg.head_dim
        q, kv = cfg.heads * hd // tp, local_kv_heads(cfg, tp) * hd
        first = r * cfg.kv_heads // tp * hd  # this rank's first kv row (its replica's, when shared)
        qh, kh = cfg.heads * hd, cfg.kv_heads * hd
        return np.concatenate([g[r * q:(r + 1) * q], g[qh + first:qh + first + kv],
                               g[qh + kh + first:qh + kh + first + kv]])
    if key.endswith("gate_up.weight"):
        f = cfg.ffn // tp
        return np.concatenate([g[r * f:(r + 1) * f], g[cfg.ffn + r * f:cfg.ffn + (r + 1) * f]])
    if key.endswith(("proj.weight", "down.weight")):
        n = g.shape[1] // tp
        return g[:, r * n:(r + 1) * n]
    return g


def batch(cfg: Config, step: int) -> torch.Tensor:
    """The global batch of a step: arithmetic sequences mod vocab (learnable), (global_batch, seq + 1)."""
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, cfg.vocab, (cfg.global_batch, 1), generator=g)
    stride = torch.randint(1, 8, (cfg.global_batch, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab


def lr_lambda(cfg: Config) -> Any:
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.total_steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


# --------------------------------------------------------------------------- one training step


class Trainer:
    def __init__(self, cfg: Config, topo: Topology, rank: int):
        if topo.ep > 1 and (not cfg.experts or cfg.experts % topo.ep or topo.distopt):
            # TODO(limitation): the demo's distributed optimizer shards over DP, not over expert-DP as
            # Megatron-Core does for experts, so it does not run with EP.
            raise ValueError(f"{topo}: EP needs experts divisible by it, and no distributed optimizer")
        self.cfg, self.topo, self.rank = cfg, topo, rank
        self.groups = Groups(topo, rank, cfg.kv_heads)
        self.layout = self.groups.layout(cfg)
        self.chunks = [Chunk(cfg, self.layout, c) for c in range(topo.vpp)]
        init = global_init(cfg)
        with torch.no_grad():
            for c, chunk in enumerate(self.chunks):
                for name, p in chunk.named_parameters():
                    key = self.layout.global_name(name, c)
                    key = "embedding.weight" if key == "lm_head.weight" else key
                    key = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{self.global_expert(int(m[1]))}.",
                                 key)
                    p.copy_(torch.from_numpy(local_part(cfg, key, init[key], topo.tp, self.groups.tp_rank)))
        for ch in self.chunks:
            for layer in ch.layers:
                if isinstance(layer.mlp, MoE):
                    layer.mlp.ep_group, layer.mlp.ep_rank = self.groups.ep, self.layout.ep_rank
        self.params = [p for ch in self.chunks for p in ch.parameters()]
        # A distributed optimizer, as Megatron-Core lays it out: this DP rank owns the flat ranges
        # megatron_param_ranges gives, and AdamW runs on copies of those ranges only.
        self.ranges = [(p, start, stop, nn.Parameter(p.detach().view(-1)[start:stop].clone()))
                       for p, start, stop in gt.megatron_param_ranges(self.params, dp_size=topo.dp,
                                                                      dp_rank=self.groups.dp_rank)
                       ] if topo.distopt else []
        stepped = [(p, piece) for p, _, _, piece in self.ranges] if topo.distopt else [(p, p) for p in self.params]
        decay = [piece for p, piece in stepped if p.ndim > 1]
        no_decay = [piece for p, piece in stepped if p.ndim <= 1]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), foreach=False)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.step = 0

    def global_expert(self, local: int) -> int:
        return self.layout.ep_rank * self.cfg.experts // self.topo.ep + local

    @property
    def model(self) -> list[nn.Module]:
        return list(self.chunks)

    def _peer(self, pp_rank: int) -> int:
        g = self.groups
        return g.rank_of(g.tp_rank, pp_rank, g.dp_rank)

    def train_step(self) -> float | None:
        """One optimizer step over the global batch; the mean loss on the reporting rank, else None."""
        cfg, topo, g = self.cfg, self.topo, self.groups
        tokens = batch(cfg, self.step)
        per_dp = cfg.global_batch // topo.dp
        mine = tokens[g.dp_rank * per_dp:(g.dp_rank + 1) * per_dp]
        micro = [mine[i:i + cfg.micro_batch] for i in range(0, per_dp, cfg.micro_batch)]
        n_micro = len(micro)
        for p in self.params:  # (the optimizer of a distributed one holds copies, not these)
            if p.grad is not None:
                p.grad.zero_()
        # The virtual pipeline: (chunk, stage) in order; a micro-batch goes through all of it.
        # TODO(limitation): all forwards, then all backwards (GPipe order), not 1F1B.
        order = [(c, s) for c in range(topo.vpp) for s in range(topo.pp)]
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        total = torch.zeros(())
        shape = (cfg.micro_batch, cfg.seq, cfg.hidden)
        for m, mb in enumerate(micro):  # forward
            for i, (c, s) in enumerate(order):
                if s != g.pp_rank:
                    continue
                chunk = self.chunks[c]
                if i == 0:
                    x_in = None
                    x = chunk.embed(mb[:, :-1], g.tp)
                else:
                    x_in = torch.empty(shape)
                    dist.recv(x_in, src=self._peer(order[i - 1][1]))
                    x_in.requires_grad_(True)
                    x = x_in
                y = chunk(x, g.tp)
                if i == len(order) - 1:
                    y = chunk.loss(y, mb[:, 1:], g.tp) / n_micro
                    total += y.detach()
                else:
                    dist.send(y.detach(), dst=self._peer(order[i + 1][1]))
                saved[(m, i)] = (x_in, y)
        for m in reversed(range(n_micro)):  # backward
            for i in reversed(range(len(order))):
                c, s = order[i]
                if s != g.pp_rank:
                    continue
                x_in, y = saved.pop((m, i))
                if i == len(order) - 1:
                    y.backward()
                else:
                    grad = torch.empty(shape)
                    dist.recv(grad, src=self._peer(order[i + 1][1]))
                    y.backward(grad)
                if x_in is not None:
                    dist.send(x_in.grad, dst=self._peer(order[i - 1][1]))
        if g.kv_share is not None:  # a kv head replicated over TP ranks: each saw only its query heads
            q_rows = cfg.heads // topo.tp * cfg.head_dim
            for ch in self.chunks:
                for layer in ch.layers:
                    a = layer.attn
                    for p in (a.qkv.weight, a.qkv.bias, a.qkv_lora_B):
                        kv_grad = p.grad[q_rows:].contiguous()
                        dist.all_reduce(kv_grad, group=g.kv_share)
                        p.grad[q_rows:] = kv_grad
        if g.embedding is not None:  # tied copies on the first and last stage: sum their gradients
            first, last = self.chunks[0], self.chunks[-1]
            w = first.embedding.weight if g.pp_rank == 0 else last.lm_head.weight
            dist.all_reduce(w.grad, group=g.embedding)
        if g.dp is not None:
            for ch in self.chunks:
                for name, p in ch.named_parameters():
                    # An expert is held by the ranks of its expert-DP group only; it saw its whole EP group's tokens.
                    group = g.expert_dp if ".local_experts." in name else g.dp
                    if group is not None:
                        dist.all_reduce(p.grad, group=group)
                    p.grad /= topo.dp
        if topo.distopt:
            for p, start, stop, piece in self.ranges:
                piece.grad = p.grad.view(-1)[start:stop].clone()
        self.opt.step()
        self.sched.step()
        if topo.distopt:
            self._gather_ranges()
        self.step += 1
        last_stage = g.pp_rank == topo.pp - 1
        if g.dp is not None and last_stage:
            dist.all_reduce(total, group=g.dp)
            total /= topo.dp
        return float(total) if last_stage and g.tp_rank == 0 and g.dp_rank == 0 else None

    def _gather_ranges(self) -> None:
        """Every parameter whole again on every DP rank, from the ranges each one stepped."""
        with torch.no_grad():
            mine: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
            for p, start, stop, piece in self.ranges:
                mine.setdefault(id(p), []).append((start, stop, piece))
            for p in self.params:
                full = torch.zeros(p.numel())
                for start, stop, piece in mine.get(id(p), []):
                    full[start:stop] = piece
                if self.groups.dp is not None:
                    dist.all_reduce(full, group=self.groups.dp)  # the other ranks add zeros
                p.copy_(full.view_as(p))

    def _flat_shards(self) -> list[gt.FlatShard]:
        """This rank's pieces of the Adam state (created empty before the first step)."""
        out = []
        for p, start, stop, piece in self.ranges:
            st = self.opt.state[piece]
            if not st:
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(piece), exp_avg_sq=torch.zeros_like(piece))
            out.append(gt.FlatShard(p, start, stop, {k: st[k] for k in ("step", "exp_avg", "exp_avg_sq")}))
        return out

    def save(self, path: str, saver: gs.AsyncSaver | None = None) -> gt.LoadResult | None:
        """Save the model, optimizer and scheduler to ``path`` (with ``saver``: in the background)."""
        gt.save_checkpoint(path, model=self.model, layout=self.layout, rules=rules(self.cfg), optimizer=self.opt,
                           saver=saver,
                           optimizer_shards=self._flat_shards() if self.topo.distopt else None,
                           scheduler=self.sched, trainer_state={"step": self.step,
                                                                "consumed_samples": self.step * self.cfg.global_batch,
                                                                "model_config": asdict(self.cfg)})
        return None

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits (batch, seq, vocab) of a process that holds the whole model."""
        if self.topo.world != 1:
            raise ValueError(f"logits() needs the whole model in one process, not {self.topo}")
        chunk = self.chunks[0]
        with torch.no_grad():
            return chunk.head(chunk(chunk.embed(tokens, None), None))[..., :self.cfg.vocab]

    def misplace_after_load(self) -> None:
        """Negative control: what a wrong load would look like (two rows of the
        first layer's fused QKV swapped), to show the loss comparison catches it."""
        for c, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                if self.layout.global_name(name, c) == "layers.0.attn.qkv.weight":
                    with torch.no_grad():
                        p[[0, 1]] = p[[1, 0]]

    def load(self, path: str) -> gt.LoadResult:
        shards = self._flat_shards() if self.topo.distopt else None
        result = gt.load_checkpoint(path, model=self.model, layout=self.layout, rules=rules(self.cfg),
                                    optimizer=self.opt, optimizer_shards=shards, scheduler=self.sched)
        with torch.no_grad():
            for p, start, stop, piece in self.ranges:  # the stepped copies follow the loaded weights
                piece.copy_(p.view(-1)[start:stop])
        self.step = int(result.trainer_state["step"])
        return result


# --------------------------------------------------------------------------- jobs


def _worker(rank: int, world: int, port: int, job: dict[str, Any], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    report: dict[str, Any] = {"rank": rank}
    try:
        cfg, topo = Config(**job["config"]), Topology(**job["topology"])
        torch.manual_seed(0)
        trainer = Trainer(cfg, topo, rank)
        if job.get("resume"):
            dist.barrier()
            t0 = time.perf_counter()
            result = trainer.load(job["resume"])
            dist.barrier()
            report["load_s"] = time.perf_counter() - t0
            report["bytes_needed"] = result.stats.bytes_needed
            report["bytes_read"] = result.stats.bytes_read
            if job.get("misplace"):
                trainer.misplace_after_load()
        report["resume_step"] = trainer.step
        losses = []
        while trainer.step < job["until"]:
            loss = trainer.train_step()
            if loss is not None:
                losses.append(loss)
        report["losses"] = losses
        if job.get("save"):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.save(job["save"])
            dist.barrier()
            report["save_s"] = time.perf_counter() - t0
        report["ok"] = True
    except BaseException as e:
        report |= {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        if report["ok"]:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        os._exit(0)  # gloo threads can abort in C++ destructors at interpreter exit


def run(cfg: Config, topo: Topology, out: str, *, until: int, resume: str | None = None,
        save: str | None = None, misplace: bool = False, start_method: str = "spawn") -> dict[str, Any]:
    """Run a whole job on ``topo.world`` processes; its losses and timings.
    ``start_method``: torch.multiprocessing's (the tests fork the ranks from a
    server that imported torch once)."""
    os.makedirs(out, exist_ok=True)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    job = {"config": asdict(cfg), "topology": asdict(topo), "until": until, "resume": resume, "save": save,
           "misplace": misplace}
    mp.start_processes(_worker, args=(topo.world, port, job, out), nprocs=topo.world, start_method=start_method)
    reports = []
    for r in range(topo.world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            reports.append(json.load(f))
    failed = [r for r in reports if not r["ok"]]
    if failed:
        raise RuntimeError(f"{topo}: rank {failed[0]['rank']} failed: {failed[0]['error']}\n{failed[0]['trace']}")
    losses = next(r["losses"] for r in reports if r["losses"])
    return {
        "losses": losses,
        "resume_step": reports[0]["resume_step"],
        "save_s": max(r.get("save_s", 0.0) for r in reports),
        "load_s": max(r.get("load_s", 0.0) for r in reports),
        "bytes_needed": sum(r.get("bytes_needed", 0) for r in reports),
        "bytes_read": sum(r.get("bytes_read", 0) for r in reports),
    }
