"""Megatron-Core's own GPTModel as the oracle: saved under one layout with
globalshard (default arguments) and with Megatron's ``dist_checkpointing``,
loaded under another by each; every tensor must be equal to Megatron's own
load, and the logits of a fixed batch equal to those before the save.

All scenarios run in one spawn of 2 gloo ranks (``megatron_jobs``)."""

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from ranks import held, outcomes_by_case

import globalshard_torch as gt

DENSE = dict(hidden=16, heads=4, groups=2, ffn=32, glu=True, bias=False, vocab=64, tied=False)
CASES = [
    dict(name="tp2_to_tp1", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1), model=DENSE),
    dict(name="tp1_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1), model=DENSE),
    # Tied embeddings across pipeline stages: the last stage's output layer is a copy.
    dict(name="pp2_to_pp1_tied", save=dict(tp=1, pp=2), load=dict(tp=1, pp=1), model={**DENSE, "tied": True}),
    dict(name="pp1_to_pp2_tied", save=dict(tp=1, pp=1), load=dict(tp=1, pp=2), model={**DENSE, "tied": True}),
    # One query group at TP=2 (fewer kv heads than ranks), with biases and a plain MLP.
    dict(name="gqa_1_group_tp2_to_tp1", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1),
         model={**DENSE, "groups": 1, "bias": True, "glu": False}),
    dict(name="gqa_1_group_tp1_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1),
         model={**DENSE, "groups": 1, "bias": True, "glu": False}),
    # A vocabulary of 60 padded to 64 (make_vocab_size_divisible_by=32 x TP): the padding rows are
    # trained (the loss runs over them) and Megatron's checkpoint keeps them.
    dict(name="padded_vocab_tp2_to_tp1", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1),
         model={**DENSE, "true_vocab": 60}),
    dict(name="padded_vocab_same_layout", save=dict(tp=2, pp=1), load=dict(tp=2, pp=1),
         model={**DENSE, "true_vocab": 60}),
    # Mixture of experts (SequentialMLP, 4 experts): EP carved out of DP, and EP traded for TP.
    dict(name="moe_ep2_to_ep1", save=dict(tp=1, pp=1, ep=2), load=dict(tp=1, pp=1, ep=1),
         model={**DENSE, "experts": 4}),
    dict(name="moe_ep2_to_tp2", save=dict(tp=1, pp=1, ep=2), load=dict(tp=2, pp=1, ep=1),
         model={**DENSE, "experts": 4}),
    dict(name="moe_tp2_to_ep2", save=dict(tp=2, pp=1, ep=1), load=dict(tp=1, pp=1, ep=2),
         model={**DENSE, "experts": 4}),
    # Experts not cut by TP (expert_tensor_parallel_size=1 at TP=2: each TP rank holds other experts whole).
    dict(name="moe_tp2_etp1_ep2_to_tp1", save=dict(tp=2, pp=1, ep=2, etp=1), load=dict(tp=1, pp=1),
         model={**DENSE, "experts": 4}),
    dict(name="moe_tp2_to_tp2_etp1_ep2", save=dict(tp=2, pp=1), load=dict(tp=2, pp=1, ep=2, etp=1),
         model={**DENSE, "experts": 4}),
    # Interleaved virtual pipeline (2 chunks per stage: layers 0 and 2 on stage 0, 1 and 3 on
    # stage 1), traded for data parallelism, for TP and for a plain pipeline, with tied embeddings.
    dict(name="vpp2_to_pp1", save=dict(tp=1, pp=2, vpp=2), load=dict(tp=1, pp=1), model=DENSE),
    dict(name="tp2_to_vpp2_tied", save=dict(tp=2, pp=1), load=dict(tp=1, pp=2, vpp=2),
         model={**DENSE, "tied": True}),
    dict(name="vpp2_to_pp2_tied", save=dict(tp=1, pp=2, vpp=2), load=dict(tp=1, pp=2),
         model={**DENSE, "tied": True}),
    # An uneven pipeline (num_layers_in_first_pipeline_stage=1: layer 0 on stage 0, 1-3 on stage 1),
    # told to globalshard as Megatron assigns it, to and from an even one.
    dict(name="uneven_pp2_to_tp2", save=dict(tp=1, pp=2, first=1), load=dict(tp=2, pp=1), model=DENSE),
    dict(name="pp2_to_uneven_pp2_tied", save=dict(tp=1, pp=2), load=dict(tp=1, pp=2, first=3),
         model={**DENSE, "tied": True}),
    # Megatron's pipeline_model_parallel_layout: 3 layers then 1, and interleaved 1, 2 | 0, 1.
    dict(name="layout_3_1_to_vpp2", save=dict(tp=1, pp=2, pp_layout="Ettt|tL"), load=dict(tp=1, pp=2, vpp=2),
         model=DENSE),
    dict(name="tp2_to_layout_vpp2", save=dict(tp=2, pp=1), load=dict(tp=1, pp=2, vpp=2, pp_layout="Et|tt||tL"),
         model={**DENSE, "tied": True}),
    # Multi-token prediction (one MTP layer, on the last stage, which then holds the word embeddings
    # again): its layer numbered apart from the decoder's, the embeddings' copy a replica. (Tied
    # embeddings with MTP at PP > 1 fail in Megatron's own sharded_state_dict.)
    dict(name="mtp_pp2_to_tp2", save=dict(tp=1, pp=2), load=dict(tp=2, pp=1), model={**DENSE, "mtp": True}),
    dict(name="mtp_tp2_to_vpp2", save=dict(tp=2, pp=1), load=dict(tp=1, pp=2, vpp=2), model={**DENSE, "mtp": True}),
    dict(name="mtp_tied_tp2_to_tp1", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1),
         model={**DENSE, "mtp": True, "tied": True}),
]
# Megatron-Core's DistributedOptimizer (DDP wrapper, fp32 main params): DP traded for TP both ways.
DISTOPT = [
    dict(name="distopt_dp2_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1), model=DENSE, distopt=True),
    dict(name="distopt_tp2_to_dp2", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1), model=DENSE, distopt=True),
    # Experts in their own buffers and optimizer (a ChainedOptimizer), on the layout that saved them.
    dict(name="distopt_moe_ep2_same_layout", save=dict(tp=1, pp=1, ep=2), load=dict(tp=1, pp=1, ep=2),
         model={**DENSE, "experts": 4}, distopt=True),
    # bf16 parameters (Float16Module) with the optimizer's fp32 main copies, stored as "master".
    dict(name="distopt_bf16_dp2_to_tp2", save=dict(tp=1, pp=1), load=dict(tp=2, pp=1), model={**DENSE, "bf16": True},
         distopt=True),
    # A vocabulary of 60 padded to 64 at both TPs: the padding rows' Adam moments and main copies, which
    # Megatron's load keeps, carry over from TP=2 (the last 4 rows of rank 1) to TP=1.
    dict(name="distopt_padded_vocab_tp2_to_tp1", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1),
         model={**DENSE, "true_vocab": 60}, distopt=True),
]
# A MoE distributed optimizer traded between EP=2 (a dense and an expert optimizer, chained) and TP=2 (one
# optimizer, fewer param groups), which dist_checkpointing does not load across: a round trip through the
# other layout must give back the first run's state exactly.
ROUNDTRIPS = [
    dict(name="distopt_moe_ep2_via_tp2", save=dict(tp=1, pp=1, ep=2), load=dict(tp=2, pp=1),
         model={**DENSE, "experts": 4}, roundtrip=True),
    dict(name="distopt_moe_tp2_via_ep2", save=dict(tp=2, pp=1), load=dict(tp=1, pp=1, ep=2),
         model={**DENSE, "experts": 4}, roundtrip=True),
]
# A Megatron-Core Llama (RMSNorm, SwiGLU, rotary, GQA) exported to Hugging Face Llama, opened by
# transformers, and the export read back into another layout by load_hf; with qk_layernorm, a Qwen3.
LLAMA = {**DENSE, "llama": True}
EXPORTS = [
    dict(name="export_tp2_untied", save=dict(tp=2, pp=1), load=dict(tp=1, pp=2), model=LLAMA,
         export="megatron_gpt"),
    dict(name="export_pp2_tied", save=dict(tp=1, pp=2), load=dict(tp=2, pp=1), model={**LLAMA, "tied": True},
         export="megatron_gpt"),
    dict(name="export_qwen3_tp2", save=dict(tp=2, pp=1), load=dict(tp=1, pp=2), model={**LLAMA, "qk_norm": True},
         export="megatron_gpt_qwen3"),
    dict(name="export_qwen2_pp2", save=dict(tp=1, pp=2), load=dict(tp=2, pp=1), model={**LLAMA, "qkv_bias": True},
         export="megatron_gpt_qwen2"),
]
ARCHITECTURES = {"megatron_gpt": "LlamaForCausalLM", "megatron_gpt_qwen3": "Qwen3ForCausalLM",
                 "megatron_gpt_qwen2": "Qwen2ForCausalLM"}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return outcomes_by_case(2, "megatron_jobs:scenarios", str(tmp_path_factory.mktemp("megatron")),
                            CASES + EXPORTS + DISTOPT + ROUNDTRIPS)


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_every_tensor_equals_megatrons_own_load_and_the_logits_carry_over(outcomes, case):
    ranks = outcomes[case]
    for r in ranks:
        assert r["differ"] == [], f"tensors that differ from dist_checkpointing's load: {r['differ']}"
        assert r["tensors"] > 0 and r["unexpected"] == []
    before = held(ranks, "before")
    after = held(ranks, "after")
    assert np.max(np.abs(np.array(after) - np.array(before))) < 1e-5


