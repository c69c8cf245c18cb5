"""A small Megatron-style model and the multi-process runs of the torch adapter tests.

The model holds every layout the adapter must map: vocabulary-parallel tied
embeddings with a vocabulary no TP size divides, fused QKV with grouped-query
attention, row-parallel projections with replicated biases, fused SwiGLU,
LoRA on QKV, the attention output and SwiGLU, replicated norms.

Expected values come from ``local_slice``, written here by hand and
independent of the adapter's rules: a rank's tensor is a slice of a global
reference array, and the test compares every tensor after a load with that
slice of the global array the saving job held.
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import globalshard as gs
import globalshard_torch as gt

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LORA_R, LAYERS = 13, 16, 8, 4, 2, 16, 2, 4


@dataclass(frozen=True)
class Topo:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def layout(self, rank: int) -> gt.ParallelLayout:
        # rank = ((dp * pp) + pp_rank) * tp + tp_rank
        tp_rank = rank % self.tp
        pp_rank = (rank // self.tp) % self.pp
        dp_rank = rank // (self.tp * self.pp)
        return gt.ParallelLayout(tp_rank=tp_rank, tp_size=self.tp, pp_rank=pp_rank, pp_size=self.pp,
                                 vpp_size=self.vpp, dp_rank=dp_rank, dp_size=self.dp, num_layers=LAYERS)


def padded_vocab(tp: int) -> int:
    return -(-VOCAB // tp) * tp


class Block(nn.Module):
    def __init__(self, tp: int):
        super().__init__()
        qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp
        self.attn = nn.Module()
        self.attn.norm = nn.Parameter(torch.empty(HIDDEN))
        self.attn.qkv = nn.Linear(HIDDEN, qkv_rows, bias=False)
        self.attn.qkv_lora_A = nn.Parameter(torch.empty(LORA_R, HIDDEN))
        self.attn.qkv_lora_B = nn.Parameter(torch.empty(qkv_rows, LORA_R))
        self.attn.proj = nn.Linear(HEADS * HEAD_DIM // tp, HIDDEN, bias=True)
        self.attn.proj_lora_A = nn.Parameter(torch.empty(LORA_R, HEADS * HEAD_DIM // tp))
        self.attn.proj_lora_B = nn.Parameter(torch.empty(HIDDEN, LORA_R))
        self.mlp = nn.Module()
        self.mlp.norm = nn.Parameter(torch.empty(HIDDEN))
        self.mlp.gate_up = nn.Linear(HIDDEN, 2 * FFN // tp, bias=False)
        self.mlp.gate_up_lora_A = nn.Parameter(torch.empty(LORA_R, HIDDEN))
        self.mlp.gate_up_lora_B = nn.Parameter(torch.empty(2 * FFN // tp, LORA_R))
        self.mlp.down = nn.Linear(FFN // tp, HIDDEN, bias=False)


class Chunk(nn.Module):
    """One virtual pipeline chunk of one stage."""

    def __init__(self, layout: gt.ParallelLayout, chunk: int, dtype: torch.dtype):
        super().__init__()
        tp = layout.tp_size
        first = layout.is_first_stage and chunk == 0
        last = layout.is_last_stage and chunk == layout.vpp_size - 1
        if first:
            self.embedding = nn.Embedding(padded_vocab(tp) // tp, HIDDEN)
        self.layers = nn.ModuleList(Block(tp) for _ in layout.chunk_layers(chunk))
        if last:
            self.final_norm = nn.Parameter(torch.empty(HIDDEN))
            self.lm_head = nn.Module()
            if first:  # one stage holds both ends: tie them to one Parameter
                self.lm_head.weight = self.embedding.weight
            else:
                self.lm_head.weight = nn.Parameter(torch.empty(padded_vocab(tp) // tp, HIDDEN))
        self.to(dtype)


RULES = gt.ShardingRules([
    (r"embedding\.weight", gt.VocabParallel(VOCAB)),
    (r"lm_head\.weight", gt.Tied("embedding.weight")),
    (r"layers\.\d+\.attn\.qkv\.weight", gt.PackedQKV(HEADS, KV_HEADS)),
    (r"layers\.\d+\.attn\.qkv_lora_B", gt.PackedQKV(HEADS, KV_HEADS)),
    (r"layers\.\d+\.attn\.proj\.weight", gt.RowParallel()),
    (r"layers\.\d+\.attn\.proj_lora_A", gt.RowParallel()),
    (r"layers\.\d+\.mlp\.gate_up\.weight", gt.PackedSwiGLU()),
    (r"layers\.\d+\.mlp\.gate_up_lora_B", gt.PackedSwiGLU()),
    (r"layers\.\d+\.mlp\.down\.weight", gt.RowParallel()),
    (r".*(lora_A|lora_B|norm|bias)", gt.Replicated()),
])


# ----------------------------------------------------------------------- manual placement (independent of rules)


def kind_of(key: str) -> str:
    for suffix, kind in [("embedding.weight", "vocab"), ("qkv.weight", "qkv"), ("qkv_lora_B", "qkv"),
                         ("proj.weight", "cols"), ("proj_lora_A", "cols"), ("gate_up.weight", "swiglu"),
                         ("gate_up_lora_B", "swiglu"), ("down.weight", "cols")]:
        if key.endswith(suffix):
            return kind
    return "whole"


def local_slice(global_array: np.ndarray, kind: str, tp: int, r: int) -> np.ndarray:
    """What TP rank r holds of a global array, padding rows as zeros."""
    g = global_array
    if kind == "whole":
        return g.copy()
    if kind == "cols":
        n = g.shape[1] // tp
        return g[:, r * n:(r + 1) * n].copy()
    if kind == "vocab":
        n = padded_vocab(tp) // tp
        out = np.zeros((n, *g.shape[1:]), g.dtype)
        part = g[r * n:(r + 1) * n]
        out[: len(part)] = part
        return out
    if kind == "qkv":
        hd = g.shape[0] // (HEADS + 2 * KV_HEADS)
        q, kv = HEADS * hd // tp, KV_HEADS * hd // tp
        qh, kh = HEADS * hd, KV_HEADS * hd
        return np.concatenate([g[r * q:(r + 1) * q], g[qh + r * kv:qh + (r + 1) * kv],
                               g[qh + kh + r * kv:qh + kh + (r + 1) * kv]])
    if kind == "swiglu":
        f = g.shape[0] // 2 // tp
        full_f = g.shape[0] // 2
        return np.concatenate([g[r * f:(r + 1) * f], g[full_f + r * f:full_f + (r + 1) * f]])
    raise ValueError(kind)


def global_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"embedding.weight": (VOCAB, HIDDEN), "final_norm": (HIDDEN,)}
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes |= {
            p + "attn.norm": (HIDDEN,), p + "attn.qkv.weight": (qkv_rows, HIDDEN),
            p + "attn.qkv_lora_A": (LORA_R, HIDDEN), p + "attn.qkv_lora_B": (qkv_rows, LORA_R),
            p + "attn.proj.weight": (HIDDEN, HEADS * HEAD_DIM), p + "attn.proj.bias": (HIDDEN,),
            p + "attn.proj_lora_A": (LORA_R, HEADS * HEAD_DIM), p + "attn.proj_lora_B": (HIDDEN, LORA_R),
            p + "mlp.norm": (HIDDEN,), p + "mlp.gate_up.weight": (2 * FFN, HIDDEN),
            p + "mlp.gate_up_lora_A": (LORA_R, HIDDEN), p + "mlp.gate_up_lora_B": (2 * FFN, LORA_R),
            p + "mlp.down.weight": (HIDDEN, FFN),
        }
    return shapes


def reference(seed: int, np_dtype: Any) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32).astype(np_dtype) for k, s in global_shapes().items()}


def key_of(layout: gt.ParallelLayout, chunk: int, name: str) -> str:
    key = layout.global_name(name, chunk)
    return "embedding.weight" if key == "lm_head.weight" else key


def view(t: torch.Tensor) -> np.ndarray:
    return gt.numpy_view(t)


# ----------------------------------------------------------------------- running ranks


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _entry(rank: int, world: int, port: int, fn_name: str, args: dict[str, Any], out_dir: str,
           env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    result: dict[str, Any]
    try:
        if ":" in fn_name:  # a job of another module of tests/: "module:function"
            import importlib

            module, name = fn_name.split(":")
            out = getattr(importlib.import_module(module), name)(rank, **args)
        else:
            out = globals()[fn_name](rank, **args)
        result = {"ok": True, "value": out}
    except BaseException as e:  # reported to the parent, which asserts on it
        result = {"ok": False, "type": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
        f.flush()
        os.fsync(f.fileno())
    # Leave together, then skip interpreter teardown: gloo's threads can abort
    # in C++ static destructors at exit, after the outcome is already written.
    try:
        if result["ok"]:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        os._exit(0)


#: Modules a rank needs, imported once by the fork server and inherited by every rank it forks.
#: (The fork server skips those it cannot import: the demo's trainer is there when examples/ is on the path.)
#: torch imports some of its parts on first use: an optimizer's constructor imports ``torch._dynamo``
#: (3.5 s of CPU), DTensor and ZeroRedundancyOptimizer checks import ``torch.distributed.tensor``, ``.fsdp``
#: and ``.optim`` (1.5 s). Imported in every rank of every job, on 2 cores, they were 70% of a job's time.
_PRELOAD = ["numpy", "torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
            "torch.distributed.fsdp", "torch.distributed.optim", "torch.distributed.checkpoint",
            "globalshard", "globalshard_torch", "torch_harness", "gpt_trainer"]


def start_method(preload: Sequence[str] = ()) -> str:
    """``forkserver`` with torch and the adapter preloaded (and ``preload``): a
    rank is a fork of a clean server process that imported them once for the
    whole session, not a fresh interpreter importing torch (seconds per rank,
    2-8 ranks per job); the list in force when the session's first job starts
    is the server's. ``GLOBALSHARD_TEST_START=spawn`` goes back to fresh
    interpreters."""
    method = os.environ.get("GLOBALSHARD_TEST_START", "forkserver")
    if method == "forkserver":
        mp.set_forkserver_preload([*_PRELOAD, *preload])
    return method


def run(world: int, fn_name: str, out_dir: str, **args: Any) -> list[dict[str, Any]]:
    """Run ``fn_name(rank, **args)`` on ``world`` processes; each rank's outcome."""
    os.makedirs(out_dir, exist_ok=True)
    for r in range(world):
        p = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(p):
            os.remove(p)
    mp.start_processes(_entry, args=(world, free_port(), fn_name, args, out_dir, dict(os.environ)), nprocs=world,
                       join=True, start_method=start_method())
    outcomes = []
    for r in range(world):
        try:
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                outcomes.append(json.load(f))
        except FileNotFoundError:
            outcomes.append({"ok": False, "type": "exited", "message": "the process ended without an outcome"})
    return outcomes


