"""docs/benchmarks.md, the README's performance table and docs/reliability.md,
written from the JSON of one ``make bench`` or ``make reliability`` run.

    .venv/bin/python bench/pages.py benchmarks    # after make bench: build/bench/*.json
    .venv/bin/python bench/pages.py reliability   # after make reliability: build/reliability/*.json
    .venv/bin/python bench/pages.py check         # the pages are what the committed data renders
    .venv/bin/python bench/pages.py start KIND    # make bench and make reliability call it first
    .venv/bin/python bench/pages.py render        # after a change of this file: the pages from docs/data

A run's JSON is gathered into ``docs/data/benchmarks.json`` (or
``reliability.json``) with the commit and machine it ran on, and the pages are
rendered from that file alone, so no figure on them is typed by hand and a
test (tests/e2e/test_pages.py) holds the committed pages to the committed
data. The prose here says how each figure is measured; every number comes
from the data.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "data")
PAGES = {"benchmarks": os.path.join(ROOT, "docs", "benchmarks.md"),
         "reliability": os.path.join(ROOT, "docs", "reliability.md")}
README = os.path.join(ROOT, "README.md")
#: The disk space a ``make bench`` run needs free when it starts, after its
#: virtual environment is installed: the disk's use, sampled every 2 s through
#: a whole run at 0e3e8c9 (build/ and the temporary directory on one disk),
#: rose by 37.7 GiB at its peak, 2.0 GiB of it the environment; and room to spare.
BENCH_DISK_BYTES = 40 << 30
#: The make target of each kind of run, and the folder its JSON goes to.
COMMANDS = {"benchmarks": "bench", "reliability": "reliability"}
BUILD = {"benchmarks": os.path.join(ROOT, "build", "bench"), "reliability": os.path.join(ROOT, "build", "reliability")}
#: The README's performance table lies between these two lines.
README_BEGIN, README_END = "<!-- benchmarks: begin (bench/pages.py) -->", "<!-- benchmarks: end -->"
GENERATED = "<!-- Written by bench/pages.py from {data}; run {command} to renew it, do not edit by hand. -->"

Data = dict[str, Any]


# ----------------------------------------------------------------------- gathering a run


def _run_info(command: str) -> dict[str, Any]:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip()

    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
            "command": command}


def start(kind: str, build: str, disk_needed: int | None = None) -> None:
    """Record the commit and machine a run starts on (``build/<kind>/run.json``), and
    remove an earlier run's JSON so that a page never mixes two runs. A ``make
    bench`` run first checks that the disk holds what it writes
    (``disk_needed`` bytes; by default :data:`BENCH_DISK_BYTES`), rather than
    fail for want of space half an hour in."""
    need = disk_needed if disk_needed is not None else BENCH_DISK_BYTES if kind == "benchmarks" else 0
    os.makedirs(build, exist_ok=True)
    for where in dict.fromkeys([build, tempfile.gettempdir()]):
        free = shutil.disk_usage(where).free
        if free < need:
            raise SystemExit(f"make {COMMANDS[kind]} writes up to {need / 2**30:.0f} GiB before it deletes "
                             f"anything (nothing is deleted until each benchmark ends: deletions slow this kind "
                             f"of disk's writes), but the disk of {where} has {free / 2**30:.1f} GiB free: free "
                             "some space first")
    for name in os.listdir(build):
        if name.endswith(".json"):
            os.remove(os.path.join(build, name))
    with open(os.path.join(build, "run.json"), "w") as f:
        json.dump(_run_info(f"make {COMMANDS[kind]}"), f, indent=1)


def gather(kind: str, build: str) -> Data:
    """Every JSON file a run wrote under ``build``, by file name; ``run`` is the
    commit and machine it started on (:func:`start`), or, if it was not recorded,
    the ones it ends on."""
    files: Data = {}
    for name in sorted(os.listdir(build)) if os.path.isdir(build) else []:
        if name.endswith(".json"):
            with open(os.path.join(build, name)) as f:
                files[name[:-len(".json")]] = json.load(f)
    if not files:
        raise SystemExit(f"pages: no JSON under {build}: run `make {COMMANDS[kind]}` first")
    files.setdefault("run", _run_info(f"make {COMMANDS[kind]}"))
    return files


# ----------------------------------------------------------------------- formatting


def num(x: float | None, digits: int = 2) -> str:
    """A figure with ``digits`` decimals; an em dash where the run has none."""
    return "—" if x is None else f"{x:.{digits}f}"


def span(values: Iterable[float], digits: int = 2) -> str:
    """``lo-hi`` of a run's rounds, or the one value."""
    vs = sorted(values)
    if not vs:
        return "—"
    lo, hi = num(vs[0], digits), num(vs[-1], digits)
    return lo if lo == hi else f"{lo}-{hi}"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _missing(what: str) -> str:
    return f"*Not in this run ({what} did not write its JSON).*"


# ----------------------------------------------------------------------- benchmarks.md


