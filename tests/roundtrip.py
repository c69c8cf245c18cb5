"""Drawn checkpoints of any layout and the check that a load gave back their
global values: shared by the round-trip properties of core/, io/ and the packs."""

import numpy as np
from hypothesis import strategies as st

import globalshard as gs
from globalshard import SUPPORTED_DTYPES, is_exact_cast
from globalshard.testing.strategies import layouts, make_shard, random_values, shapes


@st.composite
def checkpoints(draw):
    """1-3 tensors, each with a random dtype, shape, saving layout and loading layout."""
    tensors = []
    for n in range(draw(st.integers(1, 3))):
        shape = draw(shapes(min_dims=0, max_dims=3, max_side=7))
        dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
        widen = [d for d in SUPPORTED_DTYPES if is_exact_cast(dtype, d)]
        tensors.append({
            "key": f"t{n}.w",
            "value": random_values(shape, dtype, draw(st.integers(0, 2**32))),
            "save": draw(layouts(shape)),
            "load": draw(layouts(shape)),
            "target_dtype": draw(st.sampled_from(widen)),
        })
    return tensors


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes: NaN payloads and signed zeros included."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def shards_of(tensors):
    """The saving shards and the (junk-filled) loading targets of drawn ``checkpoints()``."""
    state, targets = {}, {}
    for t in tensors:
        for i, spec in enumerate(t["save"]):
            state[f"{t['key']}/save{i}"] = make_shard(t["key"], spec, t["value"], seed=i)
        for i, spec in enumerate(t["load"]):
            targets[f"{t['key']}/load{i}"] = make_shard(t["key"], spec, t["value"], dtype=t["target_dtype"],
                                                        fill="junk", seed=1000 + i)
    return state, targets


def assert_loaded(tensors, targets, directory):
    """Every target holds its part of the global values, and read_array gives them back whole."""
    for t in tensors:
        value = t["value"]
        for i in range(len(t["load"])):
            target = targets[f"{t['key']}/load{i}"]
            expected = np.zeros(target.data.shape, target.data.dtype)
            for r in target.regions:
                part = np.empty(r.global_box.shape, target.data.dtype)
                gs.dtypes.cast_into(part, value[r.global_box.slices])
                expected[r.local_box.slices] = part
            # Bit-exact: NaN payloads and signed zeros included (a widened target is
            # compared with the same exact conversion of the global values).
            assert _bits_equal(target.data, expected), (t["key"], i, target.data, expected)
        # A consumer reading the whole array gets the global array back.
        assert _bits_equal(gs.read_array(directory, t["key"]), value)
