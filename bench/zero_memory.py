"""Peak memory of a distributed optimizer's save and load, per rank.

    .venv/bin/python bench/zero_memory.py [--quick]

Four gloo processes (DP=4, Megatron-Core's DistributedOptimizer layout) each
hold their pieces of the fp32 main weights and both Adam moments of a model
of 8 linear layers (``--quick``: smaller). Each rank saves its pieces, then a
fresh set of pieces is allocated and loaded at DP=4. Reported per rank: the
bytes of its own pieces, and how much the save and the load raised its peak
RSS above what it held before (``ru_maxrss``), next to the state of the
largest parameter and of the whole model, which a rank that gathered a
parameter's (or everyone's) state would need. Writes
build/bench/zero_memory.json.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import globalshard as gs
import globalshard_torch as gt

DP = 4
ITEMS = ("exp_avg", "exp_avg_sq", "master")


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, port: int, path: str, width: int, layers: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DP,
                            timeout=timedelta(seconds=600))
    model = _model(width, layers)
    rules = gt.ShardingRules([(".*", gt.Replicated())])
    layout = gt.ParallelLayout(dp_rank=rank, dp_size=DP)
    params = list(model.parameters())

    def pieces(fill: bool) -> list[gt.FlatShard]:
        out = []
        for p, start, stop in gt.megatron_param_ranges(params, dp_size=DP, dp_rank=rank, bucket_size=40_000_000):
            state = {item: (torch.randn(stop - start) if fill else torch.zeros(stop - start)) for item in ITEMS}
            out.append(gt.FlatShard(p, start, stop, state))
        return out

    mine = pieces(True)
    own = sum(t.numel() * 4 for fs in mine for t in fs.state.values())
    saved = gs.IOStats()
    before = _peak()
    gt.save_checkpoint(path, model=model, layout=layout, rules=rules, optimizer_shards=mine, overwrite=True,
                       stats=saved)
    after_save = _peak()
    del mine
    fresh = pieces(False)
    for fs in fresh:
        for t in fs.state.values():
            t.fill_(1.0)  # touch the pages: the targets' memory is counted before the load, not in it
    before_load = _peak()
    loaded = gt.load_checkpoint(path, model=model, layout=layout, rules=rules, optimizer_shards=fresh).stats
    after_load = _peak()
    result = {"rank": rank, "own_state_bytes": own, "bytes_written": saved.bytes_written,
              "save_peak_rise_bytes": after_save - before, "bytes_read": loaded.bytes_read,
              "load_peak_rise_bytes": after_load - before_load}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    quick = "--quick" in sys.argv
    width, layers = (1024, 4) if quick else (2048, 8)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(port, os.path.join(tmp, "ckpt"), width, layers, tmp), nprocs=DP,
                           join=True, start_method="spawn")
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(DP)]
    param = width * width * 4
    report: dict[str, Any] = {
        "dp": DP, "layers": layers, "width": width,
        "largest_parameter_state_bytes": param * len(ITEMS),
        "whole_model_state_bytes": param * layers * len(ITEMS),
        "ranks": ranks,
    }
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/zero_memory.json", "w") as f:
        json.dump(report, f, indent=1)
    mib = 2**20
    print(f"distributed optimizer, DP={DP}, {layers} x [{width}, {width}] fp32, 3 state items: "
          f"whole state {report['whole_model_state_bytes'] / mib:.0f} MiB, "
          f"largest parameter's {report['largest_parameter_state_bytes'] / mib:.0f} MiB")
    print("| rank | own pieces MiB | save: wrote MiB | save: peak RSS rise MiB | load: read MiB "
          "| load: peak RSS rise MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in ranks:
        print(f"| {r['rank']} | {r['own_state_bytes'] / mib:.0f} | {r['bytes_written'] / mib:.0f} "
              f"| {r['save_peak_rise_bytes'] / mib:.0f} | {r['bytes_read'] / mib:.0f} "
              f"| {r['load_peak_rise_bytes'] / mib:.0f} |")


if __name__ == "__main__":
    main()
