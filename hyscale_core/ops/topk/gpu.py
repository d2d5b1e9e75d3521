"""GPU backend of ``topk``: the sampled-threshold kernels of ``cuda/topk.cu``.

One launch per call: a block per row (or per chunk of a row, when there are
too few rows to fill the GPU) reads the row once against a threshold taken
from a sample of the row, keeps the keys above it in shared memory, and cuts
them to the exact top k (see the kernel's header for the steps). ``k`` above
the kernel's in-register sort (``SORT_CAP``) and ``k == n`` go through the
sort-based path of ``gpu_sort``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..._backend import cupy_module
from ..._checks import INT32_MAX
from ...gpu.module import get_kernel, multiprocessor_count
from . import gpu_sort
from .keys import key_spec

SORT_CAP = 4096  # cuda/topk.cu sorts up to 16 pairs per thread (8 at 512 threads)
THREADS = 512  # block size the kernel is built for unless told (cuda/topk.cu: HS_TOPK_THREADS)
MAX_CHUNKS = 64  # cuda/topk.cu: MAX_CHUNKS
MIN_CHUNK = 16384  # elements per chunk, at least, when a row is cut into chunks
SHORT_ROW = 8192  # rows up to this length keep every element (no sample)
MAX_DYNAMIC_SMEM = 200 << 10  # bytes of buffer per block, at most (227 KiB less the static part)
MAX_SAMPLE = 8192  # sampled keys per row, at most (16384 measured slower: benchmarks/NOTES.md)
# One block per row with a buffer up to this size: 256-thread blocks, three or
# four per SM, overlap one another's per-row phases better than two of 512.
SMALL_BUFFER = 64 << 10
# ...unless a warp's span (a row over 8 warps) would pass this many elements:
# the ties path re-reads a span with one warp, and longer spans made
# tie-heavy rows over 2x slower than random ones.
MAX_SPAN = 16384
POISON_OUTPUTS = False  # tests set this: outputs start as garbage, so unwritten slots show
# Rows per launch, at most: the grid holds rows x chunks blocks (2**31 - 1 at
# most) and TopkArgs counts rows in 32 bits; more rows go in batches.
ROW_BATCH = 1 << 30

_DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3, "int32": 4, "int64": 5}


@dataclass(frozen=True)
class Plan:
    """Launch parameters of one call (see cuda/topk.cu).

    chunks   : blocks per row.
    cap      : buffer entries per block (keys above the threshold it can hold).
    sample_m : sampled keys per row (0: no sample, the threshold keeps all).
    sample_r : rank of the threshold among the sampled keys.
    k_pad    : the sort's size, a power of two >= max(k, 128).
    entry    : bytes of one buffer entry (key, then a 4-byte index).
    threads  : block size (the kernel is built for it).
    """

    chunks: int
    cap: int
    sample_m: int
    sample_r: int
    k_pad: int
    entry: int
    threads: int = THREADS


def sample_rank(m: int, k: int, n: int) -> int:
    """Rank (from the top) of the threshold among ``m`` keys sampled from ``n``.

    About m k / n sampled keys lie above the k-th key; the threshold sits
    4 standard deviations (+3) further down, so it lies at or below the k-th
    key except with probability ~1e-5, and the keys above it number about
    n r / m.
    """
    mean = m * k / n
    return int(min(m, math.ceil(mean + 4.0 * math.sqrt(mean) + 3.0)))


def plan(n_rows: int, n: int, k: int, itemsize: int, sms: int, *, threads: int | None = None,
         sample_m: int | None = None, chunks: int | None = None) -> Plan:
    """Launch parameters for ``k <= SORT_CAP`` of ``n_rows`` rows of length ``n``
    on ``sms`` SMs; ``threads`` (256 or 512), ``sample_m`` (a power of two
    >= 4096) and ``chunks`` override the defaults (benchmarks/topk_gpu_plans.py
    sweeps them)."""
    key_bytes = 8 if itemsize == 8 else 4
    entry = key_bytes + 4
    k_pad = max(128, 1 << (k - 1).bit_length())
    max_cap = MAX_DYNAMIC_SMEM // entry // 32 * 32
    if n <= SHORT_ROW:
        m = r = 0
        cap = n
    else:
        m = sample_m or max(4096, min(1 << ((n // 64).bit_length() - 1), MAX_SAMPLE))
        r = sample_rank(m, k, n)
        expected, spread = n * r / m, n * math.sqrt(r) / m
        cap = max(math.ceil(expected + 6.0 * spread) + 256, -(-m * key_bytes // entry))
    # The sort runs through two arrays of k_pad pairs.
    cap = min(-(-max(cap, 2 * k_pad) // 32) * 32, max_cap)
    if chunks is None:
        # At most one block per SM: a row's last block (its cut and sort, a
        # serial phase) then has an SM to itself, and all run in one wave.
        chunks = max(1, min(MAX_CHUNKS, sms // n_rows, n // MIN_CHUNK))
    if threads is None:
        threads = 256 if chunks == 1 and cap * entry <= SMALL_BUFFER and n <= MAX_SPAN * 8 else THREADS
    return Plan(chunks, cap, m, r, k_pad, entry, threads)


# (device, stream) -> [tickets, workspace] of chunked launches on that stream.
# Launches on one stream run in order, so they can share both: the kernel's
# last block of a row resets its ticket (the counters stay zero between
# launches), and the workspace only lives for one launch. Both only grow.
_SCRATCH: dict = {}


@functools.lru_cache(maxsize=None)
def _kernel(dtype_name: str, largest: bool, threads: int, device: int):
    """The entry point of one dtype, direction and block size, compiled for ``device``."""
    name = f"topk_{dtype_name}_{'largest' if largest else 'smallest'}"
    defines = (f"HS_TOPK_DTYPE={_DTYPE_CODES[dtype_name]}",)
    if threads != THREADS:
        defines += (f"HS_TOPK_THREADS={threads}",)
    return get_kernel("topk", name, MAX_DYNAMIC_SMEM, defines)


def _scratch(cp, n_rows: int, ws_bytes: int, device: int):
    """(workspace of at least ``ws_bytes``, ``n_rows`` zeroed ticket counters) for a
    chunked launch on the current stream of ``device``."""
    key = (device, cp.cuda.get_current_stream().ptr)
    held = _SCRATCH.get(key)
    if held is None:
        held = _SCRATCH[key] = [cp.zeros(1024, dtype=cp.uint32), cp.empty(0, dtype=cp.uint8)]
    if held[0].size < n_rows:
        held[0] = cp.zeros(n_rows, dtype=cp.uint32)
    if held[1].size < ws_bytes:
        held[1] = cp.empty(ws_bytes, dtype=cp.uint8)
    return held[1], held[0]


# The kernel's TopkArgs (cuda/topk.cu), field for field.
ARGS_DTYPE = np.dtype([(name, np.uint32) for name in
                       ("rows", "n", "k", "chunks", "cap", "sample_m", "sample_r", "k_pad", "by_key")])


@functools.lru_cache(maxsize=None)
def _by_value_form():
    """CuPy's by-value argument type, wrapped once per shape so that launches
    skip its conversion; without it (another CuPy), the size-1 NumPy array
    itself, which CuPy also passes by value, converted at every launch.
    Looked up on first use: importing hyscale_core must not import CuPy."""
    try:
        from cupy.cuda.function import CNumpyArray
    except ImportError:
        return lambda array: array
    return CNumpyArray


def _by_value(array: np.ndarray):
    return _by_value_form()(array)


@dataclass(frozen=True, eq=False)
class Launch:
    """Everything of one call but its arrays, built once per shape (:func:`prepare`)."""

    kernel: object
    grid: tuple
    block: tuple
    smem: int  # dynamic shared memory, bytes
    args: object  # one TopkArgs, passed by value
    ws_bytes: int  # workspace of a chunked launch (0: none)
    plan: Plan


def args_fields(n_rows: int, n: int, k: int, by_key: bool, p: Plan) -> np.ndarray:
    """The kernel's TopkArgs as a size-1 structured array (ARGS_DTYPE)."""
    return np.array([(n_rows, n, k, p.chunks, p.cap, p.sample_m, p.sample_r, p.k_pad, by_key)], dtype=ARGS_DTYPE)


