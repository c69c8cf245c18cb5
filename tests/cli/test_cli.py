import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from repo import SPEC

import globalshard as gs

EXAMPLE = os.path.join(SPEC, "examples", "checkpoint")


def run(*args):
    return subprocess.run([sys.executable, "-m", "globalshard.cli", *args], capture_output=True, text=True)


def test_inspect_lists_tensors():
    out = run("inspect", EXAMPLE)
    assert out.returncode == 0, out.stderr
    assert "layers.0.attention.qkv.weight" in out.stdout and "bfloat16" in out.stdout
    assert "6 tensors, 15 stored regions" in out.stdout


def test_inspect_shows_the_trainer_states_keys_one_level_down(tmp_path):
    # As the torch adapter stores a state dict's JSON values: under state_dict_values.
    w = gs.ShardedTensor.from_offset("w", np.ones(2, np.float32), global_shape=(2,), global_offset=(0,))
    gs.save({"w": w}, tmp_path / "c", trainer_state={"state_dict_values": {"step": 3, "lr_scheduler": {}},
                                                      "epochs": list(range(20)),
                                                      "many": {f"k{i:02d}": i for i in range(10)}})
    out = run("inspect", str(tmp_path / "c"))
    assert out.stdout.splitlines()[-1] == ("trainer_state.json: epochs, many {k00, k01, k02, k03, k04, k05, k06, "
                                           "k07, ... (10)}, state_dict_values {lr_scheduler, step}")


def test_verify_passes_then_catches_damage(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(EXAMPLE, ckpt)
    assert run("verify", str(ckpt)).returncode == 0
    region = gs.read_metadata(ckpt).tensors["layers.0.mlp.gate_up.weight"].regions[2].path
    chunk = ckpt / region / "c" / "0" / "0"
    data = chunk.read_bytes()
    chunk.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    out = run("verify", str(ckpt))
    assert out.returncode == 1
    assert "layers.0.mlp.gate_up.weight" in out.stderr and region in out.stderr


def test_not_a_checkpoint(tmp_path):
    out = run("inspect", str(tmp_path))
    assert out.returncode == 1 and "no metadata.json" in out.stderr
    assert "the save did not complete, or this is not the right path" in out.stderr


def test_a_path_that_is_not_a_checkpoint_is_told_what_it_holds(tmp_path):
    # A run's folder of step checkpoints (torchtitan's checkpoint/, a manager's directory): the steps to pass.
    run_dir = tmp_path / "checkpoint"
    for step in (5, 20):
        gs.save({"w": gs.ShardedTensor.from_offset("w", np.ones(2, np.float32), global_shape=(2,),
                                                   global_offset=(0,))}, run_dir / f"step-{step}")
    (run_dir / "step-30").mkdir()  # a save that never committed: not offered
    (run_dir / "logs").mkdir()
    out = run("verify", str(run_dir))
    assert out.returncode == 1 and "it holds checkpoints (step-20, step-5): pass one of them" in out.stderr
    out = run("inspect", str(run_dir / "step-20" / "metadata.json"))
    assert out.returncode == 1 and "it names the file itself: pass the directory" in out.stderr
    # Another library's checkpoint, by its own writer.
    from safetensors.numpy import save_file

    (tmp_path / "hf").mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "hf" / "model.safetensors"))
    out = run("inspect", str(tmp_path / "hf"))
    assert out.returncode == 1 and "safetensors files" in out.stderr and "load_hf" in out.stderr
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = run("inspect", str(tmp_path / "dcp"))
    assert out.returncode == 1 and "torch.distributed.checkpoint (DCP) checkpoint" in out.stderr


def test_every_verb_speaks_json():
    out = run("inspect", EXAMPLE, "--json")
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["tensors"]["embedding.weight"]["dtype"] == "bfloat16"
    assert doc["regions"] == 15
    out = run("verify", EXAMPLE, "--json", "--workers", "3")
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ok"] and doc["problems"] == [] and doc["bytes_read"] > 0


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("globalshard ")


