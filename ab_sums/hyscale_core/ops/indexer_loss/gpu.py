"""GPU backend of the indexer's sparse-stage loss: the kernels of
``cuda/indexer_loss.cu`` (scores at the selection and their backward) and
``cuda/indexer_loss_kl.cu`` (the KL loss), with ``gpu_fallback`` (CuPy
primitives in float64) for inputs the score kernels are not built for.

Same contract as cpu.py. The score kernels run when q and k are both
bfloat16 or both float16 (tensor cores: mma.sync with float32 accumulators)
or both float32 (float32 FMA, no tensor cores, so float32 inputs keep
float32 products), with at most 128 heads and D a multiple of 16 up to 128;
float64, mixed dtypes and other shapes take ``gpu_fallback``. The KL kernel
takes every dtype. ``HYSCALE_INDEXER_LOSS_FALLBACK=1`` in the environment
sends all three functions to ``gpu_fallback`` (read at each call).

Precision (kernels):

- scores: logits with float32 accumulation, ReLU (NaN -> 0), the head sum in
  float32 in a fixed order (16-head butterflies, then head tiles ascending).
- backward: logits recomputed as in the forward; dw in float32 (slots in
  blocks of 64, then blocks ascending). For 16-bit inputs the tensor-core
  operands are scaled by exact powers of two into (-1, 1): dscores * mask for
  dq, held as a hi + lo pair of 16-bit values (about 16 bits), and w * mask
  for the dk rows, rounded once to the input type (exact when w holds
  16-bit values). dq sums its slots in blocks of 64, then the blocks in
  order, and is rounded once to q's dtype; each valid (query, slot) gets a
  float32 dk row, and the rows are added into a float32 dk key by key in
  ascending (query, slot) order with Kahan compensation (a sort of the index
  table per query chunk, no atomics), then rounded once to k's dtype:
  bitwise reproducible, and the same for every chunk size, since each key's
  running sum and error see the same adds in the same order.
- KL: every value in float64 whatever the input dtypes (the row work is
  memory-bound; float32 exp would add up to 2 ulp per slot), dscores rounded
  once to float32, the row losses added in float64 in a fixed order. This is
  more precise than the float32 the package promises for non-float64 inputs.

Memory, beyond inputs and outputs (N queries, kk slots, D features):
indexer_scores_at allocates only scores (float32 [N, kk]) and w as float32;
the backward adds dk and its compensation in float32 [Nk, D], dscores as float32 (a copy only if
it is not float32), and per query chunk of C queries the float32 rows
[C, kk, D] (C kk D 4 <= ROWS_BYTES = 1 GiB) and the chunk's sort scratch
(about 100 bytes per (query, slot) pair, C kk <= MAX_PAIRS = 2^22: under
400 MiB);
indexer_kl_loss allocates dscores (float32 [N, kk]), float64 row losses [N]
and, for 16-bit inputs only, their float32 copies. At N = 131072, kk = 2048,
D = 128: scores 1 GiB, rows 1 GiB, KL 1 GiB.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..._backend import cupy_module
from ..._dtypes import bfloat16
from ...gpu.convert import narrow, widen
from ...gpu.module import get_kernel
from ...gpu.segments import key_segments
from . import gpu_fallback

FALLBACK_ENV = "HYSCALE_INDEXER_LOSS_FALLBACK"
MODULE, KL_MODULE = "indexer_loss", "indexer_loss_kl"
SLOTS_PER_BLOCK, MAX_HEADS, MAX_DIM = 64, 128, 128  # cuda/indexer_loss.cuh: BK, 16 * 8, D
KL_THREADS, SUM_THREADS = 256, 1024  # cuda/indexer_loss_kl.cu
ROWS_BYTES = 1 << 30  # the backward's float32 dk rows per query chunk
MAX_PAIRS = 1 << 22  # (query, slot) pairs per query chunk (bounds the sort's scratch)
POISON_OUTPUTS = False  # tests set this: outputs and rows start as NaN, so unwritten entries show

_TYPE_CODES = {bfloat16: 0, np.dtype(np.float16): 1, np.dtype(np.float32): 2}
_KL_TAGS = {np.dtype(np.float32): "f", np.dtype(np.float64): "d"}


def fallback_forced() -> bool:
    """Whether $HYSCALE_INDEXER_LOSS_FALLBACK routes every call to gpu_fallback."""
    return os.environ.get(FALLBACK_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class Config:
    """One build of cuda/indexer_loss.cu: its defines, CTA size and dynamic shared memory."""

    defines: tuple[str, ...]
    threads: int
    smem_forward: int
    smem_backward: int
    dim: int


def config(q, k) -> Config | None:
    """The kernel build for q [N, H, D] and k, or None where gpu_fallback runs."""
    dtype = np.dtype(q.dtype)
    if fallback_forced() or dtype != np.dtype(k.dtype) or dtype not in _TYPE_CODES:
        return None
    _, heads, dim = q.shape
    if heads > MAX_HEADS or dim % 16 or dim > MAX_DIM:
        return None
    tiles = 1
    while 16 * tiles < heads:
        tiles *= 2
    item = dtype.itemsize
    pad, parts = (4, 1) if item == 4 else (8, 2)  # as PAD and PARTS in indexer_loss.cuh
    q_tile, k_tile = 16 * tiles * (dim + pad), SLOTS_PER_BLOCK * (dim + pad)
    p_tile = 16 * tiles * (SLOTS_PER_BLOCK + pad)
    forward = (q_tile + 2 * k_tile) * item
    defines = (f"HS_IL_TYPE={_TYPE_CODES[dtype]}", f"HS_IL_DIM={dim}", f"HS_IL_MTILES={tiles}")
    return Config(defines, 32 * max(4, tiles), forward, forward + (parts + 1) * p_tile * item, dim)


def _data(cp, x):
    """The kernel's view of q or k: 16-bit data as its bits."""
    return x if x.dtype == cp.float32 else x.view(cp.uint16)


