"""Tiered saves that reference a base (spec sections 5.2 and 5.3), ranks as
threads: a LoRA-like step whose frozen keys stay in the persistent step that
holds them; its tier copies hold only what it writes, the nodes keep their
copies of the base while a kept step references it, and a recovery reads
the frozen keys from those copies (else from the base in the persistent
tier), the rest from the nearest copies."""

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tiers import COLS, KEYS, ROWS, StepNamed, manager, resume, rows_state, values

import globalshard as gs
from globalshard.format.holdings import parse_holdings

FROZEN = ["a", "b"]  # the base's weights; "c" is trained


def lora_values(step):
    """Keys a and b as at step 10 (frozen), c as at ``step``."""
    return {k: (values(10) if k in FROZEN else values(step))[k] for k in KEYS}


def copy_of(tmp_path, node, step):
    return parse_holdings((tmp_path / "local" / f"node{node}" / f"iter_{step:07d}" / "holdings.json").read_bytes())


@pytest.mark.parametrize("mode,named", [(None, gs.TieredManager), ("process", gs.TieredManager), (None, StepNamed)])
def test_frozen_keys_are_referenced_in_the_base_never_written_to_the_tiers_and_recovered_from_it(tmp_path, mode,
                                                                                                named):
    # named: persisted steps named step-<n> (torchtitan's folders): a base's tier copies are found by its
    # save, whatever its root's name (before, by parsing iter_<n> from it: read from the persistent tier).
    world = 8
    name = named.STEP_NAME.format

    def job(comm):
        m = manager(tmp_path, comm, named=named)
        m.keep_last = 1  # the base outlives the retention: a kept step references it
        saver = gs.AsyncSaver(mode) if mode else None
        m.save(10, rows_state(values(10), comm.rank, world), saver=saver)
        m.wait()
        for step in (20, 30):
            state = rows_state(lora_values(step), comm.rank, world)
            m.save(step, state, base=m.path(10), frozen=FROZEN, saver=saver)
            for t in state.values():
                t.data[:] = -1  # training goes on
        m.wait()
        return m.persisted()

    assert gs.testing.comm.run_ranks(world, job) == [30] * world
    persistent = tmp_path / "persistent"
    md = gs.read_metadata(persistent / name(step=30))
    assert [b.root for b in md.bases] == [name(step=10)]
    assert all(r.base is not None for k in FROZEN for r in md.tensors[k].regions)
    assert all(r.base is None for r in md.tensors["c"].regions)
    assert (persistent / name(step=10)).exists() and not (persistent / name(step=20)).exists()  # kept as a base
    assert sorted(p.name for p in persistent.iterdir() if named.STEP_PATTERN.fullmatch(p.name)) == [
        name(step=10), name(step=30)]
    own = set(md.paths())
    for node in range(4):  # the tier copies hold what step 30 wrote, nothing of the frozen keys
        held = copy_of(tmp_path, node, 30).holds
        assert held <= own and held
    assert not any("/a/" in p or "/b/" in p for p in own)
    np.testing.assert_array_equal(gs.read_array(persistent / name(step=30), "a"), values(10)["a"])
    np.testing.assert_array_equal(gs.read_array(persistent / name(step=30), "c"), values(30)["c"])

    for node in range(4):  # keep=2, and the base's copies, which the kept step 30 references
        assert sorted(p.name for p in (tmp_path / "local" / f"node{node}").iterdir()) == [
            "iter_0000010", "iter_0000020", "iter_0000030"]

    shutil.rmtree(tmp_path / "local" / "node2")  # a node lost; the job comes back on 6 ranks, another cut
    out = resume(tmp_path, world=6, per_node=2, nodes_map=[0, 1, 3], named=named)
    n = ROWS // 6
    for rank, (trainer, got, rec) in enumerate(out):
        assert trainer["step"] == 30 and rec.step == 30
        for k, v in lora_values(30).items():
            np.testing.assert_array_equal(got[k], v[rank * n:(rank + 1) * n], err_msg=f"{rank} {k}")
        # the frozen keys from the tier copies of the base's step too: nothing from the persistent tier
        assert rec.paths_persistent == [] and rec.bytes_persistent == 0, rec.paths_persistent
        assert rec.bytes_local + rec.bytes_peer >= sum(v[:n].nbytes for v in lora_values(30).values())