# ----------------------------------------------------------------------- jobs (run on every rank)

DTYPES = {"float32": (torch.float32, np.float32), "bfloat16": (torch.bfloat16, ml_dtypes.bfloat16)}


def build(topo: dict[str, int], rank: int, dtype: str) -> tuple[gt.ParallelLayout, list[Chunk]]:
    layout = Topo(**topo).layout(rank)
    torch.manual_seed(1000 + rank)  # junk initial values, different on every rank
    return layout, [Chunk(layout, c, DTYPES[dtype][0]) for c in range(layout.vpp_size)]


def fill(layout: gt.ParallelLayout, chunks: list[Chunk], ref: dict[str, np.ndarray]) -> None:
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            key = key_of(layout, c, name)
            with torch.no_grad():
                view(p)[...] = local_slice(ref[key], kind_of(key), layout.tp_size, layout.tp_rank)


def make_optimizer(chunks: list[Chunk], master: bool) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """AdamW with two param groups (no weight decay on norms and biases), over the
    model's parameters, or over fp32 master copies of them."""
    named = {(f"chunk{c}/{n}" if len(chunks) > 1 else n): p for c, ch in enumerate(chunks)
             for n, p in ch.named_parameters()}
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named.items()} if master else {}
    params = masters if master else named
    decay = [p for n, p in params.items() if not n.endswith(("norm", "bias"))]
    no_decay = [p for n, p in params.items() if n.endswith(("norm", "bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), foreach=False)
    return opt, masters


def grads_step(layout: gt.ParallelLayout, chunks: list[Chunk], opt: torch.optim.Optimizer,
               masters: dict[str, torch.Tensor], sched: Any, seed: int, steps: int = 1) -> None:
    """Deterministic global gradients, sliced per rank; an optimizer and a
    scheduler step for each."""
    grads = reference(seed, np.float32)
    for _ in range(steps):
        for c, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                key = key_of(layout, c, name)
                g = torch.from_numpy(local_slice(grads[key], kind_of(key), layout.tp_size, layout.tp_rank))
                label = f"chunk{c}/{name}" if len(chunks) > 1 else name
                target = masters.get(label, p)
                target.grad = g.to(target.dtype)
        opt.step()
        sched.step()


def dump_globals(layout: gt.ParallelLayout, chunks: list[Chunk], opt: torch.optim.Optimizer | None,
                 masters: dict[str, torch.Tensor], out_dir: str) -> None:
    """This rank's tensors (params, moments), as raw arrays with their key and kind,
    so the parent can assemble what the saving job held globally."""
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            key = key_of(layout, c, name)
            label = f"chunk{c}/{name}" if len(chunks) > 1 else name
            items = {"param": p}
            if opt is not None:
                holder = masters.get(label, p)
                items |= {k: v for k, v in opt.state.get(holder, {}).items()}
                if masters:
                    items["master"] = holder
            for item, t in items.items():
                arr = view(t.detach())
                base = f"{item}__{key}__tp{layout.tp_rank}of{layout.tp_size}"
                np.save(os.path.join(out_dir, base + ".npy"), arr.view(np.uint8) if arr.ndim else
                        np.frombuffer(arr.tobytes(), np.uint8), allow_pickle=False)
                with open(os.path.join(out_dir, base + ".json"), "w") as f:
                    json.dump({"dtype": arr.dtype.name, "shape": list(arr.shape)}, f)


def save_job(rank: int, *, topo: dict[str, int], dtype: str, path: str, dump_dir: str, master: bool = False,
             fail_rank: int | None = None, steps: int = 1, pack_below: int = 0) -> dict[str, Any]:
    layout, chunks = build(topo, rank, dtype)
    fill(layout, chunks, reference(0, DTYPES[dtype][1]))
    opt, masters = make_optimizer(chunks, master)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    grads_step(layout, chunks, opt, masters, sched, seed=1, steps=steps)
    if layout.dp_rank == 0:
        dump_globals(layout, chunks, opt, masters, dump_dir)
    model = chunks if len(chunks) > 1 else chunks[0]
    kwargs: dict[str, Any] = {"master_params": masters} if master else {}
    if rank == fail_rank:
        _sabotage(path)
    stats = gs.IOStats()
    gt.save_checkpoint(path, model=model, layout=layout, rules=RULES, optimizer=opt, scheduler=sched,
                       trainer_state={"step": steps, "consumed_samples": 64 * steps,
                                      "model_config": {"vocab": VOCAB, "hidden": HIDDEN}},
                       stats=stats, pack_below=pack_below, **kwargs)
    return {"lr": opt.param_groups[0]["lr"], "bytes_written": stats.bytes_written}


def _sabotage(path: str) -> None:
    """Make this rank's writes fail for real: just before it writes, a plain
    file is put where its first array directory must go, so TensorStore's
    write fails on the filesystem."""
    from globalshard.io import TensorStoreEngine  # LocalEngine inherits its write

    original = TensorStoreEngine.write

    def write_arrays(self: Any, items: Any, stats: Any = None, **options: Any) -> None:
        for p, *_ in items[:1]:
            os.makedirs(os.path.join(path, os.path.dirname(p)), exist_ok=True)
            with open(os.path.join(path, p), "w") as f:
                f.write("in the way")
        original(self, items, stats, **options)

    TensorStoreEngine.write = write_arrays  # type: ignore[method-assign]


def load_job(rank: int, *, topo: dict[str, int], dtype: str, path: str, expect_dir: str, master: bool = False,
             steps_after: int = 0, after_dir: str | None = None, shared_reads: bool = False) -> dict[str, Any]:
    layout, chunks = build(topo, rank, dtype)
    opt, masters = make_optimizer(chunks, master)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model = chunks if len(chunks) > 1 else chunks[0]
    kwargs: dict[str, Any] = {"master_params": masters} if master else {}
    result = gt.load_checkpoint(path, model=model, layout=layout, rules=RULES, optimizer=opt, scheduler=sched,
                                shared_reads=shared_reads, **kwargs)
    mismatches = compare(layout, chunks, opt, masters, expect_dir)
    out = {"mismatches": mismatches, "trainer_state_step": result.trainer_state["step"],
           "rng_restored": result.rng_restored, "lr": opt.param_groups[0]["lr"],
           "betas": list(opt.param_groups[0]["betas"]), "sched_last_epoch": sched.last_epoch,
           "n_state": sum(1 for s in opt.state.values() if s),
           "bytes_read": result.stats.bytes_read, "bytes_needed": result.stats.bytes_needed,
           "bytes_sent": result.stats.bytes_sent, "bytes_received": result.stats.bytes_received}
    if steps_after:
        grads_step(layout, chunks, opt, masters, sched, seed=1, steps=steps_after)
        if layout.dp_rank == 0 and after_dir:
            dump_globals(layout, chunks, opt, masters, after_dir)
    return out


def assemble(dump_dir: str) -> dict[str, dict[str, np.ndarray]]:
    """Global arrays from the saving ranks' dumps: item -> key -> array."""
    out: dict[str, dict[str, np.ndarray]] = {}
    shapes = global_shapes()
    for fname in sorted(os.listdir(dump_dir)):
        if not fname.endswith(".json"):
            continue
        item, key, tpinfo = fname[:-5].split("__")
        r, tp = (int(x) for x in tpinfo[2:].split("of"))
        with open(os.path.join(dump_dir, fname)) as f:
            meta = json.load(f)
        raw = np.load(os.path.join(dump_dir, fname[:-5] + ".npy"), allow_pickle=False)
        dt = np.dtype(getattr(ml_dtypes, meta["dtype"], None) or meta["dtype"])
        local = raw.view(dt).reshape(meta["shape"])
        if local.ndim == 0:
            out.setdefault(item, {})[key] = local.copy()
            continue
        g = out.setdefault(item, {}).setdefault(key, np.full(shapes[key], np.nan, dt))
        place(g, local, kind_of(key), tp, r)
    return out


def place(g: np.ndarray, local: np.ndarray, kind: str, tp: int, r: int) -> None:
    """Inverse of local_slice: write a rank's local array into the global one."""
    if kind == "whole":
        g[...] = local
    elif kind == "cols":
        n = g.shape[1] // tp
        g[:, r * n:(r + 1) * n] = local
    elif kind == "vocab":
        n = padded_vocab(tp) // tp
        part = g[r * n:(r + 1) * n]
        part[...] = local[: len(part)]
    else:
        # qkv / swiglu: the slicing of an index array tells where each local row came from
        rows = local_slice(np.arange(g.shape[0]), kind, tp, r)
        g[rows] = local


def compare(layout: gt.ParallelLayout, chunks: list[Chunk], opt: torch.optim.Optimizer,
            masters: dict[str, torch.Tensor], expect_dir: str) -> list[str]:
    """Every loaded tensor vs the slice of what the saving job held; bit for bit."""
    expected = {item: {k: v for k, v in d.items()} for item, d in _load_expected(expect_dir).items()}
    bad = []
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            key = key_of(layout, c, name)
            label = f"chunk{c}/{name}" if len(chunks) > 1 else name
            checks = {"param": p}
            holder = masters.get(label, p)
            checks |= {k: v for k, v in opt.state.get(holder, {}).items()}
            if masters:
                checks["master"] = holder
            for item in expected:
                if key in expected[item] and item not in checks:
                    bad.append(f"{label}: {item} missing after load")
            for item, t in checks.items():
                if key not in expected.get(item, {}):
                    bad.append(f"{label}: {item} present but not saved")
                    continue
                want = expected[item][key]
                got = view(t.detach())
                if got.ndim:
                    want = local_slice(want, kind_of(key), layout.tp_size, layout.tp_rank)
                    if kind_of(key) == "vocab":
                        n_real = max(0, min(len(want), VOCAB - layout.tp_rank * len(want)))
                        want = want.copy()
                        want[n_real:] = 0  # padding rows: zero-filled on load
                if got.dtype != want.dtype or got.tobytes() != np.ascontiguousarray(want).tobytes():
                    bad.append(f"{label}: {item} differs (dtype {got.dtype} vs {want.dtype})")
    return bad


_CACHE: dict[str, Any] = {}


def _load_expected(expect_dir: str) -> dict[str, dict[str, np.ndarray]]:
    if expect_dir not in _CACHE:
        with open(os.path.join(expect_dir, "expected.json")) as f:
            index = json.load(f)
        out: dict[str, dict[str, np.ndarray]] = {}
        for item, keys in index.items():
            for key, meta in keys.items():
                raw = np.load(os.path.join(expect_dir, meta["file"]), allow_pickle=False)
                dt = np.dtype(getattr(ml_dtypes, meta["dtype"], None) or meta["dtype"])
                out.setdefault(item, {})[key] = raw.view(dt).reshape(meta["shape"])
        _CACHE[expect_dir] = out
    return _CACHE[expect_dir]


def write_expected(globals_: dict[str, dict[str, np.ndarray]], expect_dir: str) -> None:
    os.makedirs(expect_dir, exist_ok=True)
    index: dict[str, dict[str, Any]] = {}
    for item, keys in globals_.items():
        for n, (key, arr) in enumerate(sorted(keys.items())):
            fname = f"{item}_{n}.npy"
            np.save(os.path.join(expect_dir, fname), np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.uint8),
                    allow_pickle=False)
            index.setdefault(item, {})[key] = {"file": fname, "dtype": arr.dtype.name, "shape": list(arr.shape)}
    with open(os.path.join(expect_dir, "expected.json"), "w") as f:
        json.dump(index, f)


def topo_dict(t: Topo) -> dict[str, int]:
    return asdict(t)


# ----------------------------------------------------------------------- DTensor jobs

DT_SHAPES = {"w_uneven": (5, 4), "w_cols": (4, 6), "bias": (4,)}


def _placements(spec: list[str]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if s == "R" else Shard(int(s[1:])) for s in spec]


class DTModel(nn.Module):
    def __init__(self, mesh_shape: list[int] | None, placements: dict[str, list[str]]):
        super().__init__()
        ref = reference_dt()
        if mesh_shape is None:  # one process, plain tensors
            for name, value in ref.items():
                self.register_parameter(name, nn.Parameter(torch.zeros(value.shape)))
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", tuple(mesh_shape))
        for name, value in ref.items():
            full = torch.from_numpy(value.copy())
            self.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, _placements(placements[name]))))


