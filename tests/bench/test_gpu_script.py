"""bench/gpu.py is a short script for the first machine with a GPU: it runs
its steps end to end (here on CPU tensors, --cpu), and without CUDA it says
so and writes a skipped report rather than fail."""

import json
import os
import subprocess
import sys

import pytest
import torch
from repo import ROOT

SCRIPT = os.path.join(ROOT, "bench", "gpu.py")


def test_its_steps_run_end_to_end_and_write_one_json(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, SCRIPT, str(out), "--cpu"], check=True, capture_output=True, text=True,
                   cwd=ROOT, timeout=300)
    report = json.loads(out.read_text())
    assert set(report) >= {"staging", "async_save", "load_to_gpu", "state_bytes", "training_loop",
                           "step_time_async_process_vs_none", "step_time_async_thread_vs_none"}
    assert report["async_save"]["mode"] == "process" and report["load_to_gpu"]["gbs"] > 0
    for mode in ("process", "thread"):  # the training loop ran its pairs with saves in each mode
        loop = report["training_loop"][mode]
        assert loop["mode"] == mode and len(loop["ratios"]) == 2 and loop["save_every"] >= 4
        assert report[f"step_time_async_{mode}_vs_none"] == loop["ratio"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script measures it instead")
def test_without_cuda_it_says_so_and_writes_a_skipped_report(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, SCRIPT, str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "no CUDA device" in done.stdout
    assert json.loads(out.read_text()) == {"skipped": "no CUDA device"}