def _compare_rows(c: Data) -> list[list[str]]:
    gb = c["state_bytes"] / 1e9

    def rate(figures: Data, key: str) -> str:
        return num(gb / figures[key]) if figures.get(key) else ""

    raw = c["raw"]
    rows = [["disk (4 processes, write+fsync) / page cache (4 threads)", rate(raw, "write_s"),
             rate(raw, "read_warm_s"), rate(raw, "read_cold_s"), ""]]
    systems = [("globalshard", c["globalshard"]), ("torch DCP", c["dcp"])]
    if "orbax" in c:
        systems.append(("Orbax (jax, 4 CPU devices)", c["orbax"]))
        if "globalshard_jax" in c["orbax"]:
            systems.append(("globalshard_jax (same jax arrays)", c["orbax"]["globalshard_jax"]))
    rows += [[name, rate(f, "save_s"), rate(f, "load_tp2_warm_s"), rate(f, "load_tp2_cold_s"),
              rate(f, "load_tp1_warm_s")] for name, f in systems]
    return rows


COMPARE_HEADER = ["", "save TP=4", "load TP4->2 warm", "load TP4->2 cold", "load TP4->1 warm"]


def _round_ratios(c: Data, other: str, theirs: str, ours: str) -> list[float]:
    return [o[theirs] / g[ours] for o, g in zip(c["rounds"][other], c["rounds"]["globalshard"])]


def section_compare(d: Data) -> str:
    c = d.get("compare")
    if c is None:
        return "## Against the disk, torch DCP and Orbax\n\n" + _missing("bench/compare.py")
    r = c["ratios"]
    rounds = len(c["rounds"]["globalshard"])
    lines = [
        "## Against the disk, torch DCP and Orbax",
        "",
        f"`bench/compare.py`: {gib(c['state_bytes'])} GiB of float32 in 8 matrices sharded on rows, saved at "
        "TP=4, loaded at TP=2 and TP=1, warm and cold (pages evicted with `posix_fadvise`). globalshard and "
        "DCP run as 4 (then 2, 1) gloo processes on DTensors through `globalshard_torch.save/load` and "
        "`torch.distributed.checkpoint.save/load`; Orbax (`StandardCheckpointer`) and `globalshard_jax` as "
        "one jax process with 4 forced CPU devices, on the same jax arrays, once each after the rounds. "
        "globalshard verifies a crc32c on every byte it reads. The physical limits are 4 fresh processes "
        "writing the same rows with fsync, and 4 threads reading the files back into touched buffers.",
        "",
        f"This machine's disk is a virtual disk whose write speed jumps from minute to minute, so the disk, "
        f"globalshard and DCP take turns within each of {rounds} rounds, every timed step starts from a quiet "
        "disk (`os.sync()`, then no I/O for 0.3 s), nothing is deleted until the run ends, and each ratio is the "
        "median of the rounds' own ratios. Compare ratios within a table, not figures across runs.",
        "",
        f"GB/s of state, median of {rounds} rounds:",
        "",
        table(COMPARE_HEADER, _compare_rows(c)),
        "",
        "Ratios (above 1: globalshard took less time), median of the rounds' ratios, with the rounds' range:",
        "",
    ]
    named = [("save_vs_disk", "save / the raw write", ("raw", "write_s", "save_s")),
             ("save_vs_dcp", "save / DCP's save", ("dcp", "save_s", "save_s")),
             ("load_warm_vs_page_cache", "warm load TP4->2 / the page cache",
              ("raw", "read_warm_s", "load_tp2_warm_s")),
             ("load_warm_vs_dcp", "warm load TP4->2 / DCP", ("dcp", "load_tp2_warm_s", "load_tp2_warm_s")),
             ("load_tp1_warm_vs_dcp", "warm load TP4->1 / DCP", ("dcp", "load_tp1_warm_s", "load_tp1_warm_s")),
             ("load_cold_vs_disk", "cold load TP4->2 / the disk", ("raw", "read_cold_s", "load_tp2_cold_s")),
             ("load_cold_vs_dcp", "cold load TP4->2 / DCP", ("dcp", "load_tp2_cold_s", "load_tp2_cold_s"))]
    rows = [[f"`{key}`", label, num(r.get(key)), span(_round_ratios(c, *how))] for key, label, how in named
            if key in r]
    rows += [[f"`{key}`", key.replace("_", " "), num(r[key]), "one run"] for key in
             ("save_vs_orbax", "load_warm_vs_orbax", "load_cold_vs_orbax", "jax_save_vs_orbax",
              "jax_load_warm_vs_orbax") if key in r]
    lines += [table(["name", "ratio", "median", "rounds"], rows)]
    if c.get("size_curve"):
        lines += ["", "Linear in the state's size (each size in its own rounds, with the raw 4-process write of "
                  "the same bytes; each rank holds only its own rows; medians):", ""]
        curve = c["size_curve"]
        lines += [table(["state GiB", *[gib(s["bytes"]) for s in curve]], [
            ["save TP=4, GB/s", *[num(s["bytes"] / 1e9 / s["save_s"]) for s in curve]],
            ["raw write+fsync of the same bytes, s", *[num(s["raw_write_s"]) for s in curve]],
            ["save time / raw write time", *[num(s["save_over_raw"]) for s in curve]],
            ["load TP4->2 warm, GB/s", *[num(s["bytes"] / 1e9 / s["load_tp2_warm_s"]) for s in curve]],
        ])]
    return "\n".join(lines)


