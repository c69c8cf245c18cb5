"""The README's example runs as printed; the documented mapping example is a working mapping."""

import os
import re
import subprocess
import sys

from repo import ROOT

README = os.path.join(ROOT, "README.md")
CLI_DOC = os.path.join(ROOT, "docs", "cli.md")


def test_readme_example_runs(tmp_path):
    with open(README) as f:
        code = re.search(r"## Example\n\n```python\n(.*?)```", f.read(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ckpt" / "metadata.json").exists()
    assert "[[ 3.  4.]" in out.stdout


def test_the_documented_mapping_example_is_a_valid_mapping_that_merges_and_writes_a_config(tmp_path):
    import json

    import numpy as np

    import globalshard as gs
    from globalshard.hf import NameMapping, export

    with open(CLI_DOC) as f:
        doc = json.loads(re.search(r"```json\n(\{\"params\".*?)```", f.read(), re.S).group(1))
    mapping = NameMapping(doc)
    rng = np.random.default_rng(0)
    arrays = {"layers.0.attn.qkv.weight": rng.standard_normal((16, 4)).astype(np.float32),
              "layers.0.attn.qkv_lora_A": rng.standard_normal((2, 4)).astype(np.float32),
              "layers.0.attn.qkv_lora_B": rng.standard_normal((16, 2)).astype(np.float32),
              "final_norm": np.ones(4, np.float32), "optimizer.exp_avg.final_norm": np.ones(4, np.float32)}
    gs.save({k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,) * v.ndim)
             for k, v in arrays.items()}, str(tmp_path / "ckpt"))
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), mapping=mapping)
    assert out["merged"] == ["layers.0.attn.qkv_lora_A", "layers.0.attn.qkv_lora_B"]
    assert out["skipped"] == ["optimizer.exp_avg.final_norm"]
    assert out["config"] == {"model_type": "llama", "num_attention_heads": 8, "hidden_size": 4}
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == out["config"]
