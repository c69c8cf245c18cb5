"""Replicas compared before a save (``save(..., check_replicas=True)``).

A save stores each box of a key once, from whichever rank holding a copy
balances the bytes written, and takes the others to hold equal values (data-parallel
replicas, a plain tensor every rank holds). When training let them drift
apart (a gradient all-reduce left out, a buffer updated on one rank), the
checkpoint silently keeps one rank's values. The check: each rank takes a
crc32c of every region it holds, the ranks exchange them with the save's
plan, and copies of one box of one key that differ are refused, on every
rank, before anything is written. crc32c tells accidental differences apart
(one in four billion passes); it is not a defence against crafted values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import crc32c
import numpy as np

from globalshard.errors import MismatchError, format_problems
from globalshard.layout import ShardedTensor

__all__ = ["differing_replicas", "region_checksums"]


def region_checksums(entries: Sequence[tuple[str, ShardedTensor]],
                     staged: Mapping[str, Callable[[], None]] | None = None) -> list[list[Any]]:
    """``[key, offset, shape, crc32c, replica id]`` of every region of every
    shard: the crc32c of its values' bytes in C order, so copies compare bit
    for bit (a shard's copy still in flight is waited for)."""
    out = []
    for name, t in entries:
        if staged and name in staged:
            staged[name]()
        for region in t.regions:
            values: Any = np.ascontiguousarray(region.local_box.view(t.data)).reshape(-1).view(np.uint8)
            out.append([t.key, list(region.global_box.offset), list(region.global_box.shape),
                        int(crc32c.crc32c(values)), t.replica_id])
    return out


def differing_replicas(per_rank: Sequence[Sequence[Sequence[Any]]]) -> None:
    """Refuse copies of one box of one key that differ (``per_rank[r]``: rank
    ``r``'s :func:`region_checksums`). Boxes held by a single copy, and copies
    of other boxes of the key (another cut), are not compared.

    Raises:
        MismatchError: naming each key and box, and which ranks hold which values.
    """
    held: dict[tuple[str, tuple[int, ...], tuple[int, ...]], dict[int, list[tuple[int, int]]]] = {}
    for rank, sums in enumerate(per_rank):
        for key, offset, shape, crc, replica in sums:
            held.setdefault((key, tuple(offset), tuple(shape)), {}).setdefault(crc, []).append((rank, replica))
    problems = []
    for (key, offset, shape), by_value in sorted(held.items()):
        if len(by_value) < 2:
            continue
        box = "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape)) + "]"
        groups = sorted(by_value.values(), key=lambda holders: min(replica for _, replica in holders))
        described = "; ".join(
            ", ".join(f"rank {rank}" + (" (main)" if replica == 0 else "") for rank, replica in sorted(holders))
            for holders in groups)
        problems.append(f"{key!r} {box}: copies differ, {len(by_value)} values held by: {described}")
    if problems:
        raise MismatchError(format_problems("replicas of these regions differ (check_replicas): the save would "
                                            "keep one copy's values", problems))