def section_cold_one_process(d: Data) -> str:
    c = d.get("cold_load")
    if c is None:
        return "## Cold loads in one process\n\n" + _missing("bench/cold_load.py")
    def spread(case: dict[str, Any]) -> str:
        low_high = case.get("globalshard_vs_dcp_range")  # runs before 2026-12-04 did not record it
        return f" ({span(low_high)})" if low_high else ""

    rows = [[case["load"], num(case["globalshard_gbs"]), num(case["dcp_gbs"]), num(case["disk_gbs"]),
             num(case["globalshard_vs_disk"]), num(case["globalshard_vs_dcp"]) + spread(case)] for case in c["cases"]]
    return "\n".join([
        "## Cold loads in one process",
        "",
        f"`bench/cold_load.py`: {gib(c['state_bytes'])} GiB of float32 in {c['tensors']} tensors saved at TP=4, "
        "loaded at TP=2 and TP=1 with every target in one process (as an export, an evaluation or a TP=1 resume "
        "does), the files evicted from the page cache before each load. DCP loads its own TP=4 checkpoint of "
        f"the same state with as many processes as the new layout has ranks; the disk is a plain "
        f"{c['disk_threads']}-thread read of globalshard's files. The loads take turns, in the reverse order "
        f"every other round (this disk's speed drifts). GB/s of state, median of {len(c['rounds'])} rounds; "
        "ratios the median of the rounds' ratios (globalshard / DCP: their range beside it):",
        "",
        table(["load", "globalshard", "DCP", "disk", "globalshard / disk", "globalshard / DCP"], rows),
    ])


def _memory_parts(m: dict[str, int], state: int) -> str:
    """What the peak of a loop's phases with saves holds beyond the trainer's own peak without them."""
    moved = (m["training_with_saves"] - m["training_without"]) / 2**20
    over = (m["host_with_saves"] - m["training_without"] - state) / 2**20
    return (f"the largest peak over the phases with saves ({mib(m['host_with_saves'])} MiB) over the trainer's own "
            f"largest peak over the phases without ({mib(m['training_without'])} MiB), {num(over, 0)} MiB more than "
            f"the state's {mib(state)} MiB. It holds the staging pool "
            f"({mib(m['pools'])} MiB) and the writer process's own memory ({mib(m['writer'])} MiB); the trainer's "
            + ("own peak was the same in both. " if round(moved) == 0 else
               f"own peak was {num(abs(moved), 0)} MiB {'higher' if moved > 0 else 'lower'} in the phases with saves. ")
            + "(The loop's own peak drifts by tens of MiB from phase to phase, so it is compared with the phases "
            "beside it, not with its first steps.)")


def _threads(runs: dict[str, Any], mode: str) -> str:
    return str(runs[mode].get("threads", "?")) if mode in runs else "?"


