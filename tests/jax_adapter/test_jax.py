"""The JAX adapter on 8 forced CPU devices: every PartitionSpec change on 1-D
and 2-D meshes, boxes that do not line up, bf16/fp8, scalars; a torch-made
checkpoint loaded into a Flax-style pytree and the reverse; two processes
through jax.distributed."""

import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax_processes import two_processes

jax = pytest.importorskip("jax")
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import globalshard as gs  # noqa: E402
import globalshard_jax as gj  # noqa: E402

DEVICES = jax.devices()
pytestmark = pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 (forced CPU) devices")

MESHES = {"8": ((8,), ("x",)), "4x2": ((4, 2), ("x", "y")), "2x4": ((2, 4), ("x", "y")), "3": ((3,), ("x",)),
          "6": ((6,), ("x",)), "2x3": ((2, 3), ("x", "y"))}


def mesh(name):
    shape, names = MESHES[name]
    n = int(np.prod(shape))
    return Mesh(np.array(DEVICES[:n]).reshape(shape), names)


def specs(names):
    axes = [None, *names, tuple(names)] if len(names) > 1 else [None, names[0]]
    return [P(a, b) for a in axes for b in axes
            if not (a is not None and b is not None and set(np.atleast_1d(a)) & set(np.atleast_1d(b)))]


DTYPES = [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int32]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(MESHES)), st.sampled_from(sorted(MESHES)), st.data(), st.sampled_from(DTYPES))
def test_property_any_spec_to_any_spec(tmp_path_factory, save_mesh, load_mesh, data, dtype):
    a, b = mesh(save_mesh), mesh(load_mesh)
    spec_a = data.draw(st.sampled_from(specs(a.axis_names)))
    spec_b = data.draw(st.sampled_from(specs(b.axis_names)))
    shape = (24, 24)  # divisible by every mesh axis used: boxes of 3, 4, 6, 8 rows cross each other
    value = (np.arange(np.prod(shape)).reshape(shape) % 200 - 100).astype(dtype)
    x = jax.device_put(value, NamedSharding(a, spec_a))
    path = tmp_path_factory.mktemp("ckpt")
    gj.save(path, {"w": x, "step": 3}, trainer_state={"step": 3})
    abstract = {"w": jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(b, spec_b)),
                "step": 0}  # a Python number comes back as one
    stats = gs.IOStats()
    got, ts = gj.load(path, abstract, stats=stats)
    assert ts == {"step": 3}
    assert got["w"].sharding == NamedSharding(b, spec_b)
    assert np.array_equal(np.asarray(got["w"]).view(np.uint8), value.view(np.uint8))
    assert got["step"] == 3 and type(got["step"]) is int
    # Each distinct box once per process: bytes needed is the distinct boxes' bytes.
    distinct = {tuple((s.start, s.stop) for s in idx) for idx in
                NamedSharding(b, spec_b).addressable_devices_indices_map(shape).values()}
    itemsize = np.dtype(dtype).itemsize
    expect = sum(np.prod([(stop or n) - (start or 0) for (start, stop), n in zip(box, shape)]) for box in distinct)
    assert stats.bytes_needed == expect * itemsize + 8


def test_replicas_are_saved_once(tmp_path):
    m = mesh("4x2")
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(m, P("x", None)))
    gj.save(tmp_path, {"w": x})
    regions = gs.read_metadata(tmp_path).tensors["w"].regions
    assert len(regions) == 4  # 8 devices, 2 replicas of each box


def test_pytree_keys_and_leaves_of_every_kind(tmp_path):
    m = mesh("8")
    tree = {"params": {"dense": {"kernel": jax.device_put(np.ones((8, 2), np.float32),
                                                          NamedSharding(m, P("x")))}},
            "opt": [{"mu": np.full((3,), 2.0, np.float32)}, 7], "scale": np.float64(0.5)}
    gj.save(tmp_path, tree)
    keys = sorted(gs.read_metadata(tmp_path).tensors)
    assert keys == ["opt.0.mu", "opt.1", "params.dense.kernel", "scale"]
    abstract = jax.tree.map(lambda v: v if isinstance(v, (int, float)) else jax.ShapeDtypeStruct(v.shape, v.dtype),
                            tree)
    got, _ = gj.load(tmp_path, abstract)
    assert got["scale"] == 0.5 and got["opt"][1] == 7 and type(got["opt"][1]) is int
    assert np.array_equal(np.asarray(got["params"]["dense"]["kernel"]), np.ones((8, 2)))


def test_an_array_leaf_gives_its_sharding(tmp_path):
    m = mesh("2x4")
    value = np.arange(48, dtype=np.float32).reshape(6, 8)
    gj.save(tmp_path, {"w": jax.device_put(value, NamedSharding(m, P("x", "y")))})
    like = jax.device_put(np.zeros_like(value), NamedSharding(m, P(None, "y")))
    got, _ = gj.load(tmp_path, {"w": like})
    assert got["w"].sharding == like.sharding and np.array_equal(np.asarray(got["w"]), value)


