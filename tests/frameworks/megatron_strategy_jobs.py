"""Megatron-Core's own sharded state dicts through ``dist_checkpointing`` with the
globalshard strategy (run by test_megatron_strategy.py), beside its default
``torch_dist`` strategy as the oracle. The scoped patches are megatron_jobs'."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from megatron_jobs import (
    BATCH,
    NUM_LAYERS,
    SEQ,
    _differences,
    _keeping_step,
    _megatron,
    _named,
    _on_cpu,
    build,
    logits,
    scramble,
    setup,
    trained,
)

# isort: split
# (Megatron-Core is imported once megatron_jobs has applied its patches.)
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

import globalshard as gs
import globalshard_torch.megatron as gm
from globalshard.cli import main as cli


def _state(chunks: list[Any], opt: Any, sharding: str | None, loading: bool) -> dict[str, Any]:
    """What Megatron's trainer hands to dist_checkpointing: the chunks' sharded state
    dicts and, with an optimizer, its sharded state dict of ``sharding`` type."""
    state = _megatron(chunks)
    if opt is not None:
        # "..._mem_efficient": Megatron-LM's --distrib-optim-fully-reshardable-mem-efficient (gathered
        # over gloo, the state on DP rank 0 only)
        efficient = sharding is not None and sharding.endswith("_mem_efficient")
        metadata = {"distrib_optim_sharding_type": sharding.removesuffix("_mem_efficient") if sharding else sharding}
        if efficient:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        state["optimizer"] = opt.sharded_state_dict(state["model0"], is_loading=loading, metadata=metadata)
    return state


@contextlib.contextmanager
def _exchanges_on_cpu() -> Iterator[None]:
    """A scoped patch while the block runs: Megatron's fully parallel load sends what each
    rank read to the others in buffers it makes with ``device="cuda"``; made on the CPU."""
    real = torch.empty_like
    torch.empty_like = _on_cpu(real)
    try:
        yield
    finally:
        torch.empty_like = real


def _loaded(chunks: list[Any], opt: Any, sharding: str | None, path: str, strategy: Any = None) -> None:
    """dist_checkpointing.load of ``path`` (its backend found from its metadata.json unless
    ``strategy``) into the chunks and the optimizer, as Megatron's trainer applies it."""
    with _exchanges_on_cpu():
        loaded = dist_checkpointing.load(_state(chunks, opt, sharding, True), path, sharded_strategy=strategy)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded.get(f"model{i}", {}))  # a chunk without layers holds nothing
    if opt is not None:
        for part in opt.chained_optimizers:  # see megatron_jobs.distopt_scenario
            part._set_main_param_and_optimizer_states = _keeping_step(part)
        opt.load_state_dict(loaded["optimizer"])


def _differing(x: Any, y: Any, at: str = "") -> list[str]:
    """Where two nested dicts differ: keys, tensors (dtype or values), other values."""
    if isinstance(x, dict) and isinstance(y, dict):
        if x.keys() != y.keys():
            return [f"{at}: keys {sorted(set(x) ^ set(y))}"]
        return [d for k in x for d in _differing(x[k], y[k], f"{at}.{k}")]
    if torch.is_tensor(x) and torch.is_tensor(y):
        return [] if x.dtype == y.dtype and torch.equal(x, y) else [f"{at}: {x.dtype} {y.dtype}"]
    return [] if x == y else [f"{at}: {x!r} vs {y!r}"[:200]]


def _dp_group() -> Any:
    """The group Megatron's trainer parallelizes checkpoint saves and loads over."""
    return ps.get_data_parallel_group(with_context_parallel=True)


def _built(model: dict[str, Any], layout: Any, salt: str, sharding: str | None) -> tuple[list[Any], Any]:
    if sharding is None:
        chunks = build(model, layout)
        scramble(chunks, layout, model, salt)
        return chunks, None
    gpt, _, opt = trained(model, layout, salt)
    return [gpt], opt


