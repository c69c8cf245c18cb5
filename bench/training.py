"""What checkpointing costs a training loop.

    .venv/bin/python bench/training.py [--quick]

1. Pretraining: a CPU model (8 linear layers of 2048 x 2048, float32, AdamW:
   384 MiB of state; ``--quick``: smaller) trained by torch on every core,
   checkpointed through ``globalshard_torch.save_checkpoint`` with
   synchronous saves, and with an ``AsyncSaver`` in thread and in process
   mode; beside them two bare background writers, forked processes that
   write the same bytes to one file (``_RawWriter``), through the page cache
   (``raw``) and around it (``raw_direct``, ``O_DIRECT`` from the shared
   memory's pages, as the AsyncSaver's writer writes its shards): the cost
   of writing the bytes at all, without a format; and ``raw_chunked``,
   unbuffered too, doing what the format asks of any writer and nothing
   more (each tensor cut into its stored chunks, copied, a crc32c each):
   the floor of a checksummed, chunked writer. The process mode runs
   again with torch on one core fewer (``process_spare``): the writer then
   has a core of its own, as on a GPU trainer's host, whose cores the
   training leaves mostly idle. For the background processes, their CPU
   time per save is recorded too: on a loop that keeps every core busy it
   is taken from training.
   Each mode runs in a process of its own, which alternates phases of 8
   steps with a save every 4 steps and phases of 8 steps without, 8 pairs
   (24 for the process mode, whose ratio the target is, and the bare
   unbuffered writers, its floors; the order alternating), after a first save
   that starts the writer and sizes the staging pool. A phase's cost is its
   wall time: its steps, the time its saves block the loop and, at its end,
   the wait for its last save's background part (so every slower step a background save causes
   is counted). Each ratio is the median over the pairs of the phase with
   checkpoints over the phase without it beside it: on this shared machine
   a process's step time drifts by more than the effect (runs of the same
   loop in separate processes differed by up to 40%), so each comparison is
   made seconds apart in one process. Beside each median, the interval
   between two of the sorted pair ratios that holds the true median with at
   least 95% confidence whatever their distribution (``median_interval``):
   a single pair ranges over tenths, so this says whether a ratio is beyond
   the noise. In process mode the time each save
   blocks the loop is compared with a memcpy of the state into a warm
   buffer just before it, and the host memory of the trainer and its writer
   is sampled every 10 ms (see ``_host_bytes``): how far its peak over the
   phases with saves exceeds the trainer's own peak over the phases without,
   over the state's bytes (the loop's own peak drifts by tens of MiB from
   phase to phase, so it too is compared with phases beside it).
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
import math
import mmap
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
PHASE, EVERY = (4, 2) if QUICK else (8, 4)  # steps a phase, a save every EVERY steps
LORA_WIDTH, LORA_LAYERS, RANK = (1024, 16, 16) if QUICK else (4096, 16, 16)
MODES = ("sync", "thread", "process", "process_spare", "raw", "raw_direct", "raw_chunked")
#: Torch's threads in the ``process_spare`` mode: one core left to the writer, as a GPU trainer's host leaves them.
SPARE_THREADS = max(1, (os.cpu_count() or 2) - 1)
PAIRS = 2 if QUICK else int(os.environ.get("PAIRS", 8))
#: The modes measured with more pairs: the process mode, whose ratio the target is, and the bare unbuffered
#: writers beside it (what writing the bytes at all costs, and the format's own work). With 8 pairs the
#: median's 95% interval spans about 0.2 here (1.04-1.23 at 7de0fda), too wide to tell 1.07x from 1.05x;
#: with 30, 0.03 (1.041-1.072).
TARGET_MODES = ("process", "raw_direct", "raw_chunked")
TARGET_PAIRS = 2 if QUICK else int(os.environ.get("TARGET_PAIRS", 24))
CONFIDENCE = 0.95


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The distribution-free interval for the median of ``values``' population:
    the ``k``-th smallest and ``k``-th largest values, with the largest ``k``
    for which the median lies outside them with probability at most
    ``1 - confidence`` (each value lies below the median with probability 1/2,
    so the count below it is binomial, and the median lies below the ``k``-th
    smallest when fewer than ``k`` do). Returns ``(low, high, coverage)``, the
    coverage exact and at least ``confidence`` (the whole range when too few
    values reach it).

    >>> median_interval([float(v) for v in range(1, 9)])  # 8 values: only the extremes reach 95%
    (1.0, 8.0, 0.9921875)
    >>> median_interval([float(v) for v in range(1, 25)])[:2]
    (7.0, 18.0)
    """
    ordered, n = sorted(values), len(values)
    below = [math.comb(n, i) / 2 ** n for i in range(n + 1)]  # P(exactly i values below the median)
    k, tail = 1, below[0]  # P(fewer than k values below it)
    while k < n // 2 and 2 * (tail + below[k]) <= 1 - confidence:
        tail += below[k]
        k += 1
    return ordered[k - 1], ordered[n - k], 1 - 2 * tail


