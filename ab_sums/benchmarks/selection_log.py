"""Selection-log size: bytes per token per layer against raw int32 (4 k).

Two kinds of causal selections, N = 32768 queries over themselves, k = 2048:

* random: uniformly random scores, so each row is a uniformly random set of
  min(k, t + 1) keys in a uniformly random rank order (the worst case);
* structured: what a trained DSA indexer is described to pick (a local
  window, attention sinks, fixed anchors, per-segment far "needles", the rest
  background), ranked by scores with i.i.d. noise. The rank order inside the
  window is therefore nearly random, which is pessimistic for a real
  indexer. Measure on a trained indexer's selections when one exists.

Encodings compared, all with fletcher32 and chunks of 1024 rows:
raw int32 and sorted gaps + rank columns (uint16, row-major) + shuffle +
deflate 4, written by plain h5py; then, written and read through
SelectionLog, its two encodings forced at deflate 4 ("int32-v1": the table +
shuffle + deflate; "sorted-gaps-lehmer-v1": sorted gaps + Lehmer-coded rank
order, digit-major, shuffle + deflate) and its default ("auto": the smaller
of the two, chosen per entry on sampled chunks) at deflate 1/4/9.
``--log FILE`` measures the selections of a log instead (a rollout of a
trained indexer).

Columns: median_ms is one write (choose, encode, compress, write; a single
run, the tables are large), read_ms one read + decode + fingerprint check,
choose_ms (auto rows) the choice alone (encodings.choose on the table),
encoding the one the entry was stored in.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np

from .common import cpu_device, table, write_results


def _select(scores_for, n: int, k: int, block: int = 1024) -> np.ndarray:
    """int32 [n, k]: hs.topk of the score rows ``scores_for(a, b)`` (-inf = masked)."""
    import hyscale_core as hs

    out = np.empty((n, k), dtype=np.int32)
    for a in range(0, n, block):
        b = min(n, a + block)
        values, indices = hs.topk(scores_for(a, b), k)
        out[a:b] = np.where(values == -np.inf, -1, indices)
    return out


def random_causal(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Uniformly random causal selections, int32 [n, k]."""
    rng = np.random.default_rng(seed)

    def scores(a: int, b: int) -> np.ndarray:
        s = rng.random((b - a, n), dtype=np.float32)
        s[np.arange(a, b)[:, None] < np.arange(n)[None, :]] = -np.inf
        return s

    return _select(scores, n, k)


def structured_causal(n: int, k: int, seed: int = 0, window: int = 1024, anchors: int = 512,
                      needles: int = 256, segment: int = 256, noise: float = 1.0) -> np.ndarray:
    """Window + sinks + anchors + needles selections, int32 [n, k] (see the module docstring).

    Scores: background N(0, noise); +6 for the 4 sink tokens; +3 for
    ``anchors`` fixed random keys; +3..+5 inside the ``window`` keys before
    the query, decaying with distance; +3.5 for ``needles`` random far keys
    shared by each ``segment`` of consecutive queries.
    """
    rng = np.random.default_rng(seed)
    importance = np.zeros(n, dtype=np.float32)
    importance[rng.choice(n, min(anchors, n), replace=False)] = 3.0
    importance[:4] = 6.0

    def scores(a: int, b: int) -> np.ndarray:
        distance = (np.arange(a, b)[:, None] - np.arange(n)[None, :]).astype(np.float32)
        s = rng.standard_normal((b - a, n), dtype=np.float32) * noise + importance
        local = (distance >= 0) & (distance < window)
        s += np.where(local, 3.0 + 2.0 * (1.0 - distance / window), 0.0).astype(np.float32)
        for g in range(a, b, segment):
            s[g - a:min(b, g + segment) - a, rng.integers(0, max(g - window, 1), needles)] += 3.5
        s[distance < 0] = -np.inf
        return s

    return _select(scores, n, k)


def _h5_bytes(path: Path, arrays: dict[str, tuple[np.ndarray, int]], **filters) -> tuple[int, float]:
    """(stored bytes, write seconds) of arrays {name: (data, row axis)} in one HDF5 file."""
    start = time.perf_counter()
    with h5py.File(path, "w") as f:
        for name, (data, axis) in arrays.items():
            chunks = list(data.shape)
            chunks[axis] = min(1024, data.shape[axis])
            f.create_dataset(name, data=data, chunks=tuple(chunks), fletcher32=True, **filters)
    seconds = time.perf_counter() - start
    with h5py.File(path, "r") as f:
        return sum(f[name].id.get_storage_size() for name in arrays), seconds


def _rank_columns(selection: np.ndarray) -> dict[str, tuple[np.ndarray, int]]:
    """The sorted-gaps + plain rank columns alternative, row-major."""
    from hyscale_core.io.codec import narrowest_unsigned, sort_rows

    count, first, gaps, order = sort_rows(selection)
    k = selection.shape[1]
    return {"count": (count.astype(narrowest_unsigned(k)), 0), "first": (first, 0),
            "gaps": (gaps.astype(narrowest_unsigned(int(gaps.max(initial=0)))), 0),
            "order": (order.astype(narrowest_unsigned(k)), 0)}