def test_verify_json_reports_damage_with_exit_1(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(EXAMPLE, ckpt)
    region = gs.read_metadata(ckpt).tensors["layers.0.mlp.gate_up.weight"].regions[0].path
    chunk = ckpt / region / "c" / "0" / "0"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    out = run("verify", str(ckpt), "--json")
    doc = json.loads(out.stdout)
    assert out.returncode == 1 and not doc["ok"] and region in doc["problems"][0]


def save(path, arrays):
    gs.save({k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,) * v.ndim)
             for k, v in arrays.items()}, path)


def test_diff_names_keys_shapes_and_value_differences(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 40)).astype(np.float32)
    save(tmp_path / "a", {"w": w, "only_a": np.ones(2, np.int32), "s": np.ones((2, 3), np.float32),
                          "nan": np.array([np.nan, 1.0])})
    w2 = w.copy()
    w2[250, 7] += 0.5
    save(tmp_path / "b", {"w": w2, "only_b": np.ones(2, np.int32), "s": np.ones((3, 2), np.float32),
                          "nan": np.array([np.nan, 1.0])})
    out = run("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert doc["only_in_a"] == ["only_a"] and doc["only_in_b"] == ["only_b"]
    assert doc["dtype_or_shape"][0]["key"] == "s"
    values = {v["key"]: v for v in doc["values"]}
    assert values["nan"]["identical"] and values["nan"]["max_abs_diff"] == 0
    assert not values["w"]["identical"] and abs(values["w"]["max_abs_diff"] - 0.5) < 1e-6
    # Read chunk by chunk: a window far smaller than the tensor finds the same difference.
    import globalshard.cli as cli

    monkeypatch.setattr(cli, "DIFF_WINDOW_BYTES", 160)
    assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    same = run("diff", str(tmp_path / "a"), str(tmp_path / "a"))
    assert same.returncode == 0 and "same" in same.stdout
    assert run("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "1").returncode == 1  # keys still differ


def test_diff_of_a_missing_checkpoint_is_trouble_not_a_difference(tmp_path):
    save(tmp_path / "a", {"w": np.ones(3, np.float32)})
    out = run("diff", str(tmp_path / "a"), str(tmp_path / "nothing"))
    assert out.returncode == 3 and "no metadata.json" in out.stderr


def test_export_safetensors_from_the_command_line(tmp_path):
    from safetensors.numpy import load_file

    w = np.arange(60, dtype=np.float32).reshape(6, 10)
    save(tmp_path / "a", {"w": w, "b": np.ones(4, np.float32)})
    out = run("export", str(tmp_path / "a"), str(tmp_path / "hf"), "--format", "safetensors", "--max-shard-size",
              "100B", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["tensors"] == 2 and len(doc["files"]) == 2 and doc["skipped"] == []
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got = load_file(str(tmp_path / "hf" / index["weight_map"]["w"]))
    assert np.array_equal(got["w"], w)
    bad = run("export", str(tmp_path / "a"), str(tmp_path / "hf2"), "--map", "llama")
    assert bad.returncode == 2 and "match no rule" in bad.stderr
    bad = run("export", str(tmp_path / "a"), str(tmp_path / "hf2"), "--max-shard-size", "lots")
    assert bad.returncode == 2 and "not a size" in bad.stderr


def test_export_with_a_mapping_reports_merged_adapters_and_its_config_and_takes_number_params(tmp_path):
    mapping = {"params": {"heads": 2},
               "tensors": [{"key": "wq", "name": "q.weight", "rotary": "heads",
                            "lora": {"A": "wq_lora_A", "B": "wq_lora_B", "scale": "alpha"}}],
               "config": {"rope_theta": {"$param": "rope_theta"}, "heads": {"$param": "heads"},
                          "dtype": {"$dtype": "q.weight"}}}
    (tmp_path / "map.json").write_text(json.dumps(mapping))
    save(tmp_path / "a", {"wq": np.ones((8, 3), np.float32), "wq_lora_A": np.ones((1, 3), np.float32),
                          "wq_lora_B": np.ones((8, 1), np.float32)})
    out = run("export", str(tmp_path / "a"), str(tmp_path / "hf"), "--map", str(tmp_path / "map.json"),
              "--param", "rope_theta=5e5", "--param", "alpha=0.5", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["merged"] == ["wq_lora_A", "wq_lora_B"] and doc["config"] == "config.json"
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"rope_theta": 500000.0, "heads": 2,
                                                                          "dtype": "float32"}
    human = run("export", str(tmp_path / "a"), str(tmp_path / "hf"), "--map", str(tmp_path / "map.json"),
                "--param", "rope_theta=5e5", "--param", "alpha=0.5")
    assert "merged 2 adapter keys" in human.stdout and "wrote config.json" in human.stdout
    missing = run("export", str(tmp_path / "a"), str(tmp_path / "hf2"), "--map", str(tmp_path / "map.json"),
                  "--param", "alpha=1")
    assert missing.returncode == 2 and "--param rope_theta" in missing.stderr
    bad = run("export", str(tmp_path / "a"), str(tmp_path / "hf2"), "--param", "alpha=many")
    assert bad.returncode == 2 and "NAME=NUMBER" in bad.stderr


def test_kvstore_option(tmp_path):
    save(tmp_path / "root" / "run1", {"w": np.ones(3, np.float32)})
    out = run("inspect", "run1", "--kvstore", f"file://{tmp_path / 'root'}/", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tensors"]["w"]["global_shape"] == [3]
    spec = json.dumps({"driver": "file", "path": str(tmp_path / "root") + "/"})
    assert run("verify", "run1", "--kvstore", spec).returncode == 0


def test_copy_makes_a_checkpoint_that_stands_without_its_base(tmp_path):
    w = np.arange(8, dtype=np.float32)

    def state(a):
        return {k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,))
                for k, v in {"w": w, "a": a}.items()}

    gs.save(state(np.zeros(2, np.float32)), tmp_path / "run" / "step-1")
    gs.save(state(np.ones(2, np.float32)), tmp_path / "run" / "step-2", base=tmp_path / "run" / "step-1",
            frozen=["w"])
    out = run("copy", str(tmp_path / "run" / "step-2"), str(tmp_path / "alone"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["bytes"] == 40 and doc["bytes_from_bases"] == 32 and doc["bases"] == ["step-1"]
    shutil.rmtree(tmp_path / "run")
    assert run("verify", str(tmp_path / "alone")).returncode == 0
    assert np.array_equal(gs.read_array(tmp_path / "alone", "w"), w)
    again = run("copy", str(tmp_path / "alone"), str(tmp_path / "alone2"))
    assert again.returncode == 0 and "0.00 MiB of it from no base; it stands alone" in again.stdout
    refused = run("copy", str(tmp_path / "alone"), str(tmp_path / "alone2"))
    assert refused.returncode == 1 and "already holds a checkpoint" in refused.stderr
    # --drop: a release without what a pattern matches.
    out = run("copy", str(tmp_path / "alone"), str(tmp_path / "weights"), "--drop", "a", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["dropped"] == 1, out.stderr
    assert sorted(gs.read_metadata(tmp_path / "weights").tensors) == ["w"]
    out = run("copy", str(tmp_path / "alone"), str(tmp_path / "none"), "--drop", "optimizer.*")
    assert out.returncode == 1 and "drop 'optimizer.*' matches no key" in out.stderr
    assert not (tmp_path / "none" / "metadata.json").exists()


def test_usage_errors_exit_2(tmp_path):
    assert run("inspect").returncode == 2
    assert run("frobnicate", EXAMPLE).returncode == 2
    out = run("export", EXAMPLE, str(tmp_path / "out"), "--dtype", "fp8")
    assert out.returncode == 2 and "unknown dtype name 'fp8'; known: " in out.stderr and "float8_e4m3fn" in out.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_names_the_bases_and_their_bytes(tmp_path, capsys):
    from globalshard import cli

    w, a = np.ones((4, 4), np.float32), np.zeros(2, np.float32)
    state = {k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,) * v.ndim)
             for k, v in {"w": w, "a": a}.items()}
    gs.save(state, tmp_path / "s0")
    gs.save(state, tmp_path / "s1", base=tmp_path / "s0", frozen=["w"])
    assert cli.main(["inspect", str(tmp_path / "s1"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bases"] == [{"root": "s0", "save_id": gs.read_metadata(tmp_path / "s0").save_id, "bytes": 64}]
    assert doc["bytes_in_bases"] == 64 and doc["bytes"] == 72
    assert cli.main(["verify", str(tmp_path / "s1")]) == 0