def _pairs(mode: str) -> int:
    return TARGET_PAIRS if mode in TARGET_MODES else PAIRS


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


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used (/proc/PID/stat), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host_bytes(trainer: int, writer: int | None) -> dict[str, int]:
    """Host memory of the trainer and its writer: the trainer's anonymous and
    shared memory (the staging pools are shared memory) and the writer's
    anonymous memory. The writer's file-backed pages are the libraries the
    trainer maps too (checked once with /proc/PID/smaps: 3 of its 35 MiB were
    private to it); reading its smaps_rollup at every sample instead slowed the
    trainer's steps by a quarter."""
    t = _resident(trainer)
    writing = _resident(writer)["RssAnon"] if writer is not None else 0
    return {"training": t["RssAnon"], "pools": t["RssShmem"], "writer": writing,
            "host": t["RssAnon"] + t["RssShmem"] + writing}


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


class _RawWriter:
    """A bare background writer, to set the AsyncSaver beside: a forked
    process that writes the state's bytes, copied into shared memory, to one
    file with ``write`` and ``fsync``: no format, no checksums, no commit.
    ``direct``: with ``O_DIRECT`` from the shared memory's pages (its size
    rounded up to a page). ``chunked``: also unbuffered, but doing the work
    the format asks of any writer of these tensors, and nothing more: each
    tensor cut into its stored inner chunks (globalshard's chunk shapes, 512 x
    512 for a whole 2048 x 2048 float32), each chunk copied into an aligned
    buffer, its crc32c appended, zeros to the next 4096 bytes, and written,
    one thread, one file, no directories (the floor of a checksummed, chunked
    writer). One save in flight, as for the AsyncSaver."""

    def __init__(self, nbytes: int, direct: bool = False, chunked: bool = False) -> None:
        direct = direct or chunked
        nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE if direct else nbytes
        self.buffer = mmap.mmap(-1, nbytes)  # shared with the child across fork; page-aligned
        self.array = np.frombuffer(self.buffer, np.uint8)
        child_from, self._to = os.pipe()  # (read end, write end)
        self._from, child_to = os.pipe()
        self.pid = os.fork()  # before torch starts its threads (run_mode calls this first)
        if self.pid == 0:
            os.close(self._to)
            os.close(self._from)
            with os.fdopen(child_from, "rb") as requests, os.fdopen(child_to, "wb", buffering=0) as replies:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
                for line in requests:
                    request = json.loads(line)
                    fd = os.open(request["path"], flags, 0o644)
                    if chunked:
                        _write_chunked(fd, self.array, request["tensors"])
                    else:
                        view = memoryview(self.buffer)
                        for i in range(0, nbytes, 64 << 20):
                            os.write(fd, view[i:i + (64 << 20)])
                    os.fsync(fd)
                    os.close(fd)
                    replies.write(b"x")
            os._exit(0)
        os.close(child_from)
        os.close(child_to)
        self._pending = False

    def save(self, tensors: list[np.ndarray], path: str) -> None:
        self.wait()
        offset, placed = 0, []
        for t in tensors:
            np.copyto(np.ndarray(t.shape, t.dtype, self.array, offset), t)
            placed.append([offset, list(t.shape), t.dtype.str])
            offset += t.nbytes
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.write(self._to, json.dumps({"path": path, "tensors": placed}).encode() + b"\n")
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            os.read(self._from, 1)
            self._pending = False

    def close(self) -> None:
        os.close(self._to)
        os.waitpid(self.pid, 0)


