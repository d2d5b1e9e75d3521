"""bfloat16 conversions on the GPU (hyscale_core.gpu.convert) against a NumPy
reference of the same bit rules, on every bfloat16 pattern and on the
awkward float32 values: ties, NaN payloads, +-inf, -0.0, subnormals and the
values that round up to inf."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _narrow_reference(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits; a NaN keeps its top bits and is made quiet."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def _awkward_floats() -> np.ndarray:
    rng = np.random.default_rng(3)
    top = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << 16
    ties = top | 0x8000  # exactly halfway: even and odd upper halves both appear
    near = np.concatenate([top | 0x7FFF, top | 0x8001, top | 1])
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                        0xFF800001, 0x7FBFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x807FFFFF,
                        0x007F8000, 0x3F808000, 0x3F818000], dtype=np.uint32)
    plain = rng.standard_normal(10000).astype(np.float32).view(np.uint32)
    return np.concatenate([ties, near, special, plain]).view(np.float32)


@pytest.mark.parametrize("shape", [(1,), (7,), (63, 300), (2, 3, 301)])
def test_narrow_rounds_like_the_reference(shape):
    import cupy as cp

    from hyscale_core._dtypes import bfloat16
    from hyscale_core.gpu.convert import narrow

    values = _awkward_floats()
    x = np.resize(values, int(np.prod(shape))).reshape(shape)
    got = narrow(cp.asarray(x), bfloat16)
    assert got.dtype == bfloat16 and got.shape == shape
    np.testing.assert_array_equal(cp.asnumpy(got.view(cp.uint16)), _narrow_reference(x))


def test_narrow_of_strided_and_float64_inputs():
    import cupy as cp

    from hyscale_core._dtypes import bfloat16
    from hyscale_core.gpu.convert import narrow

    x = _awkward_floats()[:4000].reshape(40, 100)
    got = narrow(cp.asarray(x)[:, ::3], bfloat16)  # a strided view
    np.testing.assert_array_equal(cp.asnumpy(got.view(cp.uint16)), _narrow_reference(x[:, ::3]))
    wide = np.random.default_rng(4).standard_normal(999)  # float64: rounded to float32 first
    got = narrow(cp.asarray(wide), bfloat16)
    np.testing.assert_array_equal(cp.asnumpy(got.view(cp.uint16)), _narrow_reference(wide.astype(np.float32)))
    finite = np.isfinite(x)  # ml_dtypes agrees wherever the value is not NaN
    np.testing.assert_array_equal(cp.asnumpy(narrow(cp.asarray(x[finite]), bfloat16).view(cp.uint16)),
                                  x[finite].astype(bfloat16).view(np.uint16))


def _every_pattern():
    import cupy as cp

    from hyscale_core._dtypes import bfloat16

    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    return patterns, cp.asarray(patterns).view(bfloat16)


def test_widen_to_float32_is_exact_on_every_bfloat16_pattern():
    import cupy as cp

    from hyscale_core.gpu.convert import widen

    patterns, x = _every_pattern()
    wide = widen(x, cp.float32)
    assert wide.dtype == cp.float32
    np.testing.assert_array_equal(cp.asnumpy(wide.view(cp.uint32)), patterns.astype(np.uint32) << 16)


def test_widen_to_float64_is_exact_on_every_bfloat16_pattern():
    """Subnormals included (CuPy's -ftz=true would flush a float32 -> float64 conversion of them)."""
    import cupy as cp

    from hyscale_core.gpu.convert import widen

    patterns, x = _every_pattern()
    wide = widen(x, cp.float64)
    expected = (patterns.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert wide.dtype == cp.float64
    np.testing.assert_array_equal(cp.asnumpy(wide), expected)  # NaN matches NaN
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.signbit(cp.asnumpy(wide))[finite], np.signbit(expected)[finite])  # -0.0
    assert (cp.asnumpy(wide)[1:128] > 0).all()  # the positive subnormals stay


def test_narrow_undoes_widen_on_every_bfloat16_pattern():
    import cupy as cp

    from hyscale_core._dtypes import bfloat16
    from hyscale_core.gpu.convert import narrow, widen

    patterns, x = _every_pattern()
    back = cp.asnumpy(narrow(widen(x, cp.float32), bfloat16).view(cp.uint16))
    quiet = patterns | np.where((patterns & 0x7FFF) > 0x7F80, 0x40, 0).astype(np.uint16)
    np.testing.assert_array_equal(back, quiet)  # exact; signalling NaNs come back quiet
