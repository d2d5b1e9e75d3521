"""A synthetic long-context retrieval task: a key-value needle far back.

Each sequence of ``length`` tokens is random filler with ``facts`` fact
tokens in its first ``far`` fraction. A fact token binds a key to a value
(one token per (key, value) pair; the facts of a sequence have distinct
keys). The last ``queries`` tokens name keys of facts in the sequence; the
target at each is that fact's value. Answering needs the query to attend to
its fact, hundreds of tokens back, so the indexer must select it: a
selection without the needle cannot answer better than chance (1 / values).

Vocabulary: fillers [0, F), facts F + key * values + value, queries
F + keys * values + key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._backend import to_host


@dataclass(frozen=True)
class NeedleBatch:
    """``sequences`` packed sequences of one length, all int64 host arrays.

    ids [N]         tokens, N = sequences * length.
    cu_seqlens [B+1] packed-sequence bounds (for the indexer's masks).
    rows [M]        positions of the query tokens (the loss rows).
    targets [M]     the value each query asks for.
    needles [M]     position of the fact each query asks about.
    """

    ids: np.ndarray
    cu_seqlens: np.ndarray
    rows: np.ndarray
    targets: np.ndarray
    needles: np.ndarray


@dataclass(frozen=True)
class NeedleTask:
    """Sizes of the task; ``vocab`` is what the model's vocabulary must hold."""

    length: int = 512
    keys: int = 8
    values: int = 8
    fillers: int = 32
    facts: int = 4
    queries: int = 2
    far: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.queries <= self.facts <= self.keys:
            raise ValueError(f"need 1 <= queries <= facts <= keys, got {self.queries}, {self.facts}, {self.keys}")
        if self.facts > int(self.length * self.far) or self.queries >= self.length * (1 - self.far):
            raise ValueError(f"length {self.length} (far {self.far}) has no room for {self.facts} facts "
                             f"and {self.queries} queries")

    @property
    def vocab(self) -> int:
        return self.fillers + self.keys * self.values + self.keys

    def batch(self, rng: np.random.Generator, sequences: int) -> NeedleBatch:
        """``sequences`` fresh sequences packed into one token row."""
        n, f, far_end = self.length, self.fillers, int(self.length * self.far)
        ids = rng.integers(0, f, (sequences, n))
        rows, targets, needles = [], [], []
        for b in range(sequences):
            keys = rng.choice(self.keys, self.facts, replace=False)
            values = rng.integers(0, self.values, self.facts)
            where = rng.choice(far_end, self.facts, replace=False)
            ids[b, where] = f + keys * self.values + values
            asked = rng.choice(self.facts, self.queries, replace=False)
            at = np.arange(n - self.queries, n)
            ids[b, at] = f + self.keys * self.values + keys[asked]
            rows.append(b * n + at)
            targets.append(values[asked])
            needles.append(b * n + where[asked])
        return NeedleBatch(ids.reshape(-1), np.arange(sequences + 1) * n, np.concatenate(rows),
                           np.concatenate(targets), np.concatenate(needles))


def needle_recall(selection: Any, batch: NeedleBatch) -> float:
    """Fraction of the query rows whose selection (int32 [N, k]) holds the needle."""
    picked = to_host(selection)[batch.rows]
    return float((picked == batch.needles[:, None]).any(axis=1).mean())
