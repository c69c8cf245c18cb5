"""Saves that reference a base (spec/FORMAT.md section 5.2): frozen keys and
regions whose SHA-256 equals the base's are stored as references, loads,
verify, read_array and the reference reader follow them, and a base deleted
or replaced makes its dependants fail loudly, never load zeros."""

import itertools
import json
import os
import shutil
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo import SPEC

import globalshard as gs
from globalshard.testing.comm import run_ranks

sys.path.insert(0, SPEC)
import reference_reader


def whole(values):
    return {k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,) * v.ndim)
            for k, v in values.items()}


def lora(seed, adapter_scale=1.0):
    rng = np.random.default_rng(seed)
    base = {f"base.layers.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(3)}
    base["base.norm"] = np.ones(32, np.float32)
    adapters = {"lora.A": np.full((4, 32), adapter_scale, np.float32), "lora.B": np.full((64, 4), adapter_scale,
                                                                                      np.float32)}
    return base, adapters


def regions_of(root):
    doc = json.loads((root / "metadata.json").read_text())
    return doc.get("bases", []), {k: [r.get("base") for r in t["regions"]] for k, t in doc["tensors"].items()}


def test_frozen_keys_are_referenced_unread_and_load_back_exactly(tmp_path):
    base, adapters = lora(0)
    gs.save(whole({**base, **adapters}), tmp_path / "step0")
    stats = gs.IOStats()
    new_adapters = {k: v * 3 for k, v in adapters.items()}
    gs.save(whole({**base, **new_adapters}), tmp_path / "step1", base=tmp_path / "step0", frozen=["base.*"],
            stats=stats)
    bases, refs = regions_of(tmp_path / "step1")
    assert bases == [{"root": "step0", "save_id": gs.read_metadata(tmp_path / "step0").save_id}]
    assert all(refs[k] == [0] for k in base) and all(refs[k] == [None] for k in adapters)
    assert stats.bytes_written == sum(v.nbytes for v in new_adapters.values())  # the base is not written again
    reader = reference_reader.Checkpoint(tmp_path / "step1")
    for k, v in {**base, **new_adapters}.items():
        assert np.array_equal(gs.read_array(tmp_path / "step1", k), v), k
        assert np.array_equal(reader.read(k), v), k
    problems, nbytes = gs.Checkpoint(tmp_path / "step1").verify()
    assert problems == [] and nbytes == sum(v.nbytes for v in {**base, **adapters}.values())
    arrays = tmp_path / "step1" / "saves" / gs.read_metadata(tmp_path / "step1").save_id / "arrays"
    assert set(os.listdir(arrays)) == {"lora.A", "lora.B"}  # the dependant stores its adapters only


def test_regions_whose_sha256_equals_the_bases_are_referenced(tmp_path):
    base, adapters = lora(1)
    gs.save(whole({**base, **adapters}), tmp_path / "a", digests=True)
    changed = {**base, "base.layers.1.w": base["base.layers.1.w"] + 1, **adapters}
    stats = gs.IOStats()
    gs.save(whole(changed), tmp_path / "b", base=tmp_path / "a", stats=stats)
    _, refs = regions_of(tmp_path / "b")
    same = [k for k in changed if k != "base.layers.1.w"]
    assert all(refs[k] == [0] for k in same) and refs["base.layers.1.w"] == [None]
    assert stats.bytes_written == changed["base.layers.1.w"].nbytes
    md = gs.read_metadata(tmp_path / "b")
    for k, v in changed.items():  # every region records the SHA-256 of its bytes, referenced or not
        assert md.tensors[k].regions[0].sha256 == gs.checkpoint.bases.digest_of(v)
        assert np.array_equal(gs.read_array(tmp_path / "b", k), v)


def test_a_base_without_digests_is_referenced_for_frozen_keys_only(tmp_path):
    base, adapters = lora(2)
    gs.save(whole({**base, **adapters}), tmp_path / "a")  # no digests recorded
    gs.save(whole({**base, **adapters}), tmp_path / "b", base=tmp_path / "a")
    _, refs = regions_of(tmp_path / "b")
    assert all(r == [None] for r in refs.values())  # nothing to compare with: all written
    assert gs.read_metadata(tmp_path / "b").tensors["lora.A"].regions[0].sha256 is not None


def test_references_name_where_the_bytes_lie_never_a_chain(tmp_path):
    base, adapters = lora(3)
    gs.save(whole({**base, **adapters}), tmp_path / "s0", digests=True)
    a1 = {k: v + 1 for k, v in adapters.items()}
    gs.save(whole({**base, **a1}), tmp_path / "s1", base=tmp_path / "s0", frozen="base.*")
    a2 = {"lora.A": a1["lora.A"], "lora.B": a1["lora.B"] + 1}
    gs.save(whole({**base, **a2}), tmp_path / "s2", base=tmp_path / "s1", frozen=["base.*"])
    bases, refs = regions_of(tmp_path / "s2")
    roots = [b["root"] for b in bases]
    assert sorted(roots) == ["s0", "s1"]
    assert all(roots[refs[k][0]] == "s0" for k in base)  # s1 references s0: s2 does too, directly
    assert roots[refs["lora.A"][0]] == "s1" and refs["lora.B"] == [None]
    for k, v in {**base, **a2}.items():
        assert np.array_equal(reference_reader.Checkpoint(tmp_path / "s2").read(k), v)
        assert np.array_equal(gs.read_array(tmp_path / "s2", k), v)


@pytest.mark.parametrize("how", ["deleted", "replaced", "uncommitted"])
def test_a_base_deleted_or_replaced_makes_its_dependants_fail_loudly(tmp_path, how):
    base, adapters = lora(4)
    gs.save(whole({**base, **adapters}), tmp_path / "s0")
    gs.save(whole({**base, **adapters}), tmp_path / "s1", base=tmp_path / "s0", frozen=["base.*"])
    if how == "deleted":
        shutil.rmtree(tmp_path / "s0")
    elif how == "replaced":
        gs.save(whole({**base, **adapters}), tmp_path / "s0", overwrite=True)
        gs.wait_for_cleanup()
    else:
        os.remove(tmp_path / "s0" / "metadata.json")
    targets = whole({k: np.full_like(v, 7) for k, v in {**base, **adapters}.items()})
    says = "was replaced" if how == "replaced" else "cannot be read"
    with pytest.raises(gs.StorageError, match=says) as e:
        gs.load(targets, tmp_path / "s1")
    assert "s0" in str(e.value) and "base.layers.0.w" in str(e.value)
    assert all((t.data == 7).all() for t in targets.values())  # nothing loaded, not zeros
    with pytest.raises(gs.StorageError, match=says):
        gs.read_array(tmp_path / "s1", "base.norm")
    assert np.array_equal(gs.read_array(tmp_path / "s1", "lora.A"), adapters["lora.A"])  # its own keys still load
    problems, _ = gs.Checkpoint(tmp_path / "s1").verify()
    assert len(problems) == 1 and "s0" in problems[0], problems
    with pytest.raises(reference_reader.Invalid, match="s0"):
        reference_reader.Checkpoint(tmp_path / "s1").read("base.norm")


def test_a_base_that_no_longer_stores_a_referenced_region_is_refused(tmp_path):
    base, adapters = lora(5)
    gs.save(whole({**base, **adapters}), tmp_path / "s0")
    gs.save(whole({**base, **adapters}), tmp_path / "s1", base=tmp_path / "s0", frozen=["base.*"])
    doc = json.loads((tmp_path / "s0" / "metadata.json").read_text())  # the base edited by hand
    doc["tensors"]["base.norm"]["regions"][0]["path"] = doc["tensors"]["base.norm"]["regions"][0]["path"] + "x"
    (tmp_path / "s0" / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(gs.StorageError, match="does not store what it is referenced for") as e:
        gs.read_array(tmp_path / "s1", "base.norm")
    assert "'base.norm'" in str(e.value)


def test_bad_bases_and_frozen_keys_are_refused_before_anything_is_written(tmp_path):
    base, adapters = lora(6)
    state = whole({**base, **adapters})
    gs.save(state, tmp_path / "run" / "s0")
    with pytest.raises(gs.LayoutError, match="need base="):
        gs.save(state, tmp_path / "run" / "x", frozen=["base.*"])
    with pytest.raises(gs.StorageError, match="not a checkpoint beside"):
        gs.save(state, tmp_path / "elsewhere" / "x", base=tmp_path / "run" / "s0")
    with pytest.raises(gs.StorageError, match="not a checkpoint beside"):  # itself: its arrays are deleted after
        gs.save(state, tmp_path / "run" / "s0", base=tmp_path / "run" / "s0", overwrite=True)
    with pytest.raises(gs.StorageError, match="holds no committed checkpoint"):
        gs.save(state, tmp_path / "run" / "x", base=tmp_path / "run" / "nothing")
    with pytest.raises(gs.LayoutError, match="'nope.*' matches no key"):
        gs.save(state, tmp_path / "run" / "x", base=tmp_path / "run" / "s0", frozen=["nope.*"])
    wider = {k: gs.ShardedTensor.from_offset(k, np.zeros((64, 33), np.float32), global_shape=(64, 33),
                                             global_offset=(0, 0)) for k in base if k.startswith("base.layers")}
    with pytest.raises(gs.LayoutError, match=r"frozen 'base.layers.0.w' \(float32 \(64, 33\)\) is stored as "
                                             r"float32 \(64, 32\) in the base s0"):
        gs.save(wider, tmp_path / "run" / "x", base=tmp_path / "run" / "s0", frozen=["base.layers.*"])
    doubles = whole({"base.norm": np.ones(32, np.float64)})
    with pytest.raises(gs.LayoutError, match=r"frozen 'base.norm' \(float64 \(32,\)\) is stored as float32"):
        gs.save(doubles, tmp_path / "run" / "x", base=tmp_path / "run" / "s0", frozen=["base.*"])
    with pytest.raises(gs.LayoutError, match=r"frozen 'extra' \(float32 \(2,\)\) is not stored in the base s0"):
        gs.save(whole({"extra": np.ones(2, np.float32)}), tmp_path / "run" / "x", base=tmp_path / "run" / "s0",
                frozen=["extra"])
    w = base["base.layers.0.w"]  # rows 0-59 stored as an array, 60-63 (512 bytes) packed
    uneven = {f"w@{a}": gs.ShardedTensor.from_offset("base.layers.0.w", w[a:b], global_shape=w.shape,
                                                     global_offset=(a, 0)) for a, b in ((0, 60), (60, 64))}
    with pytest.raises(gs.LayoutError, match="frozen 'base.layers.0.w' is cut otherwise in the base s0, and packed"):
        gs.save(uneven, tmp_path / "run" / "x", base=tmp_path / "run" / "s0", frozen=["base.layers.*"],
                pack_below=1024)
    assert not (tmp_path / "run" / "x" / "metadata.json").exists()
    assert not (tmp_path / "elsewhere" / "x" / "metadata.json").exists()


def test_a_dependant_loads_into_any_layout_and_its_overwrite_never_deletes_the_base(tmp_path):
    rng = np.random.default_rng(7)
    frozen_w = rng.standard_normal((8, 6)).astype(np.float32)
    trained = rng.standard_normal((8, 6)).astype(np.float32)

    def tp2(values, rank):
        return {k: gs.ShardedTensor.from_offset(k, v[rank * 4:(rank + 1) * 4].copy(), global_shape=v.shape,
                                                global_offset=(rank * 4, 0)) for k, v in values.items()}

    for name, t, base in (("s0", trained, None), ("s1", trained * 2, tmp_path / "s0")):
        results = run_ranks(2, lambda comm, t=t, name=name, base=base: gs.save(
            tp2({"frozen": frozen_w, "trained": t}, comm.rank), tmp_path / name, comm=comm, base=base,
            frozen=["frozen"] if base else ()))
        assert results == [None, None], results
    assert regions_of(tmp_path / "s1")[1] == {"frozen": [0, 0], "trained": [None, None]}
    targets = {f"{k}@{r}": gs.ShardedTensor.from_offset(k, np.zeros((2, 6), np.float32), global_shape=(8, 6),
                                                        global_offset=(2 * r, 0))
               for k in ("frozen", "trained") for r in range(4)}
    gs.load(targets, tmp_path / "s1")  # TP=2 -> TP=4, from the base and from its own arrays
    for name, t in targets.items():
        r = int(name.split("@")[1])
        want = frozen_w if t.key == "frozen" else trained * 2
        assert np.array_equal(t.data, want[2 * r:2 * r + 2]), name
    before = sorted(os.listdir(tmp_path / "s0" / "saves"))
    gs.save(whole({"frozen": frozen_w, "trained": trained}), tmp_path / "s1", overwrite=True)
    gs.wait_for_cleanup()
    assert sorted(os.listdir(tmp_path / "s0" / "saves")) == before  # the replaced dependant's, not the base's
    assert np.array_equal(gs.read_array(tmp_path / "s0", "frozen"), frozen_w)


def test_a_frozen_key_saved_under_another_layout_takes_the_bases_cut(tmp_path):
    # A LoRA fine-tune saved at TP=2 (the base split in rows), resumed at TP=4 cut along columns: its
    # frozen weights are recorded as the base's halves, referenced, and nothing of them is written again.
    rng = np.random.default_rng(11)
    frozen_w = rng.standard_normal((8, 8)).astype(np.float32)
    adapter = rng.standard_normal((8, 2)).astype(np.float32)

    def rows(key, v, rank, n):
        return gs.ShardedTensor.from_offset(key, v[rank * 8 // n:(rank + 1) * 8 // n].copy(), global_shape=v.shape,
                                            global_offset=(rank * 8 // n, 0))

    def cols(key, v, rank, n):
        return gs.ShardedTensor.from_offset(key, v[:, rank * 8 // n:(rank + 1) * 8 // n].copy(),
                                            global_shape=v.shape, global_offset=(0, rank * 8 // n))

    def state(rank, n, cut, a):
        return {"w": cut("w", frozen_w, rank, n), "lora": rows("lora", a, rank, n)}

    assert run_ranks(2, lambda comm: gs.save(state(comm.rank, 2, rows, adapter), tmp_path / "s0", comm=comm)) == \
        [None, None]
    stats = [gs.IOStats() for _ in range(4)]
    assert run_ranks(4, lambda comm: gs.save(state(comm.rank, 4, cols, adapter * 2), tmp_path / "s1", comm=comm,
                                             base=tmp_path / "s0", frozen=["w"], stats=stats[comm.rank])) == \
        [None] * 4
    md, base_md = gs.read_metadata(tmp_path / "s1"), gs.read_metadata(tmp_path / "s0")
    assert [(r.box, r.path, r.base) for r in md.tensors["w"].regions] == \
        [(r.box, r.path, 0) for r in base_md.tensors["w"].regions]  # the base's two row halves
    assert sum(s.bytes_written for s in stats) == adapter.nbytes  # the adapter only
    for k, want in (("w", frozen_w), ("lora", adapter * 2)):
        assert np.array_equal(gs.read_array(tmp_path / "s1", k), want), k
        assert np.array_equal(reference_reader.Checkpoint(tmp_path / "s1").read(k), want), k
    assert gs.Checkpoint(tmp_path / "s1").verify()[0] == []
    # A third save, back at TP=2 rows, finds its cut in s1's record and references s0 where the bytes lie.
    assert run_ranks(2, lambda comm: gs.save(state(comm.rank, 2, rows, adapter), tmp_path / "s2", comm=comm,
                                             base=tmp_path / "s1", frozen=["w"])) == [None, None]
    assert {r.base for r in gs.read_metadata(tmp_path / "s2").tensors["w"].regions} == {0}
    assert gs.read_metadata(tmp_path / "s2").bases[0].root == "s0"
    assert np.array_equal(gs.read_array(tmp_path / "s2", "w"), frozen_w)


def test_bases_on_a_kvstore_are_sibling_prefixes():
    base, adapters = lora(8)
    root = "memory://bases-kv/run/"
    gs.save(whole({**base, **adapters}), "s0", kvstore=root)
    gs.save(whole({**base, **adapters}), "s1", kvstore=root, base="s0", frozen=["base.*"])
    assert gs.read_metadata("s1", kvstore=root).bases[0].root == "s0"
    assert np.array_equal(gs.read_array("s1", "base.norm", kvstore=root), base["base.norm"])
    from globalshard.store import open_root

    with pytest.raises(gs.StorageError, match="top of its kvstore"):
        open_root("memory://").sibling("s0")  # a root with no parent prefix has no siblings


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_an_async_save_does_not_copy_frozen_regions_into_its_pool(tmp_path, mode):
    base, adapters = lora(9)
    gs.save(whole({**base, **adapters}), tmp_path / "s0")
    saver = gs.AsyncSaver(mode)
    saver.save(whole({**base, **adapters}), tmp_path / "s1", base=tmp_path / "s0", frozen=["base.*"])
    saver.wait()
    assert saver.pool.nbytes < sum(v.nbytes for v in base.values())  # only the adapters were copied
    assert saver.last_mode == mode
    for k, v in {**base, **adapters}.items():
        assert np.array_equal(gs.read_array(tmp_path / "s1", k), v)
    # Cut otherwise (row halves): the base's cut, through the writer too.
    halves = {f"{k}@{r}": gs.ShardedTensor.from_offset(k, v[r * 32:(r + 1) * 32], global_shape=v.shape,
                                                       global_offset=(r * 32, 0))
              for k, v in base.items() if v.ndim == 2 for r in range(2)}
    saver.save({**halves, **whole(adapters)}, tmp_path / "s2", base=tmp_path / "s0", frozen=["base.*"])
    saver.wait()
    layers = [k for k in base if k != "base.norm"]
    assert {k: [r.base for r in t.regions] for k, t in gs.read_metadata(tmp_path / "s2").tensors.items()} == \
        {**{k: [0] for k in layers}, **{k: [None] for k in adapters}}
    for k in [*layers, *adapters]:
        assert np.array_equal(gs.read_array(tmp_path / "s2", k), {**base, **adapters}[k])


def test_the_manager_keeps_every_base_a_kept_checkpoint_references(tmp_path):
    base, adapters = lora(10)
    manager = gs.CheckpointManager(tmp_path, keep_last=1)
    first = manager.save(0, whole({**base, **adapters}))
    for step in (1, 2, 3):
        manager.save(step, whole({**base, **{k: v + step for k, v in adapters.items()}}), base=first,
                     frozen=["base.*"])
    assert [s for s, _ in manager.complete()] == [0, 3]  # step 0 is the base of step 3; 1 and 2 are gone
    manager.save(4, whole({**base, **adapters}))  # references nothing: its base may go
    assert [s for s, _ in manager.complete()] == [4]
    assert np.array_equal(gs.read_array(manager.latest()[1], "base.norm"), base["base.norm"])


values_and_changes = st.tuples(st.integers(0, 2**31), st.lists(st.booleans(), min_size=4, max_size=4),
                               st.lists(st.booleans(), min_size=4, max_size=4))


@settings(max_examples=25)
@given(values_and_changes)
def test_property_a_dependant_holds_the_new_values_and_references_only_unchanged_ones(case):
    import tempfile

    seed, changed, frozen = case
    rng = np.random.default_rng(seed)
    old = {f"t{i}": rng.integers(-5, 5, (3 + i, 2)).astype(np.float32) for i in range(4)}
    new = {k: v + 1 if changed[i] else v.copy() for i, (k, v) in enumerate(old.items())}
    frozen_keys = [k for i, k in enumerate(old) if frozen[i] and not changed[i]]
    root = tempfile.mkdtemp()
    try:
        gs.save(whole(old), os.path.join(root, "a"), digests=True)
        gs.save(whole(new), os.path.join(root, "b"), base=os.path.join(root, "a"), frozen=frozen_keys)
        md = gs.read_metadata(os.path.join(root, "b"))
        for i, k in enumerate(new):
            referenced = md.tensors[k].regions[0].base is not None
            assert referenced == (not changed[i]), (k, changed, frozen)
            assert np.array_equal(gs.read_array(os.path.join(root, "b"), k), new[k])
    finally:
        shutil.rmtree(root, ignore_errors=True)


cuts = st.lists(st.integers(1, 11), min_size=0, max_size=3, unique=True).map(lambda c: [0, *sorted(c), 12])


def pieces(cut, value, by_columns):
    """``value`` (12 x 12) cut at ``cut`` along its columns or rows, one shard per piece."""
    out = {}
    for a, b in itertools.pairwise(cut):
        box = (slice(None), slice(a, b)) if by_columns else (slice(a, b),)
        offset = (0, a) if by_columns else (a, 0)
        out[f"w@{a}"] = gs.ShardedTensor.from_offset("w", value[box].copy(), global_shape=value.shape,
                                                     global_offset=offset)
    return out


@settings(max_examples=25)
@given(cuts, cuts, st.booleans())
def test_property_a_frozen_key_under_any_other_cut_reads_back_and_writes_nothing(base_cut, new_cut, by_columns):
    import tempfile

    value = np.arange(12 * 12, dtype=np.float32).reshape(12, 12)
    root = tempfile.mkdtemp()
    try:
        gs.save(pieces(base_cut, value, by_columns), os.path.join(root, "a"))
        stats = gs.IOStats()
        gs.save(pieces(new_cut, value, by_columns), os.path.join(root, "b"), base=os.path.join(root, "a"),
                frozen=["w"], stats=stats)
        assert stats.bytes_written == 0
        regions = gs.read_metadata(os.path.join(root, "b")).tensors["w"].regions
        theirs = gs.read_metadata(os.path.join(root, "a")).tensors["w"].regions
        assert [r.box for r in regions] == [r.box for r in theirs]
        assert all(r.base == 0 for r in regions)
        assert np.array_equal(gs.read_array(os.path.join(root, "b"), "w"), value)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_export_follows_references(tmp_path):
    from safetensors.numpy import load_file

    from globalshard import hf

    base, adapters = lora(11)
    gs.save(whole({**base, **adapters}), tmp_path / "s0")
    gs.save(whole({**base, **adapters}), tmp_path / "s1", base=tmp_path / "s0", frozen=["base.*"])
    hf.export(str(tmp_path / "s1"), str(tmp_path / "hf"))
    files = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    exported = {k: v for f in files for k, v in load_file(str(tmp_path / "hf" / f)).items()}
    assert set(exported) == set(base) | set(adapters)
    for k, v in {**base, **adapters}.items():
        assert np.array_equal(exported[k], v), k


def _gathered(per_rank):
    """region_digests of each rank's state, merged (as ranks exchange them)."""
    out = {}
    for digests in per_rank:
        for key, regions in digests.items():
            out.setdefault(key, {}).update(regions)
    return out


def _rows(key, v, rank, n):
    h = v.shape[0] // n
    return gs.ShardedTensor.from_offset(key, v[rank * h:(rank + 1) * h].copy(), global_shape=v.shape,
                                        global_offset=(rank * h, 0))


def _cols(key, v, rank, n):
    h = v.shape[1] // n
    return gs.ShardedTensor.from_offset(key, v[:, rank * h:(rank + 1) * h].copy(), global_shape=v.shape,
                                        global_offset=(0, rank * h))


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_keys_unchanged_since_a_load_under_another_layout_take_the_bases_cut(tmp_path, mode):
    # A fine-tune saved at 2 ranks (row halves), loaded at 4 cut along columns: the digests of what the
    # load filled are the caller's word of what the base holds; a later save references every key still
    # so (the base's cut, nothing written) and writes the one that changed, whole, in its own cut.
    rng = np.random.default_rng(12)
    frozen_w, other = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    adapter = rng.standard_normal((8, 4)).astype(np.float32)

    def state(rank, n, cut, w, o, a):
        return {"w": cut("w", w, rank, n), "o": cut("o", o, rank, n), "lora": _rows("lora", a, rank, n)}

    run_ranks(2, lambda comm: gs.save(state(comm.rank, 2, _rows, frozen_w, other, adapter), tmp_path / "s0",
                                      comm=comm))
    loaded = [state(r, 4, _cols, frozen_w, other, adapter) for r in range(4)]  # what a load at 4 ranks fills
    known = _gathered(gs.region_digests(s) for s in loaded)
    changed = other.copy()
    changed[1, 6] += 1.0  # one element of one rank's piece: that key is written
    stats = [gs.IOStats() for _ in range(4)]
    savers = [gs.AsyncSaver(mode) if mode != "sync" else None for _ in range(4)]

    def save(comm):
        s = state(comm.rank, 4, _cols, frozen_w, changed, adapter * 2)
        options = dict(comm=comm, base=tmp_path / "s0", unchanged=known, stats=stats[comm.rank])
        if savers[comm.rank] is None:
            gs.save(s, tmp_path / "s1", **options)
        else:
            savers[comm.rank].save(s, tmp_path / "s1", **options)
            savers[comm.rank].wait()

    run_ranks(4, save)
    if mode != "sync":
        assert {s.last_mode for s in savers} == {mode}
    md, base_md = gs.read_metadata(tmp_path / "s1"), gs.read_metadata(tmp_path / "s0")
    assert [(r.box, r.path, r.base) for r in md.tensors["w"].regions] == \
        [(r.box, r.path, 0) for r in base_md.tensors["w"].regions]  # the base's row halves
    assert [(r.box.offset, r.base) for r in md.tensors["o"].regions] == [((0, 2 * i), None) for i in range(4)]
    assert sum(s.bytes_written for s in stats) == changed.nbytes + adapter.nbytes
    for k, want in (("w", frozen_w), ("o", changed), ("lora", adapter * 2)):
        assert np.array_equal(gs.read_array(tmp_path / "s1", k), want), k
        assert np.array_equal(reference_reader.Checkpoint(tmp_path / "s1").read(k), want), k
    assert gs.Checkpoint(tmp_path / "s1").verify()[0] == []


def test_unchanged_keys_need_a_base_and_are_written_when_the_base_stores_them_otherwise(tmp_path):
    value = np.arange(16, dtype=np.float32).reshape(4, 4)
    gs.save(whole({"w": value}), tmp_path / "s0")
    known = gs.region_digests(whole({"w": value.astype(np.float64), "x": value}))
    with pytest.raises(gs.LayoutError, match="need base="):
        gs.save(whole({"w": value}), tmp_path / "s1", unchanged=known)
    # float64 here, float32 in the base; "x" not in the base: both stored as usual, nothing refused.
    gs.save(whole({"w": value.astype(np.float64), "x": value}), tmp_path / "s1", base=tmp_path / "s0",
            unchanged=known)
    md = gs.read_metadata(tmp_path / "s1")
    assert [r.base for t in md.tensors.values() for r in t.regions] == [None, None]
    assert np.array_equal(gs.read_array(tmp_path / "s1", "w"), value)
    # Ranks passing different digests would not hash together: refused on every rank, nothing committed.
    halves = [{"w": _rows("w", value, r, 2)} for r in range(2)]

    def differing(comm):
        try:
            gs.save(halves[comm.rank], tmp_path / "s2", comm=comm, base=tmp_path / "s0",
                    unchanged=gs.region_digests(halves[comm.rank]))
        except gs.LayoutError as e:
            return str(e)

    assert all("different unchanged=" in m for m in run_ranks(2, differing))
    assert not (tmp_path / "s2" / "metadata.json").exists()


@settings(max_examples=25)
@given(cuts, cuts, st.booleans(), st.one_of(st.none(), st.integers(0, 143)))
def test_property_an_unchanged_key_is_referenced_and_a_changed_one_written_under_any_cut(base_cut, new_cut,
                                                                                        by_columns, touched):
    import tempfile

    value = np.arange(12 * 12, dtype=np.float32).reshape(12, 12)
    now = value.copy()
    if touched is not None:
        now.reshape(-1)[touched] = -1.0
    root = tempfile.mkdtemp()
    try:
        gs.save(pieces(base_cut, value, by_columns), os.path.join(root, "a"))
        stats = gs.IOStats()
        gs.save(pieces(new_cut, now, by_columns), os.path.join(root, "b"), base=os.path.join(root, "a"),
                stats=stats, unchanged=gs.region_digests(pieces(new_cut, value, by_columns)))
        regions = gs.read_metadata(os.path.join(root, "b")).tensors["w"].regions
        if touched is None:
            theirs = gs.read_metadata(os.path.join(root, "a")).tensors["w"].regions
            assert [(r.box, r.base) for r in regions] == [(r.box, 0) for r in theirs] and stats.bytes_written == 0
        else:
            assert all(r.base is None for r in regions) and stats.bytes_written == value.nbytes
        assert np.array_equal(gs.read_array(os.path.join(root, "b"), "w"), now)  # never the stale values
    finally:
        shutil.rmtree(root, ignore_errors=True)
