"""globalshard for torch trainers: TP/PP/VPP/DP layouts, Megatron-style sharding
rules, DTensor parameters, Adam/AdamW state, torch.distributed, and a
checkpoint manager, over the framework-neutral globalshard core.

A nested state dict (DTensors, plain tensors, optimizer state from
``get_state_dict``, Stateful objects, JSON values), as with
``torch.distributed.checkpoint``::

    import globalshard_torch as gt
    gt.save({"model": model_sd, "optim": optim_sd, "step": 100}, path)
    gt.load(state_dict, path)   # in place, under any other layout

Megatron-style models: save on one topology and load on another with one call each::

    layout = ParallelLayout(tp_rank=..., tp_size=2, pp_rank=..., pp_size=2, num_layers=24)
    save_checkpoint(path, model=chunks, layout=layout, rules=rules, optimizer=opt, scheduler=sched,
                    trainer_state={"step": step, "consumed_samples": n})
    result = load_checkpoint(path, model=chunks, layout=other_layout, rules=rules, optimizer=opt,
                             scheduler=sched)
"""

from globalshard_torch.checkpoint import CheckpointManager, LoadResult, TieredManager, load_checkpoint, save_checkpoint
from globalshard_torch.comm import TorchComm, default_comm, resolve_comm
from globalshard_torch.hf import load_hf
from globalshard_torch.model import Entry, model_entries
from globalshard_torch.parallel import ParallelLayout
from globalshard_torch.rules import (
    ColumnParallel,
    Experts,
    FirstStage,
    MegatronQKV,
    PackedQKV,
    PackedSwiGLU,
    Placement,
    Replicated,
    RowParallel,
    Rule,
    ShardingRules,
    Split,
    StackedExperts,
    Tied,
    VocabParallel,
)
from globalshard_torch.state import jsonable, rng_state, set_rng_state
from globalshard_torch.state_dict import LoadedKeys, load, save
from globalshard_torch.tensors import HostStaging, numpy_view, torch_dtype
from globalshard_torch.zero import FlatShard, megatron_param_ranges, zero_redundancy_shards

__all__ = [
    "load_hf",
    "CheckpointManager",
    "TieredManager",
    "ColumnParallel",
    "Experts",
    "FirstStage",
    "FlatShard",
    "Entry",
    "HostStaging",
    "LoadResult",
    "LoadedKeys",
    "MegatronQKV",
    "PackedQKV",
    "PackedSwiGLU",
    "ParallelLayout",
    "Placement",
    "Replicated",
    "RowParallel",
    "Rule",
    "ShardingRules",
    "Split",
    "StackedExperts",
    "Tied",
    "TorchComm",
    "VocabParallel",
    "default_comm",
    "resolve_comm",
    "jsonable",
    "load",
    "megatron_param_ranges",
    "load_checkpoint",
    "model_entries",
    "numpy_view",
    "rng_state",
    "save",
    "save_checkpoint",
    "set_rng_state",
    "torch_dtype",
    "zero_redundancy_shards",
]
