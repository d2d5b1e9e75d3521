"""Where the GPU sparse attention's time goes, kernel by kernel, with the
streams' overlap: one forward and one backward at MLA shapes recorded by
torch's profiler (CUPTI records every kernel of the process, CuPy's
included), then summed per kernel name.

    python -m benchmarks.sparse_attention_timeline --n 32768 --heads 64

Per step (fwd, bwd): its span (first kernel's start to last kernel's end;
"events" is the time between CUDA events recorded around the call on the
current stream, as benchmarks/sparse_attention_gpu.py times it, so the
difference is host time the device waited for),
the time with no kernel running (idle) and with kernels of two streams at
once (overlap); per kernel name: launches, total device time, and "alone",
the time it was the only kernel running (what removing it would save at
most); and the longest idle stretches, with the kernels that ended before
and started after each (host work the device waited for shows there).
``--rows-gb`` sets the backward's ROWS_BYTES (its query chunk; default
rows_budget()'s choice); the bits of dq and dkv do not depend on it. Inputs
as benchmarks/sparse_attention_gpu.py draws them. Results JSON:
results/sparse_attention_timeline.json (``--out`` for another folder).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from .common import gpu_device, table, write_results
from .sparse_attention_gpu import inputs, to_cupy


def kernel_events(trace: dict) -> list[tuple[float, float, str, int]]:
    """(start us, end us, name, stream) of every kernel in a chrome trace, by start."""
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and "dur" in e:
            stream = e.get("args", {}).get("stream", e.get("tid", 0))
            events.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"], int(stream)))
    return sorted(events)


GAPS = 5  # the longest stretches with no kernel running, listed per step


def summarise(events: list[tuple[float, float, str, int]]) -> dict:
    """Span, idle and overlap (ms) of a list of kernel events; per kernel
    name: launches, total ms and the ms it ran alone; the GAPS longest idle
    stretches: where they start (ms after the first kernel's start), how long
    they last, and the kernels that ended before and started after them."""
    if not events:
        return {"span_ms": 0.0, "idle_ms": 0.0, "overlap_ms": 0.0, "kernels": {}, "gaps": []}
    events = sorted(events)  # by start: the sweep adds them in this order
    bounds = sorted({t for s, e, _, _ in events for t in (s, e)})
    running: dict[int, int] = {}  # event number -> stream, for the events covering the current interval
    by_end = sorted(range(len(events)), key=lambda i: events[i][1])
    starts_at = ends_at = 0
    idle = overlap = 0.0
    alone: dict[str, float] = defaultdict(float)
    gaps, last_ended = [], ""
    for left, right in zip(bounds, bounds[1:]):
        while ends_at < len(by_end) and events[by_end[ends_at]][1] <= left:
            running.pop(by_end[ends_at], None)
            last_ended = events[by_end[ends_at]][2]
            ends_at += 1
        while starts_at < len(events) and events[starts_at][0] <= left:
            if events[starts_at][1] > left:
                running[starts_at] = events[starts_at][3]
            starts_at += 1
        width = right - left
        if not running:
            idle += width
            gaps.append({"at_ms": (left - bounds[0]) / 1e3, "ms": width / 1e3, "after": last_ended,
                         "before": events[starts_at][2]})
        elif len(set(running.values())) > 1:
            overlap += width
        if len(running) == 1:
            alone[events[next(iter(running))][2]] += width
    kernels: dict[str, dict] = {}
    for s, e, name, _ in events:
        row = kernels.setdefault(name, {"launches": 0, "total_ms": 0.0})
        row["launches"] += 1
        row["total_ms"] += (e - s) / 1e3
    for name, row in kernels.items():
        row["alone_ms"] = alone[name] / 1e3
    gaps = sorted(gaps, key=lambda g: -g["ms"])[:GAPS]
    return {"span_ms": (bounds[-1] - bounds[0]) / 1e3, "idle_ms": idle / 1e3, "overlap_ms": overlap / 1e3,
            "kernels": kernels, "gaps": gaps}


def record(torch, steps: dict) -> dict:
    """{step name: summarise() of its kernels}; each step runs once before it is recorded."""
    from torch.profiler import ProfilerActivity, profile

    summaries = {}
    for name, fn in steps.items():
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            summaries[name] = summarise(kernel_events(json.loads(path.read_text())))
        summaries[name]["events_ms"] = start.elapsed_time(stop)  # the call as the benchmark times it
        print(f"  {name}: {summaries[name]['span_ms']:.2f} ms span, {summaries[name]['events_ms']:.2f} ms between "
              f"events, {len(summaries[name]['kernels'])} kernel names", flush=True)
    return summaries


def main(argv=None) -> None:
    import cupy as cp
    import torch

    import hyscale_core as hs
    from hyscale_core.ops.sparse_attention import gpu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[32768])
    parser.add_argument("--heads", type=int, nargs="+", default=[64])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--rows-gb", type=float, nargs="+", default=[None],
                        help="the backward's ROWS_BYTES in GiB, one run each (default: rows_budget() picks)")
    parser.add_argument("--steps", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--out", default=None, help="folder of the results JSON (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows, short = [], []
    for h in args.heads:
        for n in args.n:
            q, kv, dout, idx = (to_cupy(cp, x, torch) for x in inputs(torch, n, h, args.topk))
            out, lse = hs.sparse_attention(q, kv, idx)
            for rows_gb in args.rows_gb if "bwd" in args.steps else [None]:
                gpu.ROWS_BYTES = None if rows_gb is None else int(rows_gb * 2**30)
                steps = {"fwd": lambda: hs.sparse_attention(q, kv, idx),
                         "bwd": lambda: hs.sparse_attention_backward(q, kv, idx, out, lse, dout)}
                if rows_gb != args.rows_gb[0]:
                    steps.pop("fwd")  # the forward does not depend on ROWS_BYTES: recorded once
                picked = {s: steps[s] for s in args.steps if s in steps}
                budget = round(gpu.rows_budget() / 2**30, 2)  # as the backward will pick it (memory is free now)
                print(f"N={n} h={h} rows {budget} GiB", flush=True)
                for step, summary in record(torch, picked).items():
                    config = {"n": n, "h": h, "k": args.topk, "rows_gib": budget if step == "bwd" else None}
                    rows.append({"bench": "sparse_attention_timeline", "config": config, "impl": f"hs {step}",
                                 **summary})
                    short.append({"N": n, "h": h, "step": step, "rows GiB": config["rows_gib"] or "",
                                  "kernel": "(events / span / idle / overlap)",
                                  "ms": f"{summary['events_ms']:.2f} / {summary['span_ms']:.2f} / "
                                        f"{summary['idle_ms']:.2f} / {summary['overlap_ms']:.2f}"})
                    for gap in summary["gaps"]:
                        short.append({"N": n, "h": h, "step": step, "rows GiB": config["rows_gib"] or "",
                                      "kernel": f"(idle at {gap['at_ms']:.2f} ms: {gap['after'][:18]} -> "
                                                f"{gap['before'][:18]})", "ms": f"{gap['ms']:.3f}"})
                    for name, k in sorted(summary["kernels"].items(), key=lambda kv: -kv[1]["total_ms"]):
                        short.append({"N": n, "h": h, "step": step, "rows GiB": config["rows_gib"] or "",
                                      "kernel": name[:40], "launches": k["launches"],
                                      "ms": f"{k['total_ms']:.2f}", "alone ms": f"{k['alone_ms']:.2f}"})
            del q, kv, dout, idx, out, lse
            cp.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
    path = write_results("sparse_attention_timeline", gpu_device(), rows, Path(args.out) if args.out else None)
    print(table(short, ["N", "h", "step", "rows GiB", "kernel", "launches", "ms", "alone ms"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