def test_64_bit_leaves_are_never_narrowed(tmp_path):
    big = np.array([2**40 + 3, -(2**40)], np.int64)
    gj.save(tmp_path, {"i": big, "f": np.array([1 / 3], np.float64)})
    assert not jax.config.jax_enable_x64
    with pytest.raises(gs.CastError, match=r"(?s)'f': a float64 leaf would be narrowed to float32.*'i': a int64"):
        gj.load(tmp_path, {"i": jax.ShapeDtypeStruct((2,), np.int64), "f": np.zeros(1, np.float64)})
    # Python numbers as targets come back exact, as Python numbers.
    gj.save(tmp_path / "s", {"n": 2**40 + 3, "x": 1 / 3})
    got, _ = gj.load(tmp_path / "s", {"n": 0, "x": 0.0})
    assert got == {"n": 2**40 + 3, "x": 1 / 3}


def test_an_integer_stored_wider_than_its_target_loads_when_every_value_fits(tmp_path):
    # flax's TrainState.create holds step as the Python int 0 (stored as int64); jax.eval_shape of that state
    # asks for int32. Integers narrower than stored load exactly when every value fits, else a CastError.
    m = mesh("8")
    counts = jax.device_put(np.arange(16, dtype=np.int32) - 8, NamedSharding(m, P("x")))
    gj.save(tmp_path, {"step": 0, "counts": np.asarray(counts).astype(np.int64), "big": 2**40, "neg": -1})
    abstract = jax.eval_shape(lambda: {"step": 0, "counts": counts, "big": 0, "neg": 0})
    assert abstract["step"].dtype == np.int32 and abstract["step"].weak_type
    abstract["counts"] = jax.ShapeDtypeStruct((16,), np.int32, sharding=NamedSharding(mesh("2x4"), P("y")))
    got, _ = gj.load(tmp_path, {k: abstract[k] for k in ("step", "counts")}, strict=False)
    assert got["step"].dtype == np.int32 and int(got["step"]) == 0
    assert got["counts"].sharding == abstract["counts"].sharding
    assert np.array_equal(np.asarray(got["counts"]), np.arange(16) - 8)
    with pytest.raises(gs.CastError, match=r"'big': .* holds 1099511627776, which does not fit int32; with jax's"):
        gj.load(tmp_path, abstract)
    with pytest.raises(gs.CastError, match=r"'neg': stored as int64, holds -1, which does not fit uint8$"):
        gj.load(tmp_path, {**abstract, "big": 0, "neg": jax.ShapeDtypeStruct((), np.uint8)})
    with pytest.raises(gs.CastError, match=r"'f'.*float64.*float32"):  # floats stay refused: 0.1 is not exact
        gj.save(tmp_path / "f", {"f": 0.1})
        gj.load(tmp_path / "f", {"f": jax.ShapeDtypeStruct((), np.float32)})


def test_64_bit_leaves_load_exactly_with_x64_on(tmp_path):
    big = np.array([2**40 + 3, -(2**40)], np.int64)
    gj.save(tmp_path, {"i": big})
    with jax.enable_x64(True):
        got, _ = gj.load(tmp_path, {"i": jax.ShapeDtypeStruct((2,), np.int64)})
        assert got["i"].dtype == np.int64 and np.array_equal(np.asarray(got["i"]), big)


@pytest.mark.parametrize("leaf", ["a string", object(), None])
def test_a_leaf_that_is_not_an_array_is_named(tmp_path, leaf):
    gj.save(tmp_path, {"w": np.ones(3, np.float32)})
    if leaf is None:  # None is an empty subtree in jax: nothing to load, so the checkpoint's "w" is unexpected
        with pytest.raises(gs.MismatchError, match=r"no process's pytree asks for(?s:.*)'w'"):
            gj.load(tmp_path, {"v": leaf})
        return
    with pytest.raises(gs.LayoutError, match=r"'v': a load target leaf of type"):
        gj.load(tmp_path, {"w": jax.ShapeDtypeStruct((3,), np.float32), "v": leaf})


def test_strict_by_default_and_a_report_either_way(tmp_path):
    gj.save(tmp_path, {"w": np.ones(3, np.float32), "norm": np.full(2, 5.0, np.float32)})
    with pytest.raises(gs.MismatchError, match=r"(?s)no process's pytree asks for.*'norm'"):
        gj.load(tmp_path, {"w": jax.ShapeDtypeStruct((3,), np.float32)})
    given = np.zeros(4, np.float32)
    result = gj.load(tmp_path, {"w": jax.ShapeDtypeStruct((3,), np.float32), "extra": given}, strict=False)
    got, _ = result
    assert np.array_equal(np.asarray(got["w"]), np.ones(3)) and got["extra"] is given
    assert result.missing_keys == ["extra"] and result.unexpected_keys == ["norm"]
    full = gj.load(tmp_path, {"w": jax.ShapeDtypeStruct((3,), np.float32), "norm": np.zeros(2, np.float32)})
    assert full.missing_keys == [] and full.unexpected_keys == []


