"""Megatron-Core's own ``dist_checkpointing`` with globalshard as its sharded
strategy: Megatron's models and distributed optimizer describe their state
with ``sharded_state_dict()`` as its trainer does, ``dist_checkpointing.save``
stores it through ``globalshard_torch.megatron.SaveStrategy`` and
``dist_checkpointing.load`` finds the backend by itself. The oracle is the
same state saved and loaded with Megatron's default strategy (torch_dist).

All scenarios run in one spawn of 2 gloo ranks (``megatron_strategy_jobs``)."""

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from ranks import held, outcomes_by_case, run

DENSE = dict(hidden=16, heads=4, groups=2, ffn=32, glu=True, bias=False, vocab=64, tied=False)
CASES = [
    # Stacked layers (prepend_axis_num=1), fused SwiGLU fc1 (a ShardedTensorFactory) and GQA QKV cut by TP.
    dict(name="tp2_to_pp2_tied", save=dict(tp=2, pp=1), load=dict(tp=1, pp=2), model={**DENSE, "tied": True}),
    dict(name="vpp2_to_tp2", save=dict(tp=1, pp=2, vpp=2), load=dict(tp=2, pp=1), model=DENSE),
    dict(name="moe_ep2_to_tp2", save=dict(tp=1, pp=1, ep=2), load=dict(tp=2, pp=1), model={**DENSE, "experts": 4}),
    # Megatron's uneven pipeline_model_parallel_layout, and multi-token prediction (its layer on the last stage).
    dict(name="layout_3_1_to_vpp2", save=dict(tp=1, pp=2, pp_layout="Ettt|tL"), load=dict(tp=1, pp=2, vpp=2),
         model=DENSE),
    dict(name="mtp_pp2_to_tp2", save=dict(tp=1, pp=2), load=dict(tp=2, pp=1), model={**DENSE, "mtp": True}),
    # The distributed optimizer's two current formats: param-shaped (reshards over any layout) and
    # its buffers as they are (reshards over DP only), the second with bf16 parameters and their fp32
    # main copies, as Megatron's trainer keeps them.
    dict(name="distopt_fully_reshardable_dp2_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1), model=DENSE,
         sharding="fully_reshardable"),
    # Megatron-LM's --distrib-optim-fully-reshardable-mem-efficient: the same format, gathered over gloo
    # to DP rank 0, which alone saves it.
    dict(name="distopt_fully_reshardable_mem_efficient_dp2_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1),
         model=DENSE, sharding="fully_reshardable_mem_efficient"),
    dict(name="distopt_dp_reshardable_bf16_dp2", save=dict(tp=1, pp=1), load=dict(tp=1, pp=1),
         model={**DENSE, "bf16": True}, sharding="dp_reshardable"),
    # Megatron's fully parallel save and load (its trainer's default), over DP=2 and then DP=1.
    dict(name="fully_parallel_dp2_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1), model=DENSE, parallel=True),
    dict(name="fully_parallel_distopt_dp2", save=dict(tp=1, pp=1), load=dict(tp=1, pp=1), model=DENSE,
         sharding="fully_reshardable", parallel=True),
    # The background save Megatron's trainer makes (async_sharded_save, its AsyncCallsQueue).
    dict(name="async_tp2_to_tp1", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1), model=DENSE, background=True),
    # Both, as Megatron-LM's trainer saves with --async-save: fully parallel over DP=2, in the background.
    dict(name="async_fully_parallel_dp2_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1), model=DENSE,
         background=True, parallel=True),
]
# allow_shape_mismatch (embeddings and output layer): a vocabulary padded to another size on load
# (at 128 and TP=2, rank 1's rows are all beyond the stored ones).
RESIZED = [
    dict(name="vocab_64_to_128", save=dict(tp=2, pp=1), load=dict(tp=2, pp=1), model=DENSE,
         load_model={**DENSE, "vocab": 128}),
    dict(name="vocab_72_to_64", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1), model={**DENSE, "vocab": 72},
         load_model=DENSE),
]

# A background save that fails on one rank (its writer process killed).
FAILED = [dict(name="async_writer_killed", save=dict(tp=2, pp=1), model=DENSE, fail=True)]

