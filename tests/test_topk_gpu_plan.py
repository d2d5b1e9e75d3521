"""The GPU top-k's host side without a GPU: the launch plan's rules and the
argument block's layout against cuda/topk.cu."""
from __future__ import annotations

import re

import pytest

from hyscale_core.gpu.module import cuda_source_dir
from hyscale_core.ops.topk import gpu

H200_SMS = 132


def test_argument_block_matches_the_kernel_struct():
    source = (cuda_source_dir() / "topk.cu").read_text()
    body = re.search(r"struct TopkArgs \{(.*?)\};", source, re.S).group(1)
    fields = []
    for line in body.splitlines():
        declaration = line.split("//")[0].strip().rstrip(";")
        if declaration:
            kind, names = declaration.split(None, 1)
            assert kind == "u32", line
            fields += [name.strip() for name in names.split(",")]
    assert fields == list(gpu.ARGS_DTYPE.names)
    assert gpu.ARGS_DTYPE.itemsize == 4 * len(fields)


def test_argument_block_holds_the_plan():
    p = gpu.plan(3, 300_001, 2048, 4, H200_SMS)
    block = gpu.args_fields(3, 300_001, 2048, True, p)[0]
    assert (block["rows"], block["n"], block["k"], block["by_key"]) == (3, 300_001, 2048, 1)
    assert (block["chunks"], block["cap"], block["sample_m"], block["sample_r"], block["k_pad"]) == (
        p.chunks, p.cap, p.sample_m, p.sample_r, p.k_pad)


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 131, 132, 1024, 16384])
@pytest.mark.parametrize("n", [63, 8192, 32768, 131072, 1 << 20, 1 << 24])
@pytest.mark.parametrize("k", [1, 256, 2048, 4096])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_plan_rules(rows, n, k, itemsize):
    if k > n:
        pytest.skip("k > n: no plan")
    p = gpu.plan(rows, n, k, itemsize, H200_SMS)
    assert 1 <= p.chunks <= gpu.MAX_CHUNKS
    assert rows * p.chunks <= max(rows, H200_SMS)  # at most one block per SM when rows are few
    if p.chunks > 1:
        assert n // p.chunks >= gpu.MIN_CHUNK
    assert p.k_pad >= max(k, 128) and p.k_pad & (p.k_pad - 1) == 0
    assert p.cap >= 2 * p.k_pad  # the sort runs through two arrays of k_pad pairs in the buffer
    assert p.cap * p.entry <= gpu.MAX_DYNAMIC_SMEM
    assert p.entry == (12 if itemsize == 8 else 8)
    assert p.threads in (256, 512)
    if n <= gpu.SHORT_ROW:
        assert (p.sample_m, p.sample_r) == (0, 0) and p.cap >= n
    else:
        assert 0 < p.sample_r <= p.sample_m <= max(4096, gpu.MAX_SAMPLE)


def test_sample_rank_sits_below_the_expected_rank():
    """The threshold's rank among the sampled keys lies past the k-th key's
    expected rank (so T is at or below the k-th key), never past the sample,
    and rises with k."""
    for m, n in [(4096, 131072), (8192, 1 << 20), (4096, 8193)]:
        ranks = [gpu.sample_rank(m, k, n) for k in (1, 256, 2048, 4096)]
        assert ranks == sorted(ranks)
        for k, r in zip((1, 256, 2048, 4096), ranks):
            assert m * k / n < r <= m


def test_a_launch_past_the_grid_is_refused():
    """rows x chunks blocks past 2**31 - 1 cannot be one launch: topk_rows
    batches the rows (ROW_BATCH) so that the grid and TopkArgs' 32-bit row
    count hold; prepare refuses what would not fit rather than launch it."""
    assert gpu.ROW_BATCH <= 2**31 - 1  # a batch of one-block rows is one launch
    p = gpu.plan(4, 1000, 10, 4, H200_SMS)
    with pytest.raises(ValueError, match="need more blocks than a launch holds"):
        gpu.prepare(2**31, 1000, 10, "float32", True, True, p, 0)