def section_training(d: Data) -> str:
    t = d.get("training")
    if t is None:
        return "## Checkpointing a training loop\n\n" + _missing("bench/training.py")
    m, runs = t["model"], t["runs"]

    def per_step(mode: str) -> float:
        run = runs["process" if mode == "none" else mode]  # "none": the phases beside the process mode's
        return float(statistics.median(p[mode]["cost_s"] / m["phase_steps"] for p in run["pairs"]))

    cpu = t.get("background_cpu_s_per_save", {})

    def background(mode: str) -> str:
        return num(cpu[mode], 2) if cpu.get(mode) is not None else ""

    intervals = t.get("step_time_intervals", {})

    def interval(mode: str) -> str:
        return span(intervals[mode]) if mode in intervals else ""

    def pairs(mode: str) -> str:
        return str(len(runs["process" if mode == "none" else mode]["pairs"]))

    rows = [[label, num(per_step(mode), 3), "1.00" if mode == "none" else num(t[f"step_time_{key}_vs_none"]),
             interval(mode), pairs(mode), background(mode)]
            for mode, key, label in (("none", "", "no checkpoints"), ("sync", "sync", "synchronous saves"),
                                     ("thread", "async_thread", "AsyncSaver, thread mode"),
                                     ("process", "async_process", "AsyncSaver, process mode"),
                                     ("process_spare", "async_process_spare_core",
                                      f"AsyncSaver, process mode, torch on {_threads(runs, 'process_spare')} "
                                      "thread(s): a core left to the writer"),
                                     ("raw", "raw_writer", "a bare process writing the same bytes"),
                                     ("raw_direct", "raw_unbuffered_writer",
                                      "a bare process writing the same bytes unbuffered"),
                                     ("raw_chunked", "raw_chunked_writer",
                                      "a bare process writing the same bytes unbuffered in checksummed chunks"))
            if mode == "none" or mode in runs]
    lora, pre = t["lora"], t["pretrain_with_base"]
    memory = t["memory_measure"]
    return "\n".join([
        "## Checkpointing a training loop",
        "",
        f"`bench/training.py`: {m['layers']} linear layers of {m['width']} x {m['width']} float32 trained with AdamW "
        f"({mib(m['state_bytes'])} MiB of weights and moments) by torch on {m['threads']} threads, batch "
        f"{m['batch']}. Each mode runs in a process of its own that alternates phases of {m['phase_steps']} steps "
        f"with a `save_checkpoint` every {m['save_every']} steps and phases of {m['phase_steps']} steps without, "
        "in pairs (the order alternating; how many: the table's last but one column), after a first save "
        "that starts the writer and sizes the staging pool. A phase's cost is its wall time (its steps, the "
        "time its saves block the loop, and the wait for its last save's background part); seconds per step "
        "are medians over the pairs, and each ratio the median over the pairs of the phase with checkpoints "
        "over the phase without it beside it, with the interval that holds the true median with at least "
        f"{100 * t.get('step_time_confidence', 0.95):.0f}% confidence whatever the pairs' distribution (two of "
        "the sorted pair ratios: `median_interval`). The process mode, whose ratio the target is, and the bare "
        "unbuffered writer, its floor, run more pairs:",
        "",
        table(["", "s per step", "over none", "95% interval", "pairs", "background CPU s per save"], rows),
        "",
        "The background CPU is the user and system time of the writer process (or bare process) over the "
        "phases with saves, per save: on a loop that keeps every core busy, the training loses about that "
        "much. With torch on one core fewer, the phases without saves are slower too, and the ratio is "
        "taken against them.",
        "",
        "The bare processes are forked by the loop and write the state's bytes, copied into shared memory at each "
        "save, to one file with `write` (64 MiB at a time) and `fsync`: no format, no checksums, no commit; "
        "the second with `O_DIRECT`, from the shared memory's pages to the disk, as the AsyncSaver's writer "
        "writes its shards (`globalshard/io/localio/unbuffered.py`). Any background writer runs on the cores "
        "this loop keeps busy, and a buffered one's pages are written back and reclaimed by the kernel there "
        "too; the unbuffered bare writer is the cost of writing the bytes at all. The third does, besides, the "
        "work the format asks of any writer of these tensors and nothing more: it cuts each tensor into its "
        "stored inner chunks (512 x 512 for a whole 2048 x 2048 float32), copies each into an aligned buffer and "
        "appends its crc32c, in one thread, to one file, without directories or a commit: the floor of a "
        "checksummed, chunked writer on this loop.",
        "",
        f"A process-mode save blocked the loop {num(t['async_block_vs_memcpy'])}x a memcpy of the state into a warm "
        "buffer (median over the saves after the first, which starts the writer and sizes the staging pool). "
        f"Its saves raised the peak host memory ({memory}) by {num(t['async_peak_rss_over_state'])}x "
        f"the state: {_memory_parts(t['async_memory'], m['state_bytes'])}",
        "",
        f"Full training with `base=` the previous save (every region hashed): the saves left "
        f"{num(100 * pre['saved_fraction'], 1)}% of the state's bytes unwritten, since every weight and both moments "
        "change every step: a base saves nothing there.",
        "",
        f"A LoRA fine-tune of a frozen base of {gib(lora['base_bytes'])} GiB: once the base is saved, each save with "
        f"`frozen=[\"base.*\"]` wrote {num(lora['written_over_adapter_bytes'])}x the bytes of the adapters and their "
        f"optimizer state ({mib(lora['adapter_and_optimizer_bytes'])} MiB).",
    ])


def section_tiers(d: Data) -> str:
    t = d.get("tiers")
    if t is None:
        return "## The fast tier\n\n" + _missing("bench/tiers.py")
    rounds = t["rounds"]

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in rounds))

    background = "tier_async_save_s" in rounds[0]  # measured since the tiers took a saver
    rows = [["a save stops training", num(med("tier_save_s")), num(med("plain_save_s")),
             num(t["tier_local_save_vs_persistent_save"])]]
    if background:
        rows.append(["an asynchronous save stops training (ratio: over the row above's TieredManager)",
                     num(med("tier_async_save_s")), "", num(t["tier_async_save_vs_tier_save"])])
    rows.append(["recovery with one node lost", num(med("tier_load_s")), num(med("plain_load_s")),
                 num(t["tier_recovery_vs_persistent_recovery"])])
    after = ("The asynchronous save (`saver=AsyncSaver()`, process mode) returns once the arrays are in its "
             f"staging pool; its tier copies were committed {num(med('tier_async_copies_s'))} s after the call."
             if background else "")
    return "\n".join([
        "## The fast tier",
        "",
        f"`bench/tiers.py`: 8 gloo processes as {t['nodes']} nodes of {t['ranks_per_node']}, each node's tier a "
        f"directory of its own (`replicas={t['replicas']}`), the persistent tier on a moto S3 server on 127.0.0.1; "
        f"{mib(t['state_bytes'])} MiB of float32 cut over the 8 ranks. The save into the tiers returns once every "
        "node committed its copy and its neighbour's (the drain to S3 runs on in the background); the recovery "
        "runs on the 6 ranks of the 3 nodes left after one node's directory is deleted, with another cut. "
        f"Seconds, median of {len(rounds)} rounds; ratios the median of the rounds' ratios:",
        "",
        table(["", "TieredManager", "S3 only", "ratio"], rows),
        "",
        f"The recovery read {num(t['tier_persistent_bytes_over_lost_node_bytes'])}x the lost node's own bytes "
        "from S3: its arrays came from the neighbour that holds their copy." + (" " + after if after else ""),
    ])


