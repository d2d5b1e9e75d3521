"""GPU backend of ``topk``: the radix-select kernels of ``cuda/topk.cu``.

Rows are cut into segments that one block each selects from (a persistent
grid walks the segments). A row longer than ``SEGMENT_BYTES`` (or one of
too few rows to fill the GPU) is cut into several segments: each segment is
small enough that its later passes re-read it from the L2 cache, and the
segments' top-k candidates, emitted in index order (so position order is
index order), form a shorter row that one more launch selects from.
Selections larger than the kernel's in-block sort (``SORT_CAP``) are ordered
afterwards by CuPy's sort.
"""
from __future__ import annotations

import numpy as np

from ..._backend import cupy_module
from ...gpu.module import get_kernel, multiprocessor_count
from . import gpu_sort
from .keys import key_spec, sortable_keys

SORT_CAP = 4096  # cuda/topk.cu: SORT_CAP (also its tie buffer)
THREADS = 512  # cuda/topk.cu: THREADS, two blocks per multiprocessor
BY_INDEX, BY_KEY, UNSORTED = 0, 1, 2
SEGMENT_BYTES = 128 << 10  # a resident block's segment stays in L2 between passes
MAX_CANDIDATES = 1 << 16  # the second stage's row length, at most
MAX_CAP = 1 << 16  # candidate-buffer entries per block, at most
POISON_OUTPUTS = False  # tests set this: outputs start as garbage, so unwritten slots show

_KERNELS = {16: "topk_select_u16", 32: "topk_select_u32", 64: "topk_select_u64"}


def _segments(n_rows: int, n: int, k: int, itemsize: int) -> int:
    """Segments per row: enough to keep segments in L2 and every SM busy."""
    min_len = 8 * k  # candidates shrink the row at least eightfold
    if n < 2 * min_len:
        return 1
    by_cache = -(-n * itemsize // SEGMENT_BYTES)
    by_sms = -(-2 * multiprocessor_count(cupy_module().cuda.Device().id) // n_rows)
    return int(max(1, min(max(by_cache, by_sms), n // min_len, MAX_CANDIDATES // k)))


def _select(cp, rows, k: int, largest: bool, sort_mode: int, segs: int):
    """One kernel launch: ``(indices int64 [R, C], value bits [R, C])``.

    With ``segs`` segments per row, C is the candidates' count (each
    segment's top-k, segment order); with one segment, C = k.
    """
    n_rows, n = rows.shape
    spec = key_spec(rows.dtype)
    bits = rows.view(spec.bits_dtype)
    seg_len = -(-n // segs)
    seg_len = -(-seg_len // 8) * 8  # every segment start stays 16-byte aligned
    segs = -(-n // seg_len)
    last = n - (segs - 1) * seg_len
    width = (segs - 1) * k + min(k, last)
    n_segments = n_rows * segs
    threads = THREADS if seg_len >= 4096 else THREADS // 2
    sms = multiprocessor_count(cp.cuda.Device().id)
    grid = min(n_segments, sms * (1024 // threads))
    cap = int(min(max(seg_len // 4, 256), seg_len, MAX_CAP))
    buf_key = cp.empty(grid * 2 * cap, dtype=spec.bits_dtype)
    buf_idx = cp.empty(grid * 2 * cap, dtype=cp.uint32)
    out_key = cp.empty(grid * k, dtype=spec.bits_dtype)
    out_idx = cp.empty(grid * k, dtype=cp.uint32)
    final_idx = cp.empty((n_rows, width), dtype=cp.int64)
    final_val = cp.empty((n_rows, width), dtype=spec.bits_dtype)
    if POISON_OUTPUTS:
        final_idx.fill(-7)
        final_val.fill(0x5A)
    smem = SORT_CAP * (spec.bits_dtype.itemsize + 4)
    kernel = get_kernel("topk", _KERNELS[spec.width], smem, (f"HS_TOPK_WIDTH={spec.width}",))
    kernel(
        (grid,), (threads,),
        (bits, np.int64(n), np.int64(seg_len), np.int32(segs), np.int32(n_segments), np.int32(k),
         np.uint64(spec.all_ones), np.uint64(spec.sign), np.uint64(spec.exp_mask), np.uint64(spec.mant_mask),
         np.int32(spec.is_float), np.int32(not largest), buf_key, buf_idx, np.int32(cap), out_key, out_idx,
         np.int32(sort_mode), final_idx, final_val, np.int64(width)),
        shared_mem=smem,
    )
    return final_idx, final_val.view(rows.dtype)


def _order_large(cp, indices, values, largest: bool, sort_output: bool):
    """Order a selection the kernel left unsorted (k > SORT_CAP)."""
    by_index = cp.argsort(indices, axis=1)
    indices = cp.take_along_axis(indices, by_index, axis=1)
    values = cp.take_along_axis(values, by_index, axis=1)
    if not sort_output:
        return values, indices
    keys = sortable_keys(values, largest, xp=cp)
    order = gpu_sort.order_by_keys(cp, keys, key_spec(values.dtype).width)
    return cp.take_along_axis(values, order, axis=1), cp.take_along_axis(indices, order, axis=1)


def topk_rows(rows, k: int, largest: bool, sort_output: bool):
    """Top-k of each row of a C-contiguous 2-D CuPy array (see ``hyscale_core.topk``)."""
    cp = cupy_module()
    n_rows, n = rows.shape
    if k == 0 or n_rows == 0:
        return cp.empty((n_rows, k), dtype=rows.dtype), cp.empty((n_rows, k), dtype=cp.int64)
    if k == n:
        if sort_output:
            return gpu_sort.topk_rows(cp, rows, k, largest, sort_output)
        indices = cp.ascontiguousarray(cp.broadcast_to(cp.arange(n, dtype=cp.int64), (n_rows, n)))
        return rows.copy(), indices
    if k > SORT_CAP:
        indices, values = _select(cp, rows, k, largest, UNSORTED, 1)
        return _order_large(cp, indices, values, largest, sort_output)
    sort_mode = BY_KEY if sort_output else BY_INDEX
    segs = _segments(n_rows, n, k, rows.dtype.itemsize)
    if segs == 1:
        indices, values = _select(cp, rows, k, largest, sort_mode, 1)
        return values, indices
    cand_idx, cand_val = _select(cp, rows, k, largest, BY_INDEX, segs)
    positions, values = _select(cp, cand_val, k, largest, sort_mode, 1)
    return values, cp.take_along_axis(cand_idx, positions, axis=1)