def reference_dt() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in DT_SHAPES.items()}


def _full(t: torch.Tensor) -> np.ndarray:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().numpy().copy()


def dtensor_save_job(rank: int, *, mesh_shape: list[int], placements: dict[str, list[str]], path: str,
                     dump: str) -> None:
    model = DTModel(mesh_shape, placements)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 1.0
    opt.step()
    held = {}
    for name, p in model.named_parameters():
        held[f"param.{name}"] = _full(p)
        for item, v in opt.state[p].items():
            held[f"{item}.{name}"] = _full(v)
    if rank == 0:
        np.savez(dump, **held)
    gt.save_checkpoint(path, model=model, layout=gt.ParallelLayout(), optimizer=opt)


def dtensor_load_job(rank: int, *, mesh_shape: list[int] | None, placements: dict[str, list[str]], path: str,
                     dump: str) -> list[str]:
    model = DTModel(mesh_shape, placements)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    rules = gt.ShardingRules([(".*", gt.Replicated())]) if mesh_shape is None else None
    gt.load_checkpoint(path, model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=opt)
    with np.load(dump, allow_pickle=False) as f:
        held = dict(f)
    bad = []
    for name, p in model.named_parameters():
        checks = {f"param.{name}": p} | {f"{item}.{name}": v for item, v in opt.state[p].items()}
        for label, t in checks.items():
            if _full(t).tobytes() != held[label].tobytes():
                bad.append(label)
        if mesh_shape is not None and type(opt.state[p]["exp_avg"]).__name__ != "DTensor":
            bad.append(f"{name}: exp_avg is not a DTensor")
    return bad