def scenario(rank: int, *, path: str, name: str, save: dict[str, int], load: dict[str, int], model: dict[str, Any],
             load_model: dict[str, Any] | None = None, sharding: str | None = None,
             background: bool = False, parallel: bool = False) -> dict[str, Any]:
    """Saved at ``save`` by dist_checkpointing with the globalshard strategy (in the
    background with ``background``: the weights change before the save is
    finalized; wrapped in Megatron's fully parallel save and load over DP with
    ``parallel``, as its trainer does by default) and with torch_dist; loaded at
    ``load`` (into ``load_model``'s sizes when given) by dist_checkpointing from
    each: every tensor, and with an optimizer every Adam moment, main parameter
    and group, compared."""
    ours, theirs = os.path.join(path, name, "globalshard"), os.path.join(path, name, "torch_dist")
    if rank == 0:
        os.makedirs(ours)
        os.makedirs(theirs)
    dist.barrier()
    layout = setup(model, **save)
    a, a_opt = _built(model, layout, "saved", sharding)
    before = logits(a, layout)
    saved = _named(a, layout)
    dist_checkpointing.save(_state(a, a_opt, sharding, False), theirs)
    changed = False
    if background:
        queue = AsyncCallsQueue()
        strategy = gm.SaveStrategy(saver=gs.AsyncSaver(), check_replicas=True)
        if parallel:
            strategy = FullyParallelSaveStrategyWrapper(strategy, _dp_group())
        request = dist_checkpointing.save(_state(a, a_opt, sharding, False), ours, sharded_strategy=strategy,
                                          async_sharded_save=True)
        queue.schedule_async_request(request)
        scramble(a, layout, model, "training goes on")  # the checkpoint holds the values of the call
        changed = any(not torch.equal(t, saved[k]) for k, t in _named(a, layout).items())
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    else:
        # Megatron's replicas (layernorms on every TP rank, DP copies) compared before writing: all equal.
        strategy = gm.SaveStrategy(check_replicas=True)
        if parallel:
            strategy = FullyParallelSaveStrategyWrapper(strategy, _dp_group())
        dist_checkpointing.save(_state(a, a_opt, sharding, False), ours, sharded_strategy=strategy)
    with open(os.path.join(ours, "metadata.json")) as f:
        backend = json.load(f)["sharded_backend"]
    verified = cli(["verify", gm.arrays_path(ours)]) == 0 if rank == 0 else None
    meta_ours = {k: (tuple(t.global_shape), str(t.dtype)) for k, t in
                 dist_checkpointing.load_tensors_metadata(ours).items()}
    meta_theirs = {k: (tuple(t.global_shape), str(t.dtype)) for k, t in
                   dist_checkpointing.load_tensors_metadata(theirs).items()}
    # Every tensor whole, as Megatron's tools read a checkpoint (load_plain_tensors).
    plain = _differing(*(dist_checkpointing.load_plain_tensors(p) for p in (ours, theirs)))
    if sharding == "dp_reshardable":  # its buckets' padding between parameters is saved from torch.empty
        plain = [d for d in plain if not d.startswith(".optimizer.distributed.")]
    del a, a_opt

    load_model = load_model or model
    layout = setup(load_model, **load)
    b, b_opt = _built(load_model, layout, "fresh", sharding)
    _loaded(b, b_opt, sharding, ours, FullyParallelLoadStrategyWrapper(gm.LoadStrategy(), _dp_group())
            if parallel else None)
    c, c_opt = _built(load_model, layout, "other", sharding)
    _loaded(c, c_opt, sharding, theirs)
    if sharding is None:
        b_t, c_t = _named(b, layout), _named(c, layout)
        differ = sorted(k for k in b_t if not torch.equal(b_t[k], c_t[k]))
    else:
        differ = _differences(b[0], b_opt, c[0], c_opt, layout)
    return {"differ": differ, "tensors": len(_named(b, layout)), "before": before, "after": logits(b, layout),
            "backend": backend, "verified": verified, "same_metadata": meta_ours == meta_theirs,
            "keys": len(meta_ours), "changed": changed, "plain": plain}


