"""Writes selection_log_v1.h5, the format-version-1 log that tests/test_io_selection_log.py
reads back to prove later readers still read it. Run from the repository root:

    PYTHONPATH=. python tests/data/make_selection_log_v1.py

The tables come from closed formulas (no random generator), so the test
recomputes them; never regenerate the file for a new format version, add one.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

CU_SEQLENS = np.array([0, 20, 50])
Q_POS = np.arange(10) * 3


def windows(n: int, k: int, cu_seqlens=None) -> np.ndarray:
    """Row t: the min(k, t - start + 1) keys ending at t, rotated by t, then -1."""
    starts = np.zeros(n, int) if cu_seqlens is None else np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens))
    table = np.full((n, k), -1, dtype=np.int32)
    for t in range(n):
        m = min(k, t - starts[t] + 1)
        table[t, :m] = t - (np.arange(m) + 2 * t) % m
    return table


def scattered() -> np.ndarray:
    """10 non-causal queries over 30 keys, 5 keys each."""
    return ((np.arange(5)[None, :] * 7 + np.arange(10)[:, None]) % 30).astype(np.int32)


def main() -> None:
    from hyscale_core.io import SelectionLog

    with SelectionLog(Path(__file__).with_name("selection_log_v1.h5"), "w") as log:
        log.append("rollout-0", "0", windows(50, 8))
        log.append("rollout-0", "1", windows(50, 8, CU_SEQLENS), cu_seqlens=CU_SEQLENS)
        log.append(7, "layers.2.indexer", scattered(), causal=False, q_pos=Q_POS, n_keys=30)


if __name__ == "__main__":
    main()
