"""Corruption: every file a checkpoint holds (each chunk and shard file, each
zarr.json, metadata.json, the trainer state) is damaged in five ways, and
four readers (a full load, a partial load, read_array, verify) each either
raise a GlobalShardError that names the damaged file, or return exactly the
saved values (a damage that changes nothing that is read, such as a fill
value no read uses). Never zeros, never wrong values, never a raw
TensorStore or OS exception.

CI damages every file; set GLOBALSHARD_RELIABILITY_REPORT to record counts.
"""

import json
import os
import shutil

import numpy as np
import pytest
import saver

import globalshard as gs

DAMAGES = ["flip", "truncate", "empty", "delete", "symlink-out"]
REPORT = os.environ.get("GLOBALSHARD_RELIABILITY_REPORT")


def _damage(path, how, outside):
    data = path.read_bytes()
    if how == "flip":
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:])
    elif how == "truncate":
        path.write_bytes(data[: max(0, len(data) - 7)])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "delete":
        path.unlink()
    else:  # a symlink to an identical copy outside the checkpoint
        copy = outside / f"copy-{abs(hash(str(path)))}"
        copy.write_bytes(data)
        path.unlink()
        path.symlink_to(copy)


def _partial_targets():
    half = saver.ROWS // 2
    out = {f"k{k}": gs.ShardedTensor.from_offset(f"layer{k}.w", np.zeros((half, saver.COLS), np.float32),
                                                 global_shape=(saver.ROWS, saver.COLS), global_offset=(0, 0))
           for k in range(saver.KEYS)}
    out["big"] = gs.ShardedTensor.from_offset("big", np.zeros((256, saver.BIG[1]), np.float32),
                                              global_shape=saver.BIG, global_offset=(0, 0))
    return out


def _readers(ckpt):
    def full():
        assert saver.whose(ckpt) == 1

    def partial():
        t = _partial_targets()
        gs.load(t, ckpt)
        for k in range(saver.KEYS):
            assert np.array_equal(t[f"k{k}"].data, saver.expected(1, k)[: saver.ROWS // 2]), k
        assert np.array_equal(t["big"].data, saver.expected(1, "big")[:256])

    def read_array():
        for k in range(saver.KEYS):
            assert np.array_equal(gs.read_array(ckpt, f"layer{k}.w"), saver.expected(1, k)), k
        assert np.array_equal(gs.read_array(ckpt, "big", (slice(700, 900),)), saver.expected(1, "big")[700:900])

    def verify():
        problems, _ = gs.Checkpoint(ckpt).verify()
        if problems:
            raise gs.StorageError("\n".join(problems))

    return {"full load": full, "partial load": partial, "read_array": read_array, "verify": verify}


def _files(root):
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            if f != ".globalshard.lock":
                out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def _names(message, rel):
    """Whether an error message names the damaged file: itself, its array's
    directory, or (for metadata.json) the JSON path or a key it holds."""
    if rel == "metadata.json":
        return True  # the parser names the JSON path; a renamed key is named as missing
    parts = rel.split("/")
    candidates = {rel}
    for kind in ("arrays", "packs"):
        if kind in parts:
            i = parts.index(kind)
            candidates.add("/".join(parts[: i + 3]))  # saves/<id>/arrays/<dir>/<n>, saves/<id>/packs/<rank>/<n>
    return any(c in message for c in candidates)


@pytest.fixture(scope="module", params=[0, 1 << 20], ids=["arrays", "packed"])
def base(tmp_path_factory, request):
    # Packed: the twelve 128 KiB layer regions share one pack of two 1 MiB-or-less inner chunks.
    root = tmp_path_factory.mktemp("corruption") / "base"
    saver.save_stamped(root, 1, pack_below=request.param)
    return root


@pytest.mark.parametrize("how", DAMAGES)
def test_every_file_every_damage_every_reader(base, tmp_path, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    detected = harmless = 0
    files = _files(base)
    packed = any("/packs/" in f for f in files)
    assert len(files) >= (7 if packed else 25) and "metadata.json" in files
    for n, rel in enumerate(files):
        ckpt = tmp_path / f"c{n}"
        shutil.copytree(base, ckpt, symlinks=True)
        _damage(ckpt / rel, how, outside)
        for reader, call in _readers(ckpt).items():
            try:
                call()
            except gs.GlobalShardError as e:
                assert _names(str(e), rel), f"{how} {rel}, {reader}: the error does not name the file: {e}"
                detected += 1
                continue
            except AssertionError as e:
                raise AssertionError(f"{how} {rel}, {reader}: WRONG VALUES loaded: {e}") from None
            except Exception as e:
                raise AssertionError(f"{how} {rel}, {reader}: a raw {type(e).__name__}: {e}") from None
            harmless += 1  # the exact saved values came back
        shutil.rmtree(ckpt)
    if how in ("delete", "empty", "truncate", "symlink-out"):
        # Whole-file damage: every reader that touches the file fails.
        assert detected >= len(files), (detected, harmless)
    _record(how + (" (packed)" if packed else ""), len(files), detected, harmless)


def _record(how, files, detected, harmless):
    if REPORT:
        data = json.load(open(REPORT)) if os.path.exists(REPORT) else {}
        data.setdefault("corruption", {})[how] = {"files": files, "reads": 4 * files, "detected": detected,
                                                 "exact_values": harmless, "wrong_values": 0}
        json.dump(data, open(REPORT, "w"), indent=1)
