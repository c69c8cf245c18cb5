"""The ``globalshard`` command: look at, check, compare, copy and export checkpoints.

    globalshard inspect PATH                 tensors, dtypes, shapes, regions, trainer state keys
    globalshard verify PATH [--workers N]    read every stored byte, checksums verified
    globalshard diff A B [--atol X]          keys, dtypes, shapes and values that differ
    globalshard copy PATH OUT [--overwrite] [--drop PATTERN]  a standalone copy: arrays in bases copied in
    globalshard export PATH OUT --format safetensors [--dtype bf16] [--max-shard-size 5GB]
                       [--map NAME|FILE] [--param heads=32]

Every verb takes ``--json`` (one JSON document on stdout) and ``--kvstore
SPEC`` (a TensorStore kvstore URL or JSON spec; PATH is then relative inside
it). Progress bars go to stderr when it is a terminal.

Exit status: 0 success (``diff``: no difference); 1 the checkpoint is
invalid, damaged or unreadable (``diff``: a difference was found); 2 usage
errors (bad arguments, a bad mapping or dtype); 3 ``diff`` could not read
one of its checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from importlib import metadata as importlib_metadata
from typing import Any

import numpy as np

from globalshard.checkpoint import Checkpoint, copy, read_metadata
from globalshard.checkpoint.copying import without_keys
from globalshard.dtypes import numpy_dtype
from globalshard.errors import GlobalShardError
from globalshard.geometry import Box

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_TROUBLE = 0, 1, 2, 3

#: Bytes of each tensor ``diff`` holds at once (per checkpoint).
DIFF_WINDOW_BYTES = 64 << 20


def _progress(total: int, what: str, args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=None if not args.json else True, leave=False)


def _open(path: str, args: argparse.Namespace) -> Checkpoint:
    return Checkpoint(path, kvstore=args.kvstore)


def _emit(args: argparse.Namespace, doc: dict[str, Any], text: list[str]) -> None:
    if args.json:
        json.dump(doc, sys.stdout, indent=1, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        print("\n".join(text))


# --------------------------------------------------------------------------- verbs


def _inspect(args: argparse.Namespace) -> int:
    ckpt = _open(args.path, args)
    md, trainer = ckpt.metadata, ckpt.trainer_state
    total = sum(r.nbytes for t in md.tensors.values() for r in t.regions)
    regions = sum(len(t.regions) for t in md.tensors.values())
    packed = [r for t in md.tensors.values() for r in t.regions if r.byte_offset is not None]
    packs = len({r.path for r in packed})
    referenced = [r for t in md.tensors.values() for r in t.regions if r.base is not None]
    bases: list[dict[str, Any]] = [{"root": b.root, "save_id": b.save_id,
                                    "bytes": sum(r.nbytes for r in referenced if r.base == i)}
                                   for i, b in enumerate(md.bases)]
    doc = {"path": args.path, "format_version": md.version, "save_id": md.save_id, "bytes": total,
           "bytes_in_bases": sum(r.nbytes for r in referenced), "bases": bases,
           "regions": regions, "packed_regions": len(packed), "packs": packs, "trainer_state_keys": sorted(trainer),
           "tensors": {k: {"dtype": t.dtype, "global_shape": list(t.global_shape), "regions": len(t.regions),
                           "bytes": sum(r.nbytes for r in t.regions)} for k, t in sorted(md.tensors.items())}}
    width = max((len(k) for k in md.tensors), default=3)
    text = [f"{args.path}: globalshard format {md.version}, {len(md.tensors)} tensors, "
            f"{regions} stored regions{f' ({len(packed)} of them in {packs} packs)' if packs else ''}, "
            f"{total / 2**20:.2f} MiB",
            f"{'key':{width}}  {'dtype':14} {'global shape':20} {'regions':>7} {'MiB':>9}"]
    for key in sorted(md.tensors):
        t = md.tensors[key]
        mib = sum(r.nbytes for r in t.regions) / 2**20
        text.append(f"{key:{width}}  {t.dtype:14} {t.global_shape!s:20} {len(t.regions):7d} {mib:9.3f}")
    for b in bases:
        text.append(f"base {b['root']} (save {b['save_id']}): {b['bytes'] / 2**20:.2f} MiB of the regions")
    text.append(f"trainer_state.json: {_keys(trainer) if trainer else 'none'}")
    _emit(args, doc, text)
    return EXIT_OK


def _keys(state: dict[str, Any], shown: int = 8) -> str:
    """A trainer state's keys, and those of each dict one level down (the torch
    adapter keeps a state dict's values under ``state_dict_values``)."""
    def some(keys: list[str]) -> str:
        return ", ".join(keys[:shown]) + (f", ... ({len(keys)})" if len(keys) > shown else "")

    return some([f"{k} {{{some(sorted(map(str, v)))}}}" if isinstance(v, dict) and v else k for k, v in
                 sorted(state.items())])


