"""torchtitan 0.3's llama3 ``debugmodel`` parallelized by its own
``parallelize_llama`` (FSDP2 dp_shard=2 x TP=2 on 4 gloo ranks, DTensor
backend), trained two AdamW steps and saved with globalshard and with torch
DCP, then loaded at TP=2, at dp_shard=2 and into one process by each: every
model and optimizer tensor equal to DCP's load. The one-process load is then
exported with ``--map torchtitan_llama3`` and opened by transformers, whose
logits must equal torchtitan's own forward, and the export read back by
``load_hf`` into torchtitan's FSDP2 x TP model equals DCP's load.

A Qwen3 MoE (torchtitan's ``debugmodel_moe``, fewer and smaller experts) saved
at FSDP2 dp_shard=2 x TP=2 x EP=4 (its experts sharded over EP as DTensors,
its load-balancing ``expert_bias_E`` a DTensor on each TP sub-mesh) reloads at
EP=2, at TP=2 and into one process as DCP loads it.

The debugmodel pipelined by torchtitan's ``pipelining_fn`` (PP=2 x TP=2,
Interleaved1F1B: 2 stages per rank) reloads at dp_shard=2, at PP=2 1F1B and
into one process as DCP loads it; the FSDP2 x TP save reloads at PP=2.
Its ``ParallelAwareDataloader`` at DP=2 resumes each rank's batches. Qwen3's
dense debugmodel (tied embeddings, fused GQA QKV) reloads at TP=2 and into one
process as DCP loads it, its embeddings still tied.

Qwen3 to Hugging Face: the dense model exported with ``--map torchtitan_qwen3``
and the MoE with ``torchtitan_qwen3_moe`` hold every tensor torchtitan's own
``Qwen3StateDictAdapter.to_hf`` makes, and transformers' ``Qwen3ForCausalLM``
and ``Qwen3MoeForCausalLM`` give torchtitan's logits; the exports read back
into the FSDP2 x TP (x EP) models by ``load_hf``, and so do models written by
transformers' ``save_pretrained``, with transformers' logits. A small
DeepSeek-V3 saved at FSDP2 x TP x EP exports with ``torchtitan_deepseek_v3``
as torchtitan's adapter does, gives its logits in ``DeepseekV3ForCausalLM``,
and reads back.

torchtitan's trainer loop with ``globalshard_torch.torchtitan.CheckpointManager``
as its checkpointer, beside its own DCP one: the same steps kept, and a resume
at another layout equal tensor for tensor."""

import json

import numpy as np
import pytest

pytest.importorskip("torchtitan.models.llama3")  # needs triton installed to import
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from ranks import run  # noqa: E402

WORLDS = {"tp2": dict(world=2, dp_shard=1, tp=2), "dp_shard2": dict(world=2, dp_shard=2, tp=1),
          "pp2": dict(world=2, dp_shard=1, tp=1, pp=2), "one_process": dict(world=1, dp_shard=1, tp=1)}


def reloaded_as_dcp_loads(work, layout, world, **kw):
    """Every rank's outcome of ``torchtitan_jobs:reload`` at ``kw``'s layout, each checked equal to
    DCP's load tensor for tensor (model and optimizer), with no key missing or unexpected."""
    ranks = run(world, "torchtitan_jobs:reload", str(work / layout), work=str(work), **kw)
    for r in ranks:
        assert r["differ"] == [] and r["optimizer_differ"] == []
        assert r["missing"] == [] and r["unexpected"] == []
    return ranks


@pytest.fixture(scope="module")
def full_dtensor_saved(tmp_path_factory):
    """The llama3 debugmodel trained at dp_shard=2 x TP=2 under torchtitan's full_dtensor backend
    (every parameter a DTensor over the whole mesh, FSDP2 sharding it on the DP axis)."""
    work = tmp_path_factory.mktemp("torchtitan_full_dtensor")
    run(4, "torchtitan_jobs:train", str(work / "train"), work=str(work), dp_shard=2, tp=2, backend="full_dtensor")
    return work


@pytest.mark.parametrize("layout,backend", [("dp_shard2", "full_dtensor"), ("tp2", "full_dtensor"),
                                            ("one_process", "full_dtensor"), ("dp_shard2", "partial_dtensor")])
def test_a_full_dtensor_backends_state_reloads_on_another_layout_and_backend_as_dcp_loads_it(
        full_dtensor_saved, layout, backend):
    w = WORLDS[layout]
    ranks = reloaded_as_dcp_loads(full_dtensor_saved, f"{layout}_{backend}", w["world"], dp_shard=w["dp_shard"],
                                  tp=w["tp"], backend=backend)
    assert sum(r["tensors"] for r in ranks) // w["world"] == 57


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    work = tmp_path_factory.mktemp("torchtitan")
    (value,) = set(json.dumps(v) for v in run(4, "torchtitan_jobs:train", str(work / "train"), work=str(work),
                                               dp_shard=2, tp=2))
    return work, json.loads(value)


def test_a_partial_dtensor_state_reloads_under_the_full_dtensor_backend_as_dcp_loads_it(saved):
    work, _ = saved
    ranks = reloaded_as_dcp_loads(work, "dp_shard2_full_dtensor", 2, dp_shard=2, tp=1, backend="full_dtensor")
    assert sum(r["tensors"] for r in ranks) // 2 == 57


@pytest.mark.parametrize("layout", list(WORLDS))
def test_fsdp2_by_tp_state_reloads_on_another_layout_as_dcp_loads_it(saved, layout):
    work, trained = saved
    w = WORLDS[layout]
    ranks = reloaded_as_dcp_loads(work, layout, w["world"], dp_shard=w["dp_shard"], tp=w["tp"], pp=w.get("pp", 1))
    stages = w.get("pp", 1)
    assert sum(r["tensors"] for r in ranks) // (w["world"] // stages) == trained["tensors"] == 57  # wq, wk, wv
    for r in ranks:
        assert r["optimizer_tensors"] >= 2 * 45 // stages


