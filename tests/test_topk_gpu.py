"""GPU top-k kernels: bitwise equal to the CPU backend on every path."""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
from helpers import awkward_array, same_bits, topk_dtype_params
from hyscale_core._dtypes import bfloat16

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    from hyscale_core.ops.topk import gpu

    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def check_gpu_equals_cpu(a, k, largest=True, sort_output=True):
    import cupy

    cpu_values, cpu_indices = hs.topk(a, k, largest=largest, sorted=sort_output)
    gpu_values, gpu_indices = hs.topk(cupy.asarray(a), k, largest=largest, sorted=sort_output)
    assert isinstance(gpu_indices, cupy.ndarray)
    np.testing.assert_array_equal(gpu_indices.get(), cpu_indices)
    assert same_bits(gpu_values, cpu_values)


def adversarial(kind: str, shape, dtype, rng):
    if kind == "all_equal":
        return np.full(shape, 1.5, dtype=np.float64).astype(dtype)
    if kind == "few_distinct":
        return rng.integers(-3, 4, size=shape).astype(dtype)
    if kind == "few_distinct_odd":  # repeated values whose keys differ in their low bits
        scale = 1001 if np.dtype(dtype).kind == "i" else 1.2345678
        return (rng.integers(-3, 4, size=shape) * scale + 7).astype(dtype)
    if kind == "ascending":
        return np.sort(rng.standard_normal(shape), axis=-1).astype(dtype)
    if kind == "descending":
        return np.sort(rng.standard_normal(shape), axis=-1)[..., ::-1].astype(dtype)
    if kind == "uniform":
        return rng.random(shape).astype(dtype)
    return awkward_array(rng, shape, dtype)


# (rows, n, k) covering: short rows kept whole (n <= 8192), sampled rows with
# one block per row, rows cut into chunks (few long rows), k = 1, k = n - 1,
# k = n, k above the in-kernel sort (sort path), lengths 1, 7, 63, 300, odd
# lengths (rows start off the 16-byte grid).
SHAPES = [(64, 1000, 100), (3, 300_001, 2048), (1, 1 << 20, 4096), (5, 20_000, 5000), (300, 7, 7),
          (17, 333, 1), (2, 65_536, 65_535), (1000, 2048, 256), (9, 1, 1), (11, 63, 20), (4, 300, 299),
          (200, 9001, 4096), (2, 200_003, 1)]


@pytest.mark.parametrize("dtype", topk_dtype_params())
@pytest.mark.parametrize("rows, n, k", SHAPES)
def test_random_rows_match_cpu(dtype, rows, n, k):
    rng = np.random.default_rng(rows * n + k)
    a = adversarial("awkward", (rows, n), dtype, rng)
    check_gpu_equals_cpu(a, k)
    check_gpu_equals_cpu(a, k, largest=False, sort_output=False)


@pytest.mark.parametrize("threads", [256, 512])
@pytest.mark.parametrize("dtype", topk_dtype_params())
@pytest.mark.parametrize("rows, n, k", [(3, 300_001, 2048), (1, 1 << 20, 4096), (200, 9001, 4096),
                                        (64, 1000, 100), (11, 63, 20), (40, 40_000, 4000)])
def test_both_block_sizes_match_cpu(monkeypatch, threads, dtype, rows, n, k):
    """The plan picks 256- or 512-thread blocks by shape; either must give the same bits."""
    from hyscale_core.ops.topk import gpu

    default_plan = gpu.plan
    monkeypatch.setattr(gpu, "plan", lambda *shape: default_plan(*shape, threads=threads))
    monkeypatch.setattr(gpu, "_LAUNCHES", {})
    a = adversarial("awkward", (rows, n), dtype, np.random.default_rng(rows + n + k))
    check_gpu_equals_cpu(a, k)
    check_gpu_equals_cpu(a, k, largest=False, sort_output=False)


@pytest.mark.parametrize("kind", ["all_equal", "few_distinct", "few_distinct_odd", "ascending", "descending",
                                  "uniform"])
