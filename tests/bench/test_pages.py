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
    pages.start("benchmarks", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "run.json"]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"] == "make bench" and run["cpus"] == os.cpu_count() and run["commit"]
    (tmp_path / "fuzz.json").write_text(json.dumps({"inputs": 3}))
    gathered = pages.gather("reliability", str(tmp_path))
    assert gathered["run"] == run and gathered["fuzz"] == {"inputs": 3}
