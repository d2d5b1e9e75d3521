"""Run one named benchmark: ``python -m benchmarks.run NAME [options]``.

A benchmark is a module of this package with a ``main(argv)`` function; the
names are the modules beside this file (``python -m benchmarks.run`` lists
them).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

_NOT_BENCHMARKS = {"__init__", "common", "run"}


def available() -> list[str]:
    """Names of the benchmark modules beside this file, sorted."""
    here = Path(__file__).resolve().parent
    return sorted(p.stem for p in here.glob("*.py")
                  if p.stem not in _NOT_BENCHMARKS and not p.stem.startswith("_"))


def main() -> None:
    names = available()
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        print(__doc__)
        print("available:", ", ".join(names))
        sys.exit(2)
    module = importlib.import_module(f"benchmarks.{sys.argv[1]}")
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()
