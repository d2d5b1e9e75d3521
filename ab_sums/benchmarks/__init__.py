"""Benchmarks: named configurations, a runner (``python -m benchmarks.run``)
and committed results under ``benchmarks/results/``."""
