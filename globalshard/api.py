"""Moved to :mod:`globalshard.checkpoint`; this name keeps working."""

from globalshard.checkpoint import (
    AsyncSaver,
    Checkpoint,
    load,
    read_array,
    read_metadata,
    read_trainer_state,
    save,
    wait_for_cleanup,
)
from globalshard.checkpoint.cleanup import BACKGROUND_DELETE_BYTES, delete_in_background
from globalshard.format.paths import new_save_id

__all__ = ["BACKGROUND_DELETE_BYTES", "AsyncSaver", "Checkpoint", "delete_in_background", "load", "new_save_id",
           "read_array", "read_metadata", "read_trainer_state", "save", "wait_for_cleanup"]
