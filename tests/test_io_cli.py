"""hyscale log inspect / diff, and the drift they report."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from helpers import causal_selection, dataset_in_place_of
from hyscale_core.cli import main
from hyscale_core.io import SelectionLog
from hyscale_core.io.compare import row_drift


def test_row_drift_counts_sets_not_order():
    a = np.array([[1, 2, 3, 4], [5, 6, -1, -1], [-1, -1, -1, -1], [7, 8, 9, -1]], dtype=np.int32)
    b = np.array([[4, 3, 2, 1], [5, 7, -1, -1], [-1, -1, -1, -1], [0, -1, -1, -1]], dtype=np.int32)
    np.testing.assert_allclose(row_drift(a, b), [0.0, 0.5, 0.0, 1.0])
    np.testing.assert_allclose(row_drift(a, b[:, :1]), [0.75, 0.5, 0.0, 1.0])  # k may differ
    dup = np.array([[1, 1, 2, 2]], dtype=np.int32)
    np.testing.assert_allclose(row_drift(dup, np.array([[2, 1, -1, -1]], dtype=np.int32)), [0.0])
    with pytest.raises(ValueError, match="same queries"):
        row_drift(a, b[:2])


@pytest.fixture
def logs(tmp_path):
    """Rollout A and training step B: layer 0 equal, layer 1 with half the keys swapped."""
    rng = np.random.default_rng(0)
    t0, t1 = causal_selection(rng, 300, 16), causal_selection(rng, 300, 16)
    drifted = t1.copy()
    drifted[200:, 8:] = -1  # rows 200.. keep 8 of their 16 keys
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        log.append(0, 0, t0)
        log.append(0, 1, t1)
        log.append(1, 0, t0)
    with SelectionLog(tmp_path / "b.h5", "w") as log:
        log.append(0, 0, t0)
        log.append(0, 1, drifted)
        log.append(2, 0, t0)
    expected = float(row_drift(t1, drifted).mean())
    assert expected > 0.1
    return tmp_path / "a.h5", tmp_path / "b.h5", expected


def test_inspect_lists_entries_sizes_and_checks(logs, capsys):
    a, _, _ = logs
    assert main(["log", "inspect", str(a)]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "3 selections in 2 samples" in out
    lines = [line.split() for line in out.splitlines()]
    rows = [line for line in lines if line[:2] in (["0", "0"], ["0", "1"], ["1", "0"])]
    assert len(rows) == 3 and all(r[2:4] == ["[300,", "16]"] and r[-1] == "ok" for r in rows)
    assert "raw int32 56.2 KiB" in out and "ratio" in out


def test_inspect_shows_each_entry_encoding(tmp_path, capsys):
    table = causal_selection(np.random.default_rng(0), 300, 16)
    for mode, encoding in (("w", "int32-v1"), ("a", "sorted-gaps-lehmer-v1")):
        with SelectionLog(tmp_path / "a.h5", mode, encoding=encoding) as log:
            log.append(0, encoding, table)
    assert main(["log", "inspect", str(tmp_path / "a.h5")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[5] == "encoding"
    assert [line.split()[1] for line in lines[3:5]] == [line.split()[6] for line in lines[3:5]]


def test_inspect_reports_corruption_and_incomplete(logs, tmp_path, capsys):
    a, _, _ = logs
    with h5py.File(a, "r+") as f:
        f["samples/0/1"].attrs["fingerprint"] = "0" * 32
    assert main(["log", "inspect", str(a)]) == 1
    assert "FAILED: sample '0' layer '1': selection read back has fingerprint" in capsys.readouterr().out
    with pytest.raises(RuntimeError):
        with SelectionLog(tmp_path / "c.h5", "w") as log:
            log.append(0, 0, np.zeros((2, 2), np.int32))
            raise RuntimeError
    assert main(["log", "inspect", str(tmp_path / "c.h5"), "--no-verify"]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "not checked" in out


def test_diff_reports_drift_per_layer(logs, capsys):
    a, b, expected = logs
    assert main(["log", "diff", str(a), str(b)]) == 1  # sample 1 only in A, sample 2 only in B
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows[("0", "0")][4:] == ["0.0000", "0.0000", "300/300", "identical"]
    assert rows[("0", "1")][4] == f"{expected:.4f}" and rows[("0", "1")][6] == "200/300"
    assert "only in A: sample '1' layer '0'" in out and "only in B: sample '2' layer '0'" in out


def test_diff_of_a_log_with_itself_is_clean(logs, capsys):
    a, _, _ = logs
    assert main(["log", "diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out.count("identical") == 3


def test_bad_files_exit_2_with_the_reason(tmp_path, logs, capsys):
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = np.zeros(3)
    assert main(["log", "inspect", str(plain)]) == 2
    assert f"{plain} is not a hyscale selection log" in capsys.readouterr().err
    assert main(["log", "diff", str(logs[0]), str(tmp_path / "missing.h5")]) == 2
    assert "missing.h5" in capsys.readouterr().err


def _attr(name, value):
    return lambda f: f["samples/0/1"].attrs.__setitem__(name, value)


@pytest.mark.parametrize("mutate", [lambda f: f["samples/0/1"].attrs.__delitem__("k"), _attr("n_queries", "three"),
                                    _attr("n_keys", np.array([3, 3])), dataset_in_place_of("samples/1"),
                                    dataset_in_place_of("samples/0/1")],
                         ids=["missing k", "n_queries string", "n_keys array", "sample dataset", "layer dataset"])
def test_malformed_entries_are_one_line_errors_naming_the_file(logs, mutate, capsys):
    a, b, _ = logs
    with h5py.File(a, "r+") as f:
        mutate(f)
    for argv in (["inspect", str(a)], ["diff", str(a), str(b)], ["diff", str(b), str(a)]):
        assert main(["log", *argv]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"hyscale log {argv[0]}: {a}") and err.count("\n") == 1, err
        assert out == ""  # the report is not half printed