def dtensor_single_process_load(path: str, dump: str) -> list[str]:
    return dtensor_load_job(0, mesh_shape=None, placements={}, path=path, dump=dump)


def crash_job(rank: int, *, path: str, timeout_s: float) -> str:
    """Rank 1 dies (no exception, no goodbye) before the first collective of a save."""
    comm = gt.TorchComm(timeout=timedelta(seconds=timeout_s))
    if rank == 1:
        os._exit(0)
    layout, chunks = build({"tp": 2}, rank, "float32")
    gt.save_checkpoint(path, model=chunks[0], layout=layout, rules=RULES, comm=comm)
    return "saved"


def submesh_save_job(rank: int, *, path: str, dump: str) -> None:
    """World 3; a DTensor on a mesh of ranks 0 and 1 only, so rank 2 holds nothing of it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    model = nn.Module()
    model.register_parameter("w", nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    if mesh.get_coordinate() is not None:
        model.w.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        opt.step()
        full_after = _full(model.w)  # a collective over the mesh: both members call it
        if rank == 0:
            np.save(dump, full_after)
    gt.save_checkpoint(path, model=model, layout=gt.ParallelLayout(), optimizer=opt)


def failing_load_job(rank: int, *, path: str) -> dict[str, Any]:
    """Rank 1's model has a tensor the checkpoint lacks: its load fails in
    planning. Rank 0 must fail too, with its model and optimizer untouched."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=rank == 1))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-7.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    rules = gt.ShardingRules([(".*", gt.Replicated())])
    try:
        gt.load_checkpoint(path, model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=opt)
        outcome = "loaded"
    except gs.GlobalShardError as e:
        outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "untouched": all(bool((p == -7.0).all()) for p in model.parameters()),
            "no_state": not opt.state, "lr": opt.param_groups[0]["lr"]}


