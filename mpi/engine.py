"""The engine's DSA block and tiny model over sequence shards, and a training step.

Every per-token operation (norms, projections, RoPE at global positions,
the MLP) runs on this rank's rows as it would in one process. The two
places where tokens meet are exchanges recorded on the tape as
:class:`GatherRows` (forward: a collective gather; backward: the
gradients sent to their owners and summed there in rank order):

- the indexer keys, all-gathered in global order, feed the selection
  (:class:`ShardedSelection`: ``hs.indexer_topk`` with ``q_pos``) and the
  indexer's scores at the selection (the KL loss);
- the latent kv rows the selections use (all-gather or fetch, by the cost
  model), read by the engine's own ``SparseAttention`` Function through
  the plan's renumbered indices.

Losses are shares: a rank's KL is its local mean times n_local / N and its
cross-entropy is a sum over its targets divided by the global target count,
so the shares add up to the single-process losses. Parameter gradients are
summed over ranks by :func:`allreduce_gradients` (float64, rank order, one
rounding): every rank then holds the same bits and AdamW takes the same step.
:class:`ShardedRunner` wraps all of it for a training loop that hands every
rank the same global batch (``examples/train_tiny_dsa.py`` under mpiexec).
Everything here is collective: all ranks run the same graph in the same order.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

import hyscale_core as hs

from .._backend import array_module, to_host
from ..engine import backward
from ..engine import ops
from ..engine.attention import SparseAttention
from ..engine.checkpoint import checkpoint
from ..engine.model import DSABlock, Forward, TinyDSA
from ..engine.optim import AdamW
from ..engine.selection import LiveSelection, SelectionStore
from ..engine.tensor import Function, Tensor, no_grad
from .exchange import AllGather, plan_rows, sum_in_rank_order
from .layout import split_sizes
from .shard import Shard, make_shard
from .transport import select_transport


class GatherRows(Function):
    """x [n_local, ...] -> ``plan.gather(x)``; the gradient goes through ``plan.to_owners``."""

    def forward(self, x, plan=None):
        self.save(plan)
        return plan.gather(x)

    def backward(self, g):
        (plan,) = self.saved
        return (plan.to_owners(g),)


class SumCrossEntropy(Function):
    """weight * sum over rows of the softmax cross-entropy of logits [M, V] at
    targets [M] (int); M may be 0 (a rank without targets adds 0)."""

    def forward(self, logits, targets, weight: float = 1.0):
        xp = array_module(logits)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_p = shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
        self.save(log_p, targets, weight)
        picked = xp.take_along_axis(log_p, targets[:, None], axis=1)
        return xp.asarray(-picked.sum() * weight, dtype=logits.dtype)

    def backward(self, g):
        log_p, targets, weight = self.saved
        xp = array_module(log_p)
        grad = xp.exp(log_p)
        grad[xp.arange(targets.shape[0]), targets] -= 1
        return grad * (g * weight), None


class ShardedSelection(LiveSelection):
    """Live selection of this rank's queries: ``select(layer, q, k_all, w)``
    takes the local indexer queries and weights and the *all-gathered* keys
    (global order), runs ``hs.indexer_topk`` with ``q_pos = shard.positions``
    and records the int32 [n_local, topk] global selection."""

    def __init__(self, shard: Shard, topk: int, *, store: SelectionStore | None = None) -> None:
        super().__init__(topk, causal=True, cu_seqlens=shard.cu_seqlens, store=store,
                         topk_fn=functools.partial(hs.indexer_topk, q_pos=shard.positions))


class ShardedDSABlock(DSABlock):
    """``block`` (its parameters shared, not copied) run on this rank's rows."""

    def __init__(self, block: DSABlock, shard: Shard, exchange: str = "auto") -> None:
        self.cfg, self.name, self.params = block.cfg, block.name, block.params
        self.shard, self.exchange = shard, exchange

    # DSABlock.forward runs on this rank's rows [n_local, d] with rope at this
    # rank's global positions; these are the places where tokens meet.

    def _select(self, selector: Any, iq: Tensor, ik: Tensor, iw: Tensor) -> tuple[Any, Tensor]:
        """Select this rank's queries over the all-gathered keys (global order);
        ``selector`` is a :class:`ShardedSelection` or a replay of one."""
        ik_all = GatherRows.apply(ik, plan=AllGather(self.shard, global_order=True))
        return selector.select(self.name, iq.data, ik_all.data, iw.data), ik_all

    def _attend(self, q: Tensor, kv: Tensor, indices: Any) -> Tensor:
        """Attend over the kv rows the selections use, fetched from their owners
        (cast already: they travel in the attention dtype)."""
        plan = plan_rows(self.shard, indices, kv.dtype.itemsize * self.cfg.d_qk, self.exchange)
        return SparseAttention.apply(q, GatherRows.apply(kv, plan=plan), ops.constant(plan.remap(indices)),
                                     d_v=self.cfg.d_v)

    def _kl(self, iq: Tensor, ik_all: Tensor, iw: Tensor, indices: Any, probs: Any, kl_rows: Any) -> Tensor:
        """This rank's share of the block's KL loss: the local mean over
        ``kl_rows`` (local rows; default all) times those rows over every
        rank's rows."""
        kl = super()._kl(iq, ik_all, iw, indices, probs, kl_rows)
        count = iq.shape[0] if kl_rows is None else int(kl_rows.shape[0])
        total = self.shard.comm.allreduce(count) if kl_rows is not None else self.shard.n
        return ops.Mul.apply(kl, ops.constant(kl.data * 0 + count / max(total, 1)))


