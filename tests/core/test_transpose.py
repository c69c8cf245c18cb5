"""Property: a target may hold the stored array with its axes in another order
(ShardedTensor.transposed): loading fills it with numpy.transpose of the
global array, saving through it stores the transposed global array, under
any layouts on both sides."""

import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import globalshard as gs
from globalshard.testing.strategies import layouts, make_shard, random_values, shapes


@st.composite
def cases(draw):
    shape = draw(shapes(min_dims=0, max_dims=3, max_side=6))
    axes = tuple(draw(st.permutations(range(len(shape)))))
    value = random_values(shape, draw(st.sampled_from(["float32", "bfloat16", "int16"])), draw(st.integers(0, 9)))
    permuted = tuple(shape[a] for a in axes)
    return value, axes, draw(layouts(shape)), draw(layouts(permuted, replicas=False))


@given(cases())
def test_property_load_into_a_transposed_target(case):
    value, axes, save_specs, load_specs = case
    directory = tempfile.mkdtemp()
    try:
        gs.save({f"s{i}": make_shard("w", spec, value, seed=i) for i, spec in enumerate(save_specs)}, directory)
        want = np.transpose(value, axes) if value.ndim else value
        targets = [make_shard("w", spec, want, fill="junk", seed=100 + i) for i, spec in enumerate(load_specs)]
        gs.load({f"t{i}": t.transposed(axes) for i, t in enumerate(targets)}, directory)
        for t in targets:
            for r in t.regions:
                assert t.data[r.local_box.slices].tobytes() == want[r.global_box.slices].tobytes()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@given(cases())
def test_property_save_from_a_transposed_source(case):
    value, axes, _, specs = case
    directory = tempfile.mkdtemp()
    try:
        held = np.transpose(value, axes) if value.ndim else value  # e.g. a Flax kernel of a torch weight
        gs.save({f"s{i}": make_shard("w", spec, held, seed=i).transposed(axes) for i, spec in enumerate(specs)},
                directory)
        assert gs.read_array(directory, "w").tobytes() == value.tobytes()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_not_a_permutation_is_refused():
    t = gs.ShardedTensor.from_offset("w", np.zeros((2, 3)), global_shape=(2, 3), global_offset=(0, 0))
    with pytest.raises(gs.LayoutError, match=r"axes \(0, 0\) is not a permutation"):
        t.transposed((0, 0))
