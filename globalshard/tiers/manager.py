"""A checkpoint manager with a fast tier: each step saved to the nodes'
own storage (and the next nodes'), drained to the persistent tier in the
background, and recovered onto any layout from the nearest copies."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from globalshard.checkpoint.async_save import AsyncSaver
from globalshard.checkpoint.manager import CheckpointManager
from globalshard.comm import Comm, SingleProcessComm
from globalshard.errors import LayoutError
from globalshard.format.metadata import Metadata
from globalshard.layout import ShardedTensor
from globalshard.store import open_root
from globalshard.tiers.local import LocalTier
from globalshard.tiers.recovery import Recovery, TieredCheckpoint, open_latest
from globalshard.tiers.saving import Drain, save_tiered

__all__ = ["TieredManager"]

_log = logging.getLogger("globalshard")


class TieredManager(CheckpointManager):
    """:class:`~globalshard.CheckpointManager` with a node-local tier in front.

    ``tiers``: a :class:`LocalTier`, then the persistent tier (a directory on
    a shared filesystem, or any kvstore: S3, GCS), where ``iter_*`` steps are
    kept, pointed to and pruned as by the plain manager. :meth:`save` returns
    once every node has committed its tier copy of the step (its ranks'
    arrays, and those of the ``replicas`` nodes before it), or with a
    ``saver`` once the arrays are in its staging pool; the step is
    copied to the persistent tier in the background and is *persisted* once
    committed there (:meth:`persisted`). :meth:`load_latest` loads the newest
    step that the copies this job reaches (or the persistent tier) hold whole,
    each stored read from this node's copy, else a peer node's (sent over
    ``comm``, which must have ``exchange``), else the persistent tier; the
    layout may differ in any way from the one that saved it.

    >>> import numpy as np, tempfile
    >>> from globalshard import ShardedTensor
    >>> d = tempfile.mkdtemp()
    >>> manager = TieredManager(tiers=[LocalTier(d + "/local"), d + "/persistent"], keep_last=2)
    >>> w = np.arange(4, dtype=np.float32)
    >>> _ = manager.save(100, {"w": ShardedTensor.from_offset("w", w, global_shape=(4,), global_offset=(0,))})
    >>> manager.wait(); manager.persisted()
    100
    >>> target = {"w": ShardedTensor.from_offset("w", np.zeros(4, np.float32), global_shape=(4,), global_offset=(0,))}
    >>> manager.load_latest(target)["step"], manager.recovery.bytes_local
    (100, 16)
    >>> import shutil; shutil.rmtree(d)
    """

    def __init__(self, *, tiers: Sequence[Any], keep_last: int | None = None, comm: Comm | None = None,
                 kvstore: Any = None) -> None:
        local = [t for t in tiers if isinstance(t, LocalTier)]
        persistent = [t for t in tiers if not isinstance(t, LocalTier)]
        if len(local) != 1 or len(persistent) != 1 or not isinstance(tiers[0], LocalTier):
            # TODO(limitation): one local tier, then one persistent tier.
            raise LayoutError("tiers must be one LocalTier, then the persistent tier (a path, URL or kvstore spec)")
        super().__init__(persistent[0], keep_last=keep_last, comm=comm, kvstore=kvstore)
        self.tier = local[0]
        self._drain: Drain | None = None
        #: The saver of an asynchronous save whose tier copies may be in flight.
        self._saver: AsyncSaver | None = None
        self._persisted: int | None = None
        #: Where the last :meth:`load_latest` read from (None before one).
        self.recovery: Recovery | None = None

    def _comm_or_single(self) -> Comm:
        comm = self.comm()
        return comm if comm is not None else SingleProcessComm()

    def save(self, step: int, state: Mapping[str, ShardedTensor], **kwargs: Any) -> Any:
        """Save ``state`` as step ``step`` into the local tier (see the class),
        after the previous step's drain has ended; ``trainer_state`` (gaining
        ``"step"``) and ``stats`` as for :func:`~globalshard.save`. Raises the
        previous step's failure, if it failed. Returns the step's path in the
        persistent tier.

        With ``saver`` (an :class:`~globalshard.AsyncSaver`), returns once this
        rank's arrays are copied into the saver's staging pool; writing them to
        the node's tier (by the saver's writer process, in process mode), the
        copies to the next nodes and the commit of every node's copy run in
        the background, then the drain. ``saver.wait()`` waits for the tier
        copies and raises their failure; :meth:`wait` for the drain as well.
        ``staged``: as for :meth:`AsyncSaver.save <globalshard.AsyncSaver.save>`;
        ``pack_below``: as for :func:`~globalshard.save`. ``base`` (a persisted
        step's path, :meth:`path`), ``frozen`` (key patterns), ``digests`` and
        ``unchanged``: as for :func:`~globalshard.save`, the frozen keys (a LoRA
        fine-tune's base weights), the regions hashed equal to the base's and
        the keys still as a load from the base gave them (in the base's cut)
        referenced in that step, not written to the tiers at all; a recovery reads them from
        the nodes' tier copies of the base's step (kept while a kept copy
        references it), else from the persistent tier. ``check_replicas``: as
        for :func:`~globalshard.save`."""
        trainer_state, stats = kwargs.pop("trainer_state", None), kwargs.pop("stats", None)
        saver, staged = kwargs.pop("saver", None), kwargs.pop("staged", None)
        pack_below, base, frozen = kwargs.pop("pack_below", 0), kwargs.pop("base", None), kwargs.pop("frozen", ())
        digests, unchanged = kwargs.pop("digests", None), kwargs.pop("unchanged", None)
        check_replicas = kwargs.pop("check_replicas", False)
        if kwargs:
            raise TypeError(f"TieredManager.save takes trainer_state, stats, saver, staged, pack_below, base, "
                            f"frozen, digests, unchanged and check_replicas, not {sorted(kwargs)}")
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if staged and saver is None:
            raise LayoutError("staged= needs saver=: arrays still being filled are waited for by its background")
        self.wait()
        if saver is not None:
            saver.wait()  # its pool is reused: a save of its own may still be writing from it
        trainer = dict(trainer_state or {})
        trainer.setdefault("step", step)

        def drained(drain: Drain) -> None:
            self._drain = drain

        drain = save_tiered(state, step, self._comm_or_single(), self.tier, self.store,
                            lambda s: open_root(self.path(s)), trainer_state=trainer, stats=stats,
                            on_persisted=self._on_persisted, saver=saver, staged=staged, on_drain=drained,
                            pack_below=pack_below, base=base, frozen=frozen, digests=digests,
                            unchanged=unchanged, check_replicas=check_replicas)
        if saver is None:
            self._drain = drain
        else:  # the background hands over the drain, before the saver's wait() returns
            self._saver = saver
        return self.path(step)

    def _on_persisted(self, step: int) -> None:
        # Rank 0's drain, once the persistent commit is done: the plain manager's pointer and retention.
        self._persisted = step
        self._write_pointer(step)
        self._prune(keep=self.step_name(step))
        self._remove_leftovers()

    def wait(self) -> None:
        """Wait until the step in flight is persisted; raise why it was not, if it was not."""
        self._wait_for_copies()
        if self._drain is not None:
            drain, self._drain = self._drain, None
            drain.wait()

    def _wait_for_copies(self) -> None:
        """Wait for an asynchronous save's tier copies (its drain then runs on)."""
        if self._saver is not None:
            saver, self._saver = self._saver, None
            saver.wait()

    def persisted(self) -> int | None:
        """The newest step committed in the persistent tier (None: none yet)."""
        if self._persisted is not None:
            return self._persisted
        done = self.complete()
        return done[-1][0] if done else None

    def load_latest(self, state: Mapping[str, ShardedTensor], **kwargs: Any) -> dict[str, Any] | None:
        """Load ``state`` from the newest step whole in the tiers this job reaches
        (see the class): its trainer state, or None when there is none. Where
        the bytes came from is in :attr:`recovery`."""
        found = self.open_latest()
        if found is None:
            return None
        trainer = found.load(state, **kwargs)
        self.recovery = found.recovery
        return trainer

    def open_latest(self, step: int | None = None) -> TieredCheckpoint | None:
        """The newest step whole in the tiers this job reaches (with ``step``,
        that step), opened for loading (a :class:`~globalshard.Checkpoint`
        whose loads read the nearest copies), or None. Collective. An
        asynchronous save's tier copies in flight are waited for first (not
        its drain)."""
        self._wait_for_copies()
        return open_latest(self._comm_or_single(), self.tier, self._persisted_steps,
                           lambda s: open_root(self.path(s)), step)

    def _persisted_steps(self) -> list[tuple[int, Metadata]]:
        return [(step, metadata) for step, _, metadata in self._complete()]
