"""Regenerate the example checkpoint in spec/examples/checkpoint/.

    python spec/examples/generate.py [OUTPUT_DIR]

The example holds the layouts the format exists for, saved from simulated
ranks of one process: a bfloat16 embedding with vocabulary padding at TP=3,
a fused QKV weight with grouped-query attention at TP=2, a fused SwiGLU
gate/up weight at TP=2, a norm weight replicated on both TP ranks, a 0-d
scalar and a zero-size tensor. tests/format/test_spec.py checks that the committed
copy still loads, and that saving the same state again writes the same
metadata.json byte for byte.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ml_dtypes
import numpy as np

import globalshard as gs

TRAINER_STATE: dict[str, Any] = {
    "step": 100,
    "consumed_samples": 3200,
    "model_config": {"vocab_size": 10, "hidden": 3, "heads": 4, "kv_heads": 2, "head_dim": 2, "ffn": 4},
    "parallel_config": {"tp": 2, "pp": 1, "vpp": 1, "dp": 1},
}

TP = 2
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 10, 3, 4, 2, 2, 4


def global_arrays() -> dict[str, np.ndarray]:
    """The global value of every example tensor."""

    def ramp(shape: tuple[int, ...], dtype: Any, start: float) -> np.ndarray:
        n = int(np.prod(shape))
        return (np.arange(n, dtype=np.float64).reshape(shape) * 0.5 + start).astype(dtype)

    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {
        "embedding.weight": ramp((VOCAB, HIDDEN), ml_dtypes.bfloat16, -7.0),
        "layers.0.attention.qkv.weight": ramp((qkv_rows, HIDDEN), np.float32, 1.0),
        "layers.0.mlp.gate_up.weight": ramp((2 * FFN, HIDDEN), np.float32, -3.0),
        "layers.0.norm.weight": ramp((HIDDEN,), np.float32, 1.0),
        "loss_scale": np.array(65536.0),
        "empty": np.zeros((0, HIDDEN), np.float32),
    }


def sharded_state() -> gs.ShardedStateDict:
    """The example tensors cut as the saving job held them, all ranks in one dict."""
    g = global_arrays()
    out: dict[str, gs.ShardedTensor] = {}
    # Vocabulary-parallel embedding at TP=3: 10 rows padded to 12, 4 per rank.
    rows = 4
    for r in range(3):
        local = np.zeros((rows, HIDDEN), ml_dtypes.bfloat16)
        real = g["embedding.weight"][r * rows:(r + 1) * rows]
        local[: len(real)] = real
        out[f"tp{r}.embedding"] = gs.ShardedTensor.from_offset(
            "embedding.weight", local, global_shape=(VOCAB, HIDDEN), global_offset=(r * rows, 0),
            allow_padding=True,
        )
    # Fused QKV, global [Q; K; V], rank r holds [q_r; k_r; v_r].
    q, kv = HEADS * HEAD_DIM // TP, KV_HEADS * HEAD_DIM // TP
    for r in range(TP):
        segs = [
            gs.Segment(0, r * q, q),
            gs.Segment(q, HEADS * HEAD_DIM + r * kv, kv),
            gs.Segment(q + kv, (HEADS + KV_HEADS) * HEAD_DIM + r * kv, kv),
        ]
        out[f"tp{r}.qkv"] = _from_segments("layers.0.attention.qkv.weight", g, segs)
    # Fused SwiGLU, global [gate; up], rank r holds [gate_r; up_r].
    f = FFN // TP
    for r in range(TP):
        segs = [gs.Segment(0, r * f, f), gs.Segment(f, FFN + r * f, f)]
        out[f"tp{r}.gate_up"] = _from_segments("layers.0.mlp.gate_up.weight", g, segs)
    for r in range(TP):
        out[f"tp{r}.norm"] = gs.ShardedTensor.from_offset(
            "layers.0.norm.weight", g["layers.0.norm.weight"].copy(), global_shape=(HIDDEN,),
            global_offset=(0,), replica_id=r,
        )
    out["loss_scale"] = gs.ShardedTensor.from_offset("loss_scale", g["loss_scale"].copy(), global_shape=(),
                                                     global_offset=())
    out["empty"] = gs.ShardedTensor.from_offset("empty", g["empty"].copy(), global_shape=(0, HIDDEN),
                                                global_offset=(0, 0))
    return gs.ShardedStateDict(out)


def _from_segments(key: str, g: dict[str, np.ndarray], segs: list[gs.Segment]) -> gs.ShardedTensor:
    full = g[key]
    local = np.concatenate([full[s.global_offset:s.global_offset + s.length] for s in segs])
    return gs.ShardedTensor.from_segments(key, local, global_shape=full.shape, axis=0, segments=segs)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "checkpoint")
    gs.save(sharded_state(), target, trainer_state=TRAINER_STATE, overwrite=True)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