def _hf_params(model: dict[str, Any]) -> dict[str, float]:
    """The export mapping's params for ``model``: what a Megatron checkpoint does not record."""
    params = {"heads": model["heads"], "rms_norm_eps": 1e-5, "rope_theta": model.get("rotary_base", 10000),
              **({"top_k": 2} if model.get("experts") else {})}  # config's moe_router_topk
    if not model.get("mla"):
        return params | {"kv_heads": model["groups"]} | (
            {"rope_scaling_factor": model["rope_scaling"]} if model.get("rope_scaling") else {}) | (
            {"pre_softmax": 1} if model.get("pre_softmax") else {})
    mla = model["mla"]
    yarn = {k: mla[k] for k in ("rotary_scaling_factor", "mscale", "mscale_all_dim",
                                "original_max_position_embeddings") if k in mla}
    if yarn:  # the context YaRN stretches to, as Hugging Face's config expects it
        yarn["max_position_embeddings"] = int(yarn["rotary_scaling_factor"] * yarn["original_max_position_embeddings"])
    return params | dict(qk_nope_head_dim=mla["qk_head_dim"], qk_rope_head_dim=mla["qk_pos_emb_head_dim"],
                         sigmoid_routing=1, routed_scaling_factor=mla["scale"], n_group=mla["groups"],
                         topk_group=mla["group_topk"], yarn=int(mla["rope_type"] == "yarn"), **yarn,
                         **({"layers": NUM_LAYERS} if model.get("mtp") else {}))  # the layers before MTP's


def exported(rank: int, *, path: str, name: str, save: dict[str, int], model: dict[str, Any],
             export: str, reload: dict[str, int] | None = None) -> dict[str, Any]:
    """A Megatron model saved at ``save`` by dist_checkpointing with the globalshard
    strategy, exported by ``globalshard export --map <export>`` and opened by
    transformers as the architecture its ``config.json`` names: its logits and
    class name (rank 0) beside Megatron's logits before the save. With ``reload``:
    transformers' own ``save_pretrained`` of that model (with multi-token
    prediction, which transformers drops, the export itself) read by
    ``gm.load_hf`` into a fresh Megatron model at the ``reload`` layout, and its logits."""
    import transformers

    ckpt, hf, hf_saved = (os.path.join(path, name, d) for d in ("ckpt", "hf", "hf_saved"))
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    layout = setup(model, **save)
    a, _ = _built(model, layout, "saved", None)
    before = logits(a, layout)
    dist_checkpointing.save(_state(a, None, None, False), ckpt, sharded_strategy=gm.SaveStrategy())
    params = _hf_params(model)
    out = architecture = None
    if rank == 0:
        args = [f"--param={k}={v}" for k, v in params.items()]
        assert cli(["export", gm.arrays_path(ckpt), hf, "--map", export, *args]) == 0
        reference = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        ids = (torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) * 7) % 50
        with torch.no_grad():
            out = reference(ids).logits.flatten().tolist()
        architecture = type(reference).__name__
        per_layer = sum(bool(re.match(r"decoder\.layers\.\d+\.", k))
                        for k in gs.read_metadata(gm.arrays_path(ckpt)).tensors)
        dense = getattr(reference.config, "mlp_only_layers", None)  # Qwen3 MoE's; DeepSeek's come first
        if hasattr(reference.config, "first_k_dense_replace"):
            dense = list(range(reference.config.first_k_dense_replace))
        if reference.config.model_type == "mixtral":  # every layer a MoE
            dense = []
        reference.save_pretrained(hf_saved)  # transformers' own files of the same model
    dist.barrier()
    reloaded = report = None
    if reload:
        layout = setup(model, **reload)
        b = build(model, layout)
        scramble(b, layout, model, "fresh")
        meta = ensure_metadata_has_dp_cp_group(None)
        # transformers does not keep multi-token prediction layers (it does not run them): those read ours
        source = hf if model.get("mtp") else hf_saved
        states, report = gm.load_hf(source, [chunk.sharded_state_dict(metadata=meta) for chunk in b],
                                    mapping=export, params=params)
        for chunk, state in zip(b, states, strict=True):
            chunk.load_state_dict(state)
        reloaded = logits(b, layout)
    mine = {"before": before, "reloaded": reloaded, "report": report}
    return mine | ({"exported": out, "architecture": architecture, "per_layer_keys": per_layer, "dense_layers": dense}
                   if rank == 0 else {"exported": None, "architecture": None})


