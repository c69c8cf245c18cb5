"""Single-process tests of the torch adapter: every rule's mapping to regions, the
layer mapping, tensor views, trainer-state JSON, and the checkpoint manager."""

import json
import os
import random
import shutil
import threading

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import globalshard as gs
import globalshard_torch as gt


def boxes(t: gs.ShardedTensor) -> list[tuple[str, str]]:
    return [(str(r.local_box), str(r.global_box)) for r in t.regions]


def entry_for(rule, local_shape, **layout):
    lay = gt.ParallelLayout(**layout)
    placement = rule.place(local_shape, lay)
    e = gt.Entry("x", "k", torch.zeros(local_shape), placement, True, torch.zeros(local_shape), True)
    return e.shard("k", np.zeros(local_shape, np.float32))


# ----------------------------------------------------------------------- rules


def test_column_and_row_parallel():
    t = entry_for(gt.ColumnParallel(), (3, 8), tp_rank=1, tp_size=4)
    assert t.global_shape == (12, 8) and boxes(t) == [("[0:3, 0:8]", "[3:6, 0:8]")]
    t = entry_for(gt.RowParallel(), (8, 3), tp_rank=2, tp_size=4)
    assert t.global_shape == (8, 12) and boxes(t) == [("[0:8, 0:3]", "[0:8, 6:9]")]
    bias = entry_for(gt.ColumnParallel(), (3,), tp_rank=3, tp_size=4)
    assert boxes(bias) == [("[0:3]", "[9:12]")]


def test_replicated_main_only_on_tp_rank_0():
    assert gt.Replicated().place((4,), gt.ParallelLayout(tp_rank=0, tp_size=2)).tp_main
    assert not gt.Replicated().place((4,), gt.ParallelLayout(tp_rank=1, tp_size=2)).tp_main


def test_vocab_parallel_with_padding():
    # vocab 10 at TP=4: padded to 12, 3 rows per rank; rank 3 holds row 9 and 2 padding rows.
    t = entry_for(gt.VocabParallel(10), (3, 5), tp_rank=3, tp_size=4)
    assert t.global_shape == (10, 5) and boxes(t) == [("[0:1, 0:5]", "[9:10, 0:5]")]
    with pytest.raises(gs.LayoutError, match="cannot hold"):
        gt.VocabParallel(10).place((2, 5), gt.ParallelLayout(tp_rank=0, tp_size=4))


def test_packed_qkv_gqa():
    # 8 query heads, 4 kv heads, head dim 2: global rows [Q 16; K 8; V 8] = 32; TP=2, rank 1.
    t = entry_for(gt.PackedQKV(8, 4), (16, 3), tp_rank=1, tp_size=2)
    assert t.global_shape == (32, 3)
    assert boxes(t) == [("[0:8, 0:3]", "[8:16, 0:3]"), ("[8:12, 0:3]", "[20:24, 0:3]"),
                        ("[12:16, 0:3]", "[28:32, 0:3]")]
    single = entry_for(gt.PackedQKV(8, 4), (32, 3), tp_rank=0, tp_size=1)
    assert sum(r.global_box.volume for r in single.regions) == 32 * 3
    with pytest.raises(gs.LayoutError, match="kv heads divide TP or be divided by it"):
        gt.PackedQKV(8, 3).place((12, 3), gt.ParallelLayout(tp_rank=0, tp_size=4))


def test_packed_swiglu():
    t = entry_for(gt.PackedSwiGLU(), (4, 3), tp_rank=1, tp_size=2)  # ffn 4: [gate_1; up_1]
    assert t.global_shape == (8, 3)
    assert boxes(t) == [("[0:2, 0:3]", "[2:4, 0:3]"), ("[2:4, 0:3]", "[6:8, 0:3]")]


def test_tied_resolution_and_unmatched_names():
    rules = gt.ShardingRules([(r"embedding\.weight", gt.VocabParallel(10)),
                              (r"lm_head\.weight", gt.Tied("embedding.weight"))])
    key, rule, copy = rules.resolve("lm_head.weight")
    assert key == "embedding.weight" and rule == gt.VocabParallel(10) and copy
    with pytest.raises(gs.LayoutError, match="no sharding rule"):
        rules.resolve("layers.0.w")
    bad = gt.ShardingRules([(r"a", gt.Tied("b"))])
    with pytest.raises(gs.LayoutError, match="no \\(untied\\) rule"):
        bad.resolve("a")