@pytest.mark.parametrize("case", [c["name"] for c in EXPORTS])
def test_a_megatron_llama_exports_to_a_llama_transformers_runs_with_the_same_logits_and_back(outcomes, case):
    ranks = outcomes[case]
    export = next(c["export"] for c in EXPORTS if c["name"] == case)
    assert held(ranks, "architecture") == ARCHITECTURES[export]
    before = held(ranks, "before")
    exported = held(ranks, "exported")
    after = held(ranks, "after")
    before = np.array(before).reshape(-1, DENSE["vocab"])
    assert np.max(np.abs(np.array(exported).reshape(before.shape) - before)) < 1e-5
    assert np.max(np.abs(np.array(after).reshape(before.shape) - before)) < 1e-5


@pytest.mark.parametrize("case", [c["name"] for c in DISTOPT])
def test_a_distributed_optimizers_adam_state_reshards_as_dist_checkpointing_reshards_it(outcomes, case):
    for r in outcomes[case]:
        assert r["differ"] == [], f"differ from dist_checkpointing's load: {r['differ']}"
        assert r["tensors"] > 0 and r["unexpected"] == []
        assert r["masters"] == (r["tensors"] if "bf16" in case else 0)
        assert r["same_ranges"], "megatron_param_ranges differs from the DistributedOptimizer's own ranges"


