"""Many small tensors against the same bytes in a few large ones.

    .venv/bin/python bench/small_tensors.py [--quick] [--tensors N]

N tensors (10,000, the performance issue's count; ``--quick``: 200) of
log-uniform sizes between 4 KiB and 1 MiB (1.8 GB), saved and loaded whole
in one process, against the same number of
bytes in 8 tensors: on the plain file kvstore, one zarr array (a zarr.json
and a chunk file) per region, and packed (``save(pack_below=1 MiB)``: the
small regions in a few uint8 arrays, spec section 5.1); and on OCDBT over
files (TensorStore packs keys into a few large files). The layouts take
turns in each of 3 rounds; in a round each layout is saved once and loaded
3 times into fresh targets (the round's load figure: their median, as one
load swings by 1.5x on this machine). Each ratio is the median of the
rounds' ratios, each figure the median of the 3 rounds. Each checkpoint is
deleted once it is loaded, so every save starts just after a deletion (this
disk writes faster then, docs/benchmarks.md) and the run holds one checkpoint at a time
on disk. Writes
build/bench/small_tensors.json (with ``--tensors N``: small_tensors_N.json).

Then a bound for any packed layout: the same small arrays back to back in
one raw file, each followed by its crc32c, written with fsync and read back
by 4 threads in 64 MiB preadv tasks with every crc32c checked; plus, from the
library, the per-tensor work every layout keeps (parsing metadata.json,
planning the load).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

import globalshard as gs

QUICK = "--quick" in sys.argv
#: How many small tensors: 10,000 by default (the performance issue's count,
#: 1.8 GB), ``--tensors N`` for another.
N = int(sys.argv[sys.argv.index("--tensors") + 1]) if "--tensors" in sys.argv else 200 if QUICK else 10000
#: Loads after each save (each into fresh targets); the round's load figure is their median.
LOADS = 3
#: The packed layout's save(pack_below=): every region here is under 1 MiB.
PACK_BELOW = 1 << 20


def _states() -> tuple[dict[str, gs.ShardedTensor], dict[str, gs.ShardedTensor], int]:
    rng = np.random.default_rng(0)
    sizes = np.exp(rng.uniform(np.log(4 << 10), np.log(1 << 20), N)).astype(int) // 4
    small = {f"s{i}": gs.ShardedTensor.from_offset(f"s{i}", np.full(n, i, np.float32), global_shape=(n,),
                                                   global_offset=(0,)) for i, n in enumerate(sizes)}
    total = int(sizes.sum())
    per = -(-total // 8)
    large = {f"l{i}": gs.ShardedTensor.from_offset(f"l{i}", np.full(per, i, np.float32), global_shape=(per,),
                                                   global_offset=(0,)) for i in range(8)}
    return small, large, total * 4


def _targets(state: dict[str, gs.ShardedTensor]) -> dict[str, gs.ShardedTensor]:
    return {k: gs.ShardedTensor.from_offset(t.key, np.zeros_like(t.data), global_shape=t.global_shape,
                                            global_offset=(0,)) for k, t in state.items()}


def _time(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    small, large, nbytes = _states()
    report: dict[str, Any] = {"tensors": N, "bytes": nbytes}
    os.makedirs("build", exist_ok=True)
    layouts = [("file", "small", small, 0), ("file", "packed", small, PACK_BELOW), ("file", "large", large, 0),
               ("ocdbt", "small", small, 0), ("ocdbt", "large", large, 0)]
    rounds: dict[str, list[dict[str, float]]] = {f"{store}_{name}": [] for store, name, _, _ in layouts}
    with tempfile.TemporaryDirectory(dir=os.path.abspath(os.environ.get("BENCH_DIR", "build"))) as tmp:
        # The layouts take turns in each round: this disk's write speed jumps by
        # 4x from minute to minute (docs/benchmarks.md), so each ratio compares neighbours.
        for rep in range(3):
            for store, name, state, pack in layouts:
                root = os.path.join(tmp, f"{store}-{name}-{rep}")
                where: Any = root if store == "file" else {"driver": "ocdbt", "base": f"file://{root}/"}
                save_s = _time(lambda w=where, s=state, p=pack: gs.save(s, w, pack_below=p))
                loads = []
                for _ in range(LOADS):  # each into fresh targets
                    targets = _targets(state)
                    loads.append(_time(lambda w=where, t=targets: gs.load(t, w)))
                    del targets
                rounds[f"{store}_{name}"].append({"save_s": save_s, "load_s": statistics.median(loads),
                                                  "loads_s": loads})
                gs.wait_for_cleanup()
                shutil.rmtree(root)
        report["packed_prototype"] = _packed(small, tmp)
    report["rounds"] = rounds
    for key, runs in rounds.items():
        report[key] = {f: statistics.median(r[f] for r in runs) for f in ("save_s", "load_s")}
    for store, name in (("file", "small"), ("file", "packed"), ("ocdbt", "small")):
        mine, large_runs = rounds[f"{store}_{name}"], rounds[f"{store}_large"]
        report[f"{store}_{name}_over_large"] = {  # the median of the rounds' ratios
            what: statistics.median(m[f"{what}_s"] / lg[f"{what}_s"] for m, lg in zip(mine, large_runs))
            for what in ("save", "load")}
    os.makedirs("build/bench", exist_ok=True)
    name = "small_tensors.json" if "--tensors" not in sys.argv else f"small_tensors_{N}.json"  # the report's own
    with open(os.path.join("build/bench", name), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{N} tensors of 4 KiB - 1 MiB ({nbytes / 2**20:.0f} MiB) vs the same bytes in 8 tensors, median of "
          "3 rounds:\n")
    print("| kvstore | layout | save s | load s |")
    print("| --- | --- | --- | --- |")
    for store in ("file", "ocdbt"):
        for name in ("small", "packed", "large"):
            r = report.get(f"{store}_{name}")
            if r is not None:
                print(f"| {store} | {name} | {r['save_s']:.2f} | {r['load_s']:.2f} |")
    for store, name in (("file", "small"), ("file", "packed"), ("ocdbt", "small")):
        r = report[f"{store}_{name}_over_large"]
        print(f"{store} {name} / few large = {r['save']:.2f}x (save), {r['load']:.2f}x (load), median of the rounds' "
              "ratios")
    p = report["packed_prototype"]
    large_load = report["file_large"]["load_s"]
    print(f"bound for a packed layout (raw file): write {p['write_s']:.2f} s, read {p['read_s']:.3f} s; "
          f"the library's metadata parse {p['parse_s']:.3f} s + load plan {p['plan_s']:.3f} s; "
          f"together {p['projected_load_s']:.2f} s = {p['projected_load_s'] / large_load:.2f}x the large load")


def _packed(state: dict[str, gs.ShardedTensor], tmp: str) -> dict[str, float]:
    import concurrent.futures

    import crc32c

    arrays = [t.data for t in state.values()]
    offsets = np.cumsum([0] + [a.nbytes + 4 for a in arrays])
    path = os.path.join(tmp, "packed")

    def write() -> None:
        with open(path, "wb") as f:
            for a in arrays:
                data = memoryview(a).cast("B")
                f.write(data)
                f.write(crc32c.crc32c(data).to_bytes(4, "little"))
            f.flush()
            os.fsync(f.fileno())

    targets = [np.empty_like(a) for a in arrays]
    tasks: list[list[int]] = [[]]
    size = 0
    for i, a in enumerate(arrays):
        if size >= 64 << 20:
            tasks.append([])
            size = 0
        tasks[-1].append(i)
        size += a.nbytes

    def read_task(members: list[int]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            crcs = [bytearray(4) for _ in members]
            buffers: list[Any] = []
            for i, c in zip(members, crcs):
                buffers += [memoryview(targets[i]).cast("B"), c]
            at = int(offsets[members[0]])
            for k in range(0, len(buffers), 1024):  # IOV_MAX
                part = buffers[k:k + 1024]
                want = sum(len(b) for b in part)
                if os.preadv(fd, part, at) != want:
                    raise OSError(f"{path}: short read")
                at += want
            for i, c in zip(members, crcs):
                if crc32c.crc32c(memoryview(targets[i]).cast("B")) != int.from_bytes(c, "little"):
                    raise OSError(f"{path}: member {i} fails its crc32c")
        finally:
            os.close(fd)

    def read() -> None:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(read_task, tasks))

    writes = [_time(write) for _ in range(3)]
    reads = [_time(read) for _ in range(3)]
    assert all(np.array_equal(a, t) for a, t in zip(arrays, targets))
    root = os.path.join(tmp, "packed-ref")
    gs.save(state, root)
    infos = [gs.ShardInfo.of(t) for t in state.values()]
    parses, plans = [], []
    for _ in range(3):
        start = time.perf_counter()
        metadata = gs.read_metadata(root)
        parses.append(time.perf_counter() - start)
        plans.append(_time(lambda m=metadata: gs.LoadPlanner().plan(m, infos, names=list(state))))
    out = {"write_s": statistics.median(writes), "read_s": statistics.median(reads),
           "parse_s": statistics.median(parses), "plan_s": statistics.median(plans)}
    out["projected_load_s"] = out["read_s"] + out["parse_s"] + out["plan_s"]
    return out


if __name__ == "__main__":
    main()
