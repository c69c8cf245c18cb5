"""Collect the headline ratios of one ``make bench`` run into build/bench/report.json.

    .venv/bin/python bench/summary.py

Reads the JSON files the other bench scripts wrote in this run and adds, at
the top level of report.json, each figure under a fixed name (null where
its script did not run): ``save_vs_disk``, ``save_vs_dcp``,
``load_warm_vs_page_cache``, ``load_warm_vs_dcp``, ``load_cold_vs_disk``,
``load_cold_vs_dcp`` (bench/compare.py, higher is faster), ``read_amplification``
(bytes read / needed per rank, TP=4 -> 2 and across axes, bench/run.py),
``async_block_vs_memcpy`` (bench/io_memory.py, the second save), ``peak_rss_over_state``
(the larger of save and load: peak RSS rise / state), ``plan_4096_s`` (bench/run.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

OUT = os.path.join("build", "bench")


def _read(name: str) -> dict[str, Any]:
    try:
        with open(os.path.join(OUT, name)) as f:
            return dict(json.load(f))
    except FileNotFoundError:
        return {}


def main() -> None:
    report, compare, memory = _read("report.json"), _read("compare.json"), _read("io_memory.json")
    ratios = compare.get("ratios", {})
    for key in ("save_vs_disk", "save_vs_dcp", "load_warm_vs_page_cache", "load_warm_vs_dcp", "load_cold_vs_disk",
                "load_cold_vs_dcp"):
        report[key] = ratios.get(key)
    loads = {row["load"]: row["read_over_needed"] for c in report.get("io", {}).get("chunks", [])
             if c.get("chunk_mib") == 1 for row in c["loads"]}
    report["read_amplification"] = {"tp4_to_2": loads.get("TP=4 -> 2"), "tp4_to_3": loads.get("TP=4 -> 3 (uneven)"),
                                    "other_axis": loads.get("TP=4, cut on the other axis")} if loads else None
    report["async_block_vs_memcpy"] = memory.get("async", {}).get("second_blocking_over_memcpy")
    steps = [memory[s] for s in ("save", "load") if s in memory]
    report["peak_rss_over_state"] = max(s["peak_rise_bytes"] / s["state_bytes"] for s in steps) if steps else None
    report.setdefault("plan_4096_s", None)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    for key in ("save_vs_disk", "save_vs_dcp", "load_warm_vs_page_cache", "load_warm_vs_dcp", "load_cold_vs_disk",
                "load_cold_vs_dcp", "read_amplification", "async_block_vs_memcpy", "peak_rss_over_state",
                "plan_4096_s"):
        print(f"{key}: {report[key]}")


if __name__ == "__main__":
    main()
