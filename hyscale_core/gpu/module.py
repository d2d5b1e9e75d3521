"""Compile the CUDA sources of ``cuda/`` once per device and keep the modules.

Sources are compiled with NVRTC for the device's own architecture (``sm_90a``
on Hopper, so wgmma is available), cached on disk under
``$HYSCALE_CACHE_DIR`` (default ``~/.cache/hyscale_core``) keyed by the
source text of the file and every header beside it, and loaded as a
``cupy.RawModule``. Kernels are ``extern "C"`` entry points.
``HYSCALE_LINEINFO=1`` compiles with ``-lineinfo``, so that profilers map
SASS to source lines (the same code; it is cached apart).
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from .._backend import cupy_module

_HEADER_SUFFIX = ".cuh"


def cuda_source_dir() -> Path:
    """The folder holding the CUDA sources, in a source tree or an installed package."""
    import hyscale_core

    candidates = [Path(entry) / "cuda" for entry in hyscale_core.__path__]
    candidates.append(Path(hyscale_core.__file__).resolve().parent.parent / "cuda")
    for folder in candidates:
        if any(folder.glob("*.cu")):
            return folder
    raise FileNotFoundError(f"hyscale_core cannot find its CUDA sources; looked in {[str(c) for c in candidates]}")


def source_files() -> list[Path]:
    """Every ``cuda/*.cu`` translation unit."""
    return sorted(cuda_source_dir().glob("*.cu"))


def _architecture(cp, device_id: int) -> str:
    cc = cp.cuda.Device(device_id).compute_capability  # e.g. "90"
    return f"sm_{cc}a" if cc == "90" else f"sm_{cc}"


def _compile(name: str, source: str, options: tuple[str, ...], arch: str) -> tuple[bytes, str]:
    """``(image, suffix)``: a cubin for ``arch``, or PTX where NVRTC gives no cubin."""
    from cupy_backends.cuda.libs import nvrtc

    has_cubin = hasattr(nvrtc, "getCUBIN")
    target = arch if has_cubin else arch.replace("sm_", "compute_")
    program = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, options + (f"--gpu-architecture={target}",))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC failed to compile cuda/{name}.cu for {target}:\n{log}") from exc
        if has_cubin:
            return nvrtc.getCUBIN(program), ".cubin"
        return nvrtc.getPTX(program).encode(), ".ptx"
    finally:
        nvrtc.destroyProgram(program)


def _cache_dir() -> Path:
    root = os.environ.get("HYSCALE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hyscale_core")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_options(folder: Path, defines: tuple[str, ...]) -> tuple[str, ...]:
    """NVRTC options for a source of ``folder`` built with ``defines`` ("NAME=VALUE")."""
    options = ("-std=c++17", f"-I{folder}") + tuple(f"-D{d}" for d in defines)
    return options + (("-lineinfo",) if os.environ.get("HYSCALE_LINEINFO") == "1" else ())


@functools.lru_cache(maxsize=None)
def _load(name: str, device_id: int, defines: tuple[str, ...]):
    source = (cuda_source_dir() / f"{name}.cu").read_text(encoding="utf-8")
    return module_from_source(name, source, defines, device_id)


def module_from_source(name: str, source: str, defines: tuple[str, ...] = (), device_id: int | None = None):
    """A ``cupy.RawModule`` of ``source`` (the text of a translation unit
    that includes headers of ``cuda/``, for example an instrumented copy of
    ``cuda/<name>.cu``) built as the library builds its own sources: the same
    options and architecture, cached on disk by its text and defines."""
    cp = cupy_module()
    device_id = cp.cuda.Device().id if device_id is None else device_id
    folder = cuda_source_dir()
    headers = "".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob(f"*{_HEADER_SUFFIX}")))
    arch = _architecture(cp, device_id)
    options = compile_options(folder, defines)
    from cupy_backends.cuda.libs import nvrtc

    digest = hashlib.sha256(
        "\0".join([source, headers, " ".join(options), arch, str(nvrtc.getVersion())]).encode()
    ).hexdigest()[:32]
    stem = _cache_dir() / f"{name}-{arch}-{digest}"
    cached = [p for p in (stem.with_suffix(".cubin"), stem.with_suffix(".ptx")) if p.is_file()]
    if cached:
        image_path = cached[0]
    else:
        image, suffix = _compile(name, source, options, arch)
        image_path = stem.with_suffix(suffix)
        tmp = image_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(image)
        os.replace(tmp, image_path)
    with cp.cuda.Device(device_id):
        return cp.RawModule(path=str(image_path))


@functools.lru_cache(maxsize=None)
def _kernel(module: str, name: str, device_id: int, defines: tuple[str, ...], dynamic_smem: int):
    kernel = _load(module, device_id, defines).get_function(name)
    if dynamic_smem > 0:
        kernel.max_dynamic_shared_size_bytes = dynamic_smem
    return kernel


def get_kernel(module: str, name: str, dynamic_smem: int = 0, defines: tuple[str, ...] = ()):
    """Kernel ``name`` of ``cuda/<module>.cu`` on the current device.

    ``defines`` (``"NAME=VALUE"``) select what the translation unit builds;
    each distinct set is compiled once. The kernel may use ``dynamic_smem``
    bytes of dynamic shared memory (its limit is raised to that).
    """
    cp = cupy_module()
    return _kernel(module, name, cp.cuda.Device().id, tuple(defines), int(dynamic_smem))


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_id: int) -> int:
    """Streaming multiprocessors of a device."""
    return int(cupy_module().cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])
