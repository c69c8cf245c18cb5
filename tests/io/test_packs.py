"""Packs (spec section 5.1): small regions saved with ``pack_below`` into a few
uint8 arrays, and every reader of them: loads into any layout through either
local engine, read_array, verify, shared reads, the spec's reference reader.
What a pack must say of itself is checked before a byte is read; damage names
the pack and the keys it holds."""

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from unittest import mock

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo import SPEC
from roundtrip import _bits_equal, assert_loaded, checkpoints, shards_of
from test_localio import ENGINES, NOWAIT_ANSWERS, engine, flip_byte, nowait_answers

import globalshard as gs
from globalshard import planner
from globalshard.format.metadata import parse_metadata
from globalshard.io import localio
from globalshard.io import read as io_read
from globalshard.testing.comm import run_ranks

sys.path.insert(0, SPEC)
import reference_reader

SCHEMA = os.path.join(SPEC, "metadata.schema.json")


@contextlib.contextmanager
def pack_bytes(limit):
    saved = planner.PACK_BYTES
    planner.PACK_BYTES = limit
    try:
        yield
    finally:
        planner.PACK_BYTES = saved


def check_packing(directory, pack_below, limit):
    """metadata.json packs exactly the regions under ``pack_below`` bytes, each
    aligned, inside one pack of at most ``limit`` bytes, not overlapping; the
    pack's attributes list exactly its members."""
    md = gs.read_metadata(directory)
    with open(os.path.join(directory, "metadata.json")) as f:
        jsonschema.validate(json.load(f), json.load(open(SCHEMA)))
    members = {}
    for key, t in md.tensors.items():
        for r in t.regions:
            assert (r.byte_offset is not None) == (r.nbytes < pack_below), (key, r)
            if r.byte_offset is not None:
                assert r.byte_offset % planner.PACK_ALIGN == 0
                members.setdefault(r.path, []).append([key, list(r.box.offset), r.byte_offset, r.nbytes])
    for path, listed in members.items():
        assert "/packs/" in path
        listed.sort(key=lambda m: m[2])
        ends = [b + n for _, _, b, n in listed]
        assert all(b >= e for (_, _, b, _), e in zip(listed[1:], ends)), listed
        assert ends[-1] <= limit or len(listed) == 1
        with open(os.path.join(directory, path, "zarr.json")) as f:
            doc = json.load(f)
        assert doc["data_type"] == "uint8" and doc["shape"] == [ends[-1]]
        assert doc["attributes"]["globalshard"] == {"save_id": md.save_id, "members": listed}
    return members


@settings(max_examples=60)
@given(checkpoints(), st.sampled_from([1, 8, 64, 4096, 1 << 20]), st.sampled_from([1, 200, 1 << 20]),
       st.sampled_from(ENGINES), st.sampled_from(ENGINES), st.sampled_from([24, 1 << 20]))
def test_property_packed_checkpoints_load_into_any_layout(tensors, pack_below, limit, writer, reader, chunk_bytes):
    # A tiny pack limit puts each member in a pack of its own or a few; tiny chunks
    # shard the packs so that members straddle chunk boundaries.
    pack_below = min(pack_below, limit)
    directory = tempfile.mkdtemp()
    try:
        state, targets = shards_of(tensors)
        with pack_bytes(limit), engine(writer, chunk_bytes):
            gs.save(state, directory, pack_below=pack_below)
        check_packing(directory, pack_below, limit)
        with engine(reader):
            gs.load(targets, directory)
            problems, _ = gs.Checkpoint(directory).verify()
            assert problems == []
            assert_loaded(tensors, targets, directory)
        spec_only = reference_reader.Checkpoint(directory)
        for t in tensors:
            got = spec_only.read(t["key"])
            assert _bits_equal(got, t["value"]), t["key"]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@settings(max_examples=25, deadline=None)
