"""The main job: train, stop, resume on another topology, follow the reference curve.

    make demo        (or: .venv/bin/python examples/gpt_demo.py [--steps N] [--resume-at K] [--out DIR])

A reference run trains the GPT of gpt_trainer.py uninterrupted for N steps in
one process. Then, for each topology change A -> B, a job on A trains to step
K and saves; a job on B loads that checkpoint and trains to step N. The losses
of steps K..N-1 are compared with the reference. Same-topology resumes are
compared with an uninterrupted run on that topology and must be bit-exact.

Tolerance for topology changes: 1e-5 absolute on a loss of about 5.5. Changing
TP, PP or DP changes the order of float32 sums (all-reduced partial matmuls,
gradient sums over micro-batches, DP ranks and tied embedding copies); measured,
that moves the loss by at most 9.5e-7 over 5 resumed steps (10x below the
bound). An error in what was loaded moves it by more: the negative control in
the tests swaps just two rows of one 128 x 64 matrix and moves it by 1.8e-5
here (1.4e-5 over the tests' 2 resumed steps), above the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_trainer import Config, Topology, run

TOLERANCE = 1e-5

#: (name, saved on, resumed on, the model's Config fields that differ from the default).
CHANGES: list[tuple[str, Topology, Topology, dict]] = [
    ("TP grow", Topology(tp=2), Topology(tp=4), {}),
    ("TP shrink", Topology(tp=4), Topology(tp=2), {}),
    ("PP 2 -> 1 (tied embeddings)", Topology(pp=2), Topology(pp=1), {}),
    ("PP 1 -> 2 (tied embeddings)", Topology(pp=1), Topology(pp=2), {}),
    ("VPP 2 -> 1", Topology(pp=2, vpp=2), Topology(pp=2), {}),
    ("DP 2 -> 1 with TP 1 -> 2", Topology(dp=2), Topology(tp=2), {}),
    ("TP=2/PP=2 -> single process", Topology(tp=2, pp=2), Topology(), {}),
    # 2 kv heads at TP=4: each kv head replicated on 2 ranks; at TP=2 each rank holds one.
    ("grouped QKV, kv heads replicated (2 kv heads)", Topology(tp=4), Topology(tp=2), {"kv_heads": 2}),
    # Megatron-Core's distributed optimizer layout: each DP rank holds the Adam state of its flat ranges.
    ("distributed optimizer, DP and TP change", Topology(dp=2, distopt=True), Topology(tp=2, dp=2, distopt=True), {}),
    # 4 experts in every layer, top-2 routing: EP carved from DP, traded for TP.
    ("MoE, EP traded for TP (4 experts)", Topology(dp=2, ep=2), Topology(tp=2), {"experts": 4}),
]
SAME = ("same topology (bit-exact)", Topology(tp=2, pp=2))


def resume_run(cfg: Config, a: Topology, b: Topology, k: int, n: int, work: str, *, misplace: bool = False,
               start_method: str = "spawn") -> dict:
    ckpt = os.path.join(work, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    first = run(cfg, a, os.path.join(work, "a"), until=k, save=ckpt, start_method=start_method)
    second = run(cfg, b, os.path.join(work, "b"), until=n, resume=ckpt, misplace=misplace, start_method=start_method)
    return {"from": str(a), "to": str(b), "resume_step": second["resume_step"], "losses": second["losses"],
            "losses_before": first["losses"],
            "save": {"seconds": first["save_s"]},
            "load": {"seconds": second["load_s"], "bytes_needed": second["bytes_needed"],
                     "bytes_read": second["bytes_read"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resume-at", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("build", "demo"))
    parser.add_argument("--only", nargs="*", help="run only the changes whose name contains one of these")
    args = parser.parse_args(argv)
    n, k = args.steps, args.resume_at
    cfg = Config(total_steps=n)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    references: dict[str, list[float]] = {}

    def reference_for(fields: dict) -> list[float]:
        """The uninterrupted single-process run of this model."""
        tag = json.dumps(fields, sort_keys=True)
        if tag not in references:
            print(f"reference: {Topology()} for {n} steps{f' ({fields})' if fields else ''} ...", flush=True)
            where = os.path.join(args.out, "reference" + "".join(f"-{k}{v}" for k, v in sorted(fields.items())))
            references[tag] = run(replace(cfg, **fields), Topology(), where, until=n)["losses"]
        return references[tag]

    reference = reference_for({})
    runs = []
    changes = [c for c in CHANGES if not args.only or any(o in c[0] for o in args.only)]
    for name, a, b, fields in changes:
        print(f"{name}: {a} to step {k}, save, {b} to step {n} ...", flush=True)
        r = resume_run(replace(cfg, **fields), a, b, k, n,
                       os.path.join(args.out, "runs", name.split()[0] + str(len(runs))))
        r["change"] = name
        r["compared_with"] = f"reference {fields}" if fields else "reference"
        r["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(r["losses"], reference_for(fields)[k:]))
        runs.append(r)
    if not args.only or any(o in SAME[0] for o in args.only):
        name, topo = SAME
        print(f"{name}: {topo} uninterrupted, then to step {k}, save, resume ...", flush=True)
        straight = run(cfg, topo, os.path.join(args.out, "runs", "same-straight"), until=n)["losses"]
        r = resume_run(cfg, topo, topo, k, n, os.path.join(args.out, "runs", "same"))
        r["change"] = name
        r["compared_with"] = f"uninterrupted {topo}"
        r["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(r["losses"], straight[k:]))
        runs.append(r)
    report = {"config": asdict(cfg), "tolerance": TOLERANCE, "reference_losses": reference,
              "references": {tag: losses for tag, losses in references.items()}, "runs": runs,
              "seconds": time.perf_counter() - t0}
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)

    print(f"\nreference losses ({Topology()}): " + " ".join(f"{x:.5f}" for x in reference))
    print("\n| change | steps | max abs loss diff | save s | load s | bytes read / needed |")
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    for r in runs:
        bound = 0.0 if r["change"] == SAME[0] else TOLERANCE
        ok &= r["max_abs_loss_diff"] <= bound
        ld = r["load"]
        ratio = ld["bytes_read"] / ld["bytes_needed"] if ld["bytes_needed"] else float("nan")
        print(f"| {r['change']}: {r['from']} -> {r['to']} | {r['resume_step']}..{n - 1} | "
              f"{r['max_abs_loss_diff']:.2e} | {r['save']['seconds']:.2f} | {ld['seconds']:.2f} | "
              f"{ld['bytes_read']:,} / {ld['bytes_needed']:,} = {ratio:.2f} |")
    print(f"\n{'every resumed run follows its reference' if ok else 'SOME RUNS DIVERGED'} "
          f"(tolerance {TOLERANCE:g}; same topology: exact). Report: {os.path.join(args.out, 'report.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
