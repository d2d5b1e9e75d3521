"""DSA lightning-indexer scores and their exact streaming top-k.

    I[t, s] = sum_h w[t, h] * relu(dot(q[t, h, :], k[s, :]))

for the keys ``s`` query ``t`` may see (causal, ``q_pos``, ``cu_seqlens``;
see ranges.py), ``-inf`` elsewhere.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..._backend import CPU, as_arrays, xp_for
from ..._checks import check_dtype, check_finite, check_int, check_ndim, check_same
from ..._docs import with_note
from ..._dtypes import FLOAT_DTYPES, INDEXER_DTYPES
from .ranges import candidate_ranges

# A guard against garbage, far above any DSA configuration (k = 2048).
MAX_TOPK = 1 << 20

_PRECISION = """
    Precision: q, k and w are read in their own dtype (float16, bfloat16,
    float32; float64 is rounded to float32) and every product and sum runs in
    float32 with float32 accumulation; relu(NaN) = 0. The CPU backend uses
    NumPy's BLAS for the dot products. The GPU backend uses tensor cores:
    bfloat16 and float16 inputs as they are, float32 and float64 inputs
    rounded to bfloat16 first, products accumulated in float32.
"""


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _prepare(q, k, w, causal, q_pos, cu_seqlens):
    backend, arrays = as_arrays(q=q, k=k, w=w)
    q, k, w = arrays["q"], arrays["k"], arrays["w"]
    check_ndim(q, 3, "q", "[Nq, H, D]")
    check_ndim(k, 2, "k", "[Nk, D]")
    check_ndim(w, 2, "w", "[Nq, H]")
    check_dtype(q, INDEXER_DTYPES, "q")
    check_dtype(k, INDEXER_DTYPES, "k")
    check_dtype(w, FLOAT_DTYPES, "w")
    check_same("q", q.shape[2], "k", k.shape[1], "head dim D")
    check_same("q", q.shape[0], "w", w.shape[0], "query count Nq")
    check_same("q", q.shape[1], "w", w.shape[1], "head count H")
    for name, size in (("H", q.shape[1]), ("D", q.shape[2]), ("Nk", k.shape[0])):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got shapes q {tuple(q.shape)}, k {tuple(k.shape)}")
    causal = _bool(causal, "causal")
    check_finite(w, "w", xp_for(backend), taken_as=np.float32)
    lo, hi = candidate_ranges(q.shape[0], k.shape[0], causal, q_pos, cu_seqlens)
    return backend, q, k, w, lo, hi


def _impl(backend: str):
    if backend == CPU:
        from . import cpu

        return cpu
    from . import gpu

    return gpu


@with_note(_PRECISION)
def indexer_scores(q: Any, k: Any, w: Any, *, causal: bool = True, q_pos: Any = None,
                   cu_seqlens: Any = None) -> Any:
    """The full indexer score table, float32 [Nq, Nk] (masked entries -inf).

    Parameters
    ----------
    q : array [Nq, H, D]      indexer queries.
    k : array [Nk, D]         indexer keys (shared by all heads).
    w : array [Nq, H]         per-query head weights; must be finite (in float32).
    causal : bool             a query sees keys at positions <= its own.
    q_pos : int array [Nq]    each query's position in the key axis; default
                              the last Nq positions (Nq == Nk: self-attention).
    cu_seqlens : int array [B+1]  packed sequences in the key axis (starts at
                              0, ends at Nk, non-decreasing); a query sees only
                              keys of the sequence holding its position.

    Materialises Nq * Nk floats: use :func:`indexer_topk` for selection.
    """
    backend, q, k, w, lo, hi = _prepare(q, k, w, causal, q_pos, cu_seqlens)
    return _impl(backend).indexer_scores(q, k, w, lo, hi)


@with_note(_PRECISION)
def indexer_topk(q: Any, k: Any, w: Any, topk: int, *, causal: bool = True, q_pos: Any = None,
                 cu_seqlens: Any = None, return_scores: bool = False) -> Any:
    """Each query's exact top-``topk`` keys, without materialising the scores.

    Arguments as :func:`indexer_scores`, plus ``topk`` (0 <= topk <= 2**20)
    and ``return_scores``.

    Returns int32 [Nq, topk]: key indices best first (score descending,
    equal scores lower index first, NaN above +inf); a row with fewer than
    ``topk`` candidates ends in -1. With ``return_scores=True`` returns
    ``(indices, scores)``, scores float32 [Nq, topk] with -inf at -1 slots.

    Contract: the indices are bitwise identical to
    ``topk(indexer_scores(...), topk)[1]`` with -1 where the value is -inf.
    Memory: O(Nq * topk) plus one tile of scores per worker; on the GPU a
    topk past the fused kernel's sort (32 * D picks) selects from blocks of
    the score table instead, up to 1 GiB of it at a time.
    Time on the GPU: each long row's threshold is guessed from its first
    keys; rows whose early keys score far above their later ones fail the
    guess and are selected again from their scores (exact, about twice the
    time for those rows; see ``hyscale_core.ops.indexer.gpu``).
    """
    backend, q, k, w, lo, hi = _prepare(q, k, w, causal, q_pos, cu_seqlens)
    topk = check_int(topk, "topk", 0, MAX_TOPK)
    return_scores = _bool(return_scores, "return_scores")
    indices, scores = _impl(backend).indexer_topk(q, k, w, topk, lo, hi, return_scores)
    return (indices, scores) if return_scores else indices
