"""Sparse attention in MLA's MQA layout (FlashMLA's): forward and backward.

For query t, head j and selected slot i with key s = indices[t, i] >= 0:

    logit[t, j, i] = scale * dot(q[t, j, :], kv[s, :])        (all d_qk columns)
    p[t, j, :]     = softmax of the logits over the row's valid slots
    out[t, j, :]   = sum_i p[t, j, i] * kv[s, :d_v]            (values: kv[:, :d_v])
    lse[t, j]      = log(sum_i exp(logit[t, j, i]))             (natural log)
    probs[t, i]    = sum_j p[t, j, i]                           (0 at -1 slots)

Slots holding -1 are skipped; a duplicated key is a separate slot with its
own probability. A row without valid slots gives out 0, lse -inf, probs 0
and zero gradients (no NaN).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..._backend import CPU, as_arrays, xp_for
from ..._checks import (check_dtype, check_index_table, check_int, check_ndim, check_same, check_scale, check_shape,
                        check_slot_count, float_view)
from ..._docs import with_note
from ..._dtypes import FLOAT_DTYPES, INDEX_DTYPES, compute_dtype

_PRECISION = """
    Precision: q and kv may be float16, bfloat16 (ml_dtypes), float32 or
    float64, independently. They are upcast to float64 when both are
    float64 and to float32 otherwise; every product and sum runs in that
    dtype (float32 accumulation for 16- and 32-bit inputs, blocked and
    compensated) in a fixed order, and results are rounded once to their
    output dtype (one exception: see the backward's ``precise_dkv``). lse
    (and probs) are float32 whatever the inputs.
"""


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _prepare(d_v: Any, scale: Any, check_indices: bool = True,
             **named: Any) -> tuple[str, dict[str, Any], int, float]:
    """Validate q, kv, indices, d_v and scale (plus whatever else ``named`` holds,
    imported only; the index range only with ``check_indices``); return
    ``(backend, arrays, d_v, scale)``."""
    backend, arrays = as_arrays(**named)
    q, kv, indices = arrays["q"], arrays["kv"], arrays["indices"]
    check_ndim(q, 3, "q", "[N, h, d_qk]")
    check_ndim(kv, 2, "kv", "[N_kv, d_qk]")
    check_ndim(indices, 2, "indices", "[N, k]")
    check_slot_count(indices, "indices")
    check_dtype(q, FLOAT_DTYPES, "q")
    check_dtype(kv, FLOAT_DTYPES, "kv")
    check_dtype(indices, INDEX_DTYPES, "indices")
    check_same("q", q.shape[2], "kv", kv.shape[1], "head dim d_qk")
    check_same("q", q.shape[0], "indices", indices.shape[0], "query count N")
    if q.shape[1] < 1 or q.shape[2] < 1:
        raise ValueError(f"q needs at least one head and one feature, got shape {tuple(q.shape)}")
    d_v = check_int(d_v, "d_v", 1, q.shape[2])
    scale = check_scale(scale, 1.0 / math.sqrt(q.shape[2]), taken_as=compute_dtype(q, kv))
    if check_indices:
        check_index_table(indices, kv.shape[0], "indices", xp_for(backend))
    return backend, arrays, d_v, scale


def _check_saved(arrays: dict[str, Any], d_v: int, xp: Any) -> None:
    """out, lse and dout match q and indices; the index range (its error first);
    lse is finite on rows that select a key. On the GPU (the arrays made
    C-contiguous by the caller), for float32 lse, both come from one kernel and
    one transfer."""
    n, n_h = arrays["q"].shape[:2]
    for name in ("out", "dout"):
        check_ndim(arrays[name], 3, name, "[N, h, d_v]")
        check_dtype(arrays[name], FLOAT_DTYPES, name)
        check_shape(arrays[name], (n, n_h, d_v), name, "[N, h, d_v]")
    lse = arrays["lse"]
    check_ndim(lse, 2, "lse", "[N, h]")
    check_dtype(lse, FLOAT_DTYPES, "lse")
    check_shape(lse, (n, n_h), "lse", "[N, h]")
    indices, n_keys = arrays["indices"], arrays["kv"].shape[0]
    flags = None
    if xp is not np and lse.size:
        from ...gpu.checks import table_flags

        flags = table_flags(indices, n_keys, lse)
    if flags is None or flags[0]:
        check_index_table(indices, n_keys, "indices", xp)  # raises where an entry is out of range
    if lse.size == 0 or (flags is not None and not flags[1]):
        return
    lse = float_view(lse, xp)
    has_key = indices.max(axis=1) >= 0 if indices.shape[1] else xp.zeros(n, dtype=bool)  # entries are >= -1 now
    bad = ~xp.isfinite(lse) & has_key[:, None]
    if bool(bad.any()):
        t, j = (int(i) for i in xp.argwhere(bad)[0])
        raise ValueError(f"lse must be finite on rows with a valid slot, got lse[{t}, {j}] = {float(lse[t, j])} "
                         f"(indices row {t} selects a key)")


def _impl(backend: str):
    if backend == CPU:
        from . import cpu

        return cpu
    from . import gpu

    return gpu


@with_note(_PRECISION)
def sparse_attention(q: Any, kv: Any, indices: Any, *, d_v: int = 512, scale: float | None = None,
                     return_probs: bool = False) -> tuple[Any, ...]:
    """Attention of each query over its selected keys only.

    Parameters
    ----------
    q : array [N, h, d_qk]     queries (d_qk = 576 = 512 + 64 rope in MLA).
    kv : array [N_kv, d_qk]    the shared latent keys; values are kv[:, :d_v].
    indices : int32 [N, k]     selected keys per query, -1 = skip; entries
                               must be -1 or in [0, N_kv) (checked first).
    d_v : int                  value width, 1 <= d_v <= d_qk (default 512).
    scale : float or None      logit scale, finite and > 0 (also once rounded to
                               the dtype the call runs in); default 1/sqrt(d_qk).
    return_probs : bool        also return ``probs``.

    Returns
    -------
    out : [N, h, d_v], q's dtype
    lse : float32 [N, h]       natural-log sum of exp(logit); -inf on empty rows.
    probs : float32 [N, k]     (with ``return_probs``) attention probability at
                               each slot summed over heads: the target of
                               :func:`indexer_kl_loss`, made in the same pass.
    """
    backend, arrays, d_v, scale = _prepare(d_v, scale, q=q, kv=kv, indices=indices)
    return_probs = _bool(return_probs, "return_probs")
    xp = xp_for(backend)
    q, kv, indices = (xp.ascontiguousarray(arrays[n]) for n in ("q", "kv", "indices"))
    out, lse, probs = _impl(backend).sparse_attention(q, kv, indices, d_v, scale, want_probs=return_probs)
    return (out, lse, probs) if return_probs else (out, lse)


@with_note(_PRECISION)
def sparse_attention_backward(q: Any, kv: Any, indices: Any, out: Any, lse: Any, dout: Any, *,
                              d_v: int = 512, scale: float | None = None,
                              precise_dkv: bool = False) -> tuple[Any, Any]:
    """Gradients of ``sum(out * dout)`` with respect to q and kv.

    Parameters
    ----------
    q, kv, indices, d_v, scale : as given to :func:`sparse_attention`.
    out : [N, h, d_v]          the forward output.
    lse : [N, h]               the forward lse (finite on every row with a
                               valid slot); p is recomputed as exp(logit - lse).
    dout : [N, h, d_v]         gradient of the loss with respect to out.
    precise_dkv : bool         keep every (query, slot) contribution to dkv in
                               float32 until the per-key sum. By default the
                               GPU kernels round each contribution once to
                               bfloat16 when q and kv are bfloat16 (relative
                               error at most 2^-8 per contribution, as a plain
                               bfloat16 computation has; half the memory
                               traffic of the per-key sums, about 1.4x faster
                               backward at h = 64). Other inputs and the CPU
                               backend always keep float32 or better.

    Returns
    -------
    dq : [N, h, d_qk], q's dtype     scale * sum_i dlogit * kv[s]
    dkv : [N_kv, d_qk], kv's dtype   sum over the (query, slot) pairs that
                                     selected each key of scale * dlogit * q,
                                     plus p * dout on the first d_v columns.

    with D = rowsum(dout * out), dlogit = p * (dout . kv[s, :d_v] - D).

    Determinism: dkv is summed per key in ascending (query, slot, head)
    order from a key-major transpose of ``indices``, never with atomics, so
    the result is bitwise identical run to run and for any thread count.

    lse is used in the compute dtype: with float64 inputs and the float32
    lse of the forward, gradients are accurate to about 1e-7 relative; a
    float64 lse gives float64 accuracy.

    Memory (GPU kernels): the queries go in chunks whose dkv contributions
    take a quarter of the free device memory, between 1 and 16 GiB; the
    scratch is about 1.25x that. CuPy's memory pool keeps it for the next
    call; ``cupy.get_default_memory_pool().free_all_blocks()`` gives it back.
    """
    backend, arrays, d_v, scale = _prepare(d_v, scale, check_indices=False, q=q, kv=kv, indices=indices, out=out,
                                           lse=lse, dout=dout)
    xp = xp_for(backend)
    arrays = {name: xp.ascontiguousarray(a) for name, a in arrays.items()}
    _check_saved(arrays, d_v, xp)
    q, kv, indices, out, lse, dout = (arrays[n] for n in ("q", "kv", "indices", "out", "lse", "dout"))
    return _impl(backend).sparse_attention_backward(q, kv, indices, out, lse, dout, d_v, scale,
                                                    precise_dkv=_bool(precise_dkv, "precise_dkv"))
