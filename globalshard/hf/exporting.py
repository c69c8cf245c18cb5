"""Export: a checkpoint's global tensors as Hugging Face safetensors files.

Each tensor is read and written in windows of :data:`WINDOW_BYTES`, so
memory stays at one window whatever the model's size.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from globalshard.checkpoint import Checkpoint
from globalshard.dtypes import canonical_name, numpy_dtype
from globalshard.geometry import Box
from globalshard.hf.adapters import b_rows
from globalshard.hf.config import hf_config
from globalshard.hf.naming import ExportError, NameMapping
from globalshard.hf.patterns import to_halves
from globalshard.hf.pieces import HfTensor, _hf_shapes
from globalshard.hf.safetensors_file import SAFETENSORS_DTYPES

#: Bytes of one tensor read and written at a time by :func:`export`.
WINDOW_BYTES = 64 << 20


def export(checkpoint: str | Checkpoint, out: str, *, mapping: NameMapping | None = None, dtype: str | None = None,
           max_shard_size: int = 5 * 10**9, progress: Callable[[int], None] | None = None,
           kvstore: Any = None) -> dict[str, Any]:
    """Write the checkpoint's tensors as Hugging Face safetensors in ``out``.

    ``dtype`` converts floating-point tensors (integers and bools keep
    theirs); a narrowing conversion is what was asked for, so it is allowed.
    Files hold at most ``max_shard_size`` bytes of tensors (a larger tensor
    gets a file of its own). ``progress(nbytes)`` follows the reads. A
    mapping with a ``config`` also writes ``config.json``. What an earlier
    export left in ``out`` (``model*.safetensors`` files this export does
    not write, the index, and ``config.json`` when this export writes one)
    is replaced once the new files are in place, so that no reader picks a
    stale ``model.safetensors`` over the new index; nothing else in ``out``
    is touched. The files are written under temporary names and renamed
    only once all of them are written (the disk holds both exports until
    then): an export that fails (a damaged chunk, a value the ``dtype``
    cannot hold) leaves the earlier one whole.

    Raises:
        ExportError: the mapping does not fit, or a finite value would
            become infinite or NaN in ``dtype`` (float16 above 65504,
            float8_e4m3fn above 448): a broken model, not a rounded one.

    Returns:
        The index written to ``model.safetensors.index.json``, plus
        ``"skipped"``: the checkpoint keys the mapping's ``skip`` left out,
        ``"merged"``: the adapter keys merged into the tensors they adapt,
        and ``"config"``: the ``config.json`` written, or None.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint, kvstore=kvstore)
    tensors = ckpt.metadata.tensors
    mapping = mapping or NameMapping.identity()
    pieces, skipped = mapping.pieces({k: t.global_shape for k, t in tensors.items()})
    out_dtype = {}
    for p in pieces:
        stored = tensors[p.key].dtype
        want = canonical_name(np.dtype(numpy_dtype(dtype))) if dtype and _is_float(stored) else stored
        if want not in SAFETENSORS_DTYPES:
            raise ExportError(f"{p.key!r}: safetensors has no {want} (choose another with --dtype)")
        if p.lora is not None and not _is_float(stored):
            raise ExportError(f"{p.key!r}: an adapter merges into floating-point tensors only, not {stored}")
        out_dtype[p.name] = want
    config = hf_config(mapping, pieces, out_dtype)
    # Files of bounded size, in the order the mapping lists the tensors (a tensor: its pieces, in order).
    by_name: dict[str, list[HfTensor]] = {}
    for p in pieces:
        by_name.setdefault(p.name, []).append(p)
    files: list[list[HfTensor]] = [[]]
    size = 0
    for name, members in by_name.items():
        n = sum(p.box.volume for p in members) * numpy_dtype(out_dtype[name]).itemsize
        if files[-1] and size + n > max_shard_size:
            files.append([])
            size = 0
        files[-1] += members
        size += n
    os.makedirs(out, exist_ok=True)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    weight_map: dict[str, str] = {}
    total = 0
    written: list[tuple[str, str]] = []  # (temporary, final): renamed once every file is written
    try:
        for name, members in zip(names, files):
            final = os.path.join(out, name)
            written.append((f"{final}.tmp-{os.getpid()}", final))
            total += _write_file(ckpt, written[-1][0], members, out_dtype, progress)
            weight_map |= {p.name: name for p in members}
        for tmp, final in written:
            os.replace(tmp, final)
    finally:
        for tmp, _ in written:
            if os.path.exists(tmp):
                os.unlink(tmp)
    index = {"metadata": {"total_size": total, "format": "pt", "source": "globalshard",
                          "save_id": ckpt.metadata.save_id},
             "weight_map": dict(sorted(weight_map.items()))}
    if config is not None:
        _write_atomically(os.path.join(out, "config.json"), json.dumps(config, indent=2).encode("utf-8"))
    _write_atomically(os.path.join(out, "model.safetensors.index.json"),
                      json.dumps(index, indent=2).encode("utf-8"))
    for stale in sorted(os.listdir(out)):
        if _EXPORTED.fullmatch(stale) and stale not in names:
            os.unlink(os.path.join(out, stale))
    merged = sorted({key for p in pieces if p.lora is not None for key in p.lora[:2]})
    return {**index, "skipped": skipped, "merged": merged, "config": config}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000; ``"512MiB"``, ``"100kB"``, plain bytes.

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size("1000")
    (5000000000, 2097152, 1000)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKMGT]?i?B?)\s*", text)
    if not m:
        raise ExportError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * scale)


