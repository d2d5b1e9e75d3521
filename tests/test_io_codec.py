"""The selection-table codec (sorted gaps + Lehmer rank order): lossless, row ranges, bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hyscale_core.io import codec, lehmer

INT32_MAX = np.iinfo(np.int32).max


def round_trip(table: np.ndarray) -> codec.Encoded:
    encoded = codec.encode(table)
    decoded = codec.decode(*encoded.arrays().values())
    assert decoded.dtype == np.int32 and decoded.shape == table.shape
    np.testing.assert_array_equal(decoded, table)
    return encoded


@st.composite
def tables(draw):
    """int32 tables with -1 anywhere, duplicates (small ranges) or huge indices."""
    n, k = draw(st.integers(0, 12)), draw(st.integers(0, 40))
    high = draw(st.sampled_from([3, 40, 70000, INT32_MAX]))
    return draw(hnp.arrays(np.int32, (n, k), elements=st.integers(-1, high)))


@settings(max_examples=300, deadline=None)
@given(tables())
def test_any_table_round_trips_exactly(table):
    encoded = round_trip(table)
    assert encoded.lehmer.shape == (table.shape[1], table.shape[0])
    assert encoded.gaps.shape == (max(table.shape[1] - 1, 0), table.shape[0])


@settings(max_examples=100, deadline=None)
@given(tables(), st.data())
def test_any_row_range_decodes_on_its_own(table, data):
    n = table.shape[0]
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    e = codec.encode(table)
    part = codec.decode(e.count[a:b], e.first[a:b], e.gaps[:, a:b], e.lehmer[:, a:b])
    np.testing.assert_array_equal(part, table[a:b])


def selection_like(rng, n, k, n_keys):
    """Causal-looking selections: distinct keys in random rank order, rows ending in -1."""
    table = np.full((n, k), -1, dtype=np.int32)
    for t in range(n):
        m = min(k, t % n_keys + 1)
        table[t, :m] = rng.permutation(t % n_keys + 1)[:m]
    return table


@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (63, 5), (300, 64), (40, 257)])
def test_selections_and_edge_shapes(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    round_trip(selection_like(rng, n, k, n_keys=n))
    round_trip(np.full((n, k), -1, dtype=np.int32))  # rows all -1
    round_trip(np.full((n, k), INT32_MAX, dtype=np.int32))  # one key repeated, the largest index
    round_trip(np.zeros((0, k), dtype=np.int32))
    round_trip(np.zeros((n, 0), dtype=np.int32))


def test_padding_in_the_middle_and_duplicates():
    table = np.array([[5, -1, 5, 2, -1], [-1, -1, -1, -1, 0], [9, 8, 7, 6, 5], [1, 1, 1, 1, 1]], dtype=np.int32)
    e = round_trip(table)
    np.testing.assert_array_equal(e.count, [3, 1, 5, 5])
    np.testing.assert_array_equal(e.first, [2, 0, 5, 1])


def test_dtypes_are_the_narrowest_that_fit():
    local = np.arange(300 * 16, dtype=np.int32).reshape(300, 16)  # gaps of 1
    e = codec.encode(local)
    assert (e.count.dtype, e.gaps.dtype, e.lehmer.dtype, e.first.dtype) == (np.uint8, np.uint8, np.uint8, np.int32)
    wide = np.array([[0, 70000]], dtype=np.int32)
    assert codec.encode(wide).gaps.dtype == np.uint32
    assert codec.encode(np.zeros((2, 300), dtype=np.int32)).lehmer.dtype == np.uint16
    assert codec.narrowest_unsigned(255) == np.uint8 and codec.narrowest_unsigned(256) == np.uint16
    with pytest.raises(ValueError, match="max_value"):
        codec.narrowest_unsigned(1 << 32)


def test_local_window_costs_little_before_compression():
    # sorted gaps of a window are all 1, so every gap fits one byte
    rng = np.random.default_rng(0)
    window = np.arange(2000)[:, None] - np.arange(64)[None, :]
    table = np.where(window >= 0, window, -1).astype(np.int32)
    table = np.take_along_axis(table, rng.permuted(np.tile(np.arange(64), (2000, 1)), axis=1), axis=1)
    e = round_trip(table)
    assert e.gaps.dtype == np.uint8 and set(np.unique(e.gaps)) <= {0, 1}


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_lehmer_kernels_match_the_numpy_reference(data):
    n, k = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 30))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    count = rng.integers(0, k + 1, n)
    order = np.zeros((n, k), dtype=np.int64)
    for r in range(n):
        order[r, : count[r]] = rng.permutation(k)[: count[r]]
    digits = np.empty((n, k), dtype=np.uint16)
    lehmer.encode_rows(order, count, digits)
    np.testing.assert_array_equal(digits, lehmer.encode_reference(order, count))
    assert all((digits[r, j] < k - j) for r in range(n) for j in range(k))
    back = lehmer.decode_reference(digits, count)
    valid = np.arange(k) < count[:, None]
    np.testing.assert_array_equal(back[valid], order[valid])


def test_identity_and_reversed_orders_have_constant_digits():
    k = 50
    for order, expect in ((np.arange(k), np.zeros(k)), (np.arange(k)[::-1], np.arange(k)[::-1])):
        digits = lehmer.encode_reference(order[None, :], np.array([k]))
        np.testing.assert_array_equal(digits[0], expect)


def test_bad_tables_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"indices\[1, 0\] = -2"):
        codec.encode(np.array([[0], [-2]], dtype=np.int32))
    with pytest.raises(TypeError, match="indices has dtype int64"):
        codec.encode(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="indices must have 2 dimensions"):
        codec.encode(np.zeros(3, dtype=np.int32))


def test_inconsistent_arrays_raise_instead_of_decoding_wrong():
    e = codec.encode(np.array([[3, 1, 2], [0, -1, -1]], dtype=np.int32))
    digits = e.lehmer.copy()
    digits[2, 0] = 1  # digit 2 of a k=3 row must be 0
    with pytest.raises(ValueError, match="row 0"):
        codec.decode(e.count, e.first, e.gaps, digits)
    count = e.count.copy()
    count[1] = 4
    with pytest.raises(ValueError, match="row 1"):
        codec.decode(count, e.first, e.gaps, e.lehmer)
    gaps = e.gaps.astype(np.uint32)
    gaps[0, 0] = INT32_MAX
    with pytest.raises(ValueError, match="row 0"):
        codec.decode(e.count, e.first, gaps, e.lehmer)
    with pytest.raises(ValueError, match="shapes"):
        codec.decode(e.count[:1], e.first, e.gaps, e.lehmer)


def test_arrays_of_other_dtypes_or_ranks_are_corrupt():
    e = codec.encode(np.array([[3, 1, 2], [0, -1, -1]], dtype=np.int32))
    with pytest.raises(ValueError, match="corrupt encoding: count has dtype float64, expected integers"):
        codec.decode(e.count.astype(np.float64), e.first, e.gaps, e.lehmer)
    with pytest.raises(ValueError, match=r"corrupt encoding: lehmer has shape \(3, 2, 1\), expected \[k, N\]"):
        codec.decode(e.count, e.first, e.gaps, e.lehmer[..., None])
