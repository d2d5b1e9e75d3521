"""Where hs.topk's time goes on the GPU, for one configuration: the whole
call, each kernel stage alone, and the host time to issue one call."""
from __future__ import annotations

import argparse
import time

from .common import copies_for, time_gpu


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs
    from hyscale_core.ops.topk import gpu

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--k", type=int, default=2048)
    args = parser.parse_args(argv)
    n_copies = copies_for(args.rows * args.n * 4)
    xs = [cp.random.default_rng(s).standard_normal((args.rows, args.n), dtype=cp.float32) for s in range(n_copies)]
    segs = gpu._segments(args.rows, args.n, args.k, 4)
    whole = time_gpu(lambda i: hs.topk(xs[i % n_copies], args.k))
    stage1 = time_gpu(lambda i: gpu._select(cp, xs[i % n_copies], args.k, True, gpu.BY_INDEX, segs))
    _, cand = gpu._select(cp, xs[0], args.k, True, gpu.BY_INDEX, segs)
    stage2 = time_gpu(lambda i: gpu._select(cp, cand, args.k, True, gpu.BY_KEY, 1)) if segs > 1 else 0.0
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for i in range(20):
        hs.topk(xs[i % n_copies], args.k)
    host_ms = (time.perf_counter() - start) / 20 * 1e3
    cp.cuda.Device().synchronize()
    print(f"[{args.rows}, {args.n}] k={args.k}: segments/row {segs}; whole {whole:.3f} ms, "
          f"stage 1 {stage1:.3f} ms, stage 2 {stage2:.3f} ms, host issue {host_ms:.3f} ms/call")


if __name__ == "__main__":
    main()
