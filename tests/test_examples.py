"""The examples run as a user runs them (a subprocess from the repository root)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_train_tiny_dsa_quick_learns_saves_and_logs(tmp_path):
    from hyscale_core.io import LogReplaySource, SelectionLog

    done = run_example("train_tiny_dsa.py", "--quick", "--device", "cpu", "--out", str(tmp_path),
                       "--log", str(tmp_path / "rollout.h5"))
    history = json.loads((tmp_path / "history.json").read_text())["history"]
    assert [h["stage"] for h in history] == ["init", "dense", "sparse"]
    assert history[-1]["loss"] < history[0]["loss"]  # a few steps already lower the loss
    assert all(0 <= r <= 1 for h in history for r in h["recall"])
    assert "needle recall" in done.stdout and "6/6" in done.stdout  # eval lines and the progress bar
    config = json.loads((tmp_path / "config.json").read_text())
    with np.load(tmp_path / "params.npz") as params:
        assert params["embed"].shape == (config["model"]["vocab"], config["model"]["d_model"])
    with SelectionLog(tmp_path / "rollout.h5") as log:
        assert log.samples() == ["L64-top8-seed0-0", "L64-top8-seed0-1"]
        info = log.info("L64-top8-seed0-0", "layer0")
        assert info.shape == (4 * 64, 8) and info.causal and list(info.cu_seqlens) == [0, 64, 128, 192, 256]
    with LogReplaySource(tmp_path / "rollout.h5", "L64-top8-seed0-1") as source:
        table = source.selection("layer0")  # fingerprint-checked
    assert table.dtype == np.int32 and ((table >= -1) & (table < 256)).all()
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "curves.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in done.stdout
    # the replay diagnostic loads what the example saved
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import replay_drift

    replay_drift.main(["--model", str(tmp_path), "--length", "64", "--sequences", "2", "--batches", "1",
                       "--dsa-n", "0", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "replay_drift.json").read_text())["rows"]
    assert rows[0]["impl"] == "replay (HyScale)" and rows[0]["bitwise"] and rows[0]["config"]["model"].startswith(
        "trained")


def test_train_tiny_dsa_log_append_adds_another_seeds_samples(tmp_path):
    first = ["--quick", "--device", "cpu", "--steps", "0", "--out", str(tmp_path), "--log", str(tmp_path / "a.h5")]
    run_example("train_tiny_dsa.py", *first)
    again = [*first, "--log-append", "--log-samples", "1"]
    taken = run_example_fails("train_tiny_dsa.py", *again)  # the same seed's names: refused before any step
    assert "already holds samples L64-top8-seed0-0" in taken.stderr and "step" not in taken.stdout
    run_example("train_tiny_dsa.py", *again, "--seed", "1", "--load", str(tmp_path / "params.npz"))
    from hyscale_core.io import SelectionLog

    with SelectionLog(tmp_path / "a.h5") as log:
        assert log.samples() == ["L64-top8-seed0-0", "L64-top8-seed0-1", "L64-top8-seed1-0"]


def run_example_fails(name: str, *args: str) -> subprocess.CompletedProcess:
    """A run that must stop with a usage error: exit 2, one line on stderr after the usage, no traceback."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"{name}: error: "), done.stderr
    return done


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bad, message", [
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--eval-every", "-1"], "--eval-every must be >= 1"),
    (["--eval-sequences", "0"], "--eval-sequences must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--steps", "-1"], "--steps must be >= 0"),
    (["--topk", "0"], "--topk must be in [1, "),
    (["--log-topk", "-1"], "--log-topk must be in [1, "),
    (["--length", "0"], "--length 0: "),
    (["--warmup-length", "4"], "--warmup-length 4: "),
    (["--log-length", "0"], "--log-length 0: "),
    (["--lr", "nan"], "--lr must be finite and > 0"),
    (["--lr", "0"], "--lr must be finite and > 0"),
    (["--tokens", "100"], "--tokens 100 holds no whole sequence of --length 512"),
    (["--tokens", "40", "--length", "32"], "--tokens 40 holds no whole sequence of --warmup-length 64"),
    (["--log-samples", "0"], "--log-samples must be >= 1"),
    (["--log-sequences", "0"], "--log-sequences must be >= 1"),
    (["--log-append"], "--log-append needs --log"),
    (["--quick", "--topk", "0"], "--topk must be in [1, "),
])
def test_train_tiny_dsa_bad_option_is_a_usage_error(bad, message, capsys):
    with pytest.raises(SystemExit) as stop:
        load_example("train_tiny_dsa.py").parse(bad)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_train_tiny_dsa_bad_paths_are_usage_errors(tmp_path, capsys):
    main = load_example("train_tiny_dsa.py").main
    (tmp_path / "file").write_text("not a folder, not a log")
    for bad, message in [(["--load", str(tmp_path / "none.npz")], "no such file"),
                         (["--out", str(tmp_path / "file")], "exists and is not a folder"),
                         (["--log", str(tmp_path / "none" / "a.h5")], "no folder"),
                         (["--log", str(tmp_path)], "is a folder"),
                         (["--log", str(tmp_path / "file"), "--log-append"], "cannot be read as a SelectionLog")]:
        with pytest.raises(SystemExit) as stop:
            main(["--device", "cpu", *bad])
        assert stop.value.code == 2 and message in capsys.readouterr().err, bad
    example = load_example("train_tiny_dsa.py")
    new = tmp_path / "new"  # --out is made before the log is written, so the log may lie in it
    assert example.path_problem(example.parse(["--out", str(new), "--log", str(new / "a.h5")]), lead=True) is None


def test_train_tiny_dsa_options_given_with_quick_still_apply():
    args = load_example("train_tiny_dsa.py").parse(["--quick", "--steps", "50", "--topk", "4", "--log-samples", "1"])
    assert (args.steps, args.topk, args.log_topk, args.log_samples) == (50, 4, 4, 1)
    assert (args.length, args.warmup_steps, args.tokens) == (64, 3, 256)  # the rest from --quick


def test_train_tiny_dsa_usage_error_exits_before_training():
    done = run_example_fails("train_tiny_dsa.py", "--device", "cpu", "--eval-sequences", "0")
    assert done.stdout == ""


def test_jax_dlpack_example():
    done = run_example("jax_dlpack.py")
    if importlib.util.find_spec("jax") is None:
        assert "JAX is not installed" in done.stdout
    else:
        assert done.stdout.count("zero-copy") >= 5  # every input crosses without a copy
        assert "selections shared with JAX's own top-k" in done.stdout  # >= 99%, or the example exits 1


def test_jax_dlpack_selection_check_counts_keys_missing_on_either_side():
    shared_fraction = load_example("jax_dlpack.py").shared_fraction
    theirs = np.array([[0, 1, 2], [3, 4, -1]])
    assert shared_fraction(theirs.copy(), theirs) == 1.0
    assert shared_fraction(np.array([[0, 1, -1], [3, 4, -1]]), theirs) == 0.5 * (2 / 3 + 1)  # we miss key 2
    assert shared_fraction(np.array([[0, 1, 2], [3, 4, 5]]), theirs) == 0.5 * (1 + 2 / 3)  # we add key 5
