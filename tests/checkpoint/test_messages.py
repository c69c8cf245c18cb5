"""The messages between a trainer and its writer process are JSON: values,
metadata, stores and errors come back as they went; nothing that is code
crosses."""

import errno
import functools
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import globalshard as gs
from globalshard.checkpoint.messages import can_send, decode, encode
from globalshard.store import KvStore, LocalStore, from_portable, open_root, portable

_keys = st.text(max_size=6) | st.sampled_from(["$dict", "$bytes", "$store", "$metadata", "$error", "$x"])
_leaves = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text()
           | st.binary(max_size=40))
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                       | st.dictionaries(_keys, inner, max_size=4), max_leaves=20)


def _as_sent(value):
    """What a message gives back for ``value``: tuples as lists, bytes as bytes."""
    if isinstance(value, (list, tuple)):
        return [_as_sent(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_sent(v) for k, v in value.items()}
    return value


@given(_values)
def test_json_values_and_bytes_come_back_as_they_went(value):
    data = encode(value)
    json.loads(data)  # one JSON document
    assert decode(data) == _as_sent(value)


def test_a_dict_whose_one_key_looks_like_a_tag_stays_a_dict():
    for key in ("$bytes", "$store", "$metadata", "$error", "$dict"):
        assert decode(encode({key: "not a tag"})) == {key: "not a tag"}


def test_metadata_comes_back_equal(tmp_path):
    state = {f"w@{r}": gs.ShardedTensor.from_offset("w", np.arange(6, dtype=np.float32).reshape(2, 3) + r,
                                                    global_shape=(4, 3), global_offset=(2 * r, 0)) for r in (0, 1)}
    gs.save(state, tmp_path, trainer_state={"step": 3})
    metadata = gs.read_metadata(tmp_path)
    back = decode(encode(["cleanup", metadata]))[1]
    assert back == metadata and back.dumps() == metadata.dumps()


def test_local_and_kvstore_roots_cross_and_reach_the_same_files(tmp_path):
    local = open_root(tmp_path / "a")
    kv = open_root({"driver": "file", "path": str(tmp_path / "b") + "/"}, None)
    ocdbt = open_root({"driver": "ocdbt", "base": f"file://{tmp_path}/c/"})
    for store in (local, kv, ocdbt):
        assert can_send(store)
        back = decode(encode({"store": store}))["store"]
        assert type(back) is type(store) and portable(back) == portable(store)
        store.write("x/file", b"here")
        assert back.read("x/file") == b"here"
    assert type(decode(encode(ocdbt))) is KvStore


class _Recording(LocalStore):
    pass


def test_what_another_process_cannot_reach_or_would_open_as_another_class_is_not_sent():
    memory = open_root("memory://messages/")
    assert not can_send(memory) and portable(memory) is None
    subclass = _Recording("/tmp/unused")
    assert not can_send(subclass)  # the writer would open a LocalStore, without the subclass's behaviour
    for store in (memory, subclass):
        with pytest.raises(TypeError, match="another process"):
            encode(["job", store])
    with pytest.raises(gs.StorageError, match="not a store"):
        from_portable({"pickle": "..."})


def test_code_does_not_cross():
    for value in (print, functools.partial(print, 1), object(), np.float32(1), {1: "int key"}):
        with pytest.raises(TypeError):
            encode(["setup", value])


def test_errors_come_back_with_their_type_message_and_fields():
    sent = [gs.StorageError("cannot write saves/x: disk full"), gs.ConcurrentSaveError("another save first"),
            OSError(errno.ENOSPC, "No space left on device", "/ckpt/saves/x"), KeyError("w"),
            RuntimeError("copy failed", 3)]
    back = decode(encode([["error", 1, e] for e in sent]))
    for e, (_, _, got) in zip(sent, back):
        assert type(got) is type(e) and got.args == e.args and str(got) == str(e)
    assert back[2][2].errno == errno.ENOSPC and back[2][2].filename == "/ckpt/saves/x"


class _Custom(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_an_error_of_another_type_comes_back_as_a_storage_error_naming_it():
    got = decode(encode({"e": _Custom(1, 2)}))["e"]
    assert type(got) is gs.StorageError and "_Custom" in str(got) and "1 and 2" in str(got)
    got = decode(encode({"e": ValueError(object())}))["e"]  # an argument that is no JSON value: its text
    assert type(got) is ValueError and "object at" in str(got)
    # A type named as a package error, but from elsewhere: not trusted by its name.
    doc = {"$error": {"type": "StorageError", "module": "evil", "args": ["x"], "text": "x"}}
    assert str(decode(json.dumps(doc).encode())) == "StorageError: x"
    doc = {"$error": {"type": "system", "module": "os", "args": ["echo"], "text": "t"}}
    assert type(decode(json.dumps(doc).encode())) is gs.StorageError
