"""spec/vectors/ read by the library and by spec/reference_reader.py (written
from the spec alone): both give the expected arrays, bit for bit, for every
vector and for boxes cut anywhere; both refuse every invalid document."""

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo import SPEC

import globalshard as gs
from globalshard.dtypes import numpy_dtype

VECTORS = os.path.join(SPEC, "vectors")
NAMES = sorted(d for d in os.listdir(VECTORS) if os.path.isdir(os.path.join(VECTORS, d)))


def _reference():
    spec = importlib.util.spec_from_file_location("reference_reader", os.path.join(SPEC, "reference_reader.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _reference()


def expected(name):
    with open(os.path.join(VECTORS, name, "expected.json")) as f:
        doc = json.load(f)
    out = {}
    for k, e in doc.items():
        dt = numpy_dtype(e["dtype"]).newbyteorder("<")
        out[k] = np.frombuffer(bytes.fromhex(e["hex"]), dt).reshape(e["shape"]).astype(dt.newbyteorder("="))
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_the_reference_reader_imports_no_globalshard():
    with open(os.path.join(SPEC, "reference_reader.py")) as f:
        text = f.read()
    assert "globalshard" not in [line.split()[1] for line in text.splitlines() if line.startswith(("import", "from"))]


def test_every_vector_is_listed_in_the_generator():
    with open(os.path.join(VECTORS, "generate.py")) as f:
        text = f.read()
    assert NAMES and all(f"def vector_{n}(" in text for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_both_readers_give_the_expected_arrays(name):
    path = os.path.join(VECTORS, name)
    ref = REF.Checkpoint(path)
    want = expected(name)
    assert set(gs.read_metadata(path).tensors) == set(ref.tensors) == set(want)
    for key, value in want.items():
        assert same_bits(gs.read_array(path, key), value), key
        assert same_bits(ref.read(key), value), key
    assert ref.trainer_state == gs.read_trainer_state(path) or name == "scalars_and_empty"


def test_the_trainer_state_vector_holds_null_and_a_tagged_nan():
    path = os.path.join(VECTORS, "scalars_and_empty")
    lib = gs.read_trainer_state(path)
    assert lib["lr_scheduler"] is None and lib["optimizer"] is None and np.isnan(lib["loss"])
    ref = REF.Checkpoint(path).trainer_state  # the reference reader keeps the tag as written
    assert ref["loss"] == {"$float": "nan"} and ref["lr_scheduler"] is None


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NAMES), st.data())
def test_property_any_box_agrees(name, data):
    path = os.path.join(VECTORS, name)
    want = expected(name)
    key = data.draw(st.sampled_from(sorted(want)))
    shape = want[key].shape
    lo = [data.draw(st.integers(0, s)) for s in shape]
    hi = [data.draw(st.integers(a, s)) for a, s in zip(lo, shape)]
    box = gs.Box(tuple(lo), tuple(h - a for a, h in zip(lo, hi)))
    expect = want[key][box.slices]
    assert same_bits(gs.read_array(path, key, box), expect)
    assert same_bits(REF.Checkpoint(path).read(key, lo, list(box.shape)), expect)


INVALID = os.path.join(SPEC, "examples", "invalid")


@pytest.mark.parametrize("doc", sorted(f for f in os.listdir(INVALID) if f != "cases.json"))
def test_both_readers_refuse_every_invalid_document(tmp_path, doc):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(SPEC, "examples", "checkpoint"), root)
    shutil.copy(os.path.join(INVALID, doc), root / "metadata.json")
    with pytest.raises(gs.GlobalShardError):
        ckpt = gs.Checkpoint(root)
        for key in ckpt.metadata.tensors:
            gs.read_array(root, key)
    with pytest.raises(REF.Invalid):
        ref = REF.Checkpoint(root)
        for key in ref.tensors:
            ref.read(key)


@pytest.mark.parametrize("damage", ["attributes", "crc", "negative_zero"])
def test_both_readers_refuse_damage_the_spec_names(tmp_path, damage):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(VECTORS, "packed"), root)
    meta = gs.read_metadata(root)
    region = meta.tensors["qkv"].regions[1]
    if damage == "attributes":  # an array that says it is another box
        zj = root / region.path / "zarr.json"
        doc = json.loads(zj.read_text())
        doc["attributes"]["globalshard"]["offset"] = [0, 0]
        zj.write_text(json.dumps(doc))
    elif damage == "crc":
        chunk = root / region.path / "c" / "0" / "0"
        data = bytearray(chunk.read_bytes())
        data[0] ^= 1
        chunk.write_bytes(bytes(data))
    else:
        text = (root / "metadata.json").read_text()
        assert '"offset":[0,0]' in text
        (root / "metadata.json").write_text(text.replace('"offset":[0,0]', '"offset":[-0,0]', 1))
    with pytest.raises(gs.GlobalShardError):
        gs.read_array(root, "qkv")
    with pytest.raises(REF.Invalid):
        REF.Checkpoint(root).read("qkv")


def test_the_unbuffered_vector_places_every_inner_chunk_on_a_4096_byte_boundary():
    """What the vector is for: shards whose chunks lie apart, with zeros between
    (spec section 5), which a reader finds through the index alone."""
    path = os.path.join(VECTORS, "unbuffered")
    shards = 0
    for region in (r for t in gs.read_metadata(path).tensors.values() for r in t.regions):
        doc = json.load(open(os.path.join(path, region.path, "zarr.json")))
        if doc["codecs"][0]["name"] != "sharding_indexed":
            continue
        inner = doc["codecs"][0]["configuration"]["chunk_shape"]
        count = int(np.prod([-(-s // c) for s, c in zip(doc["shape"], inner)]))
        data = open(os.path.join(path, region.path, "c", *["0"] * len(inner)), "rb").read()
        index = np.frombuffer(data[len(data) - 16 * count - 4:-4], "<u8").reshape(count, 2)
        assert count > 1 and (index[:, 0] % 4096 == 0).all() and (index[1:, 0] > index[:-1, 0] + index[:-1, 1]).all()
        shards += 1
    assert shards == 6