def _verify(args: argparse.Namespace) -> int:
    ckpt = _open(args.path, args)  # parses metadata.json and checks the trainer state's SHA-256
    total = sum(r.nbytes for t in ckpt.metadata.tensors.values() for r in t.regions)
    start = time.perf_counter()
    with _progress(total, "verify", args) as bar:
        failures, nbytes = ckpt.verify(workers=args.workers, progress=bar.update)
    seconds = time.perf_counter() - start
    regions = sum(len(t.regions) for t in ckpt.metadata.tensors.values())
    doc = {"path": args.path, "ok": not failures, "regions": regions, "bytes_read": nbytes,
           "seconds": round(seconds, 3), "problems": failures}
    if failures and not args.json:
        print(f"{len(failures)} damaged region(s):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
    _emit(args, doc, [] if failures else
          [f"OK: {regions} regions, {nbytes / 2**20:.2f} MiB read and checksummed in {seconds:.2f}s"])
    return EXIT_BAD if failures else EXIT_OK


def _compare(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    """(bit-identical, max |a - b| over elements not both NaN; NaN if one side is)."""
    identical = a.tobytes() == b.tobytes()
    if identical or a.size == 0:
        return identical, 0.0
    if a.dtype.kind in "iub":
        x, y = a.astype(np.int64 if a.dtype != np.uint64 else np.float64), b.astype(
            np.int64 if b.dtype != np.uint64 else np.float64)
        return False, float(np.max(np.abs(x - y)))
    x, y = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), b.astype(
        np.complex128 if b.dtype.kind == "c" else np.float64)
    both_nan = np.isnan(x) & np.isnan(y)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x - y)
    d = np.where(both_nan | (x == y), 0.0, d)  # equal infinities differ by 0
    return False, float(np.max(d))


