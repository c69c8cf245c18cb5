"""Run a job on a gloo process group of a few ranks: one spawn of the group runs
every scenario of a module (framework imports take seconds per process)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch_harness import free_port, start_method

#: Imported once by the session's fork server, so that each rank of the many short torchtitan and
#: transformers jobs does not import them again (about 3 of a rank's 5 seconds of imports). Frameworks
#: only, unpatched: each job's module applies its scoped patches in its own ranks.
FRAMEWORKS = ["transformers", "torchtitan.components.checkpointer", "torchtitan.components.lora",
              "torchtitan.models.llama3", "torchtitan.models.qwen3", "torchtitan.models.deepseek_v3"]


def _entry(rank: int, world: int, port: int, target: str, args: dict[str, Any], out_dir: str,
           paths: list[str], env: dict[str, str]) -> None:
    sys.path[:0] = paths
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    module, _, fn = target.partition(":")
    try:
        out = getattr(importlib.import_module(module), fn)(rank, **args)
        result = {"ok": True, "value": out}
    except BaseException as e:  # reported to the parent, which asserts on it
        result = {"ok": False, "type": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        if result["ok"]:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        for child in mp.active_children():  # e.g. dist_checkpointing's writer Manager, else the join hangs
            child.kill()
        os._exit(0)  # gloo's threads can abort in static destructors at exit


def run(world: int, target: str, out_dir: str, **args: Any) -> list[Any]:
    """``module:function(rank, **args)`` on ``world`` processes; every rank's return value.

    Raises:
        AssertionError: a rank failed, with its traceback.
    """
    os.makedirs(out_dir, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, os.path.dirname(here)]
    # Forked from a server that imported torch and the FRAMEWORKS once; each job imports its own
    # module, which patches in its ranks only, so one framework's scoped patches never reach another's.
    mp.start_processes(_entry, args=(world, free_port(), target, args, out_dir, paths, dict(os.environ)),
                       nprocs=world, join=True, start_method=start_method(FRAMEWORKS))
    values, failures = [], []
    for r in range(world):
        try:
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                outcome = json.load(f)
        except FileNotFoundError:
            outcome = {"ok": False, "type": "exited", "message": "ended without an outcome", "trace": ""}
        if outcome["ok"]:
            values.append(outcome["value"])
        else:
            failures.append(f"rank {r}: {outcome['type']}: {outcome['message']}\n{outcome['trace']}")
    assert not failures, "\n".join(failures)
    return values


def outcomes_by_case(world: int, target: str, path: str, cases: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``target(rank, path=, cases=)`` run once on ``world`` ranks for all the cases (one spawn: the
    framework imports once); each case's name -> its outcome on every rank."""
    per_rank = run(world, target, os.path.join(path, "ranks"), path=path, cases=cases)
    return {case["name"]: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}


def held(ranks: list[dict[str, Any]], field: str) -> Any:
    """``field`` of the one rank that returned it (the others return None): the logits the
    last stage holds, the export rank 0 made. Fails unless exactly one rank has it."""
    values = [r[field] for r in ranks if r[field] is not None]
    assert len(values) == 1, f"{field}: {len(values)} ranks returned it, not 1"
    return values[0]