def hf_mismatches(rank: int, *, path: str, name: str, llama: str, qwen3: str, model: dict[str, Any],
                  refuse: bool) -> dict[str, Any]:
    """``gm.load_hf`` of files that do not fit the model (the export cases' transformers
    files, ``llama`` and ``qwen3`` under ``path``): a Qwen3 (query and key norms) from a
    Llama's files, and a Llama from a Qwen3's, strict and not; each outcome's error."""
    out: dict[str, Any] = {}
    for case, m, files, export, strict in (("qwen3_from_llama", {**model, "qk_norm": True}, llama,
                                            "megatron_dist_qwen3", True),
                                           ("llama_from_qwen3", model, qwen3, "megatron_dist", True),
                                           ("llama_from_qwen3_lenient", model, qwen3, "megatron_dist", False)):
        layout = setup(m, tp=2, pp=1)
        (chunk,) = build(m, layout)
        try:
            _, report = gm.load_hf(os.path.join(path, files, "hf_saved"), chunk.sharded_state_dict(),
                                   mapping=export, params=_hf_params(m), strict=strict)
            out[case] = report["unread"]
        except gs.GlobalShardError as e:
            out[case] = f"{type(e).__name__}: {e}"
    return out


def scenarios(rank: int, *, path: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kinds = {"fail": failed_background, "export": exported, "refuse": hf_mismatches}
    return [next((f for k, f in kinds.items() if case.get(k)), scenario)(rank, path=path, **case) for case in cases]


def _cut(key: str, whole: torch.Tensor, fragments: tuple[int, ...], prepend: int, fill: bool,
         replicas: int) -> dict[str, ShardedTensor]:
    """``whole`` cut into a regular grid of ``fragments`` pieces per axis, as Megatron
    describes them (``from_rank_offsets``; the first ``prepend`` axes prepended, so
    each piece is one element along them), each piece ``replicas`` times (the first
    the main replica). ``fill``: the pieces hold the values, else zeros to load into."""
    out = {}
    grid = np.indices(fragments).reshape(len(fragments), -1).T
    for n, at in enumerate(grid):
        index = tuple(slice(int(i) * (s // f), (int(i) + 1) * (s // f)) for i, s, f in zip(at, whole.shape, fragments))
        local = whole[index].clone() if fill else torch.zeros_like(whole[index])
        local = local.reshape(local.shape[prepend:])
        offsets = [(axis, int(i), f) for axis, (i, f) in enumerate(zip(at, fragments)) if f > 1 or axis < prepend]
        for r in range(replicas):
            out[f"{key}/{n}/{r}"] = ShardedTensor.from_rank_offsets(key, local if r == 0 else local.clone(), *offsets,
                                                                   replica_id=r, prepend_axis_num=prepend)
    return out


@st.composite
def _cuts(draw: Any) -> tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]:
    """A global shape, how many of its first axes are prepended, and two grids that cut it."""
    ndim = draw(st.integers(1, 3))
    prepend = draw(st.integers(0, ndim - 1))
    shape, saved, loaded = [], [], []
    for axis in range(ndim):
        if axis < prepend:  # one element per piece along a prepended axis
            size = draw(st.integers(1, 3))
            shape.append(size), saved.append(size), loaded.append(size)
            continue
        s, lo = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        shape.append(math.lcm(s, lo) * draw(st.integers(1, 2))), saved.append(s), loaded.append(lo)
    return tuple(shape), prepend, tuple(saved), tuple(loaded)


def properties(rank: int, *, path: str) -> int:
    """In one process (hypothesis): a global array cut one way, each piece held once or
    twice (replicas), saved by dist_checkpointing with the globalshard strategy, then
    loaded cut another way (prepended axes included): every piece equals the
    global array's slice. Returns the number of examples run."""
    runs = []

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_cuts(), st.integers(1, 2), st.sampled_from([torch.float32, torch.bfloat16]))
    def check(cut: Any, replicas: int, dtype: torch.dtype) -> None:
        shape, prepend, saved, loaded = cut
        where = tempfile.mkdtemp(dir=path)
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(len(runs))).to(dtype)
        dist_checkpointing.save(_cut("w", whole, saved, prepend, True, replicas), where,
                                sharded_strategy=gm.SaveStrategy())
        state = dist_checkpointing.load(_cut("w", whole, loaded, prepend, False, 1), where)
        expected = _cut("w", whole, loaded, prepend, True, 1)
        assert state.keys() == expected.keys()
        for k, t in expected.items():
            assert torch.equal(state[k], t.data), (k, shape, prepend, saved, loaded)
        runs.append(1)

    check()
    return len(runs)


def _uneven(key: str, whole: torch.Tensor, sizes: list[int], fill: bool) -> dict[str, Any]:
    """``whole`` (1-D) cut into consecutive pieces of ``sizes`` (zeros included), each a
    ShardedTensor built directly, without axis fragmentations, as Megatron's
    test_uneven_1d_sharding builds them; those of a holder in a list under one name, as
    its test_uneven_1d_sharding_multiple_shards holds several per rank."""
    out: dict[str, Any] = {}
    at = 0
    for n, size in enumerate(sizes):
        local = whole[at:at + size].clone() if fill else torch.zeros(size, dtype=whole.dtype)
        out.setdefault(f"{key}/{n % 3}", []).append(
            ShardedTensor(key, local, local.dtype, tuple(local.shape), tuple(whole.shape), (at,), None))
        at += size
    return out


def uneven(rank: int, *, path: str) -> int:
    """In one process (hypothesis), Megatron's test_uneven_1d_sharding cases and any
    others: a 1-D array cut into pieces of any sizes (empty ones too), saved with the
    globalshard strategy, loaded cut into other pieces: each equals its slice. Returns
    the number of examples run."""
    runs = []
    split = st.integers(1, 30).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n), max_size=7)))

    def sizes(n: int, cuts: list[int]) -> list[int]:
        edges = [0, *sorted(cuts), n]
        return [b - a for a, b in itertools.pairwise(edges)]

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(split, st.lists(st.integers(0, 24), max_size=7))
    @example((15, [15] * 7), [0, 0, 0, 3, 6, 9, 12])  # Megatron's: [15] + [0] * 7 -> [0] * 3 + [3] * 5
    @example((30, [5, 10, 15, 20, 25, 30, 30]), [5, 5, 10, 10, 15, 20, 23])  # [5] * 6 + [0] * 2 -> [5, 0, 5, 0, ...]
    def check(saved: tuple[int, list[int]], cuts: list[int]) -> None:
        n, first = saved
        whole = torch.arange(n, dtype=torch.float32) + 100 * len(runs)
        where = tempfile.mkdtemp(dir=path)
        dist_checkpointing.save(_uneven("a", whole, sizes(n, first), True), where, sharded_strategy=gm.SaveStrategy())
        loaded = sizes(n, [min(c, n) for c in cuts])
        state = dist_checkpointing.load(_uneven("a", whole, loaded, False), where)
        expected = _uneven("a", whole, loaded, True)
        assert state.keys() == expected.keys()
        for name, pieces in expected.items():
            for got, want in zip(state[name], pieces, strict=True):
                assert torch.equal(got, want.data), (n, first, loaded)
        runs.append(1)

    check()
    return len(runs)