def prepare(n_rows: int, n: int, k: int, dtype, largest: bool, by_key: bool, p: Plan, device: int) -> Launch:
    """The launch of ``p`` on rows ``[n_rows, n]`` of ``dtype``."""
    if n_rows * p.chunks > INT32_MAX:
        raise ValueError(f"{n_rows} rows of {p.chunks} chunks need more blocks than a launch holds; "
                         f"topk_rows takes them in batches of ROW_BATCH rows")
    fields = args_fields(n_rows, n, k, by_key, p)
    # Plain bytes: CuPy reads a structured array's description at every
    # launch (benchmarks/gpu_launch_args.py).
    args = _by_value(fields.view(np.dtype((np.void, ARGS_DTYPE.itemsize))))
    ws_bytes = n_rows * p.chunks * (p.cap * p.entry + 4 * (1 + p.threads // 32)) if p.chunks > 1 else 0
    return Launch(_kernel(np.dtype(dtype).name, largest, p.threads, device), (n_rows * p.chunks,), (p.threads,),
                  p.cap * p.entry, args, ws_bytes, p)


# (n_rows, n, k, dtype, largest, by_key, device) -> Launch of the default plan.
# Tests that patch ``plan`` or ``sample_rank`` patch this to a fresh dict.
_LAUNCHES: dict = {}


def _default_launch(n_rows: int, n: int, k: int, dtype, largest: bool, by_key: bool, device: int) -> Launch:
    key = (n_rows, n, k, dtype, largest, by_key, device)
    found = _LAUNCHES.get(key)
    if found is None:
        p = plan(n_rows, n, k, dtype.itemsize, multiprocessor_count(device))
        found = _LAUNCHES[key] = prepare(n_rows, n, k, dtype, largest, by_key, p, device)
    return found


@functools.lru_cache(maxsize=None)
def null_pointer():
    """A null pointer kernel argument (8 zero bytes, by value)."""
    return _by_value(np.zeros(1, dtype=np.uint64))


def run(cp, rows, k: int, launch: Launch, device: int):
    """Run ``launch`` on ``rows`` on ``device`` (the current one): ``(values [R, k], indices int64 [R, k])``.

    The kernel reads and writes raw bits; arrays go in as pointers whatever
    their dtype (bfloat16 included), so no views are made."""
    n_rows = rows.shape[0]
    out_idx = cp.empty((n_rows, k), dtype=cp.int64)
    out_val = cp.empty((n_rows, k), dtype=rows.dtype)
    if POISON_OUTPUTS:
        out_idx.fill(-7)
        out_val.view(key_spec(rows.dtype).bits_dtype).fill(0x5A)
    ws = done = null_pointer()
    if launch.ws_bytes:
        ws, done = _scratch(cp, n_rows, launch.ws_bytes, device)
    launch.kernel(launch.grid, launch.block, (rows, launch.args, ws, done, out_idx, out_val), shared_mem=launch.smem)
    return out_val, out_idx


def topk_rows(rows, k: int, largest: bool, sort_output: bool):
    """Top-k of each row of a C-contiguous 2-D CuPy array (see ``hyscale_core.topk``)."""
    cp = cupy_module()
    n_rows, n = rows.shape
    if k == 0 or n_rows == 0:
        return cp.empty((n_rows, k), dtype=rows.dtype), cp.empty((n_rows, k), dtype=cp.int64)
    if k == n and not sort_output:
        indices = cp.ascontiguousarray(cp.broadcast_to(cp.arange(n, dtype=cp.int64), (n_rows, n)))
        return rows.copy(), indices
    if k == n or k > SORT_CAP or n >= 1 << 31:
        return gpu_sort.topk_rows(cp, rows, k, largest, sort_output)
    if n_rows > ROW_BATCH:
        parts = [topk_rows(rows[a:a + ROW_BATCH], k, largest, sort_output) for a in range(0, n_rows, ROW_BATCH)]
        return cp.concatenate([v for v, _ in parts]), cp.concatenate([i for _, i in parts])
    device = cp.cuda.runtime.getDevice()
    return run(cp, rows, k, _default_launch(n_rows, n, k, rows.dtype, largest, sort_output, device), device)
