"""Every cuda/*.cu compiles with nvcc -arch=sm_90 where nvcc exists (sources
using wgmma, which only sm_90a has, for sm_90a), without warnings or ptxas
performance notes (such as wgmma serialized on a divergent path); and with
NVRTC, as the runtime compiles them, where libnvrtc exists."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from hyscale_core.gpu.module import compile_options, cuda_source_dir, source_files


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


def _nvrtc_library():
    """libnvrtc, as cupy's NVIDIA wheels or a CUDA toolkit ship it, or None."""
    import ctypes
    import ctypes.util
    import os
    import site
    from pathlib import Path

    candidates = [ctypes.util.find_library("nvrtc")]
    roots = site.getsitepackages() + [site.getusersitepackages()]
    for root in roots:
        candidates += sorted(str(p) for p in Path(root).glob("nvidia/*/lib/libnvrtc.so*"))
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates += sorted(str(p) for p in Path(home).glob("lib64/libnvrtc.so*"))
    for name in filter(None, candidates):
        try:
            for builtins in sorted(Path(name).parent.glob("libnvrtc-builtins.so*")):  # NVRTC opens it by name
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_NVRTC = _nvrtc_library()


def _nvrtc_compile(source: str, defines: tuple[str, ...] = (), folder=None) -> None:
    import ctypes

    folder = folder or cuda_source_dir()
    program = ctypes.c_void_p()
    assert _NVRTC.nvrtcCreateProgram(ctypes.byref(program), (folder / source).read_bytes(), source.encode(), 0,
                                     None, None) == 0
    options = [o.encode() for o in compile_options(folder, defines)] + [b"--gpu-architecture=sm_90a"]
    try:
        status = _NVRTC.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        _NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        _NVRTC.nvrtcGetProgramLog(program, log)
    finally:
        _NVRTC.nvrtcDestroyProgram(ctypes.byref(program))
    assert status == 0, log.value.decode(errors="replace")


@pytest.mark.skipif(_NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("source", [p.name for p in source_files()])
def test_source_compiles_with_nvrtc(source):
    """The runtime compiles every source with NVRTC (hyscale_core/gpu/module.py's
    options), whose JIT mode rejects some code nvcc takes (a generic lambda is
    a host function there)."""
    _nvrtc_compile(source)


@pytest.mark.skipif(_NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("dim", [64, 192, 256])
def test_indexer_compiles_for_every_head_dim_it_accepts(dim):
    """ops/indexer/gpu.py sends every head dim that is a multiple of 64 up to
    256 to cuda/indexer.cu (the default build above is D = 128)."""
    _nvrtc_compile("indexer.cu", ("HS_IDX_HEADS=64", f"HS_IDX_DIM={dim}"))


@pytest.mark.skipif(_NVRTC is None, reason="libnvrtc not found")
def test_key_sort_compiles_with_nine_bit_digits():
    """hyscale_core/gpu/segments.py builds cuda/key_sort.cu with HS_KS_BITS = 9 for
    2**17 to 2**18 keys (the default build above is 8)."""
    _nvrtc_compile("key_sort.cu", ("HS_KS_BITS=9",))


@pytest.mark.skipif(_NVRTC is None, reason="libnvrtc not found")
@pytest.mark.parametrize("variant", ["evict_last", "gathers_only", "products_only"])
def test_forward_variants_apply_and_compile(variant, tmp_path):
    """benchmarks/sparse_attention_variants.py still finds the code it rewrites in
    the forward kernel, and the variant compiles."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # the benchmarks package sits beside tests/
        sys.path.insert(0, root)
    from benchmarks.sparse_attention_variants import patch

    shutil.copytree(cuda_source_dir(), tmp_path / "cuda")
    patch(tmp_path, variant)
    _nvrtc_compile("sparse_attention.cu", folder=tmp_path / "cuda")


def test_lineinfo_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("HYSCALE_LINEINFO", raising=False)
    plain = compile_options(tmp_path, ("HS_IDX_HEADS=64",))
    assert plain == ("-std=c++17", f"-I{tmp_path}", "-DHS_IDX_HEADS=64")
    monkeypatch.setenv("HYSCALE_LINEINFO", "1")
    assert compile_options(tmp_path, ("HS_IDX_HEADS=64",)) == plain + ("-lineinfo",)
