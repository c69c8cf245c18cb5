"""Megatron-Core's ``dist_checkpointing`` with globalshard storing the sharded tensors.

A Megatron-Core model and its distributed optimizer describe their state as a
sharded state dict (``model.sharded_state_dict()``,
``optimizer.sharded_state_dict(...)``): each ``ShardedTensor`` already names
its place in a global array, under a key that does not depend on the
parallel layout. ``dist_checkpointing.save`` and ``load`` take a *strategy*
for those tensors; this module provides one::

    import globalshard_torch.megatron as gm   # registers the "globalshard" backend

    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=gm.SaveStrategy())
    state = dist_checkpointing.load(other_layouts_sharded_state_dict, ckpt_dir)  # finds the backend itself

Megatron keeps what is its own: it applies factories, checks that every
shard is saved once, writes the common state (``common.pt``) and the
sharded objects with ``torch.save``, and records the backend in its
``metadata.json``. The sharded tensors become a globalshard checkpoint in
``<ckpt_dir>/globalshard`` (spec/FORMAT.md): each main replica's box
stored once, checksummed, committed atomically, and read back under any
other layout, each rank reading only the boxes it asks for. ``globalshard
inspect``, ``verify`` and the core's :func:`globalshard.load` open that
directory as any other checkpoint.

Megatron's conventions are kept: a shard is the main replica when its
``replica_id`` is 0 or all zeros; the axes a ``ShardedTensor`` prepends
(``prepend_axis_num``, stacked layers) are axes of the stored array; a
target with ``allow_shape_mismatch`` (the padded vocabulary of embeddings and
output layers) reads the part of the stored array it overlaps and is zero
elsewhere, as Megatron's own strategy does. Loading fills each target's
``data`` in place (created on the CPU when it is None) and returns the state
dict of those tensors. Errors are Megatron's ``CheckpointingException``, as
from its own strategies, with globalshard's message (naming the key, box or
file) and its error as the cause.

``SaveStrategy(saver=gs.AsyncSaver())`` also serves
``dist_checkpointing.save(..., async_sharded_save=True)``: the call returns
once this rank's tensors are in host memory, the saver's writer process
writes them, and the request's async function (run by Megatron's
``AsyncCallsQueue``, in a process of its own) ends when the save is
committed; the finalization raises the save's error, if any, before
Megatron writes its ``metadata.json``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor as MegatronTensor
from megatron.core.dist_checkpointing.mapping import is_main_replica
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

import globalshard as gs
from globalshard.comm import Comm
from globalshard.errors import LayoutError
from globalshard.geometry import Box, Region
from globalshard.hf import NameMapping, SafetensorsSource
from globalshard_torch.comm import resolve_comm
from globalshard_torch.tensors import HostStaging, load_device, numpy_view, torch_dtype, unusable

__all__ = ["ARRAYS", "BACKEND", "VERSION", "LoadStrategy", "SaveStrategy", "arrays_path", "load_hf"]

#: The backend name recorded in Megatron's metadata.json (``sharded_backend``).
BACKEND = "globalshard"
#: Its version (``sharded_backend_version``): the globalshard checkpoint in ``ARRAYS``.
VERSION = 1
#: The directory of a Megatron checkpoint that holds the globalshard checkpoint.
ARRAYS = "globalshard"


def arrays_path(checkpoint_dir: Any) -> str:
    """The globalshard checkpoint inside a Megatron checkpoint directory."""
    return os.path.join(os.fspath(checkpoint_dir), ARRAYS)


@contextlib.contextmanager
def _megatron_errors() -> Iterator[None]:
    """Our errors as Megatron's ``CheckpointingException`` (what callers of
    dist_checkpointing catch, as they catch its own strategies'), with the same
    message and the original as its cause."""
    try:
        yield
    except gs.GlobalShardError as e:
        raise CheckpointingException(f"{type(e).__name__}: {e}") from e


def _tensors(sharded_state_dict: Any) -> list[MegatronTensor]:
    out = []
    for value in nested_values(sharded_state_dict):
        if not isinstance(value, MegatronTensor):
            key = getattr(value, "key", None)
            raise LayoutError(f"{key!r}: a {type(value).__name__} reached the globalshard strategy, which stores "
                              "ShardedTensors only (dist_checkpointing saves sharded objects itself)")
        if value.flattened_range is not None:  # refused by Megatron-Core 0.16 too
            raise LayoutError(f"{value.key!r}: a flattened_range ShardedTensor (Megatron-Core before 0.14)")
        out.append(value)
    return out


def _box(t: MegatronTensor) -> Box:
    """A ShardedTensor's box of the global array (its prepended axes one element long)."""
    return Box(tuple(t.global_offset), (1,) * t.prepend_axis_num + tuple(t.local_shape))