#: The files an export writes (and so may replace): one file, or numbered shards.
_EXPORTED = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _windows(ckpt: Checkpoint, p: HfTensor) -> Iterator[tuple[Box, np.ndarray]]:
    """The piece's values in Hugging Face's order, a window of rows at a time,
    with its adapter merged, its rotary rows in halves, its axes transposed;
    each with the box of the piece's array it holds."""
    stored = numpy_dtype(ckpt.metadata.tensors[p.key].dtype)
    if p.axes is not None:  # windows of the transposed tensor's rows, each read as the box of the array it is
        for hf_window in p.to_hf(p.box).row_windows(stored.itemsize, WINDOW_BYTES):
            window = p.from_hf(hf_window)
            yield window, _read(ckpt, p, window).transpose(p.axes)
        return
    if p.rotary is None and p.lora is None:
        for window in p.box.row_windows(stored.itemsize, WINDOW_BYTES):
            yield window, _read(ckpt, p, window)
        return
    rows = p.box.shape[0]
    unit = rows // p.rotary if p.rotary else 1  # whole heads per window
    row_bytes = math.prod(p.box.shape[1:]) * stored.itemsize
    step = max(1, WINDOW_BYTES // max(1, row_bytes * unit)) * unit
    a = ckpt.read_array(p.lora[0], Box.full(ckpt.metadata.tensors[p.lora[0]].global_shape)) if p.lora else None
    fused_b, index = None, None  # B of a fused tensor the checkpoint stores split: read whole, its rows picked
    if p.lora is not None and p.lora[3] is not None:
        fused_b = ckpt.read_array(p.lora[1], Box.full(ckpt.metadata.tensors[p.lora[1]].global_shape))
        index = b_rows(p.lora[3], fused_b.shape[0])
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        window = Box((p.box.offset[0] + r0, *p.box.offset[1:]), (n, *p.box.shape[1:]))
        buf = _read(ckpt, p, window)
        if p.lora is not None and a is not None:
            _, b_key, scale, _ = p.lora
            rank = a.shape[0]
            b = (fused_b[index[window.offset[0]:window.offset[0] + n]] if fused_b is not None and index is not None
                 else ckpt.read_array(b_key, Box((window.offset[0], 0), (n, rank))))
            cols = slice(window.offset[1], window.offset[1] + window.shape[1])
            merged = buf.astype(np.float64) + scale * (b.astype(np.float64) @ a[:, cols].astype(np.float64))
            buf = merged.astype(buf.dtype)
        if p.rotary is not None:
            buf = to_halves(buf, n // unit)
        yield window, buf


def _read(ckpt: Checkpoint, p: HfTensor, window: Box) -> np.ndarray:
    """``window`` of the piece's array (below a stacked key's leading axes)."""
    return ckpt.read_array(p.key, p.stored_box(window)).reshape(window.shape)


def _write_file(ckpt: Checkpoint, path: str, pieces: Sequence[HfTensor], out_dtype: Mapping[str, str],
                progress: Callable[[int], None] | None) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in _hf_shapes(pieces).items():  # a tensor's pieces are consecutive, in order
        n = math.prod(shape) * numpy_dtype(out_dtype[name]).itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[out_dtype[name]], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for p in pieces:
            stored = ckpt.metadata.tensors[p.key].dtype
            for window, buf in _windows(ckpt, p):
                if out_dtype[p.name] != stored:
                    with np.errstate(over="ignore", invalid="ignore"):  # checked below
                        converted = buf.astype(numpy_dtype(out_dtype[p.name]))
                    _refuse_overflow(p, window, buf, converted, stored, out_dtype[p.name])
                    buf = converted
                if buf.size:  # little-endian bytes, written from the array itself (no copy)
                    f.write(np.ascontiguousarray(buf.astype(buf.dtype.newbyteorder("<"), copy=False))
                            .reshape(-1).view(np.uint8).data)
                if progress is not None:
                    progress(window.volume * numpy_dtype(stored).itemsize)
        f.flush()
        os.fsync(f.fileno())
    return offset


def _refuse_overflow(p: HfTensor, window: Box, buf: np.ndarray, converted: np.ndarray, stored: str,
                     dtype: str) -> None:
    """Raise naming the first finite value of ``buf`` (a window of piece ``p``, in Hugging Face's
    order) that ``converted`` holds as inf or NaN, at its place in the Hugging Face tensor."""
    bad = np.isfinite(buf) & ~np.isfinite(converted)
    if not bad.any():
        return
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    where = [s + i for s, i in zip(p.to_hf(window).offset, at)]
    name = repr(p.name) if p.name == p.key else f"{p.name!r} (checkpoint key {p.key!r})"
    raise ExportError(f"{name}: {where} is {float(buf[at]):g} in {stored}, {float(converted[at])} in {dtype}, "
                      f"which cannot hold it: export in a wider dtype (bfloat16 has float32's range)")


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

