"""A DSA block (MLA-style sparse attention with a lightning indexer) and a
small language model built from the engine's Functions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._backend import to_host
from . import ops
from .attention import IndexerKL, IndexerScoresAt, SparseAttention
from .checkpoint import checkpoint
from .checks import check_batch, check_config, check_selection
from .tensor import Tensor


@dataclass(frozen=True)
class DSAConfig:
    """Sizes of a DSA model. d_qk = d_v + rope_dim (MLA's latent + rope part).

    attention_dtype: the dtype of the sparse attention's q, kv and out
    ("bfloat16" runs the GPU tensor-core kernels); the rest stays float32.
    Checked when made (:func:`checks.check_config`): int sizes >= 1, topk in
    [1, 2**20], rope_dim even and >= 0, kl_weight finite and >= 0.
    """

    vocab: int = 64
    d_model: int = 64
    n_layers: int = 2
    heads: int = 4
    d_v: int = 32
    rope_dim: int = 16
    d_ff: int = 128
    index_heads: int = 4
    index_dim: int = 16
    topk: int = 16
    kl_weight: float = 1.0
    attention_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def d_qk(self) -> int:
        return self.d_v + self.rope_dim


def _param(xp, rng, shape, scale, name):
    return Tensor(xp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)), requires_grad=True, name=name)


class DSABlock:
    """Pre-norm block: x + Wo * SparseAttention(x) then x + SwiGLU(x).

    The indexer reads the normalised input detached from the model (DSA's
    sparse stage): its only gradient is the KL loss against the attention's
    head-summed probabilities at the selected keys.
    """

    def __init__(self, cfg: DSAConfig, name: str, rng: np.random.Generator, xp=np) -> None:
        self.cfg, self.name = cfg, name
        d, s = cfg.d_model, 1 / np.sqrt(cfg.d_model)
        p = lambda shape, scale, part: _param(xp, rng, shape, scale, f"{name}.{part}")  # noqa: E731
        self.params = {
            "attn_norm": Tensor(xp.ones(d, dtype=np.float32), requires_grad=True, name=f"{name}.attn_norm"),
            "wq": p((d, cfg.heads * cfg.d_qk), s, "wq"),
            "wkv": p((d, cfg.d_qk), s, "wkv"),
            "wo": p((cfg.heads * cfg.d_v, d), 1 / np.sqrt(cfg.heads * cfg.d_v), "wo"),
            "iq": p((d, cfg.index_heads * cfg.index_dim), s, "iq"),
            "ik": p((d, cfg.index_dim), s, "ik"),
            "iw": p((d, cfg.index_heads), s, "iw"),
            "mlp_norm": Tensor(xp.ones(d, dtype=np.float32), requires_grad=True, name=f"{name}.mlp_norm"),
            "w1": p((d, cfg.d_ff), s, "w1"),
            "w3": p((d, cfg.d_ff), s, "w3"),
            "w2": p((cfg.d_ff, d), 1 / np.sqrt(cfg.d_ff), "w2"),
        }

    def parameters(self) -> list[Tensor]:
        return list(self.params.values())

    def _indexer(self, h: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
        cfg, p = self.cfg, self.params
        h_det = h.detach()
        q = ops.Reshape.apply(ops.MatMul.apply(h_det, p["iq"]), shape=(n, cfg.index_heads, cfg.index_dim))
        return q, ops.MatMul.apply(h_det, p["ik"]), ops.MatMul.apply(h_det, p["iw"])

    def forward(self, x: Tensor, rope: tuple[Any, Any], selector: Any, kl_rows: Any = None
                ) -> tuple[Tensor, Tensor]:
        """x [N, d] -> (y [N, d], the block's indexer KL loss, a scalar).

        rope: (cos, sin) float32 [N, rope_dim / 2]. kl_rows: int [M], the rows
        the indexer loss averages over (default all; a task with a loss on a
        few rows trains the indexer where the attention is trained).
        """
        cfg, p = self.cfg, self.params
        n = x.shape[0]
        cos, sin = (ops.constant(t) for t in rope)
        h = ops.RMSNorm.apply(x, p["attn_norm"])
        iq, ik, iw = self._indexer(h, n)
        indices, ik = self._select(selector, iq, ik, iw)
        width = getattr(selector, "topk", None)
        check_selection(indices, n, cfg.topk if width is None else width, self.name)
        q = ops.Reshape.apply(ops.MatMul.apply(h, p["wq"]), shape=(n, cfg.heads, cfg.d_qk))
        q = ops.RoPETail.apply(q, cos, sin)
        kv = ops.RoPETail.apply(ops.MatMul.apply(h, p["wkv"]), cos, sin)
        dtype = cfg.attention_dtype  # np.dtype knows "bfloat16": hyscale_core imports ml_dtypes
        attn = self._attend(ops.Cast.apply(q, dtype=dtype), ops.Cast.apply(kv, dtype=dtype), indices)
        flat = ops.Reshape.apply(ops.Cast.apply(attn, dtype=np.float32), shape=(n, cfg.heads * cfg.d_v))
        x = ops.Add.apply(x, ops.MatMul.apply(flat, p["wo"]))
        kl = self._kl(iq, ik, iw, indices, attn.aux["probs"], kl_rows)
        y = ops.Add.apply(x, ops.swiglu(ops.RMSNorm.apply(x, p["mlp_norm"]), p["w1"], p["w3"], p["w2"]))
        return y, kl

    # Where the block's tokens meet other tokens: a sharded block (mpi/engine.py)
    # overrides these three and shares the rest of forward.

    def _select(self, selector: Any, iq: Tensor, ik: Tensor, iw: Tensor) -> tuple[Any, Tensor]:
        """``(indices int32 [N, topk], the indexer keys the loss scores against)``.
        ``topk`` is the selector's own when it names one (a live selection of
        another width), else the model's: a replayed table must have it."""
        return selector.select(self.name, iq.data, ik.data, iw.data), ik

    def _attend(self, q: Tensor, kv: Tensor, indices: Any) -> Tensor:
        """Sparse attention of q [N, h, d_qk] over the kv rows [N, d_qk] that ``indices`` select."""
        return SparseAttention.apply(q, kv, ops.constant(indices), d_v=self.cfg.d_v)

    def _kl(self, iq: Tensor, ik: Tensor, iw: Tensor, indices: Any, probs: Any, kl_rows: Any) -> Tensor:
        """The indexer KL loss, averaged over ``kl_rows`` (default all rows)."""
        if kl_rows is not None:
            rows = ops.constant(kl_rows)
            iq, iw = ops.TakeRows.apply(iq, rows), ops.TakeRows.apply(iw, rows)
            indices, probs = indices[kl_rows], probs[kl_rows]
        return IndexerKL.apply(IndexerScoresAt.apply(iq, ik, iw, ops.constant(indices)), ops.constant(probs))


class Forward(NamedTuple):
    """What :meth:`TinyDSA.forward` returns.

    loss   : differentiable scalar Tensor (cross-entropy, plus the indexer
             losses unless they are seeded inside checkpointed blocks).
    total  : float, cross-entropy + kl_weight * sum(kls): the value optimised.
    kls    : per-layer indexer KL losses (floats).
    logits : float32 [M, vocab] at the loss rows.
    """

    loss: Tensor
    total: float
    kls: list[float]
    logits: Any


class TinyDSA:
    """Embedding, ``n_layers`` DSA blocks, final norm, LM head."""

    def __init__(self, cfg: DSAConfig, seed: int = 0, xp=np) -> None:
        rng = np.random.default_rng(seed)
        self.cfg, self.xp = cfg, xp
        self.embed = _param(xp, rng, (cfg.vocab, cfg.d_model), 1.0, "embed")
        self.blocks = [DSABlock(cfg, f"layer{i}", rng, xp) for i in range(cfg.n_layers)]
        self.final_norm = Tensor(xp.ones(cfg.d_model, dtype=np.float32), requires_grad=True, name="final_norm")
        self.head = _param(xp, rng, (cfg.d_model, cfg.vocab), 1 / np.sqrt(cfg.d_model), "head")

    def parameters(self) -> list[Tensor]:
        out = [self.embed, self.final_norm, self.head]
        for block in self.blocks:
            out += block.parameters()
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameter name -> host copy of its float32 array."""
        return {p.name: np.array(to_host(p.data)) for p in self.parameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy arrays (by parameter name, same shapes) into the parameters."""
        for p in self.parameters():
            if p.name not in state or tuple(state[p.name].shape) != p.shape:
                got = None if p.name not in state else tuple(state[p.name].shape)
                raise ValueError(f"state has no parameter {p.name!r} of shape {p.shape} (got {got})")
            p.data[...] = self.xp.asarray(state[p.name], dtype=p.data.dtype)

    def forward(self, ids: Any, rows: Any, targets: Any, selector: Any, recompute: bool = False,
                recompute_selector: Any = None, kl_on_loss_rows: bool = False) -> Forward:
        """Predict ``targets`` [M] (int) at positions ``rows`` [M] (int) of the token
        sequence ``ids`` [N] (int); the indexer selects with ``selector``.

        ids and targets in [0, vocab), rows in [0, N), M >= 1; anything else is
        a ValueError/TypeError naming the argument and its first bad entry. A
        row listed twice counts twice in the mean loss (its gradient is the
        sum of both).

        recompute: checkpoint every block; their selections are replayed in
        backward, or made again by ``recompute_selector`` when one is given.
        kl_on_loss_rows: the indexer losses average over ``rows`` only (see
        :meth:`DSABlock.forward`).
        """
        xp = self.xp
        ids, rows, targets = check_batch(xp, ids, rows, targets, self.cfg.vocab)
        rope = ops.rope_tables(xp, xp.arange(ids.shape[0]), self.cfg.rope_dim)
        x = ops.Embedding.apply(self.embed, ops.constant(ids))
        kls: list[Tensor | float] = []
        kl_rows = rows if kl_on_loss_rows else None
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, rope, selector, self.cfg.kl_weight, recompute_selector, kl_rows)
                kls.append(float(x.aux["kl"]))
            else:
                x, kl = block.forward(x, rope, selector, kl_rows)
                kls.append(kl)
        logits = ops.MatMul.apply(ops.RMSNorm.apply(ops.TakeRows.apply(x, ops.constant(rows)), self.final_norm),
                                  self.head)
        loss = ops.CrossEntropy.apply(logits, ops.constant(targets))
        kl_values = [k if isinstance(k, float) else float(k.data) for k in kls]
        if not recompute:
            for kl in kls:
                loss = ops.Add.apply(loss, ops.Mul.apply(kl, ops.constant(kl.data * 0 + self.cfg.kl_weight)))
        total = float(loss.data) + (self.cfg.kl_weight * sum(kl_values) if recompute else 0.0)
        return Forward(loss, total, kl_values, logits.data)