def section_planning(d: Data) -> str:
    rep = d.get("report", {})
    if "planning" not in rep:
        return "## Planning\n\n" + _missing("bench/run.py")
    plans, curve = rep["planning"], rep["planning_curve"]
    rows = [[p["case"], f"{p['shards']:,}", f"{p['stored_regions']:,}", num(p["describe_s"], 1),
             num(p["save_plan_s"], 1), num(p.get("load_plan_one_rank_s"))] for p in plans]
    doublings = [b["save_plan_s"] / a["save_plan_s"] for a, b in itertools.pairwise(curve)]
    lines = [
        "## Planning",
        "",
        "`bench/run.py`: pure, every rank simulated in one process.",
        "",
        table(["case", "shards", "stored regions", "describe s", "save plan s", "one rank's load plan s"], rows),
        "",
        table([f"ranks (TP=8, {plans[0]['shards'] // 1024:,} tensors)", *[str(c["ranks"]) for c in curve]], [
            ["save plan s, from every rank's shard list in one process", *[num(c["save_plan_s"]) for c in curve]],
            ["x per doubling", "", *[num(x) for x in doublings]],
            ["one rank's load plan s", *[num(c["load_plan_one_rank_s"], 3) for c in curve]],
            ["in a real save, per rank: MB received, s to parse and plan",
             *[f"{c['compact_gather_bytes_per_rank'] / 1e6:.1f}, {c['compact_parse_and_plan_s_per_rank']:.2f}"
               for c in curve]],
            ["if every rank received every description: MB, s to parse",
             *[f"{c['full_gather_bytes_per_rank'] / 1e6:.0f}, {c['full_parse_s_per_rank']:.1f}" for c in curve]],
            ["plan broadcast from rank 0 instead: MB, s to parse",
             *[f"{c['gather_to_one_broadcast_bytes'] / 1e6:.1f}, {c['gather_to_one_parse_s_other_ranks']:.3f}"
               for c in curve]],
        ]),
        "",
        "Ranks whose shard lists differ only in replica ids (data-parallel replicas) are planned as one group: "
        "in a real save ranks exchange a digest of their list and their replica ids, then each distinct list "
        f"once. In the first case {plans[0]['ranks_writing']:,} of 1,024 ranks write (max/mean bytes per rank "
        f"{num(plans[0]['writer_bytes_max_over_mean'])}): data-parallel replicas share the writing.",
    ]
    r = rep.get("replan")
    if r:
        lines += ["", f"A repeated save of the same structure (keys, shapes, dtypes, regions, replica ids) at "
                  f"{r['ranks']:,} simulated ranks x {r['tensors']:,} tensors, the real `plan_save` of one rank with "
                  f"the others' messages simulated: {num(r['plan_s'])} s to plan the first save (from the "
                  f"distinct lists), then {num(r['replan_s'], 3)} s to check the digests and reuse the plan "
                  f"(median of {r['repeats']})."]
    cov = rep.get("coverage")
    if cov:
        lines += ["", f"The coverage check (sweep line) on {cov['boxes']:,} boxes: {cov['sweep_s'] * 1e3:.1f} ms, "
                  f"against {cov['pairwise_s']:.1f} s for all pairs ({cov['pairwise_over_sweep']:.0f}x)."]
    return "\n".join(lines)


def section_io(d: Data) -> str:
    io = d.get("report", {}).get("io")
    if io is None:
        return "## I/O in one process\n\n" + _missing("bench/run.py")
    lines = ["## I/O in one process", "",
             f"`bench/run.py`: {mib(io['bytes'])} MiB of float32 in 16 MiB tensors saved at TP=4 along rows, best "
             f"of 3, page cache warm, against plain numpy (`np.save` of the same shards, fsynced: "
             f"{num(io['np_save_s'])} s; `np.load` of all of them: {num(io['np_load_everything_s'], 3)} s). "
             "Bytes read count the distinct whole chunks each rank touches: a chunk is read whole to check its "
             "crc32c."]
    for c in io["chunks"]:
        lines += ["", f"Inner chunks of at most {c['chunk_mib']} MiB: save {num(c['save_s'])} s, "
                  f"{num(c['save_over_np_save'])}x `np.save`.", "",
                  table(["load", "s", "time / np.load of every shard", "bytes read / needed, per rank"],
                        [[r["load"], num(r["seconds"], 3), num(r["over_np_load_of_everything"]),
                          num(r["read_over_needed"])] for r in c["loads"]])]
    return "\n".join(lines)