def _diff(args: argparse.Namespace) -> int:
    try:
        a, b = _open(args.a, args), _open(args.b, args)
    except GlobalShardError as e:
        print(f"globalshard diff: {e}", file=sys.stderr)
        return EXIT_TROUBLE
    ta, tb = a.metadata.tensors, b.metadata.tensors
    only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
    mismatched: list[dict[str, Any]] = []
    compared: list[dict[str, Any]] = []
    common = sorted(set(ta) & set(tb))
    same = [k for k in common if ta[k].dtype == tb[k].dtype and ta[k].global_shape == tb[k].global_shape]
    for k in common:
        if k not in same:
            mismatched.append({"key": k, "a": {"dtype": ta[k].dtype, "shape": list(ta[k].global_shape)},
                               "b": {"dtype": tb[k].dtype, "shape": list(tb[k].global_shape)}})
    total = sum(math.prod(ta[k].global_shape) * numpy_dtype(ta[k].dtype).itemsize for k in same)
    try:
        with _progress(2 * total, "diff", args) as bar:
            for k in same:
                identical, worst = True, 0.0
                itemsize = numpy_dtype(ta[k].dtype).itemsize
                for box in Box.full(ta[k].global_shape).row_windows(itemsize, DIFF_WINDOW_BYTES):
                    same_bits, d = _compare(a.read_array(k, box), b.read_array(k, box))
                    identical &= same_bits
                    worst = max(worst, d) if not (math.isnan(d) or math.isnan(worst)) else math.nan
                    bar.update(2 * box.volume * itemsize)
                compared.append({"key": k, "identical": identical, "max_abs_diff": worst})
    except GlobalShardError as e:
        print(f"globalshard diff: {e}", file=sys.stderr)
        return EXIT_TROUBLE
    differing = [c for c in compared if not c["identical"] and (math.isnan(c["max_abs_diff"])
                                                                or c["max_abs_diff"] > args.atol)]
    doc = {"a": args.a, "b": args.b, "only_in_a": only_a, "only_in_b": only_b, "dtype_or_shape": mismatched,
           "values": [c | {"max_abs_diff": _json_float(c["max_abs_diff"])} for c in compared],
           "differ": bool(only_a or only_b or mismatched or differing)}
    text = [f"only in {args.a}: {k}" for k in only_a] + [f"only in {args.b}: {k}" for k in only_b]
    text += [f"{m['key']}: {m['a']['dtype']} {m['a']['shape']} vs {m['b']['dtype']} {m['b']['shape']}"
             for m in mismatched]
    text += [f"{c['key']}: max |a - b| = {c['max_abs_diff']:.6g}" for c in differing]
    text.append(f"{'differ' if doc['differ'] else 'same'}: {len(compared)} tensors compared"
                f"{f', {len(compared) - len(differing)} within --atol {args.atol}' if args.atol else ''}")
    _emit(args, doc, text)
    return EXIT_BAD if doc["differ"] else EXIT_OK


def _json_float(x: float) -> float | str:
    return "nan" if math.isnan(x) else x


def _copy(args: argparse.Namespace) -> int:
    source = read_metadata(args.path, kvstore=args.kvstore)  # its trainer state is read by the copy
    drop = args.drop or []
    kept = without_keys(source, drop).tensors.values()  # a bad pattern is refused before the bar shows
    start = time.perf_counter()
    with _progress(sum(r.nbytes for t in kept for r in t.regions), "copy", args) as bar:
        copied = copy(args.path, args.out, kvstore=args.kvstore, overwrite=args.overwrite, progress=bar.update,
                      drop=drop)
    seconds = time.perf_counter() - start
    from_bases = sum(r.nbytes for t in kept for r in t.regions if r.base is not None)
    doc = {"path": args.path, "out": args.out, "save_id": copied.save_id, "bytes": copied.stored_bytes(),
           "bytes_from_bases": from_bases, "bases": [b.root for b in source.bases], "seconds": round(seconds, 3),
           "dropped": len(source.tensors) - len(copied.tensors)}
    text = [f"{args.out}: {copied.stored_bytes() / 2**20:.2f} MiB in {seconds:.1f} s, "
            f"{from_bases / 2**20:.2f} MiB of it from "
            f"{', '.join(b.root for b in source.bases) if source.bases else 'no base'}; it stands alone"]
    _emit(args, doc, text)
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from globalshard.hf import ExportError, NameMapping, export, parse_size

    try:
        params: dict[str, float] = {}
        for p in args.param or []:
            name, _, value = p.partition("=")
            try:
                params[name] = int(value) if re.fullmatch(r"\d+", value) else float(value)
            except ValueError:
                raise ExportError(f"--param {p!r}: expected NAME=NUMBER") from None
            if not name or not math.isfinite(params[name]):
                raise ExportError(f"--param {p!r}: expected NAME=NUMBER")
        mapping = NameMapping.load(args.map, params) if args.map else (
            NameMapping({"tensors": [{"key": "{name}", "name": "{name}"}]}, params=params))
        size = parse_size(args.max_shard_size)
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype or "", args.dtype)
        if dtype is not None:
            numpy_dtype(dtype)
    except (ExportError, TypeError) as e:
        print(f"globalshard export: {e}", file=sys.stderr)
        return EXIT_USAGE
    ckpt = _open(args.path, args)
    total = sum(math.prod(t.global_shape) * numpy_dtype(t.dtype).itemsize for t in ckpt.metadata.tensors.values())
    start = time.perf_counter()
    try:
        with _progress(total, "export", args) as bar:
            index = export(ckpt, args.out, mapping=mapping, dtype=dtype, max_shard_size=size, progress=bar.update)
    except ExportError as e:
        print(f"globalshard export: {e}", file=sys.stderr)
        return EXIT_USAGE
    files = sorted(set(index["weight_map"].values()))
    doc = {"out": args.out, "tensors": len(index["weight_map"]), "files": files,
           "bytes": index["metadata"]["total_size"], "seconds": round(time.perf_counter() - start, 3),
           "skipped": index["skipped"], "merged": index["merged"],
           "config": "config.json" if index["config"] is not None else None}
    lines = [f"wrote {len(index['weight_map'])} tensors, {doc['bytes'] / 2**20:.2f} MiB in "
             f"{len(files)} file(s) + model.safetensors.index.json to {args.out}"]
    if index["config"] is not None:
        kind = index["config"].get("architectures") or []
        lines.append("wrote config.json" + (f" ({', '.join(map(str, kind))})" if kind else ""))
    if index["merged"]:
        lines.append(f"merged {len(index['merged'])} adapter keys into the tensors they adapt: "
                     f"{', '.join(index['merged'][:8])}{' ...' if len(index['merged']) > 8 else ''}")
    if index["skipped"]:
        lines.append(f"skipped {len(index['skipped'])} keys the mapping leaves out: "
                     f"{', '.join(index['skipped'][:8])}{' ...' if len(index['skipped']) > 8 else ''}")
    _emit(args, doc, lines)
    return EXIT_OK


