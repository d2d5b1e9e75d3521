"""Where one item of the sparse-attention forward spends its time.

An item is one CTA of ``sa_forward``: a query and a group of 64 heads. This
builds an instrumented copy of cuda/sparse_attention.cu: thread 0 of each
warpgroup reads ``%clock64`` at fixed points of the kernel (no barrier is
added), every CTA records its SM, its start and each warpgroup's end, and
one CTA in SAMPLE records every point of its first 16 pairs. It checks that
the instrumented build gives the library's out and lse bitwise, times both,
and reports, in microseconds at the SM clock measured from ``%globaltimer``
over the same CTAs:

    item        a CTA's start to its last warpgroup's end (mean)
    gap         a CTA's end to the start of the next CTA on its SM (mean)
    per item    the launch's time x SMs / CTAs, which item + gap should match
    counted     start to the block count (the CTA's first barrier)
    q           start to the q tile landed
    first       start to warpgroup 0's first logits in registers
    pair        warpgroup 0's logits of pair i to those of pair i + 1, for
                the first pair, the median of the middle pairs, and the last
                pair (to the end of warpgroup 0's loop)
    out         a warpgroup's loop end to its output written (the later one)

then the parts of a middle pair and of the first pair for each warpgroup
(``--detail``), medians over the sampled CTAs: what each warp waits for
between two points. ``--variants products_only`` (no gathers) and
``gathers_only`` (no tensor products) instrument those variants of
benchmarks/sparse_attention_variants.py instead.

    python -m benchmarks.sparse_attention_phases
    python -m benchmarks.sparse_attention_phases --sizes 32768 131072 --topk 128 2048 --detail

Indices are benchmarks/sparse_attention_gpu.py's uniform table (k keys per
query from [0, max(t + 1, k))).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .common import gpu_device, time_gpu, write_results

SAMPLE = 32  # one CTA in SAMPLE records every point
MAX_CTAS = 1 << 18
MAX_SAMPLED = MAX_CTAS // SAMPLE
PAIRS = 16  # pairs recorded per sampled CTA
ENDS = 8  # per CTA: smid, clock at start, clock at each warpgroup's end, globaltimer at start and end
POINTS = 8 + 16 * PAIRS  # per sampled CTA: see _CTA_POINTS and _PAIR_POINTS

# Points of a sampled CTA (slot: name), then per pair i slots 8 + 16 i + j.
_CTA_POINTS = {0: "start", 1: "counted", 2: "q landed", 3: "wg0 loop end", 4: "wg1 loop end", 5: "wg0 out",
               6: "wg1 out"}
# No point sits between a wgmma's issue and its wait on registers it writes: a branch there makes ptxas
# inject warpgroup.arrive (C7519), which would change what is measured (slots 7 and 13 stay unused).
_PAIR_POINTS = {0: "wg0 logits in", 1: "wg0 softmax done", 2: "wg0 own p v done", 3: "wg0 has pair bases",
                4: "wg0 has wg1's p", 5: "wg0 next left half", 6: "wg0 other p v done", 8: "wg0 next logits in",
                9: "wg1 top", 10: "wg1 right half", 11: "wg1 logits in", 12: "wg1 has wg0's bases",
                14: "wg1 own p v done", 15: "wg1 other p v done"}
_WG_POINTS = ([0, 1, 2, 3, 4, 5, 6, 8], [9, 10, 11, 12, 14, 15])  # each warpgroup's points in order

_PRELUDE = f"""
__device__ unsigned long long hs_sa_ends[{MAX_CTAS} * {ENDS}];
__device__ unsigned long long hs_sa_points[{MAX_SAMPLED} * {POINTS}];
__device__ __forceinline__ unsigned long long hs_clock() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    return t;
}}
__device__ __forceinline__ unsigned long long hs_gtime() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}}
__device__ __forceinline__ bool hs_sampled() {{
    return blockIdx.x % {SAMPLE} == 0 && blockIdx.x / {SAMPLE} < {MAX_SAMPLED};
}}
#define HS_POINT(slot) do {{ if ((threadIdx.x & 127) == 0 && hs_sampled()) \\
    hs_sa_points[(size_t)(blockIdx.x / {SAMPLE}) * {POINTS} + (slot)] = hs_clock(); }} while (0)
