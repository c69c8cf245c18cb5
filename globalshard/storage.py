"""Moved: roots to :mod:`globalshard.store`, arrays to :mod:`globalshard.io`,
chunk shapes to :mod:`globalshard.format.zarr`. ``Location`` is gone
(:func:`globalshard.store.open_root` returns a ``Store``); these names keep working."""

from globalshard.format.zarr import CHUNK_BYTES, chunk_shape
from globalshard.io.base import READ_WINDOW_BYTES, WRITE_WINDOW_BYTES, ArrayItem, IOStats, PackItem

__all__ = ["CHUNK_BYTES", "READ_WINDOW_BYTES", "WRITE_WINDOW_BYTES", "ArrayItem", "IOStats", "PackItem", "chunk_shape"]
