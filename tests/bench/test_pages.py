"""docs/benchmarks.md, the README's performance table and docs/reliability.md
are what bench/pages.py renders from the committed run data, never hand edits,
and every figure on them comes from that data."""

import copy
import json
import os
import sys

import pytest
from repo import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import pages


@pytest.mark.parametrize("kind", ["benchmarks", "reliability"])
def test_the_committed_pages_are_what_the_committed_data_renders(kind):
    assert pages.stale(kind) == [], "edit docs/data or rerun the benchmark, then bench/pages.py"


def test_a_hand_edit_of_a_page_is_caught(tmp_path, monkeypatch):
    page = tmp_path / "benchmarks.md"
    page.write_text(open(pages.PAGES["benchmarks"]).read().replace("| globalshard |", "| globalshard (fast) |"))
    monkeypatch.setitem(pages.PAGES, "benchmarks", str(page))
    assert "benchmarks.md" in " ".join(pages.stale("benchmarks"))


def test_every_figure_comes_from_the_data():
    data = pages.load_data("benchmarks")
    before = pages.render_benchmarks(data)
    changed = copy.deepcopy(data)
    changed["compare"]["globalshard"]["save_s"] = data["compare"]["state_bytes"] / 1e9 / 123.45  # 123.45 GB/s
    changed["compare"]["ratios"]["load_cold_vs_dcp"] = 9.87
    changed["report"]["plan_4096_s"] = 0.0123
    after = pages.render_benchmarks(changed)
    assert "123.45" not in before and "| globalshard | 123.45 |" in after
    assert "| `load_cold_vs_dcp` | cold load TP4->2 / DCP | 9.87 |" in after
    assert "| `plan_4096_s` | 0.012 |" in after
    assert "123.45" in pages.readme_table(changed)


def test_a_run_without_a_benchmark_says_so_rather_than_showing_old_figures():
    data = pages.load_data("benchmarks")
    del data["small_tensors"]
    text = pages.render_benchmarks(data)
    assert "## Many small tensors\n\n*Not in this run (bench/small_tensors.py did not write its JSON).*" in text


def test_start_records_the_commit_and_clears_an_earlier_run(tmp_path):
    (tmp_path / "compare.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("kept")
    pages.start("benchmarks", str(tmp_path), disk_needed=0)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "run.json"]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"] == "make bench" and run["cpus"] == os.cpu_count() and run["commit"]
    (tmp_path / "fuzz.json").write_text(json.dumps({"inputs": 3}))
    gathered = pages.gather("reliability", str(tmp_path))
    assert gathered["run"] == run and gathered["fuzz"] == {"inputs": 3}