def shard_batch(shard: Shard, ids: Any, rows: Any, targets: Any) -> tuple[Any, Any, Any, int]:
    """This rank's part of a TinyDSA batch: ``(ids [n_local], local rows [m],
    targets [m], M)`` from the global ids [N], prediction positions rows [M]
    (distinct) and targets [M]; M is the global target count, at least 1
    (the loss is a mean over the targets: ValueError for none)."""
    xp = shard.xp
    rows_h = to_host(rows).astype(np.int64, copy=False)
    if rows_h.shape[0] == 0 or targets.shape[0] == 0:
        raise ValueError(f"targets and rows must hold at least one prediction, got targets of shape "
                         f"{tuple(targets.shape)} and rows of shape {tuple(rows_h.shape)}")
    mine = np.flatnonzero(shard.owner[rows_h] == shard.rank)
    local_rows = xp.asarray(shard.local_index[rows_h[mine]])
    return ids[shard.device("positions")], local_rows, targets[xp.asarray(mine)], int(rows_h.shape[0])


class ShardedTinyDSA:
    """A :class:`TinyDSA` (parameters shared) run over ``shard``."""

    def __init__(self, model: TinyDSA, shard: Shard, exchange: str = "auto") -> None:
        self.model, self.shard, self.cfg, self.xp = model, shard, model.cfg, model.xp
        self.blocks = [ShardedDSABlock(b, shard, exchange) for b in model.blocks]

    def parameters(self) -> list[Tensor]:
        return self.model.parameters()

    def forward(self, ids: Any, rows: Any, targets: Any, n_targets: int, selector: Any, recompute: bool = False,
                kl_on_loss_rows: bool = False) -> Forward:
        """Arguments from :func:`shard_batch` (recompute and kl_on_loss_rows as
        ``TinyDSA.forward``). Returns a :class:`Forward` whose ``loss`` is this
        rank's share, ``total`` (the global loss with the indexer losses) and
        ``kls`` (the global per-layer indexer losses) the same on every rank,
        and ``logits`` float32 [m, vocab] at this rank's loss rows."""
        cfg, m = self.cfg, self.model
        rope = ops.rope_tables(self.xp, self.shard.device("positions"), cfg.rope_dim)
        x = ops.Embedding.apply(m.embed, ops.constant(ids))
        kl_rows = rows if kl_on_loss_rows else None
        kls: list[Any] = []
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, rope, selector, cfg.kl_weight, kl_rows=kl_rows)
                kls.append(x.aux["kl"])
            else:
                x, kl = block.forward(x, rope, selector, kl_rows)
                kls.append(kl)
        logits = ops.MatMul.apply(ops.RMSNorm.apply(ops.TakeRows.apply(x, ops.constant(rows)), m.final_norm),
                                  m.head)
        loss = SumCrossEntropy.apply(logits, ops.constant(targets), weight=1.0 / n_targets)
        shares = [float(loss.data)] + [float(k.data if isinstance(k, Tensor) else k) for k in kls]
        if not recompute:
            for kl in kls:
                loss = ops.Add.apply(loss, ops.Mul.apply(kl, ops.constant(kl.data * 0 + cfg.kl_weight)))
        totals = np.sum(self.shard.comm.allgather(shares), axis=0)  # rank order
        return Forward(loss, float(totals[0] + cfg.kl_weight * totals[1:].sum()), [float(v) for v in totals[1:]],
                       logits.data)


def allreduce_gradients(shard: Shard, params: list[Tensor]) -> None:
    """Replace each parameter's ``.grad`` by its sum over ranks (None counts as 0).

    Deterministic reduce-scatter + all-gather of the flattened gradients:
    rank r sums part r of every rank's vector in float64, in rank order, and
    rounds once; then every rank receives every summed part, so all ranks
    hold bitwise the same gradients. Bytes per rank: 2 (P-1)/P of the
    gradients' size each way.
    """
    xp = shard.xp
    grads = [p.grad if p.grad is not None else xp.zeros_like(p.data) for p in params]
    flat = xp.concatenate([g.reshape(-1).astype(np.float32) for g in grads])
    parts = split_sizes(flat.shape[0], shard.size)
    t = shard.transport
    mine = t.alltoallv(flat, parts, [parts[shard.rank]] * shard.size)
    summed = sum_in_rank_order(mine.reshape(shard.size, -1), np.float32)
    flat = t.alltoallv(summed, [summed.shape[0]] * shard.size, parts, send_displs=[0] * shard.size)
    start = 0
    for p, g in zip(params, grads):
        p.grad = flat[start:start + g.size].reshape(g.shape).astype(g.dtype)
        start += g.size


