"""The CUDA paths, measured on a machine with a GPU (a few minutes; none here).

    .venv/bin/python bench/gpu.py [OUT.json] [--cpu]

1. Staging bandwidth: device-to-host copies of a GPU-resident state (1 GiB
   of float32 in 16 tensors) into the ``AsyncSaver``'s page-locked host pool
   through ``HostStaging`` (side stream, an event per tensor), against a
   plain ``copy_`` of the same bytes into pinned buffers.
2. The time an async save of that state (``save_checkpoint(..., saver=)``,
   process mode) blocks the caller, against the staging copy alone, for the
   first save and the saves after it (the pool is reused).
3. A resharding load into GPU tensors: the state saved as 2 row halves,
   loaded into 4 row quarters on the device; wall time and GB/s.

Writes OUT.json (default build/bench/gpu.json). Without CUDA it writes
``{"skipped": ...}``, prints why, and exits 0. ``--cpu`` runs the same steps
on CPU tensors at a small size (nothing is staged there), so that a test
keeps the script working for the first machine with a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

CPU = "--cpu" in sys.argv
_ARGS = [a for a in sys.argv[1:] if a != "--cpu"]
OUT = _ARGS[0] if _ARGS else os.path.join("build", "bench", "gpu.json")
TENSORS, ROWS, COLS = (4, 256, 256) if CPU else (16, 4096, 4096)  # 1 GiB of float32 on a GPU
REPS = 3


def _write(report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(OUT) or ".", exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


def main() -> None:
    if not torch.cuda.is_available() and not CPU:
        print("bench/gpu.py: no CUDA device here; nothing measured (run it on a machine with a GPU)")
        _write({"skipped": "no CUDA device"})
        return
    import globalshard as gs
    import globalshard_torch as gt
    from globalshard_torch.tensors import HostStaging

    device = torch.device("cpu" if CPU else "cuda")
    synchronize = torch.cuda.synchronize if not CPU else (lambda: None)
    torch.manual_seed(0)
    model = nn.ModuleList(nn.Linear(COLS, ROWS, bias=False) for _ in range(TENSORS)).to(device)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report: dict[str, Any] = {"device": "cpu" if CPU else torch.cuda.get_device_name(), "state_bytes": state_bytes,
                              "torch": torch.__version__}

    # 1. Staging bandwidth: HostStaging into the saver's pool, against pinned copy_.
    saver = gs.AsyncSaver("process")
    pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=not CPU) for p in model.parameters()]
    plain, staged = [], []
    saver.host_pool.wanted = state_bytes  # the pool is sized by the first staging, then reused
    for _ in range(REPS):
        synchronize()
        start = time.perf_counter()
        for dst, p in zip(pinned, model.parameters()):
            dst.copy_(p.detach(), non_blocking=True)
        synchronize()
        plain.append(time.perf_counter() - start)
        staging = HostStaging(overlap=True, pool=saver.host_pool)
        synchronize()
        start = time.perf_counter()
        bufs = [staging.host(p, for_save=True) for p in model.parameters()]
        staging.ready()
        staging.wait_all()  # every copy landed
        staged.append(time.perf_counter() - start)
        assert CPU or all(saver.host_pool.offset_of(gt.numpy_view(b)) is not None for b in bufs)
    report["staging"] = {"pinned_copy_s": statistics.median(plain), "host_staging_s": statistics.median(staged),
                         "pinned_copy_gbs": state_bytes / 1e9 / statistics.median(plain),
                         "host_staging_gbs": state_bytes / 1e9 / statistics.median(staged),
                         "host_staging_over_pinned_copy": statistics.median(s / p for s, p in zip(staged, plain))}

    # 2. An async save's blocking time.
    rules, layout = gt.ShardingRules([(r".*", gt.Replicated())]), gt.ParallelLayout()
    root = tempfile.mkdtemp(prefix="globalshard-gpu-", dir=os.path.dirname(OUT) or ".")
    blocking = []
    for i in range(REPS + 1):
        start = time.perf_counter()
        gt.save_checkpoint(os.path.join(root, f"s{i}"), model=model, layout=layout, rules=rules, saver=saver)
        blocking.append(time.perf_counter() - start)
        saver.wait()
    report["async_save"] = {"first_blocking_s": blocking[0], "blocking_s": statistics.median(blocking[1:]),
                            "blocking_over_staging": statistics.median(blocking[1:]) /
                            report["staging"]["host_staging_s"], "mode": saver.last_mode}

    # 3. A resharding load into GPU tensors: saved as 2 row halves, loaded as 4 quarters.
    halves = {f"w{k}@{r}": gs.ShardedTensor.from_offset(
        f"w{k}", p.detach().cpu()[r * ROWS // 2:(r + 1) * ROWS // 2].numpy(), global_shape=(ROWS, COLS),
        global_offset=(r * ROWS // 2, 0)) for k, p in enumerate(model.parameters()) for r in range(2)}
    gs.save(halves, os.path.join(root, "halves"))
    loads = []
    for _ in range(REPS):
        quarters = {f"w{k}@{r}": torch.zeros(ROWS // 4, COLS, device=device) for k in range(TENSORS) for r in range(4)}
        staging = HostStaging()
        targets = {name: gs.ShardedTensor.from_offset(
            name.split("@")[0], gt.numpy_view(staging.host(t, for_save=False)), global_shape=(ROWS, COLS),
            global_offset=(int(name.split("@")[1]) * ROWS // 4, 0)) for name, t in quarters.items()}
        synchronize()
        start = time.perf_counter()
        gs.load(targets, os.path.join(root, "halves"))
        staging.finish_load()
        synchronize()
        loads.append(time.perf_counter() - start)
        assert torch.equal(quarters["w3@2"].cpu(), list(model.parameters())[3].detach().cpu()[ROWS // 2:3 * ROWS // 4])
    report["load_to_gpu"] = {"seconds": statistics.median(loads), "gbs": state_bytes / 1e9 / statistics.median(loads)}
    saver.writer.close()
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    _write(report)


if __name__ == "__main__":
    main()
