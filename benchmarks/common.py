"""Timing, device facts and the results JSON every benchmark writes.

Results JSON: ``{"device", "date", "commit", "rows": [{"bench", "config",
"impl", "median_ms", ...}]}``.
"""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """The checkout's commit; $HYSCALE_COMMIT where the tree has no .git (a copied tree)."""
    import os

    if os.environ.get("HYSCALE_COMMIT"):
        return os.environ["HYSCALE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def cpu_device() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{name}, {os.cpu_count()} cores"


def gpu_device() -> str:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"{name}, {props['multiProcessorCount']} SMs, {props['totalGlobalMem'] / 2**30:.0f} GiB"


def write_results(name: str, device: str, rows: list[dict[str, Any]], out_dir: Path | None = None) -> Path:
    payload = {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "python": sys.version.split()[0],
        "rows": rows,
    }
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def time_cpu(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_gpu(fn: Callable[[int], Any], repeats: int = 10, warmup: int = 2) -> float:
    """Median device time in milliseconds of ``fn(i)`` between CUDA events.

    ``fn`` receives the repetition number so callers rotate input copies
    (an input set larger than the L2 cache is read from memory every time).
    """
    import cupy as cp

    for i in range(warmup):
        fn(i)
    cp.cuda.Device().synchronize()
    times = []
    for i in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn(warmup + i)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def copies_for(nbytes: int, l2_bytes: int = 60 << 20, cap: int = 8) -> int:
    """How many copies of an input to rotate so the set exceeds 3x the L2."""
    return max(2, min(cap, -(-3 * l2_bytes // max(nbytes, 1))))


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth, bytes read plus written, GB/s."""
    import cupy as cp

    src = cp.ones(1 << 29, dtype=cp.float32)  # 2 GiB
    dst = cp.empty_like(src)
    ms = time_gpu(lambda i: dst.__setitem__(Ellipsis, src), repeats=10)
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


def bf16_square_operands(torch, n: int = 8192):
    """Two random [n, n] bfloat16 torch matrices on the GPU, the operands of the matmul floors."""
    return (torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16))


def matmul_rate_tflops(torch) -> float:
    """torch's bfloat16 matmul rate on the current device, TFLOP/s (8192^3, median of 10)."""
    a, b = bf16_square_operands(torch)
    ms = time_gpu(lambda i: a @ b, repeats=10)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def matmul_run_plan(flops: float, n: int = 8192) -> tuple[int, int, float]:
    """How ``matmul_run_ms`` covers ``flops``: (whole [n, n] x [n, n] products,
    the columns m of one last [n, n] x [n, m] product, the FLOPs run). m is a
    multiple of 128, at least 128, so the FLOPs run differ from ``flops`` by
    at most 2 n^2 128."""
    whole = int(flops // (2 * n**3))
    m = max(128, round((flops - whole * 2 * n**3) / (2 * n * n) / 128) * 128)
    return whole, m, float(whole * 2 * n**3 + 2 * n * n * m)


def matmul_run_ms(torch, flops: float, repeats: int = 3) -> float:
    """Median ms of torch bfloat16 matmuls run back to back whose FLOPs total
    ``flops`` (``matmul_run_plan``; the time is scaled by ``flops`` over the
    FLOPs run). Unlike ``matmul_rate_tflops`` (about 14 ms of products) this
    runs as long as the work it stands for, so a card held at its power limit
    runs it at the clock it allows over that time. One product runs first as
    a warm-up.
    """
    n = 8192
    whole, m, run_flops = matmul_run_plan(flops, n)
    a, b = bf16_square_operands(torch, n)
    rest = b[:, :m].contiguous()
    a @ b
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(whole):
            a @ b
        a @ rest
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * flops / run_flops)
    return statistics.median(times)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Fixed-width text table of the given columns."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
