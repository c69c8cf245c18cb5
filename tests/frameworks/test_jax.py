"""JAX users' real objects, with Orbax as the oracle: a Flax NNX model (its
kernels annotated for TP, a Dropout whose typed PRNG key and counter are
state) and its ``nnx.Optimizer`` (optax AdamW), and an optax chain over a
plain parameter dict (clipping, ``inject_hyperparams``, a schedule). Trained
on an 8-device CPU mesh at dp=2 x tp=4, saved by ``globalshard_jax.save`` and
by Orbax's ``StandardCheckpointer``, then restored by each onto other meshes
the way Flax documents it (``nnx.eval_shape`` inside ``jax.set_mesh``): every
leaf, its dtype and its sharding equal Orbax's restore, and training goes on
from either with the same losses, within 1e-6 of the run that never
stopped (a dropout key restored wrong moves them by far more). And a Linen
``TrainState`` saved as ``create`` returns it (its step a Python int),
restored from ``jax.eval_shape(create)`` as Orbax restores it."""

import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_processes import two_processes  # noqa: E402

import globalshard as gs  # noqa: E402
import globalshard_jax as gj  # noqa: E402

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (forced CPU) devices")

SAVED_AT = (2, 4)  # dp x tp
LOADED_AT = [(1, 8), (4, 2), (8, 1), (1, 1)]  # (1, 1): one device, as an export or an evaluation
BATCH = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)


def mesh(dp, tp):
    return Mesh(np.array(jax.devices()[:dp * tp]).reshape(dp, tp), ("dp", "tp"))


class MLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, (None, "tp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.normal(), ("tp",)), rngs=rngs)
        self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(init, ("tp", None)), rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.down(self.drop(nnx.gelu(self.up(x)))))


def make_nnx():
    model = MLP(nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, optax.adamw(3e-2, weight_decay=0.1), wrt=nnx.Param)


@nnx.jit
def nnx_step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: ((m(BATCH) - 0.5) ** 2).mean())(model)
    opt.update(model, grads)
    return loss


def same_leaves(got, want):
    """Every leaf of two restored pytrees: dtype, sharding and bytes equal (typed keys by their key data)."""
    flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
    flat_want, tree_want = jax.tree_util.tree_flatten(want)
    assert tree_got == tree_want
    for (path, a), b in zip(flat_got, flat_want):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim), name
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