# A Megatron Llama (RMSNorm, SwiGLU, 2 query groups) exported to Hugging Face Llama from what the strategy
# stored; with qk_layernorm, to Hugging Face Qwen3.
LLAMA = {**DENSE, "llama": True}
EXPORTS = [
    dict(name="export_tp2", save=dict(tp=2, pp=1), model=LLAMA, export="megatron_dist", reload=dict(tp=1, pp=2)),
    dict(name="export_pp2_tied", save=dict(tp=1, pp=2), model={**LLAMA, "tied": True}, export="megatron_dist"),
    # Llama 3.1's rotary: base 500000, scaled by 8 (GPTModel's rope_scaling), which the checkpoint does not record.
    dict(name="export_rope_scaling_tp2", save=dict(tp=2, pp=1), model={**LLAMA, "rotary_base": 500000,
                                                                          "rope_scaling": 8}, export="megatron_dist"),
    dict(name="export_qwen3_pp2", save=dict(tp=1, pp=2), model={**LLAMA, "qk_norm": True},
         export="megatron_dist_qwen3", reload=dict(tp=1, pp=2, vpp=2)),  # its chunks in one call
    dict(name="export_qwen2_tp2", save=dict(tp=2, pp=1), model={**LLAMA, "qkv_bias": True},
         export="megatron_dist_qwen2"),
    # A Qwen3 MoE: 4 experts (SequentialMLP, the local spec's), 2 routed per token, saved at EP=2.
    dict(name="export_qwen3_moe_ep2", save=dict(tp=1, pp=1, ep=2), model={**LLAMA, "qk_norm": True, "experts": 4},
         export="megatron_dist_qwen3_moe", reload=dict(tp=2, pp=1)),
    # Routed with moe_router_pre_softmax: the top k's probabilities over all experts, not normalised.
    dict(name="export_qwen3_moe_pre_softmax_ep2", save=dict(tp=1, pp=1, ep=2),
         model={**LLAMA, "qk_norm": True, "experts": 4, "pre_softmax": True}, export="megatron_dist_qwen3_moe"),
    # A Qwen2-MoE (Qwen1.5-MoE's form): q, k, v biases, a shared expert scaled by its sigmoid gate, routed
    # with moe_router_pre_softmax; read back at TP=2.
    dict(name="export_qwen2_moe_ep2", save=dict(tp=1, pp=1, ep=2), export="megatron_dist_qwen2_moe",
         model={**LLAMA, "qkv_bias": True, "experts": 4, "shared": 32, "pre_softmax": True}, reload=dict(tp=2, pp=1)),
    # A Mixtral (Megatron-LM's examples/mixtral): every layer a MoE, no biases, no query or key norms,
    # routed by Megatron's default softmax over the top k; exported under the Hub's names, read back at TP=2.
    dict(name="export_mixtral_ep2", save=dict(tp=1, pp=1, ep=2), model={**LLAMA, "experts": 4},
         export="megatron_dist_mixtral", reload=dict(tp=2, pp=1)),
    # Its first layer dense (moe_layer_freq): Megatron keys each layer apart (non-homogeneous layers).
    dict(name="export_qwen3_moe_dense_first_tp2", save=dict(tp=2, pp=1),
         model={**LLAMA, "qk_norm": True, "experts": 4, "moe_freq": [0, 1, 1, 1]}, export="megatron_dist_qwen3_moe"),
]
# A DeepSeek-V3: multi-latent attention, 4 routed experts (2 per token, from 1 of 2 groups, by sigmoid
# scores plus a load-balancing bias, scaled by 2.5) and 2 shared ones. Saved at EP=2 with a query LoRA
# and plain rotary (layers stacked); at TP=2 with its first layer dense (keys per layer), no query LoRA and
# YaRN (MLATransformerConfig's default, scaled as DeepSeek-V3's: mscale_all_dim 1).
MLA = dict(kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, expert_ffn=12, shared_ffn=24,
           scale=2.5, groups=2, group_topk=1)
