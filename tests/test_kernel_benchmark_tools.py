"""The kernel benchmarks' CPU-side tools: the A/B variants and the
forward's phase marks still find the kernel code they rewrite, the phases'
summaries read their records right, ncu_regions splits a source view where
the warps synchronise, the slot orders of sparse_attention_order keep each
row's keys (with torch only), ab_runs alternates trees and merges their
rows, ab_trees copies commits for it, the indexer accuracy check
counts picks outside the exact top-k, indexer_bits compares two trees'
outputs byte for byte, indexer_timeline reads the probe's slots in
the kernel's order, the GEMM floor's matmul run covers the FLOPs it
stands for, and gpu_clocks sorts nvidia-smi's samples into their phases."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the benchmarks package sits beside tests/ (plain `pytest` does not add the root)
    sys.path.insert(0, str(ROOT))
from benchmarks import ncu_regions, sparse_attention_variants  # noqa: E402


@pytest.mark.parametrize("variant", sparse_attention_variants.VARIANTS)
def test_every_variant_rewrites_the_current_kernels(tmp_path, variant):
    """A variant stops with an error when its quoted kernel lines are gone
    (a kernel edit broke it); here each one applies and changes its file."""
    shutil.copytree(ROOT / "cuda", tmp_path / "cuda")
    kernel = "sparse_attention_dq.cuh" if variant.startswith("dq_") else "sparse_attention.cu"
    before = (tmp_path / "cuda" / kernel).read_text()
    sparse_attention_variants.patch(tmp_path, variant)
    assert (tmp_path / "cuda" / kernel).read_text() != before


def test_a_missing_quote_stops_the_patch(tmp_path):
    shutil.copytree(ROOT / "cuda", tmp_path / "cuda")
    path = tmp_path / "cuda" / "sparse_attention_dq.cuh"
    path.write_text(path.read_text().replace("add_ds_kv(acc, rope, ds_tile, kv_tile, ln);", "add_ds_kv();"))
    with pytest.raises(SystemExit, match="the code this variant rewrites is not there"):
        sparse_attention_variants.patch(tmp_path, "dq_gathers_only")


@pytest.mark.parametrize("variant", [None, *sparse_attention_variants.FORWARD_CUTS])
def test_phase_marks_find_their_places_in_the_forward(variant):
    """sparse_attention_phases instruments the current forward (and its
    A/B variants): every mark goes in exactly once, after the trace's globals."""
    from benchmarks import sparse_attention_phases as phases

    text = (ROOT / "cuda" / "sparse_attention.cu").read_text()
    if variant:
        text = sparse_attention_variants.forward_variant(text, variant)
    marked = phases.instrumented_source(text)
    for _, mark, _ in phases._MARKS:
        assert marked.count(f"{mark};") == 1, mark
    assert marked.index("hs_sa_points[") < marked.index("HS_START();")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_phase_marks_leave_the_wgmma_schedule_alone(tmp_path):
    """No mark sits where ptxas would have to add warpgroup.arrive (C7519)
    or serialise wgmma: the instrumented kernel runs the library's schedule."""
    import subprocess

    from benchmarks import sparse_attention_phases as phases

    source = tmp_path / "sparse_attention_marked.cu"
    source.write_text(phases.instrumented_source((ROOT / "cuda" / "sparse_attention.cu").read_text()))
    result = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-Xptxas=-v",
                             f"-I{ROOT / 'cuda'}", "-c", str(source), "-o", str(tmp_path / "out.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "C7519" not in result.stderr and "Potential Performance Loss" not in result.stderr, result.stderr
    assert "0 bytes spill stores" in result.stderr, result.stderr


def test_a_moved_anchor_stops_the_phase_marks():
    from benchmarks import sparse_attention_phases as phases

    text = (ROOT / "cuda" / "sparse_attention.cu").read_text().replace("    Tiles tl;\n", "    Tiles tiles;\n")
    with pytest.raises(RuntimeError, match="anchor not found once"):
        phases.instrumented_source(text)


def test_phase_records_give_clock_item_gap_and_spans():
    import numpy as np

    from benchmarks import sparse_attention_phases as phases

    # smid, clock start, clock end wg0 / wg1, globaltimer start, end wg0 / wg1 (ns), unused
    ends = np.array([[0, 100, 1100, 1200, 0, 500, 600, 0],     # 1100 cycles in 600 ns
                     [0, 1300, 2300, 2300, 1000, 1600, 1600, 0],  # on SM 0, 100 cycles after the first
                     [1, 50, 1250, 1250, 0, 600, 600, 0]])
    ghz, item, gap = phases.ends_summary(ends)
    assert (round(ghz, 4), item, gap) == (round(1100 / 600, 4), 1100.0, 100.0)
    points = np.zeros((2, phases.POINTS), dtype=np.int64)
    points[:, :7] = [0, 10, 12, 370, 380, 400, 410]  # start, count, q, loop ends, outs
    for i in range(4):
        points[:, 8 + 16 * i] = 20 + 100 * i  # warpgroup 0's logits of pair i
    got = phases.spans(points, pairs=4)
    assert got == {"counted": 10, "q": 12, "first": 20, "pair first": 100, "pair middle": 100,
                   "pair last": 50, "out": 30}


def test_ncu_regions_cut_at_synchronising_instructions(tmp_path):
    csv = tmp_path / "source.csv"
    lines = ['"Kernel view"', '"Address","Source","Warp Stall Sampling (All Samples)"']
    sass = [("LDG.E R2, [R4]", 1), ("BAR.SYNC.DEFER_BLOCKING 0x0", 3),  # stretch 0-1: 4 samples
            ("HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", 2),  # a group's first wgmma closes 2-2
            ("HGMMA.64x32x16.F32.BF16 R24, gdesc[UR6], R24", 1), ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 6),  # 3-4: 7
            ("FADD R1, R2, R3", 0), ("EXIT", 7)]  # 5-6: 7
    lines += [f'"{16 * i:x}","{text}","{samples}"' for i, (text, samples) in enumerate(sass)]
    csv.write_text("\n".join(lines) + "\n")
    got = [(first, last, round(share, 6)) for first, last, share, _ in ncu_regions.regions(csv)]
    assert got == [(0, 1, 20.0), (2, 2, 10.0), (3, 4, 35.0), (5, 6, 35.0)]