def test_missing_key_is_named(tmp_path):
    gj.save(tmp_path, {"w": np.ones(3, np.float32)})
    with pytest.raises(gs.MissingKeyError, match="'v'"):
        gj.load(tmp_path, {"v": jax.ShapeDtypeStruct((3,), np.float32)})


def test_typed_prng_keys_are_stored_as_their_key_data_and_come_back_as_keys(tmp_path):
    # jax.random.key (the typed keys jax recommends) is no numpy dtype: stored as jax.random.key_data
    # (uint32, the implementation's key shape last), wrapped again with the target's key dtype.
    a, b = mesh("8"), mesh("2x4")
    keys = jax.device_put(jax.random.split(jax.random.key(7), 16).reshape(8, 2), NamedSharding(a, P("x")))
    rbg = jax.random.key(3, impl="rbg")
    gj.save(tmp_path, {"rng": jax.random.key(5), "dropout": keys, "rbg": rbg})
    stored = gs.read_metadata(tmp_path).tensors
    assert {k: (t.dtype, t.global_shape) for k, t in stored.items()} == {
        "rng": ("uint32", (2,)), "dropout": ("uint32", (8, 2, 2)), "rbg": ("uint32", (4,))}
    target = NamedSharding(b, P("y", "x"))
    abstract = jax.eval_shape(lambda: {"rng": jax.random.key(0), "dropout": jax.random.split(
        jax.random.key(0), 16).reshape(8, 2), "rbg": jax.random.key(0, impl="rbg")})
    abstract["dropout"] = jax.ShapeDtypeStruct((8, 2), keys.dtype, sharding=target)
    got, _ = gj.load(tmp_path, abstract)
    assert got["dropout"].dtype == keys.dtype and got["dropout"].sharding == target
    assert got["rbg"].dtype == rbg.dtype and got["rng"].dtype == jax.random.key(0).dtype
    for name, want in (("rng", jax.random.key(5)), ("dropout", keys), ("rbg", rbg)):
        assert np.array_equal(np.asarray(jax.random.key_data(got[name])), np.asarray(jax.random.key_data(want)))
    # The keys draw what the saved ones draw; an array target's sharding is reused.
    draw = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))
    assert np.array_equal(np.asarray(draw(got["dropout"])), np.asarray(draw(keys)))
    like = jax.device_put(jax.random.split(jax.random.key(0), 16).reshape(8, 2),
                          NamedSharding(mesh("4x2"), P("x", "y")))
    again, _ = gj.load(tmp_path, {"rng": jax.random.key(0), "dropout": like, "rbg": jax.random.key(0, impl="rbg")})
    assert again["dropout"].sharding == like.sharding
    assert np.array_equal(np.asarray(jax.random.key_data(again["dropout"])), np.asarray(jax.random.key_data(keys)))
    # A key of another implementation is refused naming the key, never a guess: of another size
    # (threefry's 2 words as rbg's 4), and of the same size (rbg's words as unsafe_rbg's draw otherwise).
    with pytest.raises(gs.MismatchError, match=r"'rng': saved as threefry2x32 keys"):
        gj.load(tmp_path, {**abstract, "rng": jax.random.key(0, impl="rbg")})
    with pytest.raises(gs.MismatchError, match=r"'rbg': saved as rbg keys, the target asks for unsafe_rbg keys"):
        gj.load(tmp_path, {**abstract, "rbg": jax.random.key(0, impl="unsafe_rbg")})


def test_an_abstract_mesh_is_resolved_to_the_mesh_set_around_the_load(tmp_path):
    # jax.eval_shape (and flax's nnx.eval_shape) inside jax.set_mesh(mesh) gives shardings over an AbstractMesh,
    # which has no devices: the load resolves it to the concrete mesh set around it, as Orbax does.
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    gj.save(tmp_path, {"w": jax.device_put(value, NamedSharding(mesh("8"), P("x")))})
    m = mesh("4x2")
    abstract = {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(m.abstract_mesh, P("y", "x")))}
    with jax.set_mesh(m):
        got, _ = gj.load(tmp_path, abstract)
    assert got["w"].sharding == NamedSharding(m, P("y", "x")) and np.array_equal(np.asarray(got["w"]), value)
    with pytest.raises(gs.LayoutError, match=r"'w': .*AbstractMesh.*jax.set_mesh"):
        gj.load(tmp_path, abstract)  # no mesh set
    with jax.set_mesh(mesh("2x4")), pytest.raises(gs.LayoutError, match=r"'w': .*AbstractMesh.*not the mesh set"):
        gj.load(tmp_path, abstract)  # another mesh set: never a guess


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_an_async_save_keeps_the_values_it_was_given_after_the_arrays_are_deleted(tmp_path, mode):
    # As a jitted step that donates its state does: the buffers are gone once gj.save returns.
    value = np.arange(24 * 24, dtype=np.float32).reshape(24, 24)
    x = jax.device_put(value, NamedSharding(mesh("4x2"), P("x", "y")))
    key = jax.random.key(4)
    saver = gs.AsyncSaver(mode)
    gj.save(tmp_path, {"w": x, "rng": key, "step": 9}, trainer_state={"step": 9}, saver=saver)
    x.delete()
    key.delete()
    saver.wait()
    with pytest.raises(gs.LayoutError, match=r"'w': the array has been deleted"):  # a save after donation
        gj.save(tmp_path / "late", {"w": x}, saver=saver)
    target = {"w": jax.ShapeDtypeStruct((24, 24), np.float32, sharding=NamedSharding(mesh("8"), P(None, "x"))),
              "rng": jax.random.key(0), "step": 0}
    got, ts = gj.load(tmp_path, target)
    assert ts == {"step": 9} and got["step"] == 9 and np.array_equal(np.asarray(got["w"]), value)
    assert np.array_equal(np.asarray(jax.random.key_data(got["rng"])), np.asarray(jax.random.key_data(
        jax.random.key(4))))


