"""spec/ is normative: the example checkpoint committed there must keep loading,
the schemas must accept the examples, and saving the same state again must write
the same metadata.json byte for byte (the format did not drift)."""

import importlib.util
import json
import os

import jsonschema
import numpy as np
import pytest
from repo import SPEC

import globalshard as gs

EXAMPLES = os.path.join(SPEC, "examples")


def _generator():
    spec = importlib.util.spec_from_file_location("generate", os.path.join(EXAMPLES, "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema(name):
    with open(os.path.join(SPEC, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("name", ["checkpoint", "checkpoint-v1"])
def test_committed_example_checkpoint_loads_into_another_layout(name):
    # checkpoint-v1 was written by format version 1 (spec section 2.4): still read.
    gen = _generator()
    expected = gen.global_arrays()
    ckpt = os.path.join(EXAMPLES, name)
    assert gs.read_metadata(ckpt).version == (1 if name.endswith("v1") else 2)
    for key, value in expected.items():
        got = gs.read_array(ckpt, key)
        assert got.dtype == value.dtype and np.array_equal(got, value), key
    # Into one process (TP=1): the fused QKV comes back as the global [Q; K; V].
    qkv = expected["layers.0.attention.qkv.weight"]
    t = {"qkv": gs.ShardedTensor.from_offset("layers.0.attention.qkv.weight", np.zeros_like(qkv),
                                             global_shape=qkv.shape, global_offset=(0, 0)),
         "emb": gs.ShardedTensor.from_offset("embedding.weight", np.zeros((10, 3), np.float32),
                                             global_shape=(10, 3), global_offset=(0, 0))}
    assert gs.load(t, ckpt) == gen.TRAINER_STATE
    assert np.array_equal(t["qkv"].data, qkv)
    assert np.array_equal(t["emb"].data, expected["embedding.weight"].astype(np.float32))


def test_saving_the_example_again_writes_the_same_metadata(tmp_path):
    # Byte for byte, but for the save id, which every save draws anew.
    gen = _generator()
    gs.save(gen.sharded_state(), tmp_path, trainer_state=gen.TRAINER_STATE)
    committed = gs.read_metadata(os.path.join(EXAMPLES, "checkpoint"))
    new = gs.read_metadata(tmp_path)
    assert new.save_id != committed.save_id
    for name in ("metadata.json", f"saves/{new.save_id}/trainer_state.json"):
        with open(os.path.join(EXAMPLES, "checkpoint", name.replace(new.save_id, committed.save_id)), "rb") as f:
            assert (tmp_path / name).read_bytes().replace(new.save_id.encode(), committed.save_id.encode()) \
                == f.read(), name


def test_schemas_accept_the_examples():
    for doc_name, schema_name in [("metadata.json", "metadata.schema.json"),
                                  ("trainer_state.json", "trainer_state.schema.json")]:
        with open(os.path.join(EXAMPLES, doc_name)) as f:
            jsonschema.validate(json.load(f), _schema(schema_name))
    with open(os.path.join(EXAMPLES, "checkpoint", "metadata.json")) as f:
        jsonschema.validate(json.load(f), _schema("metadata.schema.json"))
    with open(os.path.join(SPEC, "vectors", "based", "metadata.json")) as f:  # bases, base, sha256 (section 5.2)
        doc = json.load(f)
    assert doc["bases"] and any("sha256" in r for t in doc["tensors"].values() for r in t["regions"])
    jsonschema.validate(doc, _schema("metadata.schema.json"))


@pytest.mark.parametrize("name", ["unknown_dtype", "string_integer", "bool_integer", "negative_integer",
                                  "overflow_integer", "null_integer", "absolute_path", "climbing_path",
                                  "unknown_version", "unknown_field", "missing_field", "base_root_climbing"])
def test_schema_rejects_the_structural_invalid_examples(name):
    # The rest (gaps, overlaps, nbytes, 4.0 as an integer) are beyond a schema: FORMAT.md section 3.
    with open(os.path.join(EXAMPLES, "invalid", f"{name}.json")) as f:
        doc = json.load(f)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, _schema("metadata.schema.json"))


def test_schema_dtypes_match_the_library():
    assert _schema("metadata.schema.json")["$defs"]["dtype"]["enum"] == list(gs.SUPPORTED_DTYPES)


def test_overwriting_a_version_1_checkpoint_removes_exactly_what_it_listed(tmp_path):
    import shutil

    ckpt = tmp_path / "c"
    shutil.copytree(os.path.join(EXAMPLES, "checkpoint-v1"), ckpt)
    (ckpt / "notes.txt").write_text("mine")
    gen = _generator()
    gs.save(gen.sharded_state(), ckpt, trainer_state={"step": 1}, overwrite=True)
    assert sorted(os.listdir(ckpt)) == [".globalshard.lock", "metadata.json", "notes.txt", "saves"]
    assert gs.read_metadata(ckpt).version == 2 and gs.read_trainer_state(ckpt) == {"step": 1}
