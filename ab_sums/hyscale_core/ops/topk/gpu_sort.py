"""Sort-based exact top-k on the GPU, built from CuPy's own sort.

Each key is packed with its position into one uint64 whose ascending order
is the selection order (key descending, index ascending), so one segmented
sort per row gives the exact order with the tie rule. 64-bit keys take two
passes (low half, then high half ordered by rank in the first pass). This is
the path for very large k, where a select saves nothing.
"""
from __future__ import annotations

from .keys import key_spec, sortable_keys

_LOW32 = 0xFFFFFFFF


def _sorted_tails(cp, high, tail):
    """``tail`` values of ``(high << 32) | tail`` after sorting each row."""
    packed = (high << cp.uint64(32)) | tail
    packed.sort(axis=-1)
    return packed & cp.uint64(_LOW32)


def order_by_keys(cp, keys, width: int):
    """Selection order of every row of uint64 ``keys``: int64 [R, n], best first."""
    n_rows, n = keys.shape
    inverted = ~keys
    position = cp.broadcast_to(cp.arange(n, dtype=cp.uint64), (n_rows, n))
    low = inverted & cp.uint64(_LOW32)
    if width <= 32:
        return _sorted_tails(cp, low, position).astype(cp.int64)
    by_low = _sorted_tails(cp, low, position).astype(cp.int64)
    rank = cp.empty((n_rows, n), dtype=cp.uint64)
    rank[cp.arange(n_rows)[:, None], by_low] = position
    by_rank = _sorted_tails(cp, inverted >> cp.uint64(32), rank).astype(cp.int64)
    return cp.take_along_axis(by_low, by_rank, axis=1)


def topk_rows(cp, rows, k: int, largest: bool, sort_output: bool):
    """Exact top-k of each row of a C-contiguous CuPy array."""
    keys = sortable_keys(rows, largest, xp=cp)
    indices = order_by_keys(cp, keys, key_spec(rows.dtype).width)[:, :k]
    if not sort_output:
        indices = cp.sort(indices, axis=-1)
    indices = cp.ascontiguousarray(indices)
    return cp.take_along_axis(rows, indices, axis=1), indices
