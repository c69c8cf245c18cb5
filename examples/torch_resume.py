"""Train a tensor-parallel MLP on 2 processes, save, resume in 1 process.

    .venv/bin/python examples/torch_resume.py [OUT_DIR]

Two ranks (gloo on 127.0.0.1) run a column-parallel then row-parallel MLP
with a real all-reduce, AdamW and a LR schedule, for 3 steps; they save with
one call. One process then loads the checkpoint at TP=1 with one call and
trains 3 more steps; a reference run that never stopped, at TP=1, must match
its losses.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import globalshard_torch as gt

HIDDEN, FFN, STEPS = 8, 32, 6
RULES = gt.ShardingRules([
    (r"up\.weight", gt.ColumnParallel()), (r"up\.bias", gt.ColumnParallel()),
    (r"down\.weight", gt.RowParallel()), (r"down\.bias", gt.Replicated()),
])


class TPMLP(nn.Module):
    def __init__(self, tp: int):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN // tp)
        self.down = nn.Linear(FFN // tp, HIDDEN)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(torch.relu(self.up(x)), self.down.weight)
        if self.tp > 1:
            partial = AllReduce.apply(partial)
        return partial + self.down.bias


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, HIDDEN, generator=g), torch.randn(16, HIDDEN, generator=g)


def setup(tp: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer, object, gt.ParallelLayout]:
    torch.manual_seed(0)
    full_up, full_down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)  # same init on every rank
    model = TPMLP(tp)
    n = FFN // tp
    with torch.no_grad():
        model.up.weight.copy_(full_up.weight[rank * n:(rank + 1) * n])
        model.up.bias.copy_(full_up.bias[rank * n:(rank + 1) * n])
        model.down.weight.copy_(full_down.weight[:, rank * n:(rank + 1) * n])
        model.down.bias.copy_(full_down.bias)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched, gt.ParallelLayout(tp_rank=rank, tp_size=tp)


def train(model, opt, sched, steps: range) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def tp2_rank(rank: int, port: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    model, opt, sched, layout = setup(2, rank)
    train(model, opt, sched, range(STEPS // 2))
    gt.save_checkpoint(path, model=model, layout=layout, rules=RULES, optimizer=opt, scheduler=sched,
                       trainer_state={"step": STEPS // 2})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join("build", "torch_resume")
    path = os.path.join(out, "ckpt")
    os.makedirs(out, exist_ok=True)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.start_processes(tp2_rank, args=(port, path), nprocs=2, start_method="spawn")

    model, opt, sched, layout = setup(1, 0)  # TP=1: load overwrites all of it
    result = gt.load_checkpoint(path, model=model, layout=layout, rules=RULES, optimizer=opt, scheduler=sched)
    resumed = train(model, opt, sched, range(result.trainer_state["step"], STEPS))

    ref_model, ref_opt, ref_sched, _ = setup(1, 0)
    reference = train(ref_model, ref_opt, ref_sched, range(STEPS))[STEPS // 2:]
    worst = max(abs(a - b) for a, b in zip(resumed, reference))
    for step, (a, b) in enumerate(zip(resumed, reference), start=STEPS // 2):
        print(f"step {step}: resumed at TP=1 {a:.6f}   never stopped {b:.6f}")
    print(f"max |loss difference| = {worst:.2e}")
    if worst > 1e-5:
        raise SystemExit("resumed losses do not follow the reference")


if __name__ == "__main__":
    main()
