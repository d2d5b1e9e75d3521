"""Backend choice from the array type, and zero-copy import of foreign arrays.

Public functions call :func:`as_arrays` once; below that point code works on
plain NumPy (CPU backend) or CuPy (GPU backend) arrays and never asks again.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

CPU = "cpu"
GPU = "gpu"

# DLPack device types (dlpack.h, DLDeviceType); the host ones NumPy imports.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_ROCM_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 11, 13
_DL_HOST = (_DL_CPU, _DL_CUDA_HOST, _DL_ROCM_HOST)


@functools.lru_cache(maxsize=None)
def cupy_module() -> Any | None:
    """The ``cupy`` module when it imports and sees a CUDA device, else None."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # no driver, no device: a CPU-only machine
        return None
    return cupy


def _is_cupy_array(x: Any) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def check_device(name: str, device_id: int, current: int) -> None:
    """A device argument must live on the current device, where the kernels
    launch (CuPy's own ufuncs refuse other devices the same way)."""
    if device_id != current:
        raise ValueError(f"{name} lives on GPU {device_id} but the current device is GPU {current}; call inside "
                         f"`with cupy.cuda.Device({device_id}):`")


def _on_current_device(x: Any, name: str) -> Any:
    """The CuPy array ``x``, checked to live on the current device."""
    check_device(name, x.device.id, cupy_module().cuda.runtime.getDevice())
    return x


def _device_type(x: Any, name: str) -> int:
    """The DLPack device type ``x.__dlpack_device__()`` reports; TypeError naming
    ``name`` if the call fails or does not give (device_type, device_id)."""
    producer = f"{type(x).__name__}.__dlpack_device__()"
    try:
        device = x.__dlpack_device__()
    except Exception as exc:  # a foreign producer's own failure, whatever its type
        raise TypeError(f"{name}: {producer} raised {exc!r}") from exc
    try:
        device_type, _ = device
        return int(device_type)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: {producer} must give (device_type, device_id), got {device!r}") from exc


def _from_dlpack(x: Any, name: str) -> tuple[str, Any]:
    device_type = _device_type(x, name)
    if device_type in _DL_HOST:
        from ._dlpack import host_from_dlpack

        return CPU, host_from_dlpack(x, name)
    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        cp = cupy_module()
        if cp is None:
            raise TypeError(
                f"{name} lives on a CUDA device but CuPy is not available; "
                "install hyscale-core[cuda]"
            )
        return GPU, _on_current_device(cp.from_dlpack(x), name)
    raise TypeError(f"{name} lives on DLPack device type {device_type}, which is not supported")


def as_array(x: Any, name: str) -> tuple[str, Any]:
    """Return ``(backend, array)`` for one argument.

    NumPy arrays -> CPU, CuPy arrays -> GPU, objects with ``__dlpack__`` are
    imported without a copy on their own side, other array-likes go through
    ``numpy.asarray``. A device array must live on the current device
    (ValueError naming it otherwise).
    """
    if isinstance(x, np.ndarray):
        return CPU, x
    if _is_cupy_array(x):
        return GPU, _on_current_device(x, name)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _from_dlpack(x, name)
    try:
        return CPU, np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from exc


def as_arrays(**named: Any) -> tuple[str, dict[str, Any]]:
    """Import several arguments (each required: ``None`` is a TypeError naming
    it); they must all live on one backend."""
    arrays: dict[str, Any] = {}
    backends: dict[str, str] = {}
    for name, value in named.items():
        if value is None:
            raise TypeError(f"{name} must be an array, got None")
        backends[name], arrays[name] = as_array(value, name)
    chosen = set(backends.values())
    if len(chosen) > 1:
        where = ", ".join(f"{n} on {b}" for n, b in backends.items())
        raise TypeError(f"arguments live on different backends: {where}")
    return (chosen.pop() if chosen else CPU), arrays


def xp_for(backend: str) -> Any:
    """The array module of a backend: numpy or cupy."""
    if backend == GPU:
        return cupy_module()
    return np


def to_host(x: Any) -> np.ndarray:
    """``x`` as a NumPy array: CuPy arrays are copied to the host, NumPy ones returned as they are."""
    return x.get() if _is_cupy_array(x) else np.asarray(x)


def array_module(a: Any) -> Any:
    """numpy or cupy, whichever owns ``a`` (for code generic over both)."""
    return xp_for(GPU if _is_cupy_array(a) else CPU)
