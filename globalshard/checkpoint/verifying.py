"""Verifying a checkpoint: every stored byte read and checksummed, each
array in the root that stores it, in bounded memory."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from globalshard.checkpoint.bases import check_bases
from globalshard.errors import GlobalShardError, StorageError
from globalshard.format.zarr import PackExpect, array_attributes
from globalshard.io import ArrayEngine, open_engine

if TYPE_CHECKING:
    from globalshard.checkpoint.loading import Checkpoint

__all__ = ["verify"]


def verify(ckpt: Checkpoint, workers: int, progress: Callable[[int], None] | None) -> tuple[list[str], int]:
    """:meth:`Checkpoint.verify <globalshard.Checkpoint.verify>`."""
    problems, nbytes = [], 0
    # Each region is checked in the root that stores it: bases (spec section 5.2) first.
    needed: dict[int, list[tuple[str, Any]]] = {}
    for key in sorted(ckpt.metadata.tensors):
        for r in ckpt.metadata.tensors[key].regions:
            if r.base is not None:
                needed.setdefault(r.base, []).append((key, r))
    engines: dict[int | None, ArrayEngine] = {None: ckpt._engine}
    for b, reads in needed.items():
        try:
            engines[b] = open_engine(check_bases(ckpt._store, ckpt.metadata, {b: reads})[b], ckpt._io)
        except StorageError as e:
            problems.append(str(e))  # its regions are not read: none of them can be
    jobs: list[tuple[str, str, Any]] = []
    packs: dict[str, list[tuple[str, Any]]] = {}
    for key in sorted(ckpt.metadata.tensors):
        t = ckpt.metadata.tensors[key]
        for r in t.regions:
            if r.base not in engines:
                continue
            if r.byte_offset is None:
                jobs.append((key, t.dtype, r))
            else:
                packs.setdefault(r.path, []).append((key, r))
    jobs += [("", "uint8", path) for path in sorted(packs)]  # each pack once, with every region in it

    def save_of(r: Any) -> str | None:
        return ckpt.metadata.save_id if r.base is None else ckpt.metadata.bases[r.base].save_id

    def one(job: tuple[str, str, Any]) -> tuple[str | None, int]:
        key, dtype, r = job
        if isinstance(r, str):  # a pack
            members = sorted(packs[r], key=lambda m: m[1].byte_offset)
            save_id = save_of(members[0][1])
            assert save_id is not None
            expect = PackExpect(save_id, tuple((k, m.box.offset, m.byte_offset, m.nbytes) for k, m in members))
            try:
                return None, engines[members[0][1].base].verify(r, "uint8", None, expect)
            except GlobalShardError as e:
                lost = _unreadable(ckpt, members)  # the regions in its damaged chunks
                names = ", ".join(f"{k} {m.box}" for k, m in lost[:20])
                more = f" and {len(lost) - 20} more" if len(lost) > 20 else ""
                return (f"pack {r}: {e}\nregions of the pack that cannot be read: {names}{more}",
                        sum(m.nbytes for _, m in members))
        save_id = save_of(r)
        want = array_attributes(key, r.box.offset, save_id) if save_id else None
        try:
            return None, engines[r.base].verify(r.path, dtype, r.box.shape, want)
        except GlobalShardError as e:
            return f"{key} {r.box} ({r.path}): {e}", r.nbytes

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        for problem, n in pool.map(one, jobs):
            if problem is not None:
                problems.append(problem)
            else:
                nbytes += n
            if progress is not None:
                progress(n)
    return problems, nbytes


def _unreadable(ckpt: Checkpoint, members: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The packed regions (``(key, StoredRegion)``) that fail to read, each tried alone."""
    out = []
    for key, region in members:
        try:
            ckpt.read_array(key, region.box)
        except GlobalShardError:
            out.append((key, region))
    return out
