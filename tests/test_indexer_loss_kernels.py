"""The GPU kernels of hs.indexer_scores_at (+ backward) and hs.indexer_kl_loss (cuda/indexer_loss*.cu).

Accuracy as in test_indexer_loss; besides, every output written, bitwise
reproducibility, the fallback switch, memory bounds and NaN inputs.
"""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
from helpers import assert_within_twice_naive, on, same_bits, to_host
from hyscale_core._dtypes import bfloat16
from hyscale_core.gpu.memory import pool_peak
from hyscale_core.ops.indexer_loss import reference
from indexer_loss_cases import (
    DIM,
    check_scores,
    check_scores_backward,
    make_inputs,
    make_loss_inputs,
    naive_kl,
)


GPU_DTYPES = [pytest.param(bfloat16, id="bfloat16"), pytest.param(np.dtype(np.float32), id="float32")]
BACKEND_FUNCTIONS = ("indexer_scores_at", "indexer_scores_at_backward", "indexer_kl_loss")


def _gpu_backend():
    from hyscale_core.ops.indexer_loss import gpu, gpu_fallback

    return gpu, gpu_fallback


@pytest.fixture
def kernels_only(monkeypatch):
    """The GPU kernels must serve every call: gpu_fallback raises if it is reached."""
    gpu, fallback = _gpu_backend()
    monkeypatch.delenv(gpu.FALLBACK_ENV, raising=False)

    def refuse(*args):
        raise AssertionError("gpu_fallback served a call the kernels are built for")

    for name in BACKEND_FUNCTIONS:
        monkeypatch.setattr(fallback, name, refuse)
    return gpu


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs (and the backward's dk rows) start as NaN, so unwritten entries show."""
    gpu, _ = _gpu_backend()
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(bfloat16, id="bfloat16"), pytest.param(np.dtype(np.float16),
                                                                                      id="float16")])
@pytest.mark.parametrize("heads", [64, 32])
def test_gpu_kernels_at_dsa_shapes_within_twice_naive_error(kernels_only, poisoned, dtype, heads):
    """D = 128, kk = 2048 in 16-bit (the tensor-core path), with a row of only
    -1, a row of duplicates and -1 slots, every output against the float64
    reference."""
    q, keys, w, indices = make_inputs(np.random.default_rng(20), 4, heads, 2048, 3000, dtype=dtype)
    indices[1] = -1
    indices[2, 100:] = 11
    check_scores("gpu", q, keys, w, indices)
    check_scores_backward("gpu", q, keys, w, indices)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads, dim, k", [(20, 48, 100), (64, 128, 130), (3, 16, 7)])