def test_model_entries_tied_dedupe_and_unmatched_report():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(6, 4)
            self.lm_head = nn.Linear(4, 6, bias=False)
            self.lm_head.weight = self.embedding.weight  # tied, PP=1
            self.norm = nn.Parameter(torch.ones(4))
            self.register_buffer("scratch", torch.zeros(2), persistent=False)

    rules = gt.ShardingRules([(r"embedding\.weight", gt.VocabParallel(5)),
                              (r"lm_head\.weight", gt.Tied("embedding.weight")), (r"norm", gt.Replicated())])
    entries = gt.model_entries(M(), gt.ParallelLayout(tp_rank=1, tp_size=2), rules)
    assert sorted(e.key for e in entries) == ["embedding.weight", "norm"]  # tied copy once, no non-persistent buffer
    assert next(e for e in entries if e.key == "embedding.weight").placement.allow_padding
    with pytest.raises(gs.LayoutError) as info:
        gt.model_entries(M(), gt.ParallelLayout(), gt.ShardingRules([(r"norm", gt.Replicated())]))
    assert "embedding.weight" in str(info.value)


def test_pp_stages_hold_a_tied_copy_as_a_replica():
    rules = gt.ShardingRules([(r"embedding\.weight", gt.VocabParallel(6)),
                              (r"lm_head\.weight", gt.Tied("embedding.weight"))])
    last = nn.Module()
    last.lm_head = nn.Linear(4, 6, bias=False)
    (e,) = gt.model_entries(last, gt.ParallelLayout(pp_rank=1, pp_size=2), rules)
    assert e.key == "embedding.weight" and not e.main


def mtp_chunk(embedding: bool, layers: int) -> nn.Module:
    """A Megatron-Core GPTModel chunk's names: word embeddings (held again by the
    multi-token-prediction stage), decoder layers, one MTP layer."""
    chunk = nn.Module()
    if embedding:
        chunk.embedding = nn.Module()
        chunk.embedding.word_embeddings = nn.Embedding(6, 4)
    chunk.decoder = nn.Module()
    chunk.decoder.layers = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(layers)])
    chunk.mtp = nn.Module()
    chunk.mtp.layers = nn.ModuleList([nn.Linear(4, 4, bias=False)])
    return chunk


MTP_RULES = gt.ShardingRules([(r"embedding\.word_embeddings\.weight", gt.FirstStage(gt.VocabParallel(6))),
                              (r"(decoder|mtp)\.layers\.\d+\.weight", gt.ColumnParallel())])


