"""Dtypes the library accepts, including bfloat16 through ml_dtypes."""
from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

FLOAT_DTYPES = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
TOPK_DTYPES = FLOAT_DTYPES + INT_DTYPES

# Indexer inputs are computed in float32 (see ops/indexer docstrings).
INDEXER_DTYPES = FLOAT_DTYPES

# Selections (index tables with -1 = skip) are int32, as the indexer returns them.
INDEX_DTYPES = (np.dtype(np.int32),)


def dtype_names(dtypes: tuple[np.dtype, ...]) -> str:
    return ", ".join(d.name for d in dtypes)


def is_float(dtype) -> bool:
    """Whether ``dtype`` is one of the float dtypes (bfloat16 has kind 'V')."""
    return np.dtype(dtype) in FLOAT_DTYPES


def compute_dtype(*arrays) -> np.dtype:
    """The dtype a computation on ``arrays`` runs in (sparse attention, the
    indexer loss): float64 when every one is float64, float32 otherwise."""
    return np.dtype(np.float64 if all(a.dtype == np.float64 for a in arrays) else np.float32)