def test_timeline_sums_idle_overlap_and_alone_time():
    from benchmarks import sparse_attention_timeline as timeline

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "dq", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"cat": "kernel", "name": "rows", "ts": 6, "dur": 6, "args": {"stream": 9}},  # beside dq 6-10
        {"cat": "kernel", "name": "dq", "ts": 15, "dur": 5, "args": {"stream": 7}},  # idle 12-15
        {"cat": "cpu_op", "name": "not a kernel", "ts": 0, "dur": 99},
    ]}
    got = timeline.summarise(timeline.kernel_events(trace))
    assert (got["span_ms"], got["idle_ms"], got["overlap_ms"]) == (0.02, 0.003, 0.004)
    assert got["kernels"]["dq"] == {"launches": 2, "total_ms": 0.015, "alone_ms": 0.011}
    assert got["kernels"]["rows"] == {"launches": 1, "total_ms": 0.006, "alone_ms": 0.002}
    assert got["gaps"] == [{"at_ms": 0.012, "ms": 0.003, "after": "rows", "before": "dq"}]


def test_slot_orders_keep_each_rows_keys():
    torch = pytest.importorskip("torch")
    from benchmarks import sparse_attention_order as order

    idx = torch.tensor([[5, 3, -1, 1], [7, 2, 9, 0], [4, 4, 1, 8], [-1, -1, -1, -1]], dtype=torch.int32)
    assert order.sorted_rows(torch, idx).tolist() == [[1, 3, 5, -1], [0, 2, 7, 9], [1, 4, 4, 8], [-1, -1, -1, -1]]
    # row t rotated left by floor(t k / Q) mod v slots among its v keys; -1 slots stay last
    swept = order.swept_rows(torch, idx, 2).tolist()
    assert swept == [[1, 3, 5, -1], [7, 9, 0, 2], [1, 4, 4, 8], [-1, -1, -1, -1]]
    assert order.ordered(torch, idx, "given") is idx


FAKE_BENCH = '''
import argparse, json, os
from pathlib import Path

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    tree = Path(__file__).resolve().parent.parent.name
    rows = [{"bench": "fake", "config": {"n": args.size}, "impl": "hs", "median_ms": float(len(tree))}]
    payload = {"device": "none", "date": "today", "commit": os.environ.get("HYSCALE_COMMIT", "checkout"), "rows": rows}
    Path(args.out, "fake.json").write_text(json.dumps(payload))

main()
'''


def test_ab_runs_alternates_the_trees_and_merges_their_rows(tmp_path, capsys):
    from benchmarks import ab_runs

    for name in ("one", "three"):
        (tmp_path / name / "benchmarks").mkdir(parents=True)
        (tmp_path / name / "benchmarks" / "__init__.py").write_text("")
        (tmp_path / name / "benchmarks" / "fake.py").write_text(FAKE_BENCH)
    ab_runs.main(["--tree", f"a={tmp_path / 'one'}@c0ffee", "--tree", f"b={tmp_path / 'three'}", "--rounds", "2",
                  "--out", str(tmp_path / "merged"), "--", "fake", "--size", "7"])
    merged = json.loads((tmp_path / "merged" / "fake_ab.json").read_text())
    assert [(r["tree"], r["round"], r["median_ms"]) for r in merged["rows"]] == [
        ("a", 1, 3.0), ("b", 1, 5.0), ("a", 2, 3.0), ("b", 2, 5.0)]
    assert merged["commits"] == {"a": "c0ffee", "b": "checkout"} and merged["command"] == "fake --size 7"
    assert "3 / 3" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        ab_runs.main(["--tree", "nolabel", "--", "fake"])


