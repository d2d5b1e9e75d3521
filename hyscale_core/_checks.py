"""Argument checks shared by the public functions.

Every failure raises ``ValueError`` (bad value or shape) or ``TypeError`` (bad
type or dtype) whose message names the argument and the offending value.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from ._dtypes import dtype_names


def check_ndim(a: Any, ndim: int, name: str, layout: str) -> None:
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(a.shape)}")


def check_dtype(a: Any, allowed: tuple[np.dtype, ...], name: str) -> None:
    if np.dtype(a.dtype) not in allowed:
        raise TypeError(f"{name} has dtype {a.dtype}, expected one of: {dtype_names(allowed)}")


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high]`` (``high=None``: no upper bound)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_axis(axis: Any, ndim: int) -> int:
    """Normalise ``axis`` for an array of ``ndim`` dimensions."""
    axis = check_int(axis, "axis", -max(ndim, 1), max(ndim, 1) - 1)
    return axis % max(ndim, 1)


def check_same(name_a: str, value_a: int, name_b: str, value_b: int, what: str) -> None:
    if value_a != value_b:
        raise ValueError(f"{what} mismatch: {name_a} has {value_a}, {name_b} has {value_b}")


def check_real(value: Any, name: str, positive: bool = False) -> float:
    """``value`` as a finite Python float, >= 0 (> 0 with ``positive``); errors name it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")
    return number


def check_scale(scale: Any, default: float, taken_as: Any = np.float64) -> float:
    """``scale`` as a finite positive Python float, also once rounded to
    ``taken_as`` (the dtype the computation takes it in); ``None`` gives
    ``default``."""
    if scale is None:
        return float(default)
    value = check_real(scale, "scale", positive=True)
    with np.errstate(over="ignore", under="ignore"):
        rounded = float(np.dtype(taken_as).type(value))
    if not (np.isfinite(rounded) and rounded > 0.0):
        raise ValueError(f"scale must be finite and > 0 in {np.dtype(taken_as).name}, the precision it is "
                         f"taken in, got {value!r}")
    return value


def check_shape(a: Any, shape: tuple[int, ...], name: str, layout: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(a.shape)}")


INT32_MAX = 2**31 - 1


def check_slot_count(indices: Any, name: str) -> None:
    """The index table's column count fits int32 (the kernels' slot numbers)."""
    if indices.shape[-1] > INT32_MAX:
        raise ValueError(f"{name} has {indices.shape[-1]} columns (slots per query); at most {INT32_MAX} are supported")


def check_index_table(indices: Any, n_keys: int, name: str, xp: Any) -> None:
    """Every entry of the int table ``indices`` is -1 (skip) or a key in ``[0, n_keys)``.

    Reports the first bad entry in row-major order with its position and value.
    """
    if indices.size == 0:
        return
    flags = None
    if xp is not np:  # CuPy: one kernel and one transfer where it takes the table (gpu/checks.py)
        from .gpu.checks import table_flags

        flags = table_flags(indices, n_keys)
    if flags is not None:
        if not flags[0]:
            return
    elif int(indices.min()) >= -1 and int(indices.max()) < n_keys:  # two reads of the table, no temporaries
        return
    bad = (indices < -1) | (indices >= n_keys)
    if bool(bad.any()):
        pos = tuple(int(i) for i in xp.argwhere(bad)[0])
        where = ", ".join(str(i) for i in pos)
        raise ValueError(
            f"{name}[{where}] = {int(indices[pos])} is out of range: entries must be -1 (skip) "
            f"or key indices in [0, {n_keys})"
        )


def float_view(a: Any, xp: Any) -> Any:
    """``a`` as a float array the checks can test: bfloat16 widened exactly to
    float32 through its bits (CuPy's ufuncs do not take ml_dtypes' bfloat16)."""
    from ._dtypes import bfloat16

    if a.dtype == bfloat16:
        return (a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return a


def check_finite(a: Any, name: str, xp: Any, taken_as: Any = None) -> None:
    """Every entry of the float array ``a`` is finite, also once rounded to
    ``taken_as`` (the dtype the computation takes ``a`` in; float64 values
    past float32's range are infinite there); names the first that is not."""
    if a.size == 0:
        return
    a = float_view(a, xp)
    with np.errstate(over="ignore"):  # the overflow is what is looked for
        rounded = a if taken_as is None else a.astype(taken_as, copy=False)
    finite = xp.isfinite(rounded)
    if not bool(finite.all()):
        pos = tuple(int(i) for i in xp.argwhere(~finite)[0])
        where = ", ".join(str(i) for i in pos)
        value = float(a[pos])
        beyond = f" in {np.dtype(taken_as).name}, the precision it is taken in" if np.isfinite(value) else ""
        raise ValueError(f"{name} must be finite{beyond}, got {name}[{where}] = {value}")