@pytest.mark.parametrize("pp_rank,vpp_size,chunk", [(1, 1, 0), (0, 2, 1), (1, 2, 1)])
def test_a_first_stage_tensor_held_again_by_another_chunk_is_a_replica_of_it(pp_rank, vpp_size, chunk):
    layout = gt.ParallelLayout(pp_rank=pp_rank, pp_size=2, vpp_size=vpp_size, num_layers=4 * vpp_size)
    chunks = [mtp_chunk(embedding=c in (0, chunk), layers=4 // 2) for c in range(vpp_size)]
    held = [e for e in gt.model_entries(chunks, layout, MTP_RULES) if e.key == "embedding.word_embeddings.weight"]
    assert [e.main for e in held] == [pp_rank == 0 and c == 0 for c in range(vpp_size) if c in (0, chunk)]
    (first,) = gt.model_entries(mtp_chunk(True, 2), gt.ParallelLayout(pp_size=2, num_layers=4), MTP_RULES)[:1]
    assert first.key == "embedding.word_embeddings.weight" and first.main


def test_megatron_mtp_layers_keep_their_own_numbers_on_every_stage():
    """Megatron-Core numbers its multi-token-prediction layers apart from the
    decoder's (all on one stage): ``mtp.layers.0`` on the last of 2 stages is
    ``mtp.layers.0``, not the stage's first decoder layer (2)."""
    layout = gt.ParallelLayout(pp_rank=1, pp_size=2, num_layers=4)
    keys = sorted(e.key for e in gt.model_entries(mtp_chunk(False, 2), layout, MTP_RULES))
    assert keys == ["decoder.layers.2.weight", "decoder.layers.3.weight", "mtp.layers.0.weight"]
    assert layout.global_name("mtp.layers.0.eh_proj.weight", 0) == "mtp.layers.0.eh_proj.weight"
    assert layout.global_name("model.layers.1.mlp.weight", 0) == "model.layers.3.mlp.weight"


# ----------------------------------------------------------------------- layout


def test_interleaved_vpp_mapping():
    lay = gt.ParallelLayout(pp_rank=1, pp_size=2, vpp_size=2, num_layers=8)
    assert lay.chunk_layers(0) == (2, 3) and lay.chunk_layers(1) == (6, 7)
    assert lay.global_name("layers.1.mlp.weight", 1) == "layers.7.mlp.weight"
    assert lay.global_name("decoder.layers.0.attn.w", 0) == "decoder.layers.2.attn.w"
    assert lay.global_name("embedding.weight", 0) == "embedding.weight"
    all_layers = sorted(i for s in range(2) for c in range(2) for i in lay.chunk_layers(c, pp_rank=s))
    assert all_layers == list(range(8))


def test_custom_stage_layers_and_validation():
    lay = gt.ParallelLayout(pp_rank=0, pp_size=2, stage_layers=(((0, 1, 2),), ((3,),)))
    assert lay.num_layers == 4 and lay.global_layer(0, 2) == 2
    with pytest.raises(gs.LayoutError, match="exactly once"):
        gt.ParallelLayout(pp_size=2, stage_layers=(((0, 1),), ((1,),)))
    with pytest.raises(gs.LayoutError, match="not divisible"):
        gt.ParallelLayout(pp_size=2, vpp_size=2, num_layers=6)
    with pytest.raises(gs.LayoutError, match="tp_rank"):
        gt.ParallelLayout(tp_rank=2, tp_size=2)
    assert gt.ParallelLayout(tp_rank=1, tp_size=2).config_json()["tp_size"] == 2


# ----------------------------------------------------------------------- tensors and state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int64, torch.bool])
def test_numpy_view_is_zero_copy(dtype):
    t = torch.zeros(3, 4, dtype=dtype)
    v = gt.numpy_view(t[:, ::2])  # strided too
    assert v.shape == (3, 2) and v.dtype.name == str(dtype).removeprefix("torch.")
    v[1, 1] = 1
    assert t[1, 2].item() == 1


def test_numpy_view_of_a_parameter_and_bf16_values():
    p = nn.Parameter(torch.tensor([1.5, -2.25], dtype=torch.bfloat16))
    assert np.array_equal(gt.numpy_view(p), np.array([1.5, -2.25], ml_dtypes.bfloat16))


def test_jsonable_and_rng_round_trip():
    assert gt.jsonable({"betas": (0.9, 0.95), "lr": torch.tensor(0.5)}) == {"betas": [0.9, 0.95], "lr": 0.5}
    with pytest.raises(gs.TrainerStateError, match="cannot be stored"):
        gt.jsonable({"w": torch.zeros(2)})
    state = json.loads(json.dumps(gt.rng_state()))
    a = (torch.rand(3), np.random.rand(3), random.random())
    gt.set_rng_state(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_go_through_pinned_host_staging(tmp_path):
    model = nn.Linear(4, 4).cuda()
    rules = gt.ShardingRules([(".*", gt.Replicated())])
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules)
    other = nn.Linear(4, 4).cuda()
    gt.load_checkpoint(tmp_path / "c", model=other, layout=gt.ParallelLayout(), rules=rules)
    assert torch.equal(model.weight, other.weight) and other.weight.is_cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_save_of_cuda_tensors_overlaps_their_copies_and_keeps_the_values_at_the_call(tmp_path):
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rules = gt.ShardingRules([(".*", gt.Replicated())])
    saver = gs.AsyncSaver()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=rules, optimizer=opt,
                       saver=saver)
    with torch.no_grad():  # queued on the tensors' stream: runs after their copies to the host
        for p in model.parameters():
            p.mul_(-1)
    assert saver.snapshot_seconds >= 0
    saver.wait()
    other = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
    gt.load_checkpoint(tmp_path / "c", model=other, layout=gt.ParallelLayout(), rules=rules)
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())