# --------------------------------------------------------------------------- main


def _kvstore(text: str) -> Any:
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON kvstore spec: {e}") from None
    return text


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    common.add_argument("--kvstore", type=_kvstore, default=None,
                        help="TensorStore kvstore (URL or JSON spec) the paths are relative to")
    parser = argparse.ArgumentParser(prog="globalshard", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit status: 0 ok; 1 invalid, damaged or different; 2 usage; "
                                            "3 diff could not read a checkpoint")
    parser.add_argument("--version", action="version", version=f"globalshard {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", parents=[common], help="list the tensors of a checkpoint")
    p.add_argument("path", help="checkpoint directory or kvstore URL")
    p = sub.add_parser("verify", parents=[common], help="read and checksum every stored region")
    p.add_argument("path")
    p.add_argument("--workers", type=int, default=4, help="arrays verified at once (default 4)")
    p = sub.add_parser("diff", parents=[common], help="compare two checkpoints tensor by tensor")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="values within this are not a difference")
    p = sub.add_parser("copy", parents=[common], help="copy a checkpoint with the arrays its bases hold for it")
    p.add_argument("path")
    p.add_argument("out", help="the copy's path (a new checkpoint root)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at OUT")
    p.add_argument("--drop", action="append", metavar="PATTERN",
                   help="leave out the keys this fnmatch pattern matches (repeat it), e.g. 'optimizer.*'")
    p = sub.add_parser("export", parents=[common], help="write the tensors as Hugging Face safetensors")
    p.add_argument("path")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--dtype", help="convert floating-point tensors (bf16, fp16, fp32 or a dtype name)")
    p.add_argument("--max-shard-size", default="5GB", help="bytes per file (default 5GB)")
    from globalshard.hf.naming import shipped_mappings

    p.add_argument("--map", help=f"a mapping file, or a shipped one by name ({', '.join(shipped_mappings())})")
    p.add_argument("--param", action="append", help="NAME=NUMBER for the mapping (repeatable)")
    args = parser.parse_args(argv)
    command = {"inspect": _inspect, "verify": _verify, "diff": _diff, "copy": _copy, "export": _export}[args.command]
    try:
        return command(args)
    except GlobalShardError as e:
        if args.json:
            json.dump({"error": str(e), "type": type(e).__name__}, sys.stdout)
            sys.stdout.write("\n")
        print(f"globalshard {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD


def _version() -> str:
    try:
        return importlib_metadata.version("globalshard")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
