"""Orbax's side of bench/compare.py: the same state, as jax arrays.

    .venv/bin/python bench/orbax_bench.py DIR ROWS COLS TENSORS

jax on the CPU with 4 forced host devices and Orbax's StandardCheckpointer
(as the issue measured it): 8 float32 matrices sharded on rows over 4
devices, saved (until wait_until_finished), restored onto 2 devices (warm,
then cold: files evicted with posix_fadvise) and onto 1. Then the same with
globalshard_jax (gj.save / gj.load) on the same arrays in the same process.
Median of 3; prints JSON seconds: Orbax's, and globalshard_jax's under
"globalshard_jax". Needs ``pip install -e '.[bench]'`` (``make bench`` does it).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # after XLA_FLAGS is set
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from pagecache import evict, quiesce

import globalshard_jax as gj


def main() -> None:
    root, rows, cols, tensors = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    devices = jax.devices()

    def full(k: int) -> np.ndarray:
        return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + k

    def abstract(n: int) -> dict[str, jax.ShapeDtypeStruct]:
        sharding = NamedSharding(Mesh(np.array(devices[:n]), ("x",)), P("x", None))
        return {f"w{k}": jax.ShapeDtypeStruct((rows, cols), np.float32, sharding=sharding) for k in range(tensors)}

    sharding4 = NamedSharding(Mesh(np.array(devices[:4]), ("x",)), P("x", None))
    tree = {f"w{k}": jax.device_put(full(k), sharding4) for k in range(tensors)}
    checkpointer = ocp.StandardCheckpointer()

    def orbax_save(path: str) -> None:
        checkpointer.save(path, tree, force=True)
        checkpointer.wait_until_finished()

    def gj_save(path: str) -> None:
        gj.save(path, tree, overwrite=True)

    out = run(root, "orbax", orbax_save, lambda path, n: checkpointer.restore(path, abstract(n)), tensors, full)
    out["globalshard_jax"] = run(root, "gj", gj_save, lambda path, n: gj.load(path, abstract(n))[0], tensors, full)
    print(json.dumps(out))


def run(root: str, name: str, save: Any, restore: Any, tensors: int, full: Any) -> dict[str, Any]:
    figures: dict[str, list[float]] = {"save_s": [], "load_tp2_warm_s": [], "load_tp2_cold_s": [],
                                       "load_tp1_warm_s": []}
    for rep in range(3):
        path = os.path.abspath(os.path.join(root, f"{name}{rep}"))
        quiesce(root)  # as bench/compare.py does before each timed step
        start = time.perf_counter()
        save(path)
        figures["save_s"].append(time.perf_counter() - start)
        for label, n, cold in (("warmup", 2, False), ("load_tp2_warm_s", 2, False), ("load_tp1_warm_s", 1, False),
                               ("load_tp2_cold_s", 2, True)):
            if cold:
                evict(path)
            start = time.perf_counter()
            restored = restore(path, n)
            jax.block_until_ready(restored)
            seconds = time.perf_counter() - start
            last = f"w{tensors - 1}"
            if not np.array_equal(np.asarray(restored[last]), full(tensors - 1)):
                raise SystemExit(f"{name} restored wrong values")
            if label != "warmup":
                figures[label].append(seconds)
    return {k: statistics.median(v) for k, v in figures.items()}


if __name__ == "__main__":
    main()