def test_host_staging_names_the_shards_still_being_copied():
    staging = gt.HostStaging(overlap=True)
    cpu = torch.arange(12.0).reshape(3, 4)
    assert staging.host(cpu, for_save=True).data_ptr() == cpu.data_ptr()  # a host tensor is its own: nothing in flight
    pinned = np.zeros((4, 4), np.float32)
    waited = []
    staging._in_flight.append((pinned.ctypes.data, pinned.ctypes.data + pinned.nbytes, lambda: waited.append(1)))
    shards = {"inside": gs.ShardedTensor.from_offset("a", pinned[2:], global_shape=(2, 4), global_offset=(0, 0)),
              "outside": gs.ShardedTensor.from_offset("b", cpu.numpy(), global_shape=(3, 4), global_offset=(0, 0))}
    staged = staging.staged(shards)
    assert list(staged) == ["inside"]
    staged["inside"]()
    assert waited == [1]


# ----------------------------------------------------------------------- one process, one call


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))


RULES = gt.ShardingRules([(".*", gt.Replicated())])


def test_single_process_round_trip_with_optimizer_and_scheduler(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    sched.step()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=RULES, optimizer=opt,
                       scheduler=sched, trainer_state={"step": 1})
    other = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    opt2 = torch.optim.AdamW(other.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    result = gt.load_checkpoint(tmp_path / "c", model=other, layout=gt.ParallelLayout(), rules=RULES,
                                optimizer=opt2, scheduler=sched2)
    assert result.trainer_state == {"step": 1} and result.rng_restored  # what the save was given, as given
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][k], opt2.state[b][k])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and opt2.param_groups[0]["betas"] == (0.8, 0.9)
    # ... so that a resumed run carries it forward into its next save.
    gt.save_checkpoint(tmp_path / "d", model=other, layout=gt.ParallelLayout(), rules=RULES, optimizer=opt2,
                       scheduler=sched2, trainer_state=result.trainer_state)
    assert sched2.state_dict() == sched.state_dict()


def test_a_model_on_the_meta_device_is_refused_naming_its_tensors(tmp_path):
    # Before, a load into a model built on the meta device returned as if it had filled it (every
    # parameter still on the meta device, holding nothing), and its save failed in torch's copy, unnamed.
    gt.save_checkpoint(tmp_path / "c", model=_model(), layout=gt.ParallelLayout(), rules=RULES)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    names = r"\n  - 0\.weight: on the meta device: it holds no data \(materialize it first.*1\.bias: on the meta device"
    with pytest.raises(gs.LayoutError, match=r"(?s)cannot load into the model" + names):
        gt.load_checkpoint(tmp_path / "c", model=meta, layout=gt.ParallelLayout(), rules=RULES)
    with pytest.raises(gs.LayoutError, match=r"(?s)cannot save the model" + names):
        gt.save_checkpoint(tmp_path / "d", model=meta, layout=gt.ParallelLayout(), rules=RULES)
    assert not (tmp_path / "d").exists()
    meta.to_empty(device="cpu")  # materialized: it loads
    gt.load_checkpoint(tmp_path / "c", model=meta, layout=gt.ParallelLayout(), rules=RULES)
    assert all(torch.equal(a, b) for a, b in zip(meta.parameters(), _model().parameters()))
    meta.register_buffer("scales", torch.ones(2).to(torch.float8_e8m0fnu))  # MX scales: no dtype of the format
    with pytest.raises(gs.LayoutError, match=r"cannot save the model\n  - scales: dtype torch.float8_e8m0fnu"):
        gt.save_checkpoint(tmp_path / "e", model=meta, layout=gt.ParallelLayout(), rules=RULES)


