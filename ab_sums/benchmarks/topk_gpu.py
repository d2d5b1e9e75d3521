"""GPU top-k: hs.topk against torch.topk, cupy.argpartition and a cupy.argsort
top-k, on random and adversarial rows (float32 and bfloat16).

Times are medians of CUDA events after warm-up, rotating input copies so the
L2 cache does not serve them. The floor is one read of the input at the
copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse

from .common import copies_for, copy_bandwidth_gbs, gpu_device, table, time_gpu, write_results

SHAPES = [(1, 1 << 20), (64, 131072), (256, 262144), (1024, 131072), (4096, 131072), (16384, 32768)]
KS = [256, 2048, 4096]
DTYPES = ["float32", "bfloat16"]
DATA = ["random", "all_equal", "few_distinct", "ascending"]
SLOW_PEERS_K = 2048  # cupy.argpartition / argsort only here (they take tens of ms)

# --quick: the target shape on every kind of data, and a handful of the grid's
# configurations (few long rows, bfloat16, k = 256 and 4096, adversarial).
QUICK = [
    ((1024, 131072), "float32", "random", (256, 2048, 4096)),
    ((1024, 131072), "float32", "all_equal", (2048,)),
    ((1024, 131072), "float32", "few_distinct", (2048,)),
    ((1024, 131072), "float32", "ascending", (2048,)),
    ((1024, 131072), "bfloat16", "random", (2048,)),
    ((1024, 131072), "bfloat16", "few_distinct", (2048,)),
    ((1, 1 << 20), "float32", "random", (2048,)),
    ((1, 1 << 20), "bfloat16", "random", (4096,)),
    ((1, 1 << 20), "bfloat16", "few_distinct", (4096,)),
    ((64, 131072), "bfloat16", "random", (256,)),
    ((16384, 32768), "float32", "random", (4096,)),
    ((4096, 131072), "bfloat16", "random", (4096,)),
    ((4096, 131072), "bfloat16", "few_distinct", (4096,)),
    ((256, 262144), "float32", "random", (4096,)),
    ((256, 262144), "float32", "few_distinct", (4096,)),
]


def cases(quick: bool) -> list[tuple]:
    """(shape, dtype, data, ks) groups sharing one set of inputs."""
    if quick:
        return QUICK
    return [(shape, dtype, kind, tuple(KS)) for shape in SHAPES for dtype in DTYPES for kind in DATA]


def make_rows(cp, torch, kind: str, shape, dtype: str, seed: int):
    """(cupy array, torch tensor) views of one input, in the given dtype."""
    rng = cp.random.default_rng(seed)
    if kind == "random":
        base = rng.standard_normal(shape, dtype=cp.float32)
    elif kind == "all_equal":
        base = cp.full(shape, 1.25, dtype=cp.float32)
    elif kind == "few_distinct":
        base = rng.integers(0, 16, size=shape).astype(cp.float32)
    elif kind == "ascending":
        base = cp.sort(rng.standard_normal(shape, dtype=cp.float32), axis=1)
    else:
        raise ValueError(kind)
    tensor = torch.from_dlpack(base)
    if dtype == "bfloat16":
        tensor = tensor.to(torch.bfloat16)
        return cp.from_dlpack(tensor), tensor
    return base, tensor


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--rows, --n, --k, --dtype: one configuration of rows [rows, n] (the
    per-configuration benchmarks beside this one take them)."""
    parser.add_argument("--rows", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def peers(cp, torch, k: int, dtype: str, kind: str):
    import hyscale_core as hs

    impls = {
        "hs.topk": lambda x, t: hs.topk(x, k),
        "torch.topk": lambda x, t: torch.topk(t, k),
    }
    if k == SLOW_PEERS_K and dtype == "float32" and kind == "random":
        def argpartition(x, t):
            n = x.shape[1]
            part = cp.argpartition(x, n - k, axis=1)[:, n - k:]
            vals = cp.take_along_axis(x, part, axis=1)
            order = cp.argsort(-vals, axis=1)
            return cp.take_along_axis(vals, order, axis=1), cp.take_along_axis(part, order, axis=1)

        def argsort(x, t):
            idx = cp.argsort(-x, axis=1)[:, :k]
            return cp.take_along_axis(x, idx, axis=1), idx

        impls["cupy.argpartition"] = argpartition
        impls["cupy.argsort"] = argsort
    return impls


def run(args) -> list[dict]:
    import cupy as cp
    import torch

    bandwidth = copy_bandwidth_gbs()
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows = []
    for shape, dtype, kind, ks in cases(args.quick):
        itemsize = 4 if dtype == "float32" else 2
        n_copies = copies_for(shape[0] * shape[1] * itemsize)
        inputs = [make_rows(cp, torch, kind, shape, dtype, seed) for seed in range(n_copies)]
        floor_ms = shape[0] * shape[1] * itemsize / (bandwidth * 1e9) * 1e3
        for k in ks:
            for impl, fn in peers(cp, torch, k, dtype, kind).items():
                ms = time_gpu(lambda i: fn(*inputs[i % n_copies]), repeats=args.repeats)
                row = {"bench": "topk_gpu", "config": {"rows": shape[0], "n": shape[1], "k": k, "dtype": dtype,
                       "data": kind}, "impl": impl, "median_ms": round(ms, 4), "floor_ms": round(floor_ms, 4)}
                rows.append(row)
                print(f"{shape} {dtype:8s} {kind:12s} k={k:<5d} {impl:18s} {ms:9.3f} ms", flush=True)
        del inputs
        cp.get_default_memory_pool().free_all_blocks()
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    def key(r):
        c = r["config"]
        return (c["rows"], c["n"], c["k"], c["dtype"], c["data"])

    torch_ms = {key(r): r["median_ms"] for r in rows if r["impl"] == "torch.topk"}
    random_hs = {key(r)[:4]: r["median_ms"] for r in rows if r["impl"] == "hs.topk" and r["config"]["data"] == "random"}
    for r in rows:
        r["vs_torch"] = round(torch_ms[key(r)] / r["median_ms"], 2)
        r["x_floor"] = round(r["median_ms"] / r["floor_ms"], 2)
        if r["impl"] == "hs.topk" and key(r)[:4] in random_hs:
            r["vs_own_random"] = round(r["median_ms"] / random_hs[key(r)[:4]], 2)


def summary(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["impl"] != "hs.topk":
            continue
        c = r["config"]
        out.append({"shape": f"{c['rows']}x{c['n']}", "k": c["k"], "dtype": c["dtype"], "data": c["data"],
                    "hs_ms": r["median_ms"], "torch_x": r["vs_torch"], "x_floor": r["x_floor"],
                    "adv/rand": r.get("vs_own_random", "")})
    faster = sum(1 for o in out if o["torch_x"] > 1.0)
    ratios = [o["adv/rand"] for o in out if o["adv/rand"] != ""]
    return (table(out, ["shape", "k", "dtype", "data", "hs_ms", "torch_x", "x_floor", "adv/rand"])
            + f"\nfaster than torch.topk in {faster} of {len(out)}; worst adversarial / random "
            + f"{max(ratios, default=float('nan')):.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="the QUICK subset of the grid")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = run(args)
    from pathlib import Path

    path = write_results("topk_gpu", gpu_device(), rows, Path(args.out) if args.out else None)
    print(summary(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
