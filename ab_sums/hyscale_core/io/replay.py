"""The replay source a training step reads a rollout's selections from."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .entry import EntryInfo
from .selection_log import SelectionLog, entry_name


class LogReplaySource:
    """One sample's logged selections, by layer.

    ``log`` is an open :class:`SelectionLog` (left open by :meth:`close`) or
    a path, opened read-only here (closed by :meth:`close`). KeyError if the
    sample is not in the log. The engine replays ``selection(layer)`` in
    place of running the indexer and top-k for that layer.
    """

    def __init__(self, log: SelectionLog | str | os.PathLike, sample: str | int) -> None:
        self._owns = not isinstance(log, SelectionLog)
        self.log = SelectionLog(log) if self._owns else log
        self.sample = entry_name(sample, "sample")
        try:
            self._layers = self.log.layers(self.sample)
        except KeyError:
            self.close()
            raise

    def layers(self) -> list[str]:
        """The layers logged for this sample, in append order."""
        return list(self._layers)

    def _layer(self, layer: str | int) -> str:
        name = entry_name(layer, "layer")
        if name not in self._layers:
            raise KeyError(f"layer {name!r} of sample {self.sample!r} is not in {self.log.path}")
        return name

    def selection(self, layer: str | int) -> np.ndarray:
        """The logged selection of ``layer``, int32 [N, k], checked against its fingerprint."""
        return self.log.read(self.sample, self._layer(layer))

    def fingerprint(self, layer: str | int) -> str:
        """The fingerprint ``layer``'s selection was logged with (see io.fingerprint)."""
        return self.info(layer).fingerprint

    def info(self, layer: str | int) -> EntryInfo:
        """Shape, masks and metadata of ``layer``'s logged selection."""
        return self.log.info(self.sample, self._layer(layer))

    def close(self) -> None:
        if self._owns:
            self.log.close()

    def __enter__(self) -> LogReplaySource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
