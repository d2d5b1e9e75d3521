"""Partition helpers of hyscale_core.mpi, tested without MPI."""
from __future__ import annotations

import re

import numpy as np
import pytest

from hyscale_core.mpi import QUERY_ALIGN, Layout, balanced_layout, contiguous_layout, zigzag_layout
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
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
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


@pytest.mark.parametrize("make", [zigzag_layout, balanced_layout])
def test_layouts_reject_float_cu_seqlens_as_the_indexer_does(make):
    with pytest.raises(TypeError, match="cu_seqlens must hold integers, got dtype float64"):
        make(7, 2, [0, 3.9, 7])  # was cut to [0, 3, 7]; hs.indexer_topk raises this TypeError
    with pytest.raises(TypeError, match="cu_seqlens must hold integers, got dtype float64"):
        make(7, 2).causal_work(np.array([0.0, 3.0, 7.0]))


@pytest.mark.parametrize("make", [contiguous_layout, zigzag_layout, balanced_layout])
@pytest.mark.parametrize("args, kwargs, error, message", [
    ((7.5, 2), {}, TypeError, "n must be an integer, got 7.5"),
    ((-1, 2), {}, ValueError, "n must be >= 0, got -1"),
    ((7, 0), {}, ValueError, "world_size must be >= 1, got 0"),
    ((7, 2.0), {}, TypeError, "world_size must be an integer, got 2.0"),
    ((8, 2), {"align": 2.0}, TypeError, "align must be an integer, got 2.0"),
    ((8, 2), {"align": True}, TypeError, "align must be an integer, got True"),
    ((8, 2), {"align": 0}, ValueError, "align must be >= 1, got 0"),
])
def test_layouts_name_a_bad_size(make, args, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make(*args, **kwargs)


@pytest.mark.parametrize("make", [contiguous_layout, zigzag_layout, balanced_layout])
def test_layouts_take_numpy_integers(make):
    layout = make(np.int64(300), np.int32(3), align=np.int64(64))
    for got, expect in zip(layout.positions, make(300, 3, align=64).positions):
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(layout.owner(), make(300, 3, align=64).owner())


@pytest.mark.parametrize("n", [0, 7, 63, 64, 65, 301, 4097])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("make", [contiguous_layout, zigzag_layout])
def test_aligned_layouts_hold_whole_blocks(n, world, make):
    layout = make(n, world, align=QUERY_ALIGN)
    np.testing.assert_array_equal(np.sort(np.concatenate(layout.positions)), np.arange(n))
    for pos in layout.positions:
        if pos.size == 0:
            continue
        # every run of consecutive positions starts on a block and ends on one (or at n)
        breaks = np.flatnonzero(np.diff(pos) != 1)
        starts, stops = pos[np.r_[0, breaks + 1]], pos[np.r_[breaks, pos.size - 1]] + 1
        assert (starts % QUERY_ALIGN == 0).all()
        assert ((stops % QUERY_ALIGN == 0) | (stops == n)).all()


def test_query_align_is_the_cpu_indexer_block():
    from hyscale_core.ops.indexer.cpu import Q_BLOCK

    assert QUERY_ALIGN == Q_BLOCK


def test_aligned_zigzag_still_balances_long_sequences():
    for world in (2, 3, 4):
        work = zigzag_layout(1 << 16, world, align=QUERY_ALIGN).causal_work()
        assert np.abs(work / work.mean() - 1).max() < 0.01


def test_aligned_packed_sequences_partition_even_when_shorter_than_a_block():
    cu = np.array([0, 5, 40, 41, 700, 1000])
    layout = zigzag_layout(1000, 3, cu, align=QUERY_ALIGN)
    np.testing.assert_array_equal(np.sort(np.concatenate(layout.positions)), np.arange(1000))
    with pytest.raises(ValueError, match="align must be >= 1, got 0"):
        zigzag_layout(10, 2, align=0)


def test_maps_agree_with_positions():
    layout = zigzag_layout(301, 3)
    owner, local, major = layout.owner(), layout.local_index(), layout.rank_major()
    offsets = np.concatenate([[0], np.cumsum(layout.counts)[:-1]])
    for rank, pos in enumerate(layout.positions):
        np.testing.assert_array_equal(owner[pos], rank)
        np.testing.assert_array_equal(local[pos], np.arange(pos.size))
        np.testing.assert_array_equal(major[pos], offsets[rank] + np.arange(pos.size))
    layout.check()
    with pytest.raises(ValueError, match="cover 0..300 exactly once"):
        Layout(301, (layout.positions[0], layout.positions[1], layout.positions[1])).check()
    with pytest.raises(ValueError, match="ascending"):
        Layout(3, (np.array([1, 0]), np.array([2]))).check()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_balanced_layout_spreads_many_short_packed_sequences(world):
    cu = np.arange(0, 4097, 32)  # 128 sequences of 32 tokens: shorter than 2P aligned chunks
    per_sequence = zigzag_layout(4096, world, cu, align=QUERY_ALIGN)
    assert (per_sequence.counts == 0).sum() == world - 1  # every aligned cut falls at a sequence's end
    layout = balanced_layout(4096, world, cu, align=QUERY_ALIGN)
    for a, b in zip(layout.positions, zigzag_layout(4096, world, align=QUERY_ALIGN).positions):
        np.testing.assert_array_equal(a, b)  # the whole packed row cut into 2P chunks
    work = layout.causal_work(cu)
    assert np.abs(work / work.mean() - 1).max() < 0.15


@pytest.mark.parametrize("cu", [None, [0, 4096, 8192], [0, 7, 3000, 8192]])
def test_balanced_layout_keeps_the_per_sequence_cut_for_long_sequences(cu):
    layout = balanced_layout(8192, 4, cu, align=QUERY_ALIGN)
    for a, b in zip(layout.positions, zigzag_layout(8192, 4, cu, align=QUERY_ALIGN).positions):
        np.testing.assert_array_equal(a, b)
    layout.check()