def section_small(d: Data) -> str:
    s = d.get("small_tensors")
    if s is None:
        return "## Many small tensors\n\n" + _missing("bench/small_tensors.py")
    rounds = len(s["rounds"]["file_large"])
    rows = []
    for store, name, label in (("file", "small", "files, one array per region"),
                               ("file", "packed", "files, `save(pack_below=1 MiB)`"),
                               ("ocdbt", "small", "OCDBT over files")):
        mine, large, ratio = s[f"{store}_{name}"], s[f"{store}_large"], s[f"{store}_{name}_over_large"]
        rows.append([label, num(mine["save_s"]), num(mine["load_s"]), num(large["save_s"]), num(large["load_s"]),
                     num(ratio["save"]) + "x", num(ratio["load"]) + "x"])
    p = s["packed_prototype"]
    return "\n".join([
        "## Many small tensors",
        "",
        "`bench/small_tensors.py`: 10,000 tensors of 4 KiB to 1 MiB against the same bytes in 8 tensors, in one "
        f"process; in each of {rounds} rounds each layout is saved once and loaded 3 times into fresh targets (the "
        "round's load: their median), each checkpoint deleted once loaded. Figures are medians of the rounds, "
        "ratios medians of the rounds' ratios.",
        "",
        table(["layout", "10,000 small: save s", "load s", "8 large: save s", "load s", "small / large: save",
               "load"], rows),
        "",
        "The bound of any packed layout here (the same arrays back to back in one raw file read by 4 threads, "
        f"every crc32c checked: {num(p['read_s'], 3)} s, plus the library's metadata parse "
        f"{num(p['parse_s'], 3)} s and load plan {num(p['plan_s'], 3)} s) is "
        f"{num(p['projected_load_s'] / s['file_large']['load_s'])}x the large layout's load.",
    ])


def section_shared(d: Data) -> str:
    s = d.get("shared_reads")
    if s is None:
        return "## Shared reads\n\n" + _missing("bench/shared_reads.py")
    rows = []
    for name, label, size in (("local_warm", "local files, warm", "state_bytes_local"),
                              ("local_cold", "local files, cold", "state_bytes_local"),
                              ("s3", "S3 (moto server on 127.0.0.1)", "state_bytes_s3")):
        if name not in s:
            continue
        c = s[name]
        gets = f"{c['plain'].get('chunk_gets', '')} -> {c['shared'].get('chunk_gets', '')}" if name == "s3" else ""
        rows.append([label, mib(s[size]), num(c["plain"]["seconds"]), num(c["shared"]["seconds"]),
                     num(c["shared_over_plain_seconds"]), num(c["shared_over_plain_bytes_read"]), gets])
    return "\n".join([
        "## Shared reads",
        "",
        f"`bench/shared_reads.py`: {s['layout']}, each data-parallel pair needing the same half of every tensor; "
        "`shared_reads` off and on, median of 3. Each stored byte is read once per group instead of once per "
        "rank; on local files the exchange over gloo (loopback TCP) can cost more than the reads it saves, on an "
        "object store it halves the billed, latency-bound GETs.",
        "",
        table(["storage", "state MiB", "off: s", "on: s", "on / off time", "bytes the group read, on / off",
               "chunk GETs, off -> on"], rows),
    ])


def section_memory(d: Data) -> str:
    m = d.get("io_memory")
    parts = ["## Memory"]
    if m is None:
        parts += ["", _missing("bench/io_memory.py")]
    else:
        rows = [[step, mib(m[step]["state_bytes"]), num(m[step]["seconds"]), mib(m[step]["peak_rise_bytes"]),
                 mib(0.1 * m[step]["state_bytes"] + (64 << 20))] for step in ("save", "load")]
        a = m["async"]
        parts += ["", f"`bench/io_memory.py`, each step in a fresh process, the median of 3 by peak: "
                  f"{mib(m['save']['state_bytes'])} MiB of float32 saved from TP=4 shards and loaded into TP=2 "
                  "targets. Chunks go from the source arrays to the files and from the files into the targets "
                  "through at most one 1 MiB buffer per I/O thread.", "",
                  table(["step", "state MiB", "seconds", "peak RSS rise MiB", "allowed (10% + 64 MiB)"], rows), "",
                  f"`AsyncSaver.save` of the same state blocked the caller {num(a['second_blocking_s'], 3)} s once "
                  f"its buffer existed, {num(a['second_blocking_over_memcpy'])}x a memcpy of the state into a warm "
                  f"buffer ({num(a['memcpy_s'], 3)} s), and {num(a['first_blocking_s'], 3)} s the first time (the "
                  f"buffer is allocated and faulted in); writing and committing took the rest of "
                  f"{num(a['second_total_s'])} s in the background."]
    z = d.get("zero_memory")
    if z is not None:
        ranks = z["ranks"]
        parts += ["", f"Distributed optimizer (`bench/zero_memory.py`): {z['dp']} gloo ranks at DP={z['dp']} in "
                  f"Megatron-Core's layout, {z['layers']} fp32 layers of {z['width']} x {z['width']}, main weights "
                  f"and both Adam moments (whole state {mib(z['whole_model_state_bytes'])} MiB, the largest "
                  f"parameter's {mib(z['largest_parameter_state_bytes'])} MiB). Each rank's peak RSS rose by "
                  f"{span([r['save_peak_rise_bytes'] / 2**20 for r in ranks], 0)} MiB during the save (it wrote "
                  f"{span([r['bytes_written'] / 2**20 for r in ranks], 0)} MiB) and by "
                  f"{span([r['load_peak_rise_bytes'] / 2**20 for r in ranks], 0)} MiB during the load (it read "
                  f"{span([r['bytes_read'] / 2**20 for r in ranks], 0)} MiB): no rank gathers a parameter's state."]
    e = d.get("export_memory")
    if e is not None:
        parts += ["", f"Export (`bench/export_memory.py`): `globalshard export --dtype bf16` of a "
                  f"{gib(e['model_bytes'])} GiB model into {e['files']} file{'s' if e['files'] != 1 else ''} "
                  f"took {num(e['seconds'], 1)} s with a "
                  f"peak RSS of {mib(e['export_peak_rss_bytes'])} MiB: memory does not grow with the model."]
    return "\n".join(parts)


