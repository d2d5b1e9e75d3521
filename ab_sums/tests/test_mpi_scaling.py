"""benchmarks/mpi_scaling.py (issue 9's harness) end to end on CPU ranks with tiny
sizes, and its arithmetic (efficiencies, memory estimate, row merging)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from helpers import launch, mpiexec

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import mpi_scaling  # noqa: E402
from benchmarks._mpi_layer import memory_estimate  # noqa: E402

TINY = ["--cpu", "--check-len", "320", "--weak-per-gpu", "256", "--strong-len", "1024", "--query-chunk", "128",
        "--topk", "32", "--index-heads", "4", "--index-dim", "16", "--heads", "2", "--d-qk", "24", "--d-v", "16"]


@pytest.mark.mpi
def test_harness_runs_checks_and_reports_on_cpu_ranks(tmp_path):
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    for ranks, parts in ((1, ["check", "weak", "strong"]), (2, ["check", "weak", "strong", "probe"])):
        job = launch([mpiexec(), "-n", str(ranks), sys.executable, "-m", "benchmarks.mpi_scaling", "--out",
                      str(tmp_path), "--parts", *parts, "--probe-len", "2048", *TINY], cwd=ROOT, PYTHONPATH=path)
        assert job.returncode == 0, job.stdout
    done = launch([sys.executable, "-m", "benchmarks.mpi_scaling", "--report", str(tmp_path / "mpi_scaling.json")],
                  cwd=ROOT, PYTHONPATH=path)
    assert done.returncode == 0, done.stdout
    rows = json.loads((tmp_path / "mpi_scaling.json").read_text())["rows"]
    got = {(r["config"]["part"], r["config"]["ranks"], r["config"]["seq_len"]) for r in rows}
    assert got == {("check", 1, 320), ("check", 2, 320), ("weak", 1, 256), ("weak", 2, 512), ("strong", 1, 1024),
                   ("strong", 2, 1024), ("probe", 2, 2048)}
    assert all(r["status"] == "ok" and r["bytes_match_model"] for r in rows)
    check = next(r for r in rows if r["config"]["part"] == "check" and r["config"]["ranks"] == 2)
    assert check["check_ok"] and check["check"]["selection"]["bitwise"]
    strong = next(r for r in rows if r["config"]["part"] == "strong" and r["config"]["ranks"] == 2)
    assert strong["config"]["query_chunk"] == 128 and strong["config"]["exchange"] == "allgather"  # chunks
    assert set(strong["group_ms"]) == {"selection", "communication", "attention"}
    assert {"strong", "weak"} == {r["config"]["part"] for r in rows if "efficiency" in r}
    assert "weak scaling efficiency, per unit of work: P=1: 100.0%" in done.stdout
    assert "longest sequence, one DSA layer fwd + bwd on P=2: N=2048" in done.stdout


def row(part, ranks, n, selection, attention, communication, pairs, queries):
    return {"config": {"part": part, "ranks": ranks, "seq_len": n, "query_chunk": None}, "status": "ok",
            "median_ms": selection + attention + communication,
            "group_ms": {"selection": selection, "attention": attention, "communication": communication},
            "work": {"causal_pairs_per_rank": pairs, "queries_per_rank": queries}}


def test_efficiencies_normalise_weak_scaling_by_work():
    rows = [row("weak", 1, 100, 40.0, 50.0, 10.0, [5050], [100]),
            # twice the pairs per rank, the same queries: ideal = 10 + 2 * 40 + 50 = 140 ms
            row("weak", 2, 200, 80.0, 50.0, 45.0, [10100, 10000], [100, 100]),
            row("strong", 1, 400, 300.0, 90.0, 10.0, [80200], [400]),
            row("strong", 2, 400, 150.0, 45.0, 55.0, [40100, 40100], [200, 200])]
    eff = mpi_scaling.efficiencies(rows)
    assert eff["weak"] == {1: 1.0, 2: 100.0 / 175.0}
    assert eff["weak_work"][1] == 1.0 and eff["weak_work"][2] == pytest.approx(140.0 / 175.0)
    assert eff["strong"] == {1: 1.0, 2: 400.0 / (250.0 * 2)}


def test_merge_replaces_rows_of_the_same_run(tmp_path):
    first = row("probe", 4, 2048, 1.0, 1.0, 1.0, [1], [1])
    mpi_scaling.write_results(mpi_scaling.NAME, "dev", [first, row("weak", 4, 2048, 1.0, 1.0, 1.0, [1], [1])],
                              tmp_path)
    again = {**first, "status": "started, not finished (the job ended)"}
    rows = mpi_scaling.merge_rows(tmp_path / "mpi_scaling.json", [again])
    assert [r["config"]["part"] for r in rows] == ["weak", "probe"] and rows[1]["status"].startswith("started")


def test_memory_estimate_at_dsa_shapes():
    args = argparse.Namespace(topk=2048, index_heads=64, index_dim=128, heads=64, d_qk=576, d_v=512)
    whole_1m_on_4 = memory_estimate(args, "bfloat16", 1 << 20, 4, None) / 2**30
    assert 80 < whole_1m_on_4 < 100  # fits an H200 (140 GiB); 2M on 4 does not
    assert memory_estimate(args, "bfloat16", 2 << 20, 4, None) / 2**30 > 160
    chunked_1m_on_1 = memory_estimate(args, "bfloat16", 1 << 20, 1, 131072) / 2**30
    assert chunked_1m_on_1 < 100  # the strong-scaling baseline fits one GPU in chunks
    assert memory_estimate(args, "bfloat16", 1 << 20, 1, None) / 2**30 > 280  # whole: q, out, dout, dq alone
