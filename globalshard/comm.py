"""The few collectives a distributed save or load needs.

globalshard asks a communicator for four things: its rank, the world size, an
all-gather of small JSON-able objects, and a barrier. Any object with those
members will do (:class:`Comm` is a structural protocol); the torch adapter
supplies one over ``torch.distributed``. ``comm=None`` means one process.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from globalshard.errors import CommError, GlobalShardError

__all__ = ["Comm", "SingleProcessComm", "distinct_values", "json_digest", "run_collectively", "start_in_background",
           "wait_for_background"]

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


#: Threads taking part in collectives while the threads that started them go on, until they end.
_BACKGROUND: set[threading.Thread] = set()
_BACKGROUND_LOCK = threading.Lock()


def start_in_background(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a thread running ``target``, which takes part in collectives while
    its caller goes on (an asynchronous save's background); until it ends,
    :func:`wait_for_background` in any other thread waits for it."""
    def run() -> None:
        try:
            target()
        finally:
            with _BACKGROUND_LOCK:
                _BACKGROUND.discard(thread)

    thread = threading.Thread(target=run, name=name)
    with _BACKGROUND_LOCK:
        _BACKGROUND.add(thread)
    try:
        thread.start()
    except BaseException:
        with _BACKGROUND_LOCK:
            _BACKGROUND.discard(thread)
        raise
    return thread


def wait_for_background() -> None:
    """Wait until the threads :func:`start_in_background` started have ended
    (at once in one of them); their errors are theirs to report.

    A collective begun while such a thread runs its own on the same
    communicator would pair with theirs on the ranks where it came first and
    not on the others: a hang, an abort, or one message read as another. So
    every collective step waits first (:func:`run_collectively` does, and the
    torch and JAX adapters' communicators before each collective), as Orbax's
    restore waits for the saves in flight.
    """
    me = threading.current_thread()
    with _BACKGROUND_LOCK:
        if me in _BACKGROUND:
            return
        running = list(_BACKGROUND)
    for thread in running:
        thread.join()


def run_collectively(comm: Comm, step: str, fn: Callable[[], T]) -> tuple[T, list[Any]]:
    """Run ``fn`` on every rank, then all-gather its outcome.

    If ``fn`` fails on any rank, every rank raises: the failing rank its own
    exception, the others a :class:`CommError` naming the failed ranks and
    their messages. Nobody waits forever for a rank that already gave up.

    Over several ranks, collectives running in the background
    (:func:`start_in_background`) are waited for first.

    Returns:
        ``(result, gathered)``: this rank's result and every rank's result,
        which must then be JSON-able.
    """
    if comm.world_size > 1:
        wait_for_background()
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


def json_digest(value: Any) -> str:
    """SHA-256 (32 hex digits) of ``value``'s compact JSON: equal on every rank
    for equal values (Python's own hash differs between processes)."""
    text = json.dumps(value, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def distinct_values(comm: Comm, step: str, digests: Sequence[str], value: Any) -> dict[str, Any]:
    """Each distinct value once: the lowest rank holding each digest sends its
    value, the rest send nothing. ``digests`` is every rank's digest (gathered
    before), ``value`` this rank's (its digest is ``digests[comm.rank]``).

    Data-parallel replicas describe the same shards and read the same bytes:
    this makes a gather of those descriptions cost the distinct ones, not
    ranks x their size. Collective, like :func:`run_collectively`.
    """
    mine = digests[comm.rank]
    first = digests.index(mine) == comm.rank
    _, gathered = run_collectively(comm, step, lambda: [value] if first else None)
    out = {digests[r]: g[0] for r, g in enumerate(gathered) if g is not None}
    missing = sorted(set(digests) - set(out))
    if missing:  # cannot happen between ranks that run this same code
        raise CommError(f"{step}: no rank sent the values with digests {missing[:4]}")
    return out
