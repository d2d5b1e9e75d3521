"""Time and bytes per phase of a sharded run, gathered over the ranks.

    log = PhaseLog(shard)
    with log.phase("select"):
        ...
    table = log.report()          # collective; rank 0 gets the rows

A phase starts with a barrier (so it measures from "every rank ready") and
ends after the device has finished its queued work; its bytes are the
transport's payload counters before and after.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from .shard import Shard


class PhaseLog:
    """Per-phase wall seconds and payload bytes sent/received on this rank."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.phases: dict[str, dict[str, float]] = {}

    def _sync(self) -> None:
        if self.shard.xp.__name__ == "cupy":
            self.shard.xp.cuda.get_current_stream().synchronize()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = self.shard.transport
        self._sync()
        self.shard.comm.Barrier()
        sent, received, start = t.bytes_sent, t.bytes_received, time.perf_counter()
        yield
        self._sync()
        row = self.phases.setdefault(name, {"seconds": 0.0, "sent": 0, "received": 0})
        row["seconds"] += time.perf_counter() - start
        row["sent"] += t.bytes_sent - sent
        row["received"] += t.bytes_received - received

    def report(self) -> list[dict[str, Any]] | None:
        """Collective. On rank 0: one dict per phase with ``seconds`` (max over
        ranks), ``seconds_per_rank``, ``sent_per_rank`` and ``received_per_rank``;
        None on the other ranks."""
        everyone = self.shard.comm.gather(self.phases, root=0)
        if everyone is None:
            return None
        return [{"phase": name,
                 "seconds": max(r[name]["seconds"] for r in everyone),
                 "seconds_per_rank": [r[name]["seconds"] for r in everyone],
                 "sent_per_rank": [r[name]["sent"] for r in everyone],
                 "received_per_rank": [r[name]["received"] for r in everyone]} for name in self.phases]