def _inside(t: MegatronTensor, global_shape: tuple[int, ...]) -> Box | None:
    """The part of its box inside an array of ``global_shape`` (None when none is)."""
    inside = _box(t).intersect(Box.full(global_shape))
    return None if inside is None or inside.is_empty else inside


def _piece(t: MegatronTensor, data: Any, global_shape: tuple[int, ...], *, main: bool) -> gs.ShardedTensor:
    """The core's piece for a ShardedTensor whose local values are ``data`` (numpy):
    its prepended axes become leading axes of one element. When ``global_shape``
    (the stored array's) is not the ShardedTensor's (``allow_shape_mismatch``), the
    piece is the part of its box inside it, the rest padding (zero-filled on load)."""
    if tuple(data.shape) != tuple(t.local_shape):
        raise LayoutError(f"{t.key!r}: data of shape {tuple(data.shape)}, local_shape {tuple(t.local_shape)}")
    view, box = data[(None,) * t.prepend_axis_num], _box(t)
    replica = 0 if main else 1
    if global_shape == tuple(t.global_shape):
        return gs.ShardedTensor(t.key, view, global_shape, (Region(Box.full(view.shape), box),), replica_id=replica)
    inside = _inside(t, global_shape)
    assert inside is not None
    region = Region(local_box=inside.translate(tuple(-o for o in box.offset)), global_box=inside)
    return gs.ShardedTensor(t.key, view, global_shape, (region,), replica_id=replica, allow_padding=True)


class SaveStrategy(AsyncSaveShardedStrategy):
    """Stores a sharded state dict's ShardedTensors as a globalshard checkpoint
    (see the module). Call collectively, as ``dist_checkpointing.save`` does.

    Args:
        saver: a :class:`globalshard.AsyncSaver` for ``async_sharded_save=True``
            (one of the strategy's own when None); synchronous saves do not use it.
        comm: the communicator (default: one over the whole world).
        pack_below: as for :func:`globalshard.save`.
        check_replicas: as for :func:`globalshard.save`: the copies of each
            box (a layernorm every TP rank holds, data-parallel replicas) are
            compared bit for bit before anything is written, and copies that
            drifted apart raise, naming the key, box and ranks.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, saver: gs.AsyncSaver | None = None,
                 comm: Comm | None = None, pack_below: int = 0, check_replicas: bool = False) -> None:
        super().__init__(backend, version)
        self.saver, self.comm, self.pack_below = saver, comm, pack_below
        self.check_replicas = check_replicas

    @property
    def can_handle_sharded_objects(self) -> bool:
        # TODO(limitation): ShardedObjects (RNG states, Transformer Engine extra state, the
        # distributed optimizer's bucket sizes) go to Megatron's common strategy: torch.save files.
        return False

    def _staged(self, sharded_state_dict: Any, saver: gs.AsyncSaver | None
                ) -> tuple[HostStaging, dict[str, gs.ShardedTensor]]:
        staging = HostStaging.for_save(saver)
        pieces: dict[str, gs.ShardedTensor] = {}
        for i, t in enumerate(_tensors(sharded_state_dict)):
            if t.data is None:
                raise LayoutError(f"{t.key!r}: a ShardedTensor without data cannot be saved")
            if (why := unusable(t.data)) is not None:
                raise LayoutError(f"{t.key!r}: {why}")
            pieces[f"{i}:{t.key}"] = _piece(t, numpy_view(staging.host(t.data, for_save=True)),
                                            tuple(t.global_shape), main=is_main_replica(t.replica_id))
        staging.ready()
        return staging, pieces

    def _options(self) -> dict[str, Any]:
        comm = resolve_comm(self.comm)
        # dist_checkpointing.save writes over what a directory holds (an earlier, failed save's
        # leftovers); the globalshard checkpoint there stays loadable until this one commits.
        return dict(comm=comm, overwrite=True, pack_below=self.pack_below, check_replicas=self.check_replicas)

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        """Store the ShardedTensors; returns once the checkpoint is committed."""
        with _megatron_errors():
            staging, pieces = self._staged(sharded_state_dict, None)
            staging.save(pieces, arrays_path(checkpoint_dir), None, **self._options())

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> AsyncRequest:
        """Start the save in the background and describe its end to Megatron
        (see the module): the returned request's function waits, in Megatron's
        async process, until this rank's save is over; its finalization raises
        the save's error, if any."""
        if self.saver is None:
            self.saver = gs.AsyncSaver()
        saver = self.saver
        with _megatron_errors():
            staging, pieces = self._staged(sharded_state_dict, saver)
            staging.save(pieces, arrays_path(checkpoint_dir), saver, **self._options())
        fd, over = tempfile.mkstemp(prefix="globalshard-megatron-")
        os.close(fd)
        os.unlink(over)

        def watch() -> None:
            saver.join()
            with open(over, "w"):
                pass

        threading.Thread(target=watch, name="globalshard-megatron-watch", daemon=True).start()

        def finalize() -> None:
            try:
                with _megatron_errors():
                    saver.wait()
            finally:
                if os.path.exists(over):
                    os.unlink(over)

        return AsyncRequest(_wait_for_file, (over,), [finalize])