DEEPSEEK = {**LLAMA, "hidden": 32, "ffn": 48, "experts": 4}
EXPORTS += [
    dict(name="export_deepseek_v3_ep2", save=dict(tp=1, pp=1, ep=2), export="megatron_dist_deepseek_v3",
         reload=dict(tp=2, pp=1),
         model={**DEEPSEEK, "mla": {**MLA, "q_lora_rank": 16, "rope_type": "rope"}}),
    # With a multi-token prediction layer (mtp_num_layers=1, as Megatron-Bridge's DeepSeek-V3 recipes):
    # exported as Hugging Face's layer 4, which transformers does not run; read back at TP=2 by gm.load_hf,
    # the loss and the MTP block's hidden states of the model that saved it.
    dict(name="export_deepseek_v3_mtp_ep2", save=dict(tp=1, pp=1, ep=2), export="megatron_dist_deepseek_v3",
         reload=dict(tp=2, pp=1), model={**DEEPSEEK, "mtp": True, "mla": {**MLA, "q_lora_rank": 16,
                                                                             "rope_type": "rope"}}),
    dict(name="export_deepseek_v3_dense_first_yarn_tp2", save=dict(tp=2, pp=1), export="megatron_dist_deepseek_v3",
         reload=dict(tp=1, pp=2),
         model={**DEEPSEEK, "moe_freq": [0, 1, 1, 1],
                "mla": {**MLA, "q_lora_rank": None, "rope_type": "yarn", "rotary_scaling_factor": 4.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4}}),
]
# Files that do not fit the model, read by gm.load_hf (after the exports, whose transformers files they are).
MISMATCHES = [dict(name="hf_mismatches", refuse=True, llama="export_tp2", qwen3="export_qwen3_pp2", model=LLAMA)]
ARCHITECTURES = {"megatron_dist_deepseek_v3": "DeepseekV3ForCausalLM", "megatron_dist_qwen2_moe": "Qwen2MoeForCausalLM",
                 "megatron_dist": "LlamaForCausalLM", "megatron_dist_qwen3": "Qwen3ForCausalLM",
                 "megatron_dist_qwen2": "Qwen2ForCausalLM", "megatron_dist_mixtral": "MixtralForCausalLM",
                 "megatron_dist_qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return outcomes_by_case(2, "megatron_strategy_jobs:scenarios", str(tmp_path_factory.mktemp("megatron_strategy")),
                            CASES + RESIZED + FAILED + EXPORTS + MISMATCHES)


def _checked(ranks):
    for r in ranks:
        assert r["differ"] == [], f"differ from torch_dist's load: {r['differ']}"
        assert r["tensors"] > 0
        assert r["backend"] == "globalshard"
        assert r["same_metadata"] and r["keys"] > 0, "load_tensors_metadata differs from torch_dist's"
        assert r["plain"] == [], f"load_plain_tensors differs from torch_dist's: {r['plain']}"
    assert held(ranks, "verified") is True


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_megatrons_sharded_state_dict_reshards_through_the_globalshard_strategy(outcomes, case):
    ranks = outcomes[case]
    _checked(ranks)
    before = held(ranks, "before")
    after = held(ranks, "after")
    assert np.max(np.abs(np.array(after) - np.array(before))) < 1e-5
    if "async" in case:
        assert all(r["changed"] for r in ranks), "training did not change the weights during the save"


@pytest.mark.parametrize("case", [c["name"] for c in RESIZED])
def test_a_padded_vocabulary_loads_as_megatrons_own_strategy_loads_it(outcomes, case):
    _checked(outcomes[case])


def test_a_background_save_that_fails_on_one_rank_fails_on_every_rank_and_leaves_no_checkpoint(outcomes):
    for r in outcomes["async_writer_killed"]:
        assert r["error"] is not None, "the finalization did not raise"
        assert not r["megatron_metadata"] and not r["committed"] and not r["loads"]


@pytest.mark.parametrize("case", [c["name"] for c in EXPORTS])
def test_what_the_strategy_stored_exports_to_transformers_with_megatrons_logits_and_loads_back(outcomes, case):
    ranks = outcomes[case]
    export = next(c["export"] for c in EXPORTS if c["name"] == case)
    assert held(ranks, "architecture") == ARCHITECTURES[export]
    before = held(ranks, "before")
    exported = held(ranks, "exported")
    model = next(c["model"] for c in EXPORTS if c["name"] == case)
    # DeepSeek's four layers of sigmoid-routed experts sum in another order: 4e-5 and 7e-5 of logits up
    # to 2.1 measured, where routing without its groups moves them by 0.56, rotary without YaRN by 0.2.
    bound = 2e-4 if model.get("mla") else 1e-5
    if model.get("mtp"):  # Megatron's forward gives the loss and MTP's hidden states: compared after reading back
        assert len(exported) == 2 * 8 * 64  # the logits of the 4 layers transformers runs
        assert np.max(np.abs(np.array(held(ranks, "reloaded")) - np.array(before))) < bound
    else:
        assert np.max(np.abs(np.array(exported) - np.array(before))) < bound
    if next(c for c in EXPORTS if c["name"] == case).get("reload") and not model.get("mtp"):
        # transformers' own files of that model, read by gm.load_hf into Megatron at another layout
        reloaded = held(ranks, "reloaded")
        assert np.max(np.abs(np.array(reloaded) - np.array(exported))) < bound
        assert all(r["report"]["unread"] == [] and r["report"]["tensors"] > 0 for r in ranks)
    assert (ranks[0]["per_layer_keys"] > 0) == bool(model.get("moe_freq"))  # Megatron's two forms of keys
    if model.get("experts"):
        assert ranks[0]["dense_layers"] == [i for i, f in enumerate(model.get("moe_freq", [1] * 4)) if not f]