@pytest.mark.parametrize("dtype", [np.float32, bfloat16, np.int64], ids=["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("rows, n, k", [(8, 131_072, 2048), (2, 1 << 20, 256), (256, 5000, 4096)])
def test_adversarial_rows_match_cpu(kind, dtype, rows, n, k):
    a = adversarial(kind, (rows, n), dtype, np.random.default_rng(0))
    check_gpu_equals_cpu(a, k)
    check_gpu_equals_cpu(a, k, sort_output=False)


@pytest.mark.parametrize("rank", ["too_high", "too_low"])
@pytest.mark.parametrize("dtype", [np.float32, bfloat16, np.float64], ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("rows, n, k", [(4, 40_000, 2048), (1, 300_001, 1000)])
def test_threshold_misses_fall_back_exactly(monkeypatch, rank, dtype, rows, n, k):
    """A sampled threshold above the k-th key, or one leaving more keys above it
    than the buffer holds, sends the row through the radix-select fallback."""
    from hyscale_core.ops.topk import gpu

    monkeypatch.setattr(gpu, "sample_rank", (lambda m, k, n: 1) if rank == "too_high" else (lambda m, k, n: m))
    monkeypatch.setattr(gpu, "_LAUNCHES", {})
    a = np.random.default_rng(n).standard_normal((rows, n)).astype(dtype)
    check_gpu_equals_cpu(a, k)
    check_gpu_equals_cpu(a, k, largest=False, sort_output=False)


@pytest.mark.parametrize("n", [300, 50_000])
def test_special_values_keep_their_bits(n):
    """NaN payloads of both signs, +-inf and +-0.0: NaN above +inf, -0.0 == +0.0
    (lower index first), and every value returned with its own bits."""
    rng = np.random.default_rng(n)
    specials = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x00000000,
                         0x80000000, 0x3F800000, 0xBF800000], dtype=np.uint32)
    a = specials[rng.integers(0, len(specials), size=(6, n))].view(np.float32)
    for k in (1, 17, n // 3, n - 1):
        check_gpu_equals_cpu(a, k)
        check_gpu_equals_cpu(a, k, largest=False)
        check_gpu_equals_cpu(a, k, sort_output=False)


def test_k_zero_gives_empty_results():
    import cupy

    values, indices = hs.topk(cupy.ones((3, 10), dtype=cupy.float32), 0)
    assert values.shape == indices.shape == (3, 0) and indices.dtype == np.int64


def test_rows_past_a_launch_go_in_batches(monkeypatch):
    """More rows than one launch takes (ROW_BATCH, 2**30 by default; 7 here):
    the batches' results are those of the CPU backend, in row order."""
    from hyscale_core.ops.topk import gpu

    monkeypatch.setattr(gpu, "ROW_BATCH", 7)
    a = awkward_array(np.random.default_rng(2), (23, 300), np.float32)
    check_gpu_equals_cpu(a, 20)
    check_gpu_equals_cpu(a, 5, largest=False, sort_output=False)


def test_row_of_two_to_the_24():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1, 1 << 24)).astype(np.float32)
    check_gpu_equals_cpu(a, 2048)
    check_gpu_equals_cpu(a, 100, largest=False, sort_output=False)


def test_repeated_runs_are_bitwise_identical():
    import cupy

    for shape in [(512, 40_000), (2, 1 << 20)]:
        a = cupy.asarray(adversarial("few_distinct", shape, np.float32, np.random.default_rng(2)))
        first_values, first_indices = hs.topk(a, 2048)
        for _ in range(5):
            values, indices = hs.topk(a, 2048)
            assert same_bits(values, first_values) and same_bits(indices, first_indices)


def test_chunked_rows_on_two_streams_at_once():
    """Chunked launches share a workspace and tickets per stream; calls queued on
    two streams, growing sizes on each, must not disturb one another."""
    import cupy

    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((rows, n)).astype(np.float32) for rows, n in [(1, 300_000), (3, 1 << 20)]]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    results = []
    for a in inputs:
        for stream in streams:
            with stream:
                results.append((a, hs.topk(cupy.asarray(a), 2048)))
    cupy.cuda.Device().synchronize()
    for a, (values, indices) in results:
        cpu_values, cpu_indices = hs.topk(a, 2048)
        np.testing.assert_array_equal(indices.get(), cpu_indices)
        assert same_bits(values, cpu_values)


def test_bfloat16_through_dlpack_from_torch():
    torch = pytest.importorskip("torch")
    device_tensor = torch.randn(16, 5000, device="cuda").to(torch.bfloat16)
    gpu_values, gpu_indices = hs.topk(device_tensor, 100)
    host_tensor = device_tensor.cpu()
    cpu_values, cpu_indices = hs.topk(host_tensor, 100)
    assert isinstance(cpu_indices, np.ndarray) and cpu_values.dtype == bfloat16
    assert gpu_values.dtype == bfloat16
    np.testing.assert_array_equal(gpu_indices.get(), cpu_indices)
    assert same_bits(gpu_values, cpu_values)
    expect = torch.topk(host_tensor.float(), 100).values.to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(cpu_values.view(np.int16), expect)