# ----------------------------------------------------------------- torch <-> JAX


def test_torch_linear_at_tp2_loads_as_a_flax_kernel_and_back(tmp_path):
    torch = pytest.importorskip("torch")
    import globalshard_torch as gt

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((8, 6)).astype(np.float32)  # torch Linear(6 -> 8): (out, in)
    bias = rng.standard_normal(8).astype(np.float32)
    rules = gt.ShardingRules([(r"fc\.weight", gt.ColumnParallel()), (r"fc\.bias", gt.ColumnParallel())])
    models = []  # TP=2: rank r holds output rows [4r, 4r + 4)
    for r in range(2):
        m = torch.nn.Module()
        m.fc = torch.nn.Linear(6, 4)
        with torch.no_grad():
            m.fc.weight.copy_(torch.from_numpy(weight[r * 4:(r + 1) * 4]))
            m.fc.bias.copy_(torch.from_numpy(bias[r * 4:(r + 1) * 4]))
        models.append(m)
    state = {}
    for r, m in enumerate(models):
        layout = gt.ParallelLayout(tp_rank=r, tp_size=2)
        for e in gt.model_entries(m, layout, rules):
            state[f"{r}/{e.name}"] = e.shard(e.key, gt.numpy_view(e.tensor.detach()))
    gs.save(state, tmp_path / "torch")
    # Into Flax: kernel (in, out) on a 4-device mesh, columns split.
    m4 = mesh("8")
    mesh4 = Mesh(np.array(DEVICES[:4]), ("model",))
    abstract = {"params": {"fc": {"kernel": jax.ShapeDtypeStruct((6, 8), np.float32,
                                                                 sharding=NamedSharding(mesh4, P(None, "model"))),
                                  "bias": jax.ShapeDtypeStruct((8,), np.float32,
                                                               sharding=NamedSharding(mesh4, P("model")))}}}
    keys = {"params.fc.kernel": ("fc.weight", (1, 0)), "params.fc.bias": "fc.bias"}
    got, _ = gj.load(tmp_path / "torch", abstract, keys=keys)
    assert np.array_equal(np.asarray(got["params"]["fc"]["kernel"]), weight.T)
    assert np.array_equal(np.asarray(got["params"]["fc"]["bias"]), bias)
    # And back: JAX saves the kernel as torch's (out, in); torch loads it at TP=2.
    kernel = jax.device_put(weight.T * 2, NamedSharding(m4, P(None, "x")))
    gj.save(tmp_path / "jax", {"params": {"fc": {"kernel": kernel, "bias": jax.numpy.asarray(bias * 2)}}}, keys=keys)
    for r in range(2):
        m = torch.nn.Module()
        m.fc = torch.nn.Linear(6, 4)
        gt.load_checkpoint(str(tmp_path / "jax"), model=m, layout=gt.ParallelLayout(tp_rank=r, tp_size=2),
                           rules=rules)
        assert np.array_equal(m.fc.weight.detach().numpy(), 2 * weight[r * 4:(r + 1) * 4])
        assert np.array_equal(m.fc.bias.detach().numpy(), 2 * bias[r * 4:(r + 1) * 4])


# ----------------------------------------------------------------- two processes