def test_a_torchtitan_checkpoint_exports_to_a_llama_transformers_runs_with_torchtitans_logits(saved, tmp_path):
    from globalshard.hf import NameMapping, export

    work, _ = saved
    (loaded,) = run(1, "torchtitan_jobs:reload", str(tmp_path / "ranks"), work=str(work), dp_shard=1, tp=1)
    out = export(str(work / "ours"), str(tmp_path / "hf"),
                 mapping=NameMapping.load("torchtitan_llama3", {"heads": 16, "kv_heads": 16}))
    assert out["skipped"] and all(k.startswith("optimizer.") for k in out["skipped"])
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = (torch.arange(2 * 16).reshape(2, 16) * 37) % 2048
    with torch.no_grad():
        theirs = model(tokens).logits.numpy()
    ours = np.array(loaded["logits"]).reshape(theirs.shape)
    assert np.max(np.abs(ours - theirs)) < 1e-5, np.max(np.abs(ours - theirs))
    # And back: load_hf fills torchtitan's own FSDP2 x TP model (fused wqkv, per kv group) from the export.
    for r in run(4, "torchtitan_jobs:from_hf", str(tmp_path / "back"), work=str(work), hf=str(tmp_path / "hf"),
                 dp_shard=2, tp=2):
        assert r["tensors"] == 45 and r["differ"] == []


MOE_WORLDS = {"ep2": dict(world=4, dp_shard=2, tp=2, ep=2), "tp2": dict(world=2, dp_shard=1, tp=2, ep=1),
              "one_process": dict(world=1, dp_shard=1, tp=1, ep=1)}


@pytest.fixture(scope="module")
def moe_saved(tmp_path_factory):
    work = tmp_path_factory.mktemp("torchtitan_moe")
    (tensors,) = set(r["tensors"] for r in run(4, "torchtitan_jobs:train", str(work / "train"), work=str(work),
                                                 name="qwen3", dp_shard=2, tp=2, ep=4))
    return work, tensors


@pytest.mark.parametrize("layout", list(MOE_WORLDS))
def test_an_expert_parallel_moe_reloads_on_another_layout_as_dcp_loads_it(moe_saved, layout):
    work, tensors = moe_saved
    w = MOE_WORLDS[layout]
    for r in reloaded_as_dcp_loads(work, layout, w["world"], name="qwen3", dp_shard=w["dp_shard"], tp=w["tp"],
                                   ep=w["ep"]):
        assert r["tensors"] == tensors == 29 and r["buffers"] == 2  # 2 layers of 3 stacked expert weights
        assert r["optimizer_tensors"] >= 2 * 27


PP_WORLDS = {"dp_shard2": dict(world=2, dp_shard=2, tp=1, pp=1, schedule="1F1B"),
             "pp2_1f1b": dict(world=2, dp_shard=1, tp=1, pp=2, schedule="1F1B"),
             "one_process": dict(world=1, dp_shard=1, tp=1, pp=1, schedule="1F1B")}


@pytest.fixture(scope="module")
def pp_saved(tmp_path_factory):
    """The llama3 debugmodel split by torchtitan's ``pipelining_fn`` into 4 stages for
    Interleaved1F1B (2 per rank) at PP=2 x TP=2: each rank's stages hold their own
    layers, their TP DTensors on the stage's sub-mesh and AdamW's step counts as
    plain tensors, and the optimizer's param groups as JSON values per parameter."""
    work = tmp_path_factory.mktemp("torchtitan_pp")
    trained = run(4, "torchtitan_jobs:train", str(work / "train"), work=str(work), dp_shard=1, tp=2, pp=2,
                  schedule="Interleaved1F1B")
    assert [r["parts"] for r in trained] == [2] * 4
    return work, trained[0]["tensors"] + trained[2]["tensors"]


@pytest.mark.parametrize("layout", list(PP_WORLDS))
def test_an_interleaved_pipeline_reloads_without_it_as_dcp_loads_it(pp_saved, layout):
    work, tensors = pp_saved
    w = PP_WORLDS[layout]
    ranks = reloaded_as_dcp_loads(work, layout, w["world"], dp_shard=w["dp_shard"], tp=w["tp"], pp=w["pp"],
                                  schedule=w["schedule"])
    assert sum(r["tensors"] for r in ranks) // (w["world"] // w["pp"]) == tensors == 57


def test_each_data_parallel_ranks_dataloader_resumes_where_it_was_as_with_dcp(tmp_path):
    # torchtitan's ParallelAwareDataloader keeps its state under the rank's own key
    # (dp_rank_<i>, pickled by torchtitan itself): each rank holds a key the others do not.
    pytest.importorskip("torchdata")
    for r in run(2, "torchtitan_jobs:dataloader", str(tmp_path / "ranks"), work=str(tmp_path)):
        assert r["ours"] == r["dcp"] == r["expected"]
        assert r["ours_fresh"][0] != r["expected"][0]  # a fresh loader would not give them


@pytest.fixture(scope="module")
def tied_saved(tmp_path_factory):
    """Qwen3's debugmodel (lm_head tied to tok_embeddings; Q, K and V fused, 8 KV heads of 16) trained at
    FSDP2 dp_shard=2 x TP=2 and saved by each."""
    work = tmp_path_factory.mktemp("torchtitan_qwen3_tied")
    run(4, "torchtitan_jobs:train", str(work / "train"), work=str(work), name="qwen3_tied", dp_shard=2, tp=2)
    return work


