"""The core's communicator over torch.distributed.

Objects travel as JSON in uint8 tensors over a dedicated gloo group (so it
works whatever backend the training uses, and nothing is unpickled), with a
timeout: a rank that died makes the others fail instead of waiting forever.
Arrays of shared reads travel point to point over the same group.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from globalshard.comm import SingleProcessComm, wait_for_background

__all__ = ["TorchComm", "default_comm", "resolve_comm"]


class TorchComm:
    """:class:`globalshard.Comm` over ``torch.distributed`` (call on every rank).

    Args:
        timeout: how long a collective waits for the other ranks.
        ranks: the ranks of the group (default: all); every rank of the world
            must construct it, as for ``torch.distributed.new_group``.
        group: instead of ``ranks``, the ranks of an existing process group
            (DCP's ``process_group``, of any backend): constructed on those
            ranks only, which make a gloo group of their own.
    """

    def __init__(self, timeout: timedelta = timedelta(minutes=10), ranks: list[int] | None = None, *,
                 group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        if group is not None and ranks is not None:
            raise ValueError("TorchComm takes ranks or group, not both")
        if group is None:
            self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        else:  # a group of our own all the same: a background save's exchanges never meet the caller's on it
            self._group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo", timeout=timeout,
                                         use_local_synchronization=True)
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)

    def all_gather(self, obj: Any) -> list[Any]:
        wait_for_background()  # a save's collectives in flight on this group come first, on every rank
        data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self._group)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self._group)
        return [json.loads(bytes(t[: int(s.item())].numpy()).decode("utf-8")) for t, s in zip(out, sizes)]

    def barrier(self) -> None:
        wait_for_background()
        dist.barrier(group=self._group)

    def exchange(self, sends: Sequence[tuple[int, int, np.ndarray]],
                 recvs: Sequence[tuple[int, int, np.ndarray]]) -> None:
        """Point-to-point sends and receives of host arrays (``(peer, tag,
        array)``, peers as ranks of this group), all posted, then waited for."""
        wait_for_background()
        works = [dist.irecv(_bytes(a), src=dist.get_global_rank(self._group, peer), group=self._group, tag=tag)
                 for peer, tag, a in recvs]
        works += [dist.isend(_bytes(a), dst=dist.get_global_rank(self._group, peer), group=self._group, tag=tag)
                  for peer, tag, a in sends]
        for work in works:
            if work is not None:
                work.wait()


def _bytes(array: np.ndarray) -> torch.Tensor:
    """The bytes of a C-contiguous array as a uint8 tensor sharing its memory."""
    if not array.flags.c_contiguous:
        raise ValueError("exchange() needs C-contiguous arrays")
    if not array.flags.writeable:  # a send buffer only (bytes read from a file): torch warns of writes it never does
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array.reshape(-1).view(np.uint8))
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


_DEFAULT: list[TorchComm] = []


#: The communicator over each process group passed as ``comm=``, made once (a group's gloo twin lives as long).
_OF_GROUP: dict[int, tuple[dist.ProcessGroup, TorchComm]] = {}


def resolve_comm(comm: Any) -> Any:
    """The communicator a torch entry point uses for ``comm``: a
    :class:`globalshard.Comm` as it is; a ``torch.distributed.ProcessGroup``
    (DCP's ``process_group``) as a :class:`TorchComm` over it, made on the
    first call and reused; None as the whole world (one process without
    torch.distributed)."""
    if comm is None:
        return default_comm() or SingleProcessComm()
    if comm is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives the ranks outside the group
        raise ValueError("comm= is a process group this rank is not in; call with it on its ranks only")
    if isinstance(comm, dist.ProcessGroup):
        made = _OF_GROUP.get(id(comm))
        if made is None or made[0] is not comm:
            made = _OF_GROUP[id(comm)] = (comm, TorchComm(group=comm))
        return made[1]
    return comm


def default_comm() -> TorchComm | None:
    """One TorchComm over the whole world, made on first use; None without torch.distributed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if not _DEFAULT:
        _DEFAULT.append(TorchComm())
    return _DEFAULT[0]
