"""Peak device memory counted in CuPy's pool (hyscale_core.gpu.memory)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_pool_peak_counts_allocations_inside_the_block():
    import cupy

    from hyscale_core.gpu.memory import pool_peak

    before = cupy.zeros(1 << 20, dtype=cupy.uint8)  # held before the block: not counted
    with pool_peak() as memory:
        a = cupy.empty(3 << 20, dtype=cupy.uint8)
        b = cupy.empty(1 << 20, dtype=cupy.uint8)
        del a, before
        c = cupy.empty(1 << 20, dtype=cupy.uint8)
    assert memory.peak == 4 << 20
    assert memory.current == 2 << 20
    del b, c
