"""Cold loads with every target in one process, beside DCP and the disk.

    .venv/bin/python bench/cold_load.py [--quick]

1 GiB of float32 in 72 tensors (``--quick``: 64 MiB in 8), saved at TP=4
(rows cut in four). Loaded at TP=2 and TP=1 with all of a load's targets in
one process, as an export, an evaluation or a TP=1 resume does, after
evicting the files from the page cache (``POSIX_FADV_DONTNEED``). Beside it:
torch DCP's load of its own TP=4 checkpoint of the same state, by as many
processes as the new layout has ranks (2, then 1), and a plain 4-thread read
of globalshard's files ("the disk"). The five loads take turns in each of 7
rounds, in the reverse order every other round: this disk's speed drifts
from minute to minute (one run's four-thread reads took 0.61-1.02 s for the
same GiB), and a fixed order would give each load the same place in every
drift. Each ratio is the median of the rounds' ratios, with their range
beside it. Writes build/bench/cold_load.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pagecache import evict, quiesce

QUICK = "--quick" in sys.argv
TENSORS, ROWS, COLS = (8, 512, 4096) if QUICK else (72, 1024, 3640)
REPS = int(os.environ.get("REPS", 7))
DISK_THREADS = 4


def _full(k: int) -> np.ndarray:
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + k


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _dcp_rank(rank: int, world: int, port: int, action: str, path: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=900))
    n = ROWS // world
    state: dict[str, Any] = {}
    for k in range(TENSORS):
        local = torch.from_numpy(_full(k)[rank * n:(rank + 1) * n].copy()) if action == "save" else \
            torch.ones(n, COLS)
        state[f"w{k}"] = DTensor.from_local(local, init_device_mesh("cpu", (world,)), [Shard(0)],
                                            run_check=False) if world > 1 else local
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    if action == "save":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - start
    if action == "load":
        last = state[f"w{TENSORS - 1}"]
        local = last.to_local() if hasattr(last, "to_local") else last
        if not np.array_equal(local.numpy(), _full(TENSORS - 1)[rank * n:(rank + 1) * n]):
            raise AssertionError("DCP loaded wrong values")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": seconds}, f)
    if world > 1:
        dist.destroy_process_group()
    os._exit(0)


def _dcp(world: int, action: str, path: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    if action == "load":
        evict(path)
    quiesce(path if os.path.exists(path) else os.path.dirname(path))
    mp.start_processes(_dcp_rank, args=(world, _port(), action, path, out), nprocs=world, join=True,
                       start_method="spawn")
    with open(out) as f:
        seconds = float(json.load(f)["seconds"])
    os.unlink(out)
    return seconds


def _targets(tp: int) -> dict[str, Any]:
    import globalshard as gs

    n = ROWS // tp
    return {f"w{k}@{r}": gs.ShardedTensor.from_offset(f"w{k}", np.ones((n, COLS), np.float32),
                                                      global_shape=(ROWS, COLS), global_offset=(r * n, 0))
            for k in range(TENSORS) for r in range(tp)}


def _globalshard(path: str, tp: int) -> float:
    import globalshard as gs

    targets = _targets(tp)  # touched before the clock starts, as a trainer's tensors are
    evict(path)
    quiesce(path)
    start = time.perf_counter()
    gs.load(targets, path)
    seconds = time.perf_counter() - start
    last = targets[f"w{TENSORS - 1}@{tp - 1}"]
    n = ROWS // tp
    if not np.array_equal(last.data, _full(TENSORS - 1)[(tp - 1) * n:tp * n]):
        raise AssertionError("globalshard loaded wrong values")
    return seconds


def _disk(path: str) -> float:
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if "/c/" in os.path.join(d, f))
    buffers = [np.ones(os.path.getsize(p), np.uint8) for p in files]  # touched: faults are not reads

    def read(i: int) -> None:
        for k in range(i, len(files), DISK_THREADS):
            with open(files[k], "rb", buffering=0) as f:
                f.readinto(memoryview(buffers[k]))

    evict(path)
    quiesce(path)
    start = time.perf_counter()
    threads = [threading.Thread(target=read, args=(i,)) for i in range(DISK_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    import globalshard as gs

    base = os.environ.get("BENCH_DIR", "build")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="globalshard-cold-", dir=base)
    try:
        ours, theirs = os.path.join(tmp, "globalshard"), os.path.join(tmp, "dcp")
        n = ROWS // 4
        state = {f"w{k}@{r}": gs.ShardedTensor.from_offset(f"w{k}", _full(k)[r * n:(r + 1) * n].copy(),
                                                           global_shape=(ROWS, COLS), global_offset=(r * n, 0))
                 for k in range(TENSORS) for r in range(4)}
        gs.save(state, ours)  # the TP=4 layout (one process writes what four would)
        del state
        _dcp(4, "save", theirs)
        stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ours) for f in fs
                     if "/c/" in os.path.join(d, f))
        rounds: list[dict[str, float]] = []
        for rep in range(REPS):
            loads: list[tuple[str, Any]] = [
                ("disk_s", lambda: _disk(ours)), ("globalshard_tp2_s", lambda: _globalshard(ours, 2)),
                ("globalshard_tp1_s", lambda: _globalshard(ours, 1)), ("dcp_tp2_s", lambda: _dcp(2, "load", theirs)),
                ("dcp_tp1_s", lambda: _dcp(1, "load", theirs))]
            if rep % 2:
                loads.reverse()
            print(f"round {rep + 1} of {REPS}: {', '.join(name[:-2] for name, _ in loads)} ...", flush=True)
            rounds.append({name: run() for name, run in loads})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    state_bytes = TENSORS * ROWS * COLS * 4

    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rounds)

    cases = []
    for tp in (2, 1):
        vs_dcp = [r[f"dcp_tp{tp}_s"] / r[f"globalshard_tp{tp}_s"] for r in rounds]
        cases.append({"load": f"TP=4 -> {tp}, one process", "globalshard_gbs": state_bytes / 1e9 / med(
            lambda r, tp=tp: r[f"globalshard_tp{tp}_s"]), "dcp_gbs": state_bytes / 1e9 / med(
            lambda r, tp=tp: r[f"dcp_tp{tp}_s"]), "disk_gbs": state_bytes / 1e9 / med(lambda r: r["disk_s"]),
            "globalshard_vs_disk": med(lambda r, tp=tp: r["disk_s"] / r[f"globalshard_tp{tp}_s"]),
            "globalshard_vs_dcp": statistics.median(vs_dcp), "globalshard_vs_dcp_range": [min(vs_dcp), max(vs_dcp)]})
    report = {"quick": QUICK, "state_bytes": state_bytes, "stored_bytes": stored, "tensors": TENSORS,
              "rounds": rounds, "disk_threads": DISK_THREADS, "cases": cases,
              # The worse of the two loads, under the names of report.json.
              "load_cold_one_process_vs_disk": min(c["globalshard_vs_disk"] for c in cases),
              "load_cold_one_process_vs_dcp": min(c["globalshard_vs_dcp"] for c in cases)}
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/cold_load.json", "w") as f:
        json.dump(report, f, indent=1)
    print("| load | globalshard GB/s | DCP GB/s | disk GB/s | globalshard / disk | globalshard / DCP |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in cases:
        print(f"| {c['load']} | {c['globalshard_gbs']:.2f} | {c['dcp_gbs']:.2f} | {c['disk_gbs']:.2f} | "
              f"{c['globalshard_vs_disk']:.2f} | {c['globalshard_vs_dcp']:.2f} |")


if __name__ == "__main__":
    main()
