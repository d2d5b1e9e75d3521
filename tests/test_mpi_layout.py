"""Partition helpers of hyscale_core.mpi, tested without MPI."""
from __future__ import annotations

import numpy as np
import pytest

from hyscale_core.mpi import contiguous_layout, zigzag_layout
from hyscale_core.mpi.layout import split_sizes


@pytest.mark.parametrize("n", [0, 1, 7, 9, 300, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("make", [contiguous_layout, zigzag_layout])
def test_layouts_partition_every_position_once(n, world, make):
    layout = make(n, world)
    everything = np.sort(np.concatenate(layout.positions))
    np.testing.assert_array_equal(everything, np.arange(n))
    sizes = [len(p) for p in layout.positions]
    assert max(sizes) - min(sizes) <= 2
    assert all((np.diff(p) > 0).all() for p in layout.positions)
    np.testing.assert_array_equal(layout.owner()[layout.positions[-1]], world - 1)


def test_split_sizes_are_near_equal_and_reject_bad_counts():
    np.testing.assert_array_equal(split_sizes(7, 3), [3, 2, 2])
    with pytest.raises(ValueError, match="parts must be at least 1"):
        split_sizes(7, 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_balances_causal_work(world):
    n = 1 << 16
    zig = zigzag_layout(n, world).causal_work()
    flat = contiguous_layout(n, world).causal_work()
    assert zig.sum() == flat.sum() == n * (n + 1) // 2
    assert np.abs(zig / zig.mean() - 1).max() < 0.05
    assert np.abs(flat / flat.mean() - 1).max() > 0.3


def test_zigzag_packed_sequences_balance_each_sequence():
    cu = np.array([0, 7, 307, 1307, 1308])
    layout = zigzag_layout(1308, 3, cu)
    np.testing.assert_array_equal(np.sort(np.concatenate(layout.positions)), np.arange(1308))
    work = layout.causal_work(cu)
    assert np.abs(work / work.mean() - 1).max() < 0.05


def test_zigzag_rejects_bad_bounds():
    with pytest.raises(ValueError, match="cu_seqlens must run non-decreasing from 0 to n=10"):
        zigzag_layout(10, 2, np.array([0, 4, 9]))
