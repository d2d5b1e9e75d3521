"""Where a DSA layer's selection comes from: live, recorded, or replayed.

A selector has ``select(layer, q, k, w) -> int32 [N, topk]`` (q, k, w: the
indexer's raw arrays). :class:`LiveSelection` runs ``hs.indexer_topk`` and
records every selection with its fingerprint; :class:`ReplaySelection`
returns a source's selections instead (a :class:`SelectionStore` recorded
in the forward, or ``hyscale_core.io.LogReplaySource`` for a rollout log) and
checks each against its fingerprint. A replay source has
``selection(layer)`` and ``fingerprint(layer)``.
"""
from __future__ import annotations

from typing import Any, Callable

import hyscale_core as hs

from ..io.fingerprint import fingerprint


class SelectionMismatchError(ValueError):
    """A replayed selection does not match the fingerprint it was stored with."""


class SelectionStore:
    """Selections recorded in a forward pass, by layer: a replay source."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Any, str]] = {}

    def put(self, layer: str, indices: Any) -> None:
        self._entries[layer] = (indices, fingerprint(indices))

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
    """Replays a source's selections; a fingerprint mismatch names the layer."""

    def __init__(self, source: Any, to_array: Callable[[Any], Any] | None = None) -> None:
        self.source = source
        self.to_array = to_array

    def select(self, layer: str, q: Any, k: Any, w: Any) -> Any:
        indices = self.source.selection(layer)
        expected = self.source.fingerprint(layer)
        if fingerprint(indices) != expected:
            raise SelectionMismatchError(f"replayed selection of layer {layer!r} does not match its "
                                         f"fingerprint {expected}")
        if indices.shape[0] != q.shape[0]:
            raise SelectionMismatchError(f"replayed selection of layer {layer!r} has {indices.shape[0]} rows, "
                                         f"the layer has {q.shape[0]} queries")
        return self.to_array(indices) if self.to_array else indices
