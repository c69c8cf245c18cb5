"""Shards written around the page cache (``O_DIRECT``), as the writer process
of an asynchronous save writes them: every inner chunk at a multiple of 4096
bytes, found through the shard index, read back exactly by localio and by
TensorStore, damage still caught, and no page of them left in the cache."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from globalshard.format import zarr
from globalshard.geometry import Box
from globalshard.io import localio
from globalshard.io.localio import read, unbuffered
from globalshard.io.localio.unbuffered import BLOCK

DTYPES = ["float32", "float16", "int8", "float64", "uint16"]


def write(directory, array, dtype, *, buffered=False, cut=()):
    """``array`` stored as one region at ``directory`` by localio (``cut``: the axes its tensor was
    cut along, (0,) for chunks of whole rows); its zarr.json's layout."""
    doc = zarr.zarr_json(dtype, array.shape, {"globalshard": {"key": "w", "offset": [0] * array.ndim,
                                                              "save_id": "s"}}, cut=cut)
    for f in localio.write_array(directory, array, doc, localio.pool(), unbuffered=not buffered):
        f.result()
    return localio.parse(directory, doc)


def shard_index(layout):
    path = layout.file_of((0,) * len(layout.shape))
    count = int(np.prod([o // i for o, i in zip(layout.outer, layout.inner)]))
    with open(path, "rb") as f:
        data = f.read()
    return np.frombuffer(data[len(data) - 16 * count - 4:-4], "<u8").reshape(count, 2), len(data)


def source(value, how):
    """``value`` as the writer meets it: in page-aligned memory (the staging pool), at an address
    off the page, or strided."""
    if how == "aligned":
        out = unbuffered.aligned(value.nbytes).view(value.dtype).reshape(value.shape)
    elif how == "unaligned":
        out = unbuffered.aligned(value.nbytes + 64)[64:].view(value.dtype).reshape(value.shape)
    else:
        out = np.empty(value.shape[::-1], value.dtype).T
    out[...] = value
    return out


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), dtype=st.sampled_from(DTYPES),
       limit=st.sampled_from([64, 100, 4096, 5000, 1 << 20]), how=st.sampled_from(["aligned", "unaligned", "strided"]),
       cut=st.sampled_from([(), (0,)]))
def test_property_an_unbuffered_shard_reads_back_exactly_everywhere(shape, dtype, limit, how, cut):
    # Small chunk limits make these arrays shards of many chunks: partial edge
    # chunks, chunks smaller and larger than a block, rows that do not fill one.
    directory = tempfile.mkdtemp()
    saved = zarr.CHUNK_BYTES
    try:
        zarr.CHUNK_BYTES = limit
        rng = np.random.default_rng(len(shape) * 1000 + limit)
        value = rng.integers(-100, 100, size=shape).astype(dtype)
        layout = write(directory, source(value, how), dtype, cut=cut)
        if layout.inner is None:  # one chunk: written as before (only shards go around the cache)
            return
        index, size = shard_index(layout)
        chunk_bytes = int(np.prod(layout.inner)) * value.itemsize
        assert (index[:, 0] % BLOCK == 0).all() and (index[:, 1] == chunk_bytes + 4).all()
        assert size == len(index) * unbuffered.stride(chunk_bytes) + 16 * len(index) + 4  # cut to its end
        got = np.zeros_like(value)
        box = Box((0,) * value.ndim, value.shape)
        assert localio.Reader(localio.pool()).read([(layout, box, got, box)])[1] == []
        assert np.array_equal(got, value)
        stored = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": directory + "/"},
                          "fill_missing_data_reads": False}).result()
        assert np.array_equal(stored.read().result(), value)
        assert localio.Reader(localio.pool()).verify(layout)[1] == []
    finally:
        zarr.CHUNK_BYTES = saved
        shutil.rmtree(directory, ignore_errors=True)


