"""hyscale-core: exact streaming top-k selection for learned sparse attention.

The public API is numpy-like: functions take NumPy arrays (CPU backend, Numba),
CuPy arrays (GPU backend, CuPy RawKernels) or any object with ``__dlpack__``
(imported zero-copy, results returned as NumPy or CuPy arrays on the same
side).

    >>> import hyscale_core as hs
    >>> values, indices = hs.topk(scores, 2048)
    >>> sel = hs.indexer_topk(q, k, w, 2048)          # int32 [Nq, 2048]
    >>> out, lse, probs = hs.sparse_attention(q_mla, kv, sel, return_probs=True)
    >>> loss, dscores = hs.indexer_kl_loss(hs.indexer_scores_at(q, k, w, sel), probs)
"""
from __future__ import annotations

from pathlib import Path as _Path

from ._version import __version__


def _extend_path_in_source_tree() -> None:
    # In a source checkout `cuda/` and `mpi/` sit beside the package, while an
    # installed wheel holds them as hyscale_core/cuda and hyscale_core/mpi
    # (pyproject.toml maps them). Let the package see them in both layouts.
    here = _Path(__file__).resolve().parent
    root = here.parent
    pyproject = root / "pyproject.toml"
    if (here / "mpi").exists() or not pyproject.is_file():
        return
    if 'name = "hyscale-core"' in pyproject.read_text(encoding="utf-8"):
        __path__.append(str(root))  # noqa: F821  (package __path__)


_extend_path_in_source_tree()

from .ops.topk import topk  # noqa: E402
from .ops.indexer import indexer_scores, indexer_topk  # noqa: E402
from .ops.sparse_attention import sparse_attention, sparse_attention_backward  # noqa: E402
from .ops.indexer_loss import indexer_kl_loss, indexer_scores_at, indexer_scores_at_backward  # noqa: E402

__all__ = [
    "__version__", "topk", "indexer_scores", "indexer_topk",
    "sparse_attention", "sparse_attention_backward",
    "indexer_scores_at", "indexer_scores_at_backward", "indexer_kl_loss",
]
