"""Shared reads between data-parallel replicas: read once per group, sent over gloo.

    .venv/bin/python bench/shared_reads.py [--quick]

4 gloo processes load at TP=2 x DP=2 (each DP pair needs the same half of every
tensor) a state saved at TP=4, with ``shared_reads`` off and on: from a local
directory warm (page cache) and cold (files evicted), and from an S3-compatible
object store (moto's server on 127.0.0.1, a smaller state: it is a Python
server). Figures: seconds (median of 3), the bytes the group read from storage,
and the chunk GET requests the S3 server logged. Writes build/bench/shared_reads.json.
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
from compare import _port
from pagecache import evict

import globalshard as gs

QUICK = "--quick" in sys.argv
TENSORS = 8
LOCAL_ROWS = 512 if QUICK else 4096  # x 4096 float32 x 8 tensors: 64 MiB / 512 MiB
S3_ROWS = 64 if QUICK else 512  # 8 / 64 MiB
COLS = 4096
REPS = 1 if QUICK else 3


def _halves(rows: int, tp_rank: int, fill: bool) -> dict[str, gs.ShardedTensor]:
    n = rows // 2
    out = {}
    for k in range(TENSORS):
        data = (np.arange(n * COLS, dtype=np.float32).reshape(n, COLS) + k) if fill else np.zeros((n, COLS), np.float32)
        out[f"w{k}"] = gs.ShardedTensor.from_offset(f"w{k}", data, global_shape=(rows, COLS),
                                                    global_offset=(tp_rank * n, 0))
    return out


def _rank(rank: int, port: int, path: str, kvstore: Any, rows: int, shared: bool, out: str) -> None:
    from globalshard_torch.comm import TorchComm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=900))
    comm = TorchComm()
    targets = _halves(rows, rank % 2, fill=False)
    stats = gs.IOStats()
    comm.barrier()
    start = time.perf_counter()
    gs.load(targets, path, comm=comm, kvstore=kvstore, stats=stats, shared_reads=shared)
    comm.barrier()
    seconds = time.perf_counter() - start
    expected = _halves(rows, rank % 2, fill=True)
    ok = all(np.array_equal(targets[k].data, expected[k].data) for k in targets)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "ok": ok, "bytes_read": stats.bytes_read, "needed": stats.bytes_needed,
                   "received": stats.bytes_received}, f)
    dist.destroy_process_group()


def _run(path: str, kvstore: Any, rows: int, shared: bool) -> dict[str, Any]:
    out = tempfile.mkdtemp()
    try:
        mp.start_processes(_rank, args=(_port(), path, kvstore, rows, shared, out), nprocs=4, join=True,
                           start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert all(r["ok"] for r in ranks), "a rank loaded wrong values"
    return {"seconds": max(r["seconds"] for r in ranks), "group_bytes_read": sum(r["bytes_read"] for r in ranks),
            "group_bytes_needed": sum(r["needed"] for r in ranks), "bytes_received": sum(r["received"] for r in ranks)}


def _save(path: str, kvstore: Any, rows: int) -> None:
    n = rows // 4
    state = {}
    for k in range(TENSORS):
        full = np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS)
        # The values _halves expects: each half counts from 0 again, plus k.
        half = rows // 2
        full[half:] = full[:half]
        full += k
        for r in range(4):
            state[f"w{k}/{r}"] = gs.ShardedTensor.from_offset(f"w{k}", full[r * n:(r + 1) * n],
                                                              global_shape=(rows, COLS), global_offset=(r * n, 0))
    gs.save(state, path, kvstore=kvstore, overwrite=True)


def _cases(path: str, kvstore: Any, rows: int, before: Any, log: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shared in (False, True):
        runs = []
        for _ in range(REPS):
            before()
            gets = _gets(log, path) if log else 0
            res = _run(path, kvstore, rows, shared)
            if log:
                time.sleep(0.5)
                res["chunk_gets"] = _gets(log, path) - gets
            runs.append(res)
        best = dict(runs[0])
        best["seconds"] = statistics.median(r["seconds"] for r in runs)
        out["shared" if shared else "plain"] = best
    out["shared_over_plain_seconds"] = out["shared"]["seconds"] / out["plain"]["seconds"]
    out["shared_over_plain_bytes_read"] = out["shared"]["group_bytes_read"] / out["plain"]["group_bytes_read"]
    return out


def _gets(log: str, path: str) -> int:
    with open(log) as f:
        return sum(1 for line in f if f"GET /ckpt/{path}/saves/" in line and "zarr.json" not in line)


def _moto(tmp: str) -> tuple[subprocess.Popen[bytes], dict[str, Any], str]:
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    port = _port()
    log = os.path.join(tmp, "moto.log")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
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

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="ckpt")
    spec = {"driver": "s3", "bucket": "ckpt", "endpoint": f"http://127.0.0.1:{port}", "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"}}
    return proc, spec, log


def main() -> None:
    out_dir = os.path.join("build", "bench")
    os.makedirs(out_dir, exist_ok=True)
    report: dict[str, Any] = {"quick": QUICK, "layout": "saved TP=4, loaded TP=2 x DP=2 by 4 gloo processes"}
    tmp = tempfile.mkdtemp(prefix="globalshard-shared-", dir=out_dir)
    try:
        local = os.path.join(tmp, "ckpt")
        _save(local, None, LOCAL_ROWS)
        report["state_bytes_local"] = TENSORS * LOCAL_ROWS * COLS * 4
        report["local_warm"] = _cases(local, None, LOCAL_ROWS, lambda: None)
        report["local_cold"] = _cases(local, None, LOCAL_ROWS, lambda: evict(local))
        proc, spec, log = _moto(tmp)
        try:
            _save("s3ckpt", spec, S3_ROWS)
            report["state_bytes_s3"] = TENSORS * S3_ROWS * COLS * 4
            report["s3"] = _cases("s3ckpt", spec, S3_ROWS, lambda: None, log)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(out_dir, "shared_reads.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n### Shared reads ({report['layout']}; median of {REPS})\n")
    print("| storage | state MiB | plain s | shared s | shared / plain time | group bytes read, shared / plain "
          "| chunk GETs plain -> shared |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, size in (("local_warm", "state_bytes_local"), ("local_cold", "state_bytes_local"),
                       ("s3", "state_bytes_s3")):
        c = report[name]
        gets = f"{c['plain'].get('chunk_gets', '')} -> {c['shared'].get('chunk_gets', '')}" if name == "s3" else ""
        print(f"| {name} | {report[size] / 2**20:.0f} | {c['plain']['seconds']:.2f} | {c['shared']['seconds']:.2f} | "
              f"{c['shared_over_plain_seconds']:.2f} | {c['shared_over_plain_bytes_read']:.2f} | {gets} |")


if __name__ == "__main__":
    main()
