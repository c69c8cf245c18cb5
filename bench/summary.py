"""Collect the headline ratios of one ``make bench`` run into build/bench/report.json.

    .venv/bin/python bench/summary.py

Reads the JSON files the other bench scripts wrote in this run and adds, at
the top level of report.json, each figure under a fixed name (null where
its script did not run): ``save_vs_disk``, ``save_vs_dcp``,
``load_warm_vs_page_cache``, ``load_warm_vs_dcp``, ``load_cold_vs_disk``,
``load_cold_vs_dcp`` (bench/compare.py, higher is faster), ``read_amplification``
(bytes read / needed per rank, TP=4 -> 2 and across axes, bench/run.py),
``async_block_vs_memcpy`` (bench/io_memory.py, the second save), ``peak_rss_over_state``
(the larger of save and load: peak RSS rise / state), ``plan_4096_s`` (bench/run.py),
``load_cold_one_process_vs_disk`` and ``load_cold_one_process_vs_dcp`` (every target of a
cold load in one process, the worse of TP4->2 and TP4->1, bench/cold_load.py),
the training loop's figures (bench/training.py): ``step_time_async_process_vs_none``,
``step_time_async_thread_vs_none``, ``step_time_sync_vs_none`` (wall time per step with a
checkpoint every 4 steps over none), ``async_block_vs_memcpy`` (the time a process-mode save
blocks the loop over a memcpy of the state; this replaces bench/io_memory.py's figure of that
name), ``async_peak_rss_over_state`` (the peak host memory of the phases with saves, trainer,
pools and writer, over the trainer's own peak in the phases without, over the state),
``lora_save_bytes_over_adapter_bytes``, ``pretrain_save_bytes_saved_fraction``;
the fast tier's (bench/tiers.py): ``tier_local_save_vs_persistent_save`` (the time a save
stops training, into the nodes' tier over straight to S3), ``tier_async_save_vs_tier_save``
(the time an asynchronous save into the tiers stops training over a synchronous one),
``tier_recovery_vs_persistent_recovery``
(one node lost: recovery from the nearest copies over a load from S3),
``tier_persistent_bytes_over_lost_node_bytes``; ``replan_4096_s`` (one rank's planning of a
repeated save at 4,096 ranks, the cached plan reused, bench/run.py),
``shared_reads`` (time and group bytes read with shared reads over without, local warm and
cold and S3, bench/shared_reads.py), ``small_tensors_over_large`` (10,000 small tensors'
save and load time over the same bytes in 8, unpacked and with ``pack_below``, and the raw
packed file's projected load over the same, bench/small_tensors.py). Draws
build/bench/bench.png: throughput per system and the planning curve (matplotlib, from
``.[bench]``; skipped with a message when it is missing).
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


def plot(compare: dict[str, Any], report: dict[str, Any], path: str) -> None:
    """Throughput of each system per operation (GB/s of state), and planning time against ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    operations = [("save_s", "save TP=4"), ("load_tp2_warm_s", "load TP4->2 warm"),
                  ("load_tp2_cold_s", "load TP4->2 cold"), ("load_tp1_warm_s", "load TP4->1 warm")]
    gb = compare.get("state_bytes", 0) / 1e9
    raw = compare.get("raw", {})
    limits = {"save_s": raw.get("write_s"), "load_tp2_warm_s": raw.get("read_warm_s"),
              "load_tp2_cold_s": raw.get("read_cold_s")}
    systems = [("disk / page cache", limits)] + [(name, compare[key]) for key, name in
                                                 [("globalshard", "globalshard"), ("dcp", "torch DCP"),
                                                  ("orbax", "Orbax")] if key in compare]
    width = 0.8 / max(len(systems), 1)
    for i, (name, figures) in enumerate(systems):
        xs = [j + i * width for j in range(len(operations))]
        ys = [gb / figures[k] if figures.get(k) else 0.0 for k, _ in operations]
        left.bar(xs, ys, width, label=name)
    left.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(operations))],
                    [label for _, label in operations], fontsize=8)
    left.set_ylabel("GB/s of state")
    left.set_yscale("log")
    left.set_title(f"{compare.get('state_bytes', 0) / 2**30:.2f} GiB of float32 (median of runs)")
    left.legend(fontsize=8)
    curve = report.get("planning_curve") or []
    if curve:
        right.plot([c["ranks"] for c in curve], [c["save_plan_s"] for c in curve], "o-")
        right.set_xscale("log", base=2)
        right.set_yscale("log")
    right.set_xlabel("simulated ranks (1000 tensors each)")
    right.set_ylabel("save planning, s")
    right.set_title("planning in one process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    training = _read("training.json")
    report["async_block_vs_memcpy"] = training.get("async_block_vs_memcpy",
                                                   memory.get("async", {}).get("second_blocking_over_memcpy"))
    for key in ("step_time_async_process_vs_none", "step_time_async_thread_vs_none", "step_time_sync_vs_none",
                "async_peak_rss_over_state", "lora_save_bytes_over_adapter_bytes",
                "pretrain_save_bytes_saved_fraction"):
        report[key] = training.get(key)
    steps = [memory[s] for s in ("save", "load") if s in memory]
    report["peak_rss_over_state"] = max(s["peak_rise_bytes"] / s["state_bytes"] for s in steps) if steps else None
    report.setdefault("plan_4096_s", None)
    report.setdefault("replan_4096_s", None)
    tiers = _read("tiers.json")
    for key in ("tier_local_save_vs_persistent_save", "tier_async_save_vs_tier_save",
                "tier_recovery_vs_persistent_recovery", "tier_persistent_bytes_over_lost_node_bytes"):
        report[key] = tiers.get(key)
    cold = _read("cold_load.json")
    for key in ("load_cold_one_process_vs_disk", "load_cold_one_process_vs_dcp"):
        report[key] = cold.get(key)
    shared = _read("shared_reads.json")
    report["shared_reads"] = {name: {"shared_over_plain_seconds": shared[name]["shared_over_plain_seconds"],
                                     "shared_over_plain_bytes_read": shared[name]["shared_over_plain_bytes_read"]}
                              for name in ("local_warm", "local_cold", "s3") if name in shared} or None
    small = _read("small_tensors.json")
    report["small_tensors_over_large"] = {
        "save": small["file_small_over_large"]["save"], "load": small["file_small_over_large"]["load"],
        "packed_save": small["file_packed_over_large"]["save"], "packed_load": small["file_packed_over_large"]["load"],
        "raw_packed_bound_load": small["packed_prototype"]["projected_load_s"] / small["file_large"]["load_s"],
    } if "file_packed_over_large" in small else None
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    if compare:
        try:
            plot(compare, report, os.path.join(OUT, "bench.png"))
            print(f"plot: {os.path.join(OUT, 'bench.png')}")
        except ImportError:
            print("plot: matplotlib is not installed (pip install -e '.[bench]'), no bench.png")
    for key in ("save_vs_disk", "save_vs_dcp", "load_warm_vs_page_cache", "load_warm_vs_dcp", "load_cold_vs_disk",
                "load_cold_vs_dcp", "read_amplification", "async_block_vs_memcpy", "peak_rss_over_state",
                "plan_4096_s", "replan_4096_s", "step_time_async_process_vs_none", "step_time_async_thread_vs_none",
                "step_time_sync_vs_none", "async_peak_rss_over_state", "lora_save_bytes_over_adapter_bytes",
                "pretrain_save_bytes_saved_fraction", "tier_local_save_vs_persistent_save",
                "tier_async_save_vs_tier_save",
                "tier_recovery_vs_persistent_recovery", "tier_persistent_bytes_over_lost_node_bytes",
                "load_cold_one_process_vs_disk", "load_cold_one_process_vs_dcp",
                "shared_reads", "small_tensors_over_large"):
        print(f"{key}: {report[key]}")


if __name__ == "__main__":
    main()