def failed_background(rank: int, *, path: str, name: str, save: dict[str, int], model: dict[str, Any],
                      fail: bool) -> dict[str, Any]:
    """A background save whose writer process is killed on rank 1 (at its third
    filesystem operation, by the crash harness's hook): whether each rank's
    finalization raised, and whether anything looks like a checkpoint after."""
    from globalshard.checkpoint.writer import Writer

    ours = os.path.join(path, name)
    if rank == 0:
        os.makedirs(ours)
    dist.barrier()
    layout = setup(model, **save)
    a, _ = _built(model, layout, "saved", None)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the writer imports the hook from there
    os.environ["PYTHONPATH"] = os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])])
    writer = Writer(setup=("saver:writer_hook", [3 if rank == 1 else None, None]))
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save(_state(a, None, None, False), ours, async_sharded_save=True,
                                      sharded_strategy=gm.SaveStrategy(saver=gs.AsyncSaver(writer=writer)))
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = None
    except CheckpointingException as e:  # Megatron's, with ours as the cause
        error = type(e.__cause__).__name__
    queue.close()
    writer.close()
    dist.barrier()
    try:
        dist_checkpointing.load(_state(a, None, None, True), ours)
        loads = True
    except CheckpointingException:
        loads = False
    return {"error": error, "megatron_metadata": os.path.exists(os.path.join(ours, "metadata.json")),
            "committed": os.path.exists(os.path.join(gm.arrays_path(ours), "metadata.json")), "loads": loads}