@given(checkpoints(), st.integers(1, 3), st.integers(0, 2**32))
def test_property_each_writer_packs_its_own_regions(tensors, world, seed):
    """Shards spread over ranks: every rank computes the same packing; each
    pack holds regions its own rank wrote; the whole loads back."""
    state, targets = shards_of(tensors)
    rng = np.random.default_rng(seed)
    owner = {name: int(rng.integers(0, world)) for name in state}
    directory = tempfile.mkdtemp()
    try:
        results = run_ranks(world, lambda comm: gs.save(
            {n: t for n, t in state.items() if owner[n] == comm.rank}, directory, comm=comm, pack_below=1 << 20))
        assert all(r is None for r in results), results
        members = check_packing(directory, 1 << 20, planner.PACK_BYTES)
        for path in members:
            assert int(path.split("/")[-2]) < world
        gs.load(targets, directory)
        assert_loaded(tensors, targets, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _small_state(n=40, seed=0):
    rng = np.random.default_rng(seed)
    values = {f"layers.{i}.{'w' if i % 2 else 'b'}": rng.standard_normal((i % 5 + 1, 3)).astype(
        np.float32 if i % 3 else np.float16) for i in range(n)}
    values["big"] = rng.standard_normal((300, 300)).astype(np.float32)  # 360 KB: stored whole
    state = {k: gs.ShardedTensor.from_offset(k, v, global_shape=v.shape, global_offset=(0,) * v.ndim)
             for k, v in values.items()}
    return values, state


def _packed(tmp_path, **kw):
    values, state = _small_state(**kw)
    root = tmp_path / "ckpt"
    gs.save(state, root, pack_below=64 << 10)
    md = gs.read_metadata(root)
    pack = md.tensors["layers.3.w"].regions[0].path
    return values, root, md, pack


def _load_all(root, values):
    targets = {k: gs.ShardedTensor.from_offset(k, np.zeros_like(v), global_shape=v.shape,
                                               global_offset=(0,) * v.ndim) for k, v in values.items()}
    gs.load(targets, root)
    return {k: t.data for k, t in targets.items()}


def test_a_packed_save_is_a_few_files_and_reads_back(tmp_path):
    values, root, md, pack = _packed(tmp_path)
    packs = {r.path for t in md.tensors.values() for r in t.regions if r.byte_offset is not None}
    assert packs == {pack} and md.tensors["big"].regions[0].byte_offset is None
    assert sorted(os.listdir(root / "saves" / md.save_id)) == ["arrays", "packs"]
    assert os.listdir(root / "saves" / md.save_id / "arrays") == ["big"]
    for k, got in _load_all(root, values).items():
        assert np.array_equal(got, values[k]), k
    assert np.array_equal(gs.read_array(root, "layers.4.b", (slice(1, 3), slice(2, 3))), values["layers.4.b"][1:3, 2:3])


def test_a_load_reads_only_the_pack_chunks_it_needs(tmp_path):
    # 2,000 regions of 4 KiB: a 7.8 MiB pack of 1 MiB inner chunks; one key needs one or two chunks.
    state = {f"k{i}": gs.ShardedTensor.from_offset(f"k{i}", np.full((1024,), i, np.float32), global_shape=(1024,),
                                                   global_offset=(0,)) for i in range(2000)}
    gs.save(state, tmp_path, pack_below=1 << 20)
    stats = gs.IOStats()
    target = gs.ShardedTensor.from_offset("k1000", np.zeros(1024, np.float32), global_shape=(1024,), global_offset=(0,))
    gs.load({"x": target}, tmp_path, stats=stats)
    assert np.all(target.data == 1000)
    assert stats.bytes_needed == 4096 and 4096 < stats.bytes_read <= 2 << 20


def test_a_load_failing_while_it_prepares_packs_leaves_no_read_running(tmp_path):
    """Reads of the first packs start while the next packs' members are put
    together; if that fails, the load must not return (raise) while those
    reads still write into the caller's arrays."""
    state = {f"k{i}": gs.ShardedTensor.from_offset(f"k{i}", np.full(1 << 17, i, np.float32), global_shape=(1 << 17,),
                                                   global_offset=(0,)) for i in range(40)}  # 20 MiB: 2 packs
    gs.save(state, tmp_path, pack_below=1 << 20)
    futures, calls = [], []
    real_task, real_whole, real_pool = localio.packs._read_pack_task, io_read._whole_region_bytes, localio.pool()

    def slow_task(units):
        time.sleep(0.3)
        return real_task(units)

    class Recording:
        def submit(self, fn, *args):
            futures.append(real_pool.submit(fn, *args))
            return futures[-1]

    def failing(uses, region):
        calls.append(region.key)
        if len(calls) == 35:  # in the second pack, after the first's reads began
            raise RuntimeError("placing failed")
        return real_whole(uses, region)

    targets = {k: gs.ShardedTensor.from_offset(k, np.zeros_like(t.data), global_shape=t.global_shape,
                                               global_offset=(0,)) for k, t in state.items()}
    with mock.patch.object(localio.packs, "_read_pack_task", slow_task), \
            mock.patch.object(localio, "pool", lambda: Recording()), \
            mock.patch.object(io_read, "_whole_region_bytes", failing), \
            pytest.raises(RuntimeError, match="placing failed"):
        gs.load(targets, tmp_path)
    assert futures and all(f.done() for f in futures)


@pytest.mark.parametrize("io", ENGINES)
def test_thousands_of_scalars_and_strided_members_in_one_chunk(tmp_path, io):
    # 3,000 0-d tensors 64 bytes apart: chunks of thousands of pieces (written through
    # one buffer); transposed and byte-swapped members are copied to their bytes.
    values = {f"s{i}": np.array(i * 0.5, np.float32) for i in range(3000)}
    state = {k: gs.ShardedTensor.from_offset(k, v, global_shape=(), global_offset=()) for k, v in values.items()}
    t = np.arange(12, dtype=np.int64).reshape(3, 4)
    state["t"] = gs.ShardedTensor.from_offset("t", t.T, global_shape=(4, 3), global_offset=(0, 0))
    state["be"] = gs.ShardedTensor.from_offset("be", np.arange(5, dtype=">i4"), global_shape=(5,), global_offset=(0,))
    with engine(io):
        gs.save(state, tmp_path, pack_below=1 << 20)
        assert gs.Checkpoint(tmp_path).verify()[0] == []
        # Loading them all: thousands of members to a chunk, more than one preadv takes.
        targets = {k: gs.ShardedTensor.from_offset(k, np.zeros((), np.float32), global_shape=(), global_offset=())
                   for k in values}
        gs.load(targets, tmp_path)
        assert all(targets[k].data == v for k, v in values.items())
        # ... and their checksum still checked: a flipped byte among them fails the load.
        region = gs.read_metadata(tmp_path).tensors["s1500"].regions[0]
        shard = tmp_path / region.path / "c" / "0"
        raw = bytearray(shard.read_bytes())
        raw[region.byte_offset] ^= 1  # one chunk (1 MiB inner chunks): the byte offset is the file's
        shard.write_bytes(bytes(raw))
        with pytest.raises(gs.StorageError, match="crc32c|Digest mismatch") as e:
            gs.load(targets, tmp_path)
        assert str(e.value).count("\n  - ") == 1, str(e.value)[:2000]  # said once, not once per member
        shard.write_bytes(bytes(raw[:region.byte_offset]) + bytes([raw[region.byte_offset] ^ 1])
                          + bytes(raw[region.byte_offset + 1:]))
    assert gs.read_array(tmp_path, "s2999") == np.float32(1499.5)
    assert np.array_equal(gs.read_array(tmp_path, "t"), t.T)
    assert np.array_equal(gs.read_array(tmp_path, "be"), np.arange(5, dtype=np.int32))
    spec_only = reference_reader.Checkpoint(tmp_path)
    assert spec_only.read("s17") == np.float32(8.5) and np.array_equal(spec_only.read("t"), t.T)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "4096", planner.PACK_BYTES + 1])