def crash_rank_job(rank: int, *, path: str, victim: int, kill_at: int, tag: int) -> str:
    """A 2-rank save (TP=2) in which rank ``victim`` is SIGKILLed at its
    ``kill_at``-th filesystem operation (0: nobody is, count them instead)."""
    import saver

    comm = gt.TorchComm(timeout=timedelta(seconds=10))
    state = saver.stamped_state(tag, rank=rank)
    events = saver._counter()
    if rank == victim and kill_at:
        saver._kill_at(kill_at)
    gs.save(state, path, trainer_state={"tag": tag}, comm=comm, overwrite=True)
    return json.dumps({"events": events[0]})


def run_tolerating_deaths(world: int, fn_name: str, out_dir: str, **args: Any) -> list[dict[str, Any]]:
    """:func:`run`, where a rank may be killed: the others are then stopped too
    (as a job scheduler would), and the outcome of each is what it wrote."""
    try:
        return run(world, fn_name, out_dir, **args)
    except mp.ProcessExitedException:
        outcomes = []
        for r in range(world):
            try:
                with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                    outcomes.append(json.load(f))
            except (FileNotFoundError, ValueError):  # none, or cut short when it was stopped
                outcomes.append({"ok": False, "type": "killed", "message": "no outcome"})
        return outcomes


def state_dict_save_job(rank: int, *, path: str, dump: str, saver: str | None = None) -> None:
    """2 ranks, DTensor parameters (rows sharded), AdamW after a step; the DCP
    state dict saved through globalshard_torch.save (with ``saver``, an
    AsyncSaver of that mode, the parameters changing while it writes)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = nn.Module()
    full = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    model.register_parameter("w", nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
    model.register_parameter("b", nn.Parameter(distribute_tensor(torch.ones(5), mesh, [Shard(0)])))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.w.grad = distribute_tensor(torch.ones(6, 5), mesh, [Shard(0)])
    model.b.grad = distribute_tensor(torch.ones(5), mesh, [Shard(0)])
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    held = {"w": _full(model.w), "b": _full(model.b), "exp_avg.w": _full(opt.state[model.w]["exp_avg"])}
    if rank == 0:
        np.savez(dump, **held)
    if saver is None:
        gt.save({"model": model_sd, "optim": optim_sd, "step": 7}, path)
        return
    background = gs.AsyncSaver(saver)
    gt.save({"model": model_sd, "optim": optim_sd, "step": 7}, path, saver=background)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
            opt.state[p]["exp_avg"].add_(1000.0)
    background.wait()


def replica_drift_job(rank: int, *, path: str, saver: str | None) -> dict[str, Any]:
    """2 ranks whose copies drifted apart: a DCP state dict with a row-sharded DTensor,
    a replicated one and a plain buffer (as a BatchNorm's running mean, never all-reduced)
    that rank 1 holds one ulp off; and save_checkpoint at DP=2, its data-parallel
    replica of one bias off. Each saved with ``check_replicas=True`` (with ``saver``,
    an AsyncSaver of that mode): what each save raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    mean = torch.full((4,), 0.5)
    if rank == 1:
        mean[2] = torch.nextafter(mean[2], torch.tensor(1.0))
    state = {"model": {"w": distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]),
                       "norm": distribute_tensor(torch.ones(2), mesh, [Replicate()]), "running_mean": mean}}
    background = gs.AsyncSaver(saver) if saver else None
    outcome: dict[str, Any] = {}
    for name, save in (
            ("state_dict", lambda: gt.save(state, os.path.join(path, "sd"), check_replicas=True, saver=background)),
            ("checkpoint", lambda: gt.save_checkpoint(
                os.path.join(path, "ckpt"), model=_drifted_linear(rank), layout=gt.ParallelLayout(
                    dp_rank=rank, dp_size=2), rules=gt.ShardingRules([(".*", gt.Replicated())]),
                check_replicas=True, saver=background))):
        try:
            save()
            if background is not None:
                background.wait()
            outcome[name] = None
        except gs.MismatchError as e:
            outcome[name] = str(e)
        where = {"state_dict": "sd", "checkpoint": "ckpt"}[name]
        outcome[name + "_committed"] = os.path.exists(os.path.join(path, where, "metadata.json"))
    return outcome


