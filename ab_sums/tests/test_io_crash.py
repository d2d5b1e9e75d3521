"""A writer killed with SIGKILL loses nothing it had finished appending."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import causal_selection
from hyscale_core.io import IncompleteLogError, SelectionLog, SelectionLogError

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

# argv: path, appends to finish, then "die" (kill itself), "die-mid-append" (kill itself
# after the next append's data is flushed but before it is marked appended) or "forever"
# (append until killed, printing each finished layer).
WRITER = """
import os, signal, sys
import numpy as np
from helpers import causal_selection
from hyscale_core.io import SelectionLog

path, done, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
log = SelectionLog(path, "w", chunk_rows=64)
layer = 0
while layer < done or how == "forever":
    log.append("rollout", layer, causal_selection(np.random.default_rng(layer), 300, 32))
    print(layer, flush=True)
    layer += 1
if how == "die-mid-append":
    flushes, real_flush = [], log._file.flush
    def flush():
        flushes.append(1)
        if len(flushes) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        real_flush()
    log._file.flush = flush
    log.append("rollout", layer, causal_selection(np.random.default_rng(layer), 300, 32))
os.kill(os.getpid(), signal.SIGKILL)
"""


def run_writer(path: Path, done: int, how: str) -> None:
    proc = subprocess.run([sys.executable, "-c", WRITER, str(path), str(done), how], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def check_recovered(path: Path, layers: int) -> None:
    """Every layer below ``layers`` reads back bitwise; the log says it is incomplete."""
    with pytest.raises(IncompleteLogError, match=str(path)):
        SelectionLog(path)
    with SelectionLog(path, allow_incomplete=True) as log:
        assert not log.complete and log.layers("rollout")[:layers] == [str(i) for i in range(layers)]
        for layer in range(layers):
            np.testing.assert_array_equal(log.read("rollout", layer),
                                          causal_selection(np.random.default_rng(layer), 300, 32))


def test_killed_between_appends(tmp_path):
    path = tmp_path / "rollout.h5"
    run_writer(path, 4, "die")
    check_recovered(path, 4)
    with SelectionLog(path, allow_incomplete=True) as log:
        assert len(log) == 4 and log.incomplete_entries() == []


def test_killed_mid_append_then_resumed(tmp_path):
    path = tmp_path / "rollout.h5"
    run_writer(path, 3, "die-mid-append")
    check_recovered(path, 3)
    with SelectionLog(path, allow_incomplete=True) as log:
        assert log.keys() == [("rollout", str(i)) for i in range(3)]
        assert log.incomplete_entries() == [("rollout", "3")]
        with pytest.raises(IncompleteLogError, match="sample 'rollout' layer '3' was not completely appended"):
            log.read("rollout", 3)
    cut_off = causal_selection(np.random.default_rng(3), 300, 32)
    with SelectionLog(path, "a", allow_incomplete=True) as log:  # the resumed rollout redoes layer 3
        log.append("rollout", 3, cut_off)
    with SelectionLog(path) as log:
        assert log.complete and len(log) == 4 and log.incomplete_entries() == []
        np.testing.assert_array_equal(log.read("rollout", 3), cut_off)


@pytest.mark.parametrize("after", [2, 5])
def test_killed_by_the_parent_at_any_moment(tmp_path, after):
    path = tmp_path / "rollout.h5"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "0", "forever"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        reported = [proc.stdout.readline() for _ in range(after)]
        # while the writer runs the log is refused: locked by HDF5, or flagged incomplete
        with pytest.raises(SelectionLogError, match=f"{path}.*(locked by another process|is incomplete)"):
            SelectionLog(path)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert reported == [f"{i}\n" for i in range(after)], proc.stderr
    check_recovered(path, after)  # and any layer it finished after the last report reads back too
    with SelectionLog(path, allow_incomplete=True) as log:
        for layer in log.layers("rollout"):
            np.testing.assert_array_equal(log.read("rollout", layer),
                                          causal_selection(np.random.default_rng(int(layer)), 300, 32))
