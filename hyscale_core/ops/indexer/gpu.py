"""GPU backend of the indexer: the fused kernels of ``cuda/indexer.cu``.

Both ``indexer_scores`` and ``indexer_topk`` run the same tile code (wgmma
bf16/fp16 products with float32 accumulation, ReLU, head-weighted sum), so
the streaming selection is bitwise identical to ``topk`` of the table.
Shapes the kernel is not built for (H not dividing 256, D not a multiple of
64) go to ``gpu_fallback``. A topk beyond the in-kernel sort (32 D picks:
4096 at D = 128) selects from the same kernel's score table, made in blocks
of queries (``TABLE_BLOCK_BYTES`` each), so that it too equals topk of
``indexer_scores`` bitwise.

Threshold guess: once a query has seen the fraction f of its keys at which
``ceil(GUESS_BETA * topk * f)`` reaches ``GUESS_MIN`` (where that is below
topk), the kernel keeps only that many of its best candidates, as if the
rest of the row scored like the part seen. The selection stays exact: a row
left with fewer than topk candidates is reported by the kernel and selected
again here from the same kernel's scores (``_select_again``), so
``indexer_topk`` waits for the kernel to read that report. Rows whose early
keys score far above their later ones fail the guess and cost about a
second pass each; ``GUESS_BETA = 0`` turns the guess off.

Precision: bfloat16 and float16 inputs are used as they are; float32 and
float64 inputs are rounded to bfloat16 first. Products and sums run in
float32. ReLU maps NaN to 0. Every NaN score is the one NaN 0x7FFFFFFF, and a
sum that rounds to -0.0 (tiny negative terms) reads +0.0, which the
selection ranks the same.
"""
from __future__ import annotations

import numpy as np

from ..._backend import cupy_module
from ..._dtypes import bfloat16
from ...gpu.module import get_kernel, multiprocessor_count
from . import gpu_fallback

QROWS, KT, STAGES = 256, 64, 2  # cuda/indexer_config.cuh
CTAS_PER_SM = 2
# Candidates a query's buffer holds before it is cut back to topk, in
# multiples of topk (benchmarks/indexer_gpu_breakdown.py --buffer-ks sweeps
# it): a larger buffer prunes less often, each prune reads more.
BUFFER_KS = 2
# The threshold guess (module docstring). With exchangeable scores a row
# fails it when fewer than topk of its keys beat the kept r-th of its first
# f: at r >= 96 and beta = 1.75 that is more than four standard deviations
# (the count above has relative spread about 1 / sqrt(r)). Measured in
# benchmarks/NOTES.md ("A threshold guess"); beta from 1.4 to 2.5 timed alike.
GUESS_BETA = 1.75
GUESS_MIN = 96
# Score-table bytes per query block when topk is past the kernel's sort.
TABLE_BLOCK_BYTES = 1 << 30
POISON_OUTPUTS = False  # tests set this: outputs start as garbage, so unwritten slots show
# benchmarks/indexer_timeline.py sets this: the kernels are built with the
# timeline probe (cuda/indexer_probe.cuh), which sums cycles per step into
# the module's global hs_idx_probe; off, the probe compiles to nothing.
PROBE = False


def _config(q, topk: int | None):
    """Compile-time configuration of the fused kernel, or None if unsupported."""
    _, heads, dim = q.shape
    if heads < 8 or QROWS % heads or dim % 64 or dim > 256:
        return None
    sort_cap = STAGES * KT * dim * 2 // 8
    if topk is not None and topk > sort_cap:
        return None
    f16 = np.dtype(q.dtype) == np.float16
    defines = (f"HS_IDX_HEADS={heads}", f"HS_IDX_DIM={dim}", f"HS_IDX_F16={int(f16)}")
    if PROBE:
        defines += ("HS_IDX_PROBE=1",)
    smem = 1024 + QROWS * dim * 2 + STAGES * KT * dim * 2 + QROWS * 4  # 1024: alignment slack
    return defines, smem, QROWS // heads, (np.float16 if f16 else bfloat16)


def _operands(cp, q, k, w, lo, hi, in_dtype):
    q16 = cp.ascontiguousarray(q, dtype=in_dtype)
    k16 = cp.ascontiguousarray(k, dtype=in_dtype)
    return (q16.view(cp.uint16), k16.view(cp.uint16), cp.ascontiguousarray(w, dtype=cp.float32),
            cp.asarray(lo, dtype=cp.int32), cp.asarray(hi, dtype=cp.int32))


def _grid(cp) -> int:
    return CTAS_PER_SM * multiprocessor_count(cp.cuda.Device().id)


