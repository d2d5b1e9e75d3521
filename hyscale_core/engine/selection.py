"""Where a DSA layer's selection comes from: live, recorded, or replayed.

A selector has ``select(layer, q, k, w) -> int32 [N, topk]`` (q, k, w: the
indexer's raw arrays) and may name ``topk``, the width of its tables (None or
absent: the model's ``cfg.topk``); the DSA block checks every table's shape
against it. :class:`LiveSelection` runs ``hs.indexer_topk`` and
records every selection with its fingerprint; :class:`ReplaySelection`
returns a source's selections instead (a :class:`SelectionStore` recorded
in the forward, or ``hyscale_core.io.LogReplaySource`` for a rollout log) and
checks each against its fingerprint. A replay source has
``selection(layer)`` and ``fingerprint(layer)``, and may name the function
its fingerprints were made with as ``fingerprint_fn`` (default: the log's
blake2b :func:`hyscale_core.io.fingerprint`).

An in-memory :class:`SelectionStore` fingerprints with :func:`checksum`, a
64-bit position-weighted sum computed where the table lives (on the GPU for
CuPy tables): blake2b of a 1 GiB table (N = 131072, k = 2048) costs a copy
to the host and about a second of hashing, the checksum a pass over the
table. It catches any change of one entry and any exchange of two entries
except with probability about 2**-60; it is a guard against a stale or
overwritten selection, not against an adversary (the log keeps blake2b).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

import hyscale_core as hs

from .._backend import array_module
from .._checks import check_int
from ..io.fingerprint import fingerprint
from ..ops.indexer import MAX_TOPK

_ROW_MIX = np.uint64(0xC2B2AE3D27D4EB4F)  # odd 64-bit multipliers (from xxhash / golden ratio)
_COL_MIX = np.uint64(0x9E3779B97F4A7C15)
_ROWS = 4096  # rows per pass, to bound the uint64 temporaries


def _odd_weights(xp: Any, start: int, stop: int, mix: np.uint64) -> Any:
    return xp.arange(start, stop, dtype=xp.uint64) * mix * np.uint64(2) + np.uint64(1)


def checksum(indices: Any) -> str:
    """``"sum64:<16 hex>"`` of an integer table [N, k] (NumPy or CuPy, computed on its own device).

    sum over (r, c) of uint32(indices[r, c]) * a_r * b_c modulo 2**64, with
    odd position weights a_r, b_c, plus the shape. Integer sums wrap
    exactly, so the value does not depend on the summation order: the same
    on every run and backend.
    """
    xp = array_module(indices)
    n, k = indices.shape
    with np.errstate(over="ignore"):
        total = np.uint64(n) * _ROW_MIX + np.uint64(k) * _COL_MIX
        cols = _odd_weights(xp, 0, k, _COL_MIX)
        acc = xp.zeros((), dtype=xp.uint64)  # stays on the table's device until the end
        for r0 in range(0, n, _ROWS):
            block = indices[r0:r0 + _ROWS].astype(xp.uint32).astype(xp.uint64)
            rows = (block * cols).sum(axis=1, dtype=xp.uint64)
            rows *= _odd_weights(xp, r0, r0 + block.shape[0], _ROW_MIX)
            acc += rows.sum(dtype=xp.uint64)
        total += np.uint64(int(acc))
    return f"sum64:{int(total):016x}"


class SelectionMismatchError(ValueError):
    """A replayed selection does not match the fingerprint it was stored with."""


class SelectionStore:
    """Selections recorded in a forward pass, by layer: a replay source
    (fingerprinted with :func:`checksum`)."""

    fingerprint_fn = staticmethod(checksum)

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Any, str]] = {}

    def put(self, layer: str, indices: Any) -> None:
        self._entries[layer] = (indices, checksum(indices))

    def selection(self, layer: str) -> Any:
        try:
            return self._entries[layer][0]
        except KeyError:
            raise KeyError(f"no selection recorded for layer {layer!r}") from None

    def fingerprint(self, layer: str) -> str:
        self.selection(layer)
        return self._entries[layer][1]

    def layers(self) -> list[str]:
        return list(self._entries)


IndexerTopK = Callable[..., Any]


class LiveSelection:
    """Runs the indexer top-k (``calls`` counts the runs) and records into ``store``.

    ``topk_fn`` defaults to ``hs.indexer_topk``; the replay diagnostic passes
    another score computation.
    """

    def __init__(self, topk: int, *, causal: bool = True, cu_seqlens: Any = None,
                 store: SelectionStore | None = None, topk_fn: IndexerTopK | None = None) -> None:
        self.topk, self.causal, self.cu_seqlens = topk, causal, cu_seqlens
        self.store = store if store is not None else SelectionStore()
        self.topk_fn = topk_fn or hs.indexer_topk
        self.calls = 0

    def select(self, layer: str, q: Any, k: Any, w: Any) -> Any:
        self.calls += 1
        indices = self.topk_fn(q, k, w, self.topk, causal=self.causal, cu_seqlens=self.cu_seqlens)
        self.store.put(layer, indices)
        return indices


class ReplaySelection:
    """Replays a source's selections; a mismatch names the layer.

    topk   : the width of the replayed tables; None (default): the replaying
             model's ``cfg.topk``. The block refuses a table of another width.
    causal : the replay stands in for a causal selection. A source that
             reports the masks its selections were made under
             (``info(layer)``: a selection log) must then report causal ones,
             and any source as many keys as the layer has. Packing
             (``cu_seqlens``, ``q_pos``) is not compared (a log checked each
             entry against its own masks when it was appended). A source
             without ``info`` (a :class:`SelectionStore`, this process's own
             selections) reports no masks: its entries are not checked against any.
    """

    def __init__(self, source: Any, to_array: Callable[[Any], Any] | None = None, *, topk: int | None = None,
                 causal: bool = True) -> None:
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        self.source, self.to_array, self.causal = source, to_array, bool(causal)
        self.topk = None if topk is None else check_int(topk, "topk", 0, MAX_TOPK)

    def select(self, layer: str, q: Any, k: Any, w: Any) -> Any:
        indices = self.source.selection(layer)
        expected = self.source.fingerprint(layer)
        if getattr(self.source, "fingerprint_fn", fingerprint)(indices) != expected:
            raise SelectionMismatchError(f"replayed selection of layer {layer!r} does not match its "
                                         f"fingerprint {expected}")
        if indices.shape[0] != q.shape[0]:
            raise SelectionMismatchError(f"replayed selection of layer {layer!r} has {indices.shape[0]} rows, "
                                         f"the layer has {q.shape[0]} queries")
        self._check_masks(layer, k.shape[0])
        return self.to_array(indices) if self.to_array else indices

    def _check_masks(self, layer: str, n_keys: int) -> None:
        """The masks the source reports for ``layer`` (if any) against this replay's."""
        if not hasattr(self.source, "info"):
            return
        logged = self.source.info(layer)
        if self.causal and not logged.causal:
            raise SelectionMismatchError(f"replayed selection of layer {layer!r} was made with causal=False (it may "
                                         "hold future keys), the replay is causal=True; pass causal=False to "
                                         "replay it")
        if logged.n_keys != n_keys:
            raise SelectionMismatchError(f"replayed selection of layer {layer!r} was made over {logged.n_keys} keys, "
                                         f"the layer has {n_keys}")