def conventions(rank: int, *, path: str) -> dict[str, Any]:
    """In one process, Megatron's own dist_checkpointing tests (test_serialization.py:
    test_load_error_msg, test_tensor_shape_mismatch, test_empty_load; test_strict.py) with
    the globalshard strategy: what each load gave, or the error it raised."""
    def outcome(state: dict[str, Any], where: str) -> Any:
        try:
            loaded = dist_checkpointing.load(state, where)
        except CheckpointingException as e:
            return f"CheckpointingException: {e}"
        return {k: v.tolist() if torch.is_tensor(v) else v for k, v in loaded.items()}

    strategy = gm.SaveStrategy()
    whole = torch.arange(32).unsqueeze(0).expand(2, 32).contiguous()
    shapes = os.path.join(path, "shapes")
    os.makedirs(shapes)
    dist_checkpointing.save({"rigid": ShardedTensor.from_rank_offsets("keyA", whole, (1, 0, 1)),
                             "flexible": ShardedTensor.from_rank_offsets("keyB", whole.clone(), (1, 0, 1),
                                                                         allow_shape_mismatch=True)},
                            shapes, sharded_strategy=strategy)
    out: dict[str, Any] = {}
    for cols in (28, 36):  # fewer and more columns than stored
        out[f"rigid_{cols}"] = outcome({"rigid": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, cols))}, shapes)
        out[f"flexible_{cols}"] = outcome({"flexible": ShardedTensor.from_rank_offsets(
            "keyB", torch.ones(2, cols, dtype=whole.dtype), allow_shape_mismatch=True)}, shapes)
    # Both in one load: the rigid target is still refused, not given the overlap the other may take.
    out["rigid_with_flexible"] = outcome({
        "rigid": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, 28, dtype=whole.dtype)),
        "flexible": ShardedTensor.from_rank_offsets("keyB", torch.ones(2, 28, dtype=whole.dtype),
                                                    allow_shape_mismatch=True)}, shapes)
    out["renamed"] = outcome({"some_key": ShardedTensor.from_rank_offsets("different_key", torch.ones(2, 32))},
                             shapes)
    empty = os.path.join(path, "empty")
    os.makedirs(empty)
    dist_checkpointing.save({"common": "common-value"}, empty, sharded_strategy=strategy)
    out["empty"] = outcome({"common": "common-value"}, empty)
    # test_strict.py: mismatched keys returned, with what matched loaded.
    mixed = os.path.join(path, "strict")
    os.makedirs(mixed)
    dist_checkpointing.save({"a": ShardedTensor.from_rank_offsets("TenA", torch.arange(2.0)),
                             "b": ShardedTensor.from_rank_offsets("TenB", torch.ones(3))}, mixed,
                            sharded_strategy=strategy)
    loaded, missing, unexpected = dist_checkpointing.load(
        {"a": ShardedTensor.from_rank_offsets("TenA", torch.zeros(2)),
         "c": ShardedTensor.from_rank_offsets("TenC", torch.zeros(4))}, mixed, strict=StrictHandling.RETURN_ALL)
    out["strict"] = {"loaded": {k: v.tolist() for k, v in loaded.items()}, "missing": sorted(missing),
                     "unexpected": sorted(unexpected)}
    # A target on the meta device (a model built there): made on the process group's device and filled,
    # as DCP makes it (Megatron's torch_dist gives it back on the meta device, unfilled); a save from one
    # is refused, naming its key.
    loaded = dist_checkpointing.load({"rigid": ShardedTensor.from_rank_offsets(
        "keyA", torch.empty(2, 32, dtype=whole.dtype, device="meta"), (1, 0, 1))}, shapes)
    out["meta"] = {k: [str(v.device), v.tolist()] for k, v in loaded.items()}
    unsaved = os.path.join(path, "unsaved")
    os.makedirs(unsaved)
    try:
        dist_checkpointing.save({"m": ShardedTensor.from_rank_offsets("keyM", torch.empty(2, device="meta"))},
                                unsaved, sharded_strategy=strategy)
    except CheckpointingException as e:
        out["meta_save"] = f"CheckpointingException: {e}"
    # test_remove_sharded_tensors: the keys with a prefix removed in place (then a warning: none left).
    removing = os.path.join(path, "remove")
    os.makedirs(removing)
    dist_checkpointing.save({"sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.arange(8.0).reshape(2, 4)),
                             "sd_prefix_key_to_remove": ShardedTensor.from_rank_offsets(
                                 "prefix_key_to_remove", torch.ones(3, 5, 7))}, removing, sharded_strategy=strategy)
    dist_checkpointing.remove_sharded_tensors(removing, key_prefix="prefix")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_checkpointing.remove_sharded_tensors(removing, key_prefix="prefix")
    arrays = os.path.join(gm.arrays_path(removing), "saves", gs.read_metadata(gm.arrays_path(removing)).save_id,
                          "arrays")
    out["removed"] = {"keys": sorted(dist_checkpointing.load_tensors_metadata(removing)),
                      "warned": [str(w.message) for w in caught], "files": sorted(os.listdir(arrays)),
                      "kept": outcome({"a": ShardedTensor.from_rank_offsets("keyA", torch.zeros(2, 4))}, removing)}
    # Two copies of one box that drifted apart (a replica one ulp off): refused with check_replicas, naming it.
    drifted = os.path.join(path, "drifted")
    os.makedirs(drifted)
    copy = torch.full((2, 3), 0.5)
    copy[1, 1] = torch.nextafter(copy[1, 1], torch.tensor(1.0))
    try:
        dist_checkpointing.save({"main": ShardedTensor.from_rank_offsets("keyD", torch.full((2, 3), 0.5)),
                                 "copy": ShardedTensor.from_rank_offsets("keyD", copy, replica_id=1)}, drifted,
                                sharded_strategy=gm.SaveStrategy(check_replicas=True))
        out["drifted"] = None
    except CheckpointingException as e:
        out["drifted"] = f"CheckpointingException: {e}"
    out["drifted_committed"] = os.path.exists(os.path.join(gm.arrays_path(drifted), "metadata.json"))
    return out
