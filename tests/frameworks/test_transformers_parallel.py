"""transformers' own distributed models as the oracle for DCP-style state: a
tiny random Qwen3-MoE (its experts' ``gate_up_proj`` packed, cut by its TP plan
as ``_StridedShard``) loaded by ``from_pretrained`` with a ``DistributedConfig``
at FSDP2 x TP = 2 x 2 on 4 gloo ranks, one AdamW step, saved with
``globalshard_torch.save``; then loaded at TP=2, at FSDP2 x EP = 2 x 2 and into
one process. Every model and optimizer tensor equals the trained one, and the
Hugging Face weights saved from one process load into each layout exactly as
``from_pretrained`` cuts them. The same at PP=2 (transformers' pipeline
stages: each rank holds its own layers as plain tensors)."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # from_pretrained with a DistributedConfig needs it

import torch  # noqa: E402
from ranks import run  # noqa: E402

import globalshard_torch as gt  # noqa: E402

KIND = "Qwen3MoeForCausalLM"
CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64, tie_word_embeddings=False)
LAYOUTS = {"tp2": ({"tp_size": 2}, 2), "fsdp2_ep2": ({"fsdp_size": 2, "ep_size": 2}, 2), "one_process": ({}, 1)}


@pytest.fixture(scope="module", params=["fsdp2_tp2", "pp2"])
def saved(tmp_path_factory, request):
    work = tmp_path_factory.mktemp("transformers_parallel")
    sizes = {"fsdp2_tp2": {"tp_size": 2, "fsdp_size": 2}, "pp2": {"pp_size": 2}}[request.param]
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG))
    model.save_pretrained(work / "hf")
    gt.save({"model": transformers.Qwen3MoeForCausalLM.from_pretrained(work / "hf").state_dict()},
            str(work / "initial"))
    args = dict(hf=str(work / "hf"), kind=KIND, path=str(work / "ckpt"), dump=str(work / "held"))
    ranks = run(4 if "fsdp_size" in sizes else 2, "transformers_jobs:train", str(work / "train"), sizes=sizes, **args)
    if "tp_size" in sizes:  # the packed gate_up_proj, as transformers cuts it
        assert "_StridedShard(dim=1, sf=2)" in str(ranks[0]["placements"])
    else:  # each stage holds its own layers, whole
        assert ranks[0]["placements"].keys().isdisjoint(k for k in ranks[1]["placements"] if "layers" in k)
    return work, args


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_transformers_parallel_moe_reloads_on_another_layout(saved, layout):
    work, args = saved
    sizes, world = LAYOUTS[layout]
    for r in run(world, "transformers_jobs:reload", str(work / layout), sizes=sizes, initial=str(work / "initial"),
                 **args):
        assert r["tensors"] == 25 * 4 and r["cut"] == 25  # 25 weights, each with 2 moments and a step
        assert r["differ"] == [] and r["unknown"] == []
        assert r["not_as_cut"] == []
