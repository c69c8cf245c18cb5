import copy
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import grid_boxes, shapes

from globalshard import SUPPORTED_DTYPES, Box, MetadataError, StoredRegion, TensorMetadata
from globalshard.dtypes import numpy_dtype
from globalshard.metadata import (
    Metadata,
    TrainerStateRef,
    check_relative_path,
    dump_trainer_state,
    parse_metadata,
    parse_trainer_state,
)

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "spec", "examples")


def _example() -> dict:
    with open(os.path.join(EXAMPLES, "metadata.json")) as f:
        return json.load(f)


@st.composite
def metadata_docs(draw):
    tensors = {}
    for n, key in enumerate(draw(st.lists(st.text(min_size=1, max_size=12), max_size=4, unique=True))):
        shape = draw(shapes(min_dims=0, max_side=6))
        dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
        boxes = [b for b in draw(grid_boxes(shape)) if not b.is_empty]
        size = numpy_dtype(dtype).itemsize
        regions = tuple(StoredRegion(b, f"arrays/t{n}/{i}", b.volume * size) for i, b in enumerate(boxes))
        tensors[key] = TensorMetadata(dtype, shape, regions)
    ref = draw(st.none() | st.builds(TrainerStateRef, st.integers(0, 2**63 - 1),
                                     st.text("0123456789abcdef", min_size=64, max_size=64)))
    return Metadata(tensors, ref)


def _canonical(md: Metadata) -> Metadata:
    return Metadata(
        {k: TensorMetadata(t.dtype, t.global_shape, tuple(sorted(t.regions, key=lambda r: r.box.offset)))
         for k, t in md.tensors.items()},
        md.trainer_state, md.version,
    )


@given(metadata_docs())
def test_metadata_round_trip(md):
    text = md.dumps()
    parsed = parse_metadata(text)
    assert parsed == _canonical(md)
    assert parsed.dumps() == text


def _mutations():
    # Any JSON value, anywhere: the parser must answer with MetadataError or a valid model.
    leaves = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
    return st.recursive(leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                        max_leaves=6)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@given(st.data())
def test_parser_raises_only_metadata_error_on_mutated_documents(data):
    doc = _example()
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path = data.draw(st.sampled_from(paths))
        action = data.draw(st.sampled_from(["replace", "delete", "insert"]))
        if not path:
            doc = data.draw(_mutations())
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        last = path[-1]
        if action == "delete":
            del parent[last]
        elif action == "insert" and isinstance(parent, list):
            parent.insert(last, data.draw(_mutations()))
        else:
            parent[last] = data.draw(_mutations())
    text = json.dumps(doc, allow_nan=True)
    try:
        md = parse_metadata(text)
    except MetadataError:
        return
    # Whatever was accepted must be internally valid: round-trips and re-validates.
    assert parse_metadata(md.dumps()) == md


@given(st.binary(max_size=200))
def test_parser_on_arbitrary_bytes(blob):
    with pytest.raises(MetadataError):
        parse_metadata(blob)


def test_example_document_parses():
    md = parse_metadata(json.dumps(_example()))
    assert md.tensors["embedding.weight"].dtype == "bfloat16"
    assert md.tensors["layers.0.attention.qkv.weight"].global_shape == (16, 3)
    assert md.tensors["empty"].regions == ()


def _invalid_cases():
    with open(os.path.join(EXAMPLES, "invalid", "cases.json")) as f:
        return sorted(json.load(f).items())


@pytest.mark.parametrize("name,case", _invalid_cases())
def test_invalid_examples_are_rejected_naming_the_problem(name, case):
    with open(os.path.join(EXAMPLES, "invalid", f"{name}.json"), "rb") as f:
        data = f.read()
    with pytest.raises(MetadataError) as info:
        parse_metadata(data)
    assert case["expect"] in str(info.value), str(info.value)


def test_every_problem_is_reported_at_once():
    doc = _example()
    q = doc["tensors"]["layers.0.attention.qkv.weight"]
    q["dtype"] = "fp32"
    doc["tensors"]["embedding.weight"]["regions"][0]["offset"][0] = 1.5
    with pytest.raises(MetadataError) as info:
        parse_metadata(json.dumps(doc))
    text = str(info.value)
    assert '$.tensors["layers.0.attention.qkv.weight"].dtype' in text
    assert '$.tensors["embedding.weight"].regions[0].offset[0]' in text


@pytest.mark.parametrize("path", ["/abs", "a/../b", "a//b", "./a", "a\\b", "C:/x", "trainer_state.json",
                                  "metadata.json/x", "", "a/\x01", 5])
def test_bad_paths(path):
    assert check_relative_path(path) is not None


def test_nested_and_duplicate_paths_are_rejected():
    doc = _example()
    regions = doc["tensors"]["layers.0.attention.qkv.weight"]["regions"]
    regions[1]["path"] = regions[0]["path"] + "/inner"
    with pytest.raises(MetadataError, match="lies inside"):
        parse_metadata(json.dumps(doc))
    doc = _example()
    regions = doc["tensors"]["layers.0.attention.qkv.weight"]["regions"]
    regions[1]["path"] = regions[0]["path"]
    with pytest.raises(MetadataError, match="also used by"):
        parse_metadata(json.dumps(doc))


def test_empty_region_is_rejected():
    doc = _example()
    r = doc["tensors"]["embedding.weight"]["regions"][2]
    doc["tensors"]["embedding.weight"]["regions"].append(dict(r, shape=[0, 3], nbytes=0, path="arrays/z"))
    with pytest.raises(MetadataError, match="at least one element"):
        parse_metadata(json.dumps(doc))


def test_trainer_state_round_trip_and_checks():
    state = {"step": 7, "lr": 0.5, "nested": {"list": [1, 2.5, None, True, "x"]}, "big": 2**80}
    data, ref = dump_trainer_state(state)
    assert parse_trainer_state(data, ref) == state
    with pytest.raises(MetadataError, match="SHA-256"):
        parse_trainer_state(data.replace(b"7", b"8"), ref)
    with pytest.raises(MetadataError, match="SHA-256"):
        parse_trainer_state(data[:-2], ref)


@pytest.mark.parametrize("state,where", [
    ({"betas": (0.9, 0.95)}, '$["betas"]'),
    ({1: "int key"}, "key 1"),
    ({"x": float("nan")}, '$["x"]'),
    ({"x": {"y": object()}}, '$["x"]["y"]'),
    ([1, 2], "must be a dict"),
])
def test_trainer_state_rejects_what_json_would_change(state, where):
    with pytest.raises(MetadataError) as info:
        dump_trainer_state(state)
    assert where in str(info.value)


def test_trainer_state_with_wrong_top_level_type():
    data, ref = dump_trainer_state({"a": 1})
    bad = b"[1]\n"
    import hashlib
    with pytest.raises(MetadataError, match="must be an object"):
        parse_trainer_state(bad, TrainerStateRef(len(bad), hashlib.sha256(bad).hexdigest()))
    assert parse_trainer_state(data, ref) == {"a": 1}


def test_metadata_has_no_training_fields():
    md = Metadata({"w": TensorMetadata("float32", (2,), (StoredRegion(Box((0,), (2,)), "arrays/w/0", 8),))})
    doc = json.loads(md.dumps())
    assert set(doc) == {"format", "version", "tensors", "trainer_state"}
    assert copy.deepcopy(doc)["tensors"]["w"].keys() == {"dtype", "global_shape", "regions"}