def concrete(abstract, m):
    """Orbax 0.12's StandardCheckpointer cannot restore onto an AbstractMesh (jax's ValueError); its
    targets get the concrete mesh, as its v1 loader would do itself."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, a.sharding.spec)),
                        abstract)


@pytest.fixture(scope="module")
def nnx_saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("nnx")
    with jax.set_mesh(mesh(*SAVED_AT)):
        model, opt = make_nnx()
        for _ in range(3):
            nnx_step(model, opt)
        state = nnx.state((model, opt))
        assert state[0]["up"]["kernel"].value.sharding.spec == P(None, "tp")
        gj.save(root / "gs", state, trainer_state={"step": 3})
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(root / "orbax", state)
        checkpointer.wait_until_finished()
        after = [float(nnx_step(model, opt)) for _ in range(3)]
    return root, after


@pytest.mark.parametrize("dp,tp", LOADED_AT, ids=lambda n: str(n))
def test_a_flax_nnx_model_and_optimizer_reshard_as_orbax_restores_them(nnx_saved, dp, tp):
    root, after = nnx_saved
    m = mesh(dp, tp)
    with jax.set_mesh(m):
        graphdef, abstract = nnx.split(nnx.eval_shape(make_nnx))  # Flax's documented restore
        restored, trainer_state = gj.load(root / "gs", abstract)
        oracle = ocp.StandardCheckpointer().restore(root / "orbax", concrete(abstract, m))
        assert trainer_state == {"step": 3}
        same_leaves(restored, oracle)
        kernel = restored[0]["up"]["kernel"].value
        assert kernel.sharding.mesh == m and kernel.sharding.spec == P(None, "tp")
        assert jax.dtypes.issubdtype(restored[0]["drop"]["rngs"]["key"].value.dtype, jax.dtypes.prng_key)
        model, opt = nnx.merge(graphdef, restored)
        ours = [float(nnx_step(model, opt)) for _ in range(3)]
        model, opt = nnx.merge(graphdef, oracle)
        theirs = [float(nnx_step(model, opt)) for _ in range(3)]
    assert ours == theirs
    np.testing.assert_allclose(ours, after, rtol=0, atol=1e-6)


# ----------------------------------------------------------------- optax over a plain dict


def optax_tx():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=20)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.05))


def optax_params(m):
    rng = np.random.default_rng(1)
    specs = {"embed": P("tp", None), "w1": P(None, "tp"), "w2": P("tp", None), "scale": P()}
    shapes = {"embed": (64, 16), "w1": (16, 32), "w2": (32, 16), "scale": (16,)}
    return {k: jax.device_put(rng.standard_normal(shapes[k]).astype(np.float32), NamedSharding(m, specs[k]))
            for k in shapes}


def optax_loss(params):
    h = jax.nn.relu(params["embed"][:8] @ params["w1"]) @ params["w2"]
    return ((h * params["scale"]) ** 2).mean()


@jax.jit
def optax_step(params, opt_state):
    loss, grads = jax.value_and_grad(optax_loss)(params)
    updates, opt_state = optax_tx().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@pytest.fixture(scope="module")
def optax_saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("optax")
    with jax.set_mesh(mesh(*SAVED_AT)):
        params = optax_params(mesh(*SAVED_AT))
        opt_state = optax_tx().init(params)
        for _ in range(3):
            params, opt_state, _ = optax_step(params, opt_state)
        state = {"params": params, "opt_state": opt_state}
        gj.save(root / "gs", state)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(root / "orbax", state)
        checkpointer.wait_until_finished()
        after = []
        for _ in range(3):
            params, opt_state, loss = optax_step(params, opt_state)
            after.append(float(loss))
    return root, after


@pytest.mark.parametrize("dp,tp", LOADED_AT, ids=lambda n: str(n))
def test_an_optax_chain_over_a_parameter_dict_reshards_as_orbax_restores_it(optax_saved, dp, tp):
    root, after = optax_saved
    keys = set(gs.read_metadata(root / "gs").tensors)
    assert {"opt_state.1.count", "opt_state.1.hyperparams.learning_rate", "opt_state.1.inner_state.0.mu.w1"} <= keys
    m = mesh(dp, tp)

    def target(a):  # every array cut along its first axis over tp where it divides, as a user might
        return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                    sharding=NamedSharding(m, P("tp") if a.ndim and a.shape[0] % tp == 0 else P()))

    with jax.set_mesh(m):
        abstract = jax.tree.map(target, jax.eval_shape(
            lambda: {"params": optax_params(m), "opt_state": optax_tx().init(optax_params(m))}))
        restored, _ = gj.load(root / "gs", abstract)
        same_leaves(restored, ocp.StandardCheckpointer().restore(root / "orbax", abstract))
        params, opt_state = restored["params"], restored["opt_state"]
        ours = []
        for _ in range(3):
            params, opt_state, loss = optax_step(params, opt_state)
            ours.append(float(loss))
    np.testing.assert_allclose(ours, after, rtol=1e-6, atol=0)


def _restored_without_a_target_by_both(tmp_path, tree):
    """``tree`` saved by gj.save and by Orbax, then restored by each without a target: (ours, Orbax's)."""
    gj.save(tmp_path / "gs", tree)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", tree)
        checkpointer.wait_until_finished()
        theirs = checkpointer.restore(tmp_path / "orbax")
    ours, _ = gj.load(tmp_path / "gs")
    return ours, theirs


def test_a_pytree_of_every_leaf_kind_restored_without_a_target_holds_what_orbax_restores(tmp_path):
    # Sharded jax arrays, numpy arrays, bf16, Python numbers, None, a tuple in a list: Orbax's
    # restore(path) with no target against gj.load(path), same tree, leaf types, dtypes, values, shardings.
    m = mesh(*SAVED_AT)
    tree = {"params": {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(m, P(None, "tp"))),
                       "b": np.arange(4, dtype=np.int64)},
            "layers": [jnp.ones(3, jnp.bfloat16), (2.5, True, None), ()], "step": 7}
    ours, theirs = _restored_without_a_target_by_both(tmp_path, tree)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert ours["layers"][1:] == theirs["layers"][1:] == [[2.5, True, None], ()]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
        assert type(a) is type(b) and np.asarray(a).dtype == np.asarray(b).dtype, jax.tree_util.keystr(path)
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
        if isinstance(a, jax.Array):  # the saved sharding, as Orbax restores it
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), jax.tree_util.keystr(path)
    assert isinstance(ours["params"]["w"].sharding, NamedSharding)


