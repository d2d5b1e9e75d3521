"""Argument checks of the engine's model: its config, a batch, a layer's selection.

Every failure is a ``ValueError`` (bad value or shape) or ``TypeError`` (bad
type or dtype) that names the argument and the offending value.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import check_int, check_real
from .._dtypes import FLOAT_DTYPES, dtype_names
from ..ops.indexer import MAX_TOPK

# DSAConfig fields that count something the model builds: each at least 1.
_SIZES = ("vocab", "d_model", "n_layers", "heads", "d_v", "d_ff", "index_heads", "index_dim")


def check_config(cfg: Any) -> None:
    """The sizes of a ``DSAConfig`` against what the model relies on: positive
    int sizes, topk in [1, MAX_TOPK], rope_dim an even int >= 0 (RoPE rotates
    pairs; the rope part is the last rope_dim of d_qk = d_v + rope_dim, so
    d_v <= d_qk), kl_weight finite >= 0, attention_dtype a float dtype."""
    for name in _SIZES:
        check_int(getattr(cfg, name), f"DSAConfig.{name}", 1)
    check_int(cfg.topk, "DSAConfig.topk", 1, MAX_TOPK)
    if check_int(cfg.rope_dim, "DSAConfig.rope_dim", 0) % 2:
        raise ValueError(f"DSAConfig.rope_dim must be even (RoPE rotates pairs of dims), got {cfg.rope_dim}")
    check_real(cfg.kl_weight, "DSAConfig.kl_weight")
    _check_attention_dtype(cfg.attention_dtype)


def _check_attention_dtype(value: Any) -> None:
    try:
        dtype = None if value is None else np.dtype(value)  # np.dtype(None) is float64
    except TypeError:
        dtype = None
    if dtype is None or dtype not in FLOAT_DTYPES:  # None == np.dtype(float64): test it first
        raise TypeError(f"DSAConfig.attention_dtype must be one of: {dtype_names(FLOAT_DTYPES)}, got {value!r}")


def check_batch(xp: Any, ids: Any, rows: Any, targets: Any, vocab: int) -> tuple[Any, Any, Any]:
    """``(ids [N], rows [M], targets [M])`` as integer arrays of ``xp``, checked:
    ids and targets in [0, vocab), rows in [0, N) (repeats allowed), N >= 1,
    M >= 1 (the loss is a mean over the M predictions)."""
    ids, rows, targets = (_int_vector(xp, a, name) for a, name in ((ids, "ids"), (rows, "rows"),
                                                                   (targets, "targets")))
    if ids.shape[0] == 0:
        raise ValueError("ids must hold at least one token, got shape (0,)")
    if rows.shape[0] != targets.shape[0]:
        raise ValueError(f"rows and targets must have one entry per prediction each, got {rows.shape[0]} rows "
                         f"and {targets.shape[0]} targets")
    if rows.shape[0] == 0:
        raise ValueError("rows and targets are empty: the loss is a mean over at least one prediction")
    _check_range(xp, ids, "ids", vocab, "the vocabulary")
    _check_range(xp, rows, "rows", ids.shape[0], "positions of ids")
    _check_range(xp, targets, "targets", vocab, "the vocabulary")
    return ids, rows, targets


def _int_vector(xp: Any, a: Any, name: str) -> Any:
    a = xp.asarray(a)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must have 1 dimension, got shape {tuple(a.shape)}")
    return a


def _check_range(xp: Any, a: Any, name: str, high: int, what: str) -> None:
    """Every entry of the int vector ``a`` is in [0, high); names the first that is not."""
    if int(a.min()) >= 0 and int(a.max()) < high:
        return
    i = int(xp.flatnonzero((a < 0) | (a >= high))[0])
    raise ValueError(f"{name}[{i}] = {int(a[i])} is out of range [0, {high}) ({what})")


def check_selection(indices: Any, n_queries: int, topk: int, layer: str) -> None:
    """A layer's selection is a table [n_queries, topk] (its entries are checked
    by the attention)."""
    shape = tuple(getattr(indices, "shape", ()))
    if shape != (n_queries, topk):
        raise ValueError(f"the selection of layer {layer!r} has shape {shape}, expected ({n_queries}, {topk}): "
                         f"one row per query and topk = {topk} columns")