def _wait_for_file(path: str) -> None:
    """Megatron's async function: return once ``path`` exists (a plain path, so it
    crosses into a forked or a spawned worker alike)."""
    while not os.path.exists(path):
        time.sleep(0.01)


def _target(t: MegatronTensor, stored: tuple[int, ...] | None, staging: HostStaging) -> gs.ShardedTensor | None:
    """The core's piece a load fills ``t.data`` through (made on the CPU when None; on
    :func:`load_device` when on the meta device, as DCP makes it: Megatron's torch_dist
    gives such a target back on the meta device, unfilled), or None when ``t`` allows a
    shape mismatch and lies wholly beyond the ``stored`` array (of that shape; None: not
    stored): its data is then zeros, as it is beyond the stored part in any case."""
    if t.data is None or t.data.device.type == "meta":
        device = "cpu" if t.data is None else load_device()
        t.data = None
        t.init_data(device, init_fn=torch.zeros if t.allow_shape_mismatch else torch.empty)
    else:
        t.data = t.data.detach()
        if (why := unusable(t.data)) is not None:
            raise LayoutError(f"{t.key!r}: {why}")
        if t.allow_shape_mismatch:
            t.data.zero_()
    assert t.data is not None
    shape = stored if t.allow_shape_mismatch and stored is not None else tuple(t.global_shape)
    if shape != tuple(t.global_shape) and _inside(t, shape) is None:
        return None  # a device tensor is not staged for nothing
    return _piece(t, numpy_view(staging.host(t.data, for_save=False)), shape, main=True)


