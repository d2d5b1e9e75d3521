"""Selection logs: rollout selections stored in HDF5 and replayed by training.

    >>> from hyscale_core.io import SelectionLog, LogReplaySource
    >>> with SelectionLog("rollout.h5", "w") as log:
    ...     log.append(sample, layer, hs.indexer_topk(q, k, w, 2048))
    >>> source = LogReplaySource("rollout.h5", sample)
    >>> source.selection(layer)                    # int32 [N, 2048], verified

``fingerprint`` and the error classes import without h5py; the log classes
load h5py on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from .entry import EntryInfo, FingerprintMismatchError, IncompleteLogError, SelectionLogError
from .fingerprint import fingerprint

_LAZY = {"SelectionLog": "selection_log", "FORMAT": "selection_log", "FORMAT_VERSION": "selection_log",
         "LogReplaySource": "replay"}

__all__ = ["EntryInfo", "FingerprintMismatchError", "IncompleteLogError", "SelectionLogError", "fingerprint",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