def train_step(model: ShardedTinyDSA, optimizer: AdamW, batch: tuple[Any, Any, Any, int], selector: Any,
               recompute: bool = False, kl_on_loss_rows: bool = False) -> tuple[float, list[float]]:
    """One sharded training step: forward, backward, gradient all-reduce, AdamW.

    batch: :func:`shard_batch`'s result. Returns the global loss value and the
    per-layer indexer losses (the same on every rank).
    """
    out = model.forward(*batch, selector, recompute=recompute, kl_on_loss_rows=kl_on_loss_rows)
    backward(out.loss)
    allreduce_gradients(model.shard, optimizer.params)
    optimizer.step()
    return out.total, out.kls


class ShardedRunner:
    """A :class:`TinyDSA` run with every batch's sequence sharded over ``comm``:
    what a training loop calls instead of ``TinyDSA.forward`` under ``mpiexec``.

    Every rank holds the same parameters and passes the same global batch.
    :meth:`run` shards it (one :class:`Shard` per batch shape, kept; all on
    one transport), runs :class:`ShardedTinyDSA` and, when training, the
    backward and :func:`allreduce_gradients`: the optimizer step that follows
    is then the same on every rank. Logits and selections come back whole on
    every rank (all-gathered: [M, vocab] and int32 [N, topk] per layer, small
    at the sizes a tiny model trains), for evaluation and selection logs.
    Collective: all ranks call every method in the same order.
    """

    def __init__(self, model: TinyDSA, comm: Any, *, layout: str = "balanced", exchange: str = "auto",
                 transport: str | None = None) -> None:
        self.model, self.comm, self.layout, self.exchange = model, comm, layout, exchange
        self.transport = select_transport(comm, model.xp, transport)
        self._shards: dict[tuple, Shard] = {}

    def shard(self, n: int, cu_seqlens: Any = None) -> Shard:
        """The shard of an ``n``-token batch packed at ``cu_seqlens`` (made once per shape)."""
        key = (n, None if cu_seqlens is None else tuple(np.asarray(cu_seqlens).tolist()))
        if key not in self._shards:
            self._shards[key] = make_shard(self.comm, n, layout=self.layout, cu_seqlens=cu_seqlens,
                                           xp=self.model.xp, transport=self.transport)
        return self._shards[key]

    def run(self, ids: Any, rows: Any, targets: Any, topk: int, cu_seqlens: Any = None, *, train: bool = False,
            recompute: bool = False, kl_on_loss_rows: bool = False) -> tuple[Forward, SelectionStore]:
        """``TinyDSA.forward`` of the global batch (ids [N], rows [M], targets [M],
        int; packed at ``cu_seqlens`` int [B+1]) with a live top-``topk`` selection.

        train: also back-propagate (gradient graph kept) and sum the parameter
        gradients over ranks. Returns the :class:`Forward` (``loss`` this
        rank's share; ``total``, ``kls`` global; ``logits`` float32 [M, vocab]
        in the order of ``rows``) and a :class:`SelectionStore` of every
        layer's global selection, int32 [N, topk].
        """
        shard = self.shard(int(ids.shape[0]), cu_seqlens)
        batch = shard_batch(shard, ids, rows, targets)
        selector = ShardedSelection(shard, topk)
        model = ShardedTinyDSA(self.model, shard, self.exchange)
        if train:
            out = model.forward(*batch, selector, recompute=recompute, kl_on_loss_rows=kl_on_loss_rows)
            backward(out.loss)
            allreduce_gradients(shard, self.model.parameters())
        else:
            with no_grad():
                out = model.forward(*batch, selector, recompute=recompute, kl_on_loss_rows=kl_on_loss_rows)
        owner = shard.owner[np.asarray(to_host(rows), dtype=np.int64)]
        logits = self._gather(to_host(out.logits), [np.flatnonzero(owner == r) for r in range(shard.size)],
                              len(owner))
        store = SelectionStore()
        for layer in selector.store.layers():
            store.put(layer, self._gather(to_host(selector.store.selection(layer)), shard.layout.positions, shard.n))
        return out._replace(logits=logits), store

    def _gather(self, local: np.ndarray, where: Any, total: int) -> Any:
        """Every rank's ``local`` rows placed at its ``where[r]`` rows of a [total, ...] ``xp`` array."""
        parts = self.comm.allgather(local)
        whole = np.empty((total,) + local.shape[1:], dtype=local.dtype)
        for rows, part in zip(where, parts):
            whole[rows] = part
        return self.model.xp.asarray(whole)

    def close(self) -> None:
        """Free the transport (collective for NCCL)."""
        self.transport.close()
