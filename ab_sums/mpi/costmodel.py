"""Communication cost model of the sequence shards: payload bytes per rank.

Notation: N tokens over P ranks, rank r holding n_r of them; a row is
``row_bytes`` = d * b bytes (d features of b bytes: the indexer key
d_I * b_I, the latent kv d_qk * b); k selected keys per query. Counted as
the transports count: rows a rank sends to / receives from *other* ranks.

All-gather (every rank receives every row; indexer keys always, kv when
chosen). Forward, per rank r:

    received_r = (N - n_r) * d * b          sent_r = (P - 1) * n_r * d * b

Backward (gradient rows returned to their owners, summed there in rank
order): the same numbers with sent and received swapped.

Fetch (a rank receives only the rows its selections use). With F[r, o]
the distinct keys held by rank o that rank r's selections use (o != r),
F_r = sum_o F[r, o] (rows r fetches) and S_r = sum_o F[o, r] (rows r
serves), and ids of ID_BYTES each:

    received_r = F_r * d * b + S_r * ID_BYTES
    sent_r     = F_r * ID_BYTES + S_r * d * b

Backward: gradient rows only, received_r = S_r * d * b, sent_r = F_r * d * b.

A priori bound: F_r <= min(N - n_r, n_r * k). In a prefill or training
step (n_r = N / P queries, each selecting k = 2048 keys) n_r * k >> N, so
every key is used by some query and F_r ~ N - n_r: the all-gather moves
the same rows without ids. Fetching wins when n_r * k << N - n_r: decode
or short chunks against a long cache (16 queries per rank, k = 2048, 1M
tokens: at most 32768 of the 1M rows).

Choice ("auto"): every rank counts its F_r; after one all-gather of those
counts, fetch is used iff max_r F_r * (d * b + ID_BYTES) < max_r (N - n_r) * d * b
(the slowest rank's received bytes decide), else the all-gather.
"""
from __future__ import annotations

import numpy as np

# Fetch requests travel as int32 global positions.
ID_BYTES = 4


def allgather_bytes(counts: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward all-gather: ``(sent, received)``, int64 [P] bytes per rank.

    counts : int [P], rows held per rank (n_r). The backward swaps the pair.
    """
    counts = np.asarray(counts, dtype=np.int64)
    received = (counts.sum() - counts) * row_bytes
    sent = (counts.size - 1) * counts * row_bytes
    return sent, received


def fetch_bytes(fetched: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward fetch: ``(sent, received)``, int64 [P] bytes per rank.

    fetched : int [P, P], fetched[r, o] = distinct rows of rank o that rank r
    uses (the diagonal, a rank's own rows, moves nothing).
    """
    off = np.array(fetched, dtype=np.int64)
    np.fill_diagonal(off, 0)
    f, s = off.sum(axis=1), off.sum(axis=0)
    return f * ID_BYTES + s * row_bytes, f * row_bytes + s * ID_BYTES


def fetch_backward_bytes(fetched: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Backward of a fetch (gradient rows back to their owners): ``(sent, received)``."""
    off = np.array(fetched, dtype=np.int64)
    np.fill_diagonal(off, 0)
    return off.sum(axis=1) * row_bytes, off.sum(axis=0) * row_bytes


def fetch_bound(counts: np.ndarray, k: int) -> np.ndarray:
    """int64 [P]: the most foreign rows a rank can fetch, min(N - n_r, n_r * k)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.minimum(counts.sum() - counts, counts * k)


def choose_exchange(counts: np.ndarray, foreign: np.ndarray, row_bytes: int) -> str:
    """"fetch" or "allgather" by the rule in the module docstring.

    counts : int [P] rows held per rank; foreign : int [P] F_r per rank.
    """
    counts, foreign = np.asarray(counts, dtype=np.int64), np.asarray(foreign, dtype=np.int64)
    fetch = int((foreign * (row_bytes + ID_BYTES)).max(initial=0))
    gather = int(((counts.sum() - counts) * row_bytes).max(initial=0))
    return "fetch" if fetch < gather else "allgather"
