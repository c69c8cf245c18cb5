"""``save``: each process's addressable shards, each stored box once."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import globalshard as gs
from globalshard.comm import Comm
from globalshard.errors import LayoutError
from globalshard_jax.comm import default_comm
from globalshard_jax.tree import TREE, KeyMap, is_key, pytree_keys, resolve, skeleton

__all__ = ["save"]


def _shards(key: str, leaf: Any, axes: tuple[int, ...] | None, rank: int) -> list[gs.ShardedTensor]:
    """This process's pieces of one leaf, each addressable shard once."""
    if isinstance(leaf, jax.Array):
        out = []
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data)
            offset = tuple(s.start or 0 for s in shard.index) if shard.index else ()
            t = gs.ShardedTensor.from_offset(key, data, global_shape=leaf.shape, global_offset=offset,
                                             replica_id=int(shard.replica_id))
            out.append(t.transposed(axes) if axes else t)
        return out
    data = np.asarray(leaf)
    if data.dtype == object:
        raise LayoutError(f"{key!r}: leaf of type {type(leaf).__name__} is not an array")
    t = gs.ShardedTensor.from_offset(key, data, global_shape=data.shape, global_offset=(0,) * data.ndim,
                                     replica_id=0 if rank == 0 else 1)
    return [t.transposed(axes) if axes else t]


def save(path: Any, pytree: Any, *, trainer_state: dict[str, Any] | None = None, comm: Comm | None = None,
         keys: KeyMap = None, overwrite: bool = False, kvstore: Any = None,
         stats: gs.IOStats | None = None, pack_below: int = 0, base: Any = None, frozen: Any = (),
         digests: bool | None = None, saver: gs.AsyncSaver | None = None, check_replicas: bool = False) -> None:
    """Save a pytree of arrays (``jax.Array``, numpy, Python scalars) as one checkpoint.

    Every process calls it with its own view of the same pytree. ``keys``
    maps a pytree key to a checkpoint key, or to ``(key, axes)`` to store the
    leaf transposed (see :meth:`globalshard.ShardedTensor.transposed`).
    ``pack_below``, ``base``, ``frozen``, ``digests``: as for :func:`globalshard.save`
    (small regions stored in a few packs; regions equal to a base checkpoint's
    stored as references to it, ``frozen`` naming checkpoint keys).
    ``check_replicas``: as for :func:`globalshard.save`: the copies of each box
    (a replicated array's shards on several devices, a numpy or Python leaf
    every process holds) are compared bit for bit before anything is written,
    rather than process 0's taken. ``saver`` (a :class:`globalshard.AsyncSaver`): the call returns once the
    shards are copied into the saver's staging pool, and the writing goes on
    in its writer process; the arrays may then be donated or deleted. Call
    ``saver.wait()`` to learn its outcome, and before exiting (a load or save
    begun meanwhile waits for its exchanges first).

    The pytree's containers and each leaf's kind go into the trainer state's
    ``"globalshard_jax"`` member (a name ``trainer_state`` may not use), so
    that :func:`~globalshard_jax.load` without a target rebuilds the pytree.
    """
    comm = comm if comm is not None else default_comm()
    state, described = prepared(pytree, trainer_state, keys, comm)
    options = dict(trainer_state=described, comm=comm, overwrite=overwrite, kvstore=kvstore, stats=stats,
                   pack_below=pack_below, base=base, frozen=frozen, digests=digests, check_replicas=check_replicas)
    if saver is not None:
        saver.save(state, path, **options)
    else:
        gs.save(state, path, **options)


def prepared(pytree: Any, trainer_state: dict[str, Any] | None, keys: KeyMap,
             comm: Comm) -> tuple[dict[str, gs.ShardedTensor], dict[str, Any]]:
    """What :func:`save` hands to the core: this process's shards of every leaf
    (views of host copies; device-to-host copies all started before the first
    is waited for), and the trainer state with the pytree's structure."""
    if trainer_state is not None and TREE in trainer_state:
        raise LayoutError(f"trainer_state member {TREE!r} is globalshard_jax's own (the pytree's structure); "
                          "name yours otherwise")
    leaves = [(key, jax.random.key_data(leaf) if isinstance(leaf, jax.Array) and is_key(leaf.dtype) else leaf)
              for key, leaf in pytree_keys(pytree)]
    for key, leaf in leaves:  # every device-to-host copy started before the first is waited for
        if isinstance(leaf, jax.Array):
            if leaf.is_deleted():  # donated to a jitted step, or deleted
                raise LayoutError(f"{key!r}: the array has been deleted (donated?); save before the step that "
                                  "donates it, or pass saver= to save() and donate after it returns")
            leaf.copy_to_host_async()
    state: dict[str, gs.ShardedTensor] = {}
    for key, leaf in leaves:
        ckpt_key, axes = resolve(keys, key)
        for i, t in enumerate(_shards(ckpt_key, leaf, axes, comm.rank)):
            state[f"{key}#{i}"] = t
    return state, {**(trainer_state or {}), TREE: {"pytree": skeleton(pytree, keys)}}
