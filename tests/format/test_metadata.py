import copy
import itertools
import json
import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from repo import SPEC

from globalshard import SUPPORTED_DTYPES, Box, MetadataError, StoredRegion, TensorMetadata, geometry
from globalshard.dtypes import numpy_dtype
from globalshard.format.metadata import (
    Metadata,
    TrainerStateRef,
    check_relative_path,
    dump_trainer_state,
    parse_metadata,
    parse_trainer_state,
)
from globalshard.testing.strategies import grid_boxes, shapes

EXAMPLES = os.path.join(SPEC, "examples")


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
                                     st.text("0123456789abcdef", min_size=64, max_size=64),
                                     st.just("saves/x/trainer_state.json")))
    return Metadata(tensors, ref, 2, draw(st.text("0123456789abcdef", min_size=32, max_size=32)))


def _canonical(md: Metadata) -> Metadata:
    return Metadata(
        {k: TensorMetadata(t.dtype, t.global_shape, tuple(sorted(t.regions, key=lambda r: r.box.offset)))
         for k, t in md.tensors.items()},
        md.trainer_state, md.version, md.save_id,
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


def _whole_tensors_doc() -> dict:
    # Tensors the parser's fast path takes (one region holding all of the tensor,
    # packed or not, 0-d too) beside one it does not, with paths to collide.
    save = "0123456789abcdef0123456789abcdef"

    def whole(dtype, shape, path, nbytes, byte_offset=None):
        region = {"offset": [0] * len(shape), "shape": list(shape), "path": path, "nbytes": nbytes}
        if byte_offset is not None:
            region["byte_offset"] = byte_offset
        return {"dtype": dtype, "global_shape": list(shape), "regions": [region]}

    return {"format": "globalshard", "version": 2, "save_id": save, "tensors": {
        "a": whole("float32", [3, 2], "p/0", 24, 0),
        "b": whole("int8", [5], "p/0", 5, 64),
        "c": whole("bfloat16", [], "p/1", 2, 0),
        "d": whole("float64", [2], "arrays/d", 16),
        "g": whole("uint8", [1, 1], "p/0", 1, 200),
        "e": {"dtype": "uint8", "global_shape": [4], "regions": [
            {"offset": [0], "shape": [2], "path": "arrays/e0", "nbytes": 2},
            {"offset": [2], "shape": [2], "path": "arrays/e1", "nbytes": 2}]},
    }, "trainer_state": None}


def _outcome(text, fast):
    try:
        return parse_metadata(text, fast=fast)
    except MetadataError as e:
        return str(e)


@given(st.data())
def test_the_parsers_fast_path_agrees_with_the_full_checks(data):
    # Whole-tensor regions take a shorter path through the parser: on any
    # document, valid or not, it must give the same model or the same message.
    doc = _whole_tensors_doc()
    edits = [lambda v: True, lambda v: 1.0, lambda v: -1, lambda v: 0, lambda v: 1, lambda v: 2**63, lambda v: "p/0",
             lambda v: "arrays/d", lambda v: "p", lambda v: None, lambda v: [], lambda v: [0], lambda v: {}]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        action = data.draw(st.sampled_from(["edit", "delete", "any"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "edit":
            parent[path[-1]] = data.draw(st.sampled_from(edits))(parent[path[-1]])
        else:
            parent[path[-1]] = data.draw(_mutations())
    if data.draw(st.booleans()):
        doc["version"] = 1
        doc.pop("save_id", None)
    text = json.dumps(doc, allow_nan=True)
    assert _outcome(text, True) == _outcome(text, False)


def _set(doc, path, value):
    for p in path[:-1]:
        doc = doc[p]
    doc[path[-1]] = value


_G = ("tensors", "g", "regions", 0)


@pytest.mark.parametrize("edits", [
    [(_G + ("shape", 0), True)], [(_G + ("shape", 1), 1.0)], [(("tensors", "g", "global_shape", 0), True)],
    [(_G + ("offset", 0), False)], [(_G + ("offset", 1), 1)], [(_G + ("nbytes",), 1.0)],
    [(_G + ("byte_offset",), True)], [(_G + ("byte_offset",), 2**63)], [(_G + ("path",), "p")],
    [(_G + ("path",), "arrays/d")], [(_G + ("path",), "arrays/d/x")], [(_G + ("path",), "../x")],
    [(("tensors", "g", "global_shape"), [2**62, 4]), (_G + ("shape",), [2**62, 4])],
    # A member the full checks see and one the fast path sees, holding the same bytes.
    [(("tensors", "e", "regions", 0, "path"), "p/0"), (("tensors", "e", "regions", 0, "byte_offset"), 200)],
    [(("tensors", "e", "regions", 0, "path"), "p/1"), (("tensors", "e", "regions", 0, "byte_offset"), 0)],
    [(("tensors", "e", "regions", 1, "path"), "arrays/d")], [(("version",), 1)],
], ids=lambda edits: ";".join(f"{'.'.join(map(str, p))}={v!r}" for p, v in edits))
def test_the_fast_path_agrees_on_the_edge_cases(edits):
    doc = _whole_tensors_doc()
    for path, value in edits:
        _set(doc, path, value)
    text = json.dumps(doc)
    assert _outcome(text, True) == _outcome(text, False)


def test_the_fast_path_names_json_paths_in_later_checks():
    doc = _whole_tensors_doc()
    doc["tensors"]["b"]["regions"][0]["byte_offset"] = 8  # overlaps a's 24 bytes
    doc["tensors"]["f"] = copy.deepcopy(doc["tensors"]["d"])
    doc["tensors"]["f"]["regions"][0]["path"] = "arrays/d/x"
    with pytest.raises(MetadataError) as e:
        parse_metadata(json.dumps(doc))
    assert '$.tensors["b"].regions[0].byte_offset: bytes from 8 of pack \'p/0\' overlap $.tensors["a"].regions[0]' \
        in str(e.value)
    assert '$.tensors["f"].regions[0].path: \'arrays/d/x\' lies inside \'arrays/d\' ($.tensors["d"].regions[0])' \
        in str(e.value)
    assert str(e.value) == _outcome(json.dumps(doc), False)


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


def _nested(depth):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("state,where", [
    ({"betas": (0.9, 0.95)}, '$["betas"]'),
    ({1: "int key"}, "key 1"),
    ({"x": {"$float": "inf"}}, '$["x"]'),
    ({"x": [[[{"y": 1}]]], "deep": _nested(101)}, '$["deep"]'),
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
    md = Metadata({"w": TensorMetadata("float32", (2,), (StoredRegion(Box((0,), (2,)), "arrays/w/0", 8),))},
                  None, 2, "0" * 32)
    doc = json.loads(md.dumps())
    assert set(doc) == {"format", "version", "save_id", "tensors", "trainer_state"}
    assert copy.deepcopy(doc)["tensors"]["w"].keys() == {"dtype", "global_shape", "regions"}


def test_non_finite_floats_round_trip_through_the_trainer_state():
    state = {"best": float("inf"), "worst": float("-inf"), "loss": float("nan"), "lr": [1e-3, float("inf")],
             "plain": {"$float": 1, "other": 2}}
    data, ref = dump_trainer_state(state)
    json.loads(data, parse_constant=lambda c: pytest.fail(f"{c} written"))  # strict JSON on disk
    back = parse_trainer_state(data, ref)
    assert back["best"] == float("inf") and back["worst"] == float("-inf") and back["lr"][1] == float("inf")
    assert back["loss"] != back["loss"]
    assert back["plain"] == {"$float": 1, "other": 2}


def test_trainer_state_depth_is_bounded_on_save_and_load():
    dump_trainer_state({"x": _nested(99)})
    with pytest.raises(MetadataError, match="nested more than 100"):
        dump_trainer_state({"x": _nested(100)})
    import hashlib
    deep = ("{\"x\":" + "[" * 600 + "]" * 600 + "}").encode()
    with pytest.raises(MetadataError, match="nested more than 100"):
        parse_trainer_state(deep, TrainerStateRef(len(deep), hashlib.sha256(deep).hexdigest()))
    bad = b'{"x": {"$float": "infinity"}}'
    with pytest.raises(MetadataError, match="must be one of"):
        parse_trainer_state(bad, TrainerStateRef(len(bad), hashlib.sha256(bad).hexdigest()))


def _one_tensor(global_shape, regions, version=2):
    doc = {"format": "globalshard", "version": version, "save_id": "0" * 32,
           "tensors": {"t": {"dtype": "uint8", "global_shape": global_shape, "regions": [
               {"offset": o, "shape": sh, "path": f"a/{i}", "nbytes": math.prod(sh)}
               for i, (o, sh) in enumerate(regions)]}}, "trainer_state": None}
    if version == 1:
        del doc["save_id"]
    return json.dumps(doc)


def test_rank_is_bounded_before_anything_recurses_on_it():
    ok = _one_tensor([1] * 32, [([0] * 32, [1] * 32)])
    assert parse_metadata(ok).tensors["t"].global_shape == (1,) * 32
    for rank in (33, 1000, 100_000):
        with pytest.raises(MetadataError, match="at most 32"):
            parse_metadata(_one_tensor([1] * rank, [([0] * rank, [1] * rank)]))


def test_lone_surrogates_are_metadata_errors():
    text = _one_tensor([2], [([0], [2])]).replace('"a/0"', '"a/\\ud800"')
    with pytest.raises(MetadataError, match="Unicode"):
        parse_metadata(text)
    text = _one_tensor([2], [([0], [2])]).replace('"t"', '"\\udfff"')
    with pytest.raises(MetadataError, match="Unicode"):
        parse_metadata(text)


def test_a_crafted_exact_cover_validates_in_linear_time():
    # A brick wall: every row of bricks is offset by one from the next, so each
    # slab of a sweep over rows crosses many boxes. 20,000 regions.
    rows, per_row, width = 200, 100, 2
    regions = []
    for r in range(rows):
        shift = r % 2
        cols = [0] + [shift + width * k for k in range(1, per_row)] + [per_row * width]
        cols = sorted(set(cols))
        regions += [([r, a], [1, b - a]) for a, b in itertools.pairwise(cols)]
    boxes = [Box(tuple(o), tuple(sh)) for o, sh in regions]
    assert geometry._is_exact_cover(Box.full((rows, per_row * width)), boxes) is True  # the linear path decides
    md = parse_metadata(_one_tensor([rows, per_row * width], regions))
    assert len(md.tensors["t"].regions) == len(regions)
    # The same wall with one brick moved onto its neighbour: the overlap is found and named.
    (o, sh) = regions[5]
    regions[5] = ([o[0], o[1] + 1], sh)
    with pytest.raises(MetadataError, match="overlaps|not stored"):
        parse_metadata(_one_tensor([rows, per_row * width], regions))


def test_version_1_documents_still_parse():
    md = parse_metadata(_one_tensor([2], [([0], [2])], version=1))
    assert md.version == 1 and md.save_id is None
    with pytest.raises(MetadataError, match="save_id"):
        parse_metadata(_one_tensor([2], [([0], [2])], version=1).replace('"version": 1', '"version": 2'))


@pytest.mark.parametrize("doc", [b'{"x": {"$float": ["inf"]}}', b'{"x": {"$float": {"a": 1}}}', b'{"$float": "inf"}'])
def test_a_malformed_float_tag_is_a_metadata_error(doc):
    # Found by tests/fuzz_metadata.py at 100,000 inputs: TypeError and AssertionError escaped.
    import hashlib
    with pytest.raises(MetadataError):
        parse_trainer_state(doc, TrainerStateRef(len(doc), hashlib.sha256(doc).hexdigest()))


@pytest.mark.parametrize("text, fragment", [
    ('"nbytes": -0}', "-0 is not an integer of this format"),
    ('"nbytes": -0 }', "-0 is not an integer of this format"),
    ('"nbytes": -0.0}', "must be a non-negative integer, got number"),
])
def test_negative_zero_is_refused_wherever_it_is(text, fragment):
    doc = json.dumps(_whole_tensors_doc())
    assert '"nbytes": 16}' in doc
    with pytest.raises(MetadataError, match=fragment):
        parse_metadata(doc.replace('"nbytes": 16}', text))
    # a -0 inside a string is text, not an integer
    keyed = json.loads(doc)
    keyed["tensors"]["x-0"] = keyed["tensors"].pop("d")
    assert "x-0" in parse_metadata(json.dumps(keyed)).tensors


def _based_doc():
    with open(os.path.join(os.path.dirname(EXAMPLES), "vectors", "based", "metadata.json")) as f:
        return json.load(f)


def test_bases_and_digests_round_trip_and_parse_alike_fast_and_slow():
    doc = _based_doc()
    fast, slow = parse_metadata(json.dumps(doc)), parse_metadata(json.dumps(doc), fast=False)
    assert fast == slow and fast.bases and fast.bases[0].root == "sharded"
    assert any(r.base == 0 for t in fast.tensors.values() for r in t.regions)
    assert all(r.sha256 for t in fast.tensors.values() for r in t.regions)
    assert parse_metadata(fast.dumps()) == fast
    assert set(fast.paths()) == {r.path for t in fast.tensors.values() for r in t.regions if r.base is None}
    assert fast.stored_bytes() == sum(r.nbytes for t in fast.tensors.values() for r in t.regions if r.base is None)


@pytest.mark.parametrize("change,where", [
    (lambda d: d["bases"].append(dict(d["bases"][0])), "$.bases[1].root"),
    (lambda d: d["bases"][0].__setitem__("root", "a/b"), "$.bases[0].root"),
    (lambda d: d["bases"][0].__setitem__("root", ""), "$.bases[0].root"),
    (lambda d: d["bases"][0].__setitem__("save_id", "x" * 32), "$.bases[0].save_id"),
    (lambda d: d["bases"][0].__setitem__("extra", 1), "$.bases[0].extra"),
    (lambda d: d.__setitem__("bases", {}), "$.bases"),
    (lambda d: d["tensors"]["v"]["regions"][0].__setitem__("sha256", "ABC"), '$.tensors["v"].regions[0].sha256'),
    (lambda d: d["tensors"]["v"]["regions"][0].__setitem__("base", -1), '$.tensors["v"].regions[0].base'),
])
def test_invalid_bases_are_refused_naming_the_json_path(change, where):
    doc = _based_doc()
    change(doc)
    with pytest.raises(MetadataError) as e:
        parse_metadata(json.dumps(doc))
    assert where in str(e.value), str(e.value)


def test_version_1_has_no_bases():
    doc = _based_doc()
    doc["version"] = 1
    del doc["save_id"]
    with pytest.raises(MetadataError, match="bases"):
        parse_metadata(json.dumps(doc))


@pytest.mark.parametrize("backend,says", [
    ("globalshard", "its globalshard checkpoint is the 'globalshard' directory beside this file"),
    ("torch_dist", "sharded backend 'torch_dist'"),
])
def test_megatrons_metadata_json_is_named_as_megatrons_with_where_ours_is(backend, says):
    doc = {"sharded_backend": backend, "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
    with pytest.raises(MetadataError, match="is not a globalshard metadata document: it is Megatron-Core") as e:
        parse_metadata(json.dumps(doc), source="ckpt/metadata.json")
    assert says in str(e.value) and "$.format" in str(e.value)
    if backend != "globalshard":
        assert "directory beside" not in str(e.value)