def test_indexer_quick_rows_carry_each_timed_call():
    from benchmarks import indexer_gpu_quick

    line = {"label": "x", "n": 4096, "heads": 64, "guess_beta": 1.75, "tie_run": 1, "scores_ms": 3.5,
            "topk256_ms": 4.0, "topk256_reselected": 0, "topk2048_ms": 5.25, "topk2048_reselected": 2}
    rows = indexer_gpu_quick.result_rows(line, repeats=3)
    assert [(r["impl"], r["median_ms"]) for r in rows] == [
        ("scores alone", 3.5), ("indexer_topk k=256", 4.0), ("indexer_topk k=2048", 5.25)]
    assert rows[2]["reselected_rows"] == 2
    assert rows[2]["config"] == {"n": 4096, "heads": 64, "guess_beta": 1.75, "tie_run": 1}


def test_indexer_quick_repeated_keys_hold_each_row_that_often():
    import numpy as np

    from benchmarks import indexer_gpu_quick

    k = np.arange(10 * 4, dtype=np.float16).reshape(10, 4)
    tied = indexer_gpu_quick.repeated_keys(np, k, 3)
    assert tied.dtype == np.float16
    rows, counts = np.unique(tied, axis=0, return_counts=True)
    np.testing.assert_array_equal(rows, k[:4])  # rows 0..3 of k, three copies each but the last
    assert counts.tolist() == [3, 3, 3, 1]
    assert not (tied[:, 0] == np.sort(tied[:, 0])).all()  # the copies are scattered


def test_indexer_accuracy_counts_picks_outside_the_exact_topk():
    import numpy as np

    from benchmarks import indexer_accuracy_gpu

    ref = np.array([[5.0, 4.0, 3.0, -np.inf], [1.0, 2.0, 3.0, 4.0]])
    exact = np.array([[1, 0], [3, 2]])  # each row's top 2, in any order
    assert indexer_accuracy_gpu.picks_outside(exact, ref, 2) == 0
    one_off = np.array([[0, 2], [3, 2]])  # key 2 in place of key 1: one of four picks
    assert indexer_accuracy_gpu.picks_outside(one_off, ref, 2) == 0.25


@pytest.mark.skipif(shutil.which("git") is None, reason="git not on PATH")
def test_ab_trees_copy_commits_without_results_and_git_ignores_them(tmp_path, capsys):
    import subprocess

    from benchmarks import ab_trees

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "run.py").write_text("first\n")
    (tmp_path / "benchmarks" / "results" / "big.json").write_text("{}\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    git("branch", "feature/x")
    (tmp_path / "benchmarks" / "run.py").write_text("second\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    first, second = git("rev-parse", "--short", "feature/x"), git("rev-parse", "--short", "HEAD")

    ab_trees.main(["--repo", str(tmp_path), "feature/x", "HEAD"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["carry: ab_feature-x ab_HEAD",
                     f"--tree feature-x=ab_feature-x@{first} --tree HEAD=ab_HEAD@{second}"]
    assert (tmp_path / "ab_feature-x" / "benchmarks" / "run.py").read_text() == "first\n"
    assert (tmp_path / "ab_HEAD" / "benchmarks" / "run.py").read_text() == "second\n"
    assert list((tmp_path / "ab_HEAD" / "benchmarks" / "results").iterdir()) == []
    assert git("status", "--porcelain") == ""  # the copies are ignored

    ab_trees.main(["--repo", str(tmp_path), "--remove", "feature/x", "HEAD"])
    assert not (tmp_path / "ab_feature-x").exists() and not (tmp_path / "ab_HEAD").exists()


def test_indexer_bits_compares_bytes_and_refuses_one_package_twice(tmp_path, capsys):
    import numpy as np

    from benchmarks import indexer_bits

    scores = np.array([[1.5, 0.0, -np.inf]], dtype=np.float32)
    np.savez(tmp_path / "a.npz", package=np.array("/trees/a"), sc_x=scores, idx_x=np.array([[0, 1]]))
    np.savez(tmp_path / "b.npz", package=np.array("/trees/b"), sc_x=scores.copy(), idx_x=np.array([[0, 1]]))
    indexer_bits.main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")])
    assert "IDENTICAL (2 arrays)" in capsys.readouterr().out
    other = scores.copy()
    other[0, 1] = -0.0  # equal as numbers, not as bits
    np.savez(tmp_path / "c.npz", package=np.array("/trees/c"), sc_x=other, idx_x=np.array([[0, 1]]))
    with pytest.raises(SystemExit) as stop:
        indexer_bits.main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "c.npz")])
    assert stop.value.code == 1 and "DIFFERENT: sc_x" in capsys.readouterr().out
    np.savez(tmp_path / "d.npz", package=np.array("/trees/a"), sc_x=scores, idx_x=np.array([[0, 1]]))
    with pytest.raises(SystemExit, match="compare nothing"):
        indexer_bits.main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "d.npz")])


