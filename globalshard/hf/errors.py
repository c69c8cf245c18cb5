"""The errors of the Hugging Face side: a mapping, a dtype or a file that cannot be used."""

from __future__ import annotations

from globalshard.errors import GlobalShardError, StorageError


class ExportError(GlobalShardError, ValueError):
    """A mapping, a dtype or a safetensors file that cannot be used as asked."""


class DamagedFileError(ExportError, StorageError):
    """A safetensors file whose header or data is damaged or inconsistent
    (a :class:`~globalshard.errors.StorageError`, as any damaged data)."""
