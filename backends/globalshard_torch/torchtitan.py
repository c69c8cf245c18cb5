"""torchtitan's checkpointer, storing globalshard checkpoints.

torchtitan (0.3) takes its checkpointer from the trainer's config
(``Trainer.Config.checkpoint``: any ``BaseCheckpointManager.Config``).
:class:`CheckpointManager` is torchtitan's own DCP checkpointer, its
policies unchanged (interval, ``keep_latest_k``, the model-only last save in
``export_dtype``, ``initial_load_path``, ``exclude_from_loading``,
``load_step``, the seed checkpoint, Hugging Face loads and saves), with each
``step-<n>`` folder a globalshard checkpoint written by :func:`globalshard_torch.save`
and read by :func:`globalshard_torch.load`::

    from globalshard_torch.torchtitan import CheckpointManager

    config.checkpoint = CheckpointManager.Config(enable=True, folder="checkpoint", interval=500,
                                                 async_mode="async_with_pinned_mem")

``async_mode``: ``"async"`` saves in the background from a thread
(:class:`~globalshard.AsyncSaver` ``mode="thread"``), ``"async_with_pinned_mem"``
from the writer process (``mode="process"``); either returns once this rank's
tensors are copied to host memory. Loads take what the state asks for and
refuse what is missing, as DCP does: keys of the checkpoint no state asks for
(the optimizer, for a model-only load) are left. Hugging Face saves and loads
(``last_save_in_hf``, ``initial_load_in_hf``) stay torchtitan's.

With ``Config.local_folder`` (a directory on each node's own storage), each
step is saved there first, and on the next ``local_replicas`` nodes, then
copied to ``folder`` in the background (a :class:`~globalshard.TieredManager`
whose persistent tier is ``folder``, its steps named ``step-<n>``); a save
returns once every node holds its copy, or with ``async_mode`` once the
tensors are in host memory. A resume (``load()``, no step given) loads the
newest step whole in the nodes' copies or ``folder``, each array from the
nearest copy, onto any layout, even if it never reached ``folder``;
``close()`` waits until the last step has.

A model with frozen parameters (torchtitan's ``LoRAConverter``) stores them
once: each step references the arrays equal to the step that holds them
(``Config.reference_unchanged``), after a resume on another layout too, and
the purge keeps what kept steps reference.

Importing this module needs torchtitan.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer import MODEL, AsyncMode
from torchtitan.components.checkpointer import CheckpointManager as DcpCheckpointManager
from torchtitan.tools import filesystem

import globalshard as gs
from globalshard.errors import MissingKeyError
from globalshard_torch import state_dict as _state_dict
from globalshard_torch.checkpoint import TieredManager
from globalshard_torch.comm import resolve_comm

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


def _step_of(name: str) -> int | None:
    """The step of a ``step-<n>`` folder name; None for another name."""
    rest = name[len("step-"):] if name.startswith("step-") else ""
    return int(rest) if rest.isdigit() else None


#: A checkpoint's commit record (spec section 2): a step folder holding it is a committed checkpoint.
COMMIT_RECORD = "metadata.json"


class _Saving(Future):
    """The background part of an async save, as torchtitan waits for DCP's:
    ``result()`` waits for it and raises its error."""

    def __init__(self, saver: gs.AsyncSaver) -> None:
        super().__init__()
        self._saver = saver

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            if not self._saver.join(timeout):
                raise TimeoutError(f"the checkpoint save is still running after {timeout} s")
            try:
                self._saver.wait()
            except BaseException as e:
                self.set_exception(e)
            else:
                self.set_result(None)
        return super().result(timeout)


@dataclass(frozen=True)
class _Loaded:
    """What the last load filled the model with: the step folder ``root``
    (beside the one loaded, or itself) with save ``save_id`` in ``parent``
    stores these keys whole, and ``digests`` are the SHA-256 of their
    regions as the load filled them, from every rank
    (:func:`globalshard.region_digests`): a later save references those still
    so (``save(..., unchanged=)``), whatever layout each was saved under."""

    parent: str
    root: str
    save_id: str
    digests: dict[str, dict[tuple[int, ...], str]]


class _StepTiers(TieredManager):
    """The fast tier in front of torchtitan's folder: steps persisted as
    ``step-<n>``, as torchtitan names them, and purged by torchtitan."""

    STEP_NAME = "step-{step}"
    STEP_PATTERN = re.compile(r"step-(\d+)")


class _OwnStaging:
    """Stands in for torchtitan's DCP stager, which ``_save`` makes for
    ``async_with_pinned_mem`` (and which needs an accelerator): the
    :class:`~globalshard.AsyncSaver` stages the tensors itself."""

    def close(self) -> None:
        pass


class CheckpointManager(DcpCheckpointManager):
    """torchtitan's checkpointer storing globalshard checkpoints (see the module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(DcpCheckpointManager.Config):
        reference_unchanged: bool = True
        """When the model has parameters that do not require grad (a LoRA
        fine-tune's frozen base): each step stores the arrays byte-identical
        (by SHA-256) to those of a committed step before it as references to
        the step that holds their bytes, and after a load (a resume on
        another layout too) the weights still as the load filled them as
        references to the step it read them from, with that step's cut; so
        the base is written once. The purge keeps every step a kept one
        references. False: every step stores everything."""

        local_folder: str = ""
        """The fast tier (see the module): a directory on each node's own
        storage, the same path on every node (``{node}`` in it is replaced by
        the node's index, for nodes that share a filesystem). A node is
        ``LOCAL_WORLD_SIZE`` consecutive ranks, as torchrun starts them. Empty:
        each step is saved to ``folder`` directly."""

        local_replicas: int = 1
        """How many following nodes also hold a copy of each node's arrays."""

        local_keep: int = 2
        """Steps each node keeps in ``local_folder`` (and the bases they reference)."""

        check_replicas: bool = False
        """Compare the copies ranks hold (replicated DTensors over the data-parallel
        sub-meshes, plain buffers every rank holds) bit for bit before each save
        writes anything, and fail the save naming the key, box and ranks whose
        copies drifted apart (:func:`globalshard.save`'s ``check_replicas``).
        False: one copy is written, the others taken as equal, as DCP does."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.reference_unchanged = config.reference_unchanged
        self.check_replicas = config.check_replicas
        #: The roots each committed step folder references, read once (its metadata.json is parsed whole).
        self._bases_of: dict[str, list[str]] = {}
        self._loaded: _Loaded | None = None
        #: The step folder of the last save begun, and the root it may reference: until its background part
        #: commits, its metadata.json (or an earlier version's) does not say so, and the purge must keep it.
        self._saving: tuple[str, str | None] = ("", None)
        #: The fast tier, when ``local_folder`` is set.
        self.tiers: _StepTiers | None = None
        #: Where the last resume read from (:class:`globalshard.Recovery`), with a fast tier.
        self.recovery: gs.Recovery | None = None
        if self.enable:
            self.stager = _OwnStaging()
            if config.local_folder:
                tier = gs.LocalTier(config.local_folder, replicas=config.local_replicas, keep=config.local_keep)
                self.tiers = _StepTiers(tiers=[tier, self.folder])

    def _saver(self, async_mode: AsyncMode) -> gs.AsyncSaver | None:
        if async_mode == AsyncMode.DISABLED:
            return None
        mode = "process" if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM else "thread"
        saver: gs.AsyncSaver | None = getattr(self, "_async_saver", None)
        if saver is None or saver.mode != mode:
            saver = self._async_saver = gs.AsyncSaver(mode)  # one staging pool, reused by every save
        return saver

    def _close(self) -> None:
        # A save still in flight (a run that stops between a save and the next step's wait) finishes here: the
        # trainer destroys the process group its commit runs over right after close(). Its error, if any, is not
        # raised by close() but stays for maybe_wait_for_saving, or is reported at exit.
        saver: gs.AsyncSaver | None = getattr(self, "_async_saver", None)
        if saver is not None:
            saver.join()
        tiers: _StepTiers | None = getattr(self, "tiers", None)
        if tiers is not None:  # the last step, copied to the folder (its drain's threads end with the process)
            try:
                tiers.wait()
            except Exception as e:  # reported, as an async save's failure is at exit
                logger.error("the last checkpoint was not copied to %s: %s", self.folder, e)
        super()._close()

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """Save ``state_dict`` as a globalshard checkpoint at ``checkpoint_id``
        (Hugging Face files, with ``to_hf``, as torchtitan writes them). A step
        saved again (a run resumed from an earlier step) replaces its checkpoint
        atomically, as DCP writes over it."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        saver = self._saver(async_mode)
        name = os.path.basename(os.path.normpath(checkpoint_id))
        step = _step_of(name)
        # A step of the folder goes through the fast tier, once the step before is in the folder (so that
        # it may be this one's base).
        target: Any = checkpoint_id
        if self.tiers is not None and step is not None and \
                os.path.dirname(os.path.normpath(checkpoint_id)) == os.path.normpath(self.folder):
            target = self.tiers.target(step)
        base, digests = self._base(checkpoint_id)
        unchanged = None
        if digests and (loaded := self._as_loaded(checkpoint_id)) is not None:
            base, unchanged = loaded  # what is still as loaded references the step the load read it from
        self._bases_of.pop(name, None)  # saved anew: read again
        self._saving = (name, None if base is None else os.path.basename(os.path.normpath(base)))
        _state_dict.save(state_dict, target, overwrite=target is checkpoint_id, saver=saver, base=base,
                         digests=digests, unchanged=unchanged, check_replicas=self.check_replicas)
        if saver is None:
            return None
        saving = _Saving(saver)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            staged: Future[None] = Future()
            staged.set_result(None)  # the snapshot is in host memory when save returns
            return AsyncSaveResponse(staging_completion=staged, upload_completion=saving)
        return saving

    def _base(self, checkpoint_id: str) -> tuple[str | None, bool | None]:
        """The base and ``digests`` of a save to ``checkpoint_id`` (see
        ``Config.reference_unchanged``), every region's SHA-256 recorded:
        the step that holds most of what the newest committed step below this
        one references, or that step itself if it references none; (None,
        None) when the model has no frozen parameter. So every step references
        one step (the first of a run, or of a layout) rather than a chain of
        them, each kept for a few small equal tensors. The same on every rank:
        torchtitan waits for the previous save before the next."""
        if not self._has_frozen():
            return None, None
        parent, name = os.path.split(os.path.normpath(checkpoint_id))
        here = _step_of(name)
        steps = [s for s in self._committed_steps(parent) if here is None or s < here]
        # TODO(limitation): a base is chosen among the steps below this one in the same folder only (an
        # initial_load_path checkpoint elsewhere is not referenced); regions cast (the last step in export_dtype)
        # are written again. (After a load, on another layout too: _as_loaded.)
        if not steps:
            return None, True
        previous = filesystem.join(parent, f"step-{max(steps)}")
        try:
            metadata = gs.read_metadata(previous)
        except gs.GlobalShardError as e:  # damaged since it committed: this step stores everything
            logger.warning("%s references no base: %s", checkpoint_id, e)
            return None, True
        held = [0] * len(metadata.bases)
        for t in metadata.tensors.values():
            for r in t.regions:
                if r.base is not None:
                    held[r.base] += r.nbytes
        if not held:
            return previous, True
        anchor = filesystem.join(parent, metadata.bases[held.index(max(held))].root)
        # A base deleted by hand makes the steps referencing it unreadable (they say so); this step starts anew.
        return (anchor if filesystem.isfile(filesystem.join(anchor, COMMIT_RECORD)) else None), True

    def _as_loaded(self, checkpoint_id: str) -> tuple[str, dict[str, dict[tuple[int, ...], str]]] | None:
        """The base and ``unchanged`` digests of a save to ``checkpoint_id``
        after a load (:class:`_Loaded`): the step the load read the model's
        stored keys from, when it is beside this one and still holds that
        save; else None."""
        loaded = self._loaded
        if loaded is None or loaded.parent != os.path.dirname(os.path.normpath(checkpoint_id)) or \
                os.path.basename(os.path.normpath(checkpoint_id)) == loaded.root:
            return None
        root = filesystem.join(loaded.parent, loaded.root)
        try:  # the same file on every rank: the same answer
            if gs.read_metadata(root).save_id != loaded.save_id:
                return None  # saved again since
        except gs.GlobalShardError:
            return None
        return root, loaded.digests

    @staticmethod
    def _committed_steps(folder: str) -> list[int]:
        """The steps of ``folder`` holding a committed globalshard checkpoint."""
        if not filesystem.isdir(folder):
            return []
        found = ((_step_of(name), filesystem.join(folder, name)) for name in filesystem.listdir(folder))
        return [s for s, path in found if s is not None and filesystem.isfile(filesystem.join(path, COMMIT_RECORD))]

    def _purge_stale_checkpoints(self) -> None:
        """The purge of torchtitan's checkpointer (the steps beyond the newest
        ``keep_latest_k`` deleted by rank 0's purge thread), keeping every step
        a kept one references (spec section 2.3), and the steps those reference;
        for the step being saved (in the background: torchtitan purges as soon
        as the save has begun), its base too. The step being saved is one of
        the newest, whether its folder is there yet or not."""
        if not self._should_purge():
            return
        found = set(filesystem.listdir(self.folder))
        # The step being saved counts even before its folder appears (a fast tier's drain makes it later).
        found |= {self._saving[0]} if _step_of(self._saving[0]) is not None else set()
        steps = sorted((int(m.group(1)), name) for name in found if (m := re.search(r"step-(\d+)", name)))
        names = [name for _, name in steps]
        needed: set[str] = set()
        pending = names[-self.keep_latest_k:]
        while pending:
            name = pending.pop()
            path = filesystem.join(self.folder, name)
            saving = name == self._saving[0]
            roots = None if saving else self._bases_of.get(name)
            if roots is None and filesystem.isfile(filesystem.join(path, COMMIT_RECORD)):
                try:
                    roots = [b.root for b in gs.read_metadata(path).bases]
                except gs.GlobalShardError as e:  # what it references is unknown: delete nothing this time
                    logger.warning("not purging %s: %s", self.folder, e)
                    return
                if not saving:  # a save in flight commits another metadata.json: read it again later
                    self._bases_of[name] = roots
            if saving and self._saving[1] is not None:
                roots = [*(roots or []), self._saving[1]]
            if roots is not None:
                pending += [r for r in roots if r not in needed]
                needed.update(roots)
        assert self.purge_thread is not None
        for name in names[:-self.keep_latest_k]:
            if name not in needed:
                self.purge_queue.put(filesystem.join(self.folder, name))
                self._bases_of.pop(name, None)

    def _load(self, step: int = -1) -> bool:
        """Load as torchtitan's checkpointer does; with a fast tier, a resume
        (``step`` -1: the newest step) and ``load(step=n)`` load a step whole in
        the nodes' copies or the folder, each array from the nearest copy
        (:attr:`recovery` says where from)."""
        if self.tiers is None:
            return super()._load(step)
        self._find_load_step()  # refuses a folder whose newest step is DCP's
        found = self.tiers.open_latest(None if step == -1 else step)  # collective
        if found is None:  # nothing saved yet (torchtitan's initial load, if any), or no such step
            return super()._load(step)
        logger.info("Loading step %d from the nearest copies (%s and %s).", found.step, self.tiers.tier.path,
                    self.folder)
        self.dcp_load(self._states_to_load(found.step == 0), found, from_hf=False, from_quantized=False)
        self.recovery = found.recovery
        return True

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: Any, from_hf: bool, from_quantized: bool) -> None:
        """Fill ``state_dict`` from the globalshard checkpoint at ``checkpoint_id``
        (from Hugging Face files, with ``from_hf``, as torchtitan reads them; or
        a step of the fast tier, opened)."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        missing, _ = _state_dict.load(state_dict, checkpoint_id, strict=False)
        tier_step = getattr(checkpoint_id, "step", None) if isinstance(checkpoint_id, gs.Checkpoint) else None
        if missing:
            where = checkpoint_id if tier_step is None else f"step {tier_step} of the fast tier"
            raise MissingKeyError(f"{where} does not hold {len(missing)} keys the training state asks "
                                  f"for: {missing[:10]}")
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
        if tier_step is not None:  # a step of the fast tier: named as its folder is (or will be)
            self._loaded = self._what_was_loaded(filesystem.join(self.folder, f"step-{tier_step}"),
                                                 checkpoint_id.metadata)
        else:
            self._loaded = self._what_was_loaded(checkpoint_id)

    def _what_was_loaded(self, checkpoint_id: str, metadata: gs.Metadata | None = None) -> _Loaded | None:
        """After a load from ``checkpoint_id`` (on every rank): the step folder
        that stores the most bytes of keys whole (a LoRA run's: the step
        holding its frozen base), and the digests of the model's keys it
        stores, as loaded, gathered from every rank; None when saves
        reference nothing (no frozen parameter, or ``reference_unchanged``
        off)."""
        if not self._has_frozen():
            return None
        metadata = metadata if metadata is not None else gs.read_metadata(checkpoint_id)
        holders: dict[int | None, set[str]] = {}
        size: dict[int | None, int] = {}
        for key, t in metadata.tensors.items():
            where = {r.base for r in t.regions}
            if len(where) == 1:
                b = where.pop()
                holders.setdefault(b, set()).add(key)
                size[b] = size.get(b, 0) + sum(r.nbytes for r in t.regions)
        if not holders:
            return None
        best = max(holders, key=lambda b: (size[b], -1 if b is None else b))
        root, save_id = (os.path.basename(os.path.normpath(checkpoint_id)), metadata.save_id) if best is None \
            else (metadata.bases[best].root, metadata.bases[best].save_id)
        assert save_id is not None
        mine = _state_dict.region_digests(self.states[MODEL].state_dict(), holders[best])
        digests: dict[str, dict[tuple[int, ...], str]] = {}
        for part in resolve_comm(None).all_gather({k: [[list(o), d] for o, d in v.items()] for k, v in mine.items()}):
            for key, regions in part.items():
                digests.setdefault(key, {}).update((tuple(o), d) for o, d in regions)
        return _Loaded(os.path.dirname(os.path.normpath(checkpoint_id)), root, save_id, digests)

    def _has_frozen(self) -> bool:
        """Whether saves reference what did not change: a model with parameters that do not require grad."""
        model = self.states.get(MODEL)
        return self.reference_unchanged and any(
            not p.requires_grad for part in getattr(model, "model", ()) for p in part.parameters())

    def _find_load_step(self, folder: str = "") -> int:
        """The highest step whose folder holds a committed globalshard checkpoint
        (or Hugging Face files); -1 if none.

        Raises:
            ValueError: a newer step holds a DCP checkpoint (this folder was
                written by torchtitan's own checkpointer), which this one does not
                read: resuming from an older step, or from none, would silently
                lose that training.
        """
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return -1
        steps, dcp = [], []
        for name in filesystem.listdir(folder):
            step = _step_of(name)
            if step is None:
                continue
            path = filesystem.join(folder, name)
            if filesystem.isfile(filesystem.join(path, COMMIT_RECORD)) or \
                    filesystem.isfile(filesystem.join(path, "model.safetensors.index.json")):
                steps.append(step)
            elif filesystem.isfile(filesystem.join(path, ".metadata")):
                dcp.append(step)
        latest = max(steps, default=-1)
        if dcp and max(dcp) > latest:
            raise ValueError(f"{filesystem.join(folder, f'step-{max(dcp)}')} holds a DCP checkpoint, newer than any "
                             f"globalshard one in {folder} (latest: {latest}); this checkpointer reads globalshard "
                             "checkpoints only: resume that step with torchtitan's own CheckpointManager (and save "
                             "it with this one), or move it away")
        return latest
