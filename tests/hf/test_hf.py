"""Hugging Face safetensors both ways: export a checkpoint under Llama names,
load a Llama-style safetensors directory straight into a TP/PP layout.

Files are checked with the ``safetensors`` package itself, and loaded
tensors against a slicing written here from the Hugging Face names alone.
"""

import json
import os
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from repo import EXAMPLES
from safetensors import safe_open
from safetensors.numpy import save_file

import globalshard as gs
from globalshard.hf import ExportError, NameMapping, SafetensorsSource, export
from globalshard.testing.strategies import box_within

sys.path.insert(0, EXAMPLES)
import gpt_trainer as demo

import globalshard_torch as gt

CFG = demo.Config()
HD = CFG.head_dim


def hf_model(cfg=CFG, seed=0):
    """A Llama-style model under Hugging Face names (float32)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = {"model.embed_tokens.weight": w(cfg.vocab, cfg.hidden), "model.norm.weight": w(cfg.hidden)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": w(cfg.hidden), p + "post_attention_layernorm.weight": w(cfg.hidden),
                p + "self_attn.q_proj.weight": w(cfg.heads * HD, cfg.hidden),
                p + "self_attn.k_proj.weight": w(cfg.kv_heads * HD, cfg.hidden),
                p + "self_attn.v_proj.weight": w(cfg.kv_heads * HD, cfg.hidden),
                p + "self_attn.o_proj.weight": w(cfg.hidden, cfg.heads * HD),
                p + "self_attn.q_proj.bias": w(cfg.heads * HD), p + "self_attn.k_proj.bias": w(cfg.kv_heads * HD),
                p + "self_attn.v_proj.bias": w(cfg.kv_heads * HD), p + "self_attn.o_proj.bias": w(cfg.hidden),
                p + "mlp.gate_proj.weight": w(cfg.ffn, cfg.hidden), p + "mlp.up_proj.weight": w(cfg.ffn, cfg.hidden),
                p + "mlp.down_proj.weight": w(cfg.hidden, cfg.ffn)}
    return out


def as_checkpoint_keys(hf):
    """The same model under the demo's checkpoint keys (fused [Q; K; V] and [gate; up])."""
    out = {"embedding.weight": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"]}
    for i in range(CFG.layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out |= {p + "attn.norm": hf[h + "input_layernorm.weight"],
                p + "mlp.norm": hf[h + "post_attention_layernorm.weight"],
                p + "attn.qkv.weight": np.concatenate([hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
                p + "attn.qkv.bias": np.concatenate([hf[h + f"self_attn.{x}_proj.bias"] for x in "qkv"]),
                p + "attn.proj.weight": hf[h + "self_attn.o_proj.weight"],
                p + "attn.proj.bias": hf[h + "self_attn.o_proj.bias"],
                p + "mlp.gate_up.weight": np.concatenate([hf[h + "mlp.gate_proj.weight"],
                                                          hf[h + "mlp.up_proj.weight"]]),
                p + "mlp.down.weight": hf[h + "mlp.down_proj.weight"],
                p + "attn.qkv_lora_A": np.zeros((CFG.lora_rank, CFG.hidden), np.float32),
                p + "attn.qkv_lora_B": np.zeros(((CFG.heads + 2 * CFG.kv_heads) * HD, CFG.lora_rank), np.float32)}
    return out


def save_global(arrays, path, extra=None):
    state = {k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,) * v.ndim)
             for k, v in (arrays | (extra or {})).items()}
    gs.save(state, path)


def read_all(directory):
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    out = {}
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(directory, file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return index, out


def test_export_under_llama_names_splits_fused_layouts(tmp_path):
    hf = hf_model()
    save_global(as_checkpoint_keys(hf), tmp_path / "ckpt",
                extra={"optimizer.exp_avg.final_norm": np.ones(CFG.hidden, np.float32)})
    index = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load("llama"),
                   max_shard_size=40_000)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:  # bounded: a file exceeds the limit only when one tensor alone does
        with safe_open(str(tmp_path / "hf" / f), framework="pt") as st:
            sizes = [st.get_tensor(n).numel() * 4 for n in st.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    _, got = read_all(tmp_path / "hf")
    assert set(got) == set(hf)  # optimizer state skipped, LoRA merged, nothing else lost
    for name, value in hf.items():
        assert np.array_equal(got[name].numpy(), value), name
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in hf.values())
    # Reported, not dropped without a word: the optimizer state skipped, the LoRA factors merged.
    assert index["skipped"] == ["optimizer.exp_avg.final_norm"]
    assert index["merged"] == sorted(f"layers.{i}.attn.qkv_lora_{x}" for i in range(CFG.layers) for x in "AB")


def test_a_re_export_replaces_what_the_earlier_export_left(tmp_path):
    save_global({"w": np.arange(6, dtype=np.float32), "b": np.ones(3, np.float32)}, tmp_path / "ckpt")
    out = tmp_path / "hf"
    export(str(tmp_path / "ckpt"), str(out), max_shard_size=10)  # two shards
    (out / "model.safetensors").write_bytes(b"stale")  # as an even earlier single-file export would leave
    (out / "README.md").write_text("mine")
    index = export(str(tmp_path / "ckpt"), str(out))  # one file now
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors",
                                                     "model.safetensors.index.json"]
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    _, got = read_all(out)
    assert np.array_equal(got["w"].numpy(), np.arange(6, dtype=np.float32))
    export(str(tmp_path / "ckpt"), str(out), max_shard_size=10)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors",
                                                     "model.safetensors.index.json"]