@pytest.mark.parametrize("case", [c["name"] for c in ROUNDTRIPS])
def test_a_moe_distributed_optimizer_round_trips_through_another_ep(outcomes, case):
    for r in outcomes[case]:
        assert r["differ"] == [], f"differ from the first run after the round trip: {r['differ']}"
        assert r["tensors"] > 0
        assert r["lrs_between"] == [1e-2], "the other layout's param groups did not get the saved learning rate"
    chained = outcomes[case][0]["optimizers"]
    assert chained == ([2, 2] if "ep2_via" in case else [1, 1])


@pytest.mark.parametrize("tp,dp,pp,ep,etp", [(2, 4, 1, 2, 1), (2, 4, 2, 4, 2), (4, 2, 1, 2, 1), (2, 2, 1, 4, 1),
                                             (1, 8, 1, 2, 4), (4, 2, 2, 8, 1), (2, 2, 1, 1, 4)])
def test_every_ranks_expert_place_is_megatrons_own(tp, dp, pp, ep, etp):
    """Megatron-Core's own RankGenerators (its default order, the dense grid and
    the experts'), at layouts of up to 16 ranks: the expert TP, EP and expert
    DP rank of every rank equal ParallelLayout's, built from its dense ranks."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=tp * dp // (etp * ep), pp=pp, cp=1, order=order)

    def rank_in(gen, token):
        return {r: group.index(r) for group in gen.get_ranks(token) for r in group}

    t, d, p = rank_in(dense, "tp"), rank_in(dense, "dp"), rank_in(dense, "pp")
    et, e, ed = rank_in(experts, "tp"), rank_in(experts, "ep"), rank_in(experts, "dp")
    for r in range(tp * dp * pp):
        layout = gt.ParallelLayout(tp_rank=t[r], tp_size=tp, pp_rank=p[r], pp_size=pp, dp_rank=d[r], dp_size=dp,
                                   ep_size=ep, etp_size=etp, num_layers=pp)
        assert (layout.expert_tp_rank, layout.ep_rank, layout.expert_dp_rank) == (et[r], e[r], ed[r]), r
