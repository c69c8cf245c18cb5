"""Names at a checkpoint root (spec sections 2 and 2.2): the files, the
saves directory, the writers' lock, temporary names and save ids."""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["LOCK_FILE", "METADATA_FILE", "SAVES_DIR", "TMP_PREFIX", "TRAINER_STATE_FILE", "array_dir",
           "array_dirs", "arrays_prefix", "foreign_files", "is_ours", "is_save_id", "is_temporary",
           "new_save_id", "pack_path", "save_dir", "step_names", "temporary_name"]

METADATA_FILE = "metadata.json"
TRAINER_STATE_FILE = "trainer_state.json"
#: Everything one save writes, besides metadata.json, lies under this prefix.
SAVES_DIR = "saves"
#: The writers' lock file at a local root (spec section 2.2).
LOCK_FILE = ".globalshard.lock"
#: Temporary files this library creates start with this (``.metadata.json.tmp-<hex>``).
TMP_PREFIX = "."
HEX_DIGITS = frozenset("0123456789abcdef")
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def is_save_id(value: Any) -> bool:
    """Whether ``value`` is a save id: 32 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 32 and set(value) <= HEX_DIGITS


def new_save_id() -> str:
    """A fresh save id: the time in milliseconds, then 80 random bits (spec section 2)."""
    return f"{int(time.time() * 1000) & (16**12 - 1):012x}{secrets.token_hex(10)}"


def save_dir(save_id: str) -> str:
    """The directory of one save's arrays and trainer state (spec section 2)."""
    return f"{SAVES_DIR}/{save_id}"


def arrays_prefix(save_id: str) -> str:
    """The prefix of one save's stored arrays, each in its :func:`array_dir`."""
    return save_dir(save_id) + "/arrays/"


def pack_path(save_id: str, rank: int, n: int) -> str:
    """Where writer ``rank`` stores its ``n``-th pack of small regions (spec section 5.1)."""
    return f"{save_dir(save_id)}/packs/{rank}/{n}"


def temporary_name(base: str) -> str:
    """A fresh temporary name for a file written as ``base`` (same directory)."""
    return f"{TMP_PREFIX}{base}.tmp-{uuid.uuid4().hex}"


def is_temporary(name: str, base: str) -> bool:
    """Whether ``name`` is a temporary file of :func:`temporary_name` for ``base``."""
    return name.startswith(f"{TMP_PREFIX}{base}.tmp-")


def is_ours(name: str) -> bool:
    """Whether a name at a root belongs to this format (so a root holding only
    such names is not someone else's directory)."""
    return name in (METADATA_FILE, LOCK_FILE, SAVES_DIR) or is_temporary(name, METADATA_FILE)


def array_dir(key: str) -> str:
    """A readable, filesystem-safe directory name for a checkpoint key.

    Bytes outside ``[A-Za-z0-9._-]`` are percent-encoded (so the mapping is
    one to one), a leading dot is encoded, and long names are shortened with a
    hash of the key.

    >>> array_dir("layers.0.attn/qkv weight")
    'layers.0.attn%2Fqkv%20weight'
    """
    enc = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in key)
    if enc.startswith("."):
        enc = "%2E" + enc[1:]
    if len(enc) > 120:
        enc = enc[:100] + "~" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return enc


def array_dirs(keys: Sequence[str]) -> dict[str, str]:
    # Keys that differ only in case would share a directory on a
    # case-insensitive filesystem: give those a hash suffix.
    dirs = {k: array_dir(k) for k in keys}
    folded: dict[str, list[str]] = defaultdict(list)
    for k, d in dirs.items():
        folded[d.casefold()].append(k)
    for group in folded.values():
        if len(group) > 1:
            for k in group:
                dirs[k] += "~" + hashlib.sha256(k.encode("utf-8")).hexdigest()[:8]
    return dirs


def foreign_files(names: Sequence[str]) -> str | None:
    """What the names directly below a root without metadata.json say it
    holds, when they are another library's checkpoint files; else None.

    >>> foreign_files([".metadata", "__0_0.distcp"])
    'it holds a torch.distributed.checkpoint (DCP) checkpoint (.metadata), which globalshard does not read'
    """
    found = set(names)
    if ".metadata" in found:
        return "it holds a torch.distributed.checkpoint (DCP) checkpoint (.metadata), which globalshard does not read"
    if found & {"_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt"}:
        return "it holds an Orbax checkpoint, which globalshard does not read"
    if any(n.endswith(".safetensors") for n in found):
        return ("it holds safetensors files: Hugging Face weights, read into a model by load_hf (or the "
                "framework's own from_pretrained)")
    if any(n.startswith("mp_rank_") for n in found):
        return "it holds Megatron's torch.save checkpoint (mp_rank_*), which globalshard does not read"
    return None


def step_names(names: Sequence[str], limit: int = 8) -> list[str]:
    """The names that may be step checkpoints (a number in them: ``step-100``,
    ``iter_0000100``), the highest number first, at most ``limit``.

    >>> step_names(["step-5", "logs", "step-20", "latest"])
    ['step-20', 'step-5']
    """
    numbered = []
    for name in names:
        digits = "".join(c if c.isdigit() else " " for c in name).split()
        if digits and not name.startswith(TMP_PREFIX):
            numbered.append((int(digits[-1]), name))
    return [name for _, name in sorted(numbered, reverse=True)[:limit]]