def test_indexer_timeline_slots_follow_the_kernel_and_sum_up():
    """The probe's slot names are cuda/indexer_probe.cuh's enum in order, and
    the summary turns slot sums into shares, cycles per tile and per query."""
    import re

    from benchmarks import indexer_timeline as tl

    enum = (ROOT / "cuda" / "indexer_probe.cuh").read_text()
    body = re.search(r"enum ProbeSlot \{(.*?)\};", enum, re.S).group(1)
    names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
    assert names[-1] == "PROBE_SLOTS"
    as_python = [re.sub(r"^[PN]_", "", n).lower() for n in names[:-1]]
    assert as_python == tl.SLOTS

    slots = dict.fromkeys(tl.SLOTS, 0)
    slots.update(issue=400, hi_sums=100, final=300, next_group=100, final_sort=200, tiles=2, groups=1,
                 total_cycles=1000, final_prunes=2, final_candidates=6000, sort_rounds=4, sort_passes=12)
    summary = tl.summarise([slots[n] for n in tl.SLOTS], queries=4)
    assert summary["steps"]["issue"] == {"share_pct": 40.0, "cycles_per_tile": 200.0}
    assert summary["cycles_per_tile"] == 500.0 and summary["unaccounted_pct"] == 10.0
    assert summary["final_per_query"]["final"] == 75 and summary["final_per_query"]["final_sort"] == 50
    assert summary["candidates_per_final_prune"] == 3000.0 and summary["sort_passes_per_query"] == 3.0
    assert "issue" in tl.report(summary)


@pytest.mark.parametrize("flops", [1.0, 5.5e11, 2 * 8192.0**3, 1.4074e14, 1.1259e16])
def test_matmul_run_covers_the_flops_it_stands_for(flops):
    """Whole 8192^3 products and one [8192, m] product: m a multiple of 128,
    the FLOPs run within 2 * 8192^2 * 128 of those asked for."""
    from benchmarks.common import matmul_run_plan

    n = 8192
    whole, m, run = matmul_run_plan(flops)
    assert m % 128 == 0 and 128 <= m <= n
    assert run == whole * 2 * n**3 + 2 * n * n * m
    assert abs(run - flops) <= 2 * n * n * 128


def test_gpu_clocks_sorts_samples_into_their_phases():
    """Each phase gets the samples between its start and end: the clock's
    median and percentiles, the median power and the power cap's share;
    unreadable lines are skipped and a phase without samples says so."""
    from datetime import datetime

    from benchmarks import gpu_clocks

    lines = ["2026/12/07 10:00:00.000, 1400, 690.5, Active",
             "2026/12/07 10:00:00.050, 1500, 699.0, Active",
             "2026/12/07 10:00:00.100, 1600, 701.0, Not Active",
             "[N/A], garbage",
             "2026/12/07 10:00:01.000, 1980, 120.0, Not Active"]
    samples = gpu_clocks.parse_samples(lines)
    assert len(samples) == 4 and samples[0][3] is True and samples[2][3] is False
    at = lambda s: datetime.strptime(f"2026/12/07 10:00:{s}", gpu_clocks.FMT)  # noqa: E731
    rows = gpu_clocks.summarise(samples, [("topk1", at("00.000"), at("00.100"), 3, 250.0, {}),
                                          ("idle", at("02.000"), at("03.000"), 1, 1.0, {"tflops": 0.0})])
    assert rows[0]["samples"] == 3 and rows[0]["sm_mhz_median"] == 1500.0
    assert rows[0]["sm_mhz_p10"] == 1420.0 and rows[0]["sm_mhz_p90"] == 1580.0
    assert rows[0]["power_w_median"] == 699.0 and rows[0]["power_cap_fraction"] == round(2 / 3, 3)
    assert rows[1] == {"phase": "idle", "steps": 1, "ms_per_step": 1.0, "samples": 0, "tflops": 0.0}
    without_cap = gpu_clocks.parse_samples(["2026/12/07 10:00:00.000, 1400, 690.5"])
    assert without_cap[0][3] is None
    assert gpu_clocks.summarise(without_cap, [("m", at("00.000"), at("00.000"), 1, 1.0, {})])[0][
        "power_cap_fraction"] is None
