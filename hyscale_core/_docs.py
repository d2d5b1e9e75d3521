"""Docstrings shared in part by several public functions."""
from __future__ import annotations

from typing import Any, Callable


def with_note(note: str) -> Callable[[Any], Any]:
    """Decorator: append ``note`` to the function's docstring.

    A docstring must be a string literal (``\"\"\"...\"\"\" + NOTE`` leaves
    ``__doc__`` None), so a note several functions share is added here."""
    def add(fn: Any) -> Any:
        fn.__doc__ = (fn.__doc__ or "") + note
        return fn
    return add
