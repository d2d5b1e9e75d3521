"""The installed package (a wheel, not the source tree) finds cuda/ and mpi/."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import hyscale_core, hyscale_core.mpi
from hyscale_core.gpu.module import cuda_source_dir, source_files
print(hyscale_core.__file__)
print(hyscale_core.mpi.__file__)
print(cuda_source_dir())
print(" ".join(p.name for p in source_files()))
"""


@pytest.mark.slow
def test_installed_wheel_finds_cuda_and_mpi(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    # Build isolation, as `pip install .` does: pip fetches the build
    # requirements (pyproject.toml), so a fresh environment needs nothing more.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = wheels.glob("hyscale_core-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True, capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.split("\n")
    package, mpi, cuda, sources = out[:4]
    for path in (package, mpi, cuda):
        assert path.startswith(str(target)), path
    assert {"topk.cu"} <= set(sources.split())
    shipped = {p.name for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cuh")}
    assert shipped == {p.name for p in Path(cuda).iterdir()}