def test_the_training_and_cold_load_sections_render_what_their_benchmarks_write():
    def phase(cost):
        return {"steps_s": [cost / 8] * 8, "blocking_s": [0.04], "memcpy_s": [0.05], "wait_s": 0.0, "cost_s": cost}

    training = {
        "model": {"layers": 8, "width": 2048, "batch": 512, "phase_steps": 8, "save_every": 4, "pairs": 3,
                  "state_bytes": 3 << 27, "threads": 2},
        # Seconds per step are medians over the pairs: 0.510 for the process mode's phases without saves.
        "runs": {m: {"pairs": [{"none": phase(c), m: phase(1.1 * c)} for c in (4.0, 4.08, 4.4)],
                     "threads": 1 if m == "process_spare" else 2}
                 for m in ("sync", "thread", "process", "process_spare", "raw", "raw_direct", "raw_chunked")},
        "memory_measure": "sampled somehow",
        "async_memory": {"host_with_saves": 1800 << 20, "training_with_saves": 1340 << 20,
                         "training_without": 1350 << 20, "pools": 384 << 20, "writer": 32 << 20},
        "pretrain_with_base": {"saved_fraction": 0.0012}, "lora": {"base_bytes": 1 << 30,
                                                                   "adapter_and_optimizer_bytes": 3 << 20,
                                                                   "written_over_adapter_bytes": 1.0037},
        "step_time_async_process_vs_none": 1.0123, "step_time_async_thread_vs_none": 1.0456,
        "step_time_sync_vs_none": 1.1789, "step_time_raw_writer_vs_none": 1.0234,
        "step_time_raw_unbuffered_writer_vs_none": 1.0678, "step_time_async_process_spare_core_vs_none": 1.0089,
        "step_time_raw_chunked_writer_vs_none": 1.0912,
        "background_cpu_s_per_save": {"process": 0.1712, "process_spare": 0.1834, "raw": 0.0312, "raw_direct": 0.0,
                                      "raw_chunked": 0.0987},
        "async_block_vs_memcpy": 0.8765, "async_peak_rss_over_state": 1.0571,
        "lora_save_bytes_over_adapter_bytes": 1.0037, "step_time_confidence": 0.95,
        "step_time_intervals": {"process": [0.9812, 1.0734], "raw_direct": [1.0011, 1.0923],
                                "raw_chunked": [1.0456, 1.1012]}}
    cold = {"state_bytes": 1 << 30, "tensors": 72, "disk_threads": 4, "rounds": [{}, {}, {}],
            "cases": [{"load": "TP=4 -> 2, one process", "globalshard_gbs": 1.23, "dcp_gbs": 0.45, "disk_gbs": 1.34,
                       "globalshard_vs_disk": 0.917, "globalshard_vs_dcp": 2.71},
                      {"load": "TP=4 -> 1, one process", "globalshard_gbs": 1.2, "dcp_gbs": 0.9, "disk_gbs": 1.34,
                       "globalshard_vs_disk": 0.9, "globalshard_vs_dcp": 1.333,
                       "globalshard_vs_dcp_range": [0.91, 1.756]}]}
    tiers = {"nodes": 4, "ranks_per_node": 2, "replicas": 1, "state_bytes": 128 << 20,
             "rounds": [{"tier_save_s": 0.4, "plain_save_s": 2.0, "tier_load_s": 0.5, "plain_load_s": 1.5}],
             "tier_local_save_vs_persistent_save": 0.2012, "tier_recovery_vs_persistent_recovery": 0.3345,
             "tier_persistent_bytes_over_lost_node_bytes": 0.0}
    data = {**pages.load_data("benchmarks"), "training": training, "cold_load": cold, "tiers": tiers}
    text = pages.render_benchmarks(data)
    tier_part = text.split("## The fast tier")[1].split("\n## ")[0]
    assert "| a save stops training | 0.40 | 2.00 | 0.20 |" in tier_part
    assert "| recovery with one node lost | 0.50 | 1.50 | 0.33 |" in tier_part
    assert "0.20x as long as one straight to S3" in pages.readme_table(data)
    training_part = text.split("## Checkpointing a training loop")[1].split("\n## ")[0]
    for figure in ("1.01", "1.05", "1.18", "0.88x a memcpy", "1.06x", "0.1%", "1.00x the bytes", "3 MiB",
                   "| no checkpoints | 0.510 | 1.00 |  | 3 |  |",
                   "| AsyncSaver, process mode | 0.561 | 1.01 | 0.98-1.07 | 3 | 0.17 |",
                   "| AsyncSaver, process mode, torch on 1 thread(s): a core left to the writer | 0.561 | 1.01 "
                   "|  | 3 | 0.18 |",
                   "| synchronous saves | 0.561 | 1.18 |  | 3 |  |",
                   "| a bare process writing the same bytes unbuffered | 0.561 | 1.07 | 1.00-1.09 | 3 | 0.00 |",
                   "(sampled somehow)", "at least 95% confidence",
                   "| a bare process writing the same bytes | 0.561 | 1.02 |",
                   "| a bare process writing the same bytes unbuffered | 0.561 | 1.07 |",
                   "| a bare process writing the same bytes unbuffered in checksummed chunks | 0.561 | 1.09 | "
                   "1.05-1.10 | 3 | 0.10 |",
                   "phases with saves (1800 MiB)", "phases without (1350 MiB), 66 MiB more than the state's 384 MiB",
                   "staging pool (384 MiB)",
                   "own memory (32 MiB)", "10 MiB lower"):
        assert figure in training_part, figure
    assert "| 1.01x (95% interval 0.98-1.07) | 1.01x | 1.02x / 1.07x / 1.09x |" in pages.readme_table(data)
    # A run from before the chunked bare writer existed still renders, saying so.
    older = {**training, "runs": {m: r for m, r in training["runs"].items() if m != "raw_chunked"}}
    del older["step_time_raw_chunked_writer_vs_none"]
    assert "| 1.02x / 1.07x / not measured |" in pages.readme_table({**data, "training": older})
    cold_part = text.split("## Cold loads in one process")[1].split("\n## ")[0]
    assert "| TP=4 -> 2, one process | 1.23 | 0.45 | 1.34 | 0.92 | 2.71 |" in cold_part
    assert "| TP=4 -> 1, one process | 1.20 | 0.90 | 1.34 | 0.90 | 1.33 (0.91-1.76) |" in cold_part


def test_a_bench_run_refuses_to_start_without_the_disk_space_it_fills(tmp_path):
    """make bench keeps what each benchmark writes until it ends: it checks
    the free space up front instead of failing half an hour in (it once did,
    at 25 GB free), and starts nothing then."""
    import shutil

    free = shutil.disk_usage(tmp_path).free
    (tmp_path / "compare.json").write_text("{}")
    with pytest.raises(SystemExit, match=f"the disk of {tmp_path} has .* GiB free: free some space first"):
        pages.start("benchmarks", str(tmp_path), disk_needed=free + (1 << 30))
    assert sorted(os.listdir(tmp_path)) == ["compare.json"]  # an earlier run's JSON stays, no run.json
