"""The communicator of several JAX processes: ``jax.distributed``'s key-value store."""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import threading
from typing import Any

import jax

import globalshard as gs
from globalshard.comm import Comm, SingleProcessComm, wait_for_background

__all__ = ["JaxComm", "default_comm"]

#: Exchanges of this process per namespace, over every JaxComm it makes: each gj.save and gj.load makes its
#: own, and every process makes the same exchanges of a namespace in the same order, so the numbers agree
#: across processes and one exchange's keys and barrier are never another's (rank 0 deletes a round's keys
#: after its barrier, while the others may already be in the next exchange).
_ROUNDS: dict[str, itertools.count[int]] = collections.defaultdict(itertools.count)
_ROUNDS_LOCK = threading.Lock()


class JaxComm:
    """A :class:`globalshard.Comm` over ``jax.distributed``'s key-value store
    (no device collectives needed, so it works on CPU-only processes).

    Args:
        timeout_s: how long an exchange waits for the other processes.
        namespace: exchanges in different namespaces never meet, so saves and
            loads that run at the same time in threads of one process (in an
            order that may differ between processes) each take their own, the
            same string on every process (Orbax's handler: the item's
            directory); those of one namespace run one at a time.
    """

    # TODO(limitation): no exchange(): the key-value store is not made for bulk
    # bytes, so shared reads (load(..., shared_reads=True)) are not offered here.

    def __init__(self, timeout_s: float = 600.0, *, namespace: str = "") -> None:
        # TODO(limitation): the key-value client is reached through jax's private
        # jax._src.distributed (as Orbax does); a jax release may move it.
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise gs.CommError("jax.distributed is not initialized (call jax.distributed.initialize first)")
        self._client = client
        self._timeout_ms = int(timeout_s * 1000)
        self._namespace = namespace
        # A namespace (a path, say) by its digest: keys of fixed form, none a prefix of the unnamed ones'.
        self._prefix = f"globalshard-ns/{hashlib.sha256(namespace.encode()).hexdigest()[:16]}" if namespace \
            else "globalshard"

    @property
    def rank(self) -> int:
        return int(jax.process_index())

    @property
    def world_size(self) -> int:
        return int(jax.process_count())

    def all_gather(self, obj: Any) -> list[Any]:
        wait_for_background()  # a save's exchanges in flight come first, numbered alike on every process
        with _ROUNDS_LOCK:
            n = next(_ROUNDS[self._namespace])
        prefix = f"{self._prefix}/{n}"
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


def default_comm(namespace: str = "") -> Comm:
    """A :class:`JaxComm` (in ``namespace``) over several processes, else a single process's."""
    return JaxComm(namespace=namespace) if jax.process_count() > 1 else SingleProcessComm()
