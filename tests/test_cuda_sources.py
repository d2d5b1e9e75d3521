"""Every cuda/*.cu compiles with nvcc -arch=sm_90 where nvcc exists; sources
using wgmma (which only sm_90a has) compile for sm_90a, without warnings or
ptxas performance notes (such as wgmma serialized on a divergent path)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from hyscale_core.gpu.module import cuda_source_dir, source_files


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", [p.name for p in source_files()])
def test_source_compiles(source, tmp_path):
    folder = cuda_source_dir()
    text = (folder / source).read_text()
    arch = "-gencode=arch=compute_90a,code=sm_90a" if "wgmma.cuh" in text else "-arch=sm_90"
    result = subprocess.run(
        ["nvcc", arch, "-std=c++17", "-Xptxas=-v", f"-I{folder}", "-c", str(folder / source), "-o",
         str(tmp_path / "out.o")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr
    assert "Potential Performance Loss" not in result.stderr, result.stderr  # e.g. serialized wgmma
