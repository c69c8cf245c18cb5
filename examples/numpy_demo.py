"""Save a small transformer's state at TP=4, load it at TP=2 and TP=1.

    make demo            (or: .venv/bin/python examples/numpy_demo.py [OUT_DIR])

numpy only. The state is cut the way a Megatron-style trainer cuts it:
vocabulary-parallel embedding padded to a multiple of TP, fused QKV with
grouped-query attention ([q_r; k_r; v_r] per rank), fused SwiGLU gate/up
([gate_r; up_r]), row-parallel output projections, replicated norms; bf16
weights and fp32 Adam moments sharing each weight's layout. Every rank of the
saving job is simulated in this one process. Each load checks every element
against the original and prints what it read.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np

import globalshard as gs
from globalshard import Segment, ShardedTensor


@dataclass(frozen=True)
class Config:
    vocab: int = 1003  # no TP size divides it: the embedding is padded
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4  # grouped-query attention
    head_dim: int = 32
    ffn: int = 688


def global_state(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """The full (unsharded) model and optimizer state."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)

    qkv_rows = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    out = {"embedding.weight": w(cfg.vocab, cfg.hidden), "final_norm.weight": np.ones(cfg.hidden, ml_dtypes.bfloat16)}
    for i in range(cfg.layers):
        out |= {
            f"layers.{i}.attn.qkv.weight": w(qkv_rows, cfg.hidden),
            f"layers.{i}.attn.proj.weight": w(cfg.hidden, cfg.heads * cfg.head_dim),
            f"layers.{i}.mlp.gate_up.weight": w(2 * cfg.ffn, cfg.hidden),
            f"layers.{i}.mlp.down.weight": w(cfg.hidden, cfg.ffn),
            f"layers.{i}.norm.weight": np.ones(cfg.hidden, ml_dtypes.bfloat16),
        }
    for name in list(out):  # Adam moments: fp32, the parameter's layout
        out[f"optim.exp_avg.{name}"] = rng.standard_normal(out[name].shape).astype(np.float32) * 1e-3
        out[f"optim.exp_avg_sq.{name}"] = np.abs(rng.standard_normal(out[name].shape)).astype(np.float32) * 1e-6
    return out


