"""The bare writers bench/training.py sets the AsyncSaver beside: the chunked
one, the floor of any checksummed writer of the format, must do the work the
format asks and no less, or its figure says nothing."""

import json
import os
import sys

import numpy as np
from repo import ROOT

import globalshard as gs
from globalshard.io.localio.unbuffered import stride

sys.path.insert(0, os.path.join(ROOT, "bench"))

import training


def _bare(tmp_path, tensors, **kind):
    writer = training._RawWriter(sum(t.nbytes for t in tensors), **kind)
    try:
        writer.save(tensors, str(tmp_path / "bare" / "s0"))
        writer.wait()
    finally:
        writer.close()
    return (tmp_path / "bare" / "s0").read_bytes()


def test_the_chunked_bare_writer_writes_the_chunks_an_async_save_stores(tmp_path):
    rng = np.random.default_rng(0)
    # A whole 2048 x 2048 float32 (16 square chunks of 512 x 512), one with edge chunks, one of one chunk.
    tensors = [rng.standard_normal((2048, 2048)).astype(np.float32),
               rng.standard_normal((1000, 701)).astype(np.float32), rng.standard_normal(2048).astype(np.float32)]
    bare = _bare(tmp_path, tensors, chunked=True)
    saver = gs.AsyncSaver("thread")  # writes its shards unbuffered, as the writer process does
    state = {f"t{i}": gs.ShardedTensor.from_offset(f"t{i}", t, global_shape=t.shape, global_offset=(0,) * t.ndim)
             for i, t in enumerate(tensors)}
    saver.save(state, str(tmp_path / "ckpt"))
    saver.wait()
    metadata = gs.read_metadata(str(tmp_path / "ckpt"))
    position = 0
    for i, t in enumerate(tensors):
        (region,) = metadata.tensors[f"t{i}"].regions
        chunks = os.path.join(tmp_path, "ckpt", region.path, "c", *["0"] * t.ndim)
        stored = open(chunks, "rb").read()
        if t.nbytes > 1 << 20:  # a shard: its inner chunks, then its index, which the bare writer leaves out
            doc = json.loads(open(os.path.join(tmp_path, "ckpt", region.path, "zarr.json")).read())
            shape = doc["codecs"][0]["configuration"]["chunk_shape"]
            count = int(np.prod([-(-s // c) for s, c in zip(t.shape, shape)]))
            body = count * stride(int(np.prod(shape)) * 4)
        else:  # one chunk and its crc32c, padded by the bare writer to the next 4096 bytes
            body = len(stored)
        assert bare[position:position + body] == stored[:body], f"t{i}"
        position += body if t.nbytes > 1 << 20 else stride(t.nbytes)
    assert position == len(bare)


def test_the_plain_bare_writers_write_the_bytes_back_to_back(tmp_path):
    tensors = [np.arange(3000, dtype=np.float32), np.ones((5, 7), np.float64)]
    want = b"".join(t.tobytes() for t in tensors)
    assert _bare(tmp_path, tensors)[:len(want)] == want
    direct = _bare(tmp_path, tensors, direct=True)
    assert direct[:len(want)] == want and not any(direct[len(want):])
