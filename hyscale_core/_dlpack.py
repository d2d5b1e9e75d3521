"""Host-side DLPack import, including bfloat16 tensors NumPy cannot import.

NumPy's ``from_dlpack`` rejects the DLPack bfloat16 type. Such a tensor is
imported by relabelling its (legacy, unversioned) DLPack struct as uint16,
importing that zero-copy and viewing the result as ``ml_dtypes.bfloat16``.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ._dtypes import bfloat16

_DL_UINT, _DL_BFLOAT = 1, 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _Capsule:
    """Hands one prepared capsule to ``numpy.from_dlpack``."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


# DLDataTypeCode names (dlpack.h) for the error of a dtype NumPy cannot import.
_DL_CODES = {0: "int", 1: "uint", 2: "float", 3: "handle", 4: "bfloat", 5: "complex", 6: "bool"}


def _legacy_import(x: Any) -> tuple[np.ndarray | None, str]:
    """``(array or None, the tensor's DLPack dtype)`` from a legacy capsule of
    ``x``: the array for a bfloat16 tensor (relabelled uint16, viewed as
    bfloat16), None for any other dtype (NumPy took it or refused it already)."""
    capsule = x.__dlpack__()
    try:
        pointer = _capsule_pointer(capsule, b"dltensor")
    except ValueError:  # not a legacy capsule
        return None, "unknown"
    dtype = _DLManagedTensor.from_address(pointer).dl_tensor.dtype
    text = (f"{_DL_CODES[dtype.code]}{dtype.bits}" if dtype.code in _DL_CODES
            else f"code {dtype.code} of {dtype.bits} bits") + (f" x {dtype.lanes} lanes" if dtype.lanes != 1 else "")
    if (dtype.code, dtype.bits, dtype.lanes) != (_DL_BFLOAT, 16, 1):
        return None, text
    dtype.code = _DL_UINT
    return np.from_dlpack(_Capsule(capsule)).view(bfloat16), text


def host_from_dlpack(x: Any, name: str) -> np.ndarray:
    """Import a host DLPack producer as a NumPy array without copying; TypeError
    naming ``name`` (and the tensor's DLPack dtype where it can be read) if
    neither NumPy nor the bfloat16 relabelling takes it. Where NumPy refuses,
    ``x.__dlpack__()`` is called a second time, for a legacy capsule."""
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, ValueError) as exc:
        refused = exc
    try:
        array, dtype = _legacy_import(x)
    except Exception:  # the producer failed again: report its first failure
        array, dtype = None, "unknown"
    if array is None:
        raise TypeError(f"{name} cannot be imported through DLPack ({type(x).__name__}, DLPack dtype {dtype}): "
                        f"{refused}") from refused
    return array
