"""hs.topk against the plain reference, on both backends."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import hyscale_core as hs
from helpers import AWKWARD_LENGTHS, HAS_GPU, awkward_array, same_bits, to_host, topk_dtype_params
from hyscale_core.ops.topk import reference

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def on(backend, x):
    if backend == "gpu":
        import cupy

        return cupy.asarray(x)
    return x


def check_against_reference(backend, a, k, largest=True, sort_output=True):
    values, indices = hs.topk(on(backend, a), k, largest=largest, sorted=sort_output)
    ref_values, ref_indices = reference.topk_rows(a.reshape(-1, a.shape[-1]), k, largest, sort_output)
    assert to_host(indices).dtype == np.int64
    np.testing.assert_array_equal(to_host(indices).reshape(ref_indices.shape), ref_indices)
    assert same_bits(to_host(values).reshape(ref_values.shape), ref_values)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", topk_dtype_params())
@pytest.mark.parametrize("n", AWKWARD_LENGTHS)
def test_awkward_inputs_match_reference(backend, dtype, n):
    rng = np.random.default_rng(n)
    a = awkward_array(rng, (3, n), dtype)
    for k in sorted({0, 1, n // 2, max(n - 1, 0), n}):
        for largest in (True, False):
            for sort_output in (True, False):
                check_against_reference(backend, a, k, largest, sort_output)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", topk_dtype_params())
def test_all_equal_rows_take_lowest_indices(backend, dtype):
    a = np.full((2, 50), 3, dtype=dtype)
    _, indices = hs.topk(on(backend, a), 20)
    np.testing.assert_array_equal(to_host(indices), np.tile(np.arange(20), (2, 1)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_above_inf_and_signed_zeros_equal(backend):
    a = np.array([[-0.0, 1.0, np.nan, np.inf, 0.0, -np.inf, np.nan]], dtype=np.float32)
    values, indices = hs.topk(on(backend, a), 7)
    np.testing.assert_array_equal(to_host(indices), [[2, 6, 3, 1, 0, 4, 5]])
    assert np.signbit(to_host(values)[0, 4]) and not np.signbit(to_host(values)[0, 5])
    _, smallest = hs.topk(on(backend, a), 7, largest=False)
    np.testing.assert_array_equal(to_host(smallest), [[5, 0, 4, 1, 3, 2, 6]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_any_axis_and_non_contiguous(backend, axis):
    rng = np.random.default_rng(1)
    base = awkward_array(rng, (9, 14, 22), np.float32)
    a = base[:, ::2, :]  # non-contiguous view
    k = 3
    values, indices = hs.topk(on(backend, a), k, axis=axis)
    moved = np.moveaxis(a, axis, -1)
    ref_values, ref_indices = reference.topk_rows(moved.reshape(-1, moved.shape[-1]), k, True, True)
    expect_shape = moved.shape[:-1] + (k,)
    np.testing.assert_array_equal(np.moveaxis(to_host(indices), axis, -1), ref_indices.reshape(expect_shape))
    assert same_bits(np.moveaxis(to_host(values), axis, -1), ref_values.reshape(expect_shape))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sorted_false_is_the_same_set_in_index_order(backend):
    rng = np.random.default_rng(2)
    a = awkward_array(rng, (5, 1000), np.float32)
    _, ordered = hs.topk(on(backend, a), 100)
    _, unordered = hs.topk(on(backend, a), 100, sorted=False)
    np.testing.assert_array_equal(np.sort(to_host(ordered), axis=1), to_host(unordered))


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_against_stable_sort(backend):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 200_000)).astype(np.float32)
    a[:, ::7] = a[:, :1]  # many ties with the first element
    _, indices = hs.topk(on(backend, a), 2048)
    expect = np.argsort(-a.astype(np.float64), axis=1, kind="stable")[:, :2048]
    np.testing.assert_array_equal(to_host(indices), expect)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_runs_are_identical(backend):
    a = on(backend, awkward_array(np.random.default_rng(4), (64, 3000), np.float16))
    first = hs.topk(a, 700)
    for _ in range(3):
        again = hs.topk(a, 700)
        assert same_bits(first[0], again[0]) and same_bits(first[1], again[1])


finite_or_special = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, np.nan, np.inf, -np.inf]),
)


@settings(max_examples=150, deadline=None)
@given(
    a=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=40),
                 elements=finite_or_special),
    data=st.data(),
)
def test_hypothesis_float32_matches_reference(a, data):
    k = data.draw(st.integers(0, a.shape[1]))
    largest = data.draw(st.booleans())
    sort_output = data.draw(st.booleans())
    check_against_reference("cpu", a, k, largest, sort_output)
    if HAS_GPU:
        check_against_reference("gpu", a, k, largest, sort_output)


@settings(max_examples=100, deadline=None)
@given(a=hnp.arrays(np.int64, st.tuples(st.integers(1, 3), st.integers(1, 60)),
                    elements=st.integers(-(2**63), 2**63 - 1)), data=st.data())
def test_hypothesis_int64_matches_reference(a, data):
    k = data.draw(st.integers(0, a.shape[1]))
    check_against_reference("cpu", a, k, data.draw(st.booleans()), data.draw(st.booleans()))


def test_empty_leading_dimension():
    values, indices = hs.topk(np.zeros((0, 5), np.float32), 2)
    assert values.shape == (0, 2) and indices.shape == (0, 2)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda a: hs.topk(a, -1), ValueError, "k must be in"),
        (lambda a: hs.topk(a, 11), ValueError, r"k must be in \[0, 10\], got 11"),
        (lambda a: hs.topk(a, 2.5), TypeError, "k must be an integer"),
        (lambda a: hs.topk(a, True), TypeError, "k must be an integer"),
        (lambda a: hs.topk(a, 2, axis=2), ValueError, "axis must be in"),
        (lambda a: hs.topk(a, 2, largest="yes"), TypeError, "largest must be a bool"),
        (lambda a: hs.topk(a, 2, sorted=1), TypeError, "sorted must be a bool"),
        (lambda a: hs.topk(a.astype(np.uint8), 2), TypeError, "a has dtype uint8"),
        (lambda a: hs.topk(a.astype(np.complex64), 2), TypeError, "a has dtype complex64"),
        (lambda a: hs.topk(a.astype(bool), 2), TypeError, "a has dtype bool"),
        (lambda a: hs.topk(np.float32(1.0), 1), ValueError, "at least one dimension"),
        (lambda a: hs.topk(object(), 1), TypeError, "a has dtype object"),
    ],
)
def test_bad_arguments_name_the_argument(call, error, match):
    a = np.zeros((4, 10), np.float32)
    with pytest.raises(error, match=match):
        call(a)
