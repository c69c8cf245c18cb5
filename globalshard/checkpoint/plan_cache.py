"""Plans of recent saves, reused by a save of the same structure."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from globalshard.comm import json_digest
from globalshard.planner import SavePlan, WriteItem, rebased_writes

__all__ = ["PLANS", "PlanCache"]


class PlanCache:
    """The plans of recent saves, by the structure they were planned from.

    The key is what every rank already exchanges to plan a save: each rank's
    :func:`~globalshard.planner.describe_shards` digest and replica ids, the
    world size and ``pack_below``. Equal keys mean equal shard lists on every
    rank, hence the same plan (planning is deterministic), so a save whose key
    every rank holds takes that plan :func:`~globalshard.planner.rebased` to
    its own save id instead of gathering the lists and planning again. Any
    change of keys, shapes, dtypes, regions, replica ids, ranks or packing
    changes the key and plans anew. Ranks send the keys they hold with their
    digests, so all of them decide alike whether to reuse a plan (the
    planning exchange is collective). Holds the ``size`` most recent plans.
    """

    def __init__(self, size: int = 2) -> None:
        self._size = size
        self._plans: dict[str, SavePlan] = {}
        self._writes: dict[tuple[str, int], tuple[WriteItem, ...]] = {}  # (key, rank) -> that rank's writes
        self._lock = threading.Lock()
        #: How many saves reused a plan, and how many planned (for tests and benchmarks).
        self.hits = self.misses = 0

    @staticmethod
    def key(digests: Sequence[str], replicas: Sequence[Any], world_size: int, pack_below: int) -> str:
        """The key of a save's structure: a digest of every rank's shard-list digest
        and replica runs, the world size and ``pack_below``."""
        return json_digest([world_size, pack_below, list(digests), list(replicas)])

    def held(self) -> dict[str, SavePlan]:
        """The plans this process holds now, by key (a save announces the keys,
        then takes its plan from this, whatever other threads' saves do)."""
        with self._lock:
            return dict(self._plans)

    def reuse(self, key: str, plan: SavePlan, rank: int, save_id: str) -> tuple[WriteItem, ...]:
        """Rank ``rank``'s writes of ``plan`` (held under ``key``) under ``save_id``.

        ``plan`` becomes the most recent. Only rank 0 needs the whole plan's
        metadata, at the commit (:func:`~globalshard.planner.rebased_metadata`).
        """
        with self._lock:
            self._plans.pop(key, None)
            self._plans[key] = plan
            self.hits += 1
            mine = self._writes.get((key, rank))
            if mine is None:
                mine = self._writes[(key, rank)] = tuple(plan.for_rank(rank))
        assert plan.metadata.save_id is not None
        return rebased_writes(mine, plan.metadata.save_id, save_id)

    def put(self, key: str, plan: SavePlan) -> None:
        """Hold ``plan`` under ``key`` (a save that planned), dropping the least recent beyond ``size``."""
        with self._lock:
            self.misses += 1
            self._plans.pop(key, None)
            self._plans[key] = plan
            while len(self._plans) > self._size:
                del self._plans[next(iter(self._plans))]
            self._writes = {k: v for k, v in self._writes.items() if k[0] in self._plans}

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._plans.clear()
            self._writes.clear()


#: The cache every save of this process uses.
PLANS = PlanCache()