#define HS_PAIR(j) do {{ if (i < {PAIRS}) HS_POINT(8 + 16 * i + (j)); }} while (0)
#define HS_START() do {{ if (threadIdx.x == 0 && blockIdx.x < {MAX_CTAS}) {{ \\
    unsigned int smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid)); \\
    unsigned long long* e = hs_sa_ends + (size_t)blockIdx.x * {ENDS}; \\
    e[0] = smid; e[4] = hs_gtime(); e[1] = hs_clock(); }} HS_POINT(0); }} while (0)
#define HS_END() do {{ if ((threadIdx.x & 127) == 0 && blockIdx.x < {MAX_CTAS}) {{ \\
    unsigned long long* e = hs_sa_ends + (size_t)blockIdx.x * {ENDS}; \\
    e[2 + (threadIdx.x >> 7)] = hs_clock(); e[5 + (threadIdx.x >> 7)] = hs_gtime(); }} \\
    HS_POINT(5 + (threadIdx.x >> 7)); }} while (0)
"""

# (anchor in cuda/sparse_attention.cu, mark, whether the mark goes before the anchor, else after it)
_MARKS = [
    ("    Tiles tl;\n", "HS_START()", False),
    ("    const int pairs = (blocks_with_keys(sh, last) + 1) / 2;\n", "HS_POINT(1)", False),
    ("    float o[128], l[2] = {0.f, 0.f}, m[2] = {neg_inf(), neg_inf()};\n", "HS_POINT(2)", True),
    ("    write_output(o, l, m, sh, tl.q, out, lse, lse2, t, g, h, ln);\n}", "HS_POINT(3 + ln.w)", True),
    ("    write_output(o, l, m, sh, tl.q, out, lse, lse2, t, g, h, ln);\n", "HS_END()", False),
    # warpgroup 0's loop
    ("        if (next) {\n            block_keys(keys[0], indices, t, k, 2 * i + 2, gl);\n"
     "            block_keys(keys[1], indices, t, k, 2 * i + 3, gl);\n        }\n        float mx[2], base[2];\n"
     "        scale_logits(s, valid, sl2, mx);\n        const float mn", "HS_PAIR(0)", True),
    ("        bar_arrive(BAR_MAX0, THREADS);\n", "HS_PAIR(1)", False),
    ("        if (next) gather_half<0, 4>(sh, tl, 0, LEFT, kv, keys[0], gl);  // block 2i is done with it\n",
     "HS_PAIR(2)", True),
    ("        bar_sync(BAR_MAX1, THREADS);\n", "HS_PAIR(3)", False),
    ("        bar_sync(BAR_P1, THREADS);\n", "HS_PAIR(4)", False),
    ("            wait_half(sh, 0, LEFT, (i + 1) & 1);\n", "HS_PAIR(5)", False),
    ("            gather_half<0, 4>(sh, tl, 1, LEFT, kv, keys[1], gl);  // block 2i + 1 is done with it\n",
     "HS_PAIR(6)", True),
    ("            wgmma_wait<0>();\n        }\n        wgmma_fence_operands(o);\n", "HS_PAIR(8)", False),
    # warpgroup 1's loop
    ("        const u32 valid = valid_slots(indices, t, k, 2 * i + 1, ln);\n", "HS_PAIR(9)", True),
    ("        wait_half(sh, 1, RIGHT, i & 1);\n", "HS_PAIR(10)", False),
    ("        float mx[2], base[2];\n        scale_logits(s, valid, sl2, mx);\n        bar_sync(BAR_MAX0",
     "HS_PAIR(11)", True),
    ("        bar_sync(BAR_MAX0, THREADS);\n", "HS_PAIR(12)", False),
    ("        hold_fragment(a);\n        if (next) gather_half<4, D / 64>(sh, tl, 1, RIGHT", "HS_PAIR(14)", True),
    ("        if (next) gather_half<4, D / 64>(sh, tl, 0, RIGHT, kv, keys[0], gl);  // block 2i is done with it\n",
     "HS_PAIR(15)", True),
]


def instrumented_source(source: str) -> str:
    """cuda/sparse_attention.cu (or a variant's text) with the marks; fails if an anchor has moved."""
    for anchor, mark, before in _MARKS:
        if source.count(anchor) != 1:
            raise RuntimeError(f"cuda/sparse_attention.cu changed: anchor not found once: {anchor!r}")
        indent = anchor[: len(anchor) - len(anchor.lstrip(" "))]
        line = f"{indent}{mark};\n"
        source = source.replace(anchor, line + anchor if before else anchor + line)
    return source.replace("namespace {\n", _PRELUDE + "namespace {\n", 1)


def spans(points: np.ndarray, pairs: int) -> dict:
    """Medians over sampled CTAs (cycles) of the item's phases from the points [ctas, POINTS]."""
    at = lambda i, j: points[:, 8 + 16 * i + j]  # noqa: E731
    cta = {name: points[:, slot] for slot, name in _CTA_POINTS.items()}
    last = min(pairs, PAIRS) - 1
    mids = range(1, last - 1) if last >= 3 else range(0)
    loop_end = np.maximum(cta["wg0 loop end"], cta["wg1 loop end"])
    return {
        "counted": np.median(cta["counted"] - cta["start"]),
        "q": np.median(cta["q landed"] - cta["start"]),
        "first": np.median(at(0, 0) - cta["start"]),
        "pair first": np.median(at(1, 0) - at(0, 0)) if last >= 1 else np.nan,
        "pair middle": np.median(np.concatenate([at(i + 1, 0) - at(i, 0) for i in mids])) if mids else np.nan,
        "pair last": np.median(cta["wg0 loop end"] - at(last, 0)),
        "out": np.median(np.maximum(cta["wg0 out"], cta["wg1 out"]) - loop_end),
    }


def _pair_parts(points: np.ndarray, i: int) -> dict:
    """Medians (cycles) from each point of pair i to the next point of the same warpgroup, and from
    warpgroup 0's logits to warpgroup 1's, over the CTAs that recorded both points (the last pair has
    no next halves)."""
    base = 8 + 16 * i

    def median(a: int, b: int) -> float:
        x, y = points[:, base + a], points[:, base + b]
        both = (x > 0) & (y > 0)
        return float(np.median(y[both] - x[both])) if both.any() else float("nan")

    parts = {f"{_PAIR_POINTS[a]} -> {_PAIR_POINTS[b]}": median(a, b)
             for order in _WG_POINTS for a, b in zip(order, order[1:])}
    parts["wg0 logits in -> wg1 logits in"] = median(0, 11)
    return parts


def ends_summary(ends: np.ndarray) -> tuple[float, float, float]:
    """(SM clock in GHz, mean item span, mean gap to the next CTA on the same SM), spans in cycles,
    from the per-CTA records [ctas, ENDS]: smid, clock at start, each warpgroup's clock at its end,
    globaltimer (ns) at start and at each warpgroup's end."""
    end = np.maximum(ends[:, 2], ends[:, 3])
    elapsed_ns = np.maximum(np.maximum(ends[:, 6], ends[:, 7]) - ends[:, 4], 1)
    ghz = float(np.median((end - ends[:, 1]) / elapsed_ns))
    order = np.lexsort((ends[:, 1], ends[:, 0]))  # by SM, then start
    sm, start, stop = ends[order, 0], ends[order, 1], end[order]
    gaps = (start[1:] - stop[:-1])[sm[1:] == sm[:-1]]
    return ghz, float(np.mean(stop - start)), float(np.mean(gaps)) if gaps.size else float("nan")


def _instrumented_forward(gpu, variant: str | None):
    """The instrumented sa_forward (bfloat16) and its module, whose globals hold the records."""
    from hyscale_core.gpu.module import cuda_source_dir, module_from_source

    from .sparse_attention_variants import forward_variant

    source = (cuda_source_dir() / "sparse_attention.cu").read_text()
    if variant:
        source = forward_variant(source, variant)
    module = module_from_source("sparse_attention", instrumented_source(source), ("HS_SA_F16=0",))
    kernel = module.get_function("sa_forward")
    kernel.max_dynamic_shared_size_bytes = gpu.SMEM_FORWARD
    return kernel, module


def _print_row(row: dict) -> None:
    c = row["config"]
    print(f"N={c['n']} h={c['h']} k={c['k']} {c['variant']}: library {row['ms']['library']:.2f} ms, instrumented "
          f"{row['ms']['instrumented']:.2f} ms, SM {row['sm_ghz']:.2f} GHz, "
          f"bitwise {'yes' if row['bitwise_as_library'] else 'no'}", flush=True)
    print("  " + "  ".join(f"{name} {v}" for name, v in row["us"].items()) + " (us)", flush=True)
    for pair, parts in row.get("parts_us", {}).items():
        print(f"  {pair}: " + "; ".join(f"{name} {v}" for name, v in parts.items()), flush=True)


def measure(cp, torch, n: int, h: int, k: int, variant: str | None, detail: bool) -> dict:
    """One launch of the instrumented forward on the uniform table: its records summarised, its out
    and lse compared with the library kernel's, both timed."""
    from hyscale_core.gpu.module import multiprocessor_count
    from hyscale_core.ops.sparse_attention import gpu

    from .sparse_attention_gpu import inputs, to_cupy

    tq, tkv, tdout, tidx = inputs(torch, n, h, k)
    del tdout
    q, kv, idx = (to_cupy(cp, x, torch) for x in (tq, tkv, tidx))
    kernel, module = _instrumented_forward(gpu, variant)
    ctas = n * -(-h // gpu.HEADS_PER_CTA)
    if ctas > MAX_CTAS:
        raise ValueError(f"{ctas} CTAs: the instrumented build records {MAX_CTAS}")
    ends = cp.ndarray((MAX_CTAS * ENDS,), cp.uint64, module.get_global("hs_sa_ends"))
    points = cp.ndarray((MAX_SAMPLED * POINTS,), cp.uint64, module.get_global("hs_sa_points"))
    out = cp.empty((n, h, gpu.D_V), dtype=cp.uint16)
    lse = cp.empty((n, h), dtype=cp.float32)
    scale = 1.0 / np.sqrt(gpu.D_QK)
    args = (q.view(cp.uint16), kv.view(cp.uint16), idx, out, lse, np.uint64(0), np.int32(h), np.int32(k),
            np.float32(scale))

    def launch(_=0):
        kernel((ctas,), (gpu.THREADS,), args, shared_mem=gpu.SMEM_FORWARD)

    def library(_=0):
        return gpu.sparse_attention(q, kv, idx, gpu.D_V, scale, want_probs=False)

    ends.fill(0)
    points.fill(0)
    launch()
    cp.cuda.Device().synchronize()
    e = ends[: ctas * ENDS].get().reshape(ctas, ENDS).astype(np.int64)
    p = points[: -(-ctas // SAMPLE) * POINTS].get().reshape(-1, POINTS).astype(np.int64)
    ref_out, ref_lse, _ = library()
    same = bool((ref_out.view(cp.uint16) == out).all()) and bool(
        (ref_lse.view(cp.uint32) == lse.view(cp.uint32)).all())
    del ref_out, ref_lse
    if not same and variant is None:
        raise AssertionError(f"N={n} h={h} k={k}: the instrumented build's out or lse differ from the library's")
    traced_ms = time_gpu(launch, repeats=3, warmup=1)
    real_ms = time_gpu(library, repeats=3, warmup=1)

    ghz, item, gap = ends_summary(e)

    def us(cycles) -> float | None:
        return None if not np.isfinite(cycles) else round(float(cycles) / ghz / 1e3, 2)

    pairs = -(-k // 128)
    sms = multiprocessor_count(cp.cuda.Device().id)
    row = {
        "bench": "sparse_attention_phases",
        "config": {"n": n, "h": h, "k": k, "variant": variant or "main", "sample": SAMPLE, "pairs": pairs},
        "ms": {"library": round(real_ms, 3), "instrumented": round(traced_ms, 3)},
        "bitwise_as_library": same,
        "sm_ghz": round(ghz, 3),
        "us": {"per item": round(traced_ms * 1e3 * sms / ctas, 2), "item": us(item), "gap": us(gap),
               **{name: us(v) for name, v in spans(p, pairs).items()}},
    }
    if detail:
        row["parts_us"] = {f"pair {i}": {name: us(v) for name, v in _pair_parts(p, i).items()}
                           for i in sorted({0, min(pairs, PAIRS) // 2})}
    _print_row(row)
    return row


def main(argv=None) -> None:
    import cupy as cp
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, nargs="+", default=[64])
    parser.add_argument("--topk", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--variants", nargs="+", default=["main"], choices=["main", "products_only", "gathers_only"])
    parser.add_argument("--detail", action="store_true", help="the parts of the first and a middle pair")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = []
    for variant in args.variants:
        for n in args.sizes:
            for h in args.heads:
                for k in args.topk:
                    rows.append(measure(cp, torch, n, h, k, None if variant == "main" else variant, args.detail))
                    cp.get_default_memory_pool().free_all_blocks()
    path = write_results("sparse_attention_phases", gpu_device(), rows, Path(args.out) if args.out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
