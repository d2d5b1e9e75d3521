"""Sharded selection and sparse attention: every argument holds this rank's
rows (one per ``shard.positions`` entry); every function is a collective
call (all ranks call it, in the same order).

Exactness:

- :func:`sharded_indexer_topk` all-gathers the indexer keys (small: d_I
  values per token) and runs ``hs.indexer_topk`` on the local queries with
  ``q_pos = shard.positions``. Each query sees the same keys, masks and
  key tiles as in one process, so the selection is bitwise identical to
  rows ``positions`` of the single-process ``hs.indexer_topk``. On the CPU
  backend this needs whole query blocks per rank (layouts made with
  ``align=QUERY_ALIGN``, the :func:`make_shard` default), because BLAS
  results depend on the block's shape.
- :func:`sharded_sparse_attention` gives each query its selected kv rows in
  the same slot order, so on the CPU backend (every query row computed on
  its own) out, lse, probs and dq are bitwise one process's; the GPU
  backend's batched products may round differently per batch.
- dkv: each rank's contribution is ``hs.sparse_attention_backward``'s
  deterministic per-key sum over its own queries; the owner adds the P
  contributions in float64 in rank order and rounds once. Deterministic,
  identical for both exchanges; against one process (one compensated sum
  over all queries) it differs by the rounding of the P partial sums
  (tests: max |difference| <= (P + 1) * 2e-7 * max |dkv| in float32).
"""
from __future__ import annotations

import math
from typing import Any

import hyscale_core as hs

from .._backend import as_arrays
from .._checks import check_index_table, check_ndim
from .exchange import AllGather, plan_rows
from .shard import Shard


def sharded_indexer_topk(shard: Shard, q: Any, k: Any, w: Any, topk: int, *, causal: bool = True,
                         return_scores: bool = False) -> Any:
    """This rank's queries' exact top-``topk`` keys over the whole sequence.

    q : [n_local, H, D], k : [n_local, D], w : [n_local, H]: the indexer
    queries, keys and head weights of this rank's positions (dtypes as
    ``hs.indexer_topk``). Returns int32 [n_local, topk] global key positions
    (-1 padding), with ``return_scores`` also float32 scores [n_local, topk].
    Packed sequences come from ``shard.cu_seqlens``.
    """
    _, arrays = as_arrays(q=q, k=k, w=w)
    for name in ("q", "k", "w"):
        shard.check_rows(name, arrays[name])
    k_all = AllGather(shard, global_order=True).gather(arrays["k"])
    return hs.indexer_topk(arrays["q"], k_all, arrays["w"], topk, causal=causal, q_pos=shard.positions,
                           cu_seqlens=shard.cu_seqlens, return_scores=return_scores)


def _attention_args(shard: Shard, q: Any, kv: Any, indices: Any) -> tuple[Any, Any, Any, int]:
    """Checked local arrays and the kv row size in bytes."""
    _, arrays = as_arrays(q=q, kv=kv, indices=indices)
    q, kv, indices = arrays["q"], arrays["kv"], arrays["indices"]
    check_ndim(kv, 2, "kv", "[n_local, d_qk]")
    check_ndim(indices, 2, "indices", "[n_local, k]")
    for name, array in (("q", q), ("kv", kv), ("indices", indices)):
        shard.check_rows(name, array)
    if indices.dtype != "int32":
        raise TypeError(f"indices has dtype {indices.dtype}, expected int32")
    check_index_table(indices, shard.n, "indices", shard.xp)
    return q, kv, indices, kv.dtype.itemsize * math.prod(kv.shape[1:])


def sharded_sparse_attention(shard: Shard, q: Any, kv: Any, indices: Any, *, d_v: int = 512,
                             scale: float | None = None, return_probs: bool = False,
                             exchange: str = "auto") -> tuple[Any, ...]:
    """``hs.sparse_attention`` of this rank's queries over the sharded kv.

    q : [n_local, h, d_qk]; kv : [n_local, d_qk] (this rank's latent rows);
    indices : int32 [n_local, k] global key positions, -1 = skip (e.g. from
    :func:`sharded_indexer_topk`). exchange : "auto", "allgather" or "fetch"
    (``costmodel.py``). Returns out [n_local, h, d_v], lse float32
    [n_local, h] (and probs float32 [n_local, k]) as ``hs.sparse_attention``.
    """
    q, kv, indices, row_bytes = _attention_args(shard, q, kv, indices)
    plan = plan_rows(shard, indices, row_bytes, exchange)
    return hs.sparse_attention(q, plan.gather(kv), plan.remap(indices), d_v=d_v, scale=scale,
                               return_probs=return_probs)


def sharded_sparse_attention_backward(shard: Shard, q: Any, kv: Any, indices: Any, out: Any, lse: Any,
                                      dout: Any, *, d_v: int = 512, scale: float | None = None,
                                      exchange: str = "auto") -> tuple[Any, Any]:
    """Gradients of the sum over all ranks of ``sum(out * dout)``.

    Arguments as :func:`sharded_sparse_attention` plus this rank's out,
    lse and dout (as ``hs.sparse_attention_backward``). Fetches the kv rows
    again. Returns dq [n_local, h, d_qk] and dkv [n_local, d_qk]: the
    gradient of this rank's kv rows summed over every rank's queries.
    """
    q, kv, indices, row_bytes = _attention_args(shard, q, kv, indices)
    plan = plan_rows(shard, indices, row_bytes, exchange)
    dq, dtable = hs.sparse_attention_backward(q, plan.gather(kv), plan.remap(indices), out, lse, dout,
                                              d_v=d_v, scale=scale)
    return dq, plan.to_owners(dtable)
