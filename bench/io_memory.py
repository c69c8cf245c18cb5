"""Peak memory of a save and of a resharding load, over the state they hold.

    .venv/bin/python bench/io_memory.py [--quick]

512 MiB of float32 (16 tensors; ``--quick``: 64 MiB) saved from TP=4 shards
and loaded into TP=2 targets, each step in a fresh process so that its peak
RSS (``ru_maxrss``) is its own. Reported: seconds, and how far the step
raised the process's peak above what it held before it (the state, or the
already-touched targets). The target is at most 10% of the state + 64 MiB.
Writes build/bench/io_memory.json.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import globalshard as gs

ROWS, COLS = 4096, 2048  # 32 MiB of float32 per tensor


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _save(root: str, tensors: int) -> dict[str, float]:
    state = {}
    for k in range(tensors):
        full = np.random.default_rng(k).standard_normal((ROWS, COLS), dtype=np.float32)
        n = ROWS // 4
        for r in range(4):
            state[f"{k}.{r}"] = gs.ShardedTensor.from_offset(f"t{k}", full[r * n:(r + 1) * n].copy(),
                                                             global_shape=(ROWS, COLS), global_offset=(r * n, 0))
        del full
    before = _peak()
    start = time.perf_counter()
    gs.save(state, root, overwrite=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "state_bytes": sum(s.data.nbytes for s in state.values()),
            "peak_rise_bytes": _peak() - before}


def _async(root: str, tensors: int) -> dict[str, float]:
    """Blocking time of async saves against a memcpy of the same bytes into a
    warm buffer: the first save (it allocates the snapshot buffer), then 3
    rounds of a memcpy and a save that reuses the buffer; ``second_*``: the
    medians of those rounds (the ratio: the median of their ratios). Each
    save goes to a new directory, as a trainer's step_N checkpoints do (one
    overwriting the path of the save before it waits for that save's
    deletion of the checkpoint it replaced, docs/limitations.md)."""
    state = {}
    for k in range(tensors):
        full = np.random.default_rng(k).standard_normal((ROWS, COLS), dtype=np.float32)
        state[f"{k}"] = gs.ShardedTensor.from_offset(f"t{k}", full, global_shape=(ROWS, COLS), global_offset=(0, 0))
    total = sum(t.data.nbytes for t in state.values())

    def memcpy() -> float:
        start = time.perf_counter()
        offset = 0
        for t in state.values():
            np.copyto(np.ndarray(t.data.shape, t.data.dtype, buffer=dest, offset=offset), t.data)
            offset += t.data.nbytes
        return time.perf_counter() - start

    def save() -> tuple[float, float]:
        start = time.perf_counter()
        saver.save(state, f"{root}-{len(saved)}")
        saved.append(None)
        blocking = saver.blocking_seconds
        saver.wait()
        return blocking, time.perf_counter() - start

    saver = gs.AsyncSaver()
    saved: list[None] = []
    out: dict[str, float] = {"state_bytes": total}
    # The first save's buffer takes pages the process used before, as a
    # trainer's would: this VM's host backs memory never touched since boot
    # lazily, 3-7 s for 512 MiB (docs/benchmarks.md).
    dest = np.zeros(total, np.uint8)
    memcpy()
    del dest
    out["first_blocking_s"], out["first_total_s"] = save()
    dest = np.zeros(total, np.uint8)
    memcpy()  # into a warm buffer from here on
    rounds = [(memcpy(), *save()) for _ in range(3)]
    out["memcpy_s"] = statistics.median(r[0] for r in rounds)
    out["second_blocking_s"] = statistics.median(r[1] for r in rounds)
    out["second_total_s"] = statistics.median(r[2] for r in rounds)
    out["second_blocking_over_memcpy"] = statistics.median(r[1] / r[0] for r in rounds)
    return out


def _load(root: str, tensors: int) -> dict[str, float]:
    n = ROWS // 2
    targets = {f"{k}.{r}": gs.ShardedTensor.from_offset(f"t{k}", np.ones((n, COLS), np.float32),
                                                        global_shape=(ROWS, COLS), global_offset=(r * n, 0))
               for k in range(tensors) for r in range(2)}
    before = _peak()
    start = time.perf_counter()
    gs.load(targets, root)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "state_bytes": sum(t.data.nbytes for t in targets.values()),
            "peak_rise_bytes": _peak() - before}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] in ("--save", "--load", "--async"):
        fn = {"--save": _save, "--load": _load, "--async": _async}[sys.argv[1]]
        print(json.dumps(fn(sys.argv[2], int(sys.argv[3]))))
        return
    tensors = 2 if "--quick" in sys.argv else 16
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ckpt")
        for step in ("save", "load"):
            runs = [json.loads(subprocess.run([sys.executable, __file__, f"--{step}", root, str(tensors)],
                                              check=True, capture_output=True, text=True).stdout)
                    for _ in range(3)]
            report[step] = sorted(runs, key=lambda r: r["peak_rise_bytes"])[1]  # the median by peak
    for step in report.values():
        allowed = 0.1 * step["state_bytes"] + (64 << 20)
        step["peak_rise_over_allowed"] = step["peak_rise_bytes"] / allowed
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, __file__, "--async", os.path.join(tmp, "ckpt"), str(tensors)],
                             check=True, capture_output=True, text=True).stdout
        report["async"] = json.loads(out)
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/io_memory.json", "w") as f:
        json.dump(report, f, indent=1)
    mib = 2**20
    print("| step | state MiB | seconds | peak RSS rise MiB | allowed (10% + 64 MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("save", "load"):
        r = report[name]
        print(f"| {name} | {r['state_bytes'] / mib:.0f} | {r['seconds']:.2f} | {r['peak_rise_bytes'] / mib:.0f} "
              f"| {(0.1 * r['state_bytes'] + (64 << 20)) / mib:.0f} |")
    a = report["async"]
    print(f"\nasync save of {a['state_bytes'] / mib:.0f} MiB: memcpy {a['memcpy_s']:.3f} s; first save blocks "
          f"{a['first_blocking_s']:.3f} s of {a['first_total_s']:.2f} s; later saves (buffer reused, median of 3) "
          f"block {a['second_blocking_s']:.3f} s of {a['second_total_s']:.2f} s = "
          f"{a['second_blocking_over_memcpy']:.2f}x the memcpy")


if __name__ == "__main__":
    main()
