"""globalshard: distributed checkpoints stored by global coordinates.

Each rank describes its pieces of every array by where they sit in the global
array (:class:`ShardedTensor`), :func:`save` stores them once each, and
:func:`load` fills any other set of pieces, cut under any other parallel
layout, reading only the bytes each needs. numpy and TensorStore only: no
torch, no jax (those adapters live in ``backends/``).
"""

import logging as _logging

# The modules of version 2, kept importable as ``globalshard.api`` and so on.
from globalshard import api, metadata, storage  # noqa: F401
from globalshard.checkpoint import (
    AsyncSaver,
    Checkpoint,
    CheckpointManager,
    copy,
    load,
    read_array,
    read_metadata,
    read_trainer_state,
    region_digests,
    remove_keys,
    save,
    wait_for_cleanup,
)
from globalshard.comm import Comm, SingleProcessComm
from globalshard.dtypes import SUPPORTED_DTYPES, is_exact_cast
from globalshard.errors import (
    CastError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommError,
    ConcurrentSaveError,
    GlobalShardError,
    LayoutError,
    MetadataError,
    MismatchError,
    MissingKeyError,
    StorageError,
    TrainerStateError,
)
from globalshard.format.metadata import FORMAT_VERSION, Metadata, StoredRegion, TensorMetadata
from globalshard.geometry import Box, Region, Segment
from globalshard.io.base import IOStats
from globalshard.layout import PADDING_SUFFIX, ShardedStateDict, ShardedTensor, is_padding_key, shards_from_flat_range
from globalshard.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, ShardInfo
from globalshard.tiers import LocalTier, Recovery, TieredManager

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "AsyncSaver",
    "SUPPORTED_DTYPES",
    "Box",
    "CastError",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "Comm",
    "CommError",
    "ConcurrentSaveError",
    "GlobalShardError",
    "IOStats",
    "LayoutError",
    "LocalTier",
    "LoadPlan",
    "LoadPlanner",
    "Metadata",
    "MetadataError",
    "MismatchError",
    "MissingKeyError",
    "Recovery",
    "Region",
    "SavePlan",
    "SavePlanner",
    "Segment",
    "ShardInfo",
    "ShardedStateDict",
    "ShardedTensor",
    "PADDING_SUFFIX",
    "is_padding_key",
    "SingleProcessComm",
    "StorageError",
    "TrainerStateError",
    "StoredRegion",
    "TensorMetadata",
    "TieredManager",
    "copy",
    "is_exact_cast",
    "load",
    "read_array",
    "read_metadata",
    "read_trainer_state",
    "region_digests",
    "remove_keys",
    "save",
    "shards_from_flat_range",
    "wait_for_cleanup",
]

# Silent unless the application configures logging: save/load begin and end
# (bytes, seconds, GB/s) at INFO on the "globalshard" logger, plans at DEBUG.
_logging.getLogger("globalshard").addHandler(_logging.NullHandler())