def _drifted_linear(rank: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    if rank == 1:
        with torch.no_grad():
            model.bias[0] += 1e-3
    return model


def load_during_async_save_job(rank: int, *, path: str, mode: str) -> dict[str, Any]:
    """2 ranks: a checkpoint saved, then the next one saved by an AsyncSaver
    (``mode``) and the first loaded while it is in flight, without waiting for
    it: its collectives (in the background) and the load's share the
    communicator. Rank 1's background reaches its first collective late and
    rank 0's load starts late, so that unordered, the two ranks would pair
    one's load with the other's save. Whether each load got its checkpoint."""
    from globalshard.checkpoint import saving

    first = {f"w{i}": torch.full((64, 32), float(i)) for i in range(6)}
    gt.save({"model": first, "step": 1}, os.path.join(path, "a"))
    gathered = saving.run_collectively

    def late(comm: Any, step: str, fn: Any) -> Any:  # scoped to this job's process
        if rank == 1 and step == "save: writing":
            time.sleep(1.0)
        return gathered(comm, step, fn)

    saving.run_collectively = late
    saver = gs.AsyncSaver(mode)
    second = {k: v + 100 for k, v in first.items()}
    gt.save({"model": second, "step": 2}, os.path.join(path, "b"), saver=saver)
    if rank == 0:
        time.sleep(0.3)
    got = {"model": {k: torch.zeros_like(v) for k, v in first.items()}, "step": 0}
    gt.load(got, os.path.join(path, "a"))
    loaded_first = got["step"] == 1 and all(torch.equal(got["model"][k], v) for k, v in first.items())
    saver.wait()
    got = {"model": {k: torch.zeros_like(v) for k, v in first.items()}, "step": 0}
    gt.load(got, os.path.join(path, "b"))
    return {"first": loaded_first,
            "second": got["step"] == 2 and all(torch.equal(got["model"][k], v) for k, v in second.items())}


def state_dict_load_job(rank: int, *, path: str) -> dict[str, Any]:
    """1 rank or 2 ranks with the rows sharded differently (columns)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = nn.Module()
    model.register_parameter("w", nn.Parameter(distribute_tensor(torch.zeros(6, 5), mesh, [Shard(1)])))
    model.register_parameter("b", nn.Parameter(distribute_tensor(torch.zeros(5), mesh, [Replicate()])))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    gt.load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"w": _full(model.w).tolist(), "b": _full(model.b).tolist(),
            "exp_avg.w": _full(opt.state[model.w]["exp_avg"]).tolist(), "lr": opt.param_groups[0]["lr"],
            "step": state["step"]}


def meta_state_dict_job(rank: int, *, path: str, dcp_path: str) -> dict[str, Any]:
    """2 ranks: DTensor parameters (rows sharded) and a plain tensor saved with
    globalshard_torch.save and with DCP, then each loaded by its own load into
    the state dict of a model built on the meta device (columns sharded):
    what each load left in the state dict, and the DTensors' placements."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "scale": torch.full((3,), 0.5)}
    gt.save({"model": state}, path)
    dcp.save({"model": state}, checkpoint_id=dcp_path)
    out: dict[str, Any] = {}
    loads = {"ours": lambda sd: gt.load(sd, path), "dcp": lambda sd: dcp.load(sd, checkpoint_id=dcp_path)}
    for name, load in loads.items():
        local = torch.empty(6, 3 if rank == 0 else 2, device="meta")  # columns 3 + 2, as Shard(1) cuts 5
        sd = {"model": {"w": DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=(6, 5),
                                                stride=(5, 1)),
                        "scale": torch.empty(3, device="meta")}}
        load(sd)
        w = sd["model"]["w"]
        out[name] = {"w": w.full_tensor().tolist(), "w_local": w.to_local().tolist(), "w_device": str(w.device),
                     "w_placements": str(w.placements), "scale": sd["model"]["scale"].tolist(),
                     "scale_device": str(sd["model"]["scale"].device)}
    return out


def tp_by_dp_job(rank: int, *, path: str, dcp_path: str, dump: str) -> None:
    """World 4, mesh (dp=2, tp=2): tensor parallelism on the "tp" sub-mesh and
    data-parallel copies across it (DDP, or torchtitan's MoE ``expert_bias``
    buffer on the TP mesh), so each DTensor's mesh is half of the world and
    each of its two copies places itself at the same global offsets.
    Saved with globalshard and with DCP after an AdamW step."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    model = nn.Module()
    w = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    b = torch.linspace(-1.0, 1.0, 3)
    model.register_parameter("w", nn.Parameter(distribute_tensor(w, tp, [Shard(0)])))
    model.register_parameter("b", nn.Parameter(distribute_tensor(b, tp, [Replicate()])))
    model.register_buffer("counts", distribute_tensor(torch.arange(4.0), tp, [Replicate()]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    for p in model.parameters():
        p.grad = torch.sin(p.detach() * 3.0)
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    held = {"w": _full(model.w), "b": _full(model.b), "counts": _full(model.counts),
            "exp_avg.w": _full(opt.state[model.w]["exp_avg"]), "exp_avg_sq.b": _full(opt.state[model.b]["exp_avg_sq"])}
    if rank == 0:
        np.savez(dump, **held)
    dcp_save(state, checkpoint_id=dcp_path)
    gt.save(state, path)


def stages_job(rank: int, *, path: str) -> None:
    """World 2 as two pipeline stages hold a DCP-style state: each rank its own
    layers (plain tensors), JSON values, bytes and streams (at a position of
    their own), beside keys both hold (equal)."""
    own = {"weight": torch.full((2, 3), float(rank + 1)), "lr": 0.1 * (rank + 1), "seed": bytes([rank, 7])}
    stream = io.BytesIO(bytes([rank, 5, 5]))
    stream.seek(rank + 1)
    gt.save({"model": {f"layers.{rank}.weight": own["weight"], "step": torch.tensor(5)},
             "optim": {f"layers.{rank}.lr": own["lr"], "rng": b"\x09\x07"},
             "stage": {f"{rank}": own["seed"]}, "extra": {f"{rank}": stream}, "epoch": 2,
             # tuples, kept as saved: each rank's own, and of a key both hold, the lowest rank's
             "shapes": {f"{rank}": (rank, "x")}, "both": [3, (1, 2)] if rank == 0 else (3, [1, 2])}, path)


def replica_groups_job(rank: int, *, root: str) -> dict[str, Any]:
    """World 4 as a (2, 2) HSDP mesh: each row of the mesh (ranks 0-1, 2-3) saves
    its own checkpoint with its row's process group as ``comm=`` (DCP's
    ``process_group``), its weight sharded on rows over the row; then row 0
    loads row 1's checkpoint cut on columns, and row 1 row 0's, each over its
    group again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    row, group = rank // 2, mesh["shard"].get_group()
    full = torch.arange(32.0).reshape(8, 4) + 100 * row
    state = {"w": distribute_tensor(full, mesh["shard"], [Shard(0)]), "row": row, "blob": bytes([row])}
    gt.save(state, f"{root}/row{row}", comm=group)
    again = gt.resolve_comm(group)
    gt.save(state, f"{root}/row{row}", comm=group, overwrite=True)  # the group's communicator, reused
    dist.barrier()  # both rows saved before either reads the other's
    target = {"w": distribute_tensor(torch.zeros(8, 4), mesh["shard"], [Shard(1)]), "row": None, "blob": b""}
    gt.load(target, f"{root}/row{1 - row}", comm=group)
    expected = torch.arange(32.0).reshape(8, 4) + 100 * (1 - row)
    return {"equal": bool(torch.equal(target["w"].full_tensor(), expected)), "row": target["row"],
            "blob": list(target["blob"]), "reused": gt.resolve_comm(group) is again}


