"""Command line: look at a checkpoint, or check every stored byte of it.

    globalshard inspect PATH      tensors, dtypes, shapes, regions, trainer state keys
    globalshard verify PATH       read every stored region (checksums included)

Exit status 0 on success, 1 when the checkpoint is invalid or damaged, 2 on
usage errors.
"""

from __future__ import annotations

import argparse
import sys
import time

from globalshard.api import Checkpoint
from globalshard.errors import GlobalShardError


def _inspect(path: str) -> int:
    ckpt = Checkpoint(path)
    md, trainer = ckpt.metadata, ckpt.trainer_state
    total = sum(r.nbytes for t in md.tensors.values() for r in t.regions)
    regions = sum(len(t.regions) for t in md.tensors.values())
    print(f"{path}: globalshard format {md.version}, {len(md.tensors)} tensors, "
          f"{regions} stored regions, {total / 2**20:.2f} MiB")
    width = max((len(k) for k in md.tensors), default=3)
    print(f"{'key':{width}}  {'dtype':14} {'global shape':20} {'regions':>7} {'MiB':>9}")
    for key in sorted(md.tensors):
        t = md.tensors[key]
        mib = sum(r.nbytes for r in t.regions) / 2**20
        print(f"{key:{width}}  {t.dtype:14} {t.global_shape!s:20} {len(t.regions):7d} {mib:9.3f}")
    print(f"trainer_state.json: {sorted(trainer) if trainer else 'none'}")
    return 0


def _verify(path: str) -> int:
    ckpt = Checkpoint(path)  # parses metadata.json and checks the trainer state's SHA-256
    start = time.perf_counter()
    failures, nbytes = ckpt.verify()
    seconds = time.perf_counter() - start
    if failures:
        print(f"{len(failures)} damaged region(s):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    regions = sum(len(t.regions) for t in ckpt.metadata.tensors.values())
    print(f"OK: {regions} regions, {nbytes / 2**20:.2f} MiB read and checksummed in {seconds:.2f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="globalshard", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in [("inspect", "list the tensors of a checkpoint"),
                           ("verify", "read and checksum every stored region")]:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("path", help="checkpoint directory or kvstore URL")
    args = parser.parse_args(argv)
    command = {"inspect": _inspect, "verify": _verify}[args.command]
    try:
        return command(args.path)
    except GlobalShardError as e:
        print(f"globalshard {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