@pytest.mark.parametrize("layout", ["tp2", "one_process"])
def test_a_qwen3_with_tied_embeddings_reloads_as_dcp_loads_it_and_stays_tied(tied_saved, layout):
    work, w = tied_saved, WORLDS[layout]
    for r in reloaded_as_dcp_loads(work, layout, w["world"], name="qwen3_tied", dp_shard=w["dp_shard"], tp=w["tp"]):
        assert r["tensors"] == 25 and r["tied"] == [True]


def test_a_qwen3_exports_to_a_qwen3_transformers_runs_with_torchtitans_logits_and_back(tied_saved, tmp_path):
    params = {"heads": 16, "kv_heads": 8}
    (r,) = run(1, "torchtitan_jobs:exported", str(tmp_path / "ranks"), work=str(tied_saved), name="qwen3_tied",
               hf=str(tmp_path / "hf"), mapping="torchtitan_qwen3", params=params)
    assert r["architecture"] == "Qwen3ForCausalLM"
    # Every tensor torchtitan's own Qwen3StateDictAdapter.to_hf makes, equal; it leaves the tied lm_head out,
    # the export writes it (and an untied config): the same model.
    assert r["differ"] == [] and r["only_theirs"] == [] and r["only_ours"] == ["lm_head.weight"]
    assert r["skipped"] and all(k.startswith("optimizer.") for k in r["skipped"])
    assert r["logits_diff"] < 1e-5
    # And back into torchtitan's FSDP2 x TP Qwen3 (fused wqkv, q_norm and k_norm), as DCP loads the original.
    # Its lm_head is its embeddings: the files' own lm_head is left unread, which only strict=False allows.
    for back in run(4, "torchtitan_jobs:from_hf", str(tmp_path / "back"), work=str(tied_saved),
                    hf=str(tmp_path / "hf"), dp_shard=2, tp=2, name="qwen3_tied", mapping="torchtitan_qwen3",
                    params=params, strict=False):
        assert back["tensors"] == 20 and back["differ"] == [] and back["unread"] == ["lm_head.weight"]


def test_a_qwen3_moe_exports_to_transformers_qwen3_moe_once_its_expert_bias_is_let_go(moe_saved, tmp_path):
    from globalshard.hf import ExportError, NameMapping, export

    work, _ = moe_saved
    params = {"heads": 16, "kv_heads": 8, "top_k": 2}
    # Hugging Face's Qwen3 MoE routes without the load-balancing bias torchtitan's routes with: the shipped
    # mapping stops at it, naming it, and writes nothing.
    with pytest.raises(ExportError, match=r"layers\.0\.moe\.expert_bias_E"):
        export(str(work / "ours"), str(tmp_path / "refused"), mapping=NameMapping.load("torchtitan_qwen3_moe", params))
    assert not (tmp_path / "refused").exists()
    # Letting it go, as the mapping's description says (and torchtitan's own adapter does).
    mapping = tmp_path / "without_expert_bias.json"
    mapping.write_text(json.dumps({"extends": "torchtitan_qwen3_moe", "skip": [r"layers\..*\.moe\.expert_bias_E"]}))
    (r,) = run(1, "torchtitan_jobs:exported", str(tmp_path / "ranks"), work=str(work), name="qwen3",
               hf=str(tmp_path / "hf"), mapping=str(mapping), params=params, zero_expert_bias=True)
    assert r["architecture"] == "Qwen3MoeForCausalLM"
    assert r["differ"] == [] and r["only_ours"] == [] and r["only_theirs"] == []  # experts split as its adapter does
    assert sorted(k for k in r["skipped"] if not k.startswith("optimizer.")) == [
        "layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"]
    # torchtitan runs its experts in bfloat16 (transformers in float32): 3e-4 apart here; routing without
    # normalising the top k, or with the bias, puts them 0.04 and 0.07 apart.
    assert r["logits_diff"] < 2e-3
    # And back, as a fine-tune starts from Hugging Face's weights: load_hf fills torchtitan's MoE at
    # dp_shard=2 x TP=2 x EP=4 (each rank's experts from their own files' rows), the bias left as it was.
    for back in run(4, "torchtitan_jobs:from_hf", str(tmp_path / "back"), work=str(work), hf=str(tmp_path / "hf"),
                    dp_shard=2, tp=2, ep=4, name="qwen3", mapping=str(mapping), params=params):
        assert back["tensors"] == 23 and back["differ"] == [] and back["unread"] == []
        assert back["skipped"] == ["layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"]


