"""CPU top-k: hs.topk against np.argpartition + sorting the selected part,
and torch.topk on the CPU when torch is installed. [4096, 32768] float32."""
from __future__ import annotations

import argparse

import numpy as np

from .common import cpu_device, table, time_cpu, write_results


def numpy_topk(a: np.ndarray, k: int):
    n = a.shape[1]
    part = np.argpartition(a, n - k, axis=1)[:, n - k:]
    vals = np.take_along_axis(a, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(vals, order, axis=1), np.take_along_axis(part, order, axis=1)


def main(argv=None) -> None:
    import hyscale_core as hs

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    a = np.random.default_rng(0).standard_normal((args.rows, args.n), dtype=np.float32)
    impls = {"hs.topk": lambda: hs.topk(a, args.k), "np.argpartition+sort": lambda: numpy_topk(a, args.k)}
    try:
        import torch

        t = torch.from_numpy(a)
        impls["torch.topk (cpu)"] = lambda: torch.topk(t, args.k)
    except ImportError:
        print("torch not installed: skipping torch.topk")
    config = {"rows": args.rows, "n": args.n, "k": args.k, "dtype": "float32"}
    rows = []
    for impl, fn in impls.items():
        ms = time_cpu(fn, repeats=args.repeats)
        rows.append({"bench": "topk_cpu", "config": config, "impl": impl, "median_ms": round(ms, 2)})
        print(f"{impl:24s} {ms:9.1f} ms", flush=True)
    base = rows[0]["median_ms"]
    for r in rows:
        r["hs_speedup"] = round(r["median_ms"] / base, 2)
    path = write_results("topk_cpu", cpu_device(), rows)
    print(table(rows, ["impl", "median_ms", "hs_speedup"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
