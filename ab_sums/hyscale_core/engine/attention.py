"""The DSA block's sparse attention and indexer-loss Functions (wrapping the
hs ops, so both backends serve them)."""
from __future__ import annotations

import hyscale_core as hs

from .._backend import array_module
from .tensor import Function


class SparseAttention(Function):
    """out [N, h, d_v] of q [N, h, d_qk] over kv [N_kv, d_qk] at the constant
    int32 ``indices`` [N, k]. ``aux['probs']`` [N, k] is the head-summed
    attention at each selected key (the indexer loss's target); backward
    uses the saved lse, not probabilities."""

    def forward(self, q, kv, indices, d_v: int = 512, scale: float | None = None):
        out, lse, probs = hs.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, return_probs=True)
        self.save(q, kv, indices, out, lse, d_v, scale)
        return out, {"probs": probs, "lse": lse}

    def backward(self, g):
        q, kv, indices, out, lse, d_v, scale = self.saved
        dq, dkv = hs.sparse_attention_backward(q, kv, indices, out, lse, g, d_v=d_v, scale=scale)
        return (dq if self.needs_input_grad[0] else None, dkv if self.needs_input_grad[1] else None, None)


class IndexerScoresAt(Function):
    """Indexer scores [N, k] of q [N, H, D], k [N_k, D], w [N, H] at the
    constant ``indices`` [N, k] (-inf at -1 slots)."""

    def forward(self, q, k, w, indices):
        self.save(q, k, w, indices)
        return hs.indexer_scores_at(q, k, w, indices)

    def backward(self, g):
        q, k, w, indices = self.saved
        dq, dk, dw = hs.indexer_scores_at_backward(q, k, w, indices, g)
        return dq, dk, dw, None


class IndexerKL(Function):
    """Sparse-stage indexer loss: mean KL(probs normalised || softmax(scores_at)).
    ``probs`` is a constant (the attention's detached target)."""

    def forward(self, scores_at, probs):
        loss, dscores = hs.indexer_kl_loss(scores_at, probs)
        self.save(dscores)
        return array_module(scores_at).asarray(loss, dtype=scores_at.dtype)

    def backward(self, g):
        (dscores,) = self.saved
        return dscores * g, None