def test_a_sharding_over_some_devices_comes_back_without_a_target_where_orbax_puts_it(tmp_path):
    # A mesh over the last 4 of the 8 devices, and an array on device 6 alone: Orbax restores them over
    # the same device ids; so do we.
    m = Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("dp", "tp"))
    tree = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(m, P("dp", "tp"))),
            "s": jax.device_put(jnp.arange(3.0), jax.devices()[6])}
    ours, theirs = _restored_without_a_target_by_both(tmp_path, tree)
    assert ours["w"].sharding.is_equivalent_to(theirs["w"].sharding, 2)
    assert [d.id for d in ours["w"].sharding.mesh.devices.flat] == [4, 5, 6, 7]
    assert ours["s"].sharding == theirs["s"].sharding == SingleDeviceSharding(jax.devices()[6])
    for k in tree:
        assert np.array_equal(np.asarray(ours[k]), np.asarray(theirs[k]))


ELSEWHERE = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=12"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import globalshard_jax as gj
mesh = Mesh(np.array(jax.devices()[8:12]).reshape(2, 2), ("dp", "tp"))
trees = {"": {"w": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("dp", "tp")))},
         "_one": {"s": jax.device_put(np.arange(3, dtype=np.float32), jax.devices()[10])}}
for suffix, tree in trees.items():
    gj.save(sys.argv[1] + "/gs" + suffix, tree)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(sys.argv[1] + "/orbax" + suffix, tree)
        checkpointer.wait_until_finished()