def test_params_without_state_stay_without_state(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=RULES, optimizer=opt)
    target = _model()
    opt2 = torch.optim.AdamW(target.parameters())
    gt.load_checkpoint(tmp_path / "c", model=target, layout=gt.ParallelLayout(), rules=RULES, optimizer=opt2)
    assert not any(opt2.state.values())


def test_optimizer_mismatches_are_refused_before_loading(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=RULES, optimizer=opt)
    target = _model()
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(gs.MismatchError, match="SGD"):
        gt.load_checkpoint(tmp_path / "c", model=target, layout=gt.ParallelLayout(), rules=RULES,
                           optimizer=torch.optim.SGD(target.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))  # nothing touched
    with pytest.raises(gs.LayoutError, match="not a tensor of the model"):
        gt.save_checkpoint(tmp_path / "d", model=model, layout=gt.ParallelLayout(), rules=RULES,
                           optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(3))]))
    with pytest.raises(gs.MetadataError, match="reserved"):
        gt.save_checkpoint(tmp_path / "e", model=model, layout=gt.ParallelLayout(), rules=RULES,
                           trainer_state={"rng": 1})


def test_param_groups_are_matched_by_their_parameters_as_dcp_matches_them(tmp_path):
    # Saved: decay (weight_decay 0.1, lr 1e-3) for the weights, no decay (0, lr 2e-3) for the rest.
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    assert weights and rest
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1, "lr": 1e-3},
                             {"params": rest, "weight_decay": 0.0, "lr": 2e-3}])
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    gt.save_checkpoint(tmp_path / "c", model=model, layout=gt.ParallelLayout(), rules=RULES, optimizer=opt)

    def loaded(groups):
        target = _model()
        params = dict(target.named_parameters())
        opt2 = torch.optim.AdamW([{"params": [params[n] for n in g], "weight_decay": 0.5, "lr": 9.0}
                                  for g in groups])
        gt.load_checkpoint(tmp_path / "c", model=target, layout=gt.ParallelLayout(), rules=RULES, optimizer=opt2)
        return [(g["weight_decay"], g["lr"]) for g in opt2.param_groups], opt2, target

    w = [n for n in names if n.endswith("weight")]
    r = [n for n in names if not n.endswith("weight")]
    # Built in the other order: each group gets the hyperparameters its parameters were saved with.
    got, opt2, target = loaded([r, w])
    assert got == [(0.0, 2e-3), (0.1, 1e-3)]
    assert torch.equal(opt2.state[dict(target.named_parameters())[w[0]]]["exp_avg"], opt.state[weights[0]]["exp_avg"])
    # A saved group split in two: both halves get its hyperparameters.
    assert loaded([w[:1], w[1:], r])[0] == [(0.1, 1e-3), (0.1, 1e-3), (0.0, 2e-3)]
    # Parameters of groups with other hyperparameters in one group: refused, naming what differs.
    with pytest.raises(gs.MismatchError, match=r"param group 0 holds parameters saved in groups \[0, 1\], whose "
                                               r"\['lr', 'weight_decay'\] differ"):
        loaded([w + r])


# ----------------------------------------------------------------------- manager


def test_manager_prunes_a_large_checkpoint_unpublished_first_then_in_the_background(tmp_path, monkeypatch):
    from globalshard.checkpoint import cleanup

    monkeypatch.setattr(cleanup, "BACKGROUND_DELETE_BYTES", 1)  # every checkpoint counts as large
    release, seen = threading.Event(), []
    real = cleanup.delete_in_background

    def held(what, delete, **kw):
        seen.append(what)
        real(what, lambda: (release.wait(60), delete()), **kw)

    monkeypatch.setattr(cleanup, "delete_in_background", held)
    mgr = gt.CheckpointManager(tmp_path, keep_last=1)
    model = _model()
    try:
        for step in (100, 200):
            mgr.save(step, model=model, layout=gt.ParallelLayout(), rules=RULES)
        # save returned with step 100 unpublished (no longer complete) but not yet deleted.
        assert seen == [mgr.path(100)]
        assert [s for s, _ in mgr.complete()] == [200] and os.path.isdir(mgr.path(100))
    finally:
        release.set()
        gs.wait_for_cleanup()
    assert not os.path.exists(mgr.path(100)) and mgr.latest() == (200, mgr.path(200))


