"""The indexer's sparse-stage training loss: scores at the selected keys, KL.

For query t and selected slot i with key s = indices[t, i] >= 0:

    I[t, i]     = sum_h w[t, h] * relu(dot(q[t, h, :], k[s, :]))     (-inf at -1 slots)
    target[t]   = probs[t] / sum of probs[t] over the valid slots
    loss        = (1/N) sum_t KL(target[t] || softmax(I[t]))

relu(NaN) = 0 on every backend, as in :func:`indexer_scores` (a NaN logit
adds nothing to the score and passes no gradient).
``I`` is :func:`indexer_scores` restricted to the selected keys; ``probs``
is the main attention's probability per slot summed over heads, as
:func:`sparse_attention` returns with ``return_probs=True``. No gradient
flows through the selection itself.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..._backend import CPU, as_arrays, xp_for
from ..._checks import (check_dtype, check_finite, check_index_table, check_ndim, check_same, check_shape,
                        check_slot_count, float_view)
from ..._docs import with_note
from ..._dtypes import FLOAT_DTYPES, INDEX_DTYPES, INDEXER_DTYPES, compute_dtype

_PRECISION = """
    Precision: inputs may be float16, bfloat16 (ml_dtypes), float32 or
    float64. The computation runs in float64 when its main inputs are all
    float64 (q and k; scores_at and probs) and in float32 with float32
    accumulation otherwise, in a fixed order; results are rounded once to
    their output dtype.
