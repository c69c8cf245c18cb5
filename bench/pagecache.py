"""Page-cache control for the benchmarks' cold reads (no root needed)."""

from __future__ import annotations

import os
import time

from globalshard.testing.pagecache import evict

__all__ = ["SETTLE_S", "evict", "quiesce", "settle"]


def quiesce(path: str, *, idle_s: float = 0.3, timeout_s: float = 30.0) -> float:
    """os.sync(), then wait until the disk holding ``path`` has been idle for
    ``idle_s`` (its sector counters in /sys/dev/block unchanged, nothing in
    flight), at most ``timeout_s``. Returns the seconds waited.

    A filesystem mounted with ``discard`` (this machine's root is) trims the
    blocks of deleted files after the fact: deleting a GiB right before a
    timed save made that save 3-4x slower. Each timed run starts from a quiet
    disk instead."""
    start = time.perf_counter()
    os.sync()
    st = os.stat(path)
    stat_file = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
    if not os.path.exists(stat_file):
        return time.perf_counter() - start

    def sample() -> tuple[int, ...]:
        with open(stat_file) as f:
            return tuple(int(v) for v in f.read().split())

    last, quiet_since = sample(), time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        time.sleep(0.05)
        now = sample()
        busy = now[8] != 0 if len(now) > 8 else False  # I/Os in flight
        if now != last or busy:
            last, quiet_since = now, time.perf_counter()
        elif time.perf_counter() - quiet_since >= idle_s:
            break
    return time.perf_counter() - start


#: Seconds to wait after files were deleted before timing a write. On this
#: machine (ext4 mounted with ``discard`` on a virtual disk) a write soon after
#: a deletion runs several times faster than one made later: 0.5 GiB written
#: by one thread with fsync, after deleting 1 GiB and :func:`quiesce`, took
#: 0.40-0.46 s when started 0-5 s later, 0.76 s at 10 s, 2.18-2.19 s at 20 and
#: 40 s (bench run of 2026-12-01). A run that deletes between its timed writes
#: therefore times some of them in that window and some not.
SETTLE_S = 30.0


def settle(seconds: float = SETTLE_S) -> None:
    """Wait until deletions made before this point no longer speed up writes
    (:data:`SETTLE_S`): call once before the first timed write of a run that
    itself deletes nothing until its end, so every write meets the same disk."""
    time.sleep(seconds)