def _flat(name: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(f"{name}.{k}", v)]
    return [(name, value)]


def headline(d: Data) -> str:
    rep = d.get("report", {})
    skip = {"quick", "python", "cpus", "planning", "planning_curve", "coverage", "io"}
    rows = [[f"`{k}`", "—" if v is None else (num(v, 3) if isinstance(v, float) else str(v))]
            for name in rep if name not in skip for k, v in _flat(name, rep[name]) if not isinstance(v, list)]
    return "\n".join(["## The figures under fixed names", "",
                      "`build/bench/report.json` carries each headline figure under a fixed name (`bench/summary.py`"
                      " says what each one is):", "", table(["name", "value"], rows)])


SECTIONS: list[Callable[[Data], str]] = [section_compare, section_cold_one_process, section_training,
                                         section_tiers, section_planning, section_io,
                                         section_small, section_shared, section_memory, headline]


def render_benchmarks(d: Data) -> str:
    run = d["run"]
    head = [
        GENERATED.format(data="docs/data/benchmarks.json", command="`make bench`"),
        "# Benchmarks",
        f"From one `{run['command']}` run on commit {run['commit']} ({run['date']}), on a {run['cpus']}-core "
        f"{run['machine']} machine with Python {run['python']} and no GPU. Every figure below is from that run's "
        "JSON (`docs/data/benchmarks.json`, gathered from `build/bench/`); `python bench/compare.py --quick` is "
        "a small smoke run. These machines are shared and noisy: read the ratios, each measured within one round.",
    ]
    body = [s(d) for s in SECTIONS]
    return "\n\n".join(head + [b for b in body if b]) + "\n"


def readme_table(d: Data) -> str:
    c = d.get("compare")
    if c is None:
        return f"{README_BEGIN}\n*No benchmark run recorded.*\n{README_END}"
    rows = _compare_rows(c)
    rows = [r for r in rows if not r[0].startswith("globalshard_jax")]
    rows[0][0] = "disk (write+fsync) / page cache"
    out = [README_BEGIN, f"From one `make bench` run (commit {d['run']['commit']}, {d['run']['cpus']} "
           f"cores; {gib(c['state_bytes'])} GiB of float32 saved at TP=4 by 4 gloo processes; GB/s, "
           f"median of {len(c['rounds']['globalshard'])} rounds):", "", table(COMPARE_HEADER, rows)]
    t = d.get("training")
    if t is not None:
        m = t["model"]
        out += ["", f"A training loop saving its {mib(m['state_bytes'])} MiB of weights and AdamW moments every "
                f"{m['save_every']} steps, wall time per step over the same loop without checkpoints:", "",
                table(["synchronous saves", "AsyncSaver, thread", "AsyncSaver, process",
                       "AsyncSaver, process, a core left to the writer",
                       "a bare write+fsync process (buffered / O_DIRECT / O_DIRECT in checksummed chunks)",
                       "a process-mode save blocks",
                       "a LoRA save of a 1 GiB frozen base writes"],
                      [[num(t["step_time_sync_vs_none"]) + "x", num(t["step_time_async_thread_vs_none"]) + "x",
                        num(t["step_time_async_process_vs_none"]) + "x" + (
                            f" (95% interval {span(t['step_time_intervals']['process'])})"
                            if "process" in t.get("step_time_intervals", {}) else ""),
                        (num(t["step_time_async_process_spare_core_vs_none"]) + "x"
                         if "step_time_async_process_spare_core_vs_none" in t else "not measured"),
                        num(t["step_time_raw_writer_vs_none"]) + "x / " +
                        (num(t["step_time_raw_unbuffered_writer_vs_none"]) + "x"
                         if "step_time_raw_unbuffered_writer_vs_none" in t else "not measured") + " / " +
                        (num(t["step_time_raw_chunked_writer_vs_none"]) + "x"
                         if "step_time_raw_chunked_writer_vs_none" in t else "not measured"),
                        num(t["async_block_vs_memcpy"]) + "x a memcpy of the state",
                        num(t["lora_save_bytes_over_adapter_bytes"]) + "x the adapters' bytes"]])]
    tiers = d.get("tiers")
    if tiers is not None:
        out += ["", f"With a node-local tier (4 nodes, one replica each, S3 behind it), a save stops training "
                f"{num(tiers['tier_local_save_vs_persistent_save'])}x as long as one straight to S3, and a job that "
                f"lost a node recovers onto another layout in {num(tiers['tier_recovery_vs_persistent_recovery'])}x "
                f"the time of a load from S3, reading "
                f"{num(tiers['tier_persistent_bytes_over_lost_node_bytes'])}x the lost node's bytes from S3."]
    return "\n".join([*out, README_END])


# ----------------------------------------------------------------------- reliability.md