"""


def test_a_mesh_this_job_lacks_restored_without_a_target_fails_or_takes_the_fallback_as_in_orbax(tmp_path):
    # Saved by a job of 12 devices over ids 8-11, which this one (8) lacks: Orbax calls it a topology
    # mismatch and so do we (naming the leaf); given fallback_sharding, each restores with it.
    import os
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", ELSEWHERE, str(tmp_path)], check=True, env={**os.environ})
    fallback = NamedSharding(mesh(2, 4), P())
    checkpointer = ocp.StandardCheckpointer()
    with pytest.raises(ValueError, match="Topology mismatch"):
        checkpointer.restore(tmp_path / "orbax")
    with pytest.raises(gs.MismatchError, match="'w': saved over a mesh of devices"):
        gj.load(tmp_path / "gs")
    theirs = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(  # StandardCheckpointer takes no args=
        tmp_path / "orbax", args=ocp.args.StandardRestore(fallback_sharding=fallback))
    ours, _ = gj.load(tmp_path / "gs", fallback_sharding=fallback)
    assert np.array_equal(np.asarray(ours["w"]), np.asarray(theirs["w"]))
    assert ours["w"].sharding.is_equivalent_to(theirs["w"].sharding, 2)
    assert ours["w"].sharding.is_equivalent_to(fallback, 2)
    # An array on device 10 alone: refused by both, and restored by both with the fallback.
    with pytest.raises(ValueError, match="Topology mismatch"):
        checkpointer.restore(tmp_path / "orbax_one")
    with pytest.raises(gs.MismatchError, match="'s': saved on device 10"):
        gj.load(tmp_path / "gs_one")
    one = SingleDeviceSharding(jax.devices()[3])
    theirs = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        tmp_path / "orbax_one", args=ocp.args.StandardRestore(fallback_sharding=one))
    ours, _ = gj.load(tmp_path / "gs_one", fallback_sharding=one)
    assert ours["s"].sharding == theirs["s"].sharding == one
    assert np.array_equal(np.asarray(ours["s"]), np.asarray(theirs["s"]))


def test_an_optax_state_restored_without_a_target_holds_what_orbax_restores(optax_saved):
    # Orbax's restore(path) with no target, against gj.load(path): the same tree (optax's chain of
    # NamedTuples, EmptyStates included), the same leaves of the same types and values, whole.
    root, _ = optax_saved
    theirs = ocp.StandardCheckpointer().restore(root / "orbax")
    ours, _ = gj.load(root / "gs")
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


# ----------------------------------------------------------------- a Linen TrainState


def test_a_linen_train_state_saved_at_step_0_resumes_as_orbax_resumes_it(tmp_path):
    # TrainState.create holds step as the Python int 0 (stored as int64); jax.eval_shape of the state asks
    # for int32: the first checkpoint of a run, resumed as Flax documents it.
    linen = pytest.importorskip("flax.linen")
    train_state = pytest.importorskip("flax.training.train_state")

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(4)(linen.relu(linen.Dense(32)(x)))

    net = Net()

    def create():
        return train_state.TrainState.create(apply_fn=net.apply, params=net.init(jax.random.key(0), BATCH),
                                             tx=optax.adamw(1e-2))

    @jax.jit
    def step(state):
        grads = jax.grad(lambda p: (state.apply_fn(p, BATCH) ** 2).mean())(state.params)
        return state.apply_gradients(grads=grads)

    state = create()
    assert type(state.step) is int
    gj.save(tmp_path / "gs", state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", state)
    checkpointer.wait_until_finished()
    m = mesh(*SAVED_AT)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        m, P(None, "tp") if a.ndim == 2 and a.shape[1] % 4 == 0 else P())), jax.eval_shape(create))
    assert abstract.step.dtype == np.int32
    restored, _ = gj.load(tmp_path / "gs", abstract)
    oracle = checkpointer.restore(tmp_path / "orbax", abstract)
    same_leaves(restored, oracle)
    for _ in range(2):
        state, restored, oracle = step(state), step(restored), step(oracle)
    assert int(restored.step) == int(oracle.step) == 2
    same_leaves(restored, oracle)
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_orbaxs_checkpoint_manager_keeps_steps_of_globalshard_items_as_of_its_own(tmp_path, background):
    # An optax state trained at dp=2 x tp=4 by a step that donates it, saved each step by Orbax's
    # CheckpointManager (asynchronous or not, 2 kept) as a globalshard item beside a JSON one, and by a second
    # manager with Orbax's own StandardSave; restored at tp=4 (4 devices) and without a target by each.
    import globalshard_jax.orbax as gjo

    donating = jax.jit(lambda p, s: optax_step(p, s), donate_argnums=(0, 1))

    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=background)
    managers = {"gs": ocp.CheckpointManager(tmp_path / "gs", options=options),
                "orbax": ocp.CheckpointManager(tmp_path / "orbax", options=options)}
    with jax.set_mesh(mesh(*SAVED_AT)):
        params = optax_params(mesh(*SAVED_AT))
        opt_state = optax_tx().init(params)
        for step in range(1, 4):
            params, opt_state, _ = donating(params, opt_state)  # the saves in flight hold their own copies
            state = {"params": params, "opt_state": opt_state}
            for name, manager in managers.items():
                item = gjo.Save(state, trainer_state={"step": step}) if name == "gs" else ocp.args.StandardSave(state)
                assert manager.save(step, args=ocp.args.Composite(state=item, meta=ocp.args.JsonSave({"step": step})))
        for manager in managers.values():
            manager.wait_until_finished()
    assert [m.all_steps() for m in managers.values()] == [[2, 3], [2, 3]]
    assert gs.read_metadata(tmp_path / "gs" / "3" / "state").tensors  # the item is a globalshard checkpoint
    m = mesh(1, 4)
    with jax.set_mesh(m):
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(m, P("tp") if a.ndim and a.shape[0] % 4 == 0 else P())),
            jax.eval_shape(lambda: {"params": optax_params(m), "opt_state": optax_tx().init(optax_params(m))}))
        ours = managers["gs"].restore(3, args=ocp.args.Composite(state=gjo.Restore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        theirs = managers["orbax"].restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      meta=ocp.args.JsonRestore()))
        same_leaves(ours.state, theirs.state)
        assert ours.meta == theirs.meta == {"step": 3}
    whole = managers["gs"].restore(3, args=ocp.args.Composite(state=gjo.Restore()))
    same_leaves(whole.state, managers["orbax"].restore(3, args=ocp.args.Composite(
        state=ocp.args.StandardRestore())).state)
    # item_metadata: the same tree, shapes and dtypes as Orbax's (before: None for our items).
    ours_meta, theirs_meta = (managers[n].item_metadata(3).state for n in ("gs", "orbax"))
    assert jax.tree.structure(ours_meta) == jax.tree.structure(theirs_meta.tree)
    for m, t in zip(jax.tree.leaves(ours_meta), jax.tree.leaves(theirs_meta.tree)):
        assert (m.shape, m.dtype) == (tuple(t.shape), t.dtype), (m, t)
    for manager in managers.values():
        manager.close()


def test_orbaxs_checkpointer_saves_and_restores_through_the_handler_alone(tmp_path):
    import globalshard_jax.orbax as gjo

    tree = {"w": jnp.arange(8.0).reshape(2, 4), "step": 3}
    with ocp.Checkpointer(gjo.Handler()) as checkpointer:
        checkpointer.save(tmp_path / "c", args=gjo.Save(tree, trainer_state={"note": "x"}))
        restored = checkpointer.restore(tmp_path / "c", args=gjo.Restore())
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(tree["w"])) and restored["step"] == 3
    assert gs.Checkpoint(tmp_path / "c").trainer_state["note"] == "x"


MULTIHOST = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import orbax.checkpoint as ocp
    import globalshard as gs, globalshard_jax.orbax as gjo

    written = gs.save
    def late(state, path, **kwargs):  # process 0 writes item "opt" late, process 1 "params": orders differ
        if str(path).endswith(("opt", "params")[jax.process_index()]):
            time.sleep(0.3)
        return written(state, path, **kwargs)
    gs.save = late

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
    def tree(step, sharding):
        def leaf(i, shape):
            value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100 * step + i
            return jax.make_array_from_callback(shape, sharding, lambda idx: value[idx])
        return {"params": {"w": leaf(0, (8, 12)), "b": leaf(1, (4, 4))}, "opt": {"mu": leaf(2, (8, 12))}}
    manager = ocp.CheckpointManager(sys.argv[3], options=ocp.CheckpointManagerOptions(max_to_keep=2))
    for step in range(1, 4):
        state = tree(step, NamedSharding(mesh, P("dp", "tp")))
        manager.save(step, args=ocp.args.Composite(params=gjo.Save(state["params"]), opt=gjo.Save(state["opt"]),
                                                   orbax=ocp.args.StandardSave(state),
                                                   meta=ocp.args.JsonSave({"step": step})))
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3], manager.all_steps()
    other = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P(None, "x"))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=other), tree(0, other))
    got = manager.restore(3, args=ocp.args.Composite(params=gjo.Restore(abstract["params"]),
                                                     opt=gjo.Restore(abstract["opt"]),
                                                     orbax=ocp.args.StandardRestore(abstract)))
    for ours, theirs in [(got.params, got.orbax["params"]), (got.opt, got.orbax["opt"])]:
        for k in theirs:
            assert ours[k].sharding == theirs[k].sharding == other, k
            for a, b in zip(ours[k].addressable_shards, theirs[k].addressable_shards):
                assert a.index == b.index and np.array_equal(np.asarray(a.data), np.asarray(b.data)), k
    manager.close()
    print("ok", jax.process_index())
""")


def test_orbax_items_saved_at_once_by_two_processes_hold_what_orbax_holds(tmp_path):
    # Orbax writes a step's items in threads, in an order that differs between processes: each of our items
    # exchanges in its own namespace. Before, both items' exchanges shared one numbering, and one process's
    # "params" met the other's "opt" (messages read as others', or a hang).
    two_processes(tmp_path, MULTIHOST, tmp_path / "ckpt")