def test_manager_keeps_last_n_and_resumes_from_latest_complete(tmp_path):
    mgr = gt.CheckpointManager(tmp_path, keep_last=2)
    assert mgr.latest() is None and mgr.load_latest(model=_model(), layout=gt.ParallelLayout(), rules=RULES) is None
    model = _model()
    for step in (100, 200, 300):
        with torch.no_grad():
            model[0].weight.fill_(step)
        mgr.save(step, model=model, layout=gt.ParallelLayout(), rules=RULES)
    assert [s for s, _ in mgr.complete()] == [200, 300]
    assert not os.path.exists(mgr.path(100))
    assert mgr.latest() == (300, mgr.path(300))
    # A save that died: directory without metadata.json, newer than the pointer.
    shutil.copytree(mgr.path(300), mgr.path(400))
    os.remove(os.path.join(mgr.path(400), "metadata.json"))
    assert mgr.latest() == (300, mgr.path(300))
    # A stale pointer (to a pruned step) falls back to the newest complete one.
    with open(tmp_path / "latest", "w") as f:
        json.dump({"step": 100, "path": "iter_0000100"}, f)
    assert mgr.latest() == (300, mgr.path(300))
    os.remove(tmp_path / "latest")
    target = _model()
    result = mgr.load_latest(model=target, layout=gt.ParallelLayout(), rules=RULES)
    assert result.trainer_state["step"] == 300 and (target[0].weight == 300).all()


def test_a_managers_async_save_that_fails_keeps_the_checkpoint_before_it(tmp_path):
    # Before: save(..., saver=) moved the pointer and pruned as soon as the snapshot was taken, so with
    # keep_last=1 a background failure left no checkpoint at all (latest() None).
    mgr, saver, model = gt.CheckpointManager(tmp_path, keep_last=1), gs.AsyncSaver("thread"), _model()
    mgr.save(1, model=model, layout=gt.ParallelLayout(), rules=RULES)
    os.makedirs(mgr.path(2))
    with open(os.path.join(mgr.path(2), "saves"), "w") as f:
        f.write("a file where the save directories go")  # the background writes fail
    mgr.save(2, model=model, layout=gt.ParallelLayout(), rules=RULES, saver=saver)
    with pytest.raises(gs.StorageError):
        saver.wait()  # as the saver's own wait() raises it (the manager's wait() raises it too)
    assert mgr.latest() == (1, mgr.path(1)) and json.load(open(tmp_path / "latest"))["step"] == 1
    with torch.no_grad():
        model[0].weight.fill_(3)
    mgr.save(3, model=model, layout=gt.ParallelLayout(), rules=RULES, saver=saver)
    with torch.no_grad():
        model[0].weight.fill_(-1)  # training goes on
    target = _model()
    assert mgr.load_latest(model=target, layout=gt.ParallelLayout(), rules=RULES).trainer_state["step"] == 3
    assert (target[0].weight == 3).all() and [s for s, _ in mgr.complete()] == [3]


def test_manager_pointer_is_replaced_atomically(tmp_path):
    mgr = gt.CheckpointManager(tmp_path)
    mgr.save(7, model=_model(), layout=gt.ParallelLayout(), rules=RULES)
    assert json.load(open(tmp_path / "latest")) == {"step": 7, "path": "iter_0000007"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".latest.tmp")]
    reread = gs.read_trainer_state(mgr.path(7))
    assert reread["step"] == 7 and reread["parallel_config"]["tp_size"] == 1


