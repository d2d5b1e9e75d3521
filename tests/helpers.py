"""Test helpers: awkward inputs and backend conversion."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyscale_core._backend import cupy_module, to_host  # noqa: F401  (re-exported to the tests)
from hyscale_core._dtypes import TOPK_DTYPES, is_float

HAS_GPU = cupy_module() is not None


def mpiexec() -> str | None:
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPI_TIMEOUT_S = 120
ONE_THREAD = {name: "1" for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                     "MKL_NUM_THREADS")}
# Open MPI refuses to start as root without these (MPICH ignores them).
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPI_RANKS = Path(__file__).with_name("mpi_ranks.py")


def launch(cmd: list[str], cwd: Path | None = None, **env_vars: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` (an mpiexec job or a plain process: one thread per process, Open MPI
    allowed as root, ``env_vars`` added), stdout and stderr together; at MPI_TIMEOUT_S
    kill its process group and fail the test. The caller checks the return code."""
    env = {**os.environ, **ONE_THREAD, **(OPEN_MPI_AS_ROOT if os.geteuid() == 0 else {}), **env_vars}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=cwd)
    try:
        stdout, _ = proc.communicate(timeout=MPI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {MPI_TIMEOUT_S} s:\n{stdout}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


def run_ranks(n_ranks: int, out: Path, *groups: str) -> subprocess.CompletedProcess:
    """tests/mpi_ranks.py's ``groups`` on ``n_ranks`` ranks, results to ``out`` (see :func:`launch`)."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("needs mpiexec (pip install mpich)")
    path = os.pathsep.join([str(MPI_RANKS.parent), os.environ.get("PYTHONPATH", "")])
    return launch([exe, "-n", str(n_ranks), sys.executable, str(MPI_RANKS), str(out), *groups], PYTHONPATH=path)


AWKWARD_LENGTHS = (1, 7, 63, 300)

SPECIAL_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, np.inf, -np.inf, np.nan, 3.0, -3.0)


def awkward_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random values with many ties; for floats also NaN, +-inf and -0.0."""
    dtype = np.dtype(dtype)
    if is_float(dtype):
        pool = np.array(SPECIAL_FLOATS + tuple(rng.standard_normal(6)), dtype=np.float64)
        picks = pool[rng.integers(0, len(pool), size=shape)]
        fresh = rng.standard_normal(shape) * 100
        return np.where(rng.random(shape) < 0.5, picks, fresh).astype(dtype)
    info = np.iinfo(dtype)
    pool = np.array([0, 1, -1, info.min, info.max, 7, -7], dtype=dtype)
    picks = pool[rng.integers(0, len(pool), size=shape)]
    fresh = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return np.where(rng.random(shape) < 0.5, picks, fresh).astype(dtype)


def topk_dtype_params():
    return [pytest.param(d, id=d.name) for d in TOPK_DTYPES]


def same_bits(a, b) -> bool:
    """Bitwise equality of two arrays (NaN payloads and -0.0 included)."""
    a, b = to_host(a), to_host(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return bool(np.array_equal(np.ascontiguousarray(a).view(width), np.ascontiguousarray(b).view(width)))


def selection_agrees_up_to_tolerance(selection, ref_scores, topk, rel_tol):
    """Sets agree except among keys whose reference score is within tol of the k-th."""
    for t in range(ref_scores.shape[0]):
        row = ref_scores[t]
        visible = np.flatnonzero(np.isfinite(row))
        chosen = set(int(s) for s in selection[t] if s >= 0)
        if len(visible) <= topk:
            assert chosen == set(visible.tolist())
            continue
        kth = np.sort(row[visible])[::-1][topk - 1]
        tol = rel_tol * max(np.abs(row[visible]).max(), 1e-30)
        sure_in = set(visible[row[visible] > kth + tol].tolist())
        maybe = set(visible[np.abs(row[visible] - kth) <= tol].tolist())
        assert sure_in <= chosen <= sure_in | maybe
        assert len(chosen) == topk


def rounding(dtype):
    """``(wide dtype, r)``: r rounds an array to ``dtype`` and back to the wide dtype."""
    wide = np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    return wide, lambda x: np.asarray(x).astype(dtype).astype(wide)


def ordered_matmul(a, b):
    """``a @ b`` (batched, [..., m, j] @ [..., j, n]) summed over j in ascending
    order in the arrays' dtype, every product and partial sum rounded to it:
    the naive loop, the same on every host. A BLAS ``@`` sums in an order
    that depends on the host's CPU, and so would the bound that a
    within-twice-naive check draws from it."""
    acc = a[..., :, :1] * b[..., :1, :]
    for j in range(1, a.shape[-1]):
        acc = acc + a[..., :, j:j + 1] * b[..., j:j + 1, :]
    return acc


def max_err(a, ref, mask=None):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if mask is not None:
        a, ref = a[mask], ref[mask]
    return float(np.abs(a - ref).max(initial=0.0))


def assert_within_twice_naive(name, ours, naive, ref, mask=None):
    """max|ours - ref| <= 2 max|naive - ref| (+ a float64-rounding floor)."""
    floor = 1e-12 * max(float(np.abs(ref[mask] if mask is not None else ref).max(initial=0.0)), 1.0)
    err, naive_err = max_err(ours, ref, mask), max_err(naive, ref, mask)
    assert err <= 2 * naive_err + floor, f"{name}: error {err:.3g} vs naive {naive_err:.3g}"


def on(backend: str, *arrays):
    """``arrays`` on ``backend``: as they are for "cpu", as CuPy arrays for "gpu"."""
    if backend == "gpu":
        import cupy

        return tuple(cupy.asarray(a) for a in arrays)
    return arrays


def naive_dtype(*arrays):
    """The precision a naive computation on ``arrays`` runs in: the coarsest of their dtypes."""
    import ml_dtypes

    return max((np.dtype(a.dtype) for a in arrays), key=lambda d: float(ml_dtypes.finfo(d).eps))


# (heads, k) of the accuracy grids of the sparse-attention and indexer-loss tests.
HEADS_K_GRID = [pytest.param(h, k, id=f"h{h}-k{k}") for h in (1, 16, 64, 128) for k in (1, 7, 2048)]


def grid_sizes(heads: int, k: int, head_rows: int) -> tuple[int, int]:
    """(queries, keys) of a grid point: enough queries for a stable max error
    (about head_rows query-head rows at k > 64); few keys when k is small, so
    keys are shared by many queries and duplicated inside rows."""
    return (max(2, head_rows // heads), 3000) if k > 64 else (max(8, 256 // heads), 9)


def finite_difference(f, x, eps=1e-6):
    """Central differences of the scalar f at every entry of x (float64)."""
    grad = np.zeros_like(x)
    for pos in np.ndindex(x.shape):
        keep = x[pos]
        x[pos] = keep + eps
        up = f()
        x[pos] = keep - eps
        down = f()
        x[pos] = keep
        grad[pos] = (up - down) / (2 * eps)
    return grad


def causal_selection(rng: np.random.Generator, n: int, k: int, cu_seqlens=None) -> np.ndarray:
    """int32 [n, k]: row t holds min(k, t - start + 1) distinct keys in [start, t] (start: its
    packed sequence's first key, 0 without ``cu_seqlens``) in random rank order, then -1."""
    cu = np.array([0, n] if cu_seqlens is None else cu_seqlens)
    starts = np.repeat(cu[:-1], np.diff(cu))
    table = np.full((n, k), -1, dtype=np.int32)
    for t in range(n):
        m = min(k, t - starts[t] + 1)
        table[t, :m] = starts[t] + rng.choice(t - starts[t] + 1, m, replace=False)
    return table


def dataset_in_place_of(path: str):
    """A mutation of an open HDF5 file: the group at ``path`` replaced by a
    small dataset (a malformed selection log)."""
    def mutate(f) -> None:
        del f[path]
        f[path] = np.arange(3)
    return mutate
