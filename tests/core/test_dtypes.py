"""The exact-cast relation is checked against the values themselves: every pair
called exact keeps every value (all bit patterns of the 1- and 2-byte
types, edge values and random samples of the wider ones), and every pair
called lossy has a value that does not survive."""

import itertools

import ml_dtypes
import numpy as np
import pytest

from globalshard import SUPPORTED_DTYPES, is_exact_cast
from globalshard.dtypes import canonical_name, cast_into, numpy_dtype

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and overflow are the point


def _samples(name: str) -> np.ndarray:
    dt = numpy_dtype(name)
    if name == "bool":
        return np.array([False, True])
    if dt.itemsize <= 2:
        bits = np.arange(2 ** (8 * dt.itemsize), dtype=np.uint16 if dt.itemsize == 2 else np.uint8)
        return bits.view(dt)
    rng = np.random.default_rng(0)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        edge = np.array([info.min, info.max, 0, 1, info.max - 1, info.min + 1], dtype=dt)
        return np.concatenate([edge, rng.integers(info.min, info.max, 4096, dtype=dt, endpoint=True)])
    real = np.dtype(np.float64 if dt in (np.dtype(np.float64), np.dtype(np.complex128)) else np.float32)
    info = np.finfo(real)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, info.max, info.min, info.tiny,
                        info.smallest_subnormal, -info.smallest_subnormal, 1.0 + info.eps], dtype=real)
    rnd = rng.integers(0, 256, 4096 * real.itemsize, dtype=np.uint8).view(real)
    values = np.concatenate([special, rnd])
    if dt.kind == "c":
        return (values + 1j * values[::-1]).astype(dt)
    return values.astype(dt)


def _python_values(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "biu":
        return a.astype(object)  # Python ints: exact at any width
    return a.astype(np.complex128 if a.dtype.kind == "c" else np.float64).astype(object)


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: the same number, NaN matching NaN, and the same sign of zero."""
    if a.dtype.kind in "biu" or b.dtype.kind in "biu":
        return np.asarray(_python_values(a) == _python_values(b), dtype=bool)
    a64, b64 = a.astype(np.complex128), b.astype(np.complex128)
    out = np.ones(a.shape, bool)
    for part in (np.real, np.imag):
        x, y = part(a64), part(b64)
        out &= ((x == y) & (np.signbit(x) == np.signbit(y))) | (np.isnan(x) & np.isnan(y))
    return out


def _convert(src: str, dst: str) -> tuple[np.ndarray, np.ndarray]:
    values = _samples(src)
    there = np.empty(values.shape, numpy_dtype(dst))
    with np.errstate(all="ignore"):
        cast_into(there, values)
    return values, there


@pytest.mark.parametrize("src,dst", list(itertools.product(SUPPORTED_DTYPES, SUPPORTED_DTYPES)))
def test_exact_means_every_value_survives(src, dst):
    if src.startswith("complex") and not dst.startswith("complex"):
        assert not is_exact_cast(src, dst)
        return
    values, there = _convert(src, dst)
    survived = _same(values, there)
    if is_exact_cast(src, dst):
        assert survived.all(), f"{src}->{dst} called exact, but {values[~survived][:5]} changed"
    else:
        assert not survived.all(), f"{src}->{dst} called lossy, but every sampled value survived"


def test_known_pairs():
    assert is_exact_cast("bfloat16", "float32")
    assert is_exact_cast("float16", "float64")
    assert is_exact_cast("float8_e4m3fn", "bfloat16")
    assert is_exact_cast("int16", "int32") and is_exact_cast("uint8", "int16")
    assert not is_exact_cast("float32", "bfloat16")
    assert not is_exact_cast("float16", "bfloat16") and not is_exact_cast("bfloat16", "float16")
    assert not is_exact_cast("float32", "int32")
    assert not is_exact_cast("int64", "float64")
    assert not is_exact_cast("int8", "uint64")


def test_canonical_names():
    assert canonical_name(np.dtype(">f4")) == "float32"
    assert canonical_name(ml_dtypes.bfloat16) == "bfloat16"
    for bad in ("object", "U4", np.dtype([("a", "f4")]), "bf16", "float128"):
        with pytest.raises(TypeError):
            canonical_name(bad)
