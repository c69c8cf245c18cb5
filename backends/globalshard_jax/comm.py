"""The communicator of several JAX processes: ``jax.distributed``'s key-value store."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jax

import globalshard as gs
from globalshard.comm import Comm, SingleProcessComm

__all__ = ["JaxComm", "default_comm"]

#: Exchanges of this process, over every JaxComm it makes: each gj.save and gj.load makes its own, and
#: every process makes the same exchanges in the same order, so the numbers agree across processes and
#: one exchange's keys and barrier are never another's (rank 0 deletes a round's keys after its barrier,
#: while the others may already be in the next exchange).
_ROUNDS = itertools.count()


class JaxComm:
    """A :class:`globalshard.Comm` over ``jax.distributed``'s key-value store
    (no device collectives needed, so it works on CPU-only processes)."""

    # TODO(limitation): no exchange(): the key-value store is not made for bulk
    # bytes, so shared reads (load(..., shared_reads=True)) are not offered here.

    def __init__(self, timeout_s: float = 600.0) -> None:
        # TODO(limitation): the key-value client is reached through jax's private
        # jax._src.distributed (as Orbax does); a jax release may move it.
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise gs.CommError("jax.distributed is not initialized (call jax.distributed.initialize first)")
        self._client = client
        self._timeout_ms = int(timeout_s * 1000)

    @property
    def rank(self) -> int:
        return int(jax.process_index())

    @property
    def world_size(self) -> int:
        return int(jax.process_count())

    def all_gather(self, obj: Any) -> list[Any]:
        n = next(_ROUNDS)
        prefix = f"globalshard/{n}"
        try:
            self._client.key_value_set(f"{prefix}/{self.rank}", json.dumps(obj, allow_nan=False))
            out = [json.loads(self._client.blocking_key_value_get(f"{prefix}/{r}", self._timeout_ms))
                   for r in range(self.world_size)]
            self._client.wait_at_barrier(f"{prefix}/done", self._timeout_ms)
        except Exception as e:
            raise gs.CommError(f"jax.distributed exchange {n} failed: {e}") from None
        if self.rank == 0:
            for r in range(self.world_size):
                self._client.key_value_delete(f"{prefix}/{r}")
        return out

    def barrier(self) -> None:
        self.all_gather(None)


def default_comm() -> Comm:
    return JaxComm() if jax.process_count() > 1 else SingleProcessComm()