@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3"])
def test_a_qwen3_transformers_wrote_loads_into_torchtitans_parallel_model_with_its_logits(tmp_path, name):
    # As a fine-tune starts from Hugging Face's weights: a random Qwen3ForCausalLM (tied embeddings) or
    # Qwen3MoeForCausalLM of torchtitan's debug shapes, written by save_pretrained, read by load_hf into
    # torchtitan's model at dp_shard=2 x TP=2 (x EP=4 for the MoE's 8 experts).
    shapes = dict(vocab_size=2048, hidden_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096)
    torch.manual_seed(3)
    if name == "qwen3":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shapes, intermediate_size=64, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, tie_word_embeddings=False))
        mapping = tmp_path / "without_expert_bias.json"
        mapping.write_text(json.dumps({"extends": "torchtitan_qwen3_moe", "skip": [r"layers\..*\.moe\.expert_bias_E"]}))
        # torchtitan runs its experts in bfloat16: 0.4% of the largest logit apart here (routing with the
        # bias, or without normalising the top k, is 5% and 3% off: test_a_qwen3_moe_exports_...).
        mapping, ep, tolerance = str(mapping), 4, 0.01
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shapes, intermediate_size=512,
                                                                        tie_word_embeddings=True))
        # float32 summed in another order at TP=2 (gloo's reductions, threads' blocking): up to about 1e-6
        # of the largest logit, varying from run to run (1.01e-6 seen in CI), so 1e-5 is the bound; two
        # entries of one k_norm swapped move it by 5e-4, two rows of a q_proj by 0.05.
        mapping, ep, tolerance = "torchtitan_qwen3", 1, 1e-5
    with torch.no_grad():  # weights of a trained model's scale (the initialisation's std 0.02 gives flat logits)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    model.eval().save_pretrained(str(tmp_path / "hf"))
    tokens = (torch.arange(2 * 16).reshape(2, 16) * 37) % 2048
    with torch.no_grad():
        theirs = model(tokens).logits.numpy()
    ranks = run(4, "torchtitan_jobs:from_transformers", str(tmp_path / "ranks"), work=str(tmp_path),
                hf=str(tmp_path / "hf"), dp_shard=2, tp=2, ep=ep, name=name, mapping=mapping,
                params={"heads": 16, "kv_heads": 8, **({"top_k": 2} if name == "qwen3" else {})})
    for r in ranks:
        assert r["unread"] == [] and r["skipped"] == (
            ["layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"] if name == "qwen3" else [])
    ours = np.array(ranks[0]["logits"]).reshape(theirs.shape)
    relative = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))  # of the largest logit
    assert relative < tolerance, relative


