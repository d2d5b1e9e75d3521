"""Where hs.topk's time goes on the GPU, for one configuration: the whole
call, the launch alone (outputs and kernel, no argument checks or
reshapes), and the host time to issue one call; with the launch plan
(blocks per row, buffer entries, sample)."""
from __future__ import annotations

import argparse
import time

from .common import copies_for, time_gpu


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs
    from hyscale_core.gpu.module import multiprocessor_count
    from hyscale_core.ops.topk import gpu

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    itemsize = 4 if args.dtype == "float32" else 2
    n_copies = copies_for(args.rows * args.n * itemsize)
    xs = [cp.random.default_rng(s).standard_normal((args.rows, args.n), dtype=cp.float32) for s in range(n_copies)]
    if args.dtype == "bfloat16":
        import torch

        xs = [cp.from_dlpack(torch.from_dlpack(x).to(torch.bfloat16)) for x in xs]
    device = cp.cuda.Device().id
    plan = gpu.plan(args.rows, args.n, args.k, itemsize, multiprocessor_count(device))
    whole = time_gpu(lambda i: hs.topk(xs[i % n_copies], args.k))
    kernel = time_gpu(lambda i: gpu._launch(cp, xs[i % n_copies], args.k, True, True, plan, device))
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for i in range(20):
        hs.topk(xs[i % n_copies], args.k)
    host_ms = (time.perf_counter() - start) / 20 * 1e3
    cp.cuda.Device().synchronize()
    print(f"[{args.rows}, {args.n}] {args.dtype} k={args.k}: {plan}; whole {whole:.3f} ms, "
          f"launch alone {kernel:.3f} ms, host issue {host_ms:.3f} ms/call")


if __name__ == "__main__":
    main()