def indexer_scores_at(q, k, w, indices):
    """float32 [N, kk] scores at the selected keys, -inf at -1 slots (contract: cpu.py)."""
    cfg = config(q, k)
    if cfg is None:
        return gpu_fallback.indexer_scores_at(q, k, w, indices)
    cp = cupy_module()
    n, kk = indices.shape
    scores = cp.empty((n, kk), dtype=cp.float32)
    if POISON_OUTPUTS:
        scores.fill(np.nan)
    if n and kk:
        w32 = cp.ascontiguousarray(widen(w, cp.float32))
        kernel = get_kernel(MODULE, "il_scores_at", cfg.smem_forward, cfg.defines)
        kernel((n,), (cfg.threads,), (_data(cp, q), _data(cp, k), w32, indices, scores, np.int32(q.shape[1]),
                                      np.int32(kk)), shared_mem=cfg.smem_forward)
    return scores


def query_chunks(n: int, kk: int, dim: int):
    """Query ranges whose float32 dk rows fit ROWS_BYTES and whose pairs fit MAX_PAIRS."""
    step = max(1, min(ROWS_BYTES // max(1, kk * dim * 4), MAX_PAIRS // max(1, kk)))
    for t0 in range(0, n, step):
        yield t0, min(n, t0 + step)


def add_rows_by_key(indices, rows, dk, comp, cfg: Config) -> None:
    """dk[s] += every row of the chunk whose slot selected key s, in ascending
    (query, slot) order, compensated (comp: the running errors, float32 [Nk, D]
    like dk; the sum is dk - comp). indices int32 [C, kk]; rows float32 [C * kk, D]."""
    n_keys = dk.shape[0]
    if n_keys == 0 or indices.size == 0:
        return
    pairs, starts = key_segments(indices, cupy_module().int32, n_keys)
    get_kernel(MODULE, "il_dk_segments", 0, cfg.defines)((n_keys,), (cfg.dim // 4,), (rows, pairs, starts, dk, comp))


def indexer_scores_at_backward(q, k, w, indices, dscores):
    """``(dq [N, H, D] q.dtype, dk [Nk, D] k.dtype, dw [N, H] w.dtype)``; dk bitwise reproducible."""
    cfg = config(q, k)
    if cfg is None:
        return gpu_fallback.indexer_scores_at_backward(q, k, w, indices, dscores)
    cp = cupy_module()
    n, heads, dim = q.shape
    kk = indices.shape[1]
    dq = cp.empty(q.shape, dtype=cp.float32 if q.dtype == cp.float32 else cp.uint16)
    dw = cp.empty((n, heads), dtype=cp.float32)
    dk, comp = cp.zeros(k.shape, dtype=cp.float32), cp.zeros(k.shape, dtype=cp.float32)
    if POISON_OUTPUTS:
        dq.fill(np.nan if dq.dtype == cp.float32 else 0xFFFF)
        dw.fill(np.nan)
    q_data, k_data = _data(cp, q), _data(cp, k)
    w32 = cp.ascontiguousarray(widen(w, cp.float32))
    g32 = cp.ascontiguousarray(widen(dscores, cp.float32))
    kernel = get_kernel(MODULE, "il_scores_at_backward", cfg.smem_backward, cfg.defines)
    chunks = list(query_chunks(n, kk, dim))
    rows = cp.empty(max((t1 - t0) for t0, t1 in chunks) * kk * dim if chunks else 0, dtype=cp.float32)
    for t0, t1 in chunks:
        part = slice(t0, t1)
        chunk_rows = rows[:(t1 - t0) * kk * dim]
        if POISON_OUTPUTS:
            chunk_rows.fill(np.nan)
        kernel((t1 - t0,), (cfg.threads,), (q_data[part], k_data, w32[part], indices[part], g32[part], dq[part],
                                            dw[part], chunk_rows, np.int32(heads), np.int32(kk)),
               shared_mem=cfg.smem_backward)
        if kk:
            add_rows_by_key(indices[part], chunk_rows, dk, comp, cfg)
    dk -= comp
    dq = dq if q.dtype == cp.float32 else dq.view(q.dtype)
    dk = dk if k.dtype == cp.float32 else narrow(dk, k.dtype)
    return dq, dk, (dw if w.dtype == cp.float32 else narrow(dw, w.dtype))


def _kl_operand(cp, x):
    """scores_at or probs as float32 or float64 (16-bit data widened to float32)."""
    return x if np.dtype(x.dtype) in _KL_TAGS else cp.ascontiguousarray(widen(x, cp.float32))


def indexer_kl_loss(scores_at, probs):
    """``(loss as a Python float, dscores float32 [N, kk])``: mean over all N rows."""
    if fallback_forced():
        return gpu_fallback.indexer_kl_loss(scores_at, probs)
    cp = cupy_module()
    s, p = _kl_operand(cp, scores_at), _kl_operand(cp, probs)
    n, kk = s.shape
    dscores = cp.empty((n, kk), dtype=cp.float32)
    if POISON_OUTPUTS:
        dscores.fill(np.nan)
    if n == 0 or kk == 0:  # no slot anywhere: loss 0, and dscores is empty
        return 0.0, dscores
    row_loss = cp.empty(n, dtype=cp.float64)
    name = f"il_kl_{_KL_TAGS[np.dtype(s.dtype)]}{_KL_TAGS[np.dtype(p.dtype)]}"
    get_kernel(KL_MODULE, name)((n,), (KL_THREADS,), (s, p, np.int32(kk), np.int32(n), dscores, row_loss))
    total = cp.empty(1, dtype=cp.float64)
    get_kernel(KL_MODULE, "il_sum")((1,), (SUM_THREADS,), (row_loss, np.int32(n), total))
    return float(total.get()[0]) / n, dscores