def render_reliability(d: Data) -> str:
    run = d["run"]
    rep, fuzz = d.get("report", {}), d.get("fuzz", {})
    rows = []
    crash = rep.get("crash", {})
    for case, c in crash.items():
        rows.append([f"A killed save never loses the checkpoint it replaces: {case}",
                     f"SIGKILL at {c['kill_points']} points spread over every phase of the save",
                     f"{c['process_killed']} killed before the save ended; after each kill the previous or the new "
                     f"checkpoint loaded whole {c['previous_or_new_whole']} times of {c['kill_points']}, and the "
                     "next save succeeded with no leftover"])
    for how, c in rep.get("corruption", {}).items():
        rows.append([f"Damage is an error naming the file, never wrong values: {how}",
                     f"each of {c['files']} files x full load / partial load / `read_array` / `verify`: "
                     f"{c['reads']} reads",
                     f"{c['detected']} errors naming the file; {c['exact_values']} reads exact (they did not touch "
                     f"the damaged bytes); {c['wrong_values']} wrong values"])
    for mode, c in rep.get("racing saves", {}).items():
        rows.append([f"Racing saves: one whole winner ({mode})",
                     f"2 processes saving to one path at the same instant, {c['trials']} times",
                     f"{c['one_whole_checkpoint']} of {c['trials']} left one writer's checkpoint whole "
                     f"({c['one_committed_one_clear_error']} with a clear error for the other, "
                     f"{c['both_committed_one_after_the_other']} committed one after the other); {c['mixed']} mixed"])
    if fuzz:
        other = len(fuzz.get("failures", []))
        rows.append(["Hostile metadata: only the parsers' own errors",
                     f"{fuzz['inputs']:,} structure-aware mutations of metadata.json and the trainer state "
                     f"(`python tests/campaigns/fuzz_metadata.py --inputs {fuzz['inputs']}`, seed {fuzz['seed']})",
                     f"{other} other exceptions ({fuzz['metadata refused']:,} metadata documents refused, "
                     f"{fuzz['metadata accepted']:,} accepted and planned; {fuzz['trainer state refused']:,} trainer "
                     f"states refused, {fuzz['trainer state accepted']:,} accepted); slowest input "
                     f"{num(fuzz.get('slowest_seconds'), 2)} s"])
    return "\n".join([
        GENERATED.format(data="docs/data/reliability.json", command="`make reliability`"),
        "# Reliability",
        "",
        "Each promise of the README has tests that try to break it: `tests/checkpoint/test_trust.py`, "
        "`tests/campaigns/` (`test_crash.py`, `test_corruption.py`, `test_fuzz.py`) and "
        "`tests/torch_adapter/test_torch_trust.py`. CI runs a sample of each; `make reliability` runs the full "
        "campaign and writes `build/reliability/report.json` and `fuzz.json`, from which this page is written. "
        f"From one run on commit {run['commit']} ({run['date']}, {run['cpus']} cores):",
        "",
        table(["promise", "what was tried", "outcome"], rows),
        "",
        "Faults that every CI run checks rather than counts (`tests/checkpoint/test_trust.py`): a file-size limit "
        "(`RLIMIT_FSIZE`, a full disk) and an immutable directory during an overwrite end in a `StorageError` "
        "naming the file; the previous checkpoint loads and the next save succeeds.",
        "",
    ])


# ----------------------------------------------------------------------- writing and checking


def _replace_readme_block(text: str, block: str) -> str:
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"pages: README.md has no {README_BEGIN} ... {README_END} block")
    return text[:begin] + block + text[end + len(README_END):]


def rendered(kind: str, d: Data) -> dict[str, str]:
    """Each file this kind of run writes, by path, with its full new text."""
    if kind == "benchmarks":
        with open(README) as f:
            readme = f.read()
        return {PAGES[kind]: render_benchmarks(d), README: _replace_readme_block(readme, readme_table(d))}
    return {PAGES[kind]: render_reliability(d)}


def load_data(kind: str) -> Data:
    with open(os.path.join(DATA, f"{kind}.json")) as f:
        return dict(json.load(f))


def stale(kind: str) -> list[str]:
    """Files that do not hold what the committed data renders."""
    out = []
    for path, text in rendered(kind, load_data(kind)).items():
        with open(path) as f:
            if f.read() != text:
                out.append(os.path.relpath(path, ROOT))
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("benchmarks", "reliability", "check", "start", "render"):
        print(__doc__)
        return 2
    if argv[0] == "render":
        for kind in ("benchmarks", "reliability"):
            for path, text in rendered(kind, load_data(kind)).items():
                with open(path, "w") as f:
                    f.write(text)
        return 0
    if argv[0] == "start":
        start(argv[1], argv[2] if len(argv) > 2 else BUILD[argv[1]])
        return 0
    if argv[0] == "check":
        bad = stale("benchmarks") + stale("reliability")
        for path in bad:
            print(f"{path} is not what docs/data renders: run bench/pages.py, not a hand edit")
        return 1 if bad else 0
    kind = argv[0]
    build = argv[1] if len(argv) > 1 else BUILD[kind]
    d = gather(kind, build)
    os.makedirs(DATA, exist_ok=True)
    with open(os.path.join(DATA, f"{kind}.json"), "w") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
    for path, text in rendered(kind, load_data(kind)).items():  # as the check will read it
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