"""


def _impl(backend: str):
    if backend == CPU:
        from . import cpu

        return cpu
    from . import gpu

    return gpu


def _prepare(**named: Any) -> tuple[str, Any, dict[str, Any]]:
    """Validate q, k, w and indices; return ``(backend, xp, contiguous arrays)``."""
    backend, arrays = as_arrays(**named)
    q, k, w, indices = arrays["q"], arrays["k"], arrays["w"], arrays["indices"]
    check_ndim(q, 3, "q", "[N, H, D]")
    check_ndim(k, 2, "k", "[Nk, D]")
    check_ndim(w, 2, "w", "[N, H]")
    check_ndim(indices, 2, "indices", "[N, kk]")
    check_slot_count(indices, "indices")
    check_dtype(q, INDEXER_DTYPES, "q")
    check_dtype(k, INDEXER_DTYPES, "k")
    check_dtype(w, FLOAT_DTYPES, "w")
    check_dtype(indices, INDEX_DTYPES, "indices")
    check_same("q", q.shape[2], "k", k.shape[1], "head dim D")
    check_same("q", q.shape[0], "w", w.shape[0], "query count N")
    check_same("q", q.shape[1], "w", w.shape[1], "head count H")
    check_same("q", q.shape[0], "indices", indices.shape[0], "query count N")
    if q.shape[1] < 1 or q.shape[2] < 1:
        raise ValueError(f"q needs at least one head and one feature, got shape {tuple(q.shape)}")
    xp = xp_for(backend)
    check_finite(w, "w", xp, taken_as=compute_dtype(q, k))
    check_index_table(indices, k.shape[0], "indices", xp)
    return backend, xp, {name: xp.ascontiguousarray(a) for name, a in arrays.items()}


@with_note(_PRECISION)
def indexer_scores_at(q: Any, k: Any, w: Any, indices: Any) -> Any:
    """Indexer scores at the selected keys only, float32 [N, kk] (-inf at -1 slots).

    Parameters
    ----------
    q : array [N, H, D]        indexer queries.
    k : array [Nk, D]          indexer keys (shared by all heads).
    w : array [N, H]           per-query head weights; must be finite (in the
                               dtype the call runs in, see Precision).
    indices : int32 [N, kk]    the selection, -1 = skip; entries must be -1
                               or in [0, Nk) (checked first).
    """
    backend, _, a = _prepare(q=q, k=k, w=w, indices=indices)
    return _impl(backend).indexer_scores_at(a["q"], a["k"], a["w"], a["indices"])


@with_note(_PRECISION)
def indexer_scores_at_backward(q: Any, k: Any, w: Any, indices: Any, dscores: Any) -> tuple[Any, Any, Any]:
    """Gradients of ``sum(I * dscores)`` over the valid slots (dscores at -1 slots does not
    enter them, but is checked finite like the rest).

    Parameters
    ----------
    q, k, w, indices : as given to :func:`indexer_scores_at`.
    dscores : array [N, kk]    finite (as w); e.g. the second result of :func:`indexer_kl_loss`.

    Returns
    -------
    dq : [N, H, D], q's dtype      sum_i dscores * w * relu'(x) * k[s]
    dk : [Nk, D], k's dtype        sum over the pairs that selected each key
                                   of dscores * w * relu'(x) * q[t, h]
    dw : [N, H], w's dtype         sum_i dscores * relu(x)

    with x = dot(q[t, h], k[s]) and relu'(x) = 1 for x > 0, else 0.
    Determinism: dk is summed per key in ascending (query, slot, head) order
    from a key-major transpose of ``indices``, never with atomics, so it is
    bitwise identical run to run and for any thread count.
    """
    backend, xp, a = _prepare(q=q, k=k, w=w, indices=indices, dscores=dscores)
    g = a["dscores"]
    check_ndim(g, 2, "dscores", "[N, kk]")
    check_dtype(g, FLOAT_DTYPES, "dscores")
    check_shape(g, a["indices"].shape, "dscores", "[N, kk]")
    check_finite(g, "dscores", xp, taken_as=compute_dtype(a["q"], a["k"]))
    return _impl(backend).indexer_scores_at_backward(a["q"], a["k"], a["w"], a["indices"], g)


def _check_loss_inputs(scores_at: Any, probs: Any, xp: Any) -> None:
    check_ndim(scores_at, 2, "scores_at", "[N, kk]")
    check_ndim(probs, 2, "probs", "[N, kk]")
    check_dtype(scores_at, FLOAT_DTYPES, "scores_at")
    check_dtype(probs, FLOAT_DTYPES, "probs")
    check_same("scores_at", scores_at.shape[0], "probs", probs.shape[0], "query count N")
    check_same("scores_at", scores_at.shape[1], "probs", probs.shape[1], "slot count kk")
    scores_f, probs_f = float_view(scores_at, xp), float_view(probs, xp)
    taken_as = compute_dtype(scores_at, probs)
    if scores_at.size:
        with np.errstate(over="ignore"):  # a float64 score past float32's range: the overflow is looked for
            rounded = scores_f.astype(taken_as, copy=False)
        bad = xp.isnan(rounded) | xp.isposinf(rounded) | (xp.isneginf(rounded) & ~xp.isneginf(scores_f))
        if bool(bad.any()):
            t, i = (int(j) for j in xp.argwhere(bad)[0])
            value = float(scores_f[t, i])
            beyond = f" in {taken_as.name}, the precision it is taken in" if np.isfinite(value) else ""
            raise ValueError(f"scores_at must be finite or -inf (skipped slot){beyond}, got scores_at[{t}, {i}] = "
                             f"{value}")
    check_finite(probs, "probs", xp, taken_as=taken_as)
    if probs.size and bool((probs_f < 0).any()):
        t, i = (int(j) for j in xp.argwhere(probs_f < 0)[0])
        raise ValueError(f"probs must be >= 0, got probs[{t}, {i}] = {float(probs_f[t, i])}")


@with_note(_PRECISION)
def indexer_kl_loss(scores_at: Any, probs: Any) -> tuple[Any, Any]:
    """KL loss of the indexer against the attention's probabilities, and its gradient.

    Parameters
    ----------
    scores_at : array [N, kk]  indexer scores at the selected keys
                               (:func:`indexer_scores_at`): finite at valid
                               slots, -inf at skipped ones.
    probs : array [N, kk]      attention probability per slot summed over
                               heads; finite and >= 0 everywhere, though values
                               at -inf slots do not enter the loss.

    Returns
    -------
    loss : float               (1/N) sum_t KL(target[t] || softmax(scores_at[t])),
                               target[t] = probs[t] / (its sum over valid slots),
                               0 * log 0 = 0. A Python float on the CPU backend
                               (a 0-d device array is allowed on the GPU one).
    dscores : float32 [N, kk]  d loss / d scores_at = (softmax - target) / N at
                               valid slots, 0 at -inf slots.

    Convention: a row with no valid slot or with zero target mass contributes
    loss 0 and gradient 0 but still counts in the mean (divides by N, all
    rows), so the loss of a batch is the plain average of its rows.
    """
    backend, arrays = as_arrays(scores_at=scores_at, probs=probs)
    xp = xp_for(backend)
    scores_at, probs = xp.ascontiguousarray(arrays["scores_at"]), xp.ascontiguousarray(arrays["probs"])
    _check_loss_inputs(scores_at, probs, xp)
    return _impl(backend).indexer_kl_loss(scores_at, probs)
