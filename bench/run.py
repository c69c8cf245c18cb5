"""Benchmarks behind every figure in docs/benchmarks.md.

    make bench                 (or: .venv/bin/python bench/run.py [--quick])

Writes build/bench/report.json and prints a Markdown summary. Machines here
are shared and noisy, so speed is reported as ratios between things measured
in the same run (globalshard against plain numpy file I/O of the same bytes;
the sweep-line check against the pairwise one), next to absolute seconds.

1. Planning at scale: 1024 simulated ranks x 1000 tensors, described and
   planned in one process (TP=8 x DP=128; and every tensor cut 1024 ways);
   512 -> 4096 ranks, with what each rank of a real save receives and parses
   (compact descriptions, against every full description and against a plan
   broadcast from rank 0).
2. Coverage check: sweep line vs all-pairs on the same boxes.
3. I/O: save at TP=4, load at TP=4/2/1/3/8 and a cut on the other axis;
   time vs np.save/np.load of the same bytes, and bytes read vs bytes needed
   (whole chunks touched: TensorStore verifies a chunk's crc32c, so it reads
   all of every chunk it touches), for two inner-chunk sizes.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

import globalshard as gs
from globalshard import Box, Region, ShardInfo
from globalshard.geometry import cover_problems
from globalshard.planner import describe_shards, group_descriptions, replica_runs

QUICK = "--quick" in sys.argv
EXCHANGE_KEYS = ("describe_one_rank_s", "full_gather_bytes_per_rank", "full_parse_s_per_rank",
                 "compact_gather_bytes_per_rank", "compact_parse_and_plan_s_per_rank", "gather_to_one_bytes_rank0",
                 "gather_to_one_plan_s_rank0", "gather_to_one_broadcast_bytes", "gather_to_one_parse_s_other_ranks")


def timed(fn: Any) -> tuple[Any, float]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# --------------------------------------------------------------------------- 1. planning


def plan_tp_dp(ranks: int, tensors: int, tp: int) -> dict[str, Any]:
    dp = ranks // tp
    rows, cols = 4096, 4096

    def describe() -> list[list[ShardInfo]]:
        per_rank = []
        n = rows // tp
        region_of = [Region(Box((0, 0), (n, cols)), Box((r * n, 0), (n, cols))) for r in range(tp)]
        for rank in range(ranks):
            t, d = rank % tp, rank // tp
            per_rank.append([ShardInfo(f"layers.{k}.w", "bfloat16", (rows, cols), (n, cols), (region_of[t],), d)
                             for k in range(tensors)])
        return per_rank

    per_rank, t_describe = timed(describe)
    plan, t_plan = timed(lambda: gs.SavePlanner().plan(per_rank))
    md_text = plan.metadata.dumps()
    loads = plan.bytes_per_rank()
    # A target rank of another layout (TP=16) plans its load.
    n16 = rows // 16
    target = [ShardInfo(f"layers.{k}.w", "float32", (rows, cols), (n16, cols),
                        (Region(Box((0, 0), (n16, cols)), Box((3 * n16, 0), (n16, cols))),)) for k in range(tensors)]
    _, t_load = timed(lambda: gs.LoadPlanner().plan(plan.metadata, target))
    _, t_parse = timed(lambda: gs.metadata.parse_metadata(md_text))
    return {
        "case": f"{ranks} ranks (TP={tp} x DP={dp}) x {tensors} tensors",
        "shards": ranks * tensors, "stored_regions": len(plan.writes),
        "describe_s": t_describe, "save_plan_s": t_plan, "load_plan_one_rank_s": t_load,
        "metadata_bytes": len(md_text), "metadata_parse_s": t_parse,
        "writer_bytes_max_over_mean": max(loads) / (sum(loads) / len(loads)),
        "ranks_writing": sum(1 for b in loads if b),
        **exchange(per_rank, tp, plan),
    }


def exchange(per_rank: list[list[ShardInfo]], tp: int, plan: gs.SavePlan) -> dict[str, Any]:
    """What a real save moves between ranks and parses, three ways, per rank.

    - full: every rank all-gathers every rank's whole description (version 1);
    - compact (what the api does): every rank all-gathers a digest and replica ids
      per rank, then each distinct shard list once, and plans from those;
    - gather-to-one: rank 0 gets the compact descriptions and plans; every rank
      then receives the plan's write list and parses it.
    Rank r's message is what :func:`describe_shards` returns on rank r: here the
    ranks of one TP slice share their list, so it is described once per slice.
    """
    ranks = len(per_rank)
    _, t_describe = timed(lambda: describe_shards(per_rank[0]))
    described = {t: describe_shards(per_rank[t]) for t in range(tp)}
    messages = [json.dumps({"digest": described[r % tp][0], "replicas": replica_runs(per_rank[r])},
                           separators=(",", ":")) for r in range(ranks)]
    lists = [json.dumps(described[r][1], separators=(",", ":")) if r < tp else "null" for r in range(ranks)]
    compact_bytes = sum(map(len, messages)) + sum(map(len, lists))

    def plan_from_wire() -> gs.SavePlan:
        docs = [json.loads(m) for m in messages]
        schemas = {docs[r]["digest"]: json.loads(lists[r]) for r in range(tp)}
        groups = group_descriptions([d["digest"] for d in docs], schemas, [d["replicas"] for d in docs])
        return gs.SavePlanner().plan_groups(groups, ranks)

    wire_plan, t_compact = timed(plan_from_wire)
    assert wire_plan.writes == plan.writes
    # Version 1: rank r's description was its shards' JSON with their replica ids.
    one = json.dumps([i.to_json() for i in per_rank[0]], separators=(",", ":"))
    _, t_parse_one = timed(lambda: [ShardInfo.from_json(j) for j in json.loads(one)])
    full_bytes = sum(len(json.dumps(described[r % tp][1], separators=(",", ":")))
                     + sum(len(str(i.replica_id)) - 1 for i in per_rank[r]) for r in range(ranks))
    # Gather-to-one: the plan's write list, broadcast (each rank keeps its own items).
    writes = json.dumps([[w.key, list(w.box.offset), list(w.box.shape), w.path, w.rank, w.shard, w.region]
                         for w in plan.writes], separators=(",", ":"))
    _, t_writes = timed(lambda: json.loads(writes))
    return {
        "describe_one_rank_s": t_describe,
        "full_gather_bytes_per_rank": full_bytes, "full_parse_s_per_rank": t_parse_one * ranks,
        "compact_gather_bytes_per_rank": compact_bytes, "compact_parse_and_plan_s_per_rank": t_compact,
        "gather_to_one_bytes_rank0": compact_bytes, "gather_to_one_plan_s_rank0": t_compact,
        "gather_to_one_broadcast_bytes": len(writes), "gather_to_one_parse_s_other_ranks": t_writes,
    }


class _SimulatedRanks:
    """The communicator of rank ``rank`` among ``len(per_rank)`` simulated ranks:
    each all-gather answers every rank's message as that rank's own code
    would send it (its digest and replica ids; the distinct shard lists), so
    the real ``plan_save`` runs on this rank as in a save of all of them."""

    def __init__(self, rank: int, per_rank: list[list[ShardInfo]], tp: int) -> None:
        self.rank, self.world_size, self._tp = rank, len(per_rank), tp
        self._described = {t: describe_shards(per_rank[t]) for t in range(tp)}
        self._replicas = [replica_runs(infos) for infos in per_rank]

    def all_gather(self, obj: Any) -> list[Any]:
        value = obj["value"]
        if isinstance(value, dict) and "digest" in value:  # the planning exchange
            out = [{**value, "digest": self._described[r % self._tp][0], "replicas": self._replicas[r]}
                   for r in range(self.world_size)]
            out[0]["save_id"] = gs.format.new_save_id()  # rank 0 names the save
            return [{"ok": True, "value": v} for v in out]
        # The distinct shard lists: the first rank of each TP slice sends its own.
        return [{"ok": True, "value": [self._described[r][1]] if r < self._tp else None}
                for r in range(self.world_size)]

    def barrier(self) -> None:
        return None


def replan(ranks: int, tensors: int, tp: int, repeats: int = 5) -> dict[str, Any]:
    """One rank's planning of a save at ``ranks`` simulated ranks (TP=``tp`` x DP),
    then of repeated saves of the same structure, which reuse the cached plan:
    the real ``plan_save`` of rank 1, its collectives answered as the others would."""
    import contextlib
    import statistics

    from globalshard.checkpoint import plan_cache, saving
    from globalshard.store import LocalStore

    rows, cols = 4096, 4096
    n = rows // tp
    per_rank = [[ShardInfo(f"layers.{k}.w", "bfloat16", (rows, cols), (n, cols),
                           (Region(Box((0, 0), (n, cols)), Box((r % tp * n, 0), (n, cols))),), r // tp)
                 for k in range(tensors)] for r in range(ranks)]
    rank = 1
    # The rank's tensors: views of one small buffer (planning reads shapes, never data).
    data = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint16), (n, cols), (0, 0)).view(gs.dtypes.numpy_dtype(
        "bfloat16"))
    entries = [(f"w{k}", gs.ShardedTensor.from_offset(i.key, data, global_shape=(rows, cols),
                                                     global_offset=(rank % tp * n, 0), replica_id=rank // tp))
               for k, i in enumerate(per_rank[rank])]
    comm = _SimulatedRanks(rank, per_rank, tp)
    store = LocalStore(tempfile.mkdtemp(prefix="globalshard-replan-"))
    plan_cache.PLANS.clear()

    def plan_once() -> saving.PlannedSave:
        with contextlib.ExitStack() as held:
            return saving.plan_save(store, comm, entries, None, True, held)

    first, t_first = timed(plan_once)
    again = [timed(plan_once) for _ in range(repeats)]
    assert plan_cache.PLANS.hits == repeats and plan_cache.PLANS.misses == 1
    assert [i.path.split("/", 2)[2] for i in again[-1][0].items] == [i.path.split("/", 2)[2] for i in first.items]
    os.rmdir(store.path)
    return {"ranks": ranks, "tensors": tensors, "tp": tp, "repeats": repeats, "plan_s": t_first,
            "replan_s": statistics.median(t for _, t in again), "items": len(first.items)}


def plan_fragmented(ranks: int, tensors: int) -> dict[str, Any]:
    side = round(ranks ** 0.5)
    rows = cols = side * 64

    def describe() -> list[list[ShardInfo]]:
        per_rank = []
        for rank in range(ranks):
            i, j = divmod(rank, side)
            reg = Region(Box((0, 0), (64, 64)), Box((i * 64, j * 64), (64, 64)))
            per_rank.append([ShardInfo(f"t{k}", "float32", (rows, cols), (64, 64), (reg,)) for k in range(tensors)])
        return per_rank

    per_rank, t_describe = timed(describe)
    plan, t_plan = timed(lambda: gs.SavePlanner().plan(per_rank))
    md_text = plan.metadata.dumps()
    _, t_parse = timed(lambda: gs.metadata.parse_metadata(md_text))
    return {
        "case": f"{ranks} ranks x {tensors} tensors, each cut {side}x{side} (2-D)",
        "shards": ranks * tensors, "stored_regions": len(plan.writes),
        "describe_s": t_describe, "save_plan_s": t_plan,
        "metadata_bytes": len(md_text), "metadata_parse_s": t_parse,
    }


# --------------------------------------------------------------------------- 2. coverage


def pairwise_overlaps(boxes: list[Box]) -> int:
    return sum(1 for i in range(len(boxes)) for j in range(i + 1, len(boxes))
               if boxes[i].intersect(boxes[j]) is not None)


def coverage(side: int) -> dict[str, Any]:
    boxes = [Box((i * 4, j * 4), (4, 4)) for i in range(side) for j in range(side)]
    bounds = Box.full((side * 4, side * 4))
    result, t_sweep = timed(lambda: cover_problems(bounds, boxes))
    assert result == ([], [])
    overlaps, t_pairs = timed(lambda: pairwise_overlaps(boxes))
    assert overlaps == 0
    return {"boxes": len(boxes), "sweep_s": t_sweep, "pairwise_s": t_pairs, "pairwise_over_sweep": t_pairs / t_sweep}


# --------------------------------------------------------------------------- 3. I/O


def best_of(n: int, fn: Any) -> float:
    return min(timed(fn)[1] for _ in range(n))


def io_bench(root: str) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    layers = 2 if QUICK else 8
    # Per layer: a column-parallel (rows split) and a row-parallel (cols split) fp32 weight, 16 MiB each.
    full = {}
    for i in range(layers):
        full[f"layers.{i}.fc1"] = rng.standard_normal((4096, 1024), dtype=np.float32)
        full[f"layers.{i}.fc2"] = rng.standard_normal((1024, 4096), dtype=np.float32)
    total = sum(v.nbytes for v in full.values())

    def axis_of(name: str) -> int:
        return 0 if name.endswith("fc1") else 1

    def state(tp: int, fill: bool, axis_override: int | None = None) -> dict[str, gs.ShardedTensor]:
        out = {}
        for name, value in full.items():
            axis = axis_of(name) if axis_override is None else axis_override
            n = -(-value.shape[axis] // tp)
            for r in range(tp):
                lo, hi = r * n, min((r + 1) * n, value.shape[axis])
                sl = tuple(slice(lo, hi) if d == axis else slice(None) for d in range(2))
                data = value[sl].copy() if fill else np.empty(value[sl].shape, np.float32)
                off = tuple(lo if d == axis else 0 for d in range(2))
                out[f"{name}@{r}"] = gs.ShardedTensor.from_offset(name, data, global_shape=value.shape,
                                                                  global_offset=off)
        return out

    source = state(4, True)
    # Baseline: the same shards with np.save, one file each, fsynced like ours.
    base = os.path.join(root, "npy")
    os.makedirs(base)

    def np_save() -> None:
        for i, t in enumerate(source.values()):
            with open(os.path.join(base, f"{i}.npy"), "wb") as f:
                np.save(f, t.data)
                f.flush()
                os.fsync(f.fileno())

    def np_load_all() -> None:
        for i in range(len(source)):
            np.load(os.path.join(base, f"{i}.npy"))

    t_npsave = best_of(3, np_save)
    t_npload = best_of(3, np_load_all)
    out: dict[str, Any] = {"bytes": total, "np_save_s": t_npsave, "np_load_everything_s": t_npload, "chunks": []}
    for chunk_mib in (4, 1):
        gs.format.zarr.CHUNK_BYTES = chunk_mib << 20
        ckpt = os.path.join(root, f"ckpt{chunk_mib}")
        save_stats = gs.IOStats()

        def save(ckpt: str = ckpt, save_stats: gs.IOStats = save_stats) -> None:
            gs.save(source, ckpt, stats=save_stats, overwrite=True)

        t_save = best_of(3, save)
        rows = []
        gs.load(state(4, False), ckpt)  # warm-up: first TensorStore use, page cache
        for label, tp, swap in [("TP=4 -> 4 (same)", 4, False), ("TP=4 -> 2", 2, False), ("TP=4 -> 1", 1, False),
                                ("TP=4 -> 3 (uneven)", 3, False), ("TP=4 -> 8", 8, False),
                                ("TP=4, cut on the other axis", 4, True)]:
            if swap:
                targets = {k: v for name in full
                           for k, v in state(tp, False, 1 - axis_of(name)).items() if k.startswith(name + "@")}
            else:
                targets = state(tp, False)
            # Read amplification is per rank: each rank loads its own targets (a
            # chunk two ranks need is read by both).
            stats = gs.IOStats()
            for rank in sorted({k.rsplit("@", 1)[1] for k in targets}):
                gs.load({k: v for k, v in targets.items() if k.rsplit("@", 1)[1] == rank}, ckpt, stats=stats)
            for t in targets.values():
                if not np.array_equal(t.data, full[t.key][t.regions[0].global_box.slices]):
                    raise SystemExit(f"bench: wrong data for {t.key} in {label}")
            seconds = best_of(3, lambda targets=targets, ckpt=ckpt: gs.load(targets, ckpt))
            rows.append({
                "load": label, "seconds": seconds, "over_np_load_of_everything": seconds / t_npload,
                "bytes_needed": stats.bytes_needed, "bytes_read_chunks": stats.bytes_read,
                "read_over_needed": stats.bytes_read / stats.bytes_needed,
            })
        out["chunks"].append({"chunk_mib": chunk_mib, "arrays": save_stats.arrays // 3, "save_s": t_save,
                              "save_over_np_save": t_save / t_npsave, "loads": rows})
    gs.format.zarr.CHUNK_BYTES = 1 << 20
    return out


def main() -> None:
    out_dir = os.path.join("build", "bench")
    os.makedirs(out_dir, exist_ok=True)
    report: dict[str, Any] = {"quick": QUICK, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    tensors = 100 if QUICK else 1000
    print("planning ...", flush=True)
    report["planning"] = [plan_tp_dp(1024, tensors, 8), plan_fragmented(1024, tensors // 10 if QUICK else 100)]
    curve = [plan_tp_dp(ranks, tensors, 8) for ranks in ((128, 256) if QUICK else (512, 1024, 2048, 4096))]
    report["planning_curve"] = [{"ranks": int(c["case"].split()[0]), "save_plan_s": c["save_plan_s"],
                                 "load_plan_one_rank_s": c["load_plan_one_rank_s"],
                                 **{k: v for k, v in c.items() if k in EXCHANGE_KEYS}} for c in curve]
    report["plan_4096_s"] = curve[-1]["save_plan_s"] if not QUICK else None
    print("repeated saves ...", flush=True)
    report["replan"] = replan(256 if QUICK else 4096, tensors, 8)
    report["replan_4096_s"] = report["replan"]["replan_s"] if not QUICK else None
    print("coverage ...", flush=True)
    report["coverage"] = coverage(32 if QUICK else 64)
    print("I/O ...", flush=True)
    root = tempfile.mkdtemp(prefix="globalshard-bench-", dir=out_dir)
    try:
        report["io"] = io_bench(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)

    print("\n### Planning (pure, one process)\n")
    print("| case | shards | stored regions | describe s | save plan s | load plan s (1 rank) "
          "| metadata MB | parse s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in report["planning"]:
        print(f"| {p['case']} | {p['shards']:,} | {p['stored_regions']:,} | {p['describe_s']:.1f} | "
              f"{p['save_plan_s']:.1f} | {p.get('load_plan_one_rank_s', float('nan')):.2f} | "
              f"{p['metadata_bytes'] / 1e6:.1f} | {p['metadata_parse_s']:.1f} |")
    print(f"\n| ranks (TP=8, {tensors} tensors) | save plan s | x per doubling | one rank's load plan s "
          "| per rank in a real save: MB received, s to parse and plan | all descriptions to every rank: MB, "
          "s to parse | plan broadcast from rank 0: MB, s to parse |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    prev = None
    for c in report["planning_curve"]:
        ratio = f"{c['save_plan_s'] / prev:.2f}" if prev else ""
        print(f"| {c['ranks']} | {c['save_plan_s']:.2f} | {ratio} | {c['load_plan_one_rank_s']:.3f} | "
              f"{c['compact_gather_bytes_per_rank'] / 1e6:.1f}, {c['compact_parse_and_plan_s_per_rank']:.2f} | "
              f"{c['full_gather_bytes_per_rank'] / 1e6:.0f}, {c['full_parse_s_per_rank']:.1f} | "
              f"{c['gather_to_one_broadcast_bytes'] / 1e6:.1f}, {c['gather_to_one_parse_s_other_ranks']:.3f} |")
        prev = c["save_plan_s"]
    r = report["replan"]
    print(f"\nRepeated save at {r['ranks']} ranks x {r['tensors']} tensors, one rank: planned in {r['plan_s']:.2f} s, "
          f"then reused the plan in {r['replan_s']:.3f} s (median of {r['repeats']}).")
    p = report["planning"][0]
    print(f"\nWriters: {p['ranks_writing']} of 1024 ranks write; max/mean bytes per rank "
          f"{p['writer_bytes_max_over_mean']:.2f}.")
    c = report["coverage"]
    print(f"\n### Coverage check\n\n{c['boxes']:,} boxes: sweep {c['sweep_s'] * 1e3:.1f} ms, all pairs "
          f"{c['pairwise_s']:.1f} s: pairwise is {c['pairwise_over_sweep']:.0f}x slower.")
    io = report["io"]
    print(f"\n### I/O ({io['bytes'] / 2**20:.0f} MiB fp32 in 16 MiB tensors, saved at TP=4; best of 3)\n")
    print(f"Baselines: np.save of the same shards {io['np_save_s']:.2f} s (fsynced), np.load of all of them "
          f"{io['np_load_everything_s']:.3f} s.\n")
    for c in io["chunks"]:
        print(f"Inner chunks of at most {c['chunk_mib']} MiB: save {c['save_s']:.2f} s = "
              f"{c['save_over_np_save']:.2f}x np.save.\n")
        print("| load | s | time / np.load of every shard | bytes read / needed |")
        print("| --- | --- | --- | --- |")
        for r in c["loads"]:
            print(f"| {r['load']} | {r['seconds']:.3f} | {r['over_np_load_of_everything']:.2f} | "
                  f"{r['read_over_needed']:.3f} |")
        print()
    print(f"\nfull report: {os.path.join(out_dir, 'report.json')}")


if __name__ == "__main__":
    main()
