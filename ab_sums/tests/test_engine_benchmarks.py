"""The engine's benchmarks (layer table, replay diagnostic) run on tiny CPU shapes."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

import hyscale_core as hs

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # the benchmarks package sits beside tests/ (plain `pytest` does not add the root)
    sys.path.insert(0, ROOT)
from benchmarks import layer_step, replay_drift  # noqa: E402

TINY_LAYER = ["--index-heads", "4", "--index-dim", "16", "--heads", "2", "--d-qk", "24", "--d-v", "16",
              "--rope-dim", "8", "--topk", "16", "--d-model", "32", "--d-ff", "64", "--device", "cpu"]


def test_layer_step_rows_selection_counts_and_plot(tmp_path, capsys):
    layer_step.main(["--sizes", "96", "160", "--impls", "baseline", "hyscale", "hyscale, no replay",
                     "--out", str(tmp_path), *TINY_LAYER])
    rows = json.loads((tmp_path / "layer_step.json").read_text())["rows"]
    assert [(r["config"]["n"], r["kind"]) for r in rows] == [
        (n, kind) for n in (96, 160) for kind in ("baseline", "hyscale", "hyscale, no replay")]
    for r in rows:
        assert r["selections_per_step"] == (1 if r["kind"] == "hyscale" else 2)  # replay selects once
        assert 0 < r["selection_ms"] < r["median_ms"] and r["speedup"] > 0
        if r["kind"] == "baseline":
            assert r["speedup"] == 1.0 and "no torch" in r["impl"]
    if importlib.util.find_spec("matplotlib"):
        (tmp_path / "layer_step.png").unlink()
        layer_step.main(["--plot", str(tmp_path / "layer_step.json")])
        assert (tmp_path / "layer_step.png").stat().st_size > 0
    assert "N=160 H_I=4 hyscale:" in capsys.readouterr().out


def test_layer_step_skips_what_the_budget_cannot_hold(tmp_path, capsys):
    layer_step.main(["--sizes", "64", "--budget-s", "0", "--out", str(tmp_path), *TINY_LAYER])
    assert "N=64 H_I=4: skipped, predicted" in capsys.readouterr().out
    assert not (tmp_path / "layer_step.json").exists()


def test_materialised_baseline_selects_exactly_what_hyscale_selects():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((300, 4, 16), dtype=np.float32)
    k = rng.standard_normal((300, 16), dtype=np.float32)
    w = rng.standard_normal((300, 4), dtype=np.float32)
    assert layer_step.host_materialised(7)(q, k, w, 40).tobytes() == hs.indexer_topk(q, k, w, 40).tobytes()


def test_flips_counts_keys_missing_from_the_second_selection():
    forward = np.array([[0, 1, 2], [3, 1, -1], [2, 0, 1]])
    again = np.array([[2, 1, 0], [3, 4, -1], [5, 6, 1]])
    assert replay_drift.flips(forward, again) == (3, 2, 8)


def test_replay_drift_replay_is_exact_and_variants_are_reported(tmp_path):
    replay_drift.main(["--length", "64", "--sequences", "2", "--batches", "1", "--dsa-n", "256", "--dsa-heads", "4",
                       "--dsa-dim", "16", "--dsa-topk", "16", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "replay_drift.json").read_text())["rows"]
    model = {r["impl"]: r for r in rows if r["kind"] == "model"}
    for exact in ("replay (HyScale)", "select again, same kernel (hs.indexer_topk)"):
        assert model[exact]["flipped"] == 0 and model[exact]["bitwise"] and model[exact]["grad_rel_max"] == 0
    assert len(model) == 2 + len(replay_drift.VARIANTS)
    shape = [r for r in rows if r["kind"] == "dsa_shape"]
    assert len(shape) == len(replay_drift.VARIANTS) and all(0 <= r["flipped"] <= 1 for r in shape)
