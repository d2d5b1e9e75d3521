"""Run one named benchmark: ``python -m benchmarks.run NAME [options]``.

Names: topk_cpu, indexer_cpu, topk_gpu, selection_log (more as the modules land).
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = ["topk_cpu", "indexer_cpu", "topk_gpu", "indexer_gpu", "selection_log"]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(__doc__)
        print("available:", ", ".join(BENCHMARKS))
        sys.exit(2)
    module = importlib.import_module(f"benchmarks.{sys.argv[1]}")
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()
