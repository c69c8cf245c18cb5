"""What checkpointing costs a training loop.

    .venv/bin/python bench/training.py [--quick]

1. Pretraining: a CPU model (8 linear layers of 2048 x 2048, float32, AdamW:
   384 MiB of state; ``--quick``: smaller) trained by torch on every core,
   a checkpoint every 4 steps through ``globalshard_torch.save_checkpoint``:
   with no checkpointing, with synchronous saves, and with an
   ``AsyncSaver`` in thread and in process mode. Each run is a fresh
   process; each mode runs beside a run without checkpoints made just
   before or after it (the order alternating by round), 3 rounds, and each
   ratio is the median of the rounds' ratios of the cost per step: the
   median training step (robust to this shared machine's spikes) plus the
   time the saves block the loop, spread over the steps. In process mode, the time each save
   blocks the loop is compared with a memcpy of the state into a warm
   buffer just before it (the first save aside: it starts the writer and
   sizes the staging pool), and the host memory of the trainer and its
   writer is sampled every 10 ms (see ``_host_bytes``): how far its peak
   exceeds the peak of the same training without checkpoints, over the
   state's bytes.
2. Full training with ``base=``: each save references the one before it and
   hashes every region; the fraction of bytes it did not write (expected:
   about none, since every weight and both moments change every step).
3. A LoRA fine-tune of a frozen base of 1 GiB (16 layers of 4096 x 4096;
   ``--quick``: 64 MiB), adapters of rank 16 trained with AdamW: the base is
   saved once, then each save names the base's keys ``frozen``; the bytes
   each such save writes over the bytes of the adapters and their
   optimizer state.

Writes build/bench/training.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
from torch import nn

QUICK = "--quick" in sys.argv
WIDTH, LAYERS, BATCH = (512, 4, 256) if QUICK else (2048, 8, 512)
STEPS, EVERY = (8, 2) if QUICK else (16, 4)
LORA_WIDTH, LORA_LAYERS, RANK = (1024, 16, 16) if QUICK else (4096, 16, 16)
MODES = ("none", "sync", "thread", "process")
ROUNDS = 1 if QUICK else int(os.environ.get("REPS", 3))


def _resident(pid: int) -> dict[str, int]:
    """A process's resident anonymous, file-backed and shared memory (bytes),
    from the counters of /proc/PID/status: reading them costs nothing, where
    smaps_rollup walks the page tables of the whole process, holding its
    memory map's lock: sampled every 10 ms in the trainer (1.8 GB resident),
    it slowed its steps by half and its saves' snapshot copies with them."""
    out = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in out:
                    out[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _host_bytes(trainer: int, writer: int | None) -> int:
    """Host memory of the trainer and its writer: the trainer's anonymous and
    shared memory (the staging pools are shared memory) and the writer's
    anonymous memory. The writer's file-backed pages are the libraries the
    trainer maps too (checked once with /proc/PID/smaps: 3 of its 35 MiB were
    private to it); reading its smaps_rollup at every sample instead slowed the
    trainer's steps by a quarter."""
    t = _resident(trainer)
    return t["RssAnon"] + t["RssShmem"] + (_resident(writer)["RssAnon"] if writer is not None else 0)


#: How the memory figures are measured (bench/pages.py says it on the page).
MEMORY_MEASURE = ("sampled every 10 ms: the trainer's resident anonymous and shared memory, which holds the staging "
                  "pools, plus its writer process's anonymous memory")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def run_mode(mode: str, root: str) -> dict[str, Any]:
    """One training run in this process: per-step wall times, the saves' blocking times."""
    import globalshard as gs
    import globalshard_torch as gt

    model, opt = _model()
    x = torch.randn(BATCH, WIDTH)
    _step(model, opt, x)  # warm-up: the optimizer's state exists from here on
    rules = gt.ShardingRules([(r".*", gt.Replicated())])
    layout = gt.ParallelLayout()
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights and two moments
    saver = gs.AsyncSaver(mode) if mode in ("thread", "process") else None
    dest = np.ones(state_bytes, np.uint8)
    tensors = [gt.numpy_view(t) for p in model.parameters() for t in (p.data, *opt.state[p].values()) if t.ndim]
    peak = {"host": 0}
    base_host = _host_bytes(os.getpid(), None)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            writer = saver.writer.pid if saver is not None and mode == "process" and saver._writer else None
            peak["host"] = max(peak["host"], _host_bytes(os.getpid(), writer))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    steps, blocking, memcpy = [], [], []
    for i in range(STEPS):
        start = time.perf_counter()
        _step(model, opt, x)
        steps.append(time.perf_counter() - start)
        if mode != "none" and (i + 1) % EVERY == 0:
            start = time.perf_counter()
            offset = 0
            for t in tensors:  # a memcpy of the state, the reference of the blocking time
                np.copyto(np.ndarray(t.shape, t.dtype, dest, offset), t)
                offset += t.nbytes
            memcpy.append(time.perf_counter() - start)
            start = time.perf_counter()
            gt.save_checkpoint(os.path.join(root, f"step{i}"), model=model, layout=layout, rules=rules, optimizer=opt,
                               saver=saver)
            blocking.append(time.perf_counter() - start)
    if saver is not None:
        saver.wait()
    stop.set()
    sampler.join()
    return {"mode": mode, "steps_s": steps, "blocking_s": blocking, "memcpy_s": memcpy, "state_bytes": state_bytes,
            "wall_per_step_s": (sum(steps) + sum(blocking)) / STEPS, "peak_host_bytes": peak["host"],
            "host_before_bytes": base_host,
            "saver_mode": saver.last_mode if saver is not None else None}


def pretrain_with_base(root: str) -> dict[str, Any]:
    """Full training, each save naming the one before it as its base."""
    import globalshard as gs
    import globalshard_torch as gt

    model, opt = _model()
    x = torch.randn(BATCH, WIDTH)
    rules, layout = gt.ShardingRules([(r".*", gt.Replicated())]), gt.ParallelLayout()
    written, total = [], []
    previous = None
    for i in range(3):
        _step(model, opt, x)
        stats = gs.IOStats()
        path = os.path.join(root, f"pre{i}")
        gt.save_checkpoint(path, model=model, layout=layout, rules=rules, optimizer=opt, stats=stats, base=previous,
                           digests=True)
        if previous is not None:
            written.append(stats.bytes_written)
            total.append(gs.read_metadata(path).stored_bytes() + sum(
                r.nbytes for t in gs.read_metadata(path).tensors.values() for r in t.regions if r.base is not None))
        previous = path
    return {"saves": len(written), "bytes_written": written, "state_bytes": total,
            "saved_fraction": 1 - sum(written) / sum(total)}


class _Lora(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.base = nn.ModuleList(nn.Linear(LORA_WIDTH, LORA_WIDTH, bias=False) for _ in range(LORA_LAYERS))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.ParameterList(nn.Parameter(torch.randn(RANK, LORA_WIDTH) * 0.01) for _ in range(LORA_LAYERS))
        self.lora_b = nn.ParameterList(nn.Parameter(torch.zeros(LORA_WIDTH, RANK)) for _ in range(LORA_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, a, b in zip(self.base, self.lora_a, self.lora_b):
            x = torch.tanh(w(x) + (x @ a.T) @ b.T)
        return x


def lora(root: str) -> dict[str, Any]:
    import globalshard as gs
    import globalshard_torch as gt

    model = _Lora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=False)
    x = torch.randn(32, LORA_WIDTH)
    rules, layout = gt.ShardingRules([(r".*", gt.Replicated())]), gt.ParallelLayout()
    base_bytes = sum(p.numel() * 4 for p in model.base.parameters())
    adapter_bytes = sum(p.numel() * 4 * 3 for p in trainable)  # adapters and their two moments

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    first = os.path.join(root, "lora0")
    gt.save_checkpoint(first, model=model, layout=layout, rules=rules, optimizer=opt)
    written = []
    for i in range(1, 4):
        step()
        stats = gs.IOStats()
        path = os.path.join(root, f"lora{i}")
        gt.save_checkpoint(path, model=model, layout=layout, rules=rules, optimizer=opt, stats=stats, base=first,
                           frozen=["base.*"])
        written.append(stats.bytes_written)
        assert np.array_equal(gs.read_array(path, "base.0.weight"), model.base[0].weight.detach().numpy())
    return {"base_bytes": base_bytes, "adapter_and_optimizer_bytes": adapter_bytes, "bytes_written": written,
            "written_over_adapter_bytes": statistics.median(written) / adapter_bytes}


def _per_step(run: dict[str, Any]) -> float:
    """A run's cost per step: its median training step (robust to this shared
    machine's spikes), plus its saves' blocking time spread over its steps."""
    return float(statistics.median(run["steps_s"])) + sum(run["blocking_s"]) / STEPS


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--mode":
        print(json.dumps(run_mode(sys.argv[2], sys.argv[3])))
        return
    base = os.environ.get("BENCH_DIR", "build")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="globalshard-training-", dir=base)
    rounds: list[dict[str, Any]] = []

    def one(mode: str, tag: str) -> dict[str, Any]:
        root = os.path.join(tmp, f"{mode}{tag}")
        args = [sys.executable, __file__, "--mode", mode, root] + (["--quick"] if QUICK else [])
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        shutil.rmtree(root, ignore_errors=True)
        return dict(json.loads(out.strip().splitlines()[-1]))

    try:
        for rep in range(ROUNDS):
            # Each mode beside a run without checkpoints made just before or after it (the order
            # alternating by round), so that each ratio compares two runs minutes apart at most.
            runs: dict[str, Any] = {}
            for mode in MODES[1:]:
                print(f"round {rep + 1} of {ROUNDS}: {mode} beside none ...", flush=True)
                pair = [("none", f"{mode}{rep}n"), (mode, f"{rep}")]
                got = {m: one(m, tag) for m, tag in (pair if rep % 2 == 0 else pair[::-1])}
                runs[mode] = got[mode]
                runs[f"none_for_{mode}"] = got["none"]
            rounds.append(runs)
        print("full training with base= ...", flush=True)
        pretrain = pretrain_with_base(tmp)
        print("LoRA ...", flush=True)
        lora_report = lora(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(mode: str) -> float:
        return statistics.median(_per_step(r[mode]) / _per_step(r[f"none_for_{mode}"]) for r in rounds)

    process = [r["process"] for r in rounds]
    block = [b / m for run in process for b, m in list(zip(run["blocking_s"], run["memcpy_s"]))[1:]]
    state = process[0]["state_bytes"]
    report = {
        "quick": QUICK, "model": {"layers": LAYERS, "width": WIDTH, "batch": BATCH, "steps": STEPS,
                                  "save_every": EVERY, "state_bytes": state, "threads": torch.get_num_threads()},
        "rounds": rounds, "pretrain_with_base": pretrain, "lora": lora_report,
        "step_time_async_process_vs_none": ratio("process"), "step_time_async_thread_vs_none": ratio("thread"),
        "step_time_sync_vs_none": ratio("sync"),
        "async_block_vs_memcpy": statistics.median(block) if block else None,
        # What saves add to the peak of the same training without them (trainer and writer).
        "async_peak_rss_over_state": statistics.median(
            (r["process"]["peak_host_bytes"] - r["none_for_process"]["peak_host_bytes"]) / state for r in rounds),
        "memory_measure": MEMORY_MEASURE,
        "lora_save_bytes_over_adapter_bytes": lora_report["written_over_adapter_bytes"],
        "pretrain_save_bytes_saved_fraction": pretrain["saved_fraction"],
    }
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/training.json", "w") as f:
        json.dump(report, f, indent=1)
    for key in ("step_time_async_process_vs_none", "step_time_async_thread_vs_none", "step_time_sync_vs_none",
                "async_block_vs_memcpy", "async_peak_rss_over_state", "lora_save_bytes_over_adapter_bytes",
                "pretrain_save_bytes_saved_fraction"):
        print(f"{key}: {report[key]:.3f}")


if __name__ == "__main__":
    main()
