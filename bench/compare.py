"""globalshard against the disk and against torch DCP, on the same state.

    .venv/bin/python bench/compare.py [--quick]

The state: 8 float32 matrices (1 GiB; ``--quick``: 64 MiB) held as DTensors
sharded on rows. Saved at TP=4 by 4 gloo processes, loaded at TP=2 by 2
processes and at TP=1 by one, warm (page cache) and cold (each file evicted
with posix_fadvise). Every system does the same: globalshard through
``globalshard_torch.save/load`` (crc32c verified on every byte read), DCP
through ``torch.distributed.checkpoint.save/load`` with its default
filesystem writer, Orbax (when installed: ``.[bench]``) through
bench/orbax_bench.py with jax's 4 forced CPU devices. The physical limits: 4 processes (as the
save's 4 ranks) writing the same bytes to files with fsync, and 4 threads
reading them back warm and cold. The disk, globalshard
and DCP take turns in each of 3 rounds (``REPS=n``: n); each figure is the
median over the rounds, and each ratio the median of the rounds' ratios
(this disk's write speed changes by up to 3x within minutes, so a ratio is
only taken between runs of the same round). Speeds are GB/s of state. Then
globalshard at 0.25, 0.5, 1 and 2 GiB, each size in rounds with the raw
4-process write of the same bytes, to see that time grows linearly with
size. Every timed write goes to new files, and nothing is deleted until the
run ends, after waiting out earlier deletions first (pagecache.settle: on
this disk a write soon after a deletion runs several times faster).
Writes build/bench/compare.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import statistics
import subprocess
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
from pagecache import SETTLE_S, evict, quiesce, settle

QUICK = "--quick" in sys.argv
TENSORS = 8
ROWS, COLS = (256, 2048) if QUICK else (8192, 4096)
STATE = TENSORS * ROWS * COLS * 4
REPS = int(os.environ.get("REPS", 3))


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _full(k: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + k


def _state(world: int, zeros: bool, tensors: int = TENSORS) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if world == 1:
        return {f"w{k}": (torch.zeros(ROWS, COLS) if zeros else _full(k)) for k in range(tensors)}
    mesh = init_device_mesh("cpu", (world,))
    rank, n = dist.get_rank(), ROWS // world
    out = {}
    for k in range(tensors):  # each rank holds its own rows only, as a trainer's rank does
        local = torch.zeros(n, COLS) if zeros else _full(k)[rank * n:(rank + 1) * n].clone()
        out[f"w{k}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return out


def _rank(rank: int, world: int, port: int, system: str, action: str, path: str, out: str,
          tensors: int = TENSORS) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it (globalshard shares its I/O threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=900))
    state = _state(world, zeros=action != "save", tensors=tensors)
    # Imports before the clock starts: a trainer has its checkpoint library loaded long before it saves.
    import torch.distributed.checkpoint as dcp

    import globalshard_torch as gt

    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    if system == "globalshard":
        if action == "save":
            gt.save(state, path, overwrite=True)
        else:
            gt.load(state, path)
    else:
        if action == "save":
            dcp.save(state, checkpoint_id=path)
        else:
            dcp.load(state, checkpoint_id=path)
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - start
    if system == "globalshard":  # the replaced checkpoint's deletion ends before the next run starts
        import globalshard

        globalshard.wait_for_cleanup()
    if action != "save":  # the loaded values are right
        last = tensors - 1
        t = state[f"w{last}"]
        local = t.to_local() if hasattr(t, "to_local") else t
        n = ROWS // world
        if not torch.equal(local, _full(last)[rank * n:(rank + 1) * n]):
            raise AssertionError(f"{system} loaded wrong values")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": seconds}, f)
    if world > 1:
        dist.destroy_process_group()
    os._exit(0)


def _run(world: int, system: str, action: str, path: str, tensors: int = TENSORS) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    quiesce(path if os.path.exists(path) else os.path.dirname(path))  # nothing earlier still being written or trimmed
    if world == 1:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_rank, args=(0, 1, 0, system, action, path, out, tensors))
        p.start()
        p.join()
    else:
        mp.start_processes(_rank, args=(world, _port(), system, action, path, out, tensors), nprocs=world,
                           join=True, start_method="spawn")
    with open(out) as f:
        seconds = json.load(f)["seconds"]
    os.unlink(out)
    return seconds


def _raw_writer(rank: int, world: int, paths: list[str], tensors: int, barrier: Any, out: Any) -> None:
    """One process of the raw write: this rank's rows of every tensor, each a
    file written whole and fsynced, timed between two barriers."""
    n = ROWS // world
    data = [_full(k)[rank * n:(rank + 1) * n].clone().numpy() for k in range(tensors)]  # only its rows, as a rank
    barrier.wait()
    start = time.perf_counter()
    for k in range(tensors):
        with open(paths[rank * tensors + k], "wb") as f:
            f.write(memoryview(data[k]).cast("B"))
            f.flush()
            os.fsync(f.fileno())
    barrier.wait()
    if rank == 0:
        out.put(time.perf_counter() - start)


def _raw(root: str, tag: str, tensors: int = TENSORS, reads: bool = True) -> dict[str, float]:
    """The disk's limits, once: 4 fresh processes (as the save's 4 ranks) each
    write their rows of every tensor as files with fsync; then 4 threads read
    the files back, warm and cold. New files, as a save writes, kept until the
    run ends."""
    world = 4
    paths = [os.path.join(root, f"{tag}-r{r}-{k}.bin") for r in range(world) for k in range(tensors)]
    ctx = mp.get_context("spawn")
    barrier, times = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_raw_writer, args=(r, world, paths, tensors, barrier, times)) for r in range(world)]
    quiesce(root)
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"raw writer exited with {p.exitcode}")
    out = {"write_s": float(times.get(timeout=60))}
    if not reads:
        return out
    buffers = [np.ones(os.path.getsize(p), dtype=np.uint8) for p in paths]  # touched: faults are not reads

    def read(i: int) -> None:
        for k in range(i, len(paths), 4):
            with open(paths[k], "rb", buffering=0) as f:
                f.readinto(memoryview(buffers[k]))

    def threads() -> float:
        start = time.perf_counter()
        workers = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    out["read_warm_s"] = threads()
    evict(root)
    out["read_cold_s"] = threads()
    return out


def _system(tmp: str, system: str, rep: int) -> dict[str, float]:
    path = os.path.join(tmp, f"{system}{rep}")
    out = {"save_s": _run(4, system, "save", path)}
    _run(2, system, "load", path)  # warms the page cache
    out["load_tp2_warm_s"] = _run(2, system, "load", path)
    out["load_tp1_warm_s"] = _run(1, system, "load", path)
    evict(path)
    out["load_tp2_cold_s"] = _run(2, system, "load", path)
    return out


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


#: Each headline ratio: (numerator system, its figure, globalshard's figure); a
#: ratio above 1 means globalshard took less time.
RATIOS = {
    "save_vs_disk": ("raw", "write_s", "save_s"),
    "save_vs_dcp": ("dcp", "save_s", "save_s"),
    "load_warm_vs_page_cache": ("raw", "read_warm_s", "load_tp2_warm_s"),
    "load_warm_vs_dcp": ("dcp", "load_tp2_warm_s", "load_tp2_warm_s"),
    "load_tp1_warm_vs_dcp": ("dcp", "load_tp1_warm_s", "load_tp1_warm_s"),
    "load_cold_vs_disk": ("raw", "read_cold_s", "load_tp2_cold_s"),
    "load_cold_vs_dcp": ("dcp", "load_tp2_cold_s", "load_tp2_cold_s"),
}


def main() -> None:
    report: dict[str, Any] = {"state_bytes": STATE, "quick": QUICK}
    base = os.environ.get("BENCH_DIR", "build")
    os.makedirs(base, exist_ok=True)
    # Nothing is deleted until the run ends (a timed write soon after a deletion
    # runs faster on this disk, see pagecache.settle): about 40 GiB on disk at the end.
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        if not QUICK:
            print(f"waiting {SETTLE_S:.0f} s for earlier deletions to settle ...", flush=True)
            settle()
        # The disk, globalshard and DCP take turns within each round, so that each
        # round's ratios compare runs made minutes apart at most: this disk's write
        # speed changes by up to 3x from one minute to the next (see docs/benchmarks.md).
        rounds: dict[str, list[dict[str, float]]] = {"raw": [], "globalshard": [], "dcp": []}
        for rep in range(REPS):
            print(f"round {rep + 1} of {REPS}: raw disk, globalshard, dcp ...", flush=True)
            rounds["raw"].append(_raw(tmp, f"raw{rep}"))
            for system in ("globalshard", "dcp"):
                rounds[system].append(_system(tmp, system, rep))
        report["rounds"] = rounds
        for system, figures in rounds.items():
            report[system] = _medians(figures)
        if importlib.util.find_spec("orbax") is not None:
            print("orbax ...", flush=True)
            out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "orbax_bench.py"), tmp,
                                  str(ROWS), str(COLS), str(TENSORS)], check=True, capture_output=True, text=True)
            report["orbax"] = json.loads(out.stdout.strip().splitlines()[-1])
        else:
            print("orbax: not installed (pip install -e '.[bench]'), left out", flush=True)
        # Linear in the state's size: globalshard's TP=4 save (with the raw write
        # of the same bytes in the same round) and TP4->2 warm load.
        report["size_curve"] = []
        per = ROWS * COLS * 4
        for tensors in ((1, 2) if QUICK else (2, 4, 8, 16)):
            print(f"size curve: {tensors * per / 2**30:.2f} GiB ...", flush=True)
            curve: list[dict[str, float]] = []
            for rep in range(REPS):
                path = os.path.join(tmp, f"curve{tensors}-{rep}")
                raw_s = _raw(tmp, f"curve{tensors}-raw{rep}", tensors, reads=False)["write_s"]
                save_s = _run(4, "globalshard", "save", path, tensors)
                _run(2, "globalshard", "load", path, tensors)
                curve.append({"save_s": save_s, "raw_write_s": raw_s, "save_over_raw": save_s / raw_s,
                              "load_tp2_warm_s": _run(2, "globalshard", "load", path, tensors)})
            report["size_curve"].append({"bytes": tensors * per, **_medians(curve)})
    # Median over the rounds of each round's ratio (not a ratio of medians).
    report["ratios"] = {name: statistics.median(rounds[other][i][theirs] / rounds["globalshard"][i][ours]
                                                for i in range(REPS))
                        for name, (other, theirs, ours) in RATIOS.items()}
    gs_, dcp, raw = report["globalshard"], report["dcp"], report["raw"]
    if "orbax" in report:
        orbax = report["orbax"]
        if "globalshard_jax" in orbax:
            gj_ = orbax["globalshard_jax"]
            report["ratios"] |= {"jax_save_vs_orbax": orbax["save_s"] / gj_["save_s"],
                                 "jax_load_warm_vs_orbax": orbax["load_tp2_warm_s"] / gj_["load_tp2_warm_s"]}
        report["ratios"] |= {"save_vs_orbax": orbax["save_s"] / gs_["save_s"],
                             "load_warm_vs_orbax": orbax["load_tp2_warm_s"] / gs_["load_tp2_warm_s"],
                             "load_cold_vs_orbax": orbax["load_tp2_cold_s"] / gs_["load_tp2_cold_s"]}
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/compare.json", "w") as f:
        json.dump(report, f, indent=1)
    gb = STATE / 1e9

    def rate(s: float) -> str:
        return f"{gb / s:.2f}"

    print(f"\n{STATE / 2**30:.2f} GiB of float32, GB/s of state (median of {REPS}):\n")
    print("| | save TP=4 | load TP4->2 warm | load TP4->2 cold | load TP4->1 warm |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| disk (4 processes, fsync) / page cache (4 threads) | {rate(raw['write_s'])} | {rate(raw['read_warm_s'])} "
          f"| {rate(raw['read_cold_s'])} | |")
    systems = [("globalshard", gs_), ("torch DCP", dcp)]
    if "orbax" in report:
        systems.append(("Orbax (jax, 4 CPU devices)", report["orbax"]))
        if "globalshard_jax" in report["orbax"]:
            systems.append(("globalshard_jax (same jax arrays)", report["orbax"]["globalshard_jax"]))
    for name, r in systems:
        print(f"| {name} | {rate(r['save_s'])} | {rate(r['load_tp2_warm_s'])} | {rate(r['load_tp2_cold_s'])} "
              f"| {rate(r['load_tp1_warm_s'])} |")
    print("\n| state GiB | save s | save GB/s | raw write+fsync s | save / raw | load TP4->2 warm s | load GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in report["size_curve"]:
        print(f"| {c['bytes'] / 2**30:.2f} | {c['save_s']:.2f} | {c['bytes'] / 1e9 / c['save_s']:.2f} "
              f"| {c['raw_write_s']:.2f} | {c['save_over_raw']:.2f} "
              f"| {c['load_tp2_warm_s']:.2f} | {c['bytes'] / 1e9 / c['load_tp2_warm_s']:.2f} |")
    print()
    for k, v in report["ratios"].items():
        print(f"{k}: {v:.2f}")


if __name__ == "__main__":
    main()
