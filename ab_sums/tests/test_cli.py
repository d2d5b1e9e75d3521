"""The hyscale console script."""
from __future__ import annotations

from hyscale_core.cli import main


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend cpu: Numba" in out and "backend gpu:" in out and "CUDA sources:" in out


def test_demo_checks_streaming_against_materialised(capsys):
    assert main(["demo", "--n", "512", "--heads", "4", "--dim", "16", "--topk", "64", "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL" in out and "peak memory" in out