def save_base_then_lora(tmp_path, world, per_node):
    """Step 10 whole, then step 20 with the frozen keys referenced in step 10."""
    def job(comm):
        m = manager(tmp_path, comm, per_node=per_node)
        m.save(10, rows_state(values(10), comm.rank, world))
        m.wait()
        m.save(20, rows_state(lora_values(20), comm.rank, world), base=m.path(10), frozen=FROZEN)
        m.wait()

    assert gs.testing.comm.run_ranks(world, job) == [None] * world


def test_a_base_whose_tier_copies_are_gone_is_read_from_the_persistent_tier_and_its_copies_pruned_once_unused(
        tmp_path):
    save_base_then_lora(tmp_path, 4, 2)
    md = gs.read_metadata(tmp_path / "persistent" / "iter_0000020")
    base_paths = {r.path for k in FROZEN for r in md.tensors[k].regions}
    out = resume(tmp_path, world=2, per_node=1)  # every node's copies there: nothing from the persistent tier
    assert all(rec.bytes_persistent == 0 and rec.paths_persistent == [] for _, _, rec in out)
    for node in range(2):
        shutil.rmtree(tmp_path / "local" / f"node{node}" / "iter_0000010")
    out = resume(tmp_path, world=2, per_node=1)
    assert sorted(p for _, _, rec in out for p in rec.paths_persistent) == sorted(base_paths)
    for rank, (_, got, rec) in enumerate(out):
        for k, v in lora_values(20).items():
            np.testing.assert_array_equal(got[k], v[rank * ROWS // 2:(rank + 1) * ROWS // 2], err_msg=f"{rank} {k}")
        assert rec.bytes_local > 0  # the trained key from the step's own copies

    def later(comm):  # steps that reference no base: its copies go with the last copy that did
        m = manager(tmp_path, comm)
        for step in (30, 40, 50):
            m.save(step, rows_state(values(step), comm.rank, 4), base=m.path(10) if step == 30 else None,
                   frozen=FROZEN if step == 30 else ())
        m.wait()

    assert gs.testing.comm.run_ranks(4, later) == [None] * 4
    for node in range(2):
        assert sorted(p.name for p in (tmp_path / "local" / f"node{node}").iterdir()) == [
            "iter_0000040", "iter_0000050"]


def cols_state(vals, rank, world):
    """Each key cut in ``world`` column blocks (another TP's cut)."""
    n = COLS // world
    return {k: gs.ShardedTensor.from_offset(k, v[:, rank * n:(rank + 1) * n].copy(), global_shape=v.shape,
                                            global_offset=(0, rank * n)) for k, v in vals.items()}


@pytest.mark.parametrize("mode", [None, "process"])
def test_keys_still_as_loaded_from_the_base_on_another_cut_are_referenced_in_its_cut(tmp_path, mode):
    """A job resumed on another cut (columns, 2 ranks) from a step saved in
    rows (4 ranks) saves with ``unchanged=`` the digests of what it loaded:
    the key still as loaded is referenced in the base's row cut, neither
    written nor copied nor drained; the key that changed in one element and
    the trained key are written in the job's cut."""
    save_base_then_lora(tmp_path, 4, 2)  # step 10 whole in rows, step 20 referencing it
    vals = lora_values(30)
    vals["b"] = vals["b"].copy()
    vals["b"][5, 1] += 1  # changed since the load: written
    stats = [gs.IOStats() for _ in range(2)]

    def job(comm):
        m = manager(tmp_path, comm, per_node=1)
        loaded = cols_state({k: np.zeros((ROWS, COLS), np.float32) for k in KEYS}, comm.rank, 2)
        assert m.load_latest(loaded)["step"] == 20
        known: dict = {}  # every rank's regions of the frozen keys, as loaded
        mine = [[k, list(o), d] for k, m in gs.region_digests(loaded).items() if k in FROZEN for o, d in m.items()]
        for k, o, d in (x for part in comm.all_gather(mine) for x in part):
            known.setdefault(k, {})[tuple(o)] = d
        saver = gs.AsyncSaver(mode) if mode else None
        m.save(30, cols_state(vals, comm.rank, 2), base=m.path(10), unchanged=known, saver=saver,
               stats=stats[comm.rank])
        m.wait()
        return m.persisted()

    assert gs.testing.comm.run_ranks(2, job) == [30] * 2
    md, base_md = gs.read_metadata(tmp_path / "persistent" / "iter_0000030"), gs.read_metadata(
        tmp_path / "persistent" / "iter_0000010")
    assert [(r.box, r.path, r.base) for r in md.tensors["a"].regions] == \
        [(r.box, r.path, 0) for r in base_md.tensors["a"].regions]  # the base's row quarters
    assert all(r.base is None for k in ("b", "c") for r in md.tensors[k].regions)
    assert sum(s.bytes_written for s in stats) == vals["b"].nbytes + vals["c"].nbytes
    for node in range(2):
        held = copy_of(tmp_path, node, 30).holds
        assert held <= set(md.paths()) and not any("/a/" in p for p in held)
    for k, v in vals.items():
        np.testing.assert_array_equal(gs.read_array(tmp_path / "persistent" / "iter_0000030", k), v, err_msg=k)
    out = resume(tmp_path, world=4, per_node=2)
    for rank, (trainer, got, rec) in enumerate(out):
        assert trainer["step"] == 30 and rec.bytes_persistent == 0
        for k, v in vals.items():
            np.testing.assert_array_equal(got[k], v[rank * ROWS // 4:(rank + 1) * ROWS // 4], err_msg=k)


def test_a_base_deleted_by_hand_fails_the_recovery_naming_it(tmp_path):
    save_base_then_lora(tmp_path, 2, 1)
    shutil.rmtree(tmp_path / "persistent" / "iter_0000010")
    for node in range(2):
        shutil.rmtree(tmp_path / "local" / f"node{node}" / "iter_0000010")
    out = gs.testing.comm.run_ranks(2, lambda comm: manager(tmp_path, comm, per_node=1).load_latest(
        rows_state({k: np.zeros((ROWS, 8), np.float32) for k in KEYS}, comm.rank, 2)))
    for e in out:
        assert isinstance(e, gs.StorageError) and "iter_0000010" in str(e) and "'a'" in str(e), e


def test_the_unchanged_values_of_a_recovery_from_a_step_referencing_a_base_equal_a_plain_load(tmp_path):
    save_base_then_lora(tmp_path, 4, 2)
    out = resume(tmp_path, world=4, per_node=2)
    plain = {k: gs.read_array(tmp_path / "persistent" / "iter_0000020", k) for k in KEYS}
    assert all(np.array_equal(plain[k], v) for k, v in lora_values(20).items())
    for rank, (_, got, _) in enumerate(out):
        for k in KEYS:
            np.testing.assert_array_equal(got[k], plain[k][rank * ROWS // 4:(rank + 1) * ROWS // 4])


@pytest.mark.parametrize("mode", [None, "thread"])
def test_regions_hashed_equal_to_the_base_s_are_referenced_without_naming_them(tmp_path, mode):
    """base= alone (digests, the default with a base): each region whose SHA-256
    equals the one the base recorded (saved with digests=True) is referenced,
    every other one written and copied."""
    world = 4

    def job(comm):
        m = manager(tmp_path, comm)
        saver = gs.AsyncSaver(mode) if mode else None
        m.save(10, rows_state(values(10), comm.rank, world), saver=saver, digests=True)  # SHA-256 recorded
        m.wait()
        vals = lora_values(20)
        if comm.rank == 1:
            vals["b"] = vals["b"].copy()
            vals["b"][ROWS // world + 1, 3] += 1  # one element of rank 1's rows of b changed
        m.save(20, rows_state(vals, comm.rank, world), base=m.path(10), saver=saver)
        m.wait()
        return m.persisted()

    assert gs.testing.comm.run_ranks(world, job) == [20] * world
    md = gs.read_metadata(tmp_path / "persistent" / "iter_0000020")
    referenced = {(k, r.box.offset[0]) for k, t in md.tensors.items() for r in t.regions if r.base is not None}
    n = ROWS // world
    assert referenced == {("a", i * n) for i in range(world)} | {("b", i * n) for i in range(world) if i != 1}
    own = set(md.paths())
    for node in range(2):
        assert copy_of(tmp_path, node, 20).holds <= own
    shutil.rmtree(tmp_path / "local" / "node1")
    out = resume(tmp_path, world=2, per_node=2, nodes_map=[0])
    expected = lora_values(20)
    expected["b"] = expected["b"].copy()
    expected["b"][n + 1, 3] += 1
    base_paths = {r.path for t in md.tensors.values() for r in t.regions if r.base is not None}
    for rank, (_, got, rec) in enumerate(out):
        for k, v in expected.items():
            np.testing.assert_array_equal(got[k], v[rank * ROWS // 2:(rank + 1) * ROWS // 2], err_msg=f"{rank} {k}")
        assert set(rec.paths_persistent) <= base_paths and rec.bytes_local > 0  # the rest from node 0's copy


@settings(max_examples=10, deadline=None)
@given(saved=st.lists(st.integers(1, 5), min_size=1, max_size=4), loaded=st.lists(st.integers(1, 4), min_size=1,
                                                                                  max_size=3),
       seed=st.integers(0, 2**16))
def test_property_a_step_referencing_a_base_recovers_from_the_tier_copies_alone_under_any_cut(tmp_path_factory, saved,
                                                                                              loaded, seed):
    """A frozen key and a trained one cut in rows, the base saved, then a step
    referencing it; the persistent tier's base deleted by hand: loaded under
    another cut (columns), both keys are the saved values, read from the
    tier copies of the base's step and of the step alone."""
    tmp = tmp_path_factory.mktemp("prop")
    rows, cols = sum(saved), sum(loaded)
    rng = np.random.default_rng(seed)
    full = {k: rng.standard_normal((rows, cols)).astype(np.float32) for k in ("frozen", "trained")}

    def cut(vals):
        state, at = {}, 0
        for i, n in enumerate(saved):
            for k, v in vals.items():
                state[f"{k}{i}"] = gs.ShardedTensor.from_offset(k, v[at:at + n].copy(), global_shape=v.shape,
                                                                global_offset=(at, 0))
            at += n
        return state

    m = gs.TieredManager(tiers=[gs.LocalTier(str(tmp / "local")), str(tmp / "persistent")])
    m.save(1, cut({"frozen": full["frozen"], "trained": np.zeros_like(full["trained"])}))
    m.save(2, cut(full), base=m.path(1), frozen=["frozen"])
    m.wait()
    assert all(r.base is not None for r in gs.read_metadata(m.path(2)).tensors["frozen"].regions)
    shutil.rmtree(m.path(1))
    targets, at = {}, 0
    for i, n in enumerate(loaded):
        for k in full:
            targets[f"{k}{i}"] = gs.ShardedTensor.from_offset(k, np.zeros((rows, n), np.float32),
                                                              global_shape=(rows, cols), global_offset=(0, at))
        at += n
    assert m.load_latest(targets)["step"] == 2
    assert m.recovery.bytes_persistent == 0 and m.recovery.paths_persistent == []
    for k, v in full.items():
        got = np.concatenate([targets[f"{k}{i}"].data for i in range(len(loaded))], axis=1)
        np.testing.assert_array_equal(got, v, err_msg=k)
