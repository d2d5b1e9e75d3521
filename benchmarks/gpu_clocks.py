"""SM clock and board power while one workload at a time runs on the GPU.

    python -m benchmarks.gpu_clocks [--n 131072] [--heads 64] [--k 2048] [--seconds 6] [--rounds 2] [--out DIR]

nvidia-smi samples the SM clock, the board power and whether the software
power cap holds the clock back every 50 ms, while phases run in turn, each
for ``--seconds``, ``--rounds`` times:

- ``matmul``: torch bfloat16 8192^3 products, 20 per step (the shape of
  ``common.matmul_rate_tflops``; ``TFLOP/s`` is their rate over the phase);
- ``topk``: ``hs.indexer_topk`` at issue 4's shape (N queries and keys, one
  causal sequence, H heads, D = 128, k picks; ``indexer_gpu``'s inputs).

Each phase reports ms per step, the samples inside it, the SM clock's
median and 10th..90th percentiles (MHz), the median board power (W) and the
fraction of samples with the power cap active. A card that holds every
workload at its power limit runs each at the clock that limit allows, so a
kernel's time on two cards can differ by clock alone. Results JSON
``gpu_clocks.json`` and the raw samples ``gpu_clocks_smi.csv``.
"""
from __future__ import annotations

import argparse
import subprocess
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from .common import RESULTS, bf16_square_operands, gpu_device, table, write_results

FMT = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's timestamp
# The power cap's field took this name in newer drivers; older ones call it clocks_throttle_reasons.
CAP_FIELDS = ("clocks_event_reasons.sw_power_cap", "clocks_throttle_reasons.sw_power_cap")


def smi_query() -> str:
    """The nvidia-smi fields to sample: timestamp, SM clock, power, and the power cap where the driver names it."""
    base = "timestamp,clocks.sm,power.draw"
    for cap in CAP_FIELDS:
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={base},{cap}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return f"{base},{cap}"
    return base


def parse_samples(lines) -> list[tuple[datetime, float, float, bool | None]]:
    """(time, SM MHz, board W, power cap active or None) of each readable
    nvidia-smi line (``--format=csv,noheader,nounits``); others are skipped."""
    samples = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        try:
            cap = f[3].lower().startswith("active") if len(f) > 3 else None
            samples.append((datetime.strptime(f[0], FMT), float(f[1]), float(f[2]), cap))
        except (ValueError, IndexError):
            continue
    return samples


def summarise(samples, phases) -> list[dict]:
    """One row per phase (label, start, end, steps, ms per step, extra) from
    the samples taken between its start and end."""
    rows = []
    for label, start, end, steps, ms, extra in phases:
        inside = [s for s in samples if start <= s[0] <= end]
        row = {"phase": label, "steps": steps, "ms_per_step": round(ms, 2), "samples": len(inside), **extra}
        if inside:
            clock = np.array([s[1] for s in inside])
            caps = [s[3] for s in inside if s[3] is not None]
            row.update({"sm_mhz_median": float(np.median(clock)), "sm_mhz_p10": float(np.percentile(clock, 10)),
                        "sm_mhz_p90": float(np.percentile(clock, 90)),
                        "power_w_median": round(float(np.median([s[2] for s in inside])), 1),
                        "power_cap_fraction": round(float(np.mean(caps)), 3) if caps else None})
        rows.append(row)
    return rows


def matmul_step(torch):
    """A step of 20 bfloat16 8192^3 products and its FLOPs."""
    a, b = bf16_square_operands(torch)

    def step():
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
    return step, 20 * 2 * 8192**3


def topk_step(args):
    """A step of hs.indexer_topk at (n, heads, k) on one causal sequence."""
    import cupy as cp

    import hyscale_core as hs

    from .indexer_gpu import inputs

    q, k, w = inputs(cp, args.n, args.heads, 128)
    hs.indexer_topk(q[:1024], k[:1024], w[:1024], args.k, q_pos=np.arange(1024))  # compile

    def step():
        hs.indexer_topk(q, k, w, args.k)
        cp.cuda.Device().synchronize()
    return step, None


def run_phase(label, step, flops, seconds):
    """Steps of one workload for ``seconds`` (after one untimed step)."""
    step()
    start, t0, n = datetime.now(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    elapsed = time.perf_counter() - t0
    extra = {"tflops": round(flops * n / elapsed / 1e12, 1)} if flops else {}
    print(f"  {label}: {n} steps, {elapsed / n * 1e3:.2f} ms a step", flush=True)
    return label, start, datetime.now(), n, elapsed / n * 1e3, extra


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    workloads = {"matmul": matmul_step(torch), "topk": topk_step(args)}
    raw = out / "gpu_clocks_smi.csv"
    with open(raw, "w") as sink:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={smi_query()}", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=sink, stderr=subprocess.DEVNULL)
        try:
            phases = [run_phase(f"{name}{r + 1}", step, flops, args.seconds)
                      for r in range(args.rounds) for name, (step, flops) in workloads.items()]
        finally:
            smi.terminate()
            smi.wait()
    rows = summarise(parse_samples(raw.read_text().splitlines()), phases)
    for row in rows:
        row.update({"bench": "gpu_clocks", "config": {"n": args.n, "heads": args.heads, "k": args.k}})
    path = write_results("gpu_clocks", gpu_device(), rows, out)
    print(table(rows, ["phase", "ms_per_step", "tflops", "samples", "sm_mhz_median", "sm_mhz_p10", "sm_mhz_p90",
                       "power_w_median", "power_cap_fraction"]))
    print(f"wrote {path} and {raw}")


if __name__ == "__main__":
    main()
