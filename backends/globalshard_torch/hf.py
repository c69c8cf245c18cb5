"""Fill any TP/PP/VPP layout straight from a Hugging Face safetensors directory.

No conversion step: each rank computes, with the same rules as a checkpoint
load, which global box of which key each of its tensors holds, maps the key
to Hugging Face names through the mapping read in reverse (fused ``[Q; K;
V]`` is concatenated from ``q_proj``, ``k_proj``, ``v_proj``), and reads
only the rows of those files that its boxes cover.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import nn

import globalshard as gs
from globalshard.comm import Comm
from globalshard.dtypes import canonical_name, is_exact_cast
from globalshard.errors import CastError, MismatchError, format_problems
from globalshard.hf import NameMapping, SafetensorsSource
from globalshard_torch.comm import resolve_comm
from globalshard_torch.model import model_entries, refuse_unusable
from globalshard_torch.parallel import ParallelLayout
from globalshard_torch.rules import Replicated, ShardingRules
from globalshard_torch.tensors import HostStaging, numpy_view

__all__ = ["load_hf", "fill_from_safetensors"]

#: ``load_hf``'s rules when none are given: every tensor that is not a DTensor is whole.
_WHOLE = ShardingRules([(r".*", Replicated())])


def load_hf(directory: str, model: nn.Module | Sequence[nn.Module], layout: ParallelLayout,
            rules: ShardingRules | None, *, mapping: NameMapping | str | None = None,
            params: dict[str, float] | None = None, allow_lossy_cast: bool = False,
            strict: bool = True, comm: Comm | None = None) -> dict[str, Any]:
    """Load this rank's part of every parameter and persistent buffer from safetensors.

    Args:
        directory: ``model.safetensors`` or ``model.safetensors.index.json`` with its files.
        model: this rank's model, or its virtual-pipeline chunks in local order,
            filled in place.
        layout: this rank's place; local layer indices become global ones.
        rules: how non-DTensor tensors are cut (None: DTensors place themselves and
            any other tensor is whole on every rank, as DCP takes a plain tensor;
            one that is in fact a piece fails the shape check, naming it).
        mapping: a :class:`~globalshard.hf.NameMapping`, a mapping file or a shipped
            mapping's name (``"llama"``); None: the names are the checkpoint keys.
        params: values for the mapping's ``params`` (``{"heads": 32, "kv_heads": 8}``).
        allow_lossy_cast: allow e.g. a bfloat16 model from float32 files.
        strict: a tensor of the files that no rank's model reads (an untied
            ``lm_head``, q/k/v biases a model lacks) is an error; ``False``
            loads the rest and reports them.
        comm: the ranks loading together (all of them read the files'
            headers; the union of what they read decides what is unread);
            by default torch.distributed's, or this process alone.

    Returns:
        Figures: ``{"bytes_read": ..., "tensors": ...}`` for this rank,
        ``"unread"``: the files' tensor names no rank read, and ``"skipped"``:
        this rank's keys that the files lack and the mapping's ``skip``
        patterns match (a MoE's load-balancing bias), or that are adapters
        its ``lora`` rules merge (a LoRA model starting from the weights
        they adapt), left as they were.

    Raises:
        MismatchError: a key absent from the files, or a global shape that differs,
            listing every one before anything is written.
        CastError: a lossy conversion not allowed.
    """
    if isinstance(mapping, str):
        mapping = NameMapping.load(mapping, params)
    source = SafetensorsSource(directory, mapping)
    staging = HostStaging()
    targets: dict[str, gs.ShardedTensor] = {}
    # Unlike a save, a load may take a plain tensor as whole: were it a piece, its shape would not be the files'.
    entries = model_entries(model, layout, rules if rules is not None else _WHOLE)
    refuse_unusable(entries, "load into the model")
    for e in entries:
        for name, t in e.shards(e.name, e.key, numpy_view(staging.host(e.tensor, for_save=False))).items():
            if gs.is_padding_key(t.key):
                t.data[...] = 0  # Hugging Face files hold the true vocabulary only: padding rows are zero
            else:
                targets[name] = t
    report = fill_from_safetensors(source, targets, allow_lossy_cast=allow_lossy_cast, strict=strict, comm=comm)
    staging.finish_load()
    return report


def fill_from_safetensors(source: SafetensorsSource, targets: dict[str, gs.ShardedTensor], *,
                          allow_lossy_cast: bool = False, strict: bool = True,
                          comm: Comm | None = None) -> dict[str, Any]:
    """Fill the core's pieces (``data`` in place) from the files ``source`` reads, as
    :func:`load_hf` does: every key checked (present, global shape, exact cast)
    before anything is read; keys the files lack that the mapping skips, or
    that are adapters its ``lora`` rules merge, are left out (and reported); a
    piece that may hold padding is zero beyond its regions.
    Returns :func:`load_hf`'s figures."""
    directory = source.directory
    problems, skipped = [], set()
    for name, t in list(targets.items()):
        found = source.keys.get(t.key)
        if found is None and (any(s.fullmatch(t.key) for s in source.mapping.skip) or
                              source.mapping.is_adapter(t.key)):
            # the mapping's skip (not part of the Hugging Face model), or an adapter of a lora rule (the
            # files hold the tensor it adapts): left as it is
            skipped.add(t.key)
            del targets[name]
            continue
        if found is None:
            why = f": {source.incomplete[t.key]}" if t.key in source.incomplete else ""
            problems.append(f"{t.key!r} ({name}): not in {directory} under the mapping{why}")
            continue
        dtype, shape, _ = found
        if shape != t.global_shape:
            problems.append(f"{t.key!r}: global shape {t.global_shape} here, {shape} in {directory}")
        elif not allow_lossy_cast and not is_exact_cast(dtype, canonical_name(t.data.dtype)):
            raise CastError(f"{t.key!r}: {dtype} in {directory} does not convert exactly to "
                            f"{canonical_name(t.data.dtype)} (pass allow_lossy_cast=True)")
    if problems:
        raise MismatchError(format_problems("the safetensors do not fit the model", problems))
    comm = resolve_comm(comm)
    asked = sorted({n for t in targets.values() for n in source.names(t.key)})
    read = {name for names in comm.all_gather(asked) for name in names}
    unread = sorted(set(source.entries) - read)
    if strict and unread:
        raise MismatchError(format_problems(
            f"{directory}: tensors that no rank's model reads (pass strict=False to load the rest without them)",
            [repr(n) for n in unread]))
    nbytes = 0
    for t in targets.values():
        covered = np.zeros(t.data.shape, bool) if t.allow_padding else None
        for r in t.regions:
            nbytes += source.read(t.key, r.global_box, r.local_box.view(t.data))  # a view, 0-d too
            if covered is not None:
                covered[r.local_box.slices] = True
        if covered is not None:
            t.data[~covered] = 0
    return {"bytes_read": nbytes, "tensors": len(targets), "unread": unread, "skipped": sorted(skipped)}
