"""The exceptions globalshard raises.

Every error the public API raises for bad input or a bad checkpoint derives
from :class:`GlobalShardError`, and also from the builtin exception it refines,
so ``except ValueError`` keeps working for callers that do not know us.
Messages name the key, the box, the file or the JSON path of the problem; where
several problems are found, all of them are reported in one exception.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CastError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CommError",
    "ConcurrentSaveError",
    "GlobalShardError",
    "LayoutError",
    "MetadataError",
    "MismatchError",
    "MissingKeyError",
    "StorageError",
    "TrainerStateError",
]

# How many problems one exception lists before summarising the rest.
_MAX_LISTED = 20


class GlobalShardError(Exception):
    """Root of every error raised by globalshard."""


class MetadataError(GlobalShardError, ValueError):
    """metadata.json or trainer_state.json is malformed or inconsistent."""


class TrainerStateError(MetadataError, TypeError):
    """A trainer state holds values that JSON would not give back unchanged."""


class LayoutError(GlobalShardError, ValueError):
    """Shards are inconsistent: gaps, overlaps, shapes or dtypes that disagree."""


class MismatchError(GlobalShardError, ValueError):
    """What a load asks for does not match the checkpoint (key, shape, dtype)."""


class MissingKeyError(MismatchError, KeyError):
    """A key asked for is not in the checkpoint."""

    __str__ = Exception.__str__  # KeyError would print the message quoted


class CastError(MismatchError, TypeError):
    """A dtype conversion that would lose information was not allowed."""


class StorageError(GlobalShardError, OSError):
    """Stored data is missing, truncated, corrupted or cannot be written."""


class CheckpointNotFoundError(MetadataError, FileNotFoundError):
    """The path holds no committed checkpoint: there is no metadata.json."""


class CheckpointExistsError(GlobalShardError, FileExistsError):
    """A save would overwrite a committed checkpoint without ``overwrite=True``."""


class ConcurrentSaveError(CheckpointExistsError):
    """Another save to the same path is running, or committed while this one ran."""


class CommError(GlobalShardError, RuntimeError):
    """Another rank failed during a collective save or load."""


def format_problems(summary: str, problems: Sequence[str]) -> str:
    """Join a summary and a list of problems into one readable message."""
    listed = list(problems[:_MAX_LISTED])
    lines = [summary] + [f"  - {p}" for p in listed]
    if len(problems) > _MAX_LISTED:
        lines.append(f"  ... and {len(problems) - _MAX_LISTED} more")
    return "\n".join(lines)