def test_a_gpt_oss_exports_to_transformers_gpt_oss_with_torchtitans_logits_and_back(tmp_path):
    # torchtitan's gpt-oss (attention sinks, biases everywhere, a window of 128 on even layers, YaRN, experts
    # stored [experts, out, in] with gate and up interleaved) trained at dp_shard=2 x TP=2 x EP=4 and saved,
    # exported with the shipped mapping (its load-balancing expert bias let go) to transformers' GptOss, whose
    # experts are [experts, in, out]: the mapping transposes them ("axes").
    run(4, "torchtitan_jobs:train", str(tmp_path / "train"), work=str(tmp_path), name="gpt_oss", dp_shard=2, tp=2,
        ep=4)
    mapping = tmp_path / "without_expert_bias.json"
    mapping.write_text(json.dumps({"extends": "torchtitan_gpt_oss", "skip": [r"layers\..*\.moe\.expert_bias_E"]}))
    params = {"heads": 64, "kv_heads": 8, "top_k": 4}
    (r,) = run(1, "torchtitan_jobs:exported", str(tmp_path / "ranks"), work=str(tmp_path), name="gpt_oss",
               hf=str(tmp_path / "hf"), mapping=str(mapping), params=params, zero_expert_bias=True, length=160)
    assert r["architecture"] == "GptOssForCausalLM"
    # The config's layer_types (written, not left to transformers' default) say which layers torchtitan windows.
    assert r["windows"] == [128, None] and r["sliding_window"] == 128
    assert r["layer_types"] == ["sliding_attention" if w else "full_attention" for w in r["windows"]]
    # Every tensor torchtitan 0.3's own GptOssStateDictAdapter.to_hf makes, equal; it leaves the experts out (it
    # names them mlp1_weight, mlp2_weight, which its model's keys, mlp1_weight_EGD and mlp2_weight_EDF, are not).
    assert r["differ"] == [] and r["only_theirs"] == []
    assert r["only_ours"] == sorted(f"model.layers.{i}.mlp.experts.{n}" for i in range(2)
                                    for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
    # 160 tokens, beyond the window: torchtitan's forward (its experts in float32, as transformers computes) is
    # 5e-7 of the largest logit apart in a trial; exported with a window of 1000, 15%.
    assert r["logits_diff"] < 1e-5 * r["logits_max"], r
    # Back, as a fine-tune starts from Hugging Face's weights: a GptOssForCausalLM of these shapes whose experts
    # are MXFP4 values (random blocks and scales dequantized by transformers' own convert_moe_packed_tensors), read
    # by load_hf into torchtitan's gpt-oss: at dp_shard=2 x TP=2 x EP=4 from what save_pretrained wrote (fused
    # wqkv weight and bias DTensors, each rank's experts transposed from the files' rows), and at dp_shard=2 x
    # EP=2 from the same model's files as the released gpt-oss checkpoints store their experts (blocks and
    # scales), where torchtitan keeps the expert bias a plain tensor (load_hf refused it before, "not a DTensor").
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(5)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=2048, hidden_size=256, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=64, num_local_experts=8, num_experts_per_tok=4, num_hidden_layers=2, sliding_window=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}))
    mxfp4 = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
        for i, layer in enumerate(model.model.layers):
            for proj, rows, cols in (("gate_up_proj", 128, 256), ("down_proj", 256, 64)):  # [experts, rows, cols]
                blocks = torch.randint(0, 256, (8, rows, cols // 32, 16), dtype=torch.uint8)
                scales = torch.randint(120, 124, (8, rows, cols // 32), dtype=torch.uint8)  # values of about 0.1
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales).float())
                mxfp4 |= {f"model.layers.{i}.mlp.experts.{proj}_blocks": blocks,
                          f"model.layers.{i}.mlp.experts.{proj}_scales": scales}
    model.eval().save_pretrained(str(tmp_path / "theirs"))
    (tmp_path / "theirs_mxfp4").mkdir()
    (tmp_path / "theirs_mxfp4" / "config.json").write_text((tmp_path / "theirs" / "config.json").read_text())
    plain = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    save_file({k: v for k, v in plain.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
              | mxfp4, str(tmp_path / "theirs_mxfp4" / "model.safetensors"))
    with torch.no_grad():
        theirs = model(torch.arange(2 * 160).reshape(2, 160) * 37 % 2048).logits.numpy()
    for world, tp, ep, files in ((4, 2, 4, "theirs"), (2, 1, 2, "theirs_mxfp4")):
        ranks = run(world, "torchtitan_jobs:from_transformers", str(tmp_path / f"back{world}"), work=str(tmp_path),
                    hf=str(tmp_path / files), dp_shard=2, tp=tp, ep=ep, name="gpt_oss", mapping=str(mapping),
                    params=params, length=160)
        for back in ranks:  # the scales too are read (strict: nothing of the files left unread)
            assert back["unread"] == [] and back["skipped"] == ["layers.0.moe.expert_bias_E",
                                                                "layers.1.moe.expert_bias_E"]
        ours = np.array(ranks[0]["logits"]).reshape(theirs.shape)
        assert np.max(np.abs(ours - theirs)) < 1e-5 * np.max(np.abs(theirs)), files


@pytest.fixture(scope="module")
def deepseek_saved(tmp_path_factory):
    """A small DeepSeek-V3 (multi-latent attention, a dense first layer, 8 routed experts of which 3 per token
    in 4 groups, 2 shared experts, routed as DeepSeek-V3: sigmoid scores with a bias) trained at FSDP2
    dp_shard=2 x TP=2 x EP=4 and saved by each."""
    work = tmp_path_factory.mktemp("torchtitan_deepseek_v3")
    run(4, "torchtitan_jobs:train", str(work / "train"), work=str(work), name="deepseek_v3", dp_shard=2, tp=2, ep=4)
    return work


DEEPSEEK = {"heads": 4, "top_k": 3, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "routed_scaling_factor": 2.5,
            "n_group": 4, "topk_group": 2, "yarn": 1, "mscale": 0.7, "max_position_embeddings": 163840}


def test_a_deepseek_v3_exports_to_transformers_deepseek_v3_with_torchtitans_logits_and_back(deepseek_saved, tmp_path):
    from globalshard.hf import ExportError, NameMapping, export

    # The checkpoint does not say how the router scores: the export asks, and refuses softmax.
    with pytest.raises(ExportError, match=r"'sigmoid_routing' is not in params"):
        export(str(deepseek_saved / "ours"), str(tmp_path / "asked"), mapping=NameMapping.load(
            "torchtitan_deepseek_v3", DEEPSEEK))
    with pytest.raises(ExportError, match=r"routes with a sigmoid: a model trained with softmax scores"):
        export(str(deepseek_saved / "ours"), str(tmp_path / "softmax"), mapping=NameMapping.load(
            "torchtitan_deepseek_v3", {**DEEPSEEK, "sigmoid_routing": 0}))
    # Nor whether its rotary embedding is YaRN (all of torchtitan's deepseek_v3 recipes): it asks that too.
    with pytest.raises(ExportError, match=r"'yarn' is not in params"):
        export(str(deepseek_saved / "ours"), str(tmp_path / "yarn"), mapping=NameMapping.load(
            "torchtitan_deepseek_v3", {**{k: v for k, v in DEEPSEEK.items() if k != "yarn"}, "sigmoid_routing": 1}))
    params = {**DEEPSEEK, "sigmoid_routing": 1}
    (r,) = run(1, "torchtitan_jobs:exported", str(tmp_path / "ranks"), work=str(deepseek_saved), name="deepseek_v3",
               hf=str(tmp_path / "hf"), mapping="torchtitan_deepseek_v3", params=params)
    assert r["architecture"] == "DeepseekV3ForCausalLM"
    # Every tensor torchtitan's own DeepSeekV3StateDictAdapter.to_hf makes (the expert bias as
    # e_score_correction_bias, each expert apart), equal, and nothing else.
    assert r["differ"] == [] and r["only_ours"] == [] and r["only_theirs"] == []
    assert r["skipped"] and all(k.startswith("optimizer.") for k in r["skipped"])
    # torchtitan runs its experts in bfloat16: 0.6% of the largest logit apart in a trial; a routed scaling
    # factor of 1, unnormalised top k, or no expert groups each put them 60% apart.
    assert r["logits_diff"] / r["logits_max"] < 0.02, r
    # Back into torchtitan's model at dp_shard=2 x TP=2 x EP=4, equal to DCP's load of the original.
    for back in run(4, "torchtitan_jobs:from_hf", str(tmp_path / "back"), work=str(deepseek_saved),
                    hf=str(tmp_path / "hf"), dp_shard=2, tp=2, ep=4, name="deepseek_v3",
                    mapping="torchtitan_deepseek_v3", params=params):
        assert back["differ"] == [] and back["unread"] == [] and back["skipped"] == [] and back["tensors"] > 30


def test_torchtitans_yarn_exports_as_the_rope_scaling_transformers_runs_with_its_logits(tmp_path):
    """Every deepseek_v3 recipe of torchtitan scales its rotary embedding and its softmax by YaRN
    (the model above too). With attention that is not near uniform (its projections 4 times
    torchtitan's initial ones), the scaling shows: the export with --param yarn=1 runs in
    transformers with torchtitan's logits, the same weights exported as plain rotary do not."""
    assert run(1, "torchtitan_jobs:sharpened", str(tmp_path / "save"), work=str(tmp_path), name="deepseek_v3",
               scale=4.0) == [12]  # wq, wkv_a, wkv_b, wo of 3 layers
    params = {**DEEPSEEK, "sigmoid_routing": 1}
    (yarn,) = run(1, "torchtitan_jobs:exported", str(tmp_path / "yarn"), work=str(tmp_path), name="deepseek_v3",
                  hf=str(tmp_path / "hf_yarn"), mapping="torchtitan_deepseek_v3", params=params)
    (plain,) = run(1, "torchtitan_jobs:exported", str(tmp_path / "plain"), work=str(tmp_path), name="deepseek_v3",
                   hf=str(tmp_path / "hf_plain"), mapping="torchtitan_deepseek_v3", params={**params, "yarn": 0})
    assert yarn["differ"] == [] and yarn["only_ours"] == [] and yarn["only_theirs"] == []
    assert yarn["logits_diff"] / yarn["logits_max"] < 1e-3, yarn  # 2.2e-5 measured
    assert plain["logits_diff"] / plain["logits_max"] > 0.05, plain  # 0.10 measured


def test_multi_token_prediction_layers_export_after_the_layers_as_torchtitans_adapter_numbers_them(tmp_path):
    """torchtitan's deepseek_v3 with a multi-token prediction layer (debugmodel_mtp's num_mtp_layers=1):
    its mtp_layers.0 exported as Hugging Face's model.layers.3 (after the 3 layers), every tensor as
    torchtitan's own adapter makes it; transformers runs the main layers with torchtitan's logits."""
    from globalshard.hf import ExportError, NameMapping, export

    run(1, "torchtitan_jobs:sharpened", str(tmp_path / "save"), work=str(tmp_path), name="deepseek_v3_mtp", scale=4.0)
    params = {**DEEPSEEK, "sigmoid_routing": 1}
    with pytest.raises(ExportError, match=r"'mtp_layers\.0\..*renumber.*'layers' is not in params"):
        export(str(tmp_path / "ours"), str(tmp_path / "asked"), mapping=NameMapping.load("torchtitan_deepseek_v3",
                                                                                          params))
    with pytest.raises(ExportError, match=r"several tensors map to the same names.*model\.layers\.2\."):
        export(str(tmp_path / "ours"), str(tmp_path / "short"), mapping=NameMapping.load(
            "torchtitan_deepseek_v3", {**params, "layers": 2}))
    with pytest.raises(ExportError, match=r"layers numbered with a gap"):
        export(str(tmp_path / "ours"), str(tmp_path / "long"), mapping=NameMapping.load(
            "torchtitan_deepseek_v3", {**params, "layers": 4}))
    (r,) = run(1, "torchtitan_jobs:exported", str(tmp_path / "ranks"), work=str(tmp_path), name="deepseek_v3_mtp",
               hf=str(tmp_path / "hf"), mapping="torchtitan_deepseek_v3", params={**params, "layers": 3})
    assert r["differ"] == [] and r["only_ours"] == [] and r["only_theirs"] == []
    assert r["logits_diff"] / r["logits_max"] < 1e-3, r  # 2.2e-5 measured
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (3, 1)


def test_our_checkpointer_with_check_replicas_refuses_a_step_whose_copies_drifted(tmp_path):
    # CheckpointManager.Config(check_replicas=True): the train state every rank holds, compared before each step
    # is written; rank 1 counting other tokens fails the step on both ranks, the step before stays the newest.
    for r in run(2, "torchtitan_checkpointer_jobs:drifted", str(tmp_path / "r"), work=str(tmp_path)):
        assert r["committed"] == ["step-1"], r
        assert "'train_state.ntokens_seen' []: copies differ, 2 values held by: rank 0 (main); rank 1" in r["error"]
        assert "'train_state.step'" not in r["error"]


@pytest.mark.parametrize("async_mode,pp", [("disabled", 1), ("async", 1), ("async_with_pinned_mem", 1),
                                           ("disabled", 2)])
def test_torchtitans_trainer_loop_checkpoints_with_our_manager_as_with_its_own(tmp_path, async_mode, pp):
    # torchtitan's trainer takes its checkpointer from its config: ours in its place, beside its own DCP one
    # (whose pinned-memory mode needs an accelerator: "async" there). Saved at dp_shard=2 or PP=2.
    theirs = "async" if async_mode == "async_with_pinned_mem" else async_mode
    for who, mode in (("ours", async_mode), ("dcp", theirs)):
        for r in run(2, "torchtitan_checkpointer_jobs:train", str(tmp_path / f"t_{who}"), work=str(tmp_path), who=who,
                     async_mode=mode, pp=pp):
            assert r["fresh_start"] and r["saved"] == [True] * 5, r
            # keep_latest_k=2, then the last step. DCP's async save makes its folder in the background, so
            # torchtitan's purge right after it sees one step fewer and keeps step-2 as well.
            kept = ["step-3", "step-4", "step-5"]
            assert r["steps"] == kept if who == "ours" or mode == "disabled" else set(kept) <= set(r["steps"]), r
    import globalshard as gs

    last = gs.read_metadata(tmp_path / "ours" / "checkpoint" / "step-5").tensors
    assert last and all(t.dtype == "bfloat16" for t in last.values())  # the model only, in export_dtype
    fourth = gs.read_metadata(tmp_path / "ours" / "checkpoint" / "step-4")  # nothing frozen: nothing hashed
    assert not fourth.bases and all(r.sha256 is None for t in fourth.tensors.values() for r in t.regions)
    assert not any(k.startswith("optimizer") for k in last)
    # A step folder the trainer left exports to Hugging Face as it is: its optimizer, schedulers, dataloader and
    # train state skipped (before: "4 keys match no rule and no 'skip' pattern": dataloader.*, train_state.*).
    from globalshard.hf import NameMapping, export

    mapping = NameMapping.load("torchtitan_llama3", {"heads": 16, "kv_heads": 16})
    full = export(str(tmp_path / "ours" / "checkpoint" / "step-4"), str(tmp_path / "hf4"), mapping=mapping)
    assert {k.split(".")[0] for k in full["skipped"]} == {"optimizer", "dataloader", "train_state"}, full["skipped"]
    model_only = export(str(tmp_path / "ours" / "checkpoint" / "step-5"), str(tmp_path / "hf5"), mapping=mapping)
    assert not model_only["skipped"] and sorted(full["weight_map"]) == sorted(model_only["weight_map"]), model_only
    for r in run(2, "torchtitan_checkpointer_jobs:resume", str(tmp_path / "r"), work=str(tmp_path)):
        assert r["latest"] == [5, 5] and r["changed"] > 10, r
        assert r["model"] == [] and r["optimizer"] == [] and r["schedulers"], r
        assert r["train_state"] == [[4, 16], [4, 16]], r  # 4 steps of 4 one-token samples
        assert r["initial_model"] == [] and r["initial_optimizer_kept"], r  # initial_load_path: the model only


def test_a_lora_fine_tune_under_torchtitans_trainer_stores_its_frozen_base_once(tmp_path):
    # torchtitan's own LoRA (LoRAConverter: adapters on each layer's attention and FFN outputs, everything else
    # frozen), trained 5 steps at dp_shard=2 with a checkpoint at each (2 kept, the last one model only in bf16):
    # ours from the writer process, beside torchtitan's own DCP checkpointer.
    import globalshard as gs

    for who, mode in (("ours", "async_with_pinned_mem"), ("dcp", "disabled")):
        (r, _) = run(2, "torchtitan_checkpointer_jobs:train", str(tmp_path / f"t_{who}"), work=str(tmp_path),
                     who=who, async_mode=mode, model="llama3_lora")
        assert r["saved"] == [True] * 5, r
        # torchtitan purges after each save but the last: steps 3 and 4, then 5. Ours keeps step-1 as well:
        # steps 2 to 4 reference its frozen weights (the bf16 last step does not).
        kept = ["step-3", "step-4", "step-5"]
        assert r["steps"] == (["step-1"] + kept if who == "ours" else kept), r
    folder = tmp_path / "ours" / "checkpoint"
    first, fourth, last = (gs.read_metadata(folder / f"step-{n}") for n in (1, 4, 5))
    frozen = sorted(k for k in last.tensors if "lora_" not in k)  # the model's keys, less its adapters
    assert len(frozen) > 20 and len(last.tensors) > len(frozen)

    def referenced(metadata: gs.Metadata) -> list[str]:
        return sorted(k for k, t in metadata.tensors.items() if all(r.base is not None for r in t.regions))

    def written(metadata: gs.Metadata) -> int:
        return sum(r.nbytes for t in metadata.tensors.values() for r in t.regions if r.base is None)

    assert referenced(first) == [] and not last.bases and referenced(last) == []
    assert [b.root for b in fourth.bases] == ["step-1"]
    assert [k for k in referenced(fourth) if not k.startswith(("optimizer.", "lr_scheduler.", "dataloader."))] == frozen
    adapters = sum(r.nbytes for k, t in fourth.tensors.items() if "lora_" in k for r in t.regions)  # with AdamW's
    assert written(fourth) <= 1.1 * adapters < written(first) / 10, (written(fourth), adapters, written(first))
    # Step 4 loads at TP=2 (its frozen weights from step-1) as torchtitan's own checkpoint of it does, and
    # starts a new run (initial_load_path) as well; the bytes all verify.
    # Turned off, every step stores everything again (and records no SHA-256, as a model without frozen
    # parameters does: test_torchtitans_trainer_loop_...).
    (r, _) = run(2, "torchtitan_checkpointer_jobs:train", str(tmp_path / "t_plain"), work=str(tmp_path / "plain"),
                 who="ours", async_mode="disabled", model="llama3_lora", reference_unchanged=False)
    plain = gs.read_metadata(tmp_path / "plain" / "ours" / "checkpoint" / "step-4")
    assert r["steps"] == kept and not plain.bases and written(plain) == written(first)
    assert all(r.sha256 is None for t in plain.tensors.values() for r in t.regions)
    problems, read = gs.Checkpoint(folder / "step-4").verify()
    assert problems == [] and read == sum(r.nbytes for t in fourth.tensors.values() for r in t.regions) > \
        written(fourth), (problems, read)
    # Moved alone (gs.copy, as `globalshard copy`), step 4 holds the same values with no base.
    moved = gs.copy(folder / "step-4", tmp_path / "moved" / "step-4")
    assert not moved.bases and sorted(moved.tensors) == sorted(fourth.tensors)
    for key in moved.tensors:
        assert np.array_equal(gs.read_array(tmp_path / "moved" / "step-4", key), gs.read_array(folder / "step-4", key))
    for r in run(2, "torchtitan_checkpointer_jobs:resume", str(tmp_path / "r"), work=str(tmp_path),
                 model="llama3_lora"):
        assert r["latest"] == [5, 5] and r["changed"] > 10, r
        assert r["model"] == [] and r["optimizer"] == [] and r["schedulers"], r
        assert r["initial_model"] == [] and r["initial_optimizer_kept"], r
    # Exported to Hugging Face with its adapters merged (torchtitan_llama3, --param lora_scale=alpha/rank):
    # transformers' logits are the LoRA model's; read back by load_hf, a fresh LoRA model starts from them.
    (r, other) = run(2, "torchtitan_checkpointer_jobs:lora_exported", str(tmp_path / "e"), work=str(tmp_path),
                     hf=str(tmp_path / "hf"))
    lora = sorted(k for k in fourth.tensors if "lora_" in k and not k.startswith("optimizer."))
    assert r["merged"] == lora and len(lora) == 4 * 6, r["merged"]  # wo and w2 of 6 layers: A and B
    assert r["tuned"] < 1e-5 < 100 * 1e-5 < r["dropped"], r  # float32 in another order; without the adapters
    assert r["started"] < 1e-5 and r["unread"] == [] and r["adapters_kept"] and other["adapters_kept"], r
    assert r["skipped"] == sorted(k for k in lora), r
    # Resumed from step 4 at TP=2 (a layout step-1 was not saved under), two more steps from the writer
    # process: each references step-1's frozen weights, cut as step-1 cut them, and writes only the
    # adapters and their state.
    (r, _) = run(2, "torchtitan_checkpointer_jobs:lora_resumed", str(tmp_path / "lr"), work=str(tmp_path),
                 async_mode="async_with_pinned_mem")
    assert r["steps"] == ["step-1", "step-6", "step-7"], r
    for n in (6, 7):
        later = gs.read_metadata(folder / f"step-{n}")
        assert [b.root for b in later.bases] == ["step-1"], n
        assert [k for k in referenced(later) if not k.startswith(("optimizer.", "lr_scheduler."))] == frozen, n
        for k in frozen:  # step-1's regions (dp_shard=2 cuts rows), each referenced
            assert [(reg.box, reg.path, reg.base) for reg in later.tensors[k].regions] == \
                [(reg.box, reg.path, 0) for reg in first.tensors[k].regions], k
        assert written(later) <= 1.1 * adapters, (n, written(later), adapters)
        assert gs.Checkpoint(folder / f"step-{n}").verify()[0] == []


def test_a_seed_checkpoint_made_in_one_process_starts_a_sharded_run_as_torchtitans_own(tmp_path):
    # torchtitan's create_seed_checkpoint: step 0 saved unsharded by one process (the model only), then a
    # run at dp_shard=2 starts from it (load(step=-1) finds step 0 and loads the model only), by our
    # checkpointer and by torchtitan's own: the same weights, the seed's.
    (seeded,) = run(1, "torchtitan_checkpointer_jobs:seed", str(tmp_path / "s"), work=str(tmp_path))
    import globalshard as gs

    stored = gs.read_metadata(tmp_path / "ours" / "checkpoint" / "step-0")
    assert sorted(stored.tensors) == sorted(seeded) and gs.read_trainer_state(tmp_path / "ours" / "checkpoint"
                                                                               / "step-0") is not None
    for r in run(2, "torchtitan_checkpointer_jobs:from_seed", str(tmp_path / "r"), work=str(tmp_path)):
        assert r["differ"] == [] and r["tensors"] == len(seeded) > 20, r["differ"]
        assert r["values"] == seeded


@pytest.mark.parametrize("async_mode", ["async", "async_with_pinned_mem"])
def test_a_background_save_that_fails_raises_at_the_trainers_wait_and_commits_nothing(tmp_path, async_mode):
    for r in run(2, "torchtitan_checkpointer_jobs:failed", str(tmp_path / "f"), work=str(tmp_path),
                 async_mode=async_mode):
        assert r == {"returned": True, "error": "StorageError", "found": -1, "committed": False,
                     "committed_at_close": True}, r


@pytest.mark.parametrize("async_mode,model", [("disabled", "llama3"), ("async_with_pinned_mem", "llama3"),
                                              ("async_with_pinned_mem", "llama3_lora")])
def test_a_fast_tier_in_front_of_torchtitans_folder_recovers_a_step_that_never_reached_it(tmp_path, async_mode,
                                                                                          model):
    # Each rank a node with a directory of its own; steps saved there and on the next node, copied to the
    # folder in the background. The folder's newest step lost (a job that died before its copy ended) and a
    # node lost: the resume, at TP=2 instead of dp_shard=2, loads step 4 from the surviving node's copies. With
    # LoRA, steps 2 to 4 reference step 1's frozen base: its copies stay on the nodes, and it is read there too.
    import shutil

    import globalshard as gs

    lora = model == "llama3_lora"
    trained = run(2, "torchtitan_checkpointer_jobs:tiered", str(tmp_path / "t"), work=str(tmp_path), phase="train",
                  async_mode=async_mode, model=model)
    base = ["step-1"] if lora else []
    for r in trained:
        # keep_latest_k=2 (torchtitan's purge, keeping the base), local_keep=2 (and the base's copies)
        assert r["folder"] == ["latest", *base, "step-3", "step-4"], r["folder"]
        assert r["local"] == ["iter_0000001"] * lora + ["iter_0000003", "iter_0000004"], r["local"]
        assert r["train_state"] == [4, 16] and r["values"] == trained[0]["values"]
    assert [b.root for b in gs.read_metadata(tmp_path / "ours" / "tiered" / "step-4").bases] == base
    shutil.rmtree(tmp_path / "ours" / "tiered" / "step-4")
    shutil.rmtree(tmp_path / "local" / "node1")
    # load() as the trainer resumes; load(step=4) as its load_step asks (the plain case only: the same path).
    for step in (-1, 4) if async_mode == "disabled" else (-1,):
        for r in run(2, "torchtitan_checkpointer_jobs:tiered", str(tmp_path / f"r{step}"), work=str(tmp_path),
                     phase="resume", model=model, step=step):
            assert r["step"] == 4 and r["bytes_persistent"] == 0 and r["bytes_near"] > 0, r
            assert r["train_state"] == [4, 16]
            differ = sorted(k for k in trained[0]["values"] if r["values"].get(k) != trained[0]["values"][k])
            assert differ == [] and len(r["values"]) == len(trained[0]["values"]) > 40, differ


def test_torchtitans_hugging_face_last_save_and_initial_load_go_through_our_checkpointer(tmp_path):
    for r in run(2, "torchtitan_checkpointer_jobs:hugging_face", str(tmp_path / "h"), work=str(tmp_path)):
        assert "model.safetensors.index.json" in r["files"] or "model.safetensors" in r["files"], r
        assert r["differ"] == [] and r["tensors"] > 40, r