def _filesystem(path):
    """The file system type of the mount holding ``path`` (from /proc/self/mounts)."""
    best, kind = "", ""
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            mount, fs = line.split()[1:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fs
    return kind


def _cached(path):
    """Whether the first block of ``path`` is in the page cache (a read that must not wait succeeds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(BLOCK)], 0, read._NOWAIT) > 0
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not read._NOWAIT or not hasattr(os, "O_DIRECT"), reason="no RWF_NOWAIT or O_DIRECT here")
def test_an_unbuffered_shard_leaves_no_page_in_the_cache_and_a_buffered_one_does(tmp_path):
    if _filesystem(tmp_path) in ("tmpfs", "ramfs", ""):
        pytest.skip(f"{tmp_path} is in memory: every page of it is the page cache")
    value = source(np.arange(1 << 20, dtype=np.float32).reshape(512, 2048), "aligned")
    files = {}
    for name, buffered in (("direct", False), ("buffered", True)):
        layout = write(str(tmp_path / name), value, "float32", buffered=buffered)
        files[name] = layout.file_of((0, 0))
    assert not _cached(files["direct"])  # written from the array's pages to the disk
    assert _cached(files["buffered"])


def test_a_file_system_without_o_direct_gets_the_same_file_buffered(tmp_path, monkeypatch):
    value = source(np.arange(600 * 700, dtype=np.float32).reshape(600, 700), "aligned")
    write(str(tmp_path / "direct"), value, "float32")
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(unbuffered.os, "open", no_direct)
    layout = write(str(tmp_path / "plain"), value, "float32")
    monkeypatch.undo()
    path = layout.file_of((0, 0))
    with open(path, "rb") as f, open(path.replace("plain", "direct"), "rb") as g:
        assert f.read() == g.read()


def _written_despite_refusals(tmp_path, monkeypatch, cleared_first: bool) -> None:
    """Every unbuffered write is refused with EINVAL (``cleared_first``: after
    the file was made buffered, as another thread handling its own refusal
    would); the file must still hold the bytes an unrefused write gives."""
    import fcntl

    value = source(np.arange(600 * 700, dtype=np.float32).reshape(600, 700), "aligned")
    write(str(tmp_path / "direct"), value, "float32")
    real = unbuffered._pwritev
    refused = []

    def picky(fd, buffers, offset):
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & os.O_DIRECT:
            refused.append(offset)
            if cleared_first:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(unbuffered, "_pwritev", picky)
    layout = write(str(tmp_path / "refused"), value, "float32")
    monkeypatch.undo()
    assert refused  # it was tried
    path = layout.file_of((0, 0))  # the same file of the unrefused write: the prefix replaced, not a name inside
    with open(path, "rb") as f, open(path.replace(str(tmp_path / "refused"), str(tmp_path / "direct")), "rb") as g:
        assert f.read() == g.read()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_a_write_the_disk_refuses_unbuffered_is_written_buffered(tmp_path, monkeypatch):
    # A disk whose blocks are larger than 4096 bytes refuses the aligned writes
    # with EINVAL: the file is written buffered from there on, the same bytes.
    _written_despite_refusals(tmp_path, monkeypatch, cleared_first=False)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_a_refused_write_is_written_again_when_another_thread_made_the_file_buffered_first(tmp_path, monkeypatch):
    # Threads write parts of one file at once. Two writes refused while the file was unbuffered:
    # the first thread to handle its refusal clears O_DIRECT, and the second then found the flag
    # gone and raised the EINVAL (seen in CI).
    _written_despite_refusals(tmp_path, monkeypatch, cleared_first=True)


def test_other_write_errors_are_raised(tmp_path, monkeypatch):
    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(unbuffered, "_pwritev", full)
    with pytest.raises(OSError, match="No space"):
        write(str(tmp_path / "full"), source(np.ones((600, 700), np.float32), "aligned"), "float32")


@pytest.mark.parametrize("where", ["chunk", "checksum", "index"])
def test_damage_in_an_unbuffered_shard_is_named(tmp_path, where):
    value = source(np.arange(600 * 700, dtype=np.float32).reshape(600, 700), "aligned")
    layout = write(str(tmp_path / "a"), value, "float32")
    index, size = shard_index(layout)
    at = {"chunk": int(index[1, 0]) + 100, "checksum": int(index[1, 0] + index[1, 1]) - 2, "index": size - 10}[where]
    path = layout.file_of((0, 0))
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = localio.Reader(localio.pool()).verify(layout)[1]
    assert len(problems) == 1
    assert ("shard index" in str(problems[0])) == (where == "index")
    if where != "index":  # the second chunk of (600, 350), where the byte was changed
        assert str(problems[0]).startswith(f"{path} (inner chunk [0, 1]): the chunk fails its crc32c")


def test_chunks_apart_by_their_padding_are_still_read_in_one_run_and_each_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(zarr, "CHUNK_BYTES", 64 << 10)
    value = source(np.arange(128 * 2048, dtype=np.float32).reshape(128, 2048), "aligned")
    layout = write(str(tmp_path / "a"), value, "float32", cut=(0,))  # row chunks: contiguous in the target
    index, _ = shard_index(layout)
    assert len(index) == 16 and (np.diff(index[:, 0].astype(np.int64)) > index[0, 1]).all()  # apart
    monkeypatch.setattr(read, "_NOWAIT", 0)  # every read blocks: runs are what is left to see
    calls = []
    real = os.preadv

    def counting(fd, buffers, offset, *flags):
        calls.append(offset)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", counting)
    box = Box((0, 0), value.shape)

    def load():
        calls.clear()
        got = np.zeros_like(value)
        return got, localio.Reader(localio.pool()).read([(layout, box, got, box)])[1]

    got, problems = load()
    assert problems == [] and np.array_equal(got, value)
    assert len(calls) == 1  # 16 chunks and the 15 gaps between them: one preadv (after the index's)
    with open(layout.file_of((0, 0)), "r+b") as f:
        f.seek(int(index[5, 0]) + 7)
        f.write(b"\xff")
    _, problems = load()
    assert [str(p) for p in problems] == [f"{layout.file_of((0, 0))} (inner chunk [5, 0]): the chunk fails its "
                                          "crc32c checksum (damaged file)"]


def test_copied_chunks_go_through_a_buffer_of_about_one_chunk_whatever_the_batch(tmp_path):
    # The writer process's memory beside the staging pool: each I/O thread holds one such buffer.
    value = source(np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048), "strided")  # every chunk copied
    step = unbuffered.stride(1 << 20)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        batch = [(i, j) for i in range(4) for j in range(4)]  # (512, 512) chunks: 16 MiB in one batch
        unbuffered._write_chunks(fd, value, batch, 0, (512, 512), step)
    finally:
        os.close(fd)
    assert unbuffered._local.buf.nbytes == max(step, unbuffered.SCRATCH_BYTES)
    data = np.fromfile(tmp_path / "f", np.uint8)
    assert len(data) == 16 * step
    for k, (i, j) in enumerate(batch):  # each chunk where its index will say, in C order
        got = data[k * step:k * step + (1 << 20)].view(np.float32).reshape(512, 512)
        assert np.array_equal(got, value[i * 512:(i + 1) * 512, j * 512:(j + 1) * 512])