def test_pack_below_out_of_range_is_refused_before_anything_is_written(tmp_path, bad):
    _, state = _small_state(4)
    with pytest.raises(gs.LayoutError, match="pack_below"):
        gs.save(state, tmp_path / "c", pack_below=bad)
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_ranks_passing_different_pack_below_fail_together(tmp_path):
    _values, state = _small_state(4)
    names = sorted(state)
    results = run_ranks(2, lambda comm: gs.save({n: state[n] for n in names[comm.rank::2]}, tmp_path, comm=comm,
                                                pack_below=1024 * (comm.rank + 1)))
    assert all(isinstance(r, gs.GlobalShardError) for r in results), results
    assert any("pack_below" in str(r) for r in results), results
    assert not (tmp_path / "metadata.json").exists()


def _edit_pack_attributes(root, pack, change):
    path = root / pack / "zarr.json"
    doc = json.loads(path.read_text())
    change(doc["attributes"]["globalshard"])
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("io", ENGINES)
@pytest.mark.parametrize("damage,says", [
    ("drop_member", "does not list"),
    ("other_save", "belongs to save"),
    ("member_moved", "does not list"),
    ("float_offset", "does not list"),
])
def test_a_pack_that_does_not_name_the_region_is_refused(tmp_path, io, damage, says):
    values, root, _md, pack = _packed(tmp_path)

    def change(attrs):
        if damage == "drop_member":
            attrs["members"] = [m for m in attrs["members"] if m[0] != "layers.3.w"]
        elif damage == "other_save":
            attrs["save_id"] = "f" * 32
        elif damage == "member_moved":
            for m in attrs["members"]:
                if m[0] == "layers.3.w":
                    m[2] += 64
        else:
            for m in attrs["members"]:
                if m[0] == "layers.3.w":
                    m[2] = float(m[2])

    _edit_pack_attributes(root, pack, change)
    with engine(io):
        with pytest.raises(gs.StorageError, match=says) as e:
            _load_all(root, values)
        assert pack in str(e.value)
        problems, _ = gs.Checkpoint(root).verify()
        named = "layers." if damage == "other_save" else "layers.3.w"  # the save: every member is foreign
        assert len(problems) == 1 and pack in problems[0] and named in problems[0], problems
    with pytest.raises(reference_reader.Invalid):
        reference_reader.Checkpoint(root).read("layers.3.w")


