"""Canonical dtype names and the rules for converting between them.

A checkpoint names every dtype by a canonical string (``"bfloat16"``,
``"float8_e4m3fn"``, ...): the name numpy and ml_dtypes give the type, never a
byte-order code. The target array of a load decides the dtype it receives;
:func:`is_exact_cast` says whether the stored values all survive the trip.

Exactness is derived from each type's value set (integer width and sign; float
precision, exponent range, infinities, signed zero), not from a hand-kept table
and not from ``numpy.can_cast``, which calls ``int64 -> float64`` safe although
it rounds large integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from globalshard.errors import GlobalShardError

__all__ = ["SUPPORTED_DTYPES", "canonical_name", "is_exact_cast", "numpy_dtype", "cast_into"]

_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}

#: Every dtype name a checkpoint may hold, in a stable order.
SUPPORTED_DTYPES: tuple[str, ...] = tuple(_NUMPY_DTYPES)

_ML_DTYPES = frozenset(n for n, d in _NUMPY_DTYPES.items() if d.type.__module__.startswith("ml_dtypes"))


class _UnsupportedDType(GlobalShardError, TypeError):
    pass


def canonical_name(dtype: Any) -> str:
    """The canonical name of a dtype given as a name, numpy dtype or array type.

    >>> canonical_name("bfloat16"), canonical_name(np.float32), canonical_name(">i4")
    ('bfloat16', 'float32', 'int32')

    Raises:
        TypeError (a GlobalShardError) for types a checkpoint cannot hold
        (object, strings, structured types, ...).
    """
    if isinstance(dtype, str) and dtype in _NUMPY_DTYPES:
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise _UnsupportedDType(f"unsupported dtype {dtype!r}: {e}") from None
    name = dt.name
    if name not in _NUMPY_DTYPES or dt.fields is not None or dt.subdtype is not None:
        raise _UnsupportedDType(
            f"unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}"
        )
    return name


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The native-byte-order numpy dtype for a canonical name."""
    try:
        return _NUMPY_DTYPES[name]
    except KeyError:
        raise _UnsupportedDType(f"unknown dtype name {name!r}; known: {', '.join(SUPPORTED_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class _ValueSet:
    kind: str  # "bool" | "int" | "float" | "complex"
    bits: int = 0  # ints: width
    signed: bool = False
    precision: int = 0  # floats: significand bits including the implicit one
    max_exp: int = 0  # floats: first exponent that overflows (finfo.maxexp)
    min_exp: int = 0  # floats: smallest normal exponent (finfo.minexp)
    has_inf: bool = False
    has_neg_zero: bool = False


def _value_set(name: str) -> _ValueSet:
    dt = _NUMPY_DTYPES[name]
    if name == "bool":
        return _ValueSet("bool")
    if dt.kind in "iu":
        return _ValueSet("int", bits=dt.itemsize * 8, signed=dt.kind == "i")
    if dt.kind == "c":
        part = _value_set("float32" if dt.itemsize == 8 else "float64")
        return _ValueSet("complex", **{f: getattr(part, f) for f in _FLOAT_FIELDS})
    info = ml_dtypes.finfo(dt) if name in _ML_DTYPES else np.finfo(dt)
    with np.errstate(all="ignore"):
        inf = np.array(np.inf, np.float32).astype(dt)
        neg_zero = np.array(-0.0, np.float32).astype(dt)
    return _ValueSet(
        "float",
        precision=int(info.nmant) + 1,
        max_exp=int(info.maxexp),
        min_exp=int(info.minexp),
        has_inf=bool(np.isinf(inf.astype(np.float32))),
        has_neg_zero=bool(np.signbit(neg_zero.astype(np.float32))),
    )


_FLOAT_FIELDS = ("precision", "max_exp", "min_exp", "has_inf", "has_neg_zero")


def _float_holds_float(dst: _ValueSet, src: _ValueSet) -> bool:
    return (
        dst.precision >= src.precision
        and dst.max_exp >= src.max_exp
        # The smallest subnormal of src must be a multiple of dst's.
        and dst.min_exp - dst.precision <= src.min_exp - src.precision
        and (dst.has_inf or not src.has_inf)
        and (dst.has_neg_zero or not src.has_neg_zero)
    )


def _float_holds_int(dst: _ValueSet, src: _ValueSet) -> bool:
    magnitude_bits = src.bits - (1 if src.signed else 0)
    return dst.precision >= magnitude_bits and dst.max_exp > magnitude_bits


def _is_exact(src: str, dst: str) -> bool:
    if src == dst:
        return True
    s, d = _value_set(src), _value_set(dst)
    if s.kind == "bool":
        return True  # 0 and 1 are exact in every type
    if d.kind == "bool":
        return False
    if s.kind == "int":
        if d.kind == "int":
            if s.signed and not d.signed:
                return False
            return d.bits > s.bits if (d.signed and not s.signed) else d.bits >= s.bits
        return _float_holds_int(d, s)  # float or complex
    if s.kind == "float":
        return d.kind in ("float", "complex") and _float_holds_float(d, s)
    return d.kind == "complex" and _float_holds_float(d, s)


_EXACT: frozenset[tuple[str, str]] = frozenset(
    (s, d) for s in SUPPORTED_DTYPES for d in SUPPORTED_DTYPES if _is_exact(s, d)
)


def is_exact_cast(src: str, dst: str) -> bool:
    """Whether every value of dtype ``src`` is represented exactly in ``dst``.

    >>> is_exact_cast("bfloat16", "float32"), is_exact_cast("float32", "bfloat16")
    (True, False)
    >>> is_exact_cast("int64", "float64"), is_exact_cast("uint8", "int16")
    (False, True)
    """
    return (src, dst) in _EXACT


def cast_into(out: np.ndarray, value: np.ndarray) -> None:
    """Assign ``value`` into ``out`` (same shape), converting the dtype.

    numpy has no direct conversion between some ml_dtypes types and complex or
    other ml_dtypes types; those go through float32, which holds every
    ml_dtypes value exactly, so the only rounding is the final one.
    """
    # Only reached for exact casts or ones the caller allowed to round: NaN to
    # int or overflow is their choice, not a warning.
    with np.errstate(invalid="ignore", over="ignore"):
        try:
            out[...] = value
        except (TypeError, ValueError):
            if value.dtype.name not in _ML_DTYPES:
                raise
            out[...] = value.astype(np.float32)
