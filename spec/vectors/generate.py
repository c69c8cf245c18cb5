"""Regenerate the test vectors in spec/vectors/: small checkpoints and the arrays they hold.

    python spec/vectors/generate.py [OUT [NAME ...]]   (OUT: spec/vectors; NAME: only those vectors)

Each vector is a directory holding a checkpoint (metadata.json, saves/) and
``expected.json``: for every key its dtype, global shape and the raw
little-endian bytes of the global array in C order (hex), which any reader
in any language can compare with. tests/format/test_vectors.py reads every vector
with the library and with spec/reference_reader.py.

| vector | what it covers |
| --- | --- |
| dtypes | every dtype of section 6, bit patterns including NaN payloads, split in two regions |
| sharded | `sharding_indexed` arrays with many small inner chunks, partial ones at the edges |
| padding | a vocabulary-parallel embedding saved from padded local arrays (only real rows stored) |
| packed | fused QKV (grouped-query) and SwiGLU gate/up: local arrays of segments of the global one |
| flat | ZeRO-style flat ranges: boxes cut from a contiguous range of elements |
| scalars_and_empty | 0-d tensors and zero-size tensors (no regions), and a trainer state |
| replicas | data-parallel replicas: stored once |
| small_packs | packs (section 5.1): every dtype, a 0-d tensor and a split tensor in six small packs, |
| | members straddling 40-byte inner chunks, next to a region stored whole |
| based | bases (section 5.2): "w" and "v" of the sibling vector "sharded" referenced (frozen and by |
| | SHA-256), "b" changed and stored, a new key; written after "sharded", with it |
| unbuffered | the arrays of "sharded" written as an asynchronous save writes them: each inner chunk |
| | at a multiple of 4096 bytes in its shard, zeros between (section 5); found by the index alone |
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import numpy as np

import globalshard as gs
from globalshard import planner
from globalshard.dtypes import numpy_dtype
from globalshard.format import paths, zarr

HERE = os.path.dirname(os.path.abspath(__file__))


def bits(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    dt = numpy_dtype(dtype)
    n = int(np.prod(shape)) if shape else 1
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    return rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape).copy()


def whole(key: str, value: np.ndarray, offset: tuple[int, ...] | None = None,
          global_shape: tuple[int, ...] | None = None, **kw: Any) -> gs.ShardedTensor:
    return gs.ShardedTensor.from_offset(key, value, global_shape=global_shape or value.shape,
                                        global_offset=offset or (0,) * value.ndim, **kw)


def rows(key: str, value: np.ndarray, parts: int) -> dict[str, gs.ShardedTensor]:
    """``value`` cut into ``parts`` row blocks (the last may be shorter)."""
    n = -(-value.shape[0] // parts)
    return {f"{key}/{i}": whole(key, value[i * n:(i + 1) * n].copy(), (i * n, *[0] * (value.ndim - 1)), value.shape)
            for i in range(parts) if value[i * n:(i + 1) * n].size}


def vector_dtypes() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    g = {f"t.{d}": bits((4, 3), d, i) for i, d in enumerate(gs.SUPPORTED_DTYPES)}
    state: dict[str, gs.ShardedTensor] = {}
    for k, v in g.items():
        state |= rows(k, v, 2)
    return g, state, None


def vector_sharded() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    g = {"w": bits((13, 7), "float32", 1), "b": bits((11, 5), "bfloat16", 2), "v": bits((33,), "int16", 3)}
    state: dict[str, gs.ShardedTensor] = {}
    for k, v in g.items():
        state |= rows(k, v, 2)
    return g, state, None


def vector_padding() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    vocab, hidden, tp = 10, 3, 4
    g = {"embedding.weight": bits((vocab, hidden), "float32", 4)}
    n = -(-vocab // tp)
    state = {}
    for r in range(tp):
        local = np.full((n, hidden), 7.0, np.float32)  # padding rows hold junk: never stored
        real = g["embedding.weight"][r * n:(r + 1) * n]
        local[: len(real)] = real
        regions = [gs.Region(gs.Box((0, 0), real.shape), gs.Box((r * n, 0), real.shape))] if len(real) else []
        state[f"emb{r}"] = gs.ShardedTensor("embedding.weight", local, (vocab, hidden), regions, allow_padding=True)
    return g, state, None


def vector_packed() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    heads, kv_heads, head_dim, hidden, ffn, tp = 4, 2, 2, 3, 4, 2
    qkv = bits(((heads + 2 * kv_heads) * head_dim, hidden), "bfloat16", 5)
    gate_up = bits((2 * ffn, hidden), "float32", 6)
    state = {}
    q, kv, f = heads * head_dim // tp, kv_heads * head_dim // tp, ffn // tp
    for r in range(tp):
        starts = [r * q, heads * head_dim + r * kv, (heads + kv_heads) * head_dim + r * kv]
        local = np.concatenate([qkv[s:s + n] for s, n in zip(starts, [q, kv, kv])])
        offs = [0, q, q + kv]
        state[f"qkv{r}"] = gs.ShardedTensor("qkv", local, qkv.shape, [
            gs.Region(gs.Box((o, 0), (n, hidden)), gs.Box((s, 0), (n, hidden)))
            for o, s, n in zip(offs, starts, [q, kv, kv])])
        local = np.concatenate([gate_up[r * f:(r + 1) * f], gate_up[ffn + r * f:ffn + (r + 1) * f]])
        state[f"gate_up{r}"] = gs.ShardedTensor("gate_up", local, gate_up.shape, [
            gs.Region(gs.Box((0, 0), (f, hidden)), gs.Box((r * f, 0), (f, hidden))),
            gs.Region(gs.Box((f, 0), (f, hidden)), gs.Box((ffn + r * f, 0), (f, hidden)))])
    return {"qkv": qkv, "gate_up": gate_up}, state, None


def vector_flat() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    g = {"exp_avg": bits((5, 6, 4), "float32", 7)}
    flat = g["exp_avg"].reshape(-1)
    state = {}
    for r, (a, b) in enumerate([(0, 37), (37, 50), (50, 120)]):
        for i, t in enumerate(gs.shards_from_flat_range("exp_avg", flat[a:b].copy(), global_shape=(5, 6, 4), start=a)):
            state[f"r{r}/{i}"] = t
    return g, state, None


def vector_scalars_and_empty() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    g = {"step": np.array(12345, np.int64), "loss_scale": np.array(65536.0, np.float64),
         "empty": np.zeros((0, 3), np.float32), "empty3": np.zeros((2, 0, 5), np.int8)}
    state = {k: whole(k, v.copy()) for k, v in g.items()}
    # null for absent scheduler and optimizer state; a NaN loss is written as {"$float": "nan"}.
    return g, state, {"step": 12345, "lr_scheduler": None, "optimizer": None, "loss": float("nan")}


def vector_replicas() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    g = {"w": bits((6, 4), "float16", 8)}
    state: dict[str, gs.ShardedTensor] = {}
    for dp in range(3):
        for k, t in rows("w", g["w"], 2).items():
            state[f"dp{dp}/{k}"] = gs.ShardedTensor(t.key, t.data, t.global_shape, t.regions, replica_id=dp)
    return g, state, None


def vector_small_packs() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    g = {f"p.{d}": bits((3, 2), d, 20 + i) for i, d in enumerate(gs.SUPPORTED_DTYPES)}
    g["scalar"] = np.array(-2.5, np.float32)
    g["split"] = bits((5, 4), "int32", 40)  # two regions, both packed
    g["whole"] = bits((40, 4), "float64", 41)  # 1280 bytes: over pack_below, stored as its own array
    state = {k: whole(k, v.copy()) for k, v in g.items() if k != "split"}
    state |= rows("split", g["split"], 2)
    return g, state, None


def vector_based() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    g, _, _ = vector_sharded()
    g["b"] = bits((11, 5), "bfloat16", 50)  # changed since "sharded": stored here
    g["new"] = bits((4,), "uint8", 51)
    state: dict[str, gs.ShardedTensor] = {}
    for k, v in g.items():
        state |= rows(k, v, 2) if k != "new" else {k: whole(k, v.copy())}
    return g, state, None


def vector_unbuffered() -> tuple[dict[str, np.ndarray], dict[str, gs.ShardedTensor], Any]:
    return vector_sharded()


#: save() options of the vectors that need them ("base": a sibling vector's name), and
#: (CHUNK_BYTES, PACK_BYTES) while they are written.
OPTIONS: dict[str, tuple[dict[str, Any], int | None, int | None]] = {
    "sharded": ({"digests": True}, 24, None),  # inner chunks of a few elements: shards even for tiny arrays
    "small_packs": ({"pack_below": 256}, 40, 256),  # packs of a few members, in 40-byte inner chunks
    "based": ({"base": "sharded", "frozen": ["w"]}, 24, None),  # "v" found equal by its SHA-256
    # Saved by an AsyncSaver: its background part writes shards unbuffered (in a
    # thread here, so that the chunk size set in this process applies).
    "unbuffered": ({"async": True}, 24, None),
}

VECTORS = {name[len("vector_"):]: fn for name, fn in list(globals().items()) if name.startswith("vector_")}


def expected_json(g: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: {"dtype": gs.dtypes.canonical_name(v.dtype), "shape": list(v.shape),
                "hex": np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<"), copy=False).tobytes().hex()}
            for k, v in sorted(g.items())}


def main(out: str = HERE, *names: str) -> None:
    for name, fn in VECTORS.items():
        if names and name not in names:
            continue
        g, state, trainer = fn()
        path = os.path.join(out, name)
        shutil.rmtree(path, ignore_errors=True)
        options, chunk_bytes, pack_bytes = OPTIONS.get(name, ({}, None, None))
        if "base" in options:
            options = {**options, "base": os.path.join(out, options["base"])}
        saved = zarr.CHUNK_BYTES, planner.PACK_BYTES
        zarr.CHUNK_BYTES = chunk_bytes or saved[0]
        planner.PACK_BYTES = pack_bytes or saved[1]
        try:
            if options.pop("async", False):
                saver = gs.AsyncSaver("thread")
                saver.save(state, path, trainer_state=trainer, **options)
                saver.wait()
            else:
                gs.save(state, path, trainer_state=trainer, **options)
        finally:
            zarr.CHUNK_BYTES, planner.PACK_BYTES = saved
        os.remove(os.path.join(path, paths.LOCK_FILE))  # the writers' lock: not part of the vector
        with open(os.path.join(path, "expected.json"), "w") as f:
            json.dump(expected_json(g), f, indent=1, sort_keys=True)
            f.write("\n")
        print(path)


if __name__ == "__main__":
    main(*sys.argv[1:])