def indexer_scores(q, k, w, lo, hi):
    """float32 [Nq, Nk] score table on the device."""
    cp = cupy_module()
    config = _config(q, None)
    if config is None:
        return gpu_fallback.indexer_scores(q, k, w, lo, hi)
    defines, smem, _, in_dtype = config
    q16, k16, w32, lo32, hi32 = _operands(cp, q, k, w, lo, hi, in_dtype)
    table = cp.full((q.shape[0], k.shape[0]), -cp.inf, dtype=cp.float32)
    if q.shape[0] == 0:
        return table
    counter = cp.zeros(1, dtype=cp.int32)
    kernel = get_kernel("indexer", "indexer_scores_kernel", smem, defines)
    kernel((_grid(cp),), (128,), (q16, k16, w32, lo32, hi32, np.int32(q.shape[0]), np.int32(k.shape[0]),
                                  counter, table), shared_mem=smem)
    return table


def _score_blocks(q, k, w, lo, hi):
    """``(t0, t1, indexer_scores of queries t0 .. t1 - 1)`` over all queries:
    a query's scores do not depend on the queries beside it in the kernel."""
    rows = max(1, min(q.shape[0], TABLE_BLOCK_BYTES // (4 * k.shape[0])))
    for t0 in range(0, q.shape[0], rows):
        t1 = min(t0 + rows, q.shape[0])
        yield t0, t1, indexer_scores(q[t0:t1], k, w[t0:t1], lo[t0:t1], hi[t0:t1])


def indexer_topk(q, k, w, topk: int, lo, hi, want_scores: bool):
    """``(indices int32 [Nq, topk], scores float32 [Nq, topk] or None)`` on the device."""
    cp = cupy_module()
    config = _config(q, topk)
    if config is None:
        if _config(q, None) is not None:  # built for the shape; topk past the in-kernel sort
            return gpu_fallback.select_from_panels(_score_blocks(q, k, w, lo, hi), q.shape[0], k.shape[0], topk,
                                                   want_scores)
        return gpu_fallback.indexer_topk(q, k, w, topk, lo, hi, want_scores)
    defines, smem, per_group, in_dtype = config
    n_q = q.shape[0]
    indices = cp.empty((n_q, topk), dtype=cp.int32)
    scores = cp.empty((n_q, topk), dtype=cp.float32) if want_scores else None
    if POISON_OUTPUTS:
        indices.fill(-7)
        if scores is not None:
            scores.fill(np.nan)
    if n_q == 0 or topk == 0:
        return indices, scores
    q16, k16, w32, lo32, hi32 = _operands(cp, q, k, w, lo, hi, in_dtype)
    grid = _grid(cp)
    cap = BUFFER_KS * topk + KT  # room for one more tile of appends after each prune check
    n_pairs = grid * 2 * per_group * cap
    if n_pairs >= 2**32:  # the kernel counts pairs in 32 bits
        raise ValueError(f"indexer_topk: topk={topk} needs candidate buffers of {n_pairs} pairs, past 2**32")
    buf_pairs = cp.empty(2 * n_pairs, dtype=cp.uint32)  # (score bits, key index) pairs
    counter = cp.zeros(1, dtype=cp.int32)
    failed = cp.zeros(1 + n_q, dtype=cp.int32)  # count, then the rows
    kernel = get_kernel("indexer", "indexer_topk_kernel", smem, defines)
    kernel((grid,), (128,), (q16, k16, w32, lo32, hi32, np.int32(n_q), np.int32(k.shape[0]), np.int32(topk),
                             counter, buf_pairs, np.int32(cap), np.float32(GUESS_BETA),
                             np.int32(GUESS_MIN), failed[:1], failed[1:], indices,
                             scores if scores is not None else np.uint64(0)), shared_mem=smem)
    n_failed = int(failed[0].get())
    if n_failed:
        _select_again(q, k, w, lo, hi, np.sort(failed[1:1 + n_failed].get()), indices, scores)
    return indices, scores


def _select_again(q, k, w, lo, hi, rows, indices, scores):
    """Overwrite ``rows`` (int host array) of the kernel's outputs with topk of
    their rows of the score table, without a guess."""
    cp = cupy_module()
    lo, hi = np.asarray(lo)[rows], np.asarray(hi)[rows]
    rows_d = cp.asarray(rows)
    picked, values = gpu_fallback.select_from_panels(_score_blocks(q[rows_d], k, w[rows_d], lo, hi), len(rows),
                                                     k.shape[0], indices.shape[1], scores is not None)
    indices[rows_d] = picked
    if scores is not None:
        scores[rows_d] = values
