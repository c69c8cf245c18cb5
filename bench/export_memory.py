"""Peak memory of `globalshard export` against the size of the model it exports.

    .venv/bin/python bench/export_memory.py [GIB]      # default 1; 13 for "larger than half the RAM"

Saves a model of GIB GiB (float32 matrices of 256 MiB, written one at a
time, so the saving process never holds more than one), then runs
``globalshard export --format safetensors --dtype bf16`` on it in a fresh
process, which reports its own peak RSS (VmHWM of /proc/self/status: that
of the exported program only; a child's ru_maxrss would also count the
parent's pages at fork). Writes build/bench/export_memory.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import globalshard as gs

ROWS, COLS = 8192, 8192  # 256 MiB of float32 per tensor

CHILD = """
import json, sys
from globalshard.cli import main
code = main(json.loads(sys.argv[1]))
peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0].split()[1]
print(peak, file=sys.stderr)
sys.exit(code)
"""


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    tensors = max(1, round(gib * 4))
    base = os.environ.get("BENCH_DIR", "build")
    os.makedirs(base, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        # One tensor per save would replace the checkpoint; build it in one save of views instead,
        # from a memory map so the saving process does not hold the model either.
        backing = np.lib.format.open_memmap(os.path.join(tmp, "values.npy"), mode="w+", dtype=np.float32,
                                            shape=(tensors, ROWS, COLS))
        for k in range(tensors):
            backing[k] = k
        backing.flush()
        state = {f"w{k}": gs.ShardedTensor.from_offset(f"layers.{k}.weight", backing[k], global_shape=(ROWS, COLS),
                                                       global_offset=(0, 0)) for k in range(tensors)}
        gs.save(state, ckpt)
        del backing, state
        os.unlink(os.path.join(tmp, "values.npy"))
        start = time.perf_counter()
        args = ["export", ckpt, os.path.join(tmp, "hf"), "--format", "safetensors", "--dtype", "bf16",
                "--max-shard-size", "2GB", "--json"]
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                             check=True)
        seconds = time.perf_counter() - start
        peak_kib = int(out.stderr.strip().splitlines()[-1])
        doc = json.loads(out.stdout)
        report = {"model_bytes": tensors * ROWS * COLS * 4, "exported_bytes": doc["bytes"], "files": len(doc["files"]),
                  "seconds": seconds, "export_peak_rss_bytes": peak_kib * 1024}
        shutil.rmtree(os.path.join(tmp, "hf"))
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/export_memory.json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"export of a {report['model_bytes'] / 2**30:.1f} GiB model to bf16 safetensors "
          f"({report['files']} files): {seconds:.1f} s, peak RSS {report['export_peak_rss_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