def tier_state_dict_job(rank: int, *, root: str, save: bool) -> dict[str, Any]:
    """A DCP-style state dict in a TieredManager's tiers. Saving: world 4 as 2
    nodes of 2, a weight as FSDP2 over TP leaves it (mesh dp=2 x tp=2), a
    moment cut on both dims, JSON and a tuple, saved asynchronously while
    training goes on. Recovering: world 2 on the second node alone, its
    copies only, another mesh and placement."""
    import random

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    tier = gs.LocalTier(lambda node: f"{root}/local/node{node if save else 1}", replicas=1, ranks_per_node=2)
    manager = gt.TieredManager(tiers=[tier, f"{root}/persistent"])
    full = torch.arange(48.0).reshape(8, 6)
    random.seed(3)
    rng = random.getstate()
    if save:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        w = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2), Shard(0)], src_data_rank=None)
        m = distribute_tensor(full * 2, mesh, [Shard(0), Shard(1)], src_data_rank=None)
        saver = gs.AsyncSaver()
        gt.save({"model": {"w": w}, "optim": {"w": {"exp_avg": m}}, "step": 7, "rng": rng}, manager.target(7),
                saver=saver)
        w.to_local().fill_(-1)  # training goes on: the tiers hold the values of the call
        m.to_local().fill_(-1)
        manager.wait()
        return {"mode": saver.last_mode, "persisted": manager.persisted()}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    target = {"model": {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)])},
              "optim": {"w": {"exp_avg": distribute_tensor(torch.zeros(8, 6), mesh, [Replicate()])}},
              "step": None, "rng": None}
    found = manager.open_latest()
    gt.load(target, found)
    return {"w": bool(torch.equal(target["model"]["w"].full_tensor(), full)),
            "m": bool(torch.equal(target["optim"]["w"]["exp_avg"].full_tensor(), full * 2)),
            "step": target["step"], "rng": target["rng"] == rng and type(target["rng"]) is tuple,
            "bytes_persistent": found.recovery.bytes_persistent, "bytes_peer": found.recovery.bytes_peer,
            "bytes_local": found.recovery.bytes_local}


def tier_lora_job(rank: int, *, root: str, save: bool) -> dict[str, Any]:
    """A LoRA fine-tune's state dict in a TieredManager's tiers. Saving: world
    4 as 2 nodes of 2, the frozen weight in row quarters (TP), step 1 whole,
    step 2 (asynchronously) referencing it for the weight. Resuming: world 2
    on the second node alone, columns: the step recovered from that node's
    copies (of both steps), then step 3 saved with ``unchanged=`` the
    digests of what it loaded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from globalshard_torch.state_dict import region_digests

    tier = gs.LocalTier(lambda node: f"{root}/local/node{node if save else 1}", replicas=1, ranks_per_node=2)
    manager = gt.TieredManager(tiers=[tier, f"{root}/persistent"])
    full = torch.arange(64.0).reshape(8, 8)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    if save:
        w = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        lora = distribute_tensor(torch.zeros(2, 8), mesh, [Replicate()], src_data_rank=None)
        gt.save({"model": {"w": w, "lora": lora}}, manager.target(1), digests=True)
        saver = gs.AsyncSaver()
        lora.to_local().fill_(2)
        gt.save({"model": {"w": w, "lora": lora}}, manager.target(2), saver=saver, base=manager.path(1),
                frozen=["model.w"])
        lora.to_local().fill_(-1)  # training goes on
        manager.wait()
        return {"mode": saver.last_mode, "persisted": manager.persisted()}
    state = {"model": {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(1)]),
                       "lora": distribute_tensor(torch.zeros(2, 8), mesh, [Replicate()])}}
    found = manager.open_latest()
    gt.load(state, found)
    out = {"w": bool(torch.equal(state["model"]["w"].full_tensor(), full)),
           "lora": bool(torch.equal(state["model"]["lora"].full_tensor(), torch.full((2, 8), 2.0))),
           "bytes_persistent": found.recovery.bytes_persistent, "bytes_local": found.recovery.bytes_local}
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, region_digests({"model.w": state["model"]["w"]}, {"model.w"}))
    known: dict[str, dict[Any, str]] = {}
    for piece in pieces:
        for key, digests in piece.items():
            known.setdefault(key, {}).update(digests)
    state["model"]["lora"].to_local().fill_(3)
    stats = gs.IOStats()
    gt.save(state, manager.target(3), saver=gs.AsyncSaver(), base=manager.path(1), unchanged=known, stats=stats)
    manager.wait()
    md, base = gs.read_metadata(manager.path(3)), gs.read_metadata(manager.path(1))
    out["w_referenced_in_the_base_cut"] = [(r.box, r.path, r.base) for r in md.tensors["model.w"].regions] == \
        [(r.box, r.path, 0) for r in base.tensors["model.w"].regions]
    out["bytes_written"] = stats.bytes_written
    return out


def overlapping_meshes_job(rank: int, *, path: str) -> str:
    """World 3; two meshes both named ("tp",) of 2 ranks, [0, 1] and [1, 2]: rank 1 is on both."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    meshes = [DeviceMesh("cpu", ranks, mesh_dim_names=("tp",)) for ranks in ([0, 1], [1, 2])]
    state = {name: distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
             for name, mesh in zip("ab", meshes) if mesh.get_coordinate() is not None}
    try:
        gt.save(state, path)
        return "saved"
    except gs.GlobalShardError as e:
        return f"{type(e).__name__}: {e}"