def test_hugging_face_files_that_do_not_fit_a_megatron_model_are_refused_naming_the_keys(outcomes):
    for r in outcomes["hf_mismatches"]:
        # Megatron's Qwen3 asks for query and key norms a Llama's files lack: named, nothing loaded.
        assert r["qwen3_from_llama"].startswith("MismatchError") and \
            "decoder.layers.self_attention.q_layernorm.weight" in r["qwen3_from_llama"], r["qwen3_from_llama"]
        # A Llama leaves a Qwen3's norms unread: refused unless strict=False, which names them.
        assert r["llama_from_qwen3"].startswith("MismatchError") and \
            "model.layers.0.self_attn.q_norm.weight" in r["llama_from_qwen3"], r["llama_from_qwen3"]
        assert "model.layers.3.self_attn.k_norm.weight" in r["llama_from_qwen3_lenient"]


def test_megatrons_own_serialization_tests_pass_with_the_globalshard_strategy(tmp_path):
    """Megatron's test_serialization.py cases on errors, shapes, empty states and
    removing tensors, and a test_strict.py case, in one process."""
    (out,) = run(1, "megatron_strategy_jobs:conventions", str(tmp_path / "ranks"), path=str(tmp_path))
    for cols in (28, 36):  # a rigid target of another global shape is refused, naming the key and both shapes
        assert out[f"rigid_{cols}"].startswith("CheckpointingException: MismatchError"), out[f"rigid_{cols}"]
        assert "keyA" in out[f"rigid_{cols}"] and f"(2, {cols})" in out[f"rigid_{cols}"]
    assert out["rigid_with_flexible"].startswith("CheckpointingException: MismatchError"), out["rigid_with_flexible"]
    assert out["flexible_28"] == {"flexible": [list(range(28))] * 2}  # the part it overlaps
    assert out["flexible_36"] == {"flexible": [list(range(32)) + [0] * 4] * 2}  # zeros beyond, as torch_dist
    assert out["renamed"].startswith("CheckpointingException") and "different_key" in out["renamed"]
    assert out["empty"] == {"common": "common-value"}
    assert out["meta"] == {"rigid": ["cpu", [list(range(32))] * 2]}
    assert out["meta_save"].startswith("CheckpointingException") and "'keyM': on the meta device" in out["meta_save"]
    assert out["strict"] == {"loaded": {"a": [0.0, 1.0]}, "missing": ["TenB"], "unexpected": ["TenC"]}
    removed = out["removed"]  # test_remove_sharded_tensors: the prefixed key gone, its arrays too
    assert removed["keys"] == ["keyA"] and removed["files"] == ["keyA"], removed
    assert removed["kept"] == {"a": [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]}
    assert len(removed["warned"]) == 1 and 'whose keys begin with "prefix". Skipping removal' in removed["warned"][0]
    # SaveStrategy(check_replicas=True): two copies of keyD's box one ulp apart, refused, nothing committed.
    assert out["drifted"].startswith("CheckpointingException: MismatchError"), out["drifted"]
    assert "'keyD' [0:2, 0:3]: copies differ" in out["drifted"] and not out["drifted_committed"]


def test_any_two_cuts_of_a_global_array_round_trip_through_dist_checkpointing(tmp_path):
    (examples,) = run(1, "megatron_strategy_jobs:properties", str(tmp_path / "ranks"), path=str(tmp_path))
    assert examples == 25


def test_uneven_pieces_empty_ones_included_round_trip_through_dist_checkpointing(tmp_path):
    # Megatron's test_uneven_1d_sharding (and _multiple_shards): pieces of any sizes, empty ones
    # too, several per holder, saved one way and loaded another.
    (examples,) = run(1, "megatron_strategy_jobs:uneven", str(tmp_path / "ranks"), path=str(tmp_path))
    assert examples == 27  # 25 drawn, Megatron's 2 with empty pieces
