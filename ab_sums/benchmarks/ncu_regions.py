"""Where a kernel's warps wait, by stretch of code: the share of Nsight
Compute's warp-stall samples in each stretch of SASS between two
synchronising instructions (barriers, wgmma waits, copy-group fences, the
first wgmma of a group, exits), from the source view exported as CSV:

    ncu --clock-control none -k regex:"^sa_backward_dq$" -c 1 --section SourceCounters \\
        -o /tmp/dq python -m benchmarks.sparse_attention_profile --n 8192 --heads 64
    ncu -i /tmp/dq.ncu-rep --page source --csv --print-source sass > dq_source.csv
    python -m benchmarks.ncu_regions dq_source.csv

A stretch's samples include those of the instruction that ends it (a wait
is charged to the stretch it closes). Lines: first and last SASS line
(0-based), share of all samples, the closing instruction.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

_CLOSERS = ("BAR.SYNC", "BAR.RED", "WARPGROUP.DEPBAR", "EXIT", "LDGDEPBAR")
_SAMPLES = "Warp Stall Sampling (All Samples)"


def regions(path: Path) -> list[tuple[int, int, float, str]]:
    """(first line, last line, share of samples in %, closing instruction) per stretch."""
    rows = list(csv.reader(path.open()))
    start = next(i for i, r in enumerate(rows) if _SAMPLES in r)
    header, data = rows[start], rows[start + 1:]
    col, src = header.index(_SAMPLES), header.index("Source")
    samples = [float(r[col] or 0) for r in data]
    total = sum(samples) or 1.0
    out, first = [], 0
    for i, r in enumerate(data):
        text = r[src].strip()
        first_of_group = text.startswith("HGMMA") and "!UPT" in text  # a wgmma that overwrites its accumulator
        if any(c in text for c in _CLOSERS) or first_of_group or i == len(data) - 1:
            out.append((first, i, 100.0 * sum(samples[first:i + 1]) / total, text[:70]))
            first = i + 1
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--min", type=float, default=0.0, help="print stretches of at least this share (%%)")
    args = parser.parse_args(argv)
    for first, last, share, closer in regions(args.csv):
        if share >= args.min:
            print(f"{first:5d}-{last:5d} {share:5.1f} %  {closer}")


if __name__ == "__main__":
    main()