def test_staging_buffers_come_from_the_savers_pool_once_it_is_sized():
    """Device tensors are staged into the AsyncSaver's host pool (shared with its
    writer process): the first save finds the pool empty, stages into buffers of
    its own and records what it needs; from the next save on they lie in the pool,
    which is not reallocated while the state keeps its size."""
    import globalshard as gs
    from globalshard_torch.tensors import HostStaging

    saver = gs.AsyncSaver()
    shapes = [((64, 32), torch.float32), ((17,), torch.bfloat16), ((3, 5), torch.int64)]
    first = HostStaging(overlap=True, pool=saver.host_pool)
    bufs = [first.buffer(s, d) for s, d in shapes]
    assert all(saver.host_pool.offset_of(gt.numpy_view(b)) is None for b in bufs)  # no pool yet
    assert first.needed == sum(-(-b.numel() * b.element_size() // 64) * 64 for b in bufs)
    generations = set()
    for _ in range(3):
        staging = HostStaging(overlap=True, pool=saver.host_pool)
        bufs = [staging.buffer(s, d) for s, d in shapes]
        assert [(tuple(b.shape), b.dtype) for b in bufs] == [(s, d) for s, d in shapes]
        offsets = [saver.host_pool.offset_of(gt.numpy_view(b)) for b in bufs]
        assert None not in offsets and offsets == sorted(offsets) and all(o % 64 == 0 for o in offsets)
        generations.add(saver.host_pool.generation)
        for b in bufs:
            b.fill_(1)  # writable, and within the pool (no overlap: each fill lands in its own bytes)
    assert len(generations) == 1
    bigger = HostStaging(overlap=True, pool=saver.host_pool)
    extra = bigger.buffer((1024, 1024), torch.float32)  # more than the pool holds: a buffer of its own
    assert saver.host_pool.offset_of(gt.numpy_view(extra)) is None
    HostStaging(overlap=True, pool=saver.host_pool)
    assert saver.host_pool.nbytes >= bigger.needed  # grown for the next save


def test_tiered_manager_saves_into_the_tiers_and_refuses_what_a_tiered_save_cannot_do(tmp_path):
    mgr = gt.TieredManager(tiers=[gs.LocalTier(str(tmp_path / "local")), str(tmp_path / "persistent")])
    model = _model()
    with torch.no_grad():
        model[0].weight.fill_(3)
    mgr.save(5, model=model, layout=gt.ParallelLayout(), rules=RULES)
    mgr.wait()
    assert mgr.persisted() == 5 and os.path.isfile(tmp_path / "local" / "iter_0000005" / "holdings.json")
    for bad in ({"overwrite": True}, {"kvstore": {"driver": "memory"}}):
        with pytest.raises(gs.LayoutError, match=f"takes none of \\['{next(iter(bad))}'\\]"):
            gt.save_checkpoint(mgr.target(6), model=model, layout=gt.ParallelLayout(), rules=RULES, **bad)
    assert not os.path.exists(tmp_path / "local" / "iter_0000006")  # refused before anything was written
    target = _model()
    result = mgr.load_latest(model=target, layout=gt.ParallelLayout(), rules=RULES)
    assert result.trainer_state["step"] == 5 and (target[0].weight == 3).all()
    assert mgr.recovery.bytes_local > 0 and mgr.recovery.bytes_persistent == 0


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_tiered_manager_saves_asynchronously_with_a_saver(tmp_path, mode):
    """``saver=`` through the manager and through save_checkpoint(manager.target(step)):
    each returns after the snapshot, and the tiers hold the values of the call."""
    mgr = gt.TieredManager(tiers=[gs.LocalTier(str(tmp_path / "local")), str(tmp_path / "persistent")])
    model, saver = _model(), gs.AsyncSaver(mode)
    with torch.no_grad():
        model[0].weight.fill_(3)
    mgr.save(5, model=model, layout=gt.ParallelLayout(), rules=RULES, saver=saver)
    with torch.no_grad():
        model[0].weight.fill_(4)  # training goes on
    gt.save_checkpoint(mgr.target(6), model=model, layout=gt.ParallelLayout(), rules=RULES, saver=saver,
                       trainer_state={"step": 6})
    with torch.no_grad():
        model[0].weight.fill_(5)
    mgr.wait()
    assert saver.last_mode == mode and mgr.persisted() == 6
    for step, value in ((6, 4), (5, 3)):
        target = _model()
        found = mgr.open_latest() if step == 6 else mgr.path(5)
        result = gt.load_checkpoint(found, model=target, layout=gt.ParallelLayout(), rules=RULES)
        assert result.trainer_state["step"] == step and (target[0].weight == value).all(), step
