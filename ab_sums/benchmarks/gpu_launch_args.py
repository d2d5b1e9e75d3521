"""Host microseconds of one hs.topk launch by the form of its by-value
scalar arguments, and of the pieces around it.

CuPy converts every kernel argument at every launch; the form of the
scalar block decides how much that costs. Each form launches the same
plan on the same input (checked bitwise against the default), issued back
to back without synchronisation, so the figure is host time per call:

    structured array   a size-1 NumPy array of the TopkArgs dtype
    void array         the same bytes viewed as one unstructured void
    prebuilt           the void array wrapped once in CuPy's by-value
                       argument (what hyscale_core.ops.topk.gpu uses when
                       CuPy has it)

plus two cp.empty calls (the outputs), gpu.topk_rows, hs.topk and
torch.topk on the same row.

    python -m benchmarks.gpu_launch_args
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from .common import gpu_device, write_results


def host_us(cp, fn, calls: int) -> float:
    """Host microseconds per call of ``fn()`` issued back to back."""
    for _ in range(20):
        fn()
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    cp.cuda.Device().synchronize()
    return elapsed


def main(argv=None) -> None:
    import cupy as cp
    import torch

    import hyscale_core as hs
    from hyscale_core.ops.topk import gpu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=65536, help="row length (one row, float32)")
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)

    x = cp.random.default_rng(0).standard_normal((1, args.n), dtype=cp.float32)
    k, device = args.k, cp.cuda.Device().id
    launch = gpu._default_launch(1, args.n, k, x.dtype, True, True, device)
    expected = gpu.run(cp, x, k, launch, device)[1]
    fields = gpu.args_fields(1, args.n, k, True, launch.plan)
    forms = {"structured array": fields, "void array": fields.view(np.dtype((np.void, gpu.ARGS_DTYPE.itemsize)))}
    forms["prebuilt"] = gpu._by_value(forms["void array"])
    rows = []
    for name, form in forms.items():
        variant = dataclasses.replace(launch, args=form)
        if not bool((gpu.run(cp, x, k, variant, device)[1] == expected).all()):
            raise AssertionError(f"{name}: indices differ from the default launch's")
        rows.append((name, host_us(cp, lambda: gpu.run(cp, x, k, variant, device), args.calls)))
    t = torch.from_dlpack(x)
    rows += [("cp.empty x2", host_us(cp, lambda: (cp.empty((1, k), cp.int64), cp.empty((1, k), cp.float32)),
                                     args.calls)),
             ("gpu.topk_rows", host_us(cp, lambda: gpu.topk_rows(x, k, True, True), args.calls)),
             ("hs.topk", host_us(cp, lambda: hs.topk(x, k), args.calls)),
             ("torch.topk", host_us(cp, lambda: torch.topk(t, k), args.calls))]
    results = []
    for name, us in rows:
        print(f"{name:18s} {us:7.1f} us/call", flush=True)
        results.append({"bench": "gpu_launch_args", "config": {"n": args.n, "k": k}, "impl": name,
                        "host_us": round(us, 2)})
    from pathlib import Path

    print(f"wrote {write_results('gpu_launch_args', gpu_device(), results, Path(args.out) if args.out else None)}")


if __name__ == "__main__":
    main()