class LoadStrategy(LoadShardedStrategy):
    """Fills a sharded state dict's ShardedTensors from the globalshard
    checkpoint in a Megatron checkpoint directory (see the module).

    Args:
        comm: the communicator (default: one over the whole world).
        allow_lossy_cast: as for :func:`globalshard.load`.
    """

    def __init__(self, *, comm: Comm | None = None, allow_lossy_cast: bool = False) -> None:
        super().__init__()
        self.comm, self.allow_lossy_cast = comm, allow_lossy_cast

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"the globalshard strategy reads backend {BACKEND!r}, not {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"the globalshard strategy reads version {VERSION} of its backend, "
                                         f"not {loaded_version!r}")

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> dict[str, Any]:
        """Fill every ShardedTensor's ``data`` (see the module); the state dict of those tensors."""
        with _megatron_errors():
            return self._load(sharded_state_dict, arrays_path(checkpoint_dir))

    def _load(self, sharded_state_dict: Any, path: str) -> dict[str, Any]:
        tensors = _tensors(sharded_state_dict)
        comm = resolve_comm(self.comm)
        checkpoint = gs.Checkpoint.open(path, comm=comm)  # its metadata sizes padded targets, then it loads
        stored = checkpoint.metadata.tensors
        staging = HostStaging()
        targets: dict[str, gs.ShardedTensor] = {}
        for i, t in enumerate(tensors):
            found = stored.get(t.key)
            target = _target(t, None if found is None else tuple(found.global_shape), staging)
            if target is not None:
                targets[f"{i}:{t.key}"] = target
        checkpoint.load(targets, comm=comm, allow_lossy_cast=self.allow_lossy_cast)
        staging.finish_load()
        return dict_list_map_outplace(lambda t: t.data, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> dict[str, MegatronTensor]:
        """Each stored key as a ShardedTensor of its global shape and dtype, without data."""
        with _megatron_errors():
            metadata = gs.read_metadata(arrays_path(checkpoint_dir))
        return {key: MegatronTensor.from_rank_offsets(
                    key, torch.empty(t.global_shape, dtype=torch_dtype(t.dtype), device="meta")).without_data()
                for key, t in metadata.tensors.items() if not gs.is_padding_key(key)}

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> None:
        """Remove the tensors whose keys begin with ``key_prefix``, in place
        (:func:`globalshard.remove_keys`: one commit, then their arrays
        deleted); as Megatron's own strategy, a warning and nothing else when
        no key does. Call it on one rank, as Megatron's test does."""
        with _megatron_errors():
            path = arrays_path(checkpoint_dir)
            if not any(k.startswith(key_prefix) for k in gs.read_metadata(path).tensors):
                warnings.warn(f"There are no tensors in {os.fspath(checkpoint_dir)} whose keys begin with "
                              f'"{key_prefix}". Skipping removal.', stacklevel=2)
                return
            gs.remove_keys(path, [glob.escape(key_prefix) + "*"])


def load_hf(directory: str, sharded_state_dict: Any, *, mapping: NameMapping | str,
            params: dict[str, float] | None = None, allow_lossy_cast: bool = False, strict: bool = True,
            comm: Comm | None = None) -> tuple[Any, dict[str, Any]]:
    """A Megatron model's state from Hugging Face safetensors, through a mapping read
    in reverse (``megatron_dist``, ``megatron_dist_qwen3``, ...: the mappings that
    export what this strategy stores): what ``dist_checkpointing.load`` returns
    for a checkpoint, for ``model.load_state_dict``, each rank reading only the
    rows of the files its ShardedTensors cover.

    Megatron's factories (fused ``[gate; up]``, experts) are applied and merged
    as ``dist_checkpointing.load`` does; ``allow_shape_mismatch`` targets (a padded
    vocabulary) read the files' rows and are zero beyond them. Sharded objects
    (a layer's ``_extra_state``) and the mapping's skipped keys the files lack (a
    router's expert bias for a Hugging Face model without one) come back as
    they are in the model.

    Args:
        directory: ``model.safetensors``, or ``model.safetensors.index.json`` and its files.
        sharded_state_dict: the model's ``sharded_state_dict()``, or with virtual
            pipeline stages the list of its chunks' (in local order), so that
            what no rank reads is decided over all of them.
        mapping: a shipped mapping's name, a mapping file, or a :class:`~globalshard.hf.NameMapping`.
        params: the mapping's params (``{"heads": 32, "kv_heads": 8}``).
        allow_lossy_cast: allow e.g. a bfloat16 model from float32 files.
        strict: a tensor of the files that no rank reads (an untied ``lm_head``, norms
            the model lacks) is an error; ``False`` loads the rest and reports them.
        comm: the ranks loading together (by default torch.distributed's).

    Returns:
        The state dict (a list of them for a list of chunks), and
        :func:`globalshard_torch.load_hf`'s figures for this rank.

    Raises:
        MismatchError: keys the files lack or of another global shape, each named.
        CastError: a lossy conversion not allowed.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    from globalshard_torch.hf import fill_from_safetensors

    if isinstance(mapping, str):
        mapping = NameMapping.load(mapping, params)
    source = SafetensorsSource(directory, mapping)
    chunks = sharded_state_dict if isinstance(sharded_state_dict, list) else [sharded_state_dict]
    prepared = [load_preprocess(chunk) for chunk in chunks]
    staging = HostStaging()
    targets: dict[str, gs.ShardedTensor] = {}
    for c, (state, _, _) in enumerate(prepared):
        for i, t in enumerate(v for v in nested_values(state) if isinstance(v, MegatronTensor)):
            found = source.keys.get(t.key)
            target = _target(t, None if found is None else found[1], staging)
            if target is not None:
                targets[f"{c}:{i}:{t.key}"] = target
    report = fill_from_safetensors(source, targets, allow_lossy_cast=allow_lossy_cast, strict=strict, comm=comm)
    staging.finish_load()
    out = []
    for state, nonpersistent, factories in prepared:
        loaded = dict_list_map_outplace(lambda v: v.data if isinstance(v, (MegatronTensor, ShardedObject)) else v,
                                        state)
        merge(loaded, nonpersistent)
        out.append(apply_factory_merges(loaded, factories))
    return (out if isinstance(sharded_state_dict, list) else out[0]), report


def _registered() -> None:
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())


_registered()
