"""transformers as the oracle for Hugging Face checkpoints: a tiny random
LlamaForCausalLM (built from a LlamaConfig, nothing downloaded) written by
``save_pretrained`` in several shards, then ``load_hf`` into TP=1, TP=2 and
PP=2 layouts: the TP=1 model gives transformers' own logits on every
position, and every TP and PP piece equals the slice of the tensor
``from_pretrained`` loads."""

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import globalshard as gs  # noqa: E402
import globalshard_torch as gt  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64)
RULES = gt.ShardingRules([
    (r"model\.embed_tokens\.weight|lm_head\.weight", gt.VocabParallel(CONFIG["vocab_size"])),
    (r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight", gt.ColumnParallel()),
    (r".*\.(o_proj|down_proj)\.weight", gt.RowParallel()),
    (r".*norm\.weight", gt.Replicated()),
])
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from ones, so every tensor counts
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, max_shard_size="40KB", safe_serialization=True)
    assert len(list(path.glob("model-*.safetensors"))) > 2 and (path / "model.safetensors.index.json").exists()
    return path, transformers.LlamaForCausalLM.from_pretrained(path).eval()


def test_tp1_load_gives_transformers_logits_on_every_position(saved):
    path, reference = saved
    torch.manual_seed(1)
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    gt.load_hf(str(path), ours, gt.ParallelLayout(num_layers=4), RULES)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)


def test_a_model_built_on_the_meta_device_loads_its_state_dict_and_gives_the_logits(saved, tmp_path):
    # transformers' (and accelerate's) empty-weights path: the model built on the meta device, its state
    # dict loaded, then assigned. Before, gt.load returned with every tensor still on the meta device.
    # (DCP's own load of a meta state dict, the oracle: tests/torch_adapter, over gloo.)
    _, reference = saved
    gt.save(reference.state_dict(), tmp_path / "gs")
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    sd = empty.state_dict()
    assert gt.load(sd, tmp_path / "gs") == gt.LoadedKeys([], [])
    assert not any(t.is_meta for t in sd.values())
    empty.load_state_dict(sd, assign=True)
    empty.model.rotary_emb.to_empty(device="cpu")  # a buffer outside the state dict: made again, as on load
    empty.model.rotary_emb.__init__(empty.config)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    with torch.no_grad():
        assert torch.equal(empty(ids).logits, reference(ids).logits)


class Sharded(nn.Module):
    """This rank's tensors under the Hugging Face names, at local shapes."""

    def __init__(self, shapes):
        super().__init__()
        for name, shape in shapes.items():
            module = self
            *parents, leaf = name.split(".")
            for part in parents:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(torch.full(shape, float("nan"))))


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_every_tp_and_pp_piece_equals_the_slice_transformers_loads(saved, tp, pp):
    path, reference = saved
    full = dict(reference.named_parameters())
    per_stage = CONFIG["num_hidden_layers"] // pp
    unread = []  # each simulated rank loads alone here: what it left of the files
    for s in range(pp):
        for r in range(tp):
            layout = gt.ParallelLayout(tp_rank=r, tp_size=tp, pp_rank=s, pp_size=pp, num_layers=4)
            shapes = {}
            for name, p in full.items():
                if ".layers." in name:
                    index = int(name.split(".layers.")[1].split(".")[0])
                    if index // per_stage != s:
                        continue
                    name = name.replace(f".layers.{index}.", f".layers.{index - s * per_stage}.")
                shape = list(p.shape)
                if any(f"{c}." in name for c in COLUMN):
                    shape[0] //= tp
                elif "o_proj" in name or "down_proj" in name:
                    shape[1] //= tp
                shapes[name] = shape
            local = Sharded(shapes)
            unread.append(set(gt.load_hf(str(path), local, layout, RULES, strict=pp == 1)["unread"]))
            for name, p in local.named_parameters():
                gname = layout.global_name(name, 0)
                g = full[gname].detach()
                if p.shape[0] != g.shape[0]:
                    g = g[r * p.shape[0]:(r + 1) * p.shape[0]]
                elif p.ndim == 2 and p.shape[1] != g.shape[1]:
                    g = g[:, r * p.shape[1]:(r + 1) * p.shape[1]]
                assert torch.equal(p.detach(), g), (tp, pp, s, r, gname)
    assert set.intersection(*unread) == set()


def test_a_tensor_of_the_files_that_no_rank_reads_is_an_error_unless_allowed(saved):
    path, reference = saved
    # A model without lm_head (as if its embeddings were tied): the files' untied lm_head is read by nothing.
    headless = nn.Module()
    headless.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).model
    layout, rules = gt.ParallelLayout(num_layers=4), gt.ShardingRules([(".*", gt.Replicated())])
    with pytest.raises(gs.MismatchError, match=r"(?s)no rank's model reads.*'lm_head.weight'"):
        gt.load_hf(str(path), headless, layout, rules)
    assert gt.load_hf(str(path), headless, layout, rules, strict=False)["unread"] == ["lm_head.weight"]
    assert torch.equal(headless.model.norm.weight, reference.model.norm.weight)


# ----------------------------------------------------------------- the demo's Llama, exported


def test_the_demo_exported_with_its_adapter_merged_gives_its_logits_in_transformers(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt_trainer import Config, Topology, Trainer, run

    from globalshard.hf import NameMapping, export

    cfg = Config(total_steps=4)
    # Trained at TP=2 (LoRA and biases move away from their initial values), saved, loaded whole.
    run(cfg, Topology(tp=2), str(tmp_path / "job"), until=3, save=str(tmp_path / "ckpt"))
    trainer = Trainer(cfg, Topology(), 0)
    trainer.load(str(tmp_path / "ckpt"))
    lora_b = trainer.chunks[0].layers[0].attn.qkv_lora_B
    assert lora_b.abs().max() > 0  # the adapter matters: dropping it would change the logits
    mapping = NameMapping.load("llama", {"heads": cfg.heads, "kv_heads": cfg.kv_heads})
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)
    assert out["merged"] == sorted(f"layers.{i}.attn.qkv_lora_{x}" for i in range(cfg.layers) for x in "AB")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config | {"architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab, "hidden_size": cfg.hidden,
                     "num_hidden_layers": cfg.layers, "num_key_value_heads": cfg.kv_heads,
                     "tie_word_embeddings": True, "attention_bias": True} == config
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert model.config.head_dim == cfg.head_dim and model.config.num_attention_heads == cfg.heads
    ids = torch.randint(0, cfg.vocab, (3, cfg.seq), generator=torch.Generator().manual_seed(3))
    ours = trainer.logits(ids)
    with torch.no_grad():
        theirs = model(ids).logits
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max() < 1e-5, (theirs - ours).abs().max()
    # Without the adapter the model is another one: the comparison above can fail.
    for layer in trainer.chunks[0].layers:
        layer.attn.qkv_lora_B.data.zero_()
    assert (trainer.logits(ids) - theirs).abs().max() > 1e-3
