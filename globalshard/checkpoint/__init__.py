"""Orchestration: when, on which rank and in what order a checkpoint is saved,
committed, cleaned up, loaded and managed, written once against
:class:`~globalshard.store.Store` and :class:`~globalshard.io.ArrayEngine`."""

from globalshard.checkpoint.async_save import AsyncSaver
from globalshard.checkpoint.bases import region_digests
from globalshard.checkpoint.cleanup import wait_for_cleanup
from globalshard.checkpoint.copying import copy
from globalshard.checkpoint.loading import Checkpoint, load, read_array, read_metadata, read_trainer_state
from globalshard.checkpoint.manager import CheckpointManager
from globalshard.checkpoint.removing import remove_keys
from globalshard.checkpoint.saving import save

__all__ = ["AsyncSaver", "Checkpoint", "CheckpointManager", "copy", "load", "read_array", "read_metadata",
           "read_trainer_state", "region_digests", "remove_keys", "save", "wait_for_cleanup"]