WORKER = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import globalshard as gs, globalshard_jax as gj
    path = sys.argv[3]
    value = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    x = jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])
    keys = jax.jit(lambda: jax.random.split(jax.random.key(9), 16), out_shardings=sharding)()
    gj.save(path, {"w": x, "keys": keys, "step": 7}, trainer_state={"step": 1})
    mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    target = NamedSharding(mesh2, P("b", "a"))
    stats = gs.IOStats()
    got, ts = gj.load(path, {"w": jax.ShapeDtypeStruct(value.shape, np.float32, sharding=target),
                             "keys": jax.ShapeDtypeStruct((16,), keys.dtype, sharding=NamedSharding(mesh2, P("b"))),
                             "step": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh2, P()))},
                      stats=stats)
    for shard in got["w"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), value[shard.index]), shard.index
    bits = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(9), 16)))
    for shard in got["keys"].addressable_shards:
        assert np.array_equal(np.asarray(jax.random.key_data(shard.data)), bits[shard.index]), shard.index
    assert ts == {"step": 1} and got["step"].dtype == np.int32 and int(got["step"]) == 7  # stored as int64
    whole_stats = gs.IOStats()
    whole, ts = gj.load(path, stats=whole_stats)  # no target: the saved sharding, over all 8 devices
    assert ts == {"step": 1} and whole["step"] == 7 and whole["w"].sharding.is_equivalent_to(sharding, 2)
    for shard in whole["w"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), value[shard.index]), shard.index
    # A load while an async save is in flight: process 0 loads at once, process 1 late, so that unordered, one
    # process's load would take the exchange the other's save's background takes.
    saver = gs.AsyncSaver("thread")
    gj.save(path + ".next", {"w": x, "keys": keys, "step": 8}, saver=saver)
    if jax.process_index() == 1:
        time.sleep(0.5)
    again, ts = gj.load(path, {"w": jax.ShapeDtypeStruct(value.shape, np.float32, sharding=sharding)}, strict=False)
    saver.wait()
    assert ts == {"step": 1} and all(np.array_equal(np.asarray(s.data), value[s.index])
                                     for s in again["w"].addressable_shards)
    print("ok", jax.process_index(), len(got["w"].addressable_shards), stats.bytes_needed, whole_stats.bytes_needed)
""")


def test_two_processes_through_jax_distributed(tmp_path):
    outs = two_processes(tmp_path, WORKER, tmp_path / "ckpt")
    # Each process read only its own devices' boxes: half the array each; the keys (2 uint32 each) are cut
    # along mesh axis "b" only, which each process's 4 devices span, so each reads them all; and the int64 step.
    assert [int(o.split()[3]) for o in outs] == [16 * 6 * 4 // 2 + 16 * 2 * 4 + 8] * 2
    # Without a target, each process reads the half of w and of the keys its devices hold as saved.
    assert [int(o.split()[4]) for o in outs] == [16 * 6 * 4 // 2 + 16 * 2 * 4 // 2 + 8] * 2
    assert gs.read_metadata(tmp_path / "ckpt").tensors["w"].global_shape == (16, 6)


DRIFTED = textwrap.dedent("""
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import globalshard as gs
    import globalshard_jax as gj

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    w = jax.make_array_from_callback((8, 6), NamedSharding(mesh, P("a")),  # replicated over the 4 devices of "b"
                                     lambda i: np.arange(48, dtype=np.float32).reshape(8, 6)[i])
    seen = np.array([100 + jax.process_index()], np.int64)  # a host value each process counted for itself
    gj.save(sys.argv[3] + "/agree", {"w": w, "seen": np.array([100], np.int64)}, check_replicas=True)
    try:
        gj.save(sys.argv[3] + "/drift", {"w": w, "seen": seen}, check_replicas=True)
        error = "none"
    except gs.MismatchError as e:
        error = "named" if "'seen' [0:1]: copies differ, 2 values held by: rank 0 (main); rank 1" in str(e) else str(e)
    committed = os.path.exists(sys.argv[3] + "/drift/metadata.json")
    print("ok", jax.process_index(), error, committed)
""")


def test_copies_that_processes_hold_are_compared_with_check_replicas(tmp_path):
    # An array's shards replicated over devices and processes compare equal; a numpy leaf each process filled
    # itself (taken from process 0 unchecked) is refused on both, naming it, and nothing is committed.
    outs = two_processes(tmp_path, DRIFTED, tmp_path)
    assert [o.split()[2:] for o in outs] == [["named", "False"]] * 2, outs
    assert gs.read_metadata(tmp_path / "agree").tensors["w"].global_shape == (8, 6)


SLOW_CLEANUP = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import globalshard_jax as gj

    class SlowDelete:  # rank 0 late to delete an exchange's keys, as after a GC pause
        def __init__(self, client):
            self.client = client
        def __getattr__(self, name):
            return getattr(self.client, name)
        def key_value_delete(self, key):
            time.sleep(1.0)
            return self.client.key_value_delete(key)

    first = gj.JaxComm(timeout_s=20)
    if jax.process_index() == 0:
        first._client = SlowDelete(first._client)
    assert first.all_gather(jax.process_index() * 10) == [0, 10]
    second = gj.JaxComm(timeout_s=20)  # as the next gj.save or gj.load makes its own
    assert second.all_gather(jax.process_index() + 100) == [100, 101]
    print("ok")
""")


def test_the_next_exchange_does_not_collide_with_a_late_cleanup_of_the_last(tmp_path):
    # Every JaxComm numbered its exchanges from 0: the other process set the next exchange's key before rank 0
    # had deleted the last one's (ALREADY_EXISTS on rank 1, a timeout on rank 0).
    two_processes(tmp_path, SLOW_CLEANUP)


