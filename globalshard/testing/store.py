"""Tests every :class:`~globalshard.store.base.Store` must pass, as zarr's
``zarr.testing.store.StoreTests``: subclass :class:`StoreTests` in a test
module and give it a ``store`` fixture (a fresh, empty root per test)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorstore as ts

from globalshard.errors import ConcurrentSaveError
from globalshard.store.base import Store, context

__all__ = ["StoreTests"]


class StoreTests:
    """The contract of :class:`~globalshard.store.base.Store` (spec sections 2, 2.1, 2.2)."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("a subclass provides a fresh, empty store")

    def test_it_is_a_store(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert all(isinstance(getattr(store, flag), bool) for flag in ("locks", "process_shared", "lists_cheaply"))

    def test_a_process_shared_store_reaches_the_same_root_from_another_process(self, store: Store) -> None:
        import json
        import subprocess
        import sys

        from globalshard.store import portable

        store.write("a/file", b"written here")
        if not store.process_shared:
            assert portable(store) is None  # an in-memory root: another process cannot reach it, and saves know it
            return
        script = ("import json, sys\nfrom globalshard.store import from_portable\n"
                  "store = from_portable(json.loads(sys.stdin.read()))\n"
                  "sys.stdout.buffer.write(store.read('a/file'))\nstore.write('a/other', b'written there')\n")
        out = subprocess.run([sys.executable, "-c", script], input=json.dumps(portable(store)).encode(),
                             capture_output=True, check=True)
        assert out.stdout == b"written here"
        assert store.read("a/other") == b"written there"

    def test_a_sibling_is_the_root_beside_this_one(self, store: Store) -> None:
        import uuid

        name = f"sibling-{uuid.uuid4().hex[:8]}"
        other = store.sibling(name)
        other.write("metadata.json", b"the sibling's")
        store.write("metadata.json", b"this one's")
        assert other.read("metadata.json") == b"the sibling's" and store.read("metadata.json") == b"this one's"
        assert store.sibling_name(other) == name and other.sibling_name(store) is not None
        assert store.sibling_name(store) is None
        assert store.sibling_name(other.sibling(name)) == name  # the sibling's sibling of that name: itself
        assert store.sibling(name).read("metadata.json") == b"the sibling's"

    def test_files_lists_everything_below_a_prefix(self, store: Store) -> None:
        store.write("a/b/c", b"1")
        store.write("a/b/d/e", b"2" * 1000)
        store.write("a/bc", b"3")
        store.write("z", b"4")
        assert store.files("a/b") == ["a/b/c", "a/b/d/e"]
        assert store.read_whole("a/b/d/e") == b"2" * 1000 and store.read_whole("a/missing") is None

    def test_a_file_reads_in_pieces_of_the_size_asked_for(self, store: Store) -> None:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(st.binary(max_size=300), st.integers(1, 64))
        def check(data: bytes, piece: int) -> None:
            store.write("f", data)
            pieces = store.read_pieces("f", piece)
            assert pieces is not None
            got = list(pieces)
            assert b"".join(got) == data and store.size("f") == len(data)
            if data:
                assert all(len(p) == piece for p in got[:-1]) and 0 < len(got[-1]) <= piece
            else:
                assert got == [b""]

        check()
        assert store.read_pieces("missing", 4) is None and store.size("missing") is None

    def test_a_file_written_in_pieces_appears_whole_or_not_at_all(self, store: Store) -> None:
        with store.open_write("a/f") as out:
            for k in range(5):
                out.write(bytes([k]) * 1000)
            assert store.read("a/f") is None  # not before the block ends
        assert store.read("a/f") == b"".join(bytes([k]) * 1000 for k in range(5))
        with pytest.raises(RuntimeError, match="the source failed"), store.open_write("a/f") as out:
            out.write(b"half of it")
            raise RuntimeError("the source failed")
        assert store.read("a/f") == b"".join(bytes([k]) * 1000 for k in range(5))  # what was there stays
        with pytest.raises(RuntimeError), store.open_write("a/g") as out:
            out.write(b"half of it")
            raise RuntimeError("the source failed")
        assert store.files("a") == ["a/f"]  # nothing else: no file, no temporary one

    def test_copy_file_copies_a_piece_at_a_time_between_stores(self, store: Store, tmp_path: Any) -> None:
        from globalshard.store import LocalStore
        from globalshard.store.base import copy_file

        other = LocalStore(tmp_path / "other")
        store.write("x/data", bytes(range(256)) * 1000)
        assert copy_file(store, "x/data", other, "y/copy")
        assert other.read_whole("y/copy") == bytes(range(256)) * 1000
        assert copy_file(other, "y/copy", store, "x/back") and store.read_whole("x/back") == other.read_whole("y/copy")
        assert not copy_file(store, "x/missing", other) and other.files("x") == []

    def test_a_missing_file_reads_as_none(self, store: Store) -> None:
        assert store.read("metadata.json") is None
        assert store.read_stamped("metadata.json")[0] is None

    def test_a_write_reads_back_whole_and_replaces_what_was_there(self, store: Store) -> None:
        store.write("a/b/file", b"first")
        assert store.read("a/b/file") == b"first"
        store.write("a/b/file", b"second, longer")
        assert store.read("a/b/file") == b"second, longer"

    def test_a_commit_on_the_version_read_replaces_it(self, store: Store) -> None:
        _, stamp = store.read_stamped("metadata.json")
        store.commit("metadata.json", b"one", stamp)
        data, stamp = store.read_stamped("metadata.json")
        assert data == b"one"
        store.commit("metadata.json", b"two", stamp)
        assert store.read("metadata.json") == b"two"

    def test_a_commit_on_a_version_replaced_meanwhile_is_refused(self, store: Store) -> None:
        store.write("metadata.json", b"one")
        _, stamp = store.read_stamped("metadata.json")
        store.write("metadata.json", b"theirs")  # another save committed in between
        with pytest.raises(ConcurrentSaveError, match="metadata.json"):
            store.commit("metadata.json", b"mine", stamp)
        assert store.read("metadata.json") == b"theirs"

    def test_a_commit_where_none_was_is_refused_once_one_appeared(self, store: Store) -> None:
        _, stamp = store.read_stamped("metadata.json")
        store.write("metadata.json", b"theirs")
        with pytest.raises(ConcurrentSaveError):
            store.commit("metadata.json", b"mine", stamp)
        assert store.read("metadata.json") == b"theirs"

    def test_listing_names_the_entries_directly_below(self, store: Store) -> None:
        assert store.list_dir() == []
        for name in ("metadata.json", "saves/x/arrays/a/zarr.json", "saves/x/arrays/b/c/0", "saves/y/t.json"):
            store.write(name, b"-")
        assert [n for n in store.list_dir() if not n.startswith(".")] == ["metadata.json", "saves"]
        assert store.list_dir("saves") == ["x", "y"]
        assert store.list_dir("saves/x/arrays") == ["a", "b"]
        assert store.list_dir("nothing") == []

    def test_delete_removes_a_file_or_a_tree_and_nothing_else(self, store: Store) -> None:
        for name in ("keep", "saves/x/a", "saves/x/b/c", "saves/xy/a"):
            store.write(name, b"-")
        store.delete("keep-not-there")  # absent: nothing happens
        store.delete("saves/x", tree=True)
        assert store.read("saves/x/a") is None and store.read("saves/x/b/c") is None
        assert store.read("saves/xy/a") == b"-" and store.read("keep") == b"-"  # a prefix of a name is not a tree
        store.delete("keep")
        assert store.read("keep") is None
        store.delete_empty_parents(["saves/x/a"])  # whatever is left of it goes; the root stays
        assert store.read("saves/xy/a") == b"-"

    def test_the_lock_can_be_held_and_taken_again(self, store: Store) -> None:
        with store.lock():
            store.write("metadata.json", b"x")
        with store.lock():
            assert store.read("metadata.json") == b"x"

    def test_paths_written_through_the_store_are_contained(self, store: Store) -> None:
        store.write("saves/x/arrays/a/zarr.json", b"{}")
        assert store.escaping(["saves/x/arrays/a"]) == []
        assert store.linked_component("saves/x/arrays/a") is None

    def test_the_kvstore_of_a_path_holds_what_the_store_wrote_there(self, store: Store) -> None:
        store.write("saves/x/data", b"abc")
        kv = ts.KvStore.open(store.kvstore("saves/x"), context=context()).result()
        assert kv.read("data").result().value == b"abc"
        array: Any = ts.open({"driver": "zarr3", "kvstore": store.kvstore("saves/x/arr")}, create=True,
                             dtype=ts.uint8, shape=[3], context=context()).result()
        array.write(np.arange(3, dtype=np.uint8)).result()
        assert "arr" in store.list_dir("saves/x")

    def test_describe_names_the_file(self, store: Store) -> None:
        assert "metadata.json" in store.describe("metadata.json")

    def test_a_child_names_a_root_below_this_one(self, store: Store) -> None:
        from globalshard.store import open_root

        store.write("iter_1/metadata.json", b"{}")
        assert open_root(store.child("iter_1")).read("metadata.json") == b"{}"