def _log_row(selection: np.ndarray, path: Path, masks: dict, level: int, encoding: str) -> tuple:
    """(impl, stored bytes, write ms, read ms, extra fields) of one entry written through SelectionLog."""
    from hyscale_core.io import SelectionLog, encodings

    start = time.perf_counter()
    with SelectionLog(path, "w", compression_level=level, encoding=encoding) as log:
        info = log.append(0, 0, selection, **masks)
    written = time.perf_counter() - start
    start = time.perf_counter()
    with SelectionLog(path) as log:
        assert np.array_equal(log.read(0, 0), selection)
    read = time.perf_counter() - start
    extra = {"encoding": info.encoding}
    if encoding == encodings.AUTO:
        start = time.perf_counter()
        encodings.choose(selection, encodings.chunk_rows(*selection.shape, log.chunk_rows), level)
        extra["choose_ms"] = round((time.perf_counter() - start) * 1e3, 1)
    label = f"SelectionLog {'(default) ' if (encoding, level) == (encodings.AUTO, 4) else ''}{encoding}"
    return f"{label}, deflate{level}", info.stored_bytes, written * 1e3, read * 1e3, extra


def _alternatives(selection: np.ndarray, tmp: Path, masks: dict) -> list[tuple]:
    """(impl, stored bytes, write ms, read+decode ms, extra fields) of every encoding compared;
    ``masks``: SelectionLog.append's causal, q_pos, cu_seqlens, n_keys."""
    from hyscale_core.io import encodings

    deflate = {"shuffle": True, "compression": "gzip", "compression_opts": 4}
    results = []
    for impl, arrays, filters in (("raw int32", {"t": (selection, 0)}, {}),
                                  ("sorted gaps + rank columns, deflate4", _rank_columns(selection), deflate)):
        stored, seconds = _h5_bytes(tmp / "alt.h5", arrays, **filters)
        results.append((impl, stored, seconds * 1e3, None, {}))
    for encoding, level in ((encodings.INT32.name, 4), (encodings.LEHMER.name, 4),
                            (encodings.AUTO, 1), (encodings.AUTO, 4), (encodings.AUTO, 9)):
        results.append(_log_row(selection, tmp / f"{encoding}{level}.h5", masks, level, encoding))
    return results


def _selections(args: argparse.Namespace) -> Iterator[tuple[str, dict, np.ndarray, dict]]:
    """(kind, config, int32 table, its masks) of each selection measured."""
    if args.log:  # e.g. a rollout log of the trained indexer
        from hyscale_core.io import SelectionLog

        with SelectionLog(args.log) as log:
            for e in log:
                yield (f"log {e.sample}/{e.layer}", {"kind": "log", "file": str(args.log), "sample": e.sample,
                       "layer": e.layer, "n": e.n_queries, "k": e.k, "causal": e.causal}, log.read(e.sample, e.layer),
                       {**e.mask_kwargs(), "n_keys": e.n_keys})
        return
    for kind, make in (("random", random_causal), ("structured", structured_causal)):
        start = time.perf_counter()
        selection = make(args.n, args.k, args.seed)
        print(f"{kind}: generated [{args.n}, {args.k}] in {time.perf_counter() - start:.1f} s", flush=True)
        yield kind, {"kind": kind, "n": args.n, "k": args.k, "causal": True}, selection, {}


def _row(kind: str, config: dict, impl: str, stored: int, write_ms: float, read_ms: float | None,
         extra: dict, shape: tuple[int, int]) -> dict:
    n, k = shape
    return {"bench": "selection_log", "config": config, "impl": impl, "kind": kind,
            "median_ms": round(write_ms, 1), "read_ms": None if read_ms is None else round(read_ms, 1),
            "bytes_per_token_layer": round(stored / max(n, 1), 1), "raw_bytes_per_token_layer": 4 * k,
            "ratio_to_raw": round(stored / max(4 * n * k, 1), 4), **extra}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768, help="queries = keys (causal self-attention)")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, help="measure every selection of this log instead of synthetic ones")
    parser.add_argument("--name", default="selection_log", help="results file name (benchmarks/results/NAME.json)")
    args = parser.parse_args(argv)
    from hyscale_core.io import SelectionLog, encodings

    with tempfile.TemporaryDirectory() as tmp:  # compile the codec kernels outside the timing
        with SelectionLog(Path(tmp) / "warm.h5", "w", encoding=encodings.LEHMER.name) as log:
            log.append(0, 0, random_causal(64, 16))
        with SelectionLog(Path(tmp) / "warm.h5") as log:
            log.read(0, 0)
    rows = []
    for kind, config, selection, masks in _selections(args):
        print(kind, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for impl, stored, write_ms, read_ms, extra in _alternatives(selection, Path(tmp), masks):
                rows.append(_row(kind, config, impl, stored, write_ms, read_ms, extra, selection.shape))
                print(f"  {impl:52s} {rows[-1]['bytes_per_token_layer']:8.1f} B/token/layer  "
                      f"{100 * rows[-1]['ratio_to_raw']:5.1f}%  write {write_ms:8.1f} ms  {extra}", flush=True)
    path = write_results(args.name, cpu_device(), rows)
    print(table(rows, ["kind", "impl", "bytes_per_token_layer", "ratio_to_raw", "median_ms", "read_ms", "encoding",
                       "choose_ms"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
