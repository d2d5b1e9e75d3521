"""examples/train_tiny_dsa.py under `mpiexec -n 2` against one process, and the
ShardedRunner it uses (tests/mpi_ranks.py "runner") on 2 and 3 ranks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import mpi_ranks as cases
from helpers import launch, mpiexec, run_ranks

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_dsa.py"
# Losses and indexer KLs of the sharded run against one process: float32 rounding
# of partial sums over ranks, carried through 6 AdamW steps (measured <= 3.2e-7).
LOSS_RTOL = 1e-5
# Parameters after 6 steps (|p| <= 4; measured max difference 7.5e-5): AdamW turns
# rounding-level gradient differences of near-zero gradients into lr-sized steps.
PARAM_ATOL = 1e-3


def quick_run(out: Path, *launcher: str) -> tuple[str, list[dict], dict, list[np.ndarray]]:
    """(stdout, history, parameters, the rollout log's selections) of a --quick run."""
    from hyscale_core.io import SelectionLog

    done = launch([*launcher, sys.executable, str(EXAMPLE), "--quick", "--device", "cpu", "--out", str(out),
                   "--log", str(out / "rollout.h5")])
    assert done.returncode == 0, done.stdout
    history = json.loads((out / "history.json").read_text())["history"]
    with np.load(out / "params.npz") as params:
        state = dict(params)
    with SelectionLog(out / "rollout.h5") as log:
        selections = [log.read(sample, layer) for sample, layer in log.keys()]
    return done.stdout, history, state, selections


@pytest.mark.mpi
def test_train_tiny_dsa_under_mpiexec_matches_one_process(tmp_path):
    _, one, one_params, one_selections = quick_run(tmp_path / "one")
    stdout, two, two_params, two_selections = quick_run(tmp_path / "two", mpiexec(), "-n", "2")
    # rank 0 alone prints: one header, one final progress line
    assert stdout.count("hyscale-core ") == 1 and "sharded over 2 MPI ranks" in stdout
    assert stdout.count("6/6") == 1
    assert [h["step"] for h in two] == [h["step"] for h in one] == [0, 3, 6]
    for a, b in zip(one, two):
        for key in ("loss", "train_loss"):
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=LOSS_RTOL, err_msg=f"step {a['step']} {key}")
        np.testing.assert_allclose(b["kl"], a["kl"], rtol=LOSS_RTOL)
        assert (b["accuracy"], b["recall"]) == (a["accuracy"], a["recall"])
    assert len(two_selections) == len(one_selections) == 2  # the trained model's rollout: same selections
    for a, b in zip(one_selections, two_selections):
        np.testing.assert_array_equal(b, a)
    for name, value in one_params.items():
        np.testing.assert_allclose(two_params[name], value, rtol=0, atol=PARAM_ATOL, err_msg=name)


@pytest.mark.mpi
def test_train_tiny_dsa_bad_path_under_mpiexec_is_a_usage_error_on_every_rank(tmp_path):
    done = launch([mpiexec(), "-n", "2", sys.executable, str(EXAMPLE), "--quick", "--device", "cpu",
                   "--out", str(tmp_path), "--log", str(tmp_path / "none" / "a.h5")])
    assert done.returncode == 2 and "Traceback" not in done.stdout, done.stdout
    assert done.stdout.count("error: --log ") == 2 and "hyscale-core " not in done.stdout  # no rank trained


def single_process_runner_steps() -> list[dict]:
    """What mpi_ranks.run_runner records, in one process with the engine's TinyDSA."""
    from hyscale_core.engine import AdamW, LiveSelection, TinyDSA, backward

    model = TinyDSA(cases.engine_config(), seed=1)
    opt, steps = AdamW(model.parameters()), []
    for step, (ids, rows, targets, cu) in enumerate(cases.runner_batches()):
        selector = LiveSelection(cases.RUNNER_TOPK, cu_seqlens=cu)
        out = model.forward(ids, rows, targets, selector, recompute=step % 2 == 0, kl_on_loss_rows=True)
        backward(out.loss)
        opt.step()
        steps.append({"total": [out.total] + out.kls, "logits": out.logits, "store": selector.store,
                      "params": np.concatenate([p.data.reshape(-1) for p in model.parameters()])})
    return steps


@pytest.mark.mpi
@pytest.mark.parametrize("n_ranks", [2, 3])
def test_sharded_runner_keeps_every_rank_identical_and_matches_one_process(tmp_path, n_ranks):
    done = run_ranks(n_ranks, tmp_path / "runner.npz", "runner")
    assert done.returncode == 0, done.stdout
    got = dict(np.load(tmp_path / "runner.npz"))
    for step, ref in enumerate(single_process_runner_steps()):
        key = f"runner/{step}"
        for name in ("total", "logits", "params"):  # [P, ...]: every rank holds the same bits
            assert all(r.tobytes() == got[f"{key}/{name}"][0].tobytes() for r in got[f"{key}/{name}"]), name
        np.testing.assert_allclose(got[f"{key}/total"][0], ref["total"], rtol=1e-5)
        np.testing.assert_allclose(got[f"{key}/logits"][0], ref["logits"], rtol=0, atol=1e-5)
        for layer in ref["store"].layers():
            for rank_selection in got[f"{key}/selection/{layer}"]:
                np.testing.assert_array_equal(rank_selection, ref["store"].selection(layer))
        np.testing.assert_allclose(got[f"{key}/params"][0], ref["params"], rtol=0, atol=1e-5)


def test_launched_world_is_none_without_a_launcher(monkeypatch):
    from hyscale_core.mpi import launched_world
    from hyscale_core.mpi.shard import LAUNCHER_ENV

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert launched_world() is None
