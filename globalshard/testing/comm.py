"""A real communicator between threads of one process, for multi-rank tests
of the core (the torch adapter brings torch.distributed): ``all_gather``,
``barrier`` and the shared reads' ``exchange``. Objects go through JSON on
the way, as they would between processes.

>>> run_ranks(2, lambda comm: comm.all_gather(comm.rank * 10))
[[0, 10], [0, 10]]
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class ThreadGroup:
    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Any] = [None] * world_size
        self._mail: dict[tuple[int, int, int], list[bytes]] = {}  # (src, dst, tag) -> messages in order
        self._mail_ready = threading.Condition()

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.world_size = group.world_size
        self.gathers = 0

    def all_gather(self, obj: Any) -> list[Any]:
        g = self._group
        g._slots[self.rank] = json.loads(json.dumps(obj))
        g._barrier.wait()
        out = list(g._slots)
        g._barrier.wait()
        self.gathers += 1
        return out

    def barrier(self) -> None:
        self._group._barrier.wait()

    def exchange(self, sends: Sequence[tuple[int, int, np.ndarray]],
                 recvs: Sequence[tuple[int, int, np.ndarray]]) -> None:
        """Point to point, as between processes: the bytes are copied."""
        g = self._group
        with g._mail_ready:
            for peer, tag, array in sends:
                g._mail.setdefault((self.rank, peer, tag), []).append(array.tobytes())
            g._mail_ready.notify_all()
        for peer, tag, array in recvs:
            box = (peer, self.rank, tag)
            def arrived(box: tuple[int, int, int] = box) -> bool:
                return bool(g._mail.get(box))

            with g._mail_ready:
                if not g._mail_ready.wait_for(arrived, timeout=g.timeout):
                    raise TimeoutError(f"rank {self.rank}: nothing from rank {peer} with tag {tag}")
                data = g._mail[box].pop(0)
            if len(data) != array.nbytes:
                raise ValueError(f"rank {self.rank}: {len(data)} bytes from rank {peer}, expected {array.nbytes}")
            array.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8)


def run_ranks(world_size: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    """Run ``fn(comm)`` on one thread per rank; each result or raised exception, by rank."""
    group = ThreadGroup(world_size)
    results: list[Any] = [None] * world_size

    def main(rank: int) -> None:
        try:
            results[rank] = fn(group.comm(rank))
        except BaseException as e:
            results[rank] = e

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results