def test_a_padding_companion_is_not_an_unexpected_key(tmp_path):
    # As the torch adapter saves a padded vocabulary (spec section 1): the key is the true array.
    state = {n: gs.ShardedTensor.from_offset(k, np.ones(s, np.float32), global_shape=s, global_offset=(0, 0))
             for n, k, s in (("e", "emb", (5, 2)), ("p", "emb#padding", (1, 2)))}
    gs.save(state, tmp_path)
    got = gj.load(tmp_path, {"emb": jax.ShapeDtypeStruct((5, 2), np.float32)})
    assert got.unexpected_keys == [] and np.asarray(got[0]["emb"]).shape == (5, 2)


def _restorable(sharding):
    """A pytree of every kind a save takes: containers, sharded and plain arrays, numbers, typed keys."""
    return {"params": {"w": jax.device_put(jnp_arange((8, 4)), sharding), "b": np.arange(4, dtype=np.int64)},
            "layers": [jax.numpy.ones(3, ml_dtypes.bfloat16), (2.5, True, None)], "step": 7,
            "rng": jax.random.key(5), "rbg": jax.random.split(jax.random.key(3, impl="rbg"), 2)}


def jnp_arange(shape):
    return jax.numpy.arange(int(np.prod(shape)), dtype=jax.numpy.float32).reshape(shape)


def test_without_a_target_the_saved_pytree_comes_back_in_orbaxs_containers(tmp_path):
    # (Against Orbax's own restore in tests/frameworks/test_jax.py.)
    tree = _restorable(NamedSharding(mesh("4x2"), P("x", "y")))
    gj.save(tmp_path / "ours", tree, trainer_state={"epoch": 2})
    got, trainer_state = gj.load(tmp_path / "ours")
    assert trainer_state == {"epoch": 2}
    assert jax.tree.structure(got) == jax.tree.structure({**tree, "layers": [tree["layers"][0], [2.5, True, None]]})
    assert type(got["params"]["w"]) is type(tree["params"]["w"]) and got["params"]["w"].dtype == np.float32
    assert type(got["params"]["b"]) is np.ndarray and got["params"]["b"].dtype == np.int64
    assert got["layers"][0].dtype == ml_dtypes.bfloat16 and got["layers"][1] == [2.5, True, None]
    assert [type(v) for v in got["layers"][1][:2]] == [float, bool] and type(got["step"]) is int
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(tree)):
        if jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
            assert a.dtype == b.dtype, path  # keys of their own implementation, drawing what the saved ones draw
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b)), path
    # The saved NamedSharding comes back over as many devices (here all 8, in jax.devices() order).
    assert got["params"]["w"].sharding.is_equivalent_to(tree["params"]["w"].sharding, 2)
    assert got["layers"][0].sharding.is_equivalent_to(jax.sharding.SingleDeviceSharding(DEVICES[0]), 1)
    # With a target, the trainer state is the caller's too.
    assert gj.load(tmp_path / "ours", {"step": 0}, strict=False)[1] == {"epoch": 2}


def test_metadata_describes_what_a_load_without_a_target_gives_without_reading_an_array(tmp_path):
    tree = _restorable(NamedSharding(mesh("4x2"), P("x", "y")))
    gj.save(tmp_path / "c", tree, keys={"params.w": ("w_transposed", (1, 0))})
    got, _ = gj.load(tmp_path / "c")
    for array_dir in (tmp_path / "c").glob("saves/*/arrays"):  # no array is read: there are none left
        shutil.rmtree(array_dir)
    meta = gj.metadata(tmp_path / "c")
    assert jax.tree.structure(meta) == jax.tree.structure(got)
    for (path, m), a in zip(jax.tree_util.tree_leaves_with_path(meta), jax.tree.leaves(got)):
        assert isinstance(m, jax.ShapeDtypeStruct), path
        if isinstance(a, (int, float, bool)):  # a Python number: a 0-d struct of its stored dtype
            assert m.shape == () and m.dtype in (np.int64, np.float64, np.bool_), (path, m)
            continue
        assert (m.shape, m.dtype) == (a.shape, a.dtype), path  # keys as keys of their implementation
        if isinstance(a, jax.Array):
            assert m.sharding.is_equivalent_to(a.sharding, a.ndim), path
        else:
            assert m.sharding is None, path
    # A target for another layout is a tree.map away.
    other = NamedSharding(mesh("8"), P())
    like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=other), meta)
    assert jax.tree.structure(like) == jax.tree.structure(meta)
    # A checkpoint gj.save did not write: nested dicts by the keys' dots.
    w = np.zeros((4, 2), np.float32)
    gs.save({"w": gs.ShardedTensor.from_offset("layer.w", w, global_shape=(4, 2), global_offset=(0, 0))},
            tmp_path / "plain")
    plain = gj.metadata(tmp_path / "plain")
    assert plain == {"layer": {"w": jax.ShapeDtypeStruct((4, 2), np.float32)}}


