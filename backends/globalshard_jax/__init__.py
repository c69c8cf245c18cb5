"""globalshard for JAX: save a pytree of sharded ``jax.Array``s, load it under any sharding.

Orbax-shaped::

    import globalshard_jax as gj
    gj.save(path, {"params": params, "opt": opt_state}, trainer_state={"step": 100})
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=new_sharding)
    restored, trainer_state = gj.load(path, jax.tree.map(like, {"params": params, "opt": opt_state}))

Keys are the pytree paths joined with dots (``params.dense.kernel``,
``opt.0.mu.dense.kernel``). Typed PRNG keys (``jax.random.key``) are stored
as their ``jax.random.key_data`` (uint32, the implementation's key shape
last) and come back as keys of the target leaf's key dtype. Each process saves the shards of its addressable
devices, each stored box once (``replica_id`` 0 writes it), and a load reads
only the boxes its devices need, each distinct box once per process, then
builds the arrays with ``jax.make_array_from_single_device_arrays``.

Several processes (``jax.distributed.initialize``) agree through
:class:`JaxComm`, over the distributed runtime's key-value store; it is used
by default when ``jax.process_count() > 1``.

Checkpoints are framework-neutral: ``keys=`` maps pytree keys to checkpoint
keys, optionally with an axis permutation, so a torch ``Linear.weight``
``(out, in)`` loads as a Flax ``kernel`` ``(in, out)``::

    gj.load(path, abstract, keys={"params.fc.kernel": ("fc.weight", (1, 0))})
"""

from globalshard_jax.comm import JaxComm, default_comm
from globalshard_jax.loading import Restored, load, metadata
from globalshard_jax.saving import save
from globalshard_jax.tree import pytree_keys

__all__ = ["JaxComm", "Restored", "save", "load", "metadata", "pytree_keys", "default_comm"]
