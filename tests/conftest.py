"""GPU tests carry ``@pytest.mark.gpu`` and are skipped without a CUDA device;
MPI tests carry ``@pytest.mark.mpi`` and are skipped without ``mpiexec``."""
from __future__ import annotations

import shutil

import pytest

from helpers import HAS_GPU


def pytest_collection_modifyitems(config, items):
    has_mpiexec = shutil.which("mpiexec") is not None
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs CuPy and a CUDA device"))
        if "mpi" in item.keywords and not has_mpiexec:
            item.add_marker(pytest.mark.skip(reason="needs mpiexec (pip install mpich)"))