def test_without_a_target_an_array_on_one_device_comes_back_on_that_device_as_in_orbax(tmp_path):
    tree = {"x": jax.device_put(jnp_arange((3, 2)), DEVICES[5]), "k": jax.device_put(jax.random.key(1), DEVICES[6]),
            "d": jnp_arange((2,))}
    assert all(isinstance(v.sharding, SingleDeviceSharding) for v in tree.values())
    gj.save(tmp_path / "c", tree)
    got, _ = gj.load(tmp_path / "c")
    for name, device in (("x", DEVICES[5]), ("k", DEVICES[6]), ("d", jax.devices()[0])):
        assert got[name].sharding == SingleDeviceSharding(device), name
    assert np.array_equal(np.asarray(got["x"]), np.asarray(tree["x"]))
    assert np.array_equal(jax.random.key_data(got["k"]), jax.random.key_data(tree["k"]))


def test_without_a_target_a_sharding_comes_back_over_the_devices_of_its_ids_as_in_orbax(tmp_path):
    # Meshes over some of the 8 devices (the last four; three, out of order): the same devices, by id.
    for n, (ids, shape) in enumerate([([4, 5, 6, 7], (2, 2)), ([2, 0, 1], (3, 1))]):
        m = Mesh(np.array([DEVICES[i] for i in ids]).reshape(shape), ("x", "y"))
        w = jax.device_put(jnp_arange((6, 4)), NamedSharding(m, P("x", "y")))
        gj.save(tmp_path / f"c{n}", {"w": w})
        got, _ = gj.load(tmp_path / f"c{n}")
        assert [d.id for d in got["w"].sharding.mesh.devices.flat] == ids
        assert got["w"].sharding.is_equivalent_to(w.sharding, 2)
        assert np.array_equal(np.asarray(got["w"]), np.asarray(w))


ELSEWHERE = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=12"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import globalshard_jax as gj
    mesh = Mesh(np.array(jax.devices()[8:12]).reshape(2, 2), ("x", "y"))
    w = jax.device_put(np.arange(24, dtype=np.float32).reshape(6, 4), NamedSharding(mesh, P("x", "y")))
    gj.save(sys.argv[1], {"w": w, "n": np.ones(3)})
    gj.save(sys.argv[1] + "_one", {"s": jax.device_put(np.arange(3, dtype=np.float32), jax.devices()[10])})
