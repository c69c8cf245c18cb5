"""The README's example runs as printed; the documented mapping example is a working mapping."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
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



JAX_NAMES = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devices = np.array(jax.devices())
    saved_on = NamedSharding(Mesh(devices, ("x",)), P("x"))
    loaded_on = NamedSharding(Mesh(devices[::-1], ("y",)), P(None, "y"))
    path, step = "ckpt", 7
    params = {"w": jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), saved_on)}
    opt_state = {"mu": {"w": jax.device_put(np.full((8, 4), 0.5, np.float32), saved_on)}, "count": 3}
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=loaded_on)
    abstract_params, abstract_opt_state = jax.tree.map(like, params), {"mu": jax.tree.map(like, opt_state["mu"]),
                                                                       "count": 0}
""")
JAX_CHECK = textwrap.dedent("""
    assert trainer_state == {"step": 7} and restored["opt_state"]["count"] == 3
    assert restored["params"]["w"].sharding == loaded_on
    assert np.array_equal(np.asarray(restored["params"]["w"]), np.arange(32.0).reshape(8, 4))
    assert np.array_equal(np.asarray(tree["params"]["w"]), np.arange(32.0).reshape(8, 4))  # no target
    assert tree["opt_state"]["count"] == 3 and type(tree["opt_state"]["count"]) is int
    assert shapes["params"]["w"] == jax.ShapeDtypeStruct((8, 4), np.float32, sharding=saved_on)
""")


def test_readme_jax_example_runs_with_its_names_defined(tmp_path):
    # The README's JAX lines as printed, after the names they use: a state saved on one mesh, loaded on another.
    with open(README) as f:
        code = re.search(r"## JAX\n\n```python\n(.*?)```", f.read(), re.S).group(1)
    out = subprocess.run([sys.executable, "-c", JAX_NAMES + code + JAX_CHECK], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.gloo
def test_readme_torch_example_runs_on_four_ranks_and_reshards(tmp_path):
    # The README's torch lines as printed (tests/readme_jobs.py defines their names): saved at TP=2 x PP=2,
    # loaded at TP=4, saved again from there: every stored value is where the first save put it.
    import numpy as np
    from torch_harness import run

    import globalshard as gs

    out = run(4, "readme_jobs:readme_torch_job", str(tmp_path / "ranks"), path=str(tmp_path / "ckpt"),
              again=str(tmp_path / "again"))
    assert all(o["ok"] for o in out), [o.get("trace", o) for o in out if not o["ok"]]
    values = [o["value"] for o in out]
    assert all(v["trainer_state"]["step"] == 100 and not v["missing"] and not v["unexpected"] for v in values)
    assert {tuple(v["lr"]) for v in values} == {(1e-2 * 0.9,)}
    first, again = gs.read_metadata(tmp_path / "ckpt"), gs.read_metadata(tmp_path / "again")
    assert set(first.tensors) == set(again.tensors) and len(first.tensors) == values[0]["keys"] > 24 * 5 * 3
    for key in first.tensors:
        a, b = gs.read_array(tmp_path / "ckpt", key), gs.read_array(tmp_path / "again", key)
        if gs.is_padding_key(key):  # 13 rows padded to 14 at TP=2, to 16 at TP=4: the trained row carries over
            assert a.shape == (1, 8) and b.shape == (3, 8) and np.array_equal(b, np.concatenate([a, 0 * b[1:]]))
            continue
        assert np.array_equal(a, b), key
