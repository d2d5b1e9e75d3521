"""Writes selection_log_int32.h5, a format-version-1 log whose entries are stored in
the "int32-v1" encoding (and one in "sorted-gaps-lehmer-v1"), which
tests/test_io_encodings.py reads back to prove later readers still read both
encodings. Run from the repository root:

    PYTHONPATH=. python tests/data/make_selection_log_int32.py

The tables are those of make_selection_log_v1.py (closed formulas); never
regenerate the file for a new encoding or format version, add one.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent


def formulas():
    """The module make_selection_log_v1.py: windows(), scattered(), CU_SEQLENS, Q_POS."""
    spec = importlib.util.spec_from_file_location("make_v1", HERE / "make_selection_log_v1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from hyscale_core.io import SelectionLog

    v1, path = formulas(), HERE / "selection_log_int32.h5"
    with SelectionLog(path, "w", encoding="int32-v1", chunk_rows=16) as log:
        log.append("rollout-0", "0", v1.windows(50, 8))
        log.append("rollout-0", "1", v1.windows(50, 8, v1.CU_SEQLENS), cu_seqlens=v1.CU_SEQLENS)
    with SelectionLog(path, "a", encoding="sorted-gaps-lehmer-v1", chunk_rows=16) as log:
        log.append(7, "layers.2.indexer", v1.scattered(), causal=False, q_pos=v1.Q_POS, n_keys=30)


if __name__ == "__main__":
    main()