""")


def test_without_a_target_a_mesh_this_job_lacks_takes_fallback_sharding_or_is_named(tmp_path):
    # Saved by a job of 12 devices over ids 8-11, which this one (8 devices) does not have. As with
    # Orbax: the fallback_sharding given, or an error naming the leaf (not whole arrays put elsewhere).
    subprocess.run([sys.executable, "-c", ELSEWHERE, str(tmp_path / "c")], check=True, env={**os.environ})
    with pytest.raises(gs.MismatchError, match=r"'w': saved over a mesh of devices \[8, 9, 10, 11\].*"
                                               r"fallback_sharding="):
        gj.load(tmp_path / "c")
    fallback = NamedSharding(mesh("2x4"), P())
    got, _ = gj.load(tmp_path / "c", fallback_sharding=fallback)
    assert got["w"].sharding.is_equivalent_to(fallback, 2)
    assert np.array_equal(np.asarray(got["w"]), np.arange(24, dtype=np.float32).reshape(6, 4))
    assert isinstance(got["n"], np.ndarray)
    with pytest.raises(gs.LayoutError, match="fallback_sharding is for a load without a target"):
        gj.load(tmp_path / "c", {"w": got["w"]}, fallback_sharding=fallback)
    # An array on one device, id 10: the same.
    with pytest.raises(gs.MismatchError, match=r"'s': saved on device 10, which this job does not have.*"
                                               r"fallback_sharding="):
        gj.load(tmp_path / "c_one")
    got, _ = gj.load(tmp_path / "c_one", fallback_sharding=SingleDeviceSharding(DEVICES[3]))
    assert got["s"].sharding == SingleDeviceSharding(DEVICES[3]) and got["s"].tolist() == [0, 1, 2]


def test_without_a_target_a_mesh_saved_without_its_device_ids_is_laid_over_jax_devices(tmp_path, monkeypatch):
    # A file written before the ids were recorded: as Orbax without them, jax.devices() in order when
    # there are as many; else the fallback or an error.
    import globalshard_jax.tree as tree

    real = tree._leaf

    def without_ids(*args, **kwargs):
        out = real(*args, **kwargs)
        out.get("mesh", {}).pop("devices", None)
        return out

    monkeypatch.setattr(tree, "_leaf", without_ids)
    reversed_mesh = Mesh(np.array(DEVICES[::-1]).reshape(2, 4), ("x", "y"))
    gj.save(tmp_path / "c8", {"w": jax.device_put(jnp_arange((4, 8)), NamedSharding(reversed_mesh, P("x", "y")))})
    gj.save(tmp_path / "c3", {"w": jax.device_put(jnp_arange((6, 2)), NamedSharding(mesh("3"), P("x")))})
    monkeypatch.undo()
    got, _ = gj.load(tmp_path / "c8")
    assert [d.id for d in got["w"].sharding.mesh.devices.flat] == [d.id for d in DEVICES]
    assert np.array_equal(np.asarray(got["w"]), np.asarray(jnp_arange((4, 8))))
    with pytest.raises(gs.MismatchError, match=r"'w': saved over a mesh of 3 devices"):
        gj.load(tmp_path / "c3")


class _Adam(NamedTuple):
    count: Any
    mu: Any


class _Empty(NamedTuple):
    pass


def test_without_a_target_other_nodes_are_dicts_and_stored_keys_their_own(tmp_path):
    # NamedTuples (optax's states are) as dicts of their fields, an empty one (optax's EmptyState) as None;
    # a leaf saved under another key, transposed, back under its own in its own axis order.
    kernel = jax.device_put(jnp_arange((2, 8)), NamedSharding(mesh("2x4"), P("x", "y")))
    state = (_Adam(count=jax.numpy.int32(3), mu={"kernel": kernel}), _Empty())
    gj.save(tmp_path / "c", {"opt": state, "fc": {"kernel": kernel}}, keys={"fc.kernel": ("fc.weight", (1, 0))})
    assert gs.read_metadata(tmp_path / "c").tensors["fc.weight"].global_shape == (8, 2)  # stored transposed
    got, _ = gj.load(tmp_path / "c")
    assert np.array_equal(np.asarray(got["fc"]["kernel"]), np.asarray(kernel))
    assert got["fc"]["kernel"].sharding.is_equivalent_to(kernel.sharding, 2)
    assert got["opt"][1] is None and set(got["opt"][0]) == {"count", "mu"} and int(got["opt"][0]["count"]) == 3
    assert np.array_equal(np.asarray(got["opt"][0]["mu"]["kernel"]), np.asarray(kernel))


def test_without_a_target_a_checkpoint_gj_save_did_not_write_is_nested_dicts(tmp_path):
    # A torch-style checkpoint (the core's save): host arrays, keys split at the dots.
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    gs.save({"w": gs.ShardedTensor.from_offset("fc.weight", w, global_shape=(2, 3), global_offset=(0, 0)),
             "s": gs.ShardedTensor.from_offset("step", np.array(3, np.int64), global_shape=(), global_offset=())},
            tmp_path / "c", trainer_state={"epoch": 1})
    got, trainer_state = gj.load(tmp_path / "c")
    assert trainer_state == {"epoch": 1} and set(got) == {"fc", "step"}
    assert np.array_equal(got["fc"]["weight"], w) and got["step"].dtype == np.int64 and got["step"] == 3
    gs.save({"a": gs.ShardedTensor.from_offset("fc", w, global_shape=(2, 3), global_offset=(0, 0)),
             "b": gs.ShardedTensor.from_offset("fc.bias", w[0], global_shape=(3,), global_offset=(0,))}, tmp_path / "d")
    with pytest.raises(gs.LayoutError, match=r"'fc.bias' nests under 'fc'.*pass a target"):
        gj.load(tmp_path / "d")


def test_the_trainer_state_member_holding_the_pytree_is_refused_to_callers(tmp_path):
    with pytest.raises(gs.LayoutError, match="'globalshard_jax'"):
        gj.save(tmp_path / "c", {"w": np.ones(2)}, trainer_state={"globalshard_jax": 1})
    gj.save(tmp_path / "c", {"w": np.ones(2)})
    with pytest.raises(gs.LayoutError, match="keys="):
        gj.load(tmp_path / "c", keys={"w": "v"})


_LEAVES = st.one_of(
    st.integers(-2**31, 2**31 - 1), st.floats(allow_nan=False, width=32), st.booleans(),
    st.builds(lambda n, k: np.arange(n, dtype=k), st.integers(0, 4), st.sampled_from([np.int64, np.float32])),
    st.builds(lambda n: jax.numpy.arange(n, dtype=jax.numpy.float32), st.integers(1, 4)))
_TREES = st.recursive(st.one_of(_LEAVES, st.none()), lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
    st.dictionaries(st.text("ab_.", min_size=1, max_size=3), kids, max_size=3)), max_leaves=8)


def _as_orbax(tree):
    """``tree`` in the containers Orbax's restore without a target gives: tuples as lists (``()`` kept)."""
    if isinstance(tree, (list, tuple)):
        return [_as_orbax(v) for v in tree] if tree or isinstance(tree, list) else ()
    return {k: _as_orbax(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


@settings(max_examples=30, deadline=None)
@given(tree=_TREES)
def test_property_a_saved_pytree_comes_back_whole_without_a_target(tmp_path_factory, tree):
    # Any nesting of dicts, lists, tuples and None over numbers and arrays: the same containers (as
    # Orbax gives them), the same kinds of leaves, the same values. (Keys with dots included.)
    path = tmp_path_factory.mktemp("whole")
    try:
        gj.save(path, {"t": tree})
    except gs.LayoutError as e:  # two paths that join to one key ("a.b" and "a" > "b") are refused by the save
        assert "join to the same key" in str(e)
        return
    (got, _) = gj.load(path)
    assert jax.tree.structure(got) == jax.tree.structure({"t": _as_orbax(tree)})
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves({"t": tree})):
        assert type(a) is type(b) and np.asarray(a).dtype == np.asarray(b).dtype
        assert np.array_equal(np.asarray(a), np.asarray(b))
