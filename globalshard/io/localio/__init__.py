"""Stored arrays in local files, read and written without TensorStore.

The arrays are the same zarr v3 arrays TensorStore reads and writes (spec
section 5): ``[bytes, crc32c]`` chunks, alone or inside one
``sharding_indexed`` shard. Going around TensorStore for local files saves
what a profile of a load showed to cost most of its time: TensorStore's
portable crc32c (the ``crc32c`` package uses the CPU's instructions), its
decode into a buffer of its own, and the copy from there into the target.
Here a chunk is read with ``preadv`` straight into the target when it is a
contiguous piece of it, otherwise into a reusable per-thread buffer, its
checksum verified before a byte of it is copied out.

Only layouts this package fully understands are served: anything else in a
zarr.json (another codec, a big-endian ``bytes``, another chunk key
encoding) makes :func:`parse` return None and the caller goes through
TensorStore. Object stores always go through TensorStore.

* :mod:`~globalshard.io.localio.files`: parsing zarr.json, chunk errors, vectored I/O, the threads.
* :mod:`~globalshard.io.localio.write`: arrays and packs into files.
* :mod:`~globalshard.io.localio.read`: chunks into targets.
* :mod:`~globalshard.io.localio.packs`: packs into their members.
"""

from globalshard.io.localio.files import (
    READ_TASK_BYTES,
    TASK_BYTES,
    ArrayFile,
    ChunkError,
    Where,
    make_pool,
    parse,
    pool,
    workers,
)
from globalshard.io.localio.packs import read_packs
from globalshard.io.localio.read import Reader
from globalshard.io.localio.write import has_syncfs, syncfs, write_array, write_pack

__all__ = ["READ_TASK_BYTES", "TASK_BYTES", "ArrayFile", "ChunkError", "Reader", "Where", "has_syncfs", "make_pool",
           "parse", "pool", "read_packs", "syncfs", "workers", "write_array", "write_pack"]
