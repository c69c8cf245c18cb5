"""The few collectives a distributed save or load needs.

globalshard asks a communicator for four things: its rank, the world size, an
all-gather of small JSON-able objects, and a barrier. Any object with those
members will do (:class:`Comm` is a structural protocol); the torch adapter
supplies one over ``torch.distributed``. ``comm=None`` means one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from globalshard.errors import CommError, GlobalShardError

__all__ = ["Comm", "SingleProcessComm", "run_collectively"]

T = TypeVar("T")


@runtime_checkable
class Comm(Protocol):
    """What globalshard needs from a communicator."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-able: dicts, lists, strings, numbers), in rank order."""
        ...

    def barrier(self) -> None: ...


class SingleProcessComm:
    """The communicator of a single process: rank 0 of 1."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


def run_collectively(comm: Comm, step: str, fn: Callable[[], T]) -> tuple[T, list[Any]]:
    """Run ``fn`` on every rank, then all-gather its outcome.

    If ``fn`` fails on any rank, every rank raises: the failing rank its own
    exception, the others a :class:`CommError` naming the failed ranks and
    their messages. Nobody waits forever for a rank that already gave up.

    Returns:
        ``(result, gathered)``: this rank's result and every rank's result,
        which must then be JSON-able.
    """
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
        outcome = {"ok": True, "value": result}
    except Exception as e:  # reported to the other ranks, then re-raised
        error = e
        kind = type(e).__name__ if isinstance(e, GlobalShardError) else f"{type(e).__module__}.{type(e).__name__}"
        outcome = {"ok": False, "error": f"{kind}: {e}"}
    try:
        gathered = comm.all_gather(outcome)
    except Exception as e:
        raise CommError(f"{step}: the all-gather between ranks failed: {type(e).__name__}: {e}") from e
    if error is not None:
        raise error
    failed = [(r, o["error"]) for r, o in enumerate(gathered) if not o["ok"]]
    if failed:
        detail = "\n".join(f"  rank {r}: {msg}" for r, msg in failed)
        raise CommError(f"{step} failed on rank(s) {[r for r, _ in failed]}:\n{detail}")
    return result, [o["value"] for o in gathered]
