"""GPU tests carry ``@pytest.mark.gpu`` and are skipped without a CUDA device;
MPI tests carry ``@pytest.mark.mpi`` and are skipped without ``mpiexec``
(the one beside this Python, else the one on PATH)."""
from __future__ import annotations

import pytest

from helpers import HAS_GPU, mpiexec


def pytest_collection_modifyitems(config, items):
    has_mpiexec = mpiexec() is not None
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs CuPy and a CUDA device"))
        if "mpi" in item.keywords and not has_mpiexec:
            item.add_marker(pytest.mark.skip(reason="needs mpiexec (pip install mpich)"))
