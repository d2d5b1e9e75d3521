"""examples/train_tiny_dsa.py under `mpiexec -n 2` against one process, the
ShardedRunner it uses (tests/mpi_ranks.py "runner") on 2 and 3 ranks, and
examples/mpi_long_context.py's usage errors for values it cannot run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpi_ranks as cases
from hyscale_core.ops.indexer import MAX_TOPK
from helpers import launch, mpiexec, run_ranks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_tiny_dsa.py"
LONG_CONTEXT = ROOT / "examples" / "mpi_long_context.py"
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


def checkout_pythonpath() -> str:
    """PYTHONPATH that makes a subprocess import this checkout's hyscale_core
    (whichever checkout the venv installed)."""
    return os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])


def long_context_usage_error(*options: str, **environ: str) -> str:
    """The one error line of ``python examples/mpi_long_context.py *options`` (one
    process, this checkout's package, `environ` added to the environment), after
    asserting it is a usage error: exit status 2, nothing on stdout (no work
    ran), argparse's usage and that line on stderr, no traceback and no
    MPI_Abort."""
    env = {**os.environ, **environ, "PYTHONPATH": checkout_pythonpath()}
    done = subprocess.run([sys.executable, str(LONG_CONTEXT), *options], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr and "Abort" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    errors = [line for line in lines if line.startswith("mpi_long_context.py: error: ")]
    assert errors == lines[-1:], done.stderr
    return errors[0]


# Checked against argv alone, before MPI starts: no mpi4py needed.
@pytest.mark.parametrize("option, value, message", [
    ("--seq-len", "abc", "invalid int value: 'abc'"),
    ("--seq-len", "0", "must be at least 1, got 0"),
    ("--topk", "0", "must be between 1 and"),  # k = 0 selects nothing: nothing to compare
    ("--topk", "-1", "must be between 1 and"),
    ("--topk", str(MAX_TOPK + 1), f"must be between 1 and {MAX_TOPK}"),
    ("--index-heads", "0", "must be at least 1"),
    ("--index-dim", "0", "must be at least 1"),
    ("--heads", "0", "must be at least 1"),
    ("--d-qk", "-3", "must be at least 1"),
    ("--d-v", "0", "must be at least 1"),
    ("--d-v", "577", "must be at most --d-qk (576), got 577"),
    ("--seed", "-1", "must be at least 0"),
    ("--transport", "bogus", "invalid choice: 'bogus'"),
])
def test_long_context_refuses_a_bad_value_before_any_work(option, value, message):
    error = long_context_usage_error(option, value)
    assert f"argument {option}: " in error and message in error, error


def test_long_context_names_d_v_when_d_qk_leaves_the_default_too_wide():
    assert "argument --d-v: must be at most --d-qk (256), got 512" in long_context_usage_error("--d-qk", "256")


# Checked on every rank once MPI runs (they depend on the host), so mpi4py is needed.
@pytest.mark.parametrize("options, message", [
    (["--transport", "nccl", "--cpu"], "argument --transport: nccl moves CuPy arrays"),
    (["--transport", "cuda-aware", "--cpu"], "argument --transport: cuda-aware moves CuPy arrays"),
    (["--json", "{tmp}"], "argument --json: '{tmp}' is a folder"),
    (["--json", "{tmp}/missing/summary.json"], "argument --json: folder '{tmp}/missing' does not exist"),
])
def test_long_context_refuses_what_the_host_cannot_do_before_any_work(tmp_path, options, message):
    pytest.importorskip("mpi4py")
    error = long_context_usage_error(*(o.format(tmp=tmp_path) for o in options))
    assert message.format(tmp=tmp_path) in error, error


@pytest.mark.parametrize("value, options, message", [
    ("bogus", [], "$HYSCALE_MPI_TRANSPORT: must be auto or one of host, cuda-aware, nccl, got 'bogus'"),
    ("nccl", ["--cpu"], "$HYSCALE_MPI_TRANSPORT: nccl moves CuPy arrays"),
])
def test_long_context_refuses_a_bad_transport_from_the_environment(value, options, message):
    pytest.importorskip("mpi4py")
    assert message in long_context_usage_error(*options, HYSCALE_MPI_TRANSPORT=value)


def test_long_context_option_wins_over_the_environment_transport():
    pytest.importorskip("mpi4py")
    error = long_context_usage_error("--transport", "nccl", "--cpu", HYSCALE_MPI_TRANSPORT="bogus")
    assert "argument --transport: nccl moves CuPy arrays" in error, error


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_long_context_refuses_a_json_path_it_cannot_write(tmp_path):
    pytest.importorskip("mpi4py")
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        error = long_context_usage_error("--json", str(folder / "summary.json"))
    finally:
        folder.chmod(0o755)
    assert f"argument --json: '{folder}' is not writable" in error, error


def test_long_context_json_check_names_an_unwritable_file_or_folder(tmp_path, monkeypatch):
    """The same check in process, whoever runs it: os.access says no."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("mpi_long_context", LONG_CONTEXT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    target = tmp_path / "summary.json"
    assert example.json_path_problem(target) is None
    monkeypatch.setattr(example.os, "access", lambda path, mode: False)
    assert example.json_path_problem(target) == f"argument --json: '{tmp_path}' is not writable"
    target.write_text("{}")
    assert example.json_path_problem(target) == f"argument --json: '{target}' is not writable"


@pytest.mark.mpi
@pytest.mark.parametrize("options", [["--seq-len", "abc"], ["--json", "{tmp}/missing/summary.json"]])
def test_long_context_usage_error_ends_every_rank_under_mpiexec(tmp_path, options):
    options = [o.format(tmp=tmp_path) for o in options]
    done = launch([mpiexec(), "-n", "2", sys.executable, str(LONG_CONTEXT), "--cpu", *options],
                  PYTHONPATH=checkout_pythonpath())
    assert done.returncode == 2, done.stdout
    assert done.stdout.count("mpi_long_context.py: error: argument ") == 2, done.stdout  # one per rank
    assert "Traceback" not in done.stdout and "Abort" not in done.stdout, done.stdout
