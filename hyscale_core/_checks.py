"""Argument checks shared by the public functions.

Every failure raises ``ValueError`` (bad value or shape) or ``TypeError`` (bad
type or dtype) whose message names the argument and the offending value.
"""
from __future__ import annotations

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
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value}")
    return value


def check_axis(axis: Any, ndim: int) -> int:
    """Normalise ``axis`` for an array of ``ndim`` dimensions."""
    axis = check_int(axis, "axis", -max(ndim, 1), max(ndim, 1) - 1)
    return axis % max(ndim, 1)


def check_same(name_a: str, value_a: int, name_b: str, value_b: int, what: str) -> None:
    if value_a != value_b:
        raise ValueError(f"{what} mismatch: {name_a} has {value_a}, {name_b} has {value_b}")