def rank_layout(cfg: Config, name: str, shape: tuple[int, ...], tp: int, r: int) -> tuple[str, object]:
    """How TP rank ``r`` holds tensor ``name``: ("offset", (offset, local_shape)) or ("segments", list)."""
    base = name.split("optim.exp_avg_sq.")[-1].split("optim.exp_avg.")[-1]
    if base.endswith("qkv.weight"):
        q, kv = cfg.heads * cfg.head_dim // tp, cfg.kv_heads * cfg.head_dim // tp
        qh, kh = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return "segments", [Segment(0, r * q, q), Segment(q, qh + r * kv, kv), Segment(q + kv, qh + kh + r * kv, kv)]
    if base.endswith("gate_up.weight"):
        f = cfg.ffn // tp
        return "segments", [Segment(0, r * f, f), Segment(f, cfg.ffn + r * f, f)]
    if base == "embedding.weight":
        per = -(-cfg.vocab // tp)
        return "offset", ((r * per, 0), (per, shape[1]))
    if base.endswith(("proj.weight", "down.weight")):  # row-parallel: split the input axis
        n = shape[1] // tp
        return "offset", ((0, r * n), (shape[0], n))
    return "offset", ((0,) * len(shape), shape)  # norms: replicated


def shards(cfg: Config, full: dict[str, np.ndarray], tp: int, *, fill: bool, dtype_of=None) -> gs.ShardedStateDict:
    """Every TP rank's shards of every tensor (filled from ``full``, or empty targets)."""
    out: dict[str, ShardedTensor] = {}
    for name, value in full.items():
        dtype = dtype_of(name, value) if dtype_of else value.dtype
        for r in range(tp):
            kind, how = rank_layout(cfg, name, value.shape, tp, r)
            if kind == "segments":
                local = np.concatenate([value[s.global_offset:s.global_offset + s.length] for s in how])
                data = local.astype(dtype) if fill else np.full(local.shape, np.nan, dtype)
                t = ShardedTensor.from_segments(name, data, global_shape=value.shape, axis=0, segments=how)
            else:
                offset, local_shape = how
                data = np.full(local_shape, np.nan, dtype)
                if fill:
                    sl = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
                    part = value[sl]
                    data[tuple(slice(0, n) for n in part.shape)] = part
                replicated = local_shape == value.shape and value.ndim == 1
                t = ShardedTensor.from_offset(name, data, global_shape=value.shape, global_offset=offset,
                                              replica_id=r if replicated else 0, allow_padding=True)
            out[f"tp{r}/{name}"] = t
    return gs.ShardedStateDict(out)


def check(cfg: Config, full: dict[str, np.ndarray], state: gs.ShardedStateDict) -> int:
    """Compare every loaded element with the original; padding must be zero. Returns elements checked."""
    checked = 0
    for t in state.values():
        expected = np.zeros(t.data.shape, t.data.dtype)
        for reg in t.regions:
            expected[reg.local_box.slices] = full[t.key][reg.global_box.slices].astype(t.data.dtype)
        if not np.array_equal(t.data, expected):
            raise SystemExit(f"MISMATCH in {t.key}")
        checked += t.data.size
    return checked


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join("build", "demo")
    ckpt = os.path.join(out_dir, "ckpt_tp4")
    shutil.rmtree(ckpt, ignore_errors=True)
    cfg = Config()
    full = global_state(cfg)
    total = sum(v.nbytes for v in full.values())
    print(f"model: {cfg}\n{len(full)} tensors, {total / 2**20:.1f} MiB (bf16 weights, fp32 Adam moments)\n")

    stats = gs.IOStats()
    t0 = time.perf_counter()
    gs.save(shards(cfg, full, 4, fill=True), ckpt, stats=stats,
            trainer_state={"step": 1000, "parallel_config": {"tp": 4}, "model_config": cfg.__dict__})
    print(f"saved at TP=4 -> {ckpt}: {stats.arrays} arrays, {stats.bytes_written / 2**20:.1f} MiB written "
          f"(padding and replicas not stored) in {time.perf_counter() - t0:.2f}s\n")

    rows = []
    cases = [
        ("TP=4 -> TP=2", 2, None),
        ("TP=4 -> TP=1", 1, None),
        ("TP=4 -> TP=1, bf16 weights -> fp32", 1, lambda n, v: np.float32),
    ]
    for label, tp, dtype_of in cases:
        targets = shards(cfg, full, tp, fill=False, dtype_of=dtype_of)
        stats = gs.IOStats()
        t0 = time.perf_counter()
        trainer = gs.load(targets, ckpt, stats=stats)
        seconds = time.perf_counter() - t0
        checked = check(cfg, full, targets)
        rows.append((label, stats.arrays, stats.bytes_needed, stats.bytes_read, seconds, checked, trainer["step"]))
    # One pipeline stage of a PP=2 job at TP=2: layers 2-3 only.
    stage = {k: v for k, v in full.items() if any(f"layers.{i}." in k for i in (2, 3))}
    targets = shards(cfg, stage, 2, fill=False)
    stats = gs.IOStats()
    t0 = time.perf_counter()
    trainer = gs.load(targets, ckpt, stats=stats)
    rows.append(("TP=4 -> TP=2, PP stage 1 of 2", stats.arrays, stats.bytes_needed, stats.bytes_read,
                 time.perf_counter() - t0, check(cfg, full, targets), trainer["step"]))

    print(f"{'load':36} {'arrays':>6} {'needed MiB':>10} {'read MiB':>9} {'read/needed':>11} {'s':>6}  check")
    for label, arrays, needed, read, seconds, checked, step in rows:
        print(f"{label:36} {arrays:6d} {needed / 2**20:10.2f} {read / 2**20:9.2f} {read / needed:11.3f} "
              f"{seconds:6.2f}  {checked} elements equal, step {step}")
    print("\nEvery loaded element equals the original; padding rows are zero.")


if __name__ == "__main__":
    main()
