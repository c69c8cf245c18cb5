"""The README's torch lines run on gloo ranks as printed, after the names they use are defined.

The README saves at TP=2 x PP=2 (24 layers) and loads at ``new_layout``; here
that is TP=4 on the same 4 ranks, into a model and optimizer built for it.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from repo import ROOT
from torch import nn

import globalshard as gs
import globalshard_torch as gt

vocab_size, num_heads, num_kv_heads = 13, 8, 4
HIDDEN, HEAD_DIM, FFN = 8, 2, 8


def readme_torch() -> tuple[str, str]:
    """The README's torch block: the lines up to the load, and the load."""
    with open(f"{ROOT}/README.md") as f:
        code = re.search(r"## Torch\n\n```python\n(.*?)```", f.read(), re.S).group(1)
    save, load = code.split("result = ", 1)
    return save, "result = " + load


class Block(nn.Module):
    def __init__(self, tp: int):
        super().__init__()
        self.attn = nn.Module()
        self.attn.norm = nn.Parameter(torch.randn(HIDDEN))
        self.attn.qkv = nn.Linear(HIDDEN, (num_heads + 2 * num_kv_heads) * HEAD_DIM // tp, bias=False)
        self.attn.proj = nn.Linear(num_heads * HEAD_DIM // tp, HIDDEN, bias=False)
        self.mlp = nn.Module()
        self.mlp.norm = nn.Parameter(torch.randn(HIDDEN))
        self.mlp.gate_up = nn.Linear(HIDDEN, 2 * FFN // tp, bias=False)
        self.mlp.down = nn.Linear(FFN // tp, HIDDEN, bias=False)


def model(layout: gt.ParallelLayout) -> nn.Module:
    """One pipeline stage: the embedding on the first, the final norm on the last."""
    chunk = nn.Module()
    if layout.is_first_stage:
        chunk.embedding = nn.Embedding(-(-vocab_size // layout.tp_size), HIDDEN)
    chunk.layers = nn.ModuleList(Block(layout.tp_size) for _ in layout.chunk_layers(0))
    if layout.is_last_stage:
        chunk.final_norm = nn.Parameter(torch.randn(HIDDEN))
    return chunk


def trained(layout: gt.ParallelLayout) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    chunks = model(layout)
    opt = torch.optim.AdamW(chunks.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    for p in chunks.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    return chunks, opt, sched


def readme_torch_job(rank: int, path: str, again: str) -> dict:
    """Save as the README does at TP=2 x PP=2, load at TP=4, save that again at ``again``."""
    torch.manual_seed(rank)
    save, load = readme_torch()
    tp_rank, pp_rank, step = rank % 2, rank // 2, 100
    chunks, opt, sched = trained(gt.ParallelLayout(tp_rank=tp_rank, tp_size=2, pp_rank=pp_rank, pp_size=2,
                                                   num_layers=24))
    names = {"gt": gt, "vocab_size": vocab_size, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
             "tp_rank": tp_rank, "pp_rank": pp_rank, "path": path, "step": step, "chunks": chunks, "opt": opt,
             "sched": sched}
    exec(save, names)
    new_layout = gt.ParallelLayout(tp_rank=rank, tp_size=4, num_layers=24)
    chunks = model(new_layout)
    opt = torch.optim.AdamW(chunks.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    names |= {"new_layout": new_layout, "chunks": chunks, "opt": opt, "sched": sched}
    exec(load, names)
    result = names["result"]
    gt.save_checkpoint(again, model=chunks, layout=new_layout, rules=names["rules"], optimizer=opt,
                       scheduler=sched, trainer_state=result.trainer_state)
    dist.barrier()
    return {"trainer_state": result.trainer_state, "missing": list(result.missing_keys),
            "unexpected": list(result.unexpected_keys), "lr": sched.get_last_lr(), "keys": len(
                gs.read_metadata(path).tensors)}