def strided_job(rank: int, *, path: str, rows: int, save: bool) -> dict[str, Any]:
    """Mesh (dp=2, tp=2); a weight as FSDP2 over TP leaves it:
    [_StridedShard(0, split_factor=2), Shard(0)]; a bias Shard(0) on tp only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    model = nn.Module()
    init = full if save else torch.zeros_like(full)
    placements = [_StridedShard(0, split_factor=2), Shard(0)] if save else [Shard(0), Replicate()]
    # every rank holds the full tensor: split locally (src_data_rank=None), as FSDP2 does for strided shards
    model.register_parameter("w", nn.Parameter(distribute_tensor(init, mesh, placements, src_data_rank=None)))
    if save:
        gt.save({"w": model.w}, path)
        return {"regions": len(gt.model._dtensor_placement(model.w)[1].regions or ())}
    state = {"w": model.w}
    gt.load(state, path)
    return {"ok": bool(np.array_equal(_full(model.w), full.numpy()))}


def partial_job(rank: int, *, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (2,))
    w = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
    try:
        gt.save({"layer": {"w": w}}, path)
        return "saved"
    except gs.LayoutError as e:
        return str(e)


def moe_save_job(rank: int, *, path: str) -> dict[str, Any]:
    """DP=2 carved into EP=2 (TP=1): each rank holds 2 of 4 experts, one module
    each (Megatron-Core's SequentialMLP), trained one AdamW step."""
    from test_torch_moe import MoE, reference, rules

    layout = gt.ParallelLayout(dp_rank=rank, dp_size=2, ep_size=2)
    model = MoE("sequential", layout)
    ref = reference()
    with torch.no_grad():
        model.router.weight.copy_(torch.from_numpy(ref["router"]))
        for i, ex in enumerate(model.experts.local_experts):
            ex.linear_fc1.weight.copy_(torch.from_numpy(ref["fc1"][2 * rank + i]))
            ex.linear_fc2.weight.copy_(torch.from_numpy(ref["fc2"][2 * rank + i]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    opt.step()
    gt.save_checkpoint(path, model=model, layout=layout, rules=rules("sequential"), optimizer=opt)
    exs = model.experts.local_experts
    return {"fc1": [ex.linear_fc1.weight.detach().numpy().tolist() for ex in exs],
            "exp_avg": [opt.state[ex.linear_fc1.weight]["exp_avg"].numpy().tolist() for ex in exs]}


def _zero_model() -> tuple[nn.Module, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)


def zero_save_job(rank: int, *, path: str) -> dict[str, Any]:
    """DP=2, torch's ZeroRedundancyOptimizer: each rank holds the state of its partition."""
    model, opt = _zero_model()
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    gt.save_checkpoint(path, model=model, layout=gt.ParallelLayout(dp_rank=rank, dp_size=2),
                       rules=gt.ShardingRules([(".*", gt.Replicated())]), optimizer=opt)
    opt.consolidate_state_dict(to=0)  # the reference, gathered the way torch does it
    if rank != 0:
        return {}
    full = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    return {"params": {n: p.detach().numpy().tolist() for n, p in model.named_parameters()},
            "exp_avg_sq": {names[i]: s["exp_avg_sq"].numpy().tolist() for i, s in full["state"].items()}}


def zero_load_job(rank: int, *, path: str, expect: dict[str, Any]) -> list[str]:
    model, opt = _zero_model()
    gt.load_checkpoint(path, model=model, layout=gt.ParallelLayout(dp_rank=rank, dp_size=2),
                       rules=gt.ShardingRules([(".*", gt.Replicated())]), optimizer=opt)
    bad = []
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.optim.param_groups:
        for p in group["params"]:
            got = opt.optim.state[p]["exp_avg_sq"].numpy()
            if not np.array_equal(got, np.array(expect["exp_avg_sq"][names[id(p)]], np.float32)):
                bad.append(names[id(p)])
    return bad


def do_save_job(rank: int, *, path: str) -> int:
    """TP=2 x DP=2 over gloo, Megatron-style distributed optimizer pieces.
    Returns the peak RSS growth of this rank during the save, in bytes."""
    import resource

    from test_torch_zero import ITEMS, RULES, build, do_shards, reference, topology

    weights = reference(3)
    moments = {item: reference(30 + i) for i, item in enumerate(ITEMS)}
    t, s, d = topology(2, 1, 2)[rank]
    layout, model = build(2, 1, t, s, d, 2, fill=weights)
    pieces = do_shards(layout, model, moments, bucket_size=120)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gt.save_checkpoint(path, model=model, layout=layout, rules=RULES, optimizer_shards=pieces,
                       optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.004))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def values_of(outcomes: list[dict[str, Any]]) -> list[Any]:
    """Each rank's returned value from :func:`run`, failing with the rank's
    traceback if any rank raised."""
    for r, o in enumerate(outcomes):
        assert o["ok"], f"rank {r}: {o.get('type')}: {o.get('message')}\n{o.get('trace')}"
    return [o["value"] for o in outcomes]
