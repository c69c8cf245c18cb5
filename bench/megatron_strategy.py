"""Megatron-Core's dist_checkpointing with the globalshard strategy against its
default torch_dist strategy, on the same GPTModel (not part of ``make bench``:
it needs Megatron-Core, which ``make test-frameworks`` installs).

    make test-frameworks   # once: installs Megatron-Core into .venv
    .venv/bin/python bench/megatron_strategy.py [--reps 5]

A GPTModel of hidden size 512 (8 heads, 2 query groups, SwiGLU of 2048, 4
layers, a vocabulary of 32,000: 96 MB of float32 per rank at TP=2) on 2 gloo
ranks, with the framework suite's scoped CPU patches. In each round,
``dist_checkpointing.save`` at TP=2 with each strategy in turn (each to a new
directory; both fsync), then ``dist_checkpointing.load`` of each at PP=2
(warm: the files are in the page cache). Times are wall seconds between
barriers; each ratio is the median of the rounds' ratios. Writes
build/bench/megatron_strategy.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = dict(hidden=512, heads=8, groups=2, ffn=2048, glu=True, bias=False, vocab=32000, tied=False)
STRATEGIES = ("globalshard", "torch_dist")


def job(rank: int, *, path: str, reps: int) -> dict[str, Any]:
    """Run on each rank (by tests/frameworks/ranks.run)."""
    import torch.distributed as dist
    from megatron_jobs import _megatron, build, scramble, setup  # its CPU patches first

    # isort: split
    from megatron.core import dist_checkpointing

    import globalshard_torch.megatron as gm

    def timed(f: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        f()
        dist.barrier()
        return time.perf_counter() - start

    layout = setup(MODEL, tp=2, pp=1)
    saved = build(MODEL, layout)
    scramble(saved, layout, MODEL, "bench")
    out: dict[str, Any] = {"bytes_per_rank": sum(p.numel() * p.element_size() for c in saved for p in c.parameters()),
                           "save": {s: [] for s in STRATEGIES}, "load": {s: [] for s in STRATEGIES}}
    for r in range(reps):
        for name in STRATEGIES:
            where = os.path.join(path, f"{name}{r}")
            if rank == 0:
                os.makedirs(where)
            strategy = gm.SaveStrategy() if name == "globalshard" else None
            out["save"][name].append(timed(functools.partial(dist_checkpointing.save, _megatron(saved), where,
                                                             sharded_strategy=strategy)))
    layout = setup(MODEL, tp=1, pp=2)
    loaded = build(MODEL, layout)

    def load(where: str) -> None:
        state = dist_checkpointing.load(_megatron(loaded), where)
        for i, chunk in enumerate(loaded):
            chunk.load_state_dict(state.get(f"model{i}", {}))

    for r in range(reps):
        for name in STRATEGIES:
            out["load"][name].append(timed(functools.partial(load, os.path.join(path, f"{name}{r}"))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    sys.path[:0] = [os.path.join(ROOT, "tests", "frameworks"), os.path.join(ROOT, "tests"), HERE]
    from ranks import run

    os.makedirs(os.path.join(ROOT, "build", "bench"), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "build")) as tmp:
        (out, _) = run(2, "megatron_strategy:job", os.path.join(tmp, "ranks"), path=tmp, reps=args.reps)
    report: dict[str, Any] = {"bytes_per_rank": out["bytes_per_rank"], "reps": args.reps}
    for phase in ("save", "load"):
        ours, theirs = out[phase]["globalshard"], out[phase]["torch_dist"]
        report[phase] = {"globalshard_s": statistics.median(ours), "torch_dist_s": statistics.median(theirs),
                         "globalshard_over_torch_dist": statistics.median(a / b for a, b in zip(ours, theirs)),
                         "rounds": out[phase]}
    with open(os.path.join(ROOT, "build", "bench", "megatron_strategy.json"), "w") as f:
        json.dump(report, f, indent=2)
    for phase in ("save", "load"):
        r = report[phase]
        print(f"{phase}: globalshard {r['globalshard_s']:.3f} s, torch_dist {r['torch_dist_s']:.3f} s, "
              f"globalshard/torch_dist {r['globalshard_over_torch_dist']:.2f}x (median of {args.reps} rounds)")


if __name__ == "__main__":
    main()