def test_export_converts_floats_to_bf16_and_keeps_integers(tmp_path):
    values = {"w": np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32),
              "step": np.array(7, np.int64)}
    save_global(values, tmp_path / "ckpt")
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype="bfloat16")
    _, got = read_all(tmp_path / "hf")
    assert got["w"].dtype == torch.bfloat16 and got["step"].dtype == torch.int64 and int(got["step"]) == 7
    expected = values["w"].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got["w"].float().numpy(), expected)


@pytest.mark.parametrize("dtype,value,became", [("float16", 70000.0, "inf"), ("float8_e4m3fn", 500.0, "nan"),
                                                 ("float8_e5m2", -1e6, "-inf")])
def test_an_export_that_would_overflow_a_value_to_inf_or_nan_is_refused_naming_it(tmp_path, dtype, value, became):
    # Rounding is what --dtype asks for; a finite weight that becomes inf or NaN (float16 above 65504, e4m3fn
    # above 448, which has no inf) is a broken model, not a rounded one. An earlier export stays as it was.
    w = np.array([[1.0, 2.0], [3.0, value]], np.float32)
    save_global({"a": np.ones(4, np.float32), "w": w}, tmp_path / "ckpt")
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype="bfloat16", max_shard_size=16)
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    with pytest.raises(ExportError, match=re.escape(f"'w': [1, 1] is {value:g} in float32, {became} in {dtype}")):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=dtype, max_shard_size=16)
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    earlier = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(read_all(tmp_path / "hf")[1]["w"].float().numpy(), earlier)
    big = np.array([1.0, 1e6], ml_dtypes.bfloat16)  # bfloat16 has float32's range, float16 not
    save_global({"w": big}, tmp_path / "bf16")
    with pytest.raises(ExportError, match=re.escape("'w': [1] is 999424 in bfloat16, inf in float16")):
        export(str(tmp_path / "bf16"), str(tmp_path / "hf3"), dtype="float16")
    inf = np.array([np.inf, -np.inf, np.nan], np.float32)  # what was not finite already converts as it is
    save_global({"w": inf}, tmp_path / "nonfinite")
    export(str(tmp_path / "nonfinite"), str(tmp_path / "hf2"), dtype="float16")
    np.testing.assert_array_equal(read_all(tmp_path / "hf2")[1]["w"].float().numpy(), inf)


@pytest.mark.parametrize("rule,at,named", [
    ({"key": "w", "name": "x", "axes": [0, 2, 1]}, (1, 2, 3), "'x' (checkpoint key 'w'): [1, 3, 2]"),
    ({"key": "w", "split": {"axis": 1, "parts": [{"name": "a"}, {"name": "b"}]}}, (1, 2, 3),
     "'b' (checkpoint key 'w'): [1, 0, 3]"),
    ({"key": "w", "name": "x.{layer}", "stacked": ["layer"]}, (1, 2, 3), "'x.1' (checkpoint key 'w'): [2, 3]"),
])
def test_a_value_a_dtype_cannot_hold_is_named_where_the_hugging_face_tensor_holds_it(tmp_path, rule, at, named):
    w = np.zeros((2, 4, 4), np.float32)
    w[at] = 1e5
    save_global({"w": w}, tmp_path / "ckpt")
    with pytest.raises(ExportError, match=re.escape(f"{named} is 100000 in float32, inf in float16")):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype="float16", mapping=NameMapping({"tensors": [rule]}))
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