@pytest.mark.parametrize("io", ENGINES)
def test_a_pack_that_is_not_one_axis_of_uint8_is_refused(tmp_path, io):
    values, root, _md, pack = _packed(tmp_path)
    path = root / pack / "zarr.json"
    doc = json.loads(path.read_text())
    doc["data_type"] = "int8"
    path.write_text(json.dumps(doc))
    with engine(io), pytest.raises(gs.StorageError) as e:
        _load_all(root, values)
    assert pack in str(e.value)


def test_a_flipped_byte_in_a_pack_names_the_pack_its_chunk_and_keys(tmp_path):
    with engine("localio", 64):  # inner chunks of 64 bytes: each holds one member or part of one
        values, root, md, pack = _packed(tmp_path)
    shard = root / pack / "c" / "0"
    chunk = json.loads((root / pack / "zarr.json").read_text())["codecs"][0]["configuration"]["chunk_shape"][0]
    raw = bytearray(shard.read_bytes())
    at = md.tensors["layers.3.w"].regions[0].byte_offset + 1
    raw[at // chunk * (chunk + 4) + at % chunk] ^= 0x10  # each chunk is followed by its 4-byte crc32c
    shard.write_bytes(bytes(raw))
    with pytest.raises(gs.StorageError, match="crc32c") as e:
        _load_all(root, values)
    assert pack in str(e.value) and f"inner chunk [{at // chunk}]" in str(e.value), str(e.value)
    # The regions in that chunk: layers.3.w, and the end of the one before it if it reaches in.
    held = str(e.value).split("(packed regions it holds: ")[1]
    assert "'layers.3.w' [0:4, 0:3]" in held and held.count("'layers.") <= 2, held
    problems, _ = gs.Checkpoint(root).verify()
    assert len(problems) == 1 and pack in problems[0], problems
    lost = problems[0].split("regions of the pack that cannot be read: ")[1]
    assert "layers.3.w [0:4, 0:3]" in lost and lost.count("layers.") <= 2, lost
    # Keys outside the pack still load.
    assert np.array_equal(gs.read_array(root, "big"), values["big"])


@pytest.fixture(scope="module")
def packed64(tmp_path_factory):
    """A packed checkpoint whose pack has inner chunks of 64 bytes (saved once)."""
    with engine("localio", 64):
        return _packed(tmp_path_factory.mktemp("packed64"))


@pytest.mark.skipif(not localio.read._NOWAIT, reason="no RWF_NOWAIT here")
@given(answers=NOWAIT_ANSWERS, damaged=st.none() | st.integers(0, 1 << 20))
def test_pack_chunks_read_without_waiting_or_after_it_land_whole_and_checked(packed64, answers, damaged):
    """As for arrays (test_localio): whatever the kernel answers each
    non-blocking read of a pack chunk, every member lands whole, and a
    damaged chunk is named, whichever read brought it."""
    values, root, md, pack = packed64
    values = {k: v for k, v in values.items() if k != "big"}  # the packed keys (big: 5,625 chunks of 64 bytes)
    shard = root / pack / "c" / "0"
    chunk = json.loads((root / pack / "zarr.json").read_text())["codecs"][0]["configuration"]["chunk_shape"][0]
    at = None
    if damaged is not None:
        packed = sorted(r.byte_offset for t in md.tensors.values() for r in t.regions if r.byte_offset is not None)
        at = packed[damaged % len(packed)] + damaged % 3
        flip_byte(shard, at // chunk * (chunk + 4) + at % chunk)  # each chunk is followed by its crc32c
    try:
        with nowait_answers(answers) as asked:
            if at is None:
                for k, got in _load_all(root, values).items():
                    assert np.array_equal(got, values[k]), k
            else:
                with pytest.raises(gs.StorageError, match="crc32c") as e:
                    _load_all(root, values)
                assert f"{shard} (inner chunk [{at // chunk}]): the chunk fails" in str(e.value), str(e.value)
        assert asked
    finally:
        if at is not None:
            flip_byte(shard, at // chunk * (chunk + 4) + at % chunk)


def test_a_missing_pack_fails_every_key_it_holds(tmp_path):
    _values, root, _md, pack = _packed(tmp_path)
    shutil.rmtree(root / pack)
    for key in ("layers.0.b", "layers.3.w"):
        with pytest.raises(gs.StorageError, match="missing") as e:
            gs.read_array(root, key)
        assert pack in str(e.value)


def _metadata_doc(tmp_path):
    _, root, _md, pack = _packed(tmp_path)
    return json.loads((root / "metadata.json").read_text()), pack


def test_metadata_rules_for_packed_regions(tmp_path):
    doc, pack = _metadata_doc(tmp_path)
    parse_metadata(json.dumps(doc))  # as saved: valid

    def fails(change, *says):
        bad = json.loads(json.dumps(doc))
        change(bad)
        with pytest.raises(gs.MetadataError) as e:
            parse_metadata(json.dumps(bad))
        for text in says:
            assert text in str(e.value), str(e.value)

    def region(d, key):
        return d["tensors"][key]["regions"][0]

    def overlap(d):
        region(d, "layers.1.w")["byte_offset"] = region(d, "layers.0.b")["byte_offset"] + 4

    fails(overlap, "overlap", ".byte_offset")

    def shared_with_array(d):
        del region(d, "layers.0.b")["byte_offset"]

    fails(shared_with_array, '$.tensors["layers.1.w"].regions[0].path', 'the array of $.tensors["layers.0.b"]',
          "has no byte_offset")

    def unpacked_after_packed(d):
        del region(d, "layers.1.w")["byte_offset"]

    fails(unpacked_after_packed, '$.tensors["layers.1.w"].regions[0].path', "is a pack of", "has none")

    def array_path_into_pack(d):
        region(d, "layers.1.w")["path"] = region(d, "big")["path"]

    fails(array_path_into_pack, '$.tensors["layers.1.w"].regions[0].path', 'the array of $.tensors["big"]')

    def trainer_state_in_pack(d):
        d["trainer_state"] = {"path": pack, "nbytes": 2, "sha256": "0" * 64}

    fails(trainer_state_in_pack, "$.trainer_state.path")
    fails(lambda d: region(d, "layers.1.w").__setitem__("byte_offset", -64), ".byte_offset")
    fails(lambda d: region(d, "layers.1.w").__setitem__("byte_offset", None), ".byte_offset")

    def version_1(d):
        d["version"] = 1
        del d["save_id"]
        for t in d["tensors"].values():
            for r in t["regions"]:
                r["path"] = r["path"].split("/", 2)[2] + f"/{r.get('byte_offset', 0)}"

    fails(version_1, "byte_offset", "unknown field")


def test_overwriting_a_packed_checkpoint_deletes_its_packs(tmp_path):
    _values, root, _md, _pack = _packed(tmp_path)
    values2, state2 = _small_state(seed=1)
    gs.save(state2, root, overwrite=True, pack_below=64 << 10)
    gs.wait_for_cleanup()
    assert os.listdir(root / "saves") == [gs.read_metadata(root).save_id]
    for k, got in _load_all(root, values2).items():
        assert np.array_equal(got, values2[k]), k


def test_async_packed_save_holds_the_values_at_save_time(tmp_path):
    values, state = _small_state()
    before = {k: v.copy() for k, v in values.items()}
    saver = gs.AsyncSaver()
    saver.save(state, tmp_path, pack_below=64 << 10)
    for t in state.values():
        t.data[...] = 7
    saver.wait()
    for k, got in _load_all(tmp_path, values).items():
        assert np.array_equal(got, before[k]), k


def test_a_packed_member_that_never_becomes_ready_commits_nothing(tmp_path):
    _values, state = _small_state()

    def never():
        raise RuntimeError("device copy failed")

    saver = gs.AsyncSaver()
    saver.save(state, tmp_path, pack_below=64 << 10, staged={"layers.3.w": never})
    with pytest.raises(gs.StorageError, match="device copy failed") as e:
        saver.wait()
    assert "/packs/0/0" in str(e.value)
    assert not (tmp_path / "metadata.json").exists()
    assert os.listdir(tmp_path / "saves") == []


def test_shared_reads_of_packed_regions(tmp_path):
    values, root, _md, _pack = _packed(tmp_path)
    stats = [gs.IOStats(), gs.IOStats()]

    def load(comm):
        targets = {k: gs.ShardedTensor.from_offset(k, np.zeros_like(v), global_shape=v.shape,
                                                   global_offset=(0,) * v.ndim) for k, v in values.items()}
        gs.load(targets, root, comm=comm, shared_reads=True, stats=stats[comm.rank])
        return {k: t.data for k, t in targets.items()}

    results = run_ranks(2, load)
    for got in results:
        assert isinstance(got, dict), got
        for k, v in got.items():
            assert np.array_equal(v, values[k]), k
    assert sum(s.bytes_received for s in stats) > 0
    assert sum(s.bytes_sent for s in stats) == sum(s.bytes_received for s in stats)


def test_cli_inspect_counts_packs(tmp_path, capsys):
    from globalshard import cli

    values, root, _md, _pack = _packed(tmp_path)
    assert cli.main(["inspect", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["packs"] == 1 and doc["packed_regions"] == len(values) - 1 and doc["regions"] == len(values)
    assert cli.main(["verify", str(root)]) == 0