def _write_chunked(fd: int, pool: np.ndarray, tensors: list[Any]) -> None:
    """What ``_RawWriter(chunked=True)`` writes: each tensor ``[offset in pool,
    shape, dtype]`` in its inner chunks, each copied, followed by its crc32c
    and zeros to a multiple of 4096 bytes, back to back (``fd`` is ``O_DIRECT``)."""
    import crc32c

    from globalshard.format.zarr import chunk_shape
    from globalshard.io.localio.unbuffered import aligned, stride
    from globalshard.io.localio.write import fill_chunk

    for offset, shape, dtype in tensors:
        dtype = np.dtype(dtype)
        array = np.ndarray(tuple(shape), dtype, pool, offset)
        chunk = chunk_shape(array.shape, dtype.itemsize)
        nbytes = math.prod(chunk) * dtype.itemsize
        out = aligned(stride(nbytes))
        for index in np.ndindex(*(-(-s // c) for s, c in zip(array.shape, chunk))):
            part = array[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunk))]
            fill_chunk(out[:nbytes], part, chunk)
            out[nbytes:nbytes + 4] = np.frombuffer(crc32c.crc32c(out[:nbytes]).to_bytes(4, "little"), np.uint8)
            out[nbytes + 4:] = 0
            os.write(fd, out)


def run_mode(mode: str, root: str) -> dict[str, Any]:
    """One mode's run in this process: pairs of phases with and without checkpoints."""
    import globalshard as gs
    import globalshard_torch as gt

    raw = _RawWriter(3 * 4 * LAYERS * (WIDTH * WIDTH + WIDTH), direct=mode == "raw_direct",
                     chunked=mode == "raw_chunked") if mode.startswith("raw") else None
    if mode == "process_spare":
        torch.set_num_threads(SPARE_THREADS)
    model, opt = _model()
    x = torch.randn(BATCH, WIDTH)
    _step(model, opt, x)  # warm-up: the optimizer's state exists from here on
    rules = gt.ShardingRules([(r".*", gt.Replicated())])
    layout = gt.ParallelLayout()
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights and two moments
    saver = gs.AsyncSaver(mode.split("_")[0]) if mode in ("thread", "process", "process_spare") else None
    dest = np.ones(state_bytes, np.uint8)
    tensors = [gt.numpy_view(t) for p in model.parameters() for t in (p.data, *opt.state[p].values()) if t.ndim]
    # The peaks of the current phase: the trainer's own memory (its anonymous
    # memory), and the host's (see _host_bytes), which adds the staging pools
    # and the writer.
    peak = {"training": 0, "host": 0, "pools": 0, "writer": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            writer = background()
            for key, value in _host_bytes(os.getpid(), writer).items():
                peak[key] = max(peak[key], value)
            time.sleep(0.01)

    def background() -> int | None:
        """The process that writes this mode's saves in the background, if any."""
        if raw is not None:
            return raw.pid
        return saver.writer.pid if saver is not None and saver.mode == "process" and saver._writer else None

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    saves = 0

    def save() -> None:
        nonlocal saves
        if raw is not None:
            raw.save(tensors, os.path.join(root, f"s{saves}"))
        else:
            gt.save_checkpoint(os.path.join(root, f"s{saves}"), model=model, layout=layout, rules=rules,
                               optimizer=opt, saver=saver)
        saves += 1

    def wait() -> None:
        if saver is not None:
            saver.wait()
        if raw is not None:
            raw.wait()

    def phase(checkpoints: bool) -> dict[str, Any]:
        steps, blocking, memcpy = [], [], []
        peak.update(dict.fromkeys(peak, 0))
        writer = background()
        cpu = _cpu_seconds(writer) if writer is not None else 0.0
        for i in range(PHASE):
            if checkpoints and i % EVERY == 0:
                start = time.perf_counter()
                offset = 0
                for t in tensors:  # a memcpy of the state, the reference of the blocking time
                    np.copyto(np.ndarray(t.shape, t.dtype, dest, offset), t)
                    offset += t.nbytes
                memcpy.append(time.perf_counter() - start)
                start = time.perf_counter()
                save()
                blocking.append(time.perf_counter() - start)
            start = time.perf_counter()
            _step(model, opt, x)
            steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        wait()  # the last save's background part, counted in this phase
        wait_s = time.perf_counter() - start
        # The background process's CPU time over the phase: on a trainer that keeps every core busy,
        # time taken from training. (Its first save started the writer, before the pairs.)
        background_cpu = _cpu_seconds(writer) - cpu if writer is not None and writer == background() else None
        time.sleep(0.02)  # a sample after the phase's end
        return {"steps_s": steps, "blocking_s": blocking, "memcpy_s": memcpy, "wait_s": wait_s,
                "cost_s": sum(steps) + sum(blocking) + wait_s, "peak_bytes": dict(peak), "saves": len(blocking),
                "background_cpu_s": background_cpu}

    for _ in range(2):
        _step(model, opt, x)
    start = time.perf_counter()
    save()  # starts the writer and sizes the staging pool: a once-per-run cost, outside the pairs
    wait()
    first = time.perf_counter() - start
    pairs = []
    for k in range(_pairs(mode)):
        order = (False, True) if k % 2 == 0 else (True, False)
        got = {with_: phase(with_) for with_ in order}
        pairs.append({"none": got[False], mode: got[True]})  # the saves stay until the run ends: deleting
        # files on this disk (mounted with discard) slows writes made soon after (bench/pagecache.py)
    stop.set()
    sampler.join()
    if raw is not None:
        raw.close()
    return {"mode": mode, "pairs": pairs, "state_bytes": state_bytes, "first_save_s": first,
            "saver_mode": saver.last_mode if saver is not None else None, "threads": torch.get_num_threads()}


def _peak(run: dict[str, Any], phases: str, what: str) -> int:
    """The largest of ``what``'s peaks over a run's ``phases`` (its mode's, or ``"none"``)."""
    return max(p[phases]["peak_bytes"][what] for p in run["pairs"])


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


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--mode":
        print(json.dumps(run_mode(sys.argv[2], sys.argv[3])))
        return
    base = os.environ.get("BENCH_DIR", "build")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="globalshard-training-", dir=base)

    def one(mode: str) -> dict[str, Any]:
        root = os.path.join(tmp, mode)
        args = [sys.executable, __file__, "--mode", mode, root] + (["--quick"] if QUICK else [])
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        shutil.rmtree(root, ignore_errors=True)
        return dict(json.loads(out.strip().splitlines()[-1]))

    try:
        runs: dict[str, Any] = {}
        for mode in MODES:
            print(f"{mode}: {_pairs(mode)} pairs of phases with and without checkpoints ...", flush=True)
            runs[mode] = one(mode)
        print("full training with base= ...", flush=True)
        pretrain = pretrain_with_base(tmp)
        print("LoRA ...", flush=True)
        lora_report = lora(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratios(mode: str) -> list[float]:
        return [p[mode]["cost_s"] / p["none"]["cost_s"] for p in runs[mode]["pairs"]]

    def ratio(mode: str) -> float:
        return statistics.median(ratios(mode))

    def cpu_per_save(mode: str) -> float | None:
        """The background process's CPU seconds per save, over the phases with saves."""
        phases = [p[mode] for p in runs[mode]["pairs"]]
        if any(p["background_cpu_s"] is None for p in phases):
            return None
        return sum(p["background_cpu_s"] for p in phases) / sum(p["saves"] for p in phases)

    def steps_after_a_save(mode: str) -> dict[str, float]:
        """Median seconds of the steps that begin right after a save (index a
        multiple of EVERY) and of the other steps, in the phases with saves and
        at the same places in those without: where the background part's cost lands."""
        def median(phase: str, after: bool) -> float:
            return statistics.median(s for p in runs[mode]["pairs"] for i, s in enumerate(p[phase]["steps_s"])
                                     if (i % EVERY == 0) == after)
        return {"after_save": median(mode, True), "after_save_without": median("none", True),
                "other": median(mode, False), "other_without": median("none", False)}

    process = runs["process"]
    block = [b / m for p in process["pairs"] for b, m in zip(p["process"]["blocking_s"], p["process"]["memcpy_s"])]
    state = process["state_bytes"]
    report = {
        "quick": QUICK, "model": {"layers": LAYERS, "width": WIDTH, "batch": BATCH, "phase_steps": PHASE,
                                  "save_every": EVERY, "pairs": PAIRS, "target_pairs": TARGET_PAIRS,
                                  "target_modes": list(TARGET_MODES), "state_bytes": state,
                                  "threads": torch.get_num_threads()},
        "runs": runs, "pretrain_with_base": pretrain, "lora": lora_report,
        "step_time_async_process_vs_none": ratio("process"), "step_time_async_thread_vs_none": ratio("thread"),
        "step_time_sync_vs_none": ratio("sync"),
        # A bare process writing the same bytes (write + fsync) in the background, buffered and unbuffered.
        "step_time_raw_writer_vs_none": ratio("raw"),
        "step_time_raw_unbuffered_writer_vs_none": ratio("raw_direct"),
        # The same, doing the work the format asks of any writer: chunk copies and a crc32c of every byte.
        "step_time_raw_chunked_writer_vs_none": ratio("raw_chunked"),
        # The process mode with torch on one core fewer: the writer has a core of its own.
        "step_time_async_process_spare_core_vs_none": ratio("process_spare"),
        # Each mode's ratio: the interval that holds the median with at least this confidence.
        "step_time_confidence": CONFIDENCE,
        "step_time_intervals": {mode: median_interval(ratios(mode))[:2] for mode in MODES},
        "background_cpu_s_per_save": {mode: cpu_per_save(mode) for mode in ("process", "process_spare", "raw",
                                                                            "raw_direct", "raw_chunked")},
        "steps_after_a_save": {mode: steps_after_a_save(mode) for mode in MODES if mode != "sync"},
        "async_block_vs_memcpy": statistics.median(block) if block else None,
        # What saves add to the same loop's peak: the host's peak over the phases with saves (the
        # trainer, its staging pools and its writer) over the trainer's own peak over the phases without.
        "async_peak_rss_over_state": (_peak(process, "process", "host") - _peak(process, "none", "training")) / state,
        "memory_measure": MEMORY_MEASURE,
        "async_memory": {"host_with_saves": _peak(process, "process", "host"),
                         "training_with_saves": _peak(process, "process", "training"),
                         "training_without": _peak(process, "none", "training"),
                         "pools": _peak(process, "process", "pools"), "writer": _peak(process, "process", "writer")},
        "lora_save_bytes_over_adapter_bytes": lora_report["written_over_adapter_bytes"],
        "pretrain_save_bytes_saved_fraction": pretrain["saved_fraction"],
    }
    os.makedirs("build/bench", exist_ok=True)
    with open("build/bench/training.json", "w") as f:
        json.dump(report, f, indent=1)
    for key in ("step_time_async_process_vs_none", "step_time_async_thread_vs_none", "step_time_sync_vs_none",
                "step_time_raw_writer_vs_none", "step_time_raw_unbuffered_writer_vs_none",
                "step_time_raw_chunked_writer_vs_none", "step_time_async_process_spare_core_vs_none",
                "async_block_vs_memcpy", "async_peak_rss_over_state",
                "lora_save_bytes_over_adapter_bytes", "pretrain_save_bytes_saved_fraction"):
        print(f"{key}: {report[key]:.3f}")


if __name__ == "__main__":
    main()