def test_gpu_kernels_write_every_output(kernels_only, poisoned, dtype, heads, dim, k):
    """Padded heads, kk not a multiple of 64, a row of only -1, a whole block of
    -1, duplicates: every output written (finite), -inf exactly at -1 slots,
    zeros for the empty row, values within twice the naive error."""
    q, keys, w, indices = make_inputs(np.random.default_rng(21), 9, heads, k, 40, dim=dim, dtype=dtype)
    indices[3] = -1
    indices[5, :k // 2 + 1] = 7
    indices[6, :64] = -1
    check_scores("gpu", q, keys, w, indices)
    check_scores_backward("gpu", q, keys, w, indices)
    g = np.random.default_rng(22).standard_normal(indices.shape).astype(np.float32)
    dq, _, dw = (to_host(x) for x in hs.indexer_scores_at_backward(*on("gpu", q, keys, w, indices, g)))
    assert not dq[3].astype(np.float64).any() and not dw[3].astype(np.float64).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_kernel_bits_do_not_depend_on_runs_or_chunking(kernels_only, monkeypatch, dtype):
    """Few keys shared by many queries, so each key's sum crosses query chunks."""
    gpu = kernels_only
    q, keys, w, indices = make_inputs(np.random.default_rng(23), 37, 32, 200, 50, dtype=dtype)
    g = np.random.default_rng(24).standard_normal(indices.shape).astype(np.float32)
    args = on("gpu", q, keys, w, indices, g)
    scores = hs.indexer_scores_at(*args[:4])
    assert same_bits(scores, hs.indexer_scores_at(*args[:4]))
    base = hs.indexer_scores_at_backward(*args)
    runs = [hs.indexer_scores_at_backward(*args)]
    for rows_bytes in (1, 5 * 200 * DIM * 4):  # one query per chunk; five (the last chunk shorter)
        monkeypatch.setattr(gpu, "ROWS_BYTES", rows_bytes)
        runs.append(hs.indexer_scores_at_backward(*args))
    for other in runs:
        assert all(same_bits(a, b) for a, b in zip(base, other))
    loss, dscores = hs.indexer_kl_loss(scores, on("gpu", np.random.default_rng(25).random(indices.shape))[0])
    again = hs.indexer_kl_loss(scores, on("gpu", np.random.default_rng(25).random(indices.shape))[0])
    assert loss == again[0] and same_bits(dscores, again[1])


@pytest.mark.gpu
@pytest.mark.parametrize("s_dtype, p_dtype", [(np.float32, np.float32), (np.float32, np.float64),
                                              (np.float64, np.float32), (np.float64, np.float64),
                                              (bfloat16, np.float16)])
def test_gpu_kl_kernel_is_the_float64_formula_rounded_once(kernels_only, poisoned, s_dtype, p_dtype):
    """The KL kernel computes in float64 for every input dtype: dscores is the
    float64 reference rounded once to float32; empty rows give 0."""
    scores, probs = make_loss_inputs(np.random.default_rng(26), 33, 300)
    scores[4] = -np.inf
    probs[5] = 0
    s, p = scores.astype(s_dtype), probs.astype(p_dtype)
    loss, dscores = hs.indexer_kl_loss(*on("gpu", s, p))
    dscores = to_host(dscores)
    ref_loss, ref_d = reference.indexer_kl_loss(s.astype(np.float64), p.astype(np.float64))
    assert np.isfinite(dscores).all() and not dscores[4].any() and not dscores[5].any()
    np.testing.assert_allclose(dscores, ref_d, rtol=2e-7, atol=1e-15)
    assert abs(float(loss) - ref_loss) <= 1e-12 * max(abs(ref_loss), 1.0)


@pytest.mark.gpu
def test_gpu_fallback_switch_routes_every_call_to_the_primitive_path(monkeypatch):
    """HYSCALE_INDEXER_LOSS_FALLBACK=1 sends all three functions to gpu_fallback,
    which agrees with the kernels."""
    gpu, fallback = _gpu_backend()
    calls = []

    def spy(name):
        original = getattr(fallback, name)
        return lambda *args: calls.append(name) or original(*args)

    for name in BACKEND_FUNCTIONS:
        monkeypatch.setattr(fallback, name, spy(name))
    q, keys, w, indices = make_inputs(np.random.default_rng(27), 6, 64, 300, 500, dtype=bfloat16)
    g = np.random.default_rng(28).standard_normal(indices.shape).astype(np.float32)
    probs = np.random.default_rng(29).random(indices.shape).astype(np.float32)
    args = on("gpu", q, keys, w, indices, g, probs)

    def run():
        scores = hs.indexer_scores_at(*args[:4])
        return (scores, *hs.indexer_scores_at_backward(*args[:5]), hs.indexer_kl_loss(scores, args[5])[1])

    kernels = run()
    assert calls == []
    monkeypatch.setenv(gpu.FALLBACK_ENV, "1")
    primitives = run()
    assert calls == list(BACKEND_FUNCTIONS)
    for name, a, b in zip(("scores", "dq", "dk", "dw", "dscores"), kernels, primitives):
        a, b = to_host(a).astype(np.float64), to_host(b).astype(np.float64)
        finite = np.isfinite(b)
        np.testing.assert_array_equal(np.isfinite(a), finite, err_msg=name)
        np.testing.assert_allclose(a[finite], b[finite], rtol=2e-2, atol=1e-2 * np.abs(b[finite]).max(),
                                   err_msg=name)


@pytest.mark.gpu
def test_gpu_kernel_memory_stays_within_the_stated_bounds(kernels_only, monkeypatch):
    """Scores allocate their [N, kk] float32 output (and w as float32); the
    backward its outputs, one chunk of float32 dk rows and the chunk's sort;
    the KL loss its float32 dscores and N float64 row losses. A materialised
    [N, kk, D] or [N, kk] float64 temporary would exceed each bound."""
    gpu = kernels_only
    monkeypatch.setattr(gpu, "ROWS_BYTES", 4 << 20)
    n, heads, kk, dim, slack = 1024, 16, 2048, 64, 1 << 20
    q, keys, w, indices = make_inputs(np.random.default_rng(30), n, heads, kk, n, dim=dim, dtype=bfloat16)
    g = np.random.default_rng(31).standard_normal(indices.shape).astype(np.float32)
    probs = np.random.default_rng(32).random(indices.shape).astype(np.float32)
    q, keys, w, indices, g, probs = on("gpu", q, keys, w, indices, g, probs)
    with pool_peak() as hook:
        scores = gpu.indexer_scores_at(q, keys, w, indices)
    assert hook.peak <= n * kk * 4 + n * heads * 4 + slack, hook.peak
    with pool_peak() as hook:
        gpu.indexer_scores_at_backward(q, keys, w, indices, g)
    pairs = (gpu.ROWS_BYTES // (kk * dim * 4)) * kk
    small = q.nbytes + 12 * (keys.shape[0] * dim * 4 + n * heads * 4)  # dq; dk, its error, dw, w, conversions
    assert hook.peak <= gpu.ROWS_BYTES + 128 * pairs + small + slack, hook.peak
    with pool_peak() as hook:
        gpu.indexer_kl_loss(scores, probs)
    assert hook.peak <= n * kk * 4 + n * 8 + slack, hook.peak


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def kernel_backend(request):
    """"cpu", or "gpu" held to the kernels with poisoned outputs (``kernels_only`` and ``poisoned``)."""
    if request.param == "gpu":
        request.getfixturevalue("kernels_only")
        request.getfixturevalue("poisoned")
    return request.param


@pytest.mark.parametrize("dtype", [pytest.param(bfloat16, id="bfloat16"), pytest.param(np.dtype(np.float16),
                                   id="float16"), pytest.param(np.dtype(np.float32), id="float32")])
@pytest.mark.parametrize("n, k", [(8, 63), (6, 65), (4, 300)])
def test_kernel_shapes_slot_counts_around_a_block(kernel_backend, dtype, n, k):
    """kk one slot short of and one past a 64-slot block, and a partial fifth block: scores, their
    backward and the KL loss."""
    q, keys, w, indices = make_inputs(np.random.default_rng(40 + k), n, 16, k, 500, dtype=dtype)
    check_scores(kernel_backend, q, keys, w, indices)
    check_scores_backward(kernel_backend, q, keys, w, indices)
    scores, probs = make_loss_inputs(np.random.default_rng(41 + k), n, k)
    loss, dscores = hs.indexer_kl_loss(*on(kernel_backend, scores, probs))
    ref_loss, ref_d = reference.indexer_kl_loss(scores, probs)
    assert_within_twice_naive("dscores", to_host(dscores), naive_kl(scores, probs)[1], ref_d)
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(abs(ref_loss), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_kernels_and_fallback_agree_on_nan_inputs(monkeypatch, dtype):
    """Both GPU paths take relu(NaN) = 0: a NaN in q[2, 5] or in key row s leaves every score
    finite, and the backward's NaNs (dq at that feature for queries selecting s, dk at q's NaN
    feature for query 2's keys) fall on the same entries."""
    gpu, _ = _gpu_backend()
    monkeypatch.delenv(gpu.FALLBACK_ENV, raising=False)
    q, keys, w, indices = make_inputs(np.random.default_rng(33), 6, 16, 70, 200, dtype=dtype)
    s = int(indices[0, np.flatnonzero(indices[0] >= 0)[0]])
    q[2, 5, 9] = np.nan
    keys[s, 4] = np.nan
    g = np.random.default_rng(34).standard_normal(indices.shape).astype(np.float32)
    args = on("gpu", q, keys, w, indices, g)
    assert gpu.config(args[0], args[1]) is not None

    def run():
        return (hs.indexer_scores_at(*args[:4]), *hs.indexer_scores_at_backward(*args))

    kernels = [to_host(x).astype(np.float64) for x in run()]
    monkeypatch.setenv(gpu.FALLBACK_ENV, "1")
    primitives = [to_host(x).astype(np.float64) for x in run()]
    assert not np.isnan(kernels[0]).any() and np.isnan(kernels[1][0, :, 4]).all()
    assert np.isnan(kernels[2][indices[2][indices[2] >= 0], 9]).all()
    for name, a, b in zip(("scores", "dq", "dk", "dw"), kernels, primitives):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=name)
        finite = np.isfinite(b)
        np.testing.assert_allclose(a[finite], b[finite], rtol=2e-2, atol=1e-2 * np.abs(b[finite]).max(),
                                   err_msg=name)
