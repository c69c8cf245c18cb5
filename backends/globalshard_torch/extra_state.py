"""``nn.Module.get_extra_state()``: state a module keeps outside its parameters
(Transformer Engine keeps its FP8 scaling state there).

Extra state is per TP rank (an FP8 amax history belongs to one TP shard) and
the same on every DP replica. Each module's state is saved for each TP rank:

* a JSON value (numbers, strings, lists, dicts; ``inf`` included) goes into
  the trainer state, under ``extra_state[<global module name>]``;
* a tensor, or ``bytes`` / ``io.BytesIO``, becomes an array stored under
  ``_extra_state.<global module name>.tp<r>of<T>``, written by DP rank 0.

No Python object is serialised here, only JSON and raw arrays (a module's
own ``set_extra_state`` decides what it does with the bytes it gets back).
``None`` and empty values (Megatron-Core's linear layers return ``None``) are
no state: nothing is saved for them, and a module whose extra state is empty
needs nothing from the checkpoint, whatever the layout.

An expert's module (``...local_experts.<i>...``) is named by its global
expert index (``ep_rank * experts_per_rank + i``), so its state follows the
expert across an EP change; its main copy is on expert data-parallel rank 0.
On load, each module gets back the
state its TP rank saved; when the TP size changed there is no such thing, and
the load fails naming the module unless ``extra_state="skip"`` says to leave
the modules' extra state as it is.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import globalshard as gs
from globalshard.errors import LayoutError, MismatchError, TrainerStateError, format_problems
from globalshard_torch.parallel import ParallelLayout
from globalshard_torch.state import from_jsonable, jsonable
from globalshard_torch.tensors import numpy_view, torch_dtype

__all__ = ["PREFIX", "collect", "has_extra_state", "is_empty", "restore_targets"]

PREFIX = "_extra_state."


def has_extra_state(module: nn.Module) -> bool:
    return type(module).get_extra_state is not nn.Module.get_extra_state


_LOCAL_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)(?=\.|$)")
_EXPERTS = re.compile(r"(^|\.)experts(\.|$)")


def is_empty(value: Any) -> bool:
    """Whether a ``get_extra_state()`` value holds nothing (None, b"", an empty tensor or container)."""
    if value is None:
        return True
    if isinstance(value, io.BytesIO):
        return not value.getbuffer().nbytes
    if torch.is_tensor(value):
        return value.numel() == 0
    if isinstance(value, (bytes, bytearray, str, list, tuple, dict)):
        return len(value) == 0
    return False


def _modules(chunks: Sequence[nn.Module], layout: ParallelLayout,
             layer_pattern: str) -> list[tuple[str, nn.Module, bool]]:
    """``(global module name, module, is an expert's)`` of every module with extra state.

    A module holding all of an EP rank's experts (Transformer Engine's
    ``GroupedLinear`` under ``experts.``) has no expert index to make global:
    its state is kept per EP rank (see :func:`_key`) and does not follow an
    EP change."""
    found = []
    for c, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if has_extra_state(module):
                found.append((layout.global_name(name, c, layer_pattern) or "<root>", module))
    # Experts per EP rank, per expert container: the local indices found under it.
    local: dict[str, set[int]] = {}
    for gname, _ in found:
        for m in _LOCAL_EXPERT.finditer(gname):
            local.setdefault(gname[:m.start()], set()).add(int(m.group(2)))
    out = []
    for gname, module in found:
        matches = list(_LOCAL_EXPERT.finditer(gname))
        if matches:
            m = matches[-1]
            per_rank = len(local[gname[:m.start()]])
            index = layout.ep_rank * per_rank + int(m.group(2))
            gname = f"{gname[:m.start()]}{m.group(1)}local_experts.{index}{gname[m.end():]}"
        out.append((gname, module, bool(matches) or _EXPERTS.search(gname) is not None))
    return out


def _grouped(gname: str) -> bool:
    """An expert module without an expert index (all of an EP rank's experts)."""
    return _EXPERTS.search(gname) is not None and _LOCAL_EXPERT.search(gname) is None


def _is_main(layout: ParallelLayout, expert: bool) -> bool:
    return (layout.expert_dp_rank if expert else layout.dp_rank) == 0


def _where(gname: str, layout: ParallelLayout) -> dict[str, Any]:
    """The ranks a module's record belongs to: its TP rank, and its EP rank
    for a grouped experts module."""
    out: dict[str, Any] = {"tp": layout.tp_size, "rank": layout.tp_rank}
    # TODO(limitation): a grouped experts module's state (all of an EP rank's
    # experts in one module) is kept per EP rank and does not follow an EP change.
    if _grouped(gname) and layout.ep_size > 1:
        out["ep"] = [layout.ep_rank, layout.ep_size]
    return out


def _key(gname: str, layout: ParallelLayout) -> str:
    where = _where(gname, layout)
    key = f"{PREFIX}{gname}.tp{where['rank']}of{where['tp']}"
    return f"{key}.ep{where['ep'][0]}of{where['ep'][1]}" if "ep" in where else key


def collect(chunks: Sequence[nn.Module], layout: ParallelLayout, layer_pattern: str,
            shards: dict[str, gs.ShardedTensor]) -> dict[str, Any]:
    """This rank's extra state: arrays added to ``shards``; returns the JSON part
    as ``{global module name: {"tp": T, "rank": r, "kind": ..., "value": ...}}``
    for the modules whose main copy this rank holds."""
    out: dict[str, Any] = {}
    problems = []
    for gname, module, expert in _modules(chunks, layout, layer_pattern):
        value = module.get_extra_state()
        if is_empty(value):
            continue
        main = _is_main(layout, expert)
        record: dict[str, Any] = _where(gname, layout)
        if isinstance(value, io.BytesIO):
            value, record["kind"] = value.getvalue(), "bytesio"
        if isinstance(value, (bytes, bytearray)):
            record.setdefault("kind", "bytes")
            data: np.ndarray = np.frombuffer(bytes(value), np.uint8).copy()
        elif torch.is_tensor(value):
            record["kind"], data = "tensor", numpy_view(value.detach().cpu().contiguous()).copy()
        else:
            try:
                record["kind"], record["value"] = "json", jsonable(value, f"extra state of {gname}")
            except TrainerStateError as e:
                problems.append(f"{gname}: {type(module).__name__}.get_extra_state() returned a "
                                f"{type(value).__name__}, which only a code-executing format could hold ({e})")
            if main:
                out[gname] = record
            continue
        key = _key(gname, layout)
        shards[f"extra/{gname}"] = gs.ShardedTensor.from_offset(
            key, data, global_shape=tuple(data.shape), global_offset=(0,) * data.ndim,
            replica_id=0 if main else 1)
        if main:
            out[gname] = record
    if problems:
        raise LayoutError(format_problems("cannot save the modules' extra state", problems))
    return out


def restore_targets(chunks: Sequence[nn.Module], layout: ParallelLayout, layer_pattern: str,
                    saved: dict[str, list[dict[str, Any]]], metadata: gs.Metadata,
                    targets: dict[str, gs.ShardedTensor], mode: str) -> list[tuple[nn.Module, dict[str, Any], Any]]:
    """Plan the restore: arrays to load are added to ``targets``; returns
    ``(module, record, array or None)`` for :func:`finish`.

    Raises:
        MismatchError: a module's extra state was not saved for this TP rank
            (or at all), listing every such module; unless ``mode == "skip"``.
            A module whose own extra state is empty and that the checkpoint
            holds nothing for needs nothing.
    """
    plans, problems = [], []
    for gname, module, _expert in _modules(chunks, layout, layer_pattern):
        records = saved.get(gname, [])
        where = _where(gname, layout)
        record = next((r for r in records if {k: r[k] for k in ("tp", "rank", "ep") if k in r} == where), None)
        if record is None and not records and is_empty(module.get_extra_state()):
            continue  # saved as no state (or by a model without it), and holding none
        if record is None:
            # TODO(limitation): per-TP-rank extra state is not split or merged across a TP change.
            if mode != "skip":
                tps = sorted({r["tp"] for r in records})
                eps = sorted({r["ep"][1] for r in records if "ep" in r})
                why = (f"saved at TP={tps}, loading at TP={layout.tp_size}" if tps and not eps else
                       f"saved per EP rank at EP={eps}, loading at EP={layout.ep_size}" if eps else
                       "not in the checkpoint")
                problems.append(f"{gname}: {type(module).__name__}'s extra state is {why}; per-rank extra state "
                                "cannot be split or merged (pass extra_state='skip' to keep the module's own)")
            continue
        array = None
        if record["kind"] != "json":
            key = _key(gname, layout)
            stored = metadata.tensors.get(key)
            if stored is None:
                problems.append(f"{gname}: the extra state array {key!r} is missing")
                continue
            array = torch.zeros(stored.global_shape, dtype=torch_dtype(stored.dtype))
            targets[f"extra/{gname}"] = gs.ShardedTensor.from_offset(
                key, numpy_view(array), global_shape=stored.global_shape,
                global_offset=(0,) * len(stored.global_shape))
        plans.append((module, record, array))
    if problems:
        raise MismatchError(format_problems("the modules' extra state does not match the checkpoint", problems))
    return plans


def finish(plans: list[tuple[nn.Module, dict[str, Any], Any]]) -> None:
    """Hand each module its state back, in the form it gave it."""
    for module, record, array in plans:
        kind = record["kind"]
        if kind == "json":
            module.set_extra_state(from_jsonable(record["value"]))
        elif kind == "tensor":
            module.set_extra_state(array)
        else:
            data = array.numpy().tobytes()
            module.set_extra_state(io.BytesIO(data) if kind == "bytesio" else data)
