"""The fast tier against the persistent tier alone.

    .venv/bin/python bench/tiers.py [--quick]

8 gloo processes as 4 nodes of 2 (each node's tier a directory of its own),
the persistent tier on a moto S3 server on 127.0.0.1. The state: 8 float32
tensors of 1024 x 4096 rows-cut over the 8 ranks (128 MiB; ``--quick``: 16
MiB). Each save measured is the job's second (its first started its
process's writer, TensorStore contexts and the like). Measured, median of
3 rounds:

1. the time a save stops training: ``TieredManager.save`` (every node's copy
   and its replica committed; the drain to S3 then runs in the background)
   against ``globalshard.save`` straight to S3, and ``TieredManager.save`` with
   an ``AsyncSaver`` (process mode: it returns once the arrays are in its
   staging pool; the tier copies and their commit follow in the background);
2. one node lost (its directory deleted), recovery on the 6 ranks of the 3
   others with another cut (6 row blocks): ``TieredManager.load_latest``
   against ``globalshard.load`` from S3, and the bytes recovery read from
   S3 over the bytes the lost node held.

Writes build/bench/tiers.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

QUICK = "--quick" in sys.argv
TENSORS, ROWS, COLS = (8, 256, 2048) if QUICK else (8, 1024, 4096)
PER_NODE, REPS = 2, 1 if QUICK else 3


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _full(k: int) -> np.ndarray:
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + k


def _state(rank: int, world: int, zeros: bool) -> dict[str, Any]:
    import globalshard as gs

    n = ROWS // world
    return {f"w{k}": gs.ShardedTensor.from_offset(f"w{k}", np.zeros((n, COLS), np.float32) if zeros else
                                                  _full(k)[rank * n:(rank + 1) * n].copy(),
                                                  global_shape=(ROWS, COLS), global_offset=(rank * n, 0))
            for k in range(TENSORS)}


def _rank(rank: int, world: int, port: int, job: dict[str, Any], out: str) -> None:
    import globalshard as gs
    from globalshard_torch.comm import TorchComm

    os.environ.update(job["env"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    comm = TorchComm()
    nodes = job["nodes"]
    tier = gs.LocalTier(lambda node: os.path.join(job["local"], f"node{nodes[node]}"), replicas=1, keep=2,
                        ranks_per_node=PER_NODE)
    manager = gs.TieredManager(tiers=[tier, job["persistent"]], comm=comm, kvstore=job["spec"])
    result: dict[str, Any] = {}
    saver = gs.AsyncSaver("process")
    if job["action"].endswith("save"):  # a save like the job's every other one: its process and writer started
        warm = {"tier save": lambda: manager.save(job["step"] - 1, _state(rank, world, False)),
                "tier async save": lambda: manager.save(job["step"] - 1, _state(rank, world, False), saver=saver),
                "plain save": lambda: gs.save(_state(rank, world, False), f"plain/{job['step']}-warm",
                                              kvstore=job["spec"], comm=comm)}
        warm[job["action"]]()
        manager.wait()
    state = _state(rank, world, False)
    comm.barrier()
    start = time.perf_counter()
    if job["action"] == "tier save":
        manager.save(job["step"], state)
        comm.barrier()
        result["seconds"] = time.perf_counter() - start
        manager.wait()
    elif job["action"] == "tier async save":
        manager.save(job["step"], state, saver=saver)
        # Not comm.barrier(): a collective of globalshard's waits for the save's background ones.
        result["seconds"] = time.perf_counter() - start
        saver.wait()  # the tier copies committed (the drain runs on)
        result["copies_s"] = time.perf_counter() - start
        manager.wait()
        if saver.last_mode != "process":
            raise AssertionError(f"rank {rank}: the save ran in {saver.last_mode} mode")
    elif job["action"] == "plain save":
        gs.save(state, f"plain/{job['step']}", kvstore=job["spec"], comm=comm)
        comm.barrier()
        result["seconds"] = time.perf_counter() - start
    elif job["action"] == "tier load":
        state = _state(rank, world, True)
        manager.load_latest(state)
        comm.barrier()
        result["seconds"] = time.perf_counter() - start
        rec = manager.recovery
        result |= {"bytes_persistent": rec.bytes_persistent, "bytes_peer": rec.bytes_peer,
                   "bytes_local": rec.bytes_local}
        _check(state, rank, world)
    else:
        state = _state(rank, world, True)
        gs.load(state, f"plain/{job['step']}", kvstore=job["spec"], comm=comm)
        comm.barrier()
        result["seconds"] = time.perf_counter() - start
        _check(state, rank, world)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    comm.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _check(state: dict[str, Any], rank: int, world: int) -> None:
    n = ROWS // world
    for k in range(TENSORS):
        if not np.array_equal(state[f"w{k}"].data, _full(k)[rank * n:(rank + 1) * n]):
            raise AssertionError(f"rank {rank}: wrong values in w{k}")


def _job(world: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    out = tempfile.mkdtemp()
    try:
        mp.start_processes(_rank, args=(world, _port(), job, out), nprocs=world, join=True, start_method="spawn")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _moto(tmp: str) -> tuple[Any, dict[str, Any], dict[str, str]]:
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(os.path.join(tmp, "moto.log"), "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **env})
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("moto did not start") from None
            time.sleep(0.1)
    import boto3

    os.environ.update(env)
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="ckpt")
    spec = {"driver": "s3", "bucket": "ckpt", "endpoint": f"http://127.0.0.1:{port}", "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"}}
    return proc, spec, env


def main() -> None:
    base = os.environ.get("BENCH_DIR", "build")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="globalshard-tiers-", dir=base)
    proc, spec, env = _moto(tmp)
    rounds = []
    try:
        for rep in range(REPS):
            print(f"round {rep + 1} of {REPS}: tier save, plain save, node 2 lost, tier load, plain load ...",
                  flush=True)
            local = os.path.join(tmp, f"local{rep}")
            common = {"env": env, "spec": spec, "local": local, "persistent": f"run{rep}", "step": 100}
            tier_save = _job(8, {**common, "action": "tier save", "nodes": [0, 1, 2, 3]})
            plain_save = _job(8, {**common, "action": "plain save", "nodes": [0, 1, 2, 3], "step": 100 + rep})
            async_save = _job(8, {**common, "action": "tier async save", "nodes": [0, 1, 2, 3],
                                  "local": local + "-async", "persistent": f"run{rep}-async"})
            lost = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(local, "node2"))
                       for f in fs if "/c/" in os.path.join(d, f) and "iter_0000100" in d)
            own = lost // 2  # replicas=1: node 2 held its own arrays and node 1's, half each
            shutil.rmtree(os.path.join(local, "node2"))
            tier_load = _job(6, {**common, "action": "tier load", "nodes": [0, 1, 3]})
            plain_load = _job(6, {**common, "action": "plain load", "nodes": [0, 1, 3], "step": 100 + rep})
            rounds.append({
                "tier_save_s": max(r["seconds"] for r in tier_save),
                "plain_save_s": max(r["seconds"] for r in plain_save),
                "tier_async_save_s": max(r["seconds"] for r in async_save),
                "tier_async_copies_s": max(r["copies_s"] for r in async_save),
                "tier_load_s": max(r["seconds"] for r in tier_load),
                "plain_load_s": max(r["seconds"] for r in plain_load),
                "bytes_persistent": sum(r["bytes_persistent"] for r in tier_load),
                "bytes_peer": sum(r["bytes_peer"] for r in tier_load),
                "lost_node_own_bytes": own,
            })
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "quick": QUICK, "state_bytes": TENSORS * ROWS * COLS * 4, "nodes": 4, "ranks_per_node": PER_NODE,
        "replicas": 1, "rounds": rounds,
        "tier_local_save_vs_persistent_save": statistics.median(r["tier_save_s"] / r["plain_save_s"] for r in rounds),
        "tier_async_save_vs_tier_save": statistics.median(r["tier_async_save_s"] / r["tier_save_s"] for r in rounds),
        "tier_recovery_vs_persistent_recovery": statistics.median(r["tier_load_s"] / r["plain_load_s"]
                                                                  for r in rounds),
        "tier_persistent_bytes_over_lost_node_bytes": statistics.median(r["bytes_persistent"] /
                                                                        r["lost_node_own_bytes"] for r in rounds),
    }
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/tiers.json", "w") as f:
        json.dump(report, f, indent=1)
    for key in ("tier_local_save_vs_persistent_save", "tier_async_save_vs_tier_save",
                "tier_recovery_vs_persistent_recovery", "tier_persistent_bytes_over_lost_node_bytes"):
        print(f"{key}: {report[key]:.3f}")


if __name__ == "__main__":
    main()
