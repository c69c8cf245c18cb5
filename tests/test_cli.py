import os
import shutil
import subprocess
import sys

import globalshard as gs

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "spec", "examples", "checkpoint")


def run(*args):
    return subprocess.run([sys.executable, "-m", "globalshard.cli", *args], capture_output=True, text=True)


def test_inspect_lists_tensors():
    out = run("inspect", EXAMPLE)
    assert out.returncode == 0, out.stderr
    assert "layers.0.attention.qkv.weight" in out.stdout and "bfloat16" in out.stdout
    assert "6 tensors, 15 stored regions" in out.stdout


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
