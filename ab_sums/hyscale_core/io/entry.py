"""What a selection log says about one logged selection, and its errors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class SelectionLogError(ValueError):
    """A file that is not a usable selection log: foreign, truncated,
    corrupted, written by a newer format, or still being written. The
    message names the file and, where it applies, the sample and layer."""


class IncompleteLogError(SelectionLogError):
    """The log (or one entry of it) was not completely written: its writer
    is still running or stopped without closing it. Open with
    ``allow_incomplete=True`` to read every completely appended entry."""


class FingerprintMismatchError(SelectionLogError):
    """A selection read back does not have the fingerprint it was logged with."""


@dataclass(frozen=True)
class EntryInfo:
    """Metadata of one logged selection (sample, layer).

    The selection is an int32 table [n_queries, k]; ``causal``, ``q_pos``
    (int64 [n_queries] or None) and ``cu_seqlens`` (int64 [B+1] or None) are
    the masks it was selected under, over ``n_keys`` keys, exactly as given
    to ``hs.indexer_topk``. ``encoding`` names how the table is stored
    ("sorted-gaps-lehmer-v1" or "int32-v1", see encodings.py);
    ``stored_bytes`` is the size on disk of the encoded table;
    ``raw_bytes`` = 4 * n_queries * k, the int32 table.
    """

    sample: str
    layer: str
    n_queries: int
    k: int
    n_keys: int
    causal: bool
    q_pos: np.ndarray | None
    cu_seqlens: np.ndarray | None
    fingerprint: str
    encoding: str
    hyscale_version: str
    created: str
    stored_bytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_queries, self.k)

    @property
    def raw_bytes(self) -> int:
        return 4 * self.n_queries * self.k

    @property
    def ratio(self) -> float:
        """stored / raw bytes (0.0 for an empty table)."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 0.0

    def mask_kwargs(self) -> dict[str, Any]:
        """``causal``, ``q_pos`` and ``cu_seqlens`` as ``hs.indexer_topk`` takes them."""
        return {"causal": self.causal, "q_pos": self.q_pos, "cu_seqlens": self.cu_seqlens}