def test_an_export_that_fails_midway_leaves_the_earlier_export_whole(tmp_path):
    # Two files; the second tensor's chunk is damaged: nothing of the new export may replace the earlier
    # one's first file under its index (a model of two exports' tensors).
    save_global({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, tmp_path / "old")
    save_global({"a": np.full(4, 2.0, np.float32), "b": np.full(4, 2.0, np.float32)}, tmp_path / "new")
    export(str(tmp_path / "old"), str(tmp_path / "hf"), max_shard_size=16)
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    region = gs.read_metadata(str(tmp_path / "new")).tensors["b"].regions[0]
    chunk = tmp_path / "new" / region.path / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(gs.StorageError, match="crc32c"):
        export(str(tmp_path / "new"), str(tmp_path / "hf"), max_shard_size=16)
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before


def test_export_in_windows_smaller_than_a_tensor(tmp_path, monkeypatch):
    import globalshard.hf.exporting as hfmod

    monkeypatch.setattr(hfmod, "WINDOW_BYTES", 100)
    value = np.arange(50 * 7, dtype=np.float32).reshape(50, 7)
    save_global({"w": value}, tmp_path / "ckpt")
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    _, got = read_all(tmp_path / "hf")
    assert np.array_equal(got["w"].numpy(), value)


def test_a_key_no_rule_maps_is_an_error_not_a_loss(tmp_path):
    hf = hf_model()
    save_global(as_checkpoint_keys(hf), tmp_path / "ckpt", extra={"mystery": np.ones(3, np.float32)})
    with pytest.raises(ExportError, match="'mystery'"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load("llama"))
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")


def test_a_split_that_does_not_divide_is_an_error(tmp_path):
    save_global(as_checkpoint_keys(hf_model()), tmp_path / "ckpt")
    with pytest.raises(ExportError, match="does not split in proportions"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load("llama", {"heads": 7}))


def test_source_reads_any_box_across_the_fused_parts(tmp_path):
    hf = hf_model()
    save_file(hf, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(str(tmp_path), NameMapping.load("llama"))
    fused = as_checkpoint_keys(hf)["layers.2.attn.qkv.weight"]
    assert source.keys["layers.2.attn.qkv.weight"][1] == fused.shape
    box = gs.Box((CFG.heads * HD - 5, 3), (CFG.kv_heads * HD + 9, 20))  # spans q, k and v
    out = np.empty(box.shape, np.float32)
    source.read("layers.2.attn.qkv.weight", box, out)
    assert np.array_equal(out, fused[box.slices])


# ----------------------------------------------------------------- into a TP/PP layout


def expected_for(key, hf, tp, r):
    if key == "embedding.weight":
        n = -(-CFG.vocab // tp)
        rows = hf["model.embed_tokens.weight"][r * n:(r + 1) * n]
        return np.concatenate([rows, np.zeros((n - len(rows), CFG.hidden), np.float32)])
    if key == "final_norm":
        return hf["model.norm.weight"]
    i, rest = key.split(".")[1], key.split(".", 2)[2]
    h = f"model.layers.{i}."
    if rest in ("attn.qkv.weight", "attn.qkv.bias"):
        q, kv, kind = CFG.heads * HD // tp, CFG.kv_heads * HD // tp, rest.rsplit(".", 1)[1]
        return np.concatenate([hf[h + f"self_attn.q_proj.{kind}"][r * q:(r + 1) * q],
                               hf[h + f"self_attn.k_proj.{kind}"][r * kv:(r + 1) * kv],
                               hf[h + f"self_attn.v_proj.{kind}"][r * kv:(r + 1) * kv]])
    if rest == "mlp.gate_up.weight":
        f = CFG.ffn // tp
        return np.concatenate([hf[h + "mlp.gate_proj.weight"][r * f:(r + 1) * f],
                               hf[h + "mlp.up_proj.weight"][r * f:(r + 1) * f]])
    if rest == "attn.proj.weight":
        n = CFG.heads * HD // tp
        return hf[h + "self_attn.o_proj.weight"][:, r * n:(r + 1) * n]
    if rest == "mlp.down.weight":
        n = CFG.ffn // tp
        return hf[h + "mlp.down_proj.weight"][:, r * n:(r + 1) * n]
    return {"attn.norm": hf[h + "input_layernorm.weight"], "mlp.norm": hf[h + "post_attention_layernorm.weight"],
            "attn.proj.bias": hf[h + "self_attn.o_proj.bias"]}[rest]


@pytest.mark.parametrize("tp,pp,vpp", [(2, 2, 1), (4, 1, 1), (1, 2, 2)])
def test_load_llama_safetensors_straight_into_a_tp_pp_layout(tmp_path, tp, pp, vpp):
    hf = hf_model(seed=tp * 10 + pp)
    # Two files with an index, as Hugging Face shards a model.
    names = sorted(hf)
    half = len(names) // 2
    save_file({n: hf[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: hf[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    unread = []  # per simulated rank (each loads alone here): what the files hold that it did not read
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            layout = gt.ParallelLayout(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, vpp_size=vpp,
                                       num_layers=CFG.layers)
            chunks = [demo.Chunk(CFG, layout, c) for c in range(vpp)]
            # LoRA has no Hugging Face name: leave it out of the load.
            for c in chunks:
                for layer in c.layers:
                    del layer.attn.qkv_lora_A, layer.attn.qkv_lora_B
            figures = gt.load_hf(str(tmp_path), chunks, layout, demo.rules(CFG), mapping="llama", strict=pp == 1)
            assert figures["bytes_read"] > 0
            unread.append(set(figures["unread"]))
            for e in gt.model_entries(chunks, layout, demo.rules(CFG)):
                got = e.tensor.detach().numpy()
                assert np.array_equal(got, expected_for(e.key, hf, tp, tp_rank)), (e.key, tp_rank, pp_rank)
    assert set.intersection(*unread) == set()  # every tensor of the files read by some rank


def test_load_hf_names_every_missing_key_before_writing(tmp_path):
    hf = hf_model()
    del hf["model.layers.1.mlp.down_proj.weight"]
    save_file(hf, str(tmp_path / "model.safetensors"))
    layout = gt.ParallelLayout(num_layers=CFG.layers)
    chunk = demo.Chunk(CFG, layout, 0)
    for layer in chunk.layers:
        del layer.attn.qkv_lora_A, layer.attn.qkv_lora_B
    before = chunk.layers[0].attn.qkv.weight.detach().clone()
    with pytest.raises(gs.MismatchError, match=r"layers\.1\.mlp\.down\.weight"):
        gt.load_hf(str(tmp_path), chunk, layout, demo.rules(CFG), mapping="llama")
    assert torch.equal(chunk.layers[0].attn.qkv.weight.detach(), before)


def test_load_hf_into_a_model_on_the_meta_device_names_its_tensors(tmp_path):
    save_file(hf_model(), str(tmp_path / "model.safetensors"))
    layout = gt.ParallelLayout(num_layers=CFG.layers)
    with torch.device("meta"):
        chunk = demo.Chunk(CFG, layout, 0)
    for layer in chunk.layers:
        del layer.attn.qkv_lora_A, layer.attn.qkv_lora_B
    with pytest.raises(gs.LayoutError, match=r"(?s)cannot load into the model.*"
                                             r"layers\.0\.attn\.qkv\.weight: on the meta device"):
        gt.load_hf(str(tmp_path), chunk, layout, demo.rules(CFG), mapping="llama")


def test_export_then_load_hf_is_the_identity(tmp_path):
    # A checkpoint saved at TP=2 by the torch adapter, exported, loaded at TP=4.
    hf = hf_model(seed=5)
    save_global(as_checkpoint_keys(hf), tmp_path / "ckpt")
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load("llama"), dtype="float32")
    layout = gt.ParallelLayout(tp_rank=1, tp_size=4, num_layers=CFG.layers)
    chunk = demo.Chunk(CFG, layout, 0)
    for layer in chunk.layers:
        del layer.attn.qkv_lora_A, layer.attn.qkv_lora_B
    gt.load_hf(str(tmp_path / "hf"), chunk, layout, demo.rules(CFG), mapping="llama")
    for e in gt.model_entries(chunk, layout, demo.rules(CFG)):
        assert np.array_equal(e.tensor.detach().numpy(), expected_for(e.key, hf, 4, 1)), e.key


def _raw_safetensors(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize("case", ["overlap", "gap", "trailing", "truncated", "not_json"])
def test_safetensors_headers_are_checked_as_strictly_as_the_safetensors_package(tmp_path, case):
    from safetensors.numpy import load_file

    k = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    data = np.arange(8, dtype=np.float32).tobytes()
    header = {"k": k, "v": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}}
    if case == "overlap":  # v would read k's bytes
        header["v"]["data_offsets"], data = [0, 16], data[:16]
    elif case == "gap":
        header["v"]["data_offsets"], data = [20, 36], data + b"\0" * 4
    elif case == "trailing":
        data += b"\0" * 8
    elif case == "truncated":
        data = data[:30]
    path = tmp_path / "model.safetensors"
    _raw_safetensors(path, header, data)
    if case == "not_json":
        path.write_bytes((4).to_bytes(8, "little") + b"\xff{}x" + data)
    with pytest.raises(Exception):  # noqa: B017 - the package's own refusal, whatever its type
        load_file(str(path))
    with pytest.raises(gs.StorageError, match=re.escape(str(path))):
        SafetensorsSource(str(tmp_path))


# ----------------------------------------------------------------- adapters, rotary order, config.json


def test_an_adapter_is_merged_into_the_tensor_it_adapts_window_by_window(tmp_path, monkeypatch):
    import globalshard.hf.exporting as hfmod

    monkeypatch.setattr(hfmod, "WINDOW_BYTES", 700)  # windows of a few rows, each merged with its rows of B
    hf = hf_model(seed=3)
    keys = as_checkpoint_keys(hf)
    rng = np.random.default_rng(4)
    for i in range(CFG.layers):
        keys[f"layers.{i}.attn.qkv_lora_A"] = rng.standard_normal((CFG.lora_rank, CFG.hidden)).astype(np.float32)
        keys[f"layers.{i}.attn.qkv_lora_B"] = rng.standard_normal(
            ((CFG.heads + 2 * CFG.kv_heads) * HD, CFG.lora_rank)).astype(np.float32)
    save_global(keys, tmp_path / "ckpt")
    mapping = NameMapping.load("llama", {"lora_scale": 0.5})
    index = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)
    assert len(index["merged"]) == 2 * CFG.layers
    _, got = read_all(tmp_path / "hf")
    for i in range(CFG.layers):
        p = f"layers.{i}.attn."
        merged = keys[p + "qkv.weight"].astype(np.float64) + 0.5 * (
            keys[p + "qkv_lora_B"].astype(np.float64) @ keys[p + "qkv_lora_A"].astype(np.float64))
        q, kv = CFG.heads * HD, CFG.kv_heads * HD
        expected = np.split(merged.astype(np.float32), [q, q + kv])
        for x, want in zip("qkv", expected):
            assert np.array_equal(got[f"model.layers.{i}.self_attn.{x}_proj.weight"].numpy(), want), (i, x)


def test_an_adapter_no_rule_merges_is_refused_by_name(tmp_path):
    keys = as_checkpoint_keys(hf_model())
    keys["layers.0.mlp.down_lora_A"] = np.ones((2, CFG.ffn), np.float32)
    save_global(keys, tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"match no rule.*'layers\.0\.mlp\.down_lora_A'"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load("llama"))
    keys = as_checkpoint_keys(hf_model())
    del keys["layers.1.attn.qkv_lora_B"]
    save_global(keys, tmp_path / "half")
    with pytest.raises(ExportError, match=r"'layers\.1\.attn\.qkv\.weight': the checkpoint has only one"):
        export(str(tmp_path / "half"), str(tmp_path / "hf"), mapping=NameMapping.load("llama"))
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")


def test_an_adapter_scale_the_checkpoint_does_not_record_is_asked_for_once_an_adapter_is_there(tmp_path):
    # torchtitan's LoRA scales by alpha / rank and records neither: a mapping names the param with no default.
    doc = {"tensors": [{"key": "w", "name": "w.weight",
                        "lora": {"A": "w.lora_a", "B": "w.lora_b", "scale": "lora_scale"}}]}
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    a, b = np.ones((2, 3), np.float32), np.arange(8, dtype=np.float32).reshape(4, 2)
    save_global({"w": w}, tmp_path / "plain")
    assert export(str(tmp_path / "plain"), str(tmp_path / "hf"), mapping=NameMapping(doc))["merged"] == []
    save_global({"w": w, "w.lora_a": a, "w.lora_b": b}, tmp_path / "tuned")
    with pytest.raises(ExportError, match=r"params 'lora_scale' is not set: 'w' merges its adapter 'w\.lora_a', "
                                          r"'w\.lora_b' scaled by it, which the checkpoint does not record.*"
                                          r"--param lora_scale="):
        export(str(tmp_path / "tuned"), str(tmp_path / "hf"), mapping=NameMapping(doc))
    # Asked for once, however many tensors merge an adapter by it (a model's every layer, a fused wqkv's 3 parts).
    layers = {"tensors": [{"key": f"l{{i}}.w{p}", "name": f"layers.{{i}}.{p}.weight",
                           "lora": {"A": "l{i}.lora_a", "B": "l{i}.lora_b", "scale": "lora_scale"}} for p in "qkv"]}
    save_global({f"l{i}.{name}": v for i in range(3) for name, v in
                 [("wq", w), ("wk", w), ("wv", w), ("lora_a", a), ("lora_b", b)]}, tmp_path / "layers")
    with pytest.raises(ExportError) as refused:
        export(str(tmp_path / "layers"), str(tmp_path / "hf"), mapping=NameMapping(layers))
    assert str(refused.value).count("lora_scale' is not set") == 1
    assert "(9 tensors merge an adapter scaled by it)" in str(refused.value) and str(refused.value).count("\n  - ") == 1
    index = export(str(tmp_path / "tuned"), str(tmp_path / "hf"), mapping=NameMapping(doc, params={"lora_scale": 2}))
    assert index["merged"] == ["w.lora_a", "w.lora_b"]
    _, got = read_all(tmp_path / "hf")
    assert np.array_equal(got["w.weight"].numpy(), w + 2 * (b @ a))
    # Read back, the adapters are left as the model made them: the files hold the tensor they adapt.
    assert NameMapping(doc).is_adapter("w.lora_b") and not NameMapping(doc).is_adapter("w")


def meta_to_hf(w, heads):
    """torchtitan's Llama3StateDictAdapter._permute, written out: per head, pairs to halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


ROTARY = {"tensors": [{"key": "wq", "name": "q_proj.weight", "rotary": "heads"},
                      {"key": "bq", "name": "q_proj.bias", "rotary": "heads"},
                      {"key": "wqkv", "split": {"axis": 0, "parts": [
                          {"name": "q.weight", "size": 2, "rotary": 2},
                          {"name": "k.weight", "size": 1, "rotary": 1}]}},
                      # Grouped-query attention fused per group, as torchtitan's wqkv: q1 q2 k1 v1 | q3 q4 k2 v2.
                      {"key": "fused", "split": {"axis": 0, "groups": 2, "parts": [
                          {"name": "gq.weight", "size": "heads", "rotary": "heads"},
                          {"name": "gk.weight", "size": 2, "rotary": 2},
                          {"name": "gv.weight", "size": 2}]}}],
          "params": {"heads": 4}}


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rotary_rows_go_to_halves_on_export_and_back_on_any_read(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("rotary")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    hd = 2 * data.draw(st.integers(1, 4))
    cols = data.draw(st.integers(1, 5))
    values = {"wq": rng.standard_normal((4 * hd, cols)).astype(np.float32),
              "bq": rng.standard_normal(4 * hd).astype(np.float32),
              "wqkv": rng.standard_normal((3 * hd, cols)).astype(np.float32),
              "fused": rng.standard_normal((8 * hd, cols)).astype(np.float32)}
    save_global(values, path / "ckpt")
    mapping = NameMapping(ROTARY)
    monkey_window = data.draw(st.sampled_from([None, 8 * cols]))
    import globalshard.hf.exporting as hfmod

    old, hfmod.WINDOW_BYTES = hfmod.WINDOW_BYTES, monkey_window or hfmod.WINDOW_BYTES
    try:
        export(str(path / "ckpt"), str(path / "hf"), mapping=mapping)
    finally:
        hfmod.WINDOW_BYTES = old
    _, got = read_all(path / "hf")
    assert np.array_equal(got["q_proj.weight"].numpy(), meta_to_hf(values["wq"], 4))
    assert np.array_equal(got["q_proj.bias"].numpy(), meta_to_hf(values["bq"], 4))
    assert np.array_equal(got["q.weight"].numpy(), meta_to_hf(values["wqkv"][:2 * hd], 2))
    assert np.array_equal(got["k.weight"].numpy(), meta_to_hf(values["wqkv"][2 * hd:], 1))
    groups = values["fused"].reshape(2, 4, hd, cols)  # per group: 2 query heads, its key head, its value head
    assert np.array_equal(got["gq.weight"].numpy(), meta_to_hf(groups[:, :2].reshape(4 * hd, cols), 4))
    assert np.array_equal(got["gk.weight"].numpy(), meta_to_hf(groups[:, 2].reshape(2 * hd, cols), 2))
    assert np.array_equal(got["gv.weight"].numpy(), groups[:, 3].reshape(2 * hd, cols))
    source = SafetensorsSource(str(path / "hf"), mapping)
    for key, value in values.items():  # any box reads back in the checkpoint's own order
        lo = data.draw(st.integers(0, value.shape[0] - 1))
        hi = data.draw(st.integers(lo + 1, value.shape[0]))
        box = gs.Box((lo, *(0 for _ in value.shape[1:])), (hi - lo, *value.shape[1:]))
        out = np.empty(box.shape, np.float32)
        source.read(key, box, out)
        assert np.array_equal(out, value[box.slices]), (key, lo, hi)


def test_config_json_from_the_mapping_and_its_params(tmp_path):
    save_global(as_checkpoint_keys(hf_model()), tmp_path / "ckpt")
    index = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                   mapping=NameMapping.load("llama", {"rope_theta": 5e5}), dtype="bfloat16")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == index["config"]
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                   "tie_word_embeddings", "attention_bias", "torch_dtype")} == {
        "vocab_size": CFG.vocab, "hidden_size": CFG.hidden, "intermediate_size": CFG.ffn,
        "num_hidden_layers": CFG.layers, "num_attention_heads": CFG.heads, "num_key_value_heads": CFG.kv_heads,
        "head_dim": HD, "rope_theta": 5e5, "tie_word_embeddings": True, "attention_bias": True,
        "torch_dtype": "bfloat16"}
    # A param the config needs and nobody set is named, before anything is written.
    doc = json.loads((Path(gs.__file__).parent / "mappings" / "llama.json").read_text())
    del doc["params"]["rope_theta"]
    with pytest.raises(ExportError, match=r"config\.rope_theta needs params\.rope_theta.*--param rope_theta"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf2"), mapping=NameMapping(doc))
    assert not os.path.exists(tmp_path / "hf2")


@pytest.mark.parametrize("name", ["megatron_gpt", "torchtitan_llama3"])
def test_the_framework_mappings_need_the_head_counts_and_name_them(name):
    with pytest.raises(ExportError, match=r"'heads' is not in params.*--param heads="):
        NameMapping.load(name)
    assert NameMapping.load(name, {"heads": 8, "kv_heads": 2}).params["heads"] == 8


def test_config_shape_of_a_tensor_a_grouped_split_assembles_is_its_whole_shape(tmp_path):
    # q of 2 groups of 2 heads of 4 rows: q_proj has 16 rows, from two boxes of 8.
    save_global({"fused": np.zeros((24, 3), np.float32)}, tmp_path / "ckpt")
    parts = [{"name": "q", "size": 4}, {"name": "k", "size": 1}, {"name": "v", "size": 1}]
    mapping = NameMapping({"params": {"heads": 4},
                           "tensors": [{"key": "fused", "split": {"axis": 0, "groups": 2, "parts": parts}}],
        "config": {"q_rows": {"$shape": "q", "axis": 0}, "head_dim": {"$shape": "q", "axis": 0, "divide": "heads"}}})
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)
    _, got = read_all(tmp_path / "hf")
    assert tuple(got["q"].shape) == (16, 3)
    assert out["config"] == {"q_rows": 16, "head_dim": 4}


def attention_layer(w, p, hidden, heads, kv_heads, hd):
    """A Llama layer's norms and attention under Hugging Face's names (prefix ``p``), from ``w(*shape)``."""
    return {p + "input_layernorm.weight": w(hidden), p + "post_attention_layernorm.weight": w(hidden),
            p + "self_attn.q_proj.weight": w(heads * hd, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * hd)}


def as_megatron_dist_keys(hf, layers, heads, kv_heads):
    """A Llama under Megatron-Core's sharded state dict keys: each layer's tensors
    stacked under one key, Q, K and V interleaved per query group, [gate; up]."""
    def stacked(name):
        return np.stack([hf[f"model.layers.{i}.{name}"] for i in range(layers)])

    def qkv(i, part):
        q, k, v = (hf[f"model.layers.{i}.self_attn.{x}_proj.{part}"] for x in "qkv")
        per = heads // kv_heads
        q = q.reshape(kv_heads, per * len(q) // heads, *q.shape[1:])
        k, v = k.reshape(kv_heads, -1, *k.shape[1:]), v.reshape(kv_heads, -1, *v.shape[1:])
        return np.concatenate([q, k, v], axis=1).reshape(-1, *q.shape[2:])

    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stacked("input_layernorm.weight"),
           "decoder.layers.mlp.linear_fc1.layer_norm_weight": stacked("post_attention_layernorm.weight"),
           "decoder.layers.self_attention.linear_proj.weight": stacked("self_attn.o_proj.weight"),
           "decoder.layers.mlp.linear_fc2.weight": stacked("mlp.down_proj.weight"),
           "decoder.layers.self_attention.linear_qkv.weight": np.stack([qkv(i, "weight") for i in range(layers)]),
           "decoder.layers.mlp.linear_fc1.weight": np.stack([np.concatenate(
               [hf[f"model.layers.{i}.mlp.{x}_proj.weight"] for x in ("gate", "up")]) for i in range(layers)])}
    if "lm_head.weight" in hf:
        out["output_layer.weight"] = hf["lm_head.weight"]
    if "model.layers.0.self_attn.q_proj.bias" in hf:
        out["decoder.layers.self_attention.linear_qkv.bias"] = np.stack([qkv(i, "bias") for i in range(layers)])
    return out


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_megatron_dist_checkpoints_stacked_layers_export_as_hugging_face_layers(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("stacked")
    layers, kv_heads = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    heads, hd = kv_heads * data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    hidden, ffn, vocab = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden)}
    if data.draw(st.booleans()):
        hf["lm_head.weight"] = w(vocab, hidden)
    bias = data.draw(st.booleans())
    for i in range(layers):
        p = f"model.layers.{i}."
        hf |= attention_layer(w, p, hidden, heads, kv_heads, hd)
        hf |= {p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
               p + "mlp.down_proj.weight": w(hidden, ffn)}
        if bias:
            hf |= {p + "self_attn.q_proj.bias": w(heads * hd), p + "self_attn.k_proj.bias": w(kv_heads * hd),
                   p + "self_attn.v_proj.bias": w(kv_heads * hd)}
    save_global(as_megatron_dist_keys(hf, layers, heads, kv_heads), path / "ckpt",
                extra={"optimizer.state.exp_avg.decoder.final_layernorm.weight": w(hidden)})
    import globalshard.hf.exporting as hfmod

    old, hfmod.WINDOW_BYTES = hfmod.WINDOW_BYTES, data.draw(st.sampled_from([hfmod.WINDOW_BYTES, 4 * hidden]))
    try:  # windows of one row too: a window's box is below the stacked axis
        index = export(str(path / "ckpt"), str(path / "hf"),
                       mapping=NameMapping.load("megatron_dist_qwen2" if bias else "megatron_dist",
                                                {"heads": heads, "kv_heads": kv_heads}))
    finally:
        hfmod.WINDOW_BYTES = old
    _, got = read_all(path / "hf")
    assert got.keys() == hf.keys()
    for name, value in hf.items():
        assert np.array_equal(got[name].numpy(), value), name
    assert index["config"]["num_hidden_layers"] == layers and index["config"]["head_dim"] == hd
    assert index["config"]["tie_word_embeddings"] == ("lm_head.weight" not in hf)
    # q, k and v biases alone (Megatron's add_qkv_bias) are a Qwen2's; as a Llama they are refused, by name.
    assert index["config"]["architectures"] == (["Qwen2ForCausalLM"] if bias else ["LlamaForCausalLM"])
    if bias:
        with pytest.raises(ExportError, match=r"attention_bias.*q, k and v biases without an o_proj bias"):
            export(str(path / "ckpt"), str(path / "llama"),
                   mapping=NameMapping.load("megatron_dist", {"heads": heads, "kv_heads": kv_heads}))


@pytest.mark.parametrize("rule,match", [
    ({"key": "decoder.layers.{layer}.w", "stacked": ["layer"], "name": "x.{layer}"}, r"must be distinct fields"),
    ({"key": "decoder.layers.w", "stacked": "layer", "name": "x.{layer}"}, r"stacked: a list of field names"),
    ({"key": "decoder.layers.w", "stacked": ["layer"], "name": "x.{layer}",
      "lora": {"A": "a", "B": "b"}}, r"a stacked key merges no adapter"),
])
def test_a_stacked_rule_that_cannot_be_meant_is_refused_naming_it(rule, match):
    with pytest.raises(ExportError, match=r"tensors\[0\].*" + match):
        NameMapping({"tensors": [rule]})


def test_a_stacked_key_with_fewer_axes_than_its_fields_is_named(tmp_path):
    save_global({"decoder.layers.w": np.zeros(3, np.float32)}, tmp_path / "ckpt")
    mapping = NameMapping({"tensors": [{"key": "decoder.layers.w", "stacked": ["layer", "expert"],
                                        "name": "x.{layer}.{expert}"}]})
    with pytest.raises(ExportError, match=r"'decoder.layers.w': 1 axes, fewer than its stacked fields"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)


@settings(max_examples=25, deadline=None)
@given(kv=st.sampled_from([1, 2, 4]), per_group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([2, 4, 6]),
       rank=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_fused_adapter_merges_into_the_split_weights_it_adapts_as_into_the_fused_one(
        tmp_path_factory, kv, per_group, head_dim, rank, seed):
    # torchtitan's LoRA on its fused wqkv (q, k, v rows per kv group) keeps one adapter while its state dict
    # stores the weight as wq, wk, wv: each takes its rows of B (lora "rows"), and the export equals the
    # fused weight merged, then split per group.
    tmp = tmp_path_factory.mktemp("fused")
    heads, cols = kv * per_group, 5
    rng = np.random.default_rng(seed)
    fused = rng.standard_normal(((heads + 2 * kv) * head_dim, cols)).astype(np.float32)
    a = rng.standard_normal((rank, cols)).astype(np.float32)
    b = rng.standard_normal((fused.shape[0], rank)).astype(np.float32)
    groups = fused.reshape(kv, per_group + 2, head_dim, cols)
    split = {"q": groups[:, :per_group].reshape(-1, cols), "k": groups[:, per_group].reshape(-1, cols),
             "v": groups[:, per_group + 1].reshape(-1, cols)}
    save_global({f"w{x}": np.ascontiguousarray(w) for x, w in split.items()} | {"lora_a": a, "lora_b": b},
                tmp / "ckpt")
    rows = {"groups": "kv_heads", "sizes": ["heads", "kv_heads", "kv_heads"]}
    doc = {"params": {"heads": heads, "kv_heads": kv},
           "tensors": [{"key": f"w{x}", "name": f"{x}_proj.weight", "lora": {"A": "lora_a", "B": "lora_b",
                        "scale": 0.5, "rows": rows | {"part": i}}} for i, x in enumerate("qkv")]}
    assert export(str(tmp / "ckpt"), str(tmp / "hf"), mapping=NameMapping(doc))["merged"] == ["lora_a", "lora_b"]
    _, got = read_all(tmp / "hf")
    merged = (fused.astype(np.float64) + 0.5 * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)
    merged = merged.reshape(kv, per_group + 2, head_dim, cols)
    want = {"q": merged[:, :per_group].reshape(-1, cols), "k": merged[:, per_group].reshape(-1, cols),
            "v": merged[:, per_group + 1].reshape(-1, cols)}
    for x in "qkv":
        assert np.array_equal(got[f"{x}_proj.weight"].numpy(), want[x]), x


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_transposed_rule_exports_the_key_transposed_and_reads_any_box_back(tmp_path_factory, data):
    # As torchtitan's gpt_oss experts ([E, out, in]) are Hugging Face's GptOss experts ([E, in, out]): a rule's
    # "axes" transpose the key (numpy.transpose's order), stacked or not, in windows of any size.
    path = tmp_path_factory.mktemp("axes")
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    axes = data.draw(st.permutations(range(len(shape))))
    stacked = data.draw(st.booleans()) and len(shape) > 1
    value = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).standard_normal(shape).astype(np.float32)
    save_global({"w": value}, path / "ckpt")
    if stacked:  # the first axis numbers the layers; "axes" permute the rest (numbered from 0)
        rule = {"key": "w", "name": "x.{layer}", "stacked": ["layer"], "axes": [a - 1 for a in axes if a]}
    else:
        rule = {"key": "w", "name": "x", "axes": list(axes)}
    mapping = NameMapping({"tensors": [rule]})
    import globalshard.hf.exporting as hfmod

    old, hfmod.WINDOW_BYTES = hfmod.WINDOW_BYTES, data.draw(st.sampled_from([hfmod.WINDOW_BYTES, 4, 12]))
    try:
        export(str(path / "ckpt"), str(path / "hf"), mapping=mapping)
    finally:
        hfmod.WINDOW_BYTES = old
    _, got = read_all(path / "hf")
    if stacked:
        assert got.keys() == {f"x.{i}" for i in range(shape[0])}
        for i in range(shape[0]):
            assert np.array_equal(got[f"x.{i}"].numpy(), value[i].transpose(rule["axes"]))
    else:
        assert np.array_equal(got["x"].numpy(), value.transpose(axes))
    source = SafetensorsSource(str(path / "hf"), mapping)
    assert source.keys["w"][:2] == ("float32", shape)
    box = data.draw(box_within(shape))
    out = np.zeros(box.shape, np.float32)
    source.read("w", box, out)
    assert np.array_equal(out, value[box.slices])


@pytest.mark.parametrize("rule,match", [
    ({"key": "w", "name": "x", "axes": [0, 0]}, r"axes: a permutation of the axes"),
    ({"key": "w", "name": "x", "axes": [1, 2]}, r"axes: a permutation of the axes"),
    ({"key": "w", "name": "x", "axes": "1,0"}, r"axes: a permutation of the axes"),
    ({"key": "w", "name": "x", "axes": [1, 0], "rotary": 2}, r"axes: a transposed tensor has no 'rotary'"),
    ({"key": "w", "split": {"parts": [{"name": "a"}, {"name": "b"}]}, "axes": [1, 0]},
     r"axes: a split's parts are not transposed"),
])
def test_a_transposed_rule_that_cannot_be_meant_is_refused_naming_it(rule, match):
    with pytest.raises(ExportError, match=r"tensors\[0\]\." + match):
        NameMapping({"tensors": [rule]})


def test_axes_for_another_number_of_axes_are_named_both_ways(tmp_path):
    save_global({"w": np.zeros((2, 3), np.float32)}, tmp_path / "ckpt")
    three = NameMapping({"tensors": [{"key": "w", "name": "x", "axes": [2, 1, 0]}]})
    with pytest.raises(ExportError, match=r"'w': axes \[2, 1, 0\] for a tensor of 2 axes \[2, 3\]"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=three)
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping({"tensors": [
        {"key": "w", "name": "x", "axes": [1, 0]}]}))
    with pytest.raises(ExportError, match=r"'x': \[3, 2\] has 2 axes, the mapping transposes 'w' by axes \[2, 1, 0\]"):
        SafetensorsSource(str(tmp_path / "hf"), three)


def test_a_zero_d_tensor_of_the_files_loads_as_the_others_do(tmp_path):
    # A model with a 0-d parameter (CLIP's logit_scale, a learned temperature), its files written by the
    # safetensors package: load_hf fills it, as SafetensorsSource reads it, transposed by no axes or by [].
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(3, 2)
    model.logit_scale = torch.nn.Parameter(torch.tensor(0.0))
    files = {"proj.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "proj.bias": np.ones(2, np.float32),
             "logit_scale": np.array(2.6592, np.float32)}
    save_file(files, str(tmp_path / "model.safetensors"))
    gt.load_hf(str(tmp_path), model, gt.ParallelLayout(), gt.ShardingRules([(r".*", gt.Replicated())]))
    assert model.logit_scale.item() == np.float32(2.6592) and torch.equal(model.proj.bias, torch.ones(2))
    for mapping in (None, NameMapping({"tensors": [{"key": "logit_scale", "name": "logit_scale", "axes": []}],
                                       "skip": ["proj.*"]})):
        out = np.zeros((), np.float32)
        SafetensorsSource(str(tmp_path), mapping).read("logit_scale", gs.Box((), ()), out)
        assert out == np.float32(2.6592)


def test_load_hf_without_rules_takes_each_plain_tensor_whole_and_a_piece_fails_the_shape_check(tmp_path):
    # rules=None: DTensors place themselves, and any other tensor is whole on every rank, as DCP takes a plain
    # tensor (torchtitan's MoE keeps its expert_bias_E buffer a plain tensor once TP is 1). A plain tensor that
    # is in fact a piece (a TP shard without rules) has another shape than the files' tensor: named, not read.
    save_file({"proj.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "proj.bias": np.ones(2, np.float32)},
              str(tmp_path / "model.safetensors"))
    model = torch.nn.Linear(3, 2)
    model = torch.nn.ModuleDict({"proj": model})
    gt.load_hf(str(tmp_path), model, gt.ParallelLayout(), None)
    assert torch.equal(model.proj.weight, torch.arange(6.0).reshape(2, 3))
    piece = torch.nn.ModuleDict({"proj": torch.nn.Linear(3, 1)})
    with pytest.raises(gs.MismatchError, match=r"'proj.weight': global shape \(1, 3\) here, \(2, 3\) in"):
        gt.load_hf(str(tmp_path), piece, gt.ParallelLayout(), None)


def test_the_index_decides_which_file_holds_a_tensor_and_a_name_in_two_files_without_one_is_refused(tmp_path):
    # As transformers reads a sharded checkpoint: each name from the file its index names, even when another
    # listed file also holds that name (a stale tensor); an index naming a file that lacks the tensor is damage.
    # Without an index, two files holding one name are ambiguous.
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"x": np.ones(2, np.float32)}, str(tmp_path / first))
    save_file({"x": np.full(2, 7.0, np.float32), "y": np.zeros(2, np.float32)}, str(tmp_path / second))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"x": first, "y": second}}))
    out = np.zeros(2, np.float32)
    SafetensorsSource(str(tmp_path)).read("x", gs.Box((0,), (2,)), out)
    assert np.array_equal(out, np.ones(2, np.float32))
    assert sorted(SafetensorsSource(str(tmp_path)).entries) == ["x", "y"]
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"x": first, "y": first}}))
    with pytest.raises(gs.StorageError, match=rf"index.json names 'y' in {first}, which does not hold it"):
        SafetensorsSource(str(tmp_path))
    index.unlink()
    with pytest.raises(gs.StorageError, match=rf"'x' is in both {first} and {second}"):
        SafetensorsSource(str(tmp_path))
