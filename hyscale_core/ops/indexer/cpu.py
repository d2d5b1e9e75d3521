"""CPU backend of the indexer: BLAS tiles, a Numba epilogue, a streaming select.

Queries go in blocks of ``Q_BLOCK``; each block streams over key tiles of
``K_TILE`` that hold at least one of its candidates (fully masked tiles are
skipped). A tile's logits come from NumPy's BLAS, one product per query
(``q[t] @ k_tile.T``, [H, D] by [D, S]), the ReLU, head-weighted sum and
mask from one Numba kernel. A query's logits thus never depend on which
block it sits in or where: some BLAS kernels (OpenBLAS's Haswell sgemm, for
one) give a row other bits in a product of another row count or at another
row, and a query shard puts its queries at other rows of their blocks.
``indexer_scores`` writes the tiles into the table; ``indexer_topk`` feeds
them to a per-query candidate buffer with a running threshold, so it holds
O(Q_BLOCK * topk) selection state plus one tile, never the table. Both run the same tile code
on the same tile shapes, so their scores (and hence selections) are
bitwise identical.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numba import njit

from ..topk.cpu import kth_largest, sort_by_key, sort_key

Q_BLOCK = 64
K_TILE = 256

_ONES32 = np.uint64(0xFFFFFFFF)
_SIGN32 = np.uint64(0x80000000)
_EXP32 = np.uint64(0x7F800000)
_MANT32 = np.uint64(0x007FFFFF)
NEG_INF_BITS = np.uint32(0xFF800000)
NEG_INF_KEY = np.uint64(0x007FFFFF)  # key of -inf: the running threshold starts here


@njit(cache=True, nogil=True)
def weighted_relu(logits, w, lo, hi, s0, out):
    """out[t, s] = sum_h w[t, h] * relu(logits[t, h, s]), -inf outside [lo, hi).

    logits float32 [T, H, S], w float32 [T, H], lo/hi int64 [T], out float32 [T, S].
    The head sum runs in float32 in order h = 0 .. H-1.
    """
    n_t, n_heads = w.shape
    n_s = out.shape[1]
    zero = np.float32(0.0)
    neg_inf = np.float32(-np.inf)
    for t in range(n_t):
        acc = out[t]
        acc[:] = zero
        for h in range(n_heads):
            wh = w[t, h]
            row = logits[t, h]
            for s in range(n_s):
                x = row[s]
                acc[s] += wh * (x if x > zero else zero)  # relu(NaN) = 0, like fmaxf
        for s in range(n_s):
            if s0 + s < lo[t] or s0 + s >= hi[t]:
                acc[s] = neg_inf


@njit(cache=True, inline="always")
def score_key(bits):
    return sort_key(np.uint64(bits), _ONES32, _SIGN32, _EXP32, _MANT32, True, False)


@njit(cache=True)
def prune(bits_row, idx_row, count, t, k, thr):
    """Keep the top ``k`` of the ``count[t] > k`` buffered candidates of query t.

    The buffer is in ascending key-index order and stays so; ties at the new
    threshold keep the lower indices, as the materialised top-k would.
    """
    c = count[t]
    keys = np.empty(c, np.uint64)
    for j in range(c):
        keys[j] = score_key(bits_row[j])
    kth, n_above = kth_largest(keys, k, 32)
    ties = k - n_above
    j = 0
    for i in range(c):
        key = keys[i]
        keep = key > kth
        if key == kth and ties > 0:
            keep = True
            ties -= 1
        if keep:
            bits_row[j] = bits_row[i]
            idx_row[j] = idx_row[i]
            j += 1
    count[t] = k
    thr[t] = kth


@njit(cache=True, nogil=True)
def stream_tile(tile_bits, s0, k, buf_bits, buf_idx, count, thr):
    """Offer one score tile (float32 bits [T, S], keys s0 ..) to the buffers.

    A score enters only if its key beats the query's threshold: a later key
    equal to the k-th kept one has a higher index, so it can never rank in.
    """
    n_t, n_s = tile_bits.shape
    cap = buf_bits.shape[1]
    for t in range(n_t):
        for s in range(n_s):
            key = score_key(tile_bits[t, s])
            if key <= thr[t]:
                continue
            if count[t] == cap:
                prune(buf_bits[t], buf_idx[t], count, t, k, thr)
                if key <= thr[t]:
                    continue
            c = count[t]
            buf_bits[t, c] = tile_bits[t, s]
            buf_idx[t, c] = s0 + s
            count[t] = c + 1


@njit(cache=True, nogil=True)
def finish(buf_bits, buf_idx, count, k, out_idx, out_bits, want_scores):
    """Write each query's top-k, best first, padded with -1 (and -inf bits
    into ``out_bits`` when ``want_scores``)."""
    thr = np.empty(count.shape[0], np.uint64)
    for t in range(count.shape[0]):
        if count[t] > k:
            prune(buf_bits[t], buf_idx[t], count, t, k, thr)
        c = count[t]
        keys = np.empty(c, np.uint64)
        order = np.empty(c, np.int64)
        for j in range(c):
            keys[j] = score_key(buf_bits[t, j])
            order[j] = j
        sort_by_key(keys, order, 32)
        for j in range(c):
            out_idx[t, j] = buf_idx[t, order[j]]
        for j in range(c, k):
            out_idx[t, j] = -1
        if want_scores:
            for j in range(c):
                out_bits[t, j] = buf_bits[t, order[j]]
            for j in range(c, k):
                out_bits[t, j] = NEG_INF_BITS


def _block_tiles(q_block: np.ndarray, k32: np.ndarray, w_block: np.ndarray, lo: np.ndarray, hi: np.ndarray
                 ) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield ``(s0, s1, scores float32 [T, s1-s0])`` for the key tiles a block sees.

    The yielded scores live in a buffer reused by the next tile: copy them or
    use them before advancing.
    """
    n_k, dim = k32.shape
    first, last = int(lo.min()), int(hi.max())
    queries = np.ascontiguousarray(q_block, dtype=np.float32)  # [T, H, D]: one BLAS product per query
    logits_buf = np.empty((queries.shape[0], queries.shape[1], K_TILE), dtype=np.float32)
    tile_buf = np.empty((q_block.shape[0], K_TILE), dtype=np.float32)
    for s0 in range((first // K_TILE) * K_TILE, last, K_TILE):
        s1 = min(s0 + K_TILE, n_k)
        if not np.any((lo < s1) & (hi > s0)):
            continue
        logits, tile = logits_buf[:, :, :s1 - s0], tile_buf[:, :s1 - s0]
        np.matmul(queries, k32[s0:s1].T, out=logits)
        weighted_relu(logits, w_block, lo, hi, s0, tile)
        yield s0, s1, tile


def _blocks(q, k, w, lo, hi):
    k32 = np.ascontiguousarray(k, dtype=np.float32)
    w32 = np.ascontiguousarray(w, dtype=np.float32)
    for t0 in range(0, q.shape[0], Q_BLOCK):
        t1 = min(t0 + Q_BLOCK, q.shape[0])
        yield t0, t1, _block_tiles(q[t0:t1], k32, w32[t0:t1], lo[t0:t1], hi[t0:t1])


def indexer_scores(q, k, w, lo, hi) -> np.ndarray:
    """float32 [Nq, Nk] score table (see ``hyscale_core.indexer_scores``)."""
    table = np.full((q.shape[0], k.shape[0]), -np.inf, dtype=np.float32)
    for t0, t1, tiles in _blocks(q, k, w, lo, hi):
        for s0, s1, tile in tiles:
            table[t0:t1, s0:s1] = tile
    return table


def indexer_topk(q, k, w, topk: int, lo, hi, want_scores: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """``(indices int32 [Nq, topk], scores float32 [Nq, topk] or None)``, streaming."""
    n_q = q.shape[0]
    out_idx = np.empty((n_q, topk), dtype=np.int32)
    out_bits = np.empty((n_q if want_scores else 1, topk), dtype=np.uint32)
    scores = out_bits.view(np.float32) if want_scores else None
    if n_q == 0 or topk == 0:  # nothing to select (the prunes need room for at least one pick)
        return out_idx, scores
    cap = 2 * topk + 64
    for t0, t1, tiles in _blocks(q, k, w, lo, hi):
        buf_bits = np.empty((t1 - t0, cap), dtype=np.uint32)
        buf_idx = np.empty((t1 - t0, cap), dtype=np.int32)
        count = np.zeros(t1 - t0, dtype=np.int64)
        thr = np.full(t1 - t0, NEG_INF_KEY, dtype=np.uint64)
        for s0, _, tile in tiles:
            stream_tile(tile.view(np.uint32), s0, topk, buf_bits, buf_idx, count, thr)
        scores_block = out_bits[t0:t1] if want_scores else out_bits
        finish(buf_bits, buf_idx, count, topk, out_idx[t0:t1], scores_block, want_scores)
    return out_idx, scores
