"""Structure-aware fuzzing of metadata.json and the trainer state.

    python tests/fuzz_metadata.py --inputs 100000 [--seed 1]

Each input starts from a valid document (spec/examples, or one saved with
many regions) and gets 1-4 mutations: a value replaced by a hostile one (huge
or negative integers, 10^5-element arrays, deep nesting, lone surrogates,
long strings, floats, NaN), a member deleted or duplicated, a region
duplicated, moved or resized, the rank raised. The parsers must answer every
input with their own error (MetadataError, which TrainerStateError refines)
or a valid model, within a fixed time; an accepted metadata document must
also plan a load of every key (pure: no I/O). Prints the counts and the
slowest input's time as JSON; exits 1 on any other exception or a slow input.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import sys
import time
from typing import Any

from globalshard.errors import MetadataError
from globalshard.format.metadata import TrainerStateRef, parse_metadata, parse_trainer_state
from globalshard.geometry import Box, Region
from globalshard.planner import LoadPlanner, ShardInfo

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "spec", "examples")
#: An input slower than this is a failure (the issue's bound: no hang over 2 s).
SLOW_SECONDS = 2.0


def _seeds() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with open(os.path.join(EXAMPLES, "metadata.json")) as f:
        example = json.load(f)
    with open(os.path.join(EXAMPLES, "trainer_state.json")) as f:
        trainer = json.load(f)
    # A grid of 32 x 32 regions, the shape a large TP x FSDP save has.
    grid = copy.deepcopy(example)
    grid["tensors"] = {"g": {"dtype": "float32", "global_shape": [64, 64], "regions": [
        {"offset": [2 * i, 2 * j], "shape": [2, 2], "path": f"saves/x/arrays/g/{32 * i + j}", "nbytes": 16}
        for i in range(32) for j in range(32)]}}
    # References to a base (section 5.2): bases, base indices and digests to mutate.
    with open(os.path.join(EXAMPLES, "..", "vectors", "based", "metadata.json")) as f:
        based = json.load(f)
    return [example, grid, based], trainer


def _hostile(rng: random.Random) -> Any:
    choice = rng.randrange(16)
    if choice == 0:
        return rng.choice([2**63, 2**64 + 1, -1, -(2**70), 10**400])
    if choice == 1:
        return [rng.randrange(1 << 20)] * rng.choice([33, 1000, 100_000])
    if choice == 2:
        value: Any = 0
        for _ in range(rng.choice([50, 101, 600])):
            value = [value] if rng.random() < 0.5 else {"a": value}
        return value
    if choice == 3:
        return rng.choice(["\ud800", "a\udfffb", "\x00", "../..", "/etc/passwd", "metadata.json", "x" * 5000])
    if choice == 4:
        return rng.choice([1.5, 4.0, 1e308, -0.0])
    if choice == 5:
        return rng.choice([None, True, False, "", [], {}])
    if choice == 6:
        return {"$float": rng.choice(["inf", "nan", "-inf", "Infinity", 1])}
    if choice == 7:
        return [[0] * 32, [1] * 32]
    return rng.randrange(-3, 1 << rng.choice([3, 16, 40, 62]))


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if len(prefix) > 12:  # inside a hostile nest: its top is enough
        return out
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:50]):
            out += _paths(v, (*prefix, i))
    return out


def _copy(doc: Any) -> Any:
    return json.loads(json.dumps(doc))  # deep nests copy where copy.deepcopy would recurse too far


def mutate(doc: Any, rng: random.Random) -> Any:
    doc = _copy(doc)
    for _ in range(rng.randint(1, 4)):
        paths = _paths(doc)
        path = rng.choice(paths)
        if not path:
            if rng.random() < 0.1:
                doc = _hostile(rng)
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        last = path[-1]
        op = rng.randrange(5)
        if op == 0 and isinstance(parent, dict):
            del parent[last]
        elif op == 1 and isinstance(parent, list):
            parent.insert(last, _copy(parent[last]))  # a duplicate: an overlap, or a repeated path
        elif op == 2 and isinstance(parent[last], list) and parent[last] and isinstance(parent[last][0], int):
            parent[last] = parent[last] + [1] * rng.choice([1, 40, 2000])  # a higher rank
        elif op == 3 and isinstance(parent[last], int) and not isinstance(parent[last], bool):
            parent[last] += rng.choice([-1, 1, 1 << 40])
        else:
            parent[last] = _hostile(rng)
    return doc


def _dumps(doc: Any) -> bytes:
    try:
        return json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass")
    except (RecursionError, ValueError):
        return b"[" * 100_000  # what such a document would look like on disk


def check_metadata(data: bytes) -> str:
    try:
        md = parse_metadata(data)
    except MetadataError:
        return "refused"
    # Accepted: it must plan a full load of every key (pure).
    infos = [ShardInfo(k, t.dtype, t.global_shape, t.global_shape, (Region(Box.full(t.global_shape),
                                                                           Box.full(t.global_shape)),))
             for k, t in md.tensors.items()]
    LoadPlanner().plan(md, infos)
    parse_metadata(md.dumps())
    return "accepted"


def check_trainer_state(data: bytes) -> str:
    ref = TrainerStateRef(len(data), hashlib.sha256(data).hexdigest())
    try:
        parse_trainer_state(data, ref)
    except MetadataError:
        return "refused"
    return "accepted"


def run(inputs: int, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    metadata_seeds, trainer = _seeds()
    counts = {"metadata accepted": 0, "metadata refused": 0, "trainer state accepted": 0,
              "trainer state refused": 0}
    slowest, failures = 0.0, []
    for n in range(inputs):
        if n % 97 == 5:  # nesting far beyond any parser's recursion limit, as bytes
            depth = rng.choice([5000, 200_000])
            data, check, what = b"[" * depth + b"]" * depth, rng.choice([check_metadata, check_trainer_state]), \
                "metadata"
        elif n % 4 == 3:
            data, check, what = _dumps(mutate(trainer, rng)), check_trainer_state, "trainer state"
        else:
            data, check, what = _dumps(mutate(rng.choice(metadata_seeds), rng)), check_metadata, "metadata"
        start = time.perf_counter()
        try:
            outcome = check(data)
            counts[f"{what} {outcome}"] += 1
        except Exception as e:  # anything but the parsers' own error is a finding
            failures.append(f"input {n} ({what}): {type(e).__name__}: {str(e)[:200]}")
        took = time.perf_counter() - start
        slowest = max(slowest, took)
        if took > SLOW_SECONDS:
            failures.append(f"input {n} ({what}) took {took:.1f} s")
    return {"inputs": inputs, "seed": seed, **counts, "slowest_seconds": round(slowest, 3), "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    result = run(args.inputs, args.seed)
    print(json.dumps(result, indent=1))
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
