"""Training state as exact JSON: RNG states, scheduler and optimizer hyper-parameters."""

from __future__ import annotations

import base64
import random
from collections import Counter
from typing import Any

import numpy as np
import torch

from globalshard.errors import TrainerStateError

__all__ = ["from_jsonable", "jsonable", "rng_state", "set_rng_state"]

# A dict whose keys are not all strings (MultiStepLR's milestones Counter):
# {"$pairs": [[key, value], ...], "$type": "dict" | "Counter"}.
_PAIRS, _TYPE = "$pairs", "$type"


def jsonable(value: Any, where: str = "$") -> Any:
    """``value`` with JSON's types only.

    Tuples become lists, 0-d tensors numbers, and dicts with
    non-string keys (int, float, bool, None) tagged lists of pairs, so that
    :func:`from_jsonable` gives them back; anything else JSON cannot hold
    exactly is an error naming its path. (Non-finite floats are the core's
    to encode.)"""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if set(value) == {_PAIRS, _TYPE}:
            raise TrainerStateError(f"{where}: a dict with exactly the keys {_PAIRS!r} and {_TYPE!r} is reserved")
        if not all(isinstance(k, str) for k in value):
            bad = [k for k in value if not isinstance(k, (str, bool, int, float, type(None)))]
            if bad:
                raise TrainerStateError(f"{where}: key {bad[0]!r} is a {type(bad[0]).__name__}, which JSON "
                                        "cannot hold")
            kind = "Counter" if isinstance(value, Counter) else "dict"
            return {_PAIRS: [[k, jsonable(v, f"{where}[{k!r}]")] for k, v in value.items()], _TYPE: kind}
        return {k: jsonable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    raise TrainerStateError(f"{where}: {type(value).__name__} cannot be stored in trainer_state.json")


def from_jsonable(value: Any) -> Any:
    """The inverse of :func:`jsonable` for what it tags (lists stay lists)."""
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_PAIRS, _TYPE}:
            pairs = {k: from_jsonable(v) for k, v in value[_PAIRS]}
            return Counter(pairs) if value[_TYPE] == "Counter" else pairs
        return {k: from_jsonable(v) for k, v in value.items()}
    return value


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, numpy and Python RNG states, as JSON."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(_unb64(state["torch"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
