"""Mapping files that extend others, config directives over names with
fields, and the shipped Qwen3 mappings (torchtitan's dense and MoE keys,
Megatron-Core's with qk_layernorm) against Hugging Face's Qwen3 names."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from test_hf import attention_layer, read_all, save_global

import globalshard as gs
from globalshard.hf import ExportError, NameMapping, SafetensorsSource, export
from globalshard.hf.files import param_names, read_mapping
from globalshard.testing.strategies import box_within


def write(path, doc):
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_mapping_that_extends_another_has_its_rules_first_and_its_config_over_the_bases(tmp_path):
    (tmp_path / "maps").mkdir()
    write(tmp_path / "maps" / "base.json", {
        "params": {"p": 1, "q": 2},
        "tensors": [{"key": "a", "name": "A"}, {"key": "b.{layer}", "name": "B.{layer}"}],
        "skip": ["s.*"],
        "config": {"x": 1, "y": 2, "gone": 3, "p": {"$param": "p"}, "q": {"$param": "q"}}})
    derived = write(tmp_path / "maps" / "derived.json", {
        "extends": "base.json", "params": {"p": 5},
        "tensors": [{"key": "a", "name": "A2"}, {"key": "c", "name": "C"}],
        "skip": ["t.*"],
        "config": {"y": 3, "gone": None, "z": {"$shape": "B.{layer}", "axis": 0}}})
    save_global({k: np.full((3,), i, np.float32) for i, k in enumerate(["a", "b.0", "b.1", "c", "s1", "t1"])},
                tmp_path / "ckpt")
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load(derived))
    _, got = read_all(tmp_path / "hf")
    assert sorted(got) == ["A2", "B.0", "B.1", "C"]  # the derived rule for "a" wins over the base's
    assert got["A2"].tolist() == [0, 0, 0] and got["C"].tolist() == [3, 3, 3]
    assert sorted(out["skipped"]) == ["s1", "t1"]  # both files' skip patterns
    assert out["config"] == {"x": 1, "y": 3, "p": 5, "q": 2, "z": 3}  # null leaves "gone" out
    # Read back, the first rule that gives a key reads it, as on export, even where files hold both names.
    (tmp_path / "both").mkdir()
    save_file({"A": np.ones(3, np.float32), "A2": np.full(3, 2, np.float32)}, str(tmp_path / "both" / "m.safetensors"))
    out = np.zeros(3, np.float32)
    SafetensorsSource(str(tmp_path / "both"), NameMapping.load(derived)).read("a", gs.Box.full((3,)), out)
    assert out.tolist() == [2, 2, 2]


def test_every_shipped_mapping_loads_and_a_name_that_is_none_lists_them():
    from globalshard.hf import shipped_mappings

    names = shipped_mappings()
    assert {"llama", "megatron_dist_qwen2", "megatron_dist_mixtral"} <= set(names) and len(names) == 16
    for name in names:
        reads = param_names(read_mapping(name, ())[0])
        mapping = NameMapping.load(name, {k: v for k, v in {"heads": 4, "kv_heads": 2, "top_k": 2}.items()
                                          if k in reads})
        assert mapping.rules and mapping.config is not None, name
    with pytest.raises(ExportError, match=r"no mapping 'llama3': .*\(llama, megatron_dist, .*torchtitan_qwen3_moe\)"):
        NameMapping.load("llama3")


def test_a_shipped_mapping_is_extended_by_name(tmp_path):
    path = write(tmp_path / "mine.json", {"extends": "megatron_dist", "skip": ["rng\\..*"]})
    mapping = NameMapping.load(path, {"heads": 4, "kv_heads": 2})
    shipped = NameMapping.load("megatron_dist", {"heads": 4, "kv_heads": 2})
    assert [r.key for r in mapping.rules] == [r.key for r in shipped.rules]
    assert mapping.config == shipped.config and [s.pattern for s in mapping.skip][-1] == "rng\\..*"


@pytest.mark.parametrize("docs,match", [
    ({"a.json": {"extends": "b.json"}, "b.json": {"extends": "a.json"}}, r"goes round in a circle"),
    ({"a.json": {"extends": 5}}, r"a\.json: extends: the name of a shipped mapping or a path, got 5"),
    ({"a.json": {"extends": "missing.json"}}, r"cannot read the mapping .*missing\.json"),
    ({"a.json": {"extends": "qwen9"}}, r"no mapping 'qwen9': no such file, nor a shipped mapping \(llama, "),
    ({"a.json": {"extends": "b.json"}, "b.json": {"tensors": {"key": "x"}}}, r"b\.json: tensors must be a JSON list"),
    ({"a.json": {"extends": "b.json", "config": [1]}, "b.json": {}}, r"a\.json: config must be a JSON object"),
])
def test_a_mapping_that_cannot_be_extended_is_named(tmp_path, docs, match):
    for name, doc in docs.items():
        write(tmp_path / name, doc)
    with pytest.raises(ExportError, match=match):
        NameMapping.load(str(tmp_path / "a.json"))


def export_config(tmp_path, config, names=("L.0.gate", "L.2.gate", "L.1.dense")):
    save_global({n: np.zeros((4 if "gate" in n else 6, 2), np.float32) for n in names}, tmp_path / "ckpt")
    mapping = NameMapping({"tensors": [{"key": "{name}", "name": "{name}"}], "config": config})
    return export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)["config"]


def test_config_directives_read_names_with_fields(tmp_path):
    config = export_config(tmp_path, {
        "moe": {"$present": "L.{layer}.gate", "then": {"$shape": "L.{layer}.gate", "axis": 0}, "else": 0},
        "shared": {"$present": "L.{layer}.shared", "then": 1, "else": {"$count": "L.{layer}.dense"}},
        "dense_layers": {"$indices": "L.{layer}.dense"}, "gated": {"$indices": "L.{layer}.gate"},
        "dtype": {"$dtype": "L.{layer}.gate"}, "any": {"$absent": "L.{layer}.shared"}})
    assert config == {"moe": 4, "shared": 1, "dense_layers": [1], "gated": [0, 2], "dtype": "float32", "any": True}


@pytest.mark.parametrize("config,match", [
    ({"x": {"$shape": "L.{layer}.{kind}", "axis": 0}},
     r"config\.x: the tensors named 'L\.\{layer\}\.\{kind\}' disagree"),
    ({"x": {"$present": "L.{layer}.gate", "then": 1}}, r"config\.x: \$present with 'then' needs 'else' too"),
    ({"x": {"$indices": "L.{layer}.{kind}"}}, r"config\.x: \$indices names tensors with one \{field\}"),
    ({"x": {"$shape": "L.{layer}.shared"}}, r"config\.x reads 'L\.\{layer\}\.shared', which the export does not write"),
])
def test_a_config_directive_that_cannot_be_read_is_named_before_anything_is_written(tmp_path, config, match):
    with pytest.raises(ExportError, match=match):
        export_config(tmp_path, config)
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------ Qwen3


def qwen3(draw, rng, all_moe=False):
    """A random Qwen3 under Hugging Face's names: dense, or MoE with some dense layers
    (``all_moe``: a MoE in every layer)."""
    layers, kv_heads = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    heads, hd = kv_heads * draw(st.integers(1, 2)), 2 * draw(st.integers(1, 2))
    hidden, ffn, vocab = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    experts = draw(st.sampled_from([1, 3] if all_moe else [0, 1, 3]))
    moe_layers = [i for i in range(layers) if all_moe or (experts and draw(st.booleans()))]

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden)}
    if draw(st.booleans()):
        hf["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        hf |= attention_layer(w, p, hidden, heads, kv_heads, hd)
        hf |= {p + "self_attn.q_norm.weight": w(hd), p + "self_attn.k_norm.weight": w(hd)}
        if i in moe_layers:
            hf[p + "mlp.gate.weight"] = w(experts, hidden)
            for e in range(experts):
                hf |= {p + f"mlp.experts.{e}.gate_proj.weight": w(ffn, hidden),
                       p + f"mlp.experts.{e}.up_proj.weight": w(ffn, hidden),
                       p + f"mlp.experts.{e}.down_proj.weight": w(hidden, ffn)}
        else:
            hf |= {p + "mlp.gate_proj.weight": w(ffn + 1, hidden), p + "mlp.up_proj.weight": w(ffn + 1, hidden),
                   p + "mlp.down_proj.weight": w(hidden, ffn + 1)}
    return hf, dict(layers=layers, heads=heads, kv_heads=kv_heads, hd=hd, ffn=ffn, experts=experts,
                    moe_layers=moe_layers)


def as_torchtitan_keys(hf, m, fused):
    """The model under torchtitan's qwen3 keys: its state dict's wq/wk/wv (or the fused
    wqkv parameter, interleaved per kv group), its experts stacked on a first axis."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["lm_head.weight"] = hf["lm_head.weight"]
    names = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "attention.wo.weight": "self_attn.o_proj.weight", "attention.q_norm.weight": "self_attn.q_norm.weight",
             "attention.k_norm.weight": "self_attn.k_norm.weight", "feed_forward.w1.weight": "mlp.gate_proj.weight",
             "feed_forward.w3.weight": "mlp.up_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
             "moe.router.gate.weight": "mlp.gate.weight"}
    for i in range(m["layers"]):
        h, t = f"model.layers.{i}.", f"layers.{i}."
        out |= {t + ours: hf[h + theirs] for ours, theirs in names.items() if h + theirs in hf}
        q, k, v = (hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv")
        if fused:
            g = m["kv_heads"]
            out[t + "attention.qkv_linear.wqkv.weight"] = np.concatenate(
                [q.reshape(g, -1, q.shape[1]), k.reshape(g, -1, k.shape[1]), v.reshape(g, -1, v.shape[1])],
                axis=1).reshape(-1, q.shape[1])
        else:
            out |= {t + "attention.qkv_linear.wq.weight": q, t + "attention.qkv_linear.wk.weight": k,
                    t + "attention.qkv_linear.wv.weight": v}
        if i in m["moe_layers"]:
            for ours, theirs in (("w1_EFD", "gate_proj"), ("w3_EFD", "up_proj"), ("w2_EDF", "down_proj")):
                out[t + f"moe.routed_experts.inner_experts.{ours}"] = np.stack(
                    [hf[h + f"mlp.experts.{e}.{theirs}.weight"] for e in range(m["experts"])])
    return out


def exported_exactly(path, keys, hf, m, name, extra=None):
    """``keys`` saved and exported with the shipped mapping ``name``: every tensor of ``hf``, exactly,
    and a config that describes ``m``; returns the export as a source to read back through the mapping."""
    save_global(keys, path / "ckpt", extra=extra)
    params = {"heads": m["heads"], "kv_heads": m["kv_heads"], **({"top_k": 1} if "moe" in name else {})}
    index = export(str(path / "ckpt"), str(path / "hf"), mapping=NameMapping.load(name, params))
    _, got = read_all(path / "hf")
    assert got.keys() == hf.keys()
    for n, value in hf.items():
        assert np.array_equal(got[n].numpy(), value), n
    config = index["config"]
    assert config["head_dim"] == m["hd"] and config["num_hidden_layers"] == m["layers"]
    assert config["tie_word_embeddings"] == ("lm_head.weight" not in hf)
    dense = [i for i in range(m["layers"]) if i not in m["moe_layers"]]
    if m["moe_layers"]:
        assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == m["experts"]
        assert config["mlp_only_layers"] == dense and config["moe_intermediate_size"] == m["ffn"]
        assert config["intermediate_size"] == (m["ffn"] + 1 if dense else m["ffn"])
    else:
        assert config["architectures"] == ["Qwen3ForCausalLM"] and config["intermediate_size"] == m["ffn"] + 1
    return SafetensorsSource(str(path / "hf"), NameMapping.load(name, params))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_torchtitan_qwen3_keys_export_to_each_qwen3_tensor_exactly_and_read_back_in_any_box(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("qwen3")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    hf, m = qwen3(data.draw, rng)
    fused = data.draw(st.booleans())
    keys = as_torchtitan_keys(hf, m, fused)
    source = exported_exactly(path, keys, hf, m, "torchtitan_qwen3_moe" if m["moe_layers"] else "torchtitan_qwen3",
                              extra={"optimizer.state.norm.weight.exp_avg": hf["model.norm.weight"]})
    # Back: every key, its experts stacked again, whole and in any box, equals what was saved.
    assert set(keys) <= set(source.keys)
    for k, value in keys.items():
        assert source.keys[k][1] == value.shape, k
        box = data.draw(box_within(value.shape))
        for b in (gs.Box.full(value.shape), box):
            out = np.empty(b.shape, np.float32)
            source.read(k, b, out)
            assert np.array_equal(out, value[b.slices]), (k, b)


def test_megatron_qwen3_mappings_add_the_query_and_key_norms_to_megatrons_llama(tmp_path):
    rng = np.random.default_rng(0)
    hd, heads, hidden = 4, 2, 3

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    norms = {"q": w(2, hd), "k": w(2, hd)}  # 2 layers, stacked as Megatron's sharded state dict keys them
    dist = {"embedding.word_embeddings.weight": w(5, hidden), "decoder.final_layernorm.weight": w(hidden),
            "decoder.layers.self_attention.linear_qkv.weight": w(2, (heads + 2) * hd, hidden),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": w(2, hidden),
            "decoder.layers.self_attention.linear_proj.weight": w(2, hidden, heads * hd),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": w(2, hidden),
            "decoder.layers.mlp.linear_fc1.weight": w(2, 6, hidden),
            "decoder.layers.mlp.linear_fc2.weight": w(2, hidden, 3),
            **{f"decoder.layers.self_attention.{x}_layernorm.weight": v for x, v in norms.items()}}
    per_layer = {k.replace("decoder.layers.", f"decoder.layers.{i}."): v[i] for k, v in dist.items()
                 if k.startswith("decoder.layers.") for i in range(2)}
    per_layer |= {k: v for k, v in dist.items() if not k.startswith("decoder.layers.")}
    for name, arrays in (("megatron_dist_qwen3", dist), ("megatron_gpt_qwen3", per_layer)):
        save_global(arrays, tmp_path / name)
        out = export(str(tmp_path / name), str(tmp_path / f"{name}_hf"),
                     mapping=NameMapping.load(name, {"heads": heads, "kv_heads": 1}))
        _, got = read_all(tmp_path / f"{name}_hf")
        for i in range(2):
            for x in "qk":
                assert np.array_equal(got[f"model.layers.{i}.self_attn.{x}_norm.weight"].numpy(), norms[x][i])
        assert out["config"]["architectures"] == ["Qwen3ForCausalLM"] and out["config"]["head_dim"] == hd
        assert "mlp_bias" not in out["config"] and out["config"]["num_hidden_layers"] == 2
    # The Llama mappings they extend refuse the norms rather than drop them.
    with pytest.raises(ExportError, match=r"q_layernorm"):
        export(str(tmp_path / "megatron_dist_qwen3"), str(tmp_path / "llama_hf"),
               mapping=NameMapping.load("megatron_dist", {"heads": heads, "kv_heads": 1}))


def test_the_documented_mapping_that_lets_a_moes_expert_bias_go_skips_it_and_only_it(tmp_path):
    docs = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    doc = json.loads(re.search(r"```json\n(\{\"extends\".*?)```", docs, re.S).group(1))
    mapping = NameMapping.load(write(tmp_path / "mine.json", doc), {"heads": 2, "kv_heads": 1, "top_k": 1})
    shipped = NameMapping.load("torchtitan_qwen3_moe", {"heads": 2, "kv_heads": 1, "top_k": 1})
    assert [s.pattern for s in mapping.skip][:-1] == [s.pattern for s in shipped.skip]
    for key in ("layers.0.moe.expert_bias_E", "layers.17.moe.expert_bias_E"):
        assert mapping.skip[-1].fullmatch(key) and not any(s.fullmatch(key) for s in shipped.skip)
    assert not mapping.skip[-1].fullmatch("layers.0.moe.router.gate.weight")


def test_a_stacked_key_read_back_needs_every_index_and_names_the_missing_ones(tmp_path):
    names = {f"model.layers.0.mlp.experts.{e}.gate_proj.weight": np.full((2, 3), e, np.float32) for e in (0, 1, 3)}
    save_file(names, str(tmp_path / "model.safetensors"))
    mapping = NameMapping({"tensors": [{"key": "layers.{layer}.w1", "stacked": ["expert"],
                                        "name": "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight"}]})
    out = np.empty((4, 2, 3), np.float32)
    with pytest.raises(gs.MismatchError, match=r"'layers\.0\.w1': not in .* lacks its \['expert'\] \[\(2,\)\] "
                                               r"\(it has 3 of 4\)"):
        SafetensorsSource(str(tmp_path), mapping).read("layers.0.w1", gs.Box.full((4, 2, 3)), out)
    names["model.layers.0.mlp.experts.2.gate_proj.weight"] = np.zeros((2, 4), np.float32)
    save_file(names, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(str(tmp_path), mapping)  # refused only when asked for
    assert "layers.0.w1" not in source.keys
    with pytest.raises(gs.MismatchError, match=r"'layers\.0\.w1': not in .*\(its \['expert'\] differ in dtype"):
        source.read("layers.0.w1", gs.Box.full((4, 2, 3)), out)


def test_load_hf_leaves_a_model_key_the_files_lack_as_it_is_when_the_mapping_skips_it(tmp_path):
    import torch

    import globalshard_torch as gt

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.full((3, 2, 4), -1.0))  # 3 experts, stacked
            self.register_buffer("expert_bias", torch.full((3,), 7.0))

    experts = {f"experts.{e}.gate_proj.weight": np.full((2, 4), e, np.float32) for e in range(3)}
    save_file(experts, str(tmp_path / "model.safetensors"))
    rule = {"key": "w1", "stacked": ["expert"], "name": "experts.{expert}.gate_proj.weight"}
    rules = gt.ShardingRules([(r".*", gt.Replicated())])
    model = Moe()
    with pytest.raises(gs.MismatchError, match=r"'expert_bias' \(expert_bias\): not in"):
        gt.load_hf(str(tmp_path), model, gt.ParallelLayout(), rules, mapping=NameMapping({"tensors": [rule]}))
    got = gt.load_hf(str(tmp_path), model, gt.ParallelLayout(), rules,
                     mapping=NameMapping({"tensors": [rule], "skip": ["expert_bias"]}))
    assert got["skipped"] == ["expert_bias"] and got["unread"] == []
    assert model.expert_bias.tolist() == [7.0] * 3  # left as it was
    assert [model.w1[e].unique().tolist() for e in range(3)] == [[0.0], [1.0], [2.0]]
    # An expert the files lack: named, with what the files hold, before anything is written.
    del experts["experts.1.gate_proj.weight"]
    save_file(experts, str(tmp_path / "model.safetensors"))
    with pytest.raises(gs.MismatchError, match=r"'w1' \(w1\): not in .*: .* lacks its \['expert'\] \[\(1,\)\]"):
        gt.load_hf(str(tmp_path), Moe(), gt.ParallelLayout(), rules,
                   mapping=NameMapping({"tensors": [rule], "skip": ["expert_bias"]}))


def as_megatron_keys(hf, m, stack):
    """A Qwen3 (MoE or not) under Megatron-Core's sharded state dict keys (local layer spec): Q, K
    and V interleaved per query group, linear_fc1 [gate; up], each MoE layer's experts stacked
    under one key; with ``stack``, each layer's tensors stacked under one key, else under one key
    per layer (as Megatron keys non-homogeneous layers)."""
    def qkv(p):
        q, k, v = (hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
        g = m["kv_heads"]
        return np.concatenate([x.reshape(g, -1, x.shape[1]) for x in (q, k, v)], axis=1).reshape(-1, q.shape[1])

    def fc1(p):
        return np.concatenate([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]])

    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["output_layer.weight"] = hf["lm_head.weight"]
    layers: dict[str, list[np.ndarray]] = {}
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        layer = {"input_layernorm.weight": hf[p + "input_layernorm.weight"],
                 "pre_mlp_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
                 "self_attention.linear_qkv.weight": qkv(p),
                 "self_attention.linear_proj.weight": hf[p + "self_attn.o_proj.weight"],
                 "self_attention.q_layernorm.weight": hf[p + "self_attn.q_norm.weight"],
                 "self_attention.k_layernorm.weight": hf[p + "self_attn.k_norm.weight"]}
        if i in m["moe_layers"]:
            experts = [f"{p}mlp.experts.{e}." for e in range(m["experts"])]
            layer |= {"mlp.router.weight": hf[p + "mlp.gate.weight"],
                      "mlp.experts.experts.linear_fc1.weight": np.stack([fc1(e) for e in experts]),
                      "mlp.experts.experts.linear_fc2.weight": np.stack([hf[e + "down_proj.weight"] for e in experts])}
        else:
            layer |= {"mlp.linear_fc1.weight": fc1(p + "mlp."), "mlp.linear_fc2.weight": hf[p + "mlp.down_proj.weight"]}
        for name, value in layer.items():
            if stack:
                layers.setdefault(name, []).append(value)
            else:
                out[f"decoder.layers.{i}.{name}"] = value
    return out | {f"decoder.layers.{name}": np.stack(values) for name, values in layers.items()}


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_megatron_dist_qwen3_exports_to_each_qwen3_tensor_exactly_and_reads_back(tmp_path_factory, data):
    # Dense, a MoE in every layer, or (non-homogeneous: Megatron keys each layer apart) a MoE with dense layers.
    path = tmp_path_factory.mktemp("megatron_qwen3")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    hf, m = qwen3(data.draw, rng, all_moe=data.draw(st.booleans()))
    homogeneous = len(m["moe_layers"]) in (0, m["layers"])
    keys = as_megatron_keys(hf, m, stack=homogeneous and data.draw(st.booleans()))
    name = "megatron_dist_qwen3_moe" if m["moe_layers"] else "megatron_dist_qwen3"
    source = exported_exactly(path, keys, hf, m, name)
    for k, value in keys.items():  # layers and experts stacked again
        out = np.empty(value.shape, np.float32)
        source.read(k, gs.Box.full(value.shape), out)
        assert np.array_equal(out, value), k


LAYER = {"model.embed_tokens.weight": (8, 4), "model.layers.0.input_layernorm.weight": (4,),
         "model.layers.0.self_attn.q_proj.weight": (8, 4), "model.layers.0.self_attn.q_norm.weight": (4,),
         "model.layers.0.mlp.gate_proj.weight": (6, 4)}
Q_BIAS, O_BIAS, MLP_BIAS = ({f"model.layers.0.{n}.bias": (8,)} for n in ("self_attn.q_proj", "self_attn.o_proj",
                                                                          "mlp.gate_proj"))


def config_of(mapping, names, **params):
    """The config.json ``mapping`` writes for Hugging Face tensors of these names and shapes."""
    from globalshard.hf.config import hf_config
    from globalshard.hf.naming import HfTensor

    pieces = [HfTensor(n, n, gs.Box.full(shape)) for n, shape in names.items()]
    return hf_config(NameMapping.load(mapping, {"heads": 2, "kv_heads": 1, **params}), pieces,
                     dict.fromkeys(names, "float32"))


def test_megatrons_pre_softmax_routing_is_qwen3_moes_top_k_not_normalised():
    moe = LAYER | {"model.layers.1.input_layernorm.weight": (4,), "model.layers.1.mlp.gate.weight": (3, 4),
                   "model.layers.1.mlp.experts.0.gate_proj.weight": (2, 4)}
    assert config_of("megatron_dist_qwen3_moe", moe, top_k=2)["norm_topk_prob"] is True  # Megatron's default
    assert config_of("megatron_dist_qwen3_moe", moe, top_k=2, pre_softmax=1)["norm_topk_prob"] is False


@pytest.mark.parametrize("mapping", ["megatron_dist", "megatron_gpt_qwen3"])
def test_megatrons_rotary_scaling_is_written_as_hugging_faces_when_given(mapping):
    assert config_of(mapping, LAYER)["rope_scaling"] is None  # Megatron's default: plain rotary
    # GPTModel(rope_scaling=True, rope_scaling_factor=8): Llama 3.1's, Megatron's fixed 1, 4 and 8192 beside it
    assert config_of(mapping, LAYER, rope_scaling_factor=8)["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    # seq_len_interpolation_factor divides the positions: Hugging Face's linear scaling
    assert config_of(mapping, LAYER, seq_len_interpolation_factor=2)["rope_scaling"] == {
        "rope_type": "linear", "factor": 2}
    with pytest.raises(ExportError, match=r"both rope_scaling and seq_len_interpolation_factor"):
        config_of(mapping, LAYER, rope_scaling_factor=8, seq_len_interpolation_factor=2)


@pytest.mark.parametrize("mapping,biases,architecture", [
    ("megatron_dist", {}, "LlamaForCausalLM"), ("megatron_dist", Q_BIAS | O_BIAS, "LlamaForCausalLM"),
    ("megatron_dist", Q_BIAS, r"q, k and v biases without an o_proj bias .*--map megatron_dist_qwen2"),
    ("megatron_gpt", O_BIAS, r"an o_proj bias without q, k and v biases"),
    ("llama", Q_BIAS, r"q, k and v biases without an o_proj bias"),
    ("megatron_dist_qwen2", Q_BIAS, "Qwen2ForCausalLM"), ("megatron_gpt_qwen2", Q_BIAS, "Qwen2ForCausalLM"),
    ("megatron_dist_qwen2", {}, r"no q, k and v biases .*export it as a Llama \(--map megatron_dist\)"),
    ("megatron_gpt_qwen2", Q_BIAS | O_BIAS, r"an o_proj bias .*Qwen2 has none"),
    ("megatron_dist_qwen2", Q_BIAS | MLP_BIAS, r"MLP biases .*Qwen2's MLP has none"),
    ("megatron_dist_qwen3", {}, "Qwen3ForCausalLM"), ("megatron_gpt_qwen3", MLP_BIAS, r"Qwen3's MLP has none"),
    ("megatron_dist_qwen3", Q_BIAS, r"q, k and v biases without an o_proj bias"),
])
def test_a_model_the_architecture_cannot_hold_is_refused_by_the_shipped_mapping_naming_why(mapping, biases,
                                                                                            architecture):
    if architecture.endswith("ForCausalLM"):
        config = config_of(mapping, LAYER | biases)
        assert config["architectures"] == [architecture]
        assert ("attention_bias" in config) == (not architecture.startswith("Qwen2"))  # Qwen2 has no such key
    else:
        with pytest.raises(ExportError, match=architecture):
            config_of(mapping, LAYER | biases)


def test_a_param_chooses_a_branch_and_a_size_divides_by_another_tensors(tmp_path):
    save_global({"shared": np.zeros((12, 2), np.float32), "expert": np.zeros((4, 2), np.float32)}, tmp_path / "ckpt")
    config = {"on": {"$param": "p", "then": "yes", "else": {"$error": "p is 0"}},
              "n": {"$shape": "shared", "axis": 0, "divide": {"$shape": "expert", "axis": 0}}}
    doc = {"tensors": [{"key": "{name}", "name": "{name}"}], "config": config}
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping(doc, params={"p": 2}))
    assert out["config"] == {"on": "yes", "n": 3}
    with pytest.raises(ExportError, match=r"config\.on\.else: p is 0"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf0"), mapping=NameMapping(doc, params={"p": 0}))


def test_a_param_no_rule_or_config_reads_is_refused_naming_those_it_reads():
    # A misspelt optional param would otherwise leave the default in place: a silently other model.
    with pytest.raises(ExportError, match=r"no rule or config of this mapping reads params \['routed_scaling'\]; "
                                          r"it reads \[.*'routed_scaling_factor'"):
        NameMapping.load("megatron_dist_deepseek_v3", {**DS_PARAMS, "routed_scaling": 2.5})
    with pytest.raises(ExportError, match=r"reads params \['kv_heads'\]"):  # a Llama's, not DeepSeek's
        NameMapping.load("torchtitan_deepseek_v3", {"heads": 2, "kv_heads": 2})
    # Those a base mapping reads count (extends), as do sizes, groups and rotary heads of rules.
    assert NameMapping.load("megatron_dist_qwen3", {"heads": 4, "kv_heads": 2, "rope_theta": 1e6}).params["heads"] == 4


def test_renumber_reads_a_prefix_as_another_after_an_offset_both_ways(tmp_path):
    doc = {"tensors": [{"key": "L.{layer}.w", "name": "model.layers.{layer}.w"}],
           "renumber": [{"key": "M.{n}.", "as": "L.{layer}.", "offset": "layers"}]}
    keys = {"L.0.w": np.full((2,), 0, np.float32), "L.1.w": np.full((2,), 1, np.float32),
            "M.0.w": np.full((2,), 2, np.float32)}
    save_global(keys, tmp_path / "ckpt")
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping(doc, params={"layers": 2}))
    _, got = read_all(tmp_path / "hf")
    assert {n: t.numpy().tolist() for n, t in got.items()} == {
        "model.layers.0.w": [0, 0], "model.layers.1.w": [1, 1], "model.layers.2.w": [2, 2]}
    source = SafetensorsSource(str(tmp_path / "hf"), NameMapping(doc, params={"layers": 2}))
    out = np.empty(2, np.float32)
    source.read("M.0.w", gs.Box.full((2,)), out)
    assert out.tolist() == [2, 2]
    with pytest.raises(ExportError, match=r"'M\.0\.w': renumber 'M\.\{n\}\.'.*'layers' is not in params"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf2"), mapping=NameMapping(doc))
    with pytest.raises(ExportError, match=r"renumber\[0\]: needs 'key' and 'as'.*and 'offset'"):
        NameMapping({**doc, "renumber": [{"key": "M.{n}.", "as": "L.{layer}."}]})


def test_equal_compares_two_values_range_counts_up_to_one_and_cycle_repeats(tmp_path):
    # Dense layers first (first_k_dense_replace) is: their indices are range(their count).
    first = {"$equal": [{"$indices": "L.{layer}.dense"}, {"$range": {"$count": "L.{layer}.dense"}}],
             "then": {"$count": "L.{layer}.dense"}, "else": {"$error": "dense layers not first"}}
    config = {"per_group": {"$param": "top_k", "divide": "groups"},
              "pair": {"$equal": [{"$param": "top_k", "divide": "groups"}, 2], "then": "two", "else": "other"},
              "gated": {"$equal": [{"$indices": "L.{layer}.gate"}, [0, 2]]}, "r": {"$range": 3},
              "kinds": {"$cycle": ["a", {"$param": "groups"}], "count": {"$count": "L.{layer}.dense"}}}
    save_global({n: np.zeros((2, 2), np.float32) for n in ("L.0.dense", "L.1.dense", "L.2.gate")}, tmp_path / "a")
    doc = {"tensors": [{"key": "{name}", "name": "{name}"}], "config": {**config, "first": first}}
    out = export(str(tmp_path / "a"), str(tmp_path / "ha"), mapping=NameMapping(doc, params={"top_k": 8, "groups": 4}))
    assert out["config"] == {"per_group": 2, "pair": "two", "gated": False, "r": [0, 1, 2], "first": 2,
                             "kinds": ["a", 4]}
    out = export(str(tmp_path / "a"), str(tmp_path / "hb"), mapping=NameMapping(doc, params={"top_k": 6, "groups": 1}))
    assert out["config"]["pair"] == "other" and out["config"]["per_group"] == 6
    with pytest.raises(ExportError, match=r"config\.per_group: params\.top_k 6 does not divide by 4"):
        export(str(tmp_path / "a"), str(tmp_path / "hc"), mapping=NameMapping(doc, params={"top_k": 6, "groups": 4}))
    save_global({n: np.zeros((2, 2), np.float32) for n in ("L.0.gate", "L.1.dense")}, tmp_path / "b")
    with pytest.raises(ExportError, match=r"config\.first\.else: dense layers not first"):
        export(str(tmp_path / "b"), str(tmp_path / "hd"), mapping=NameMapping(doc, params={"top_k": 8, "groups": 4}))
    for bad, match in (({"$equal": [1]}, r"config\.x: \$equal compares a list of two values, got \[1\]"),
                       ({"$range": -1}, r"config\.x: \$range counts up to a whole number, got -1"),
                       ({"$cycle": ["a"]}, r"config\.x: \$cycle needs a whole number as its count, got None"),
                       ({"$cycle": [], "count": 2}, r"config\.x: \$cycle repeats a list of values, got \[\]")):
        with pytest.raises(ExportError, match=match):
            export(str(tmp_path / "a"), str(tmp_path / "he"), mapping=NameMapping(
                {"tensors": [{"key": "{name}", "name": "{name}"}], "config": {"x": bad}}))


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_torchtitan_deepseek_v3_keys_export_to_each_hugging_face_tensor_and_read_back(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("deepseek")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    layers, dense = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 1))
    heads, nope, rope, v, kv_rank = 2, 3, 2, 4, 5
    q_rank, experts, shared, ffn, hidden = data.draw(st.sampled_from([0, 3])), 3, data.draw(st.integers(1, 2)), 2, 4
    mtp = data.draw(st.integers(0, 1))  # multi-token prediction layers, after the others
    keys = {"tok_embeddings.weight": w(7, hidden), "norm.weight": w(hidden), "lm_head.weight": w(7, hidden)}
    for i in range(layers + mtp):
        t = f"layers.{i}." if i < layers else f"mtp_layers.{i - layers}."
        if i >= layers:
            keys |= {t + "enorm.weight": w(hidden), t + "hnorm.weight": w(hidden),
                     t + "eh_proj.weight": w(hidden, 2 * hidden), t + "mtp_norm.weight": w(hidden)}
        keys |= {t + "attention_norm.weight": w(hidden), t + "ffn_norm.weight": w(hidden),
                 t + "attention.wkv_a.weight": w(kv_rank + rope, hidden), t + "attention.kv_norm.weight": w(kv_rank),
                 t + "attention.wkv_b.weight": w(heads * (nope + v), kv_rank),
                 t + "attention.wo.weight": w(hidden, heads * v)}
        keys |= ({t + "attention.wq_a.weight": w(q_rank, hidden), t + "attention.q_norm.weight": w(q_rank),
                  t + "attention.wq_b.weight": w(heads * (nope + rope), q_rank)} if q_rank
                 else {t + "attention.wq.weight": w(heads * (nope + rope), hidden)})
        if i < dense:
            keys |= {t + "feed_forward.w1.weight": w(5, hidden), t + "feed_forward.w3.weight": w(5, hidden),
                     t + "feed_forward.w2.weight": w(hidden, 5)}
        else:
            m = t + "moe."
            keys |= {m + "router.gate.weight": w(experts, hidden), m + "expert_bias_E": w(experts),
                     m + "routed_experts.inner_experts.w1_EFD": w(experts, ffn, hidden),
                     m + "routed_experts.inner_experts.w3_EFD": w(experts, ffn, hidden),
                     m + "routed_experts.inner_experts.w2_EDF": w(experts, hidden, ffn),
                     m + "shared_experts.w1.weight": w(shared * ffn, hidden),
                     m + "shared_experts.w3.weight": w(shared * ffn, hidden),
                     m + "shared_experts.w2.weight": w(hidden, shared * ffn)}
    save_global(keys, path / "ckpt")
    yarn = data.draw(st.sampled_from([0, 1]))
    params = {"heads": heads, "top_k": 2, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "sigmoid_routing": 1,
              "yarn": yarn, "mscale": 0.7, **({"layers": layers} if mtp else {})}
    mapping = NameMapping.load("torchtitan_deepseek_v3", params)
    if dense == layers and not mtp:  # no MoE layer: nothing gives the experts' sizes the config needs
        with pytest.raises(ExportError, match=r"moe_intermediate_size reads"):
            export(str(path / "ckpt"), str(path / "hf"), mapping=mapping)
        return
    index = export(str(path / "ckpt"), str(path / "hf"), mapping=mapping)
    _, got = read_all(path / "hf")
    expected = sum(1 for k in keys if "inner_experts" not in k) + 3 * experts * (layers + mtp - dense)
    assert len(got) == expected
    if mtp:  # as Hugging Face (and torchtitan's adapter) number them: after the layers
        assert np.array_equal(got[f"model.layers.{layers}.eh_proj.weight"].numpy(), keys["mtp_layers.0.eh_proj.weight"])
        assert np.array_equal(got[f"model.layers.{layers}.shared_head.norm.weight"].numpy(),
                              keys["mtp_layers.0.mtp_norm.weight"])
    n = layers + mtp - 1  # the last layer (a MoE), in Hugging Face's numbers
    last = f"layers.{n}.moe." if n < layers else "mtp_layers.0.moe."
    for e in range(experts):  # each expert of the stacked tensors under its own name
        name = f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"
        assert np.array_equal(got[name].numpy(), keys[last + "routed_experts.inner_experts.w2_EDF"][e])
    assert np.array_equal(got[f"model.layers.{n}.mlp.gate.e_score_correction_bias"].numpy(),
                          keys[last + "expert_bias_E"])
    config = index["config"]
    assert config["first_k_dense_replace"] == dense and config["n_shared_experts"] == shared
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (layers, mtp)
    assert config["q_lora_rank"] == (q_rank or None) and config["kv_lora_rank"] == kv_rank
    assert config["v_head_dim"] == v and config["n_routed_experts"] == experts and config["scoring_func"] == "sigmoid"
    # torchtitan's YaRN as Hugging Face's: its rotary untouched in magnitude (mscale = mscale_all_dim), its
    # softmax scaled by the attention's mscale
    assert config["rope_scaling"] == ({"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 0.7}
                                      if yarn else None)
    source = SafetensorsSource(str(path / "hf"), mapping)
    for k, value in keys.items():
        out = np.empty(value.shape, np.float32)
        source.read(k, gs.Box.full(value.shape), out)
        assert np.array_equal(out, value), k


# ------------------------------------------------------------------ DeepSeek-V3 from Megatron-Core

DS_PARAMS = {"heads": 2, "top_k": 2, "qk_nope_head_dim": 3, "qk_rope_head_dim": 2, "sigmoid_routing": 1, "yarn": 0}


def megatron_deepseek(rng, layers, dense, stacked=False, q_rank=0, shared=1, te=False, mtp=0):
    """A random Megatron-Core MLA + DeepSeek MoE as Hugging Face's DeepSeek-V3 tensors (``hf``) and as
    Megatron's sharded keys (``keys``): stacked over layers, or one key per layer; a query LoRA of
    rank ``q_rank`` (0: none); the latent norms under the local spec's names or (``te``) Transformer
    Engine's; ``mtp`` multi-token prediction layers (Megatron 0.16's ``mtp.layers.<n>.transformer_layer.``)
    after the layers, numbered after them in Hugging Face's names."""
    heads, nope, rope, v, kv_rank, hidden, ffn, experts = 2, 3, 2, 4, 5, 4, 2, 3

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": w(7, hidden), "model.norm.weight": w(hidden), "lm_head.weight": w(7, hidden)}
    keys = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
            "decoder.final_layernorm.weight": hf["model.norm.weight"], "output_layer.weight": hf["lm_head.weight"]}
    per_layer: dict[str, list[np.ndarray]] = {}
    for i in range(layers + mtp):
        h, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t: dict[str, np.ndarray] = {}
        hf[h + "input_layernorm.weight"] = t["input_layernorm.weight"] = w(hidden)
        hf[a + "kv_a_proj_with_mqa.weight"] = t["self_attention.linear_kv_down_proj.weight"] = w(kv_rank + rope, hidden)
        hf[a + "kv_a_layernorm.weight"] = t["self_attention.linear_kv_up_proj.layer_norm_weight" if te
                                            else "self_attention.kv_layernorm.weight"] = w(kv_rank)
        hf[a + "kv_b_proj.weight"] = t["self_attention.linear_kv_up_proj.weight"] = w(heads * (nope + v), kv_rank)
        hf[a + "o_proj.weight"] = t["self_attention.linear_proj.weight"] = w(hidden, heads * v)
        if q_rank:
            hf[a + "q_a_proj.weight"] = t["self_attention.linear_q_down_proj.weight"] = w(q_rank, hidden)
            hf[a + "q_a_layernorm.weight"] = t["self_attention.linear_q_up_proj.layer_norm_weight" if te
                                               else "self_attention.q_layernorm.weight"] = w(q_rank)
            hf[a + "q_b_proj.weight"] = t["self_attention.linear_q_up_proj.weight"] = w(heads * (nope + rope), q_rank)
        else:
            hf[a + "q_proj.weight"] = t["self_attention.linear_q_proj.weight"] = w(heads * (nope + rope), hidden)
        hf[h + "post_attention_layernorm.weight"] = t["mlp.linear_fc1.layer_norm_weight" if te and i < dense
                                                      else "pre_mlp_layernorm.weight"] = w(hidden)
        m = h + "mlp."
        if i < dense:
            hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"] = w(5, hidden), w(5, hidden)
            t["mlp.linear_fc1.weight"] = np.concatenate([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
            hf[m + "down_proj.weight"] = t["mlp.linear_fc2.weight"] = w(hidden, 5)
        else:
            hf[m + "gate.weight"] = t["mlp.router.weight"] = w(experts, hidden)
            hf[m + "gate.e_score_correction_bias"] = t["mlp.router.expert_bias"] = w(experts)
            for e in range(experts):
                x = f"{m}experts.{e}."
                hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"] = w(ffn, hidden), w(ffn, hidden)
                hf[x + "down_proj.weight"] = w(hidden, ffn)
            t["mlp.experts.experts.linear_fc1.weight"] = np.stack([np.concatenate(
                [hf[f"{m}experts.{e}.gate_proj.weight"], hf[f"{m}experts.{e}.up_proj.weight"]])
                for e in range(experts)])
            t["mlp.experts.experts.linear_fc2.weight"] = np.stack(
                [hf[f"{m}experts.{e}.down_proj.weight"] for e in range(experts)])
            s = m + "shared_experts."
            hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"] = w(shared * ffn, hidden), w(shared * ffn, hidden)
            t["mlp.shared_experts.linear_fc1.weight"] = np.concatenate([hf[s + "gate_proj.weight"],
                                                                        hf[s + "up_proj.weight"]])
            hf[s + "down_proj.weight"] = t["mlp.shared_experts.linear_fc2.weight"] = w(hidden, shared * ffn)
        for k, x in t.items():
            if i >= layers:
                keys[f"mtp.layers.{i - layers}.transformer_layer.{k}"] = x
            elif stacked:
                per_layer.setdefault(f"decoder.layers.{k}", []).append(x)
            else:
                keys[f"decoder.layers.{i}.{k}"] = x
        if i >= layers:
            for k, n, shape in (("enorm", "enorm", (hidden,)), ("hnorm", "hnorm", (hidden,)),
                                ("eh_proj", "eh_proj", (hidden, 2 * hidden)),
                                ("final_layernorm", "shared_head.norm", (hidden,))):
                hf[f"model.layers.{i}.{n}.weight"] = keys[f"mtp.layers.{i - layers}.{k}.weight"] = w(*shape)
    keys |= {k: np.stack(xs) for k, xs in per_layer.items()}
    return hf, keys, {"q_lora_rank": q_rank or None, "kv_lora_rank": kv_rank, "v_head_dim": v,
                      "n_shared_experts": shared, "n_routed_experts": experts, "first_k_dense_replace": dense}


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_megatron_deepseek_v3_keys_export_to_each_hugging_face_tensor_and_read_back(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("megatron_deepseek")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    layers = data.draw(st.integers(1, 3))
    dense = data.draw(st.integers(0, layers - 1))
    stacked = dense == 0 and data.draw(st.booleans())  # Megatron stacks only layers that are all alike
    mtp = data.draw(st.integers(0, 1))
    hf, keys, expected = megatron_deepseek(rng, layers, dense, stacked, q_rank=data.draw(st.sampled_from([0, 3])),
                                           shared=data.draw(st.integers(1, 2)), te=data.draw(st.booleans()), mtp=mtp)
    save_global(keys, path / "ckpt")
    mapping = NameMapping.load("megatron_dist_deepseek_v3", {**DS_PARAMS, **({"layers": layers} if mtp else {})})
    index = export(str(path / "ckpt"), str(path / "hf"), mapping=mapping)
    _, got = read_all(path / "hf")
    assert sorted(got) == sorted(hf)
    for name, value in hf.items():
        assert np.array_equal(got[name].numpy(), value), name
    config = index["config"]
    assert {k: config[k] for k in expected} == expected
    assert config["num_hidden_layers"] == layers and config["norm_topk_prob"] is True
    assert config["num_nextn_predict_layers"] == mtp
    assert config["scoring_func"] == "sigmoid" and config["rope_scaling"] is None
    source = SafetensorsSource(str(path / "hf"), mapping)
    for k, value in keys.items():
        assert source.keys[k][1] == value.shape, k  # a stacked decoder key stops before MTP's layers
        out = np.empty(value.shape, np.float32)
        source.read(k, gs.Box.full(value.shape), out)
        assert np.array_equal(out, value), k


@pytest.mark.parametrize("params,drop,match", [
    ({"sigmoid_routing": 0}, "", r"config\.scoring_func\.else: .*softmax"),
    ({"n_group": 4, "topk_group": 2, "top_k": 6}, "", r"config\.topk_group\.else\.else: .*best 2"),
    ({"n_group": 4, "topk_group": 4, "top_k": 6}, "", r"params\.top_k 6 does not divide by 4"),
    ({"yarn": 0, "mscale_all_dim": 1}, "", r"config\.rope_scaling\.else\.then: mscale_all_dim without YaRN"),
    ({"yarn": 1, "mscale": 0.7}, "", r"config\.rope_scaling\.then\.mscale\.else\.else: mscale other than 1"),
    ({}, "kv_layernorm", r"config\.kv_lora_rank\.else: .*latent norms"),
    ({}, "q_layernorm", r"config\.q_lora_rank\.then\.else: a query LoRA without its norm"),
    ({}, "shared_experts", r"config\.n_shared_experts\.else: MoE layers without shared experts"),
])
def test_a_megatron_deepseek_that_hugging_face_would_run_otherwise_is_refused(tmp_path, params, drop, match):
    _, keys, _ = megatron_deepseek(np.random.default_rng(0), layers=2, dense=1, q_rank=3)
    save_global({k: v for k, v in keys.items() if not drop or drop not in k}, tmp_path / "ckpt")
    mapping = NameMapping.load("megatron_dist_deepseek_v3", {**DS_PARAMS, **params})
    with pytest.raises(ExportError, match=match):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)
    assert not (tmp_path / "hf").exists()


def test_a_megatron_deepseek_with_a_dense_layer_after_a_moe_layer_is_refused(tmp_path):
    _, keys, _ = megatron_deepseek(np.random.default_rng(0), layers=2, dense=1)
    moved = {re.sub(r"decoder\.layers\.(\d)\.", lambda m: f"decoder.layers.{1 - int(m.group(1))}.", k): v
             for k, v in keys.items()}  # layer 1 dense, layer 0 MoE (Megatron's moe_layer_freq [1, 0])
    save_global(moved, tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"config\.first_k_dense_replace\.else: dense layers after MoE layers"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load("megatron_dist_deepseek_v3",
                                                                                      DS_PARAMS))


def test_a_megatron_deepseek_trained_with_yarn_exports_its_rope_scaling_and_groups(tmp_path):
    _, keys, _ = megatron_deepseek(np.random.default_rng(0), layers=1, dense=0)
    save_global(keys, tmp_path / "ckpt")
    params = {**DS_PARAMS, "yarn": 1, "mscale_all_dim": 1, "top_k": 8, "n_group": 8, "topk_group": 4,
              "routed_scaling_factor": 2.5}
    config = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                    mapping=NameMapping.load("megatron_dist_deepseek_v3", params))["config"]
    assert config["rope_scaling"] == {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1}
    assert (config["n_group"], config["topk_group"], config["num_experts_per_tok"]) == (8, 4, 8)
    assert config["routed_scaling_factor"] == 2.5 and config["norm_topk_prob"] is True


# ------------------------------------------------------------------ Qwen2-MoE from Megatron-Core


def megatron_qwen2_moe_layer(rng, gate=True):
    """One MoE layer of a Megatron GPTModel with q, k, v biases, 3 experts and a shared expert (with
    its sigmoid gate unless ``gate`` is false), under its per-layer sharded keys."""
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    p = "decoder.layers.0."
    keys = {"embedding.word_embeddings.weight": w(7, 4), "decoder.final_layernorm.weight": w(4),
            "output_layer.weight": w(7, 4), p + "input_layernorm.weight": w(4),
            p + "self_attention.linear_qkv.weight": w(12, 4), p + "self_attention.linear_qkv.bias": w(12),
            p + "self_attention.linear_proj.weight": w(4, 4), p + "pre_mlp_layernorm.weight": w(4),
            p + "mlp.router.weight": w(3, 4), p + "mlp.experts.experts.linear_fc1.weight": w(3, 4, 4),
            p + "mlp.experts.experts.linear_fc2.weight": w(3, 4, 2),
            p + "mlp.shared_experts.linear_fc1.weight": w(10, 4), p + "mlp.shared_experts.linear_fc2.weight": w(4, 5)}
    return keys | ({p + "mlp.shared_experts.gate_weight": w(1, 4)} if gate else {})


def test_a_megatron_qwen2_moe_exports_its_shared_expert_and_gate_and_reads_back(tmp_path):
    keys = megatron_qwen2_moe_layer(np.random.default_rng(1))
    save_global(keys, tmp_path / "ckpt")
    mapping = NameMapping.load("megatron_dist_qwen2_moe", {"heads": 2, "kv_heads": 1, "top_k": 2, "pre_softmax": 1})
    config = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)["config"]
    _, got = read_all(tmp_path / "hf")
    fc1 = keys["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    assert np.array_equal(got["model.layers.0.mlp.shared_expert.gate_proj.weight"].numpy(), fc1[:5])
    assert np.array_equal(got["model.layers.0.mlp.shared_expert.up_proj.weight"].numpy(), fc1[5:])
    assert np.array_equal(got["model.layers.0.mlp.shared_expert_gate.weight"].numpy(),
                          keys["decoder.layers.0.mlp.shared_experts.gate_weight"])
    assert np.array_equal(got["model.layers.0.mlp.experts.2.down_proj.weight"].numpy(),
                          keys["decoder.layers.0.mlp.experts.experts.linear_fc2.weight"][2])
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and config["model_type"] == "qwen2_moe"
    assert (config["num_experts"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"],
            config["norm_topk_prob"], config["mlp_only_layers"]) == (3, 2, 5, False, [])
    source = SafetensorsSource(str(tmp_path / "hf"), mapping)
    for k, value in keys.items():
        out = np.empty(value.shape, np.float32)
        source.read(k, gs.Box.full(value.shape), out)
        assert np.array_equal(out, value), k


def test_a_megatron_shared_expert_without_its_gate_is_refused_as_a_qwen2_moe(tmp_path):
    save_global(megatron_qwen2_moe_layer(np.random.default_rng(1), gate=False), tmp_path / "ckpt")
    with pytest.raises(ExportError, match=r"a shared expert without its gate \(Megatron's moe_shared_expert_gate\)"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=NameMapping.load(
            "megatron_dist_qwen2_moe", {"heads": 2, "kv_heads": 1, "top_k": 2}))


# ------------------------------------------------------------------ Mixtral from Megatron-Core


MIXTRAL_NAMES = (("mlp.gate.", "block_sparse_moe.gate."), ("gate_proj.", "w1."), ("up_proj.", "w3."),
                 ("down_proj.", "w2."), ("mlp.experts.", "block_sparse_moe.experts."))


def as_mixtral(hf):
    """A Qwen3 MoE with a MoE in every layer, without its query and key norms, under the Hub's Mixtral
    names (``block_sparse_moe``, the experts' ``w1`` gate, ``w3`` up and ``w2`` down)."""
    out = {}
    for name, value in hf.items():
        if "_norm." in name:
            continue
        for theirs, mixtrals in MIXTRAL_NAMES:
            if ".mlp." in name or ".block_sparse_moe." in name:
                name = name.replace(theirs, mixtrals)
        out[name] = value
    return out


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_megatron_mixtral_exports_to_each_hub_tensor_exactly_and_reads_back(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("megatron_mixtral")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    qwen, m = qwen3(data.draw, rng, all_moe=True)
    keys = {k: v for k, v in as_megatron_keys(qwen, m, stack=data.draw(st.booleans())).items()
            if "_layernorm." not in k or "self_attention" not in k}  # no query and key norms
    hf = as_mixtral(qwen)
    save_global(keys, path / "ckpt")
    params = {"heads": m["heads"], "kv_heads": m["kv_heads"], "top_k": 1, "rope_theta": 1e6}
    mapping = NameMapping.load("megatron_dist_mixtral", params)
    config = export(str(path / "ckpt"), str(path / "hf"), mapping=mapping)["config"]
    _, got = read_all(path / "hf")
    assert got.keys() == hf.keys()
    for n, value in hf.items():
        assert np.array_equal(got[n].numpy(), value), n
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"],
            config["head_dim"], config["num_hidden_layers"], config["rope_theta"]) == \
        (m["experts"], 1, m["ffn"], m["hd"], m["layers"], 1e6)
    assert config["tie_word_embeddings"] == ("lm_head.weight" not in hf)
    assert not {"attention_bias", "mlp_bias", "sliding_window"} & config.keys()  # Mixtral has no such fields
    source = SafetensorsSource(str(path / "hf"), mapping)
    for k, value in keys.items():  # layers and experts stacked again
        out = np.empty(value.shape, np.float32)
        source.read(k, gs.Box.full(value.shape), out)
        assert np.array_equal(out, value), k


MIXTRAL_LAYER = {"model.embed_tokens.weight": (8, 4), "model.layers.0.input_layernorm.weight": (4,),
                 "model.layers.0.self_attn.q_proj.weight": (8, 4),
                 "model.layers.0.block_sparse_moe.gate.weight": (3, 4),
                 "model.layers.0.block_sparse_moe.experts.0.w1.weight": (2, 4)}


@pytest.mark.parametrize("extra,params,match", [
    ({}, {}, "MixtralForCausalLM"),
    (Q_BIAS, {}, r"q, k and v biases .*Mixtral's attention has none"),
    (O_BIAS, {}, r"an o_proj bias .*Mixtral's attention has none"),
    ({"model.layers.1.mlp.gate_proj.weight": (6, 4)}, {}, r"dense layers .*every Mixtral layer is a MoE"),
    ({}, {"pre_softmax": 1}, r"moe_router_pre_softmax .*Mixtral normalises its top k"),
])
def test_a_megatron_model_mixtral_cannot_hold_is_refused_naming_why(extra, params, match):
    if match.endswith("ForCausalLM"):
        assert config_of("megatron_dist_mixtral", MIXTRAL_LAYER | extra, top_k=2, **params)["architectures"] == [match]
    else:
        with pytest.raises(ExportError, match=match):
            config_of("megatron_dist_mixtral", MIXTRAL_LAYER | extra, top_k=2, **params)


def megatron_mixtral_layer(rng):
    """One layer of a Megatron GPTModel with 3 experts and no biases, under its stacked sharded keys."""
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    p = "decoder.layers."
    return {"embedding.word_embeddings.weight": w(7, 4), "decoder.final_layernorm.weight": w(4),
            "output_layer.weight": w(7, 4), p + "input_layernorm.weight": w(1, 4),
            p + "self_attention.linear_qkv.weight": w(1, 12, 4), p + "self_attention.linear_proj.weight": w(1, 4, 4),
            p + "pre_mlp_layernorm.weight": w(1, 4), p + "mlp.router.weight": w(1, 3, 4),
            p + "mlp.experts.experts.linear_fc1.weight": w(1, 3, 4, 4),
            p + "mlp.experts.experts.linear_fc2.weight": w(1, 3, 4, 2)}


@pytest.mark.parametrize("extra", ["mlp.router.expert_bias", "mlp.shared_experts.linear_fc2.weight"])
def test_a_megatron_mixtral_with_an_expert_bias_or_a_shared_expert_stops_at_it(tmp_path, extra):
    rng = np.random.default_rng(2)
    save_global(megatron_mixtral_layer(rng) | {f"decoder.layers.{extra}": np.ones((1, 3), np.float32)},
                tmp_path / "ckpt")
    with pytest.raises(ExportError, match=re.escape(f"decoder.layers.{extra}")):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"),
               mapping=NameMapping.load("megatron_dist_mixtral", {"heads": 2, "kv_heads": 1, "top_k": 2}))
    assert not (tmp_path / "hf").exists()


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_torchtitan_gpt_oss_keys_export_to_each_gpt_oss_tensor_exactly_and_read_back(tmp_path_factory, data):
    # Written from Hugging Face's GptOss names and shapes (transformers' modeling_gpt_oss): experts stacked as
    # [experts, in, out], gate and up interleaved on the last axis; torchtitan's as [experts, out, in].
    path = tmp_path_factory.mktemp("gpt_oss")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    layers, kv_heads, hd = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), 2 * data.draw(st.integers(1, 2))
    heads, hidden = kv_heads * data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5))
    ffn, experts, vocab = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6))

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden),
          "lm_head.weight": w(vocab, hidden)}
    keys = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
            "lm_head.weight": hf["lm_head.weight"]}
    fused = data.draw(st.booleans())
    for i in range(layers):
        h, t = f"model.layers.{i}.", f"layers.{i}."
        hf |= attention_layer(w, h, hidden, heads, kv_heads, hd)
        hf |= {h + f"self_attn.{x}_proj.bias": w(n * hd) for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
        hf |= {h + "self_attn.o_proj.bias": w(hidden), h + "self_attn.sinks": w(heads),
               h + "mlp.router.weight": w(experts, hidden), h + "mlp.router.bias": w(experts),
               h + "mlp.experts.gate_up_proj": w(experts, hidden, 2 * ffn), h + "mlp.experts.gate_up_proj_bias":
               w(experts, 2 * ffn), h + "mlp.experts.down_proj": w(experts, ffn, hidden),
               h + "mlp.experts.down_proj_bias": w(experts, hidden)}
        keys |= {t + "attention_norm.weight": hf[h + "input_layernorm.weight"],
                 t + "ffn_norm.weight": hf[h + "post_attention_layernorm.weight"],
                 t + "attention.wo.weight": hf[h + "self_attn.o_proj.weight"],
                 t + "attention.wo.bias": hf[h + "self_attn.o_proj.bias"],
                 t + "attention.sinks": hf[h + "self_attn.sinks"],
                 t + "moe.router.gate.weight": hf[h + "mlp.router.weight"],
                 t + "moe.router.gate.bias": hf[h + "mlp.router.bias"]}
        e = t + "moe.routed_experts.inner_experts."
        keys |= {e + "mlp1_weight_EGD": np.ascontiguousarray(hf[h + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)),
                 e + "mlp1_bias_EG": hf[h + "mlp.experts.gate_up_proj_bias"],
                 e + "mlp2_weight_EDF": np.ascontiguousarray(hf[h + "mlp.experts.down_proj"].transpose(0, 2, 1)),
                 e + "mlp2_bias_ED": hf[h + "mlp.experts.down_proj_bias"]}
        for kind in ("weight", "bias"):
            q, k, v = (hf[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            if fused:  # the parameter: per kv group, its query heads, then its key and value head
                rest = q.shape[1:]
                keys[t + f"attention.qkv_linear.wqkv.{kind}"] = np.concatenate(
                    [a.reshape(kv_heads, -1, *rest) for a in (q, k, v)], axis=1).reshape(-1, *rest)
            else:
                keys |= {t + f"attention.qkv_linear.w{x}.{kind}": a for x, a in zip("qkv", (q, k, v))}
    # Trained with load balancing (every gpt_oss flavor): Hugging Face's GptOss routes without the bias, so the
    # shipped mapping stops at it, and exports once it is let go as its description says.
    biases = {f"layers.{i}.moe.expert_bias_E": w(experts) for i in range(layers)}
    save_global(keys | biases, path / "ckpt")
    params = {"heads": heads, "kv_heads": kv_heads, "top_k": 1}
    with pytest.raises(ExportError, match=r"layers\.0\.moe\.expert_bias_E"):
        export(str(path / "ckpt"), str(path / "refused"), mapping=NameMapping.load("torchtitan_gpt_oss", params))
    mapping = NameMapping.load(write(path / "let_go.json", {
        "extends": "torchtitan_gpt_oss", "skip": [r"layers\..*\.moe\.expert_bias_E"]}), params)
    index = export(str(path / "ckpt"), str(path / "hf"), mapping=mapping)
    assert index["skipped"] == sorted(biases)
    _, got = read_all(path / "hf")
    assert got.keys() == hf.keys()
    for n, value in hf.items():
        assert np.array_equal(got[n].numpy(), value), n
    config = index["config"]
    assert config["architectures"] == ["GptOssForCausalLM"] and config["num_local_experts"] == experts
    assert (config["head_dim"], config["intermediate_size"], config["num_hidden_layers"]) == (hd, ffn, layers)
    assert config["hidden_size"] == hidden and config["tie_word_embeddings"] is False
    # torchtitan's gpt_oss: a sliding window on even layers (its model's layer_id % 2 == 0), full attention on odd
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * (layers // 2) + \
        ["sliding_attention"] * (layers % 2)
    source = SafetensorsSource(str(path / "hf"), mapping)
    for k, value in keys.items():
        assert source.keys[k][1] == value.shape, k
        box = data.draw(box_within(value.shape))
        out = np.empty(box.shape, np.float32)
        source.read(k, box, out)
        assert np.array_equal(out, value[box.slices]), (k, box)



def mxfp4_by_element(blocks, scales):
    """MXFP4 dequantized one element at a time, from the OCP Microscaling format: a 4-bit E2M1 value (sign,
    2 exponent bits biased by 1, 1 mantissa bit; exponent 0 is subnormal), two to a byte, the low bits first,
    times 2 ** (its group's 8-bit scale - 127)."""
    def e2m1(bits):
        sign = -1.0 if bits & 8 else 1.0
        exponent, mantissa = (bits >> 1) & 3, bits & 1
        return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))

    out = np.zeros((*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2), np.float32)
    for index in np.ndindex(*blocks.shape):
        *lead, group, byte = index
        scale = 2.0 ** (int(scales[(*lead, group)]) - 127)
        for half, bits in enumerate((blocks[index] & 15, blocks[index] >> 4)):
            out[(*lead, group * blocks.shape[-1] * 2 + 2 * byte + half)] = e2m1(int(bits)) * scale
    return out


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_gpt_oss_experts_read_from_mxfp4_blocks_are_dequantized_in_any_box(tmp_path_factory, data):
    # The released gpt-oss checkpoints store the experts as MXFP4 blocks and scales ([experts, rows, groups,
    # 16] and [experts, rows, groups]): torchtitan_gpt_oss reads them back as the dequantized [experts, rows,
    # groups * 32], which is torchtitan's own [experts, out, in] (no transpose), as bfloat16.
    path = tmp_path_factory.mktemp("mxfp4")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    experts, rows, groups = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (experts, rows, groups), dtype=np.uint8)
    h = "model.layers.0.mlp.experts."
    save_file({h + "down_proj_blocks": blocks, h + "down_proj_scales": scales}, str(path / "model.safetensors"))
    source = SafetensorsSource(str(path), NameMapping.load("torchtitan_gpt_oss", {"heads": 1, "kv_heads": 1}))
    key = "layers.0.moe.routed_experts.inner_experts.mlp2_weight_EDF"
    expected = mxfp4_by_element(blocks, scales)
    assert source.keys[key][:2] == ("bfloat16", expected.shape) and source.names(key) == {
        h + "down_proj_blocks", h + "down_proj_scales"}
    box = data.draw(box_within(expected.shape))
    for b in (gs.Box.full(expected.shape), box):
        out = np.empty(b.shape, np.float32)
        source.read(key, b, out)
        assert np.array_equal(out, expected[b.slices]), b


@pytest.mark.parametrize("case,match", [
    ("nan scale", r"down_proj_scales': an MXFP4 scale is 255"),
    ("huge scale", r"down_proj_scales': MXFP4 values beyond float32's range \(a scale of 2 \*\* 127\)"),
    ("no scales", r"MXFP4 blocks are uint8 \[\.\.\., groups, bytes\] beside their uint8 scales .* and nothing"),
    ("not bytes", r"the files hold float32"),
])
def test_mxfp4_blocks_that_cannot_be_read_are_named(tmp_path, case, match):
    h = "model.layers.0.mlp.experts."
    blocks, scales = np.zeros((1, 2, 1, 16), np.uint8), np.full((1, 2, 1), 127, np.uint8)
    files = {h + "down_proj_blocks": blocks, h + "down_proj_scales": scales}
    if case in ("nan scale", "huge scale"):  # 6 * 2 ** 127 is beyond float32
        files[h + "down_proj_scales"] = np.full((1, 2, 1), 255 if case == "nan scale" else 254, np.uint8)
        files[h + "down_proj_blocks"] = np.full((1, 2, 1, 16), 0x77, np.uint8)
    elif case == "no scales":
        del files[h + "down_proj_scales"]
    else:
        files[h + "down_proj_blocks"] = blocks.astype(np.float32)
    save_file(files, str(tmp_path / "model.safetensors"))
    with pytest.raises(gs.StorageError if case.endswith("scale") else ExportError, match=match):
        source = SafetensorsSource(str(tmp_path), NameMapping.load("torchtitan_gpt_oss", {"heads": 1, "kv_heads": 1}))
        source.read("layers.0.moe.routed_experts.inner_experts.mlp2_weight_EDF", gs.Box((0, 0, 0), (1, 2, 32)),
                    np.empty((1, 2, 32), np.float32))


def test_a_rule_that_reads_mxfp4_writes_nothing_and_takes_no_other_option(tmp_path):
    save_global({"w": np.zeros((2, 32), np.float32)}, tmp_path / "ckpt")
    reading = NameMapping({"tensors": [{"key": "w", "name": "w_blocks", "mxfp4": "w_scales"}]})
    with pytest.raises(ExportError, match=r"'w': its rule \('w' as MXFP4 'w_blocks'\) only reads files"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=reading)
    with pytest.raises(ExportError, match=r"tensors\[0\]\.mxfp4: the name of the scales"):
        NameMapping({"tensors": [{"key": "w", "name": "w_blocks", "mxfp4": "w_scales", "axes": [1, 0]}]})
