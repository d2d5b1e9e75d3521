"""Bytes moved per rank by the sequence shards: transport counters against the cost model.

Runs ``mpiexec -n P python examples/mpi_long_context.py`` (CPU, one thread
per rank) for each P and kv exchange, and records for every phase that
moves data (keys: indexer-key all-gather; kv: the latent rows the
selections use; dkv: their gradients back to the owners) the payload
bytes each rank sent and received, as counted by the transport, next to
the cost model's figure (hyscale_core/mpi/costmodel.py), plus the time per
phase. With more ranks than cores the times are not meaningful; the bytes are.

    python -m benchmarks.run mpi_bytes [--seq-len 4096] [--ranks 2 3 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import cpu_device, table, write_results

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mpi_long_context.py"
THREADS = {name: "1" for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def run_example(ranks: int, options: list[str]) -> dict:
    """The example's summary (its --json) from ``mpiexec -n ranks``."""
    beside = Path(sys.executable).with_name("mpiexec")  # the mpich wheel's, else the one on PATH
    exe = str(beside) if beside.exists() else shutil.which("mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [exe, "-n", str(ranks), sys.executable, str(EXAMPLE), "--cpu", "--json", str(out), *options]
        subprocess.run(cmd, check=True, env={**os.environ, **THREADS}, timeout=600, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    args = parser.parse_args(argv)
    rows, flat = [], []
    for ranks in args.ranks:
        for exchange in ("allgather", "fetch"):
            summary = run_example(ranks, ["--seq-len", str(args.seq_len), "--topk", str(args.topk), "--heads", "2",
                                          "--index-heads", "16", "--exchange", exchange])
            for phase in summary["phases"]:
                if "model_sent_per_rank" not in phase:
                    continue
                match = (phase["sent_per_rank"] == phase["model_sent_per_rank"]
                         and phase["received_per_rank"] == phase["model_received_per_rank"])
                rows.append({"bench": "mpi_bytes", "config": {**summary["config"], "phase": phase["phase"]},
                             "impl": f"{summary['config']['transport']} / {exchange}",
                             "median_ms": round(phase["seconds"] * 1e3, 2), "repeats": 1, "model_match": match,
                             **{k: phase[k] for k in ("sent_per_rank", "received_per_rank", "model_sent_per_rank",
                                                      "model_received_per_rank")}})
                flat.append({"P": ranks, "exchange": exchange, "phase": phase["phase"],
                             "received MB per rank": "/".join(f"{b / 1e6:.3f}" for b in phase["received_per_rank"]),
                             "sent MB per rank": "/".join(f"{b / 1e6:.3f}" for b in phase["sent_per_rank"]),
                             "= model": match})
    print(table(flat, ["P", "exchange", "phase", "received MB per rank", "sent MB per rank", "= model"]))
    device = cpu_device() + f", mpiexec from {Path(sys.executable).parent}"
    print("wrote", write_results("mpi_bytes", device, rows))


if __name__ == "__main__":
    main()
