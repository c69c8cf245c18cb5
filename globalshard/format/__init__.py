"""Everything ``spec/FORMAT.md`` defines, and nothing that does I/O.

* :mod:`~globalshard.format.paths`: names at a root (files, saves, the lock,
  temporary names, save ids, array and pack paths).
* :mod:`~globalshard.format.metadata`: metadata.json, the strict parser and
  the writer.
* :mod:`~globalshard.format.trainer_state`: trainer_state.json, written
  exactly or refused, checked against its record in metadata.json.
* :mod:`~globalshard.format.strict_json`: JSON as both files are read.
* :mod:`~globalshard.format.zarr`: stored arrays: the zarr.json writer, chunk
  shapes, the checksum rule, array and pack attributes, packed bytes.
"""

from globalshard.format.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_FILE_BYTES,
    READABLE_VERSIONS,
    Metadata,
    StoredRegion,
    TensorMetadata,
    check_relative_path,
    parse_metadata,
)
from globalshard.format.paths import METADATA_FILE, TRAINER_STATE_FILE, is_save_id, new_save_id
from globalshard.format.trainer_state import TrainerStateRef, dump_trainer_state, parse_trainer_state

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MAX_FILE_BYTES", "METADATA_FILE", "READABLE_VERSIONS",
           "TRAINER_STATE_FILE", "Metadata", "StoredRegion", "TensorMetadata", "TrainerStateRef",
           "check_relative_path", "dump_trainer_state", "is_save_id", "new_save_id", "parse_metadata",
           "parse_trainer_state"]
