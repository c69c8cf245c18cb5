"""Where a recovery reads each piece (spec section 5.3): this node's tier
copy, a peer node's, the persistent tier or a base there; in which exchange
a piece read by a peer travels; and in which pieces and exchanges a tiered
save's files travel to the next nodes. Pure: the same on every rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from globalshard.dtypes import numpy_dtype
from globalshard.errors import CommError

__all__ = ["pieces_of", "sources_of", "windows_of"]


def sources_of(needs: Sequence[Sequence[Any]], holders: Mapping[str, list[int]], node_of: Callable[[int], int],
               ranks_of: Callable[[int], Sequence[int]], persisted: bool, in_bases: frozenset[str] = frozenset()
               ) -> dict[tuple[int, int], tuple[str, int]]:
    """Where each rank's each stored read comes from: ``(rank, index into its
    needs) -> ("local" | "persistent" | "base", rank)`` or ``("peer", owner)``.
    Pure: the same on every rank. A peer read goes to the least-loaded rank
    of a node that holds the path (ties: the nearest node after the reader's
    in the ring, then the lower rank). A path in ``in_bases`` (a region the
    step references in a base, spec section 5.2, that no tier copy of the
    base holds) is read from that base in the persistent tier."""
    load: dict[int, int] = {}
    out = {}
    for rank, items in enumerate(needs):
        for i, (path, _, _, shape, dtype) in enumerate(items):
            have = holders.get(path, [])
            if path in in_bases:
                out[(rank, i)] = ("base", rank)
            elif node_of(rank) in have:
                out[(rank, i)] = ("local", rank)
            elif have:
                count = max(have) + 1
                owner = min((r for n in have for r in ranks_of(n)),
                            key=lambda r: (load.get(r, 0), (node_of(r) - node_of(rank)) % max(count, 1), r))
                load[owner] = load.get(owner, 0) + int(np.prod(shape)) * numpy_dtype(dtype).itemsize
                out[(rank, i)] = ("peer", owner)
            elif persisted:
                out[(rank, i)] = ("persistent", rank)
            else:  # _choose said the step is whole: cannot happen
                raise CommError(f"recover: no copy of {path} is reachable")
    return out


def windows_of(needs: Sequence[Sequence[Any]], sources: Mapping[tuple[int, int], tuple[str, int]], limit: int
               ) -> dict[tuple[int, int], int]:
    """The exchange that carries each piece read from a peer (``(reader,
    index)``), first fit in order: in each, no rank sends or receives more
    than ``limit`` bytes, but one piece larger than that alone. Pure: the
    same on every rank."""
    out: dict[tuple[int, int], int] = {}
    sent: list[dict[int, int]] = []  # per window: bytes sent, and received, by rank
    got: list[dict[int, int]] = []
    for rank, items in enumerate(needs):
        for i, (_, _, _, shape, dtype) in enumerate(items):
            kind, owner = sources[(rank, i)]
            if kind != "peer":
                continue
            n = int(np.prod(shape)) * numpy_dtype(dtype).itemsize
            w = 0
            while w < len(sent) and any(0 < d.get(r, 0) and d[r] + n > limit for d, r in ((sent[w], owner),
                                                                                         (got[w], rank))):
                w += 1
            if w == len(sent):
                sent.append({})
                got.append({})
            sent[w][owner] = sent[w].get(owner, 0) + n
            got[w][rank] = got[w].get(rank, 0) + n
            out[(rank, i)] = w
    return out


def pieces_of(sizes: Sequence[int], limit: int) -> list[tuple[int, int, int, int]]:
    """A sender's files (their ``sizes``) cut for the exchanges that copy them
    to the next nodes: ``(file, offset, length, window)`` in file order, each
    file in pieces of exactly ``limit`` bytes but its last (an empty file one
    empty piece), the pieces packed in order into windows of at most
    ``limit`` bytes. Pure: every rank cuts every sender's files alike."""
    out = []
    window, used = 0, 0
    for f, size in enumerate(sizes):
        offset = 0
        while True:
            length = min(limit, size - offset)
            if used and used + length > limit:
                window, used = window + 1, 0
            out.append((f, offset, length, window))
            used, offset = used + length, offset + length
            if offset >= size:
                break
    return out
