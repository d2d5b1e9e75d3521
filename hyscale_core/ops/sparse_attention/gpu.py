"""GPU backend of sparse attention: the tensor-core kernels of
``cuda/sparse_attention.cu`` (forward) and ``cuda/sparse_attention_bwd.cu``
for MLA shapes in 16-bit, CuPy primitives (``gpu_fallback``) for everything
else.

Same contract as cpu.py. The kernels run when q and kv are both bfloat16 or
both float16, d_qk = 576 and d_v = 512 (for float16 also scale >= 2**-15, so
p / scale stays finite); other inputs (float32/float64 data, mixed dtypes,
other head dims) take ``gpu_fallback``, which computes in float64.

Kernels (one CTA per query and group of 64 heads, the heads as the M of
wgmma products, selected kv rows gathered into shared memory block by
block of 64 slots):

- forward: the blocks go in pairs through two buffers, and each of the two
  warpgroups takes one block of a pair: logits, online softmax (the row
  bases passed from one to the other; a base rises only where a block's
  maximum exceeds it by more than 8 in base 2, so p <= 256 and o is seldom
  rescaled), and p v for its half of the value
  columns over both blocks, so one warpgroup's softmax runs beside the
  other's products; each half of a buffer is gathered again by the
  warpgroup that reads it last, as soon as it has. Logits, softmax,
  lse and every sum in float32; p is rounded to the input's 16-bit type as
  the operand of p v; out rounded once to q's dtype. ``probs`` needs the
  final lse, so a second kernel walks the blocks again, recomputes the
  logits (about half the forward's tensor work again; skipped with
  ``want_probs=False``) and sums exp(logit - lse) over the heads in a fixed
  order (head groups of h > 64 are added in order).
- backward: delta = rowsum(dout * out) in float32; per block p and dp are
  recomputed, ds = p (dp - delta) is rounded to 16-bit as an operand (and is
  exactly 0 on a row whose valid slots all hold one key, where p does not
  depend on the logits), dq accumulates in float32 registers. Each
  selected slot's dkv row, scale ds^T q + p^T dout summed in float32 over
  the heads of a pass (up to 128, so one row per slot for h <= 128), is
  written to a scratch buffer, and the rows are added into a float32 dkv
  key by key in ascending (query, slot, pass) order (a stable sort of the
  index table; no atomics), then rounded once to kv's dtype. The rows are
  bfloat16 for bfloat16 inputs (each rounded once: half the scratch traffic
  of float32; ``precise_dkv`` keeps them float32) and float32 for float16
  inputs. Bitwise reproducible, and independent of the query chunking
  (``rows_budget``), since each key's running sum sees the same sequence of
  adds. A chunk's dkv rows and sums run on a second stream while the
  current stream runs the next chunk's dq kernel (``OVERLAP_CHUNKS``; the
  same bits either way; two chunks' images held). Their scratch (the rows,
  up to ``rows_budget()`` bytes, and the key table) is allocated on that stream, and
  CuPy's stream-aware pool keeps freed blocks for the stream that freed
  them: after a backward the pool holds them for the next one, and
  ``cupy.get_default_memory_pool().free_all_blocks()`` gives them back.
"""
from __future__ import annotations

import numpy as np

from ..._backend import cupy_module
from ..._dtypes import bfloat16
from ...gpu.convert import narrow, widen
from ...gpu.module import get_kernel
from ...gpu.segments import key_segments
from . import gpu_fallback

# cuda/sparse_attention.cuh
D_QK, D_V = 576, 512
HEADS_PER_CTA, SLOTS_PER_BLOCK, THREADS = 64, 64, 256
_TILE = 64 * 128  # one 64-row region of a swizzled tile, bytes
IMAGE_BYTES = 2 * _TILE  # a block's ds and p' tiles
SMEM_FORWARD = 1024 + 9 * _TILE + 2 * 9 * _TILE + _TILE  # q, two key blocks, a p tile (probs: per-warp sums)
SMEM_DQ = 1024 + 9 * _TILE + 8 * _TILE + 9 * _TILE + IMAGE_BYTES  # q, dout, a key block, its image
GROUPS_PER_PASS = 2  # head groups one dkv-rows pass sums (its K: up to 128 heads)
SMEM_DKV_ROWS = {gp: 1024 + 13 * gp * _TILE for gp in (1, 2)}  # q and dout columns of a half, 2 blocks of images

ROWS_BYTES = None  # bytes of the backward's dkv rows per query chunk; None: rows_budget() picks
MIN_ROWS_BYTES, MAX_ROWS_BYTES = 1 << 30, 16 << 30
FREE_SHARE = 4  # rows_budget: at most a quarter of the free device memory
POISON_OUTPUTS = False  # tests set this: outputs start as NaN, so unwritten entries show
OVERLAP_CHUNKS = True  # the backward's dkv rows and sums on a second stream, beside the next chunk's dq kernel


def _defines(q, kv, d_v: int, scale: float) -> tuple[str, ...] | None:
    """Compile-time defines of the kernels for these inputs, or None where gpu_fallback runs."""
    dtype = np.dtype(q.dtype)
    if dtype != np.dtype(kv.dtype) or dtype not in (bfloat16, np.dtype(np.float16)):
        return None
    if q.shape[2] != D_QK or d_v != D_V:
        return None
    f16 = dtype == np.float16
    if f16 and scale < 2.0 ** -15:
        return None
    return (f"HS_SA_F16={int(f16)}",)


_SOURCES = {"sa_forward": "sparse_attention", "sa_forward_probs": "sparse_attention_probs"}


def _kernel(name: str, smem: int, defines: tuple[str, ...]):
    """sa_forward from cuda/sparse_attention.cu, sa_forward_probs from cuda/sparse_attention_probs.cu,
    the backward kernels from cuda/sparse_attention_bwd.cu."""
    return get_kernel(_SOURCES.get(name, "sparse_attention_bwd"), name, smem, defines)


def _bits(x):
    return x.view(cupy_module().uint16)


def _groups(h: int) -> int:
    return -(-h // HEADS_PER_CTA)


def head_passes(h: int) -> int:
    """Head passes of the dkv rows: one row per slot and pass."""
    return -(-_groups(h) // GROUPS_PER_PASS)


def _sum_groups(cp, part):
    """probs [N, k] from the per-head-group sums [N, groups, k], groups added in order."""
    total = cp.ascontiguousarray(part[:, 0])
    for g in range(1, part.shape[1]):
        total += part[:, g]
    return total


def sparse_attention(q, kv, indices, d_v: int, scale: float, want_probs: bool = True):
    """``(out, lse, probs)`` as cpu.py; ``probs`` is None with ``want_probs=False``
    (the kernels then skip its pass)."""
    defines = _defines(q, kv, d_v, scale)
    if defines is None:
        out, lse, probs = gpu_fallback.sparse_attention(q, kv, indices, d_v, scale)
        return out, lse, (probs if want_probs else None)
    cp = cupy_module()
    n, h, _ = q.shape
    k, groups = indices.shape[1], _groups(h)
    out = cp.empty((n, h, d_v), dtype=cp.uint16)
    lse = cp.empty((n, h), dtype=cp.float32)
    part = cp.empty((n, groups, k), dtype=cp.float32) if want_probs else None
    lse2 = cp.empty((n, h), dtype=cp.float32) if want_probs else None  # lse in base 2, for the probs kernel
    if POISON_OUTPUTS:
        out.fill(0xFFFF)
        lse.fill(np.nan)
        if part is not None:
            part.fill(np.nan)
    if n:
        _kernel("sa_forward", SMEM_FORWARD, defines)(
            (n * groups,), (THREADS,), (_bits(q), _bits(kv), indices, out, lse,
                                        lse2 if want_probs else np.uint64(0), np.int32(h), np.int32(k),
                                        np.float32(scale)), shared_mem=SMEM_FORWARD)
    if n and want_probs:
        _kernel("sa_forward_probs", SMEM_FORWARD, defines)(
            (n * groups,), (THREADS,), (_bits(q), _bits(kv), indices, lse2, part, np.int32(h), np.int32(k),
                                        np.float32(scale)), shared_mem=SMEM_FORWARD)
    probs = _sum_groups(cp, part) if want_probs else None
    return out.view(q.dtype), lse, probs


def _as_dtype(x, dtype):
    """x as a C-contiguous array of ``dtype`` (16-bit), rounded once from float32."""
    if np.dtype(x.dtype) == np.dtype(dtype):
        return cupy_module().ascontiguousarray(x)
    return narrow(widen(x, cupy_module().float32), dtype)


def rows_budget() -> int:
    """Bytes of dkv rows per query chunk of the backward: ``ROWS_BYTES`` where set,
    else a ``1 / FREE_SHARE`` share of the device memory free now (the driver's
    free bytes plus the blocks CuPy's pool holds unused), clamped to
    [MIN_ROWS_BYTES, MAX_ROWS_BYTES]. Fewer chunks mean fewer passes of the
    per-key sums over the float32 dkv. The backward's scratch is about 1.5x
    this: the rows, two chunks' images (0.22x each) and the key table."""
    if ROWS_BYTES is not None:
        return ROWS_BYTES
    cp = cupy_module()
    free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
    return min(MAX_ROWS_BYTES, max(MIN_ROWS_BYTES, free // FREE_SHARE))


def query_chunks(n: int, rows_per_query: int, row_dtype):
    """Query ranges whose dkv rows (``rows_per_query`` rows [576] of ``row_dtype`` per query) fit
    ``rows_budget()``: as few as fit, of equal length but for the last (no short tail chunk)."""
    most = max(1, rows_budget() // max(1, rows_per_query * D_QK * np.dtype(row_dtype).itemsize))
    step = -(-n // -(-n // most)) if n else 1
    for t0 in range(0, n, step):
        yield t0, min(n, t0 + step)


def dq_and_images(q, kv, indices, out, dout, lse, dq, scale: float, defines: tuple[str, ...]):
    """sa_backward_dq on a chunk of queries (16-bit q, out, dout; float32 lse):
    writes dq [C, h, 576] (uint16 bits) and returns the ds / p' images (uint8)."""
    cp = cupy_module()
    (n, h, _), k = q.shape, indices.shape[1]
    ctas = n * _groups(h)
    images = cp.empty(ctas * -(-k // SLOTS_PER_BLOCK) * IMAGE_BYTES, dtype=cp.uint8)
    _kernel("sa_backward_dq", SMEM_DQ, defines)(
        (ctas,), (THREADS,), (_bits(q), _bits(kv), indices, _bits(out), _bits(dout), lse, dq, images, np.int32(h),
                              np.int32(k), np.float32(scale)), shared_mem=SMEM_DQ)
    return images


def _row_suffix(rows) -> str:
    return "bf16" if rows.dtype == cupy_module().uint16 else "f32"


def dkv_rows(q, dout, indices, images, scale: float, defines: tuple[str, ...], row_dtype):
    """sa_backward_dkv_rows{1,2}_{f32,bf16} on the chunk of ``dq_and_images``: [C * passes
    * k, 576] of ``row_dtype`` (float32, or uint16 holding bfloat16 bits), row (t * passes
    + p) * k + i = the dkv contribution of slot i of query t from the heads of pass p
    (128 p .. 128 p + 127)."""
    cp = cupy_module()
    (n, h, _), k = q.shape, indices.shape[1]
    groups, passes = _groups(h), head_passes(h)
    rows = cp.empty((n * passes * k, D_QK), dtype=row_dtype)
    for p in range(passes):
        gp = min(GROUPS_PER_PASS, groups - GROUPS_PER_PASS * p)
        smem = SMEM_DKV_ROWS[gp]
        _kernel(f"sa_backward_dkv_rows{gp}_{_row_suffix(rows)}", smem, defines)(
            (2 * n,), (THREADS,), (_bits(q), _bits(dout), indices, images, rows, np.int32(h), np.int32(k),
                                   np.float32(scale), np.int32(p)), shared_mem=smem)
    return rows


def add_rows_by_key(indices, rows, passes: int, dkv, defines: tuple[str, ...]) -> None:
    """dkv[s] += every row of the chunk whose slot selected key s, in ascending
    (query, slot, pass) order, in float32. indices int32 [C, k]; rows [C * passes * k, 576]
    as ``dkv_rows`` makes them."""
    n_keys = dkv.shape[0]
    if n_keys == 0 or indices.size == 0:
        return
    pairs, starts = key_segments(indices, cupy_module().int32, n_keys)
    k = indices.shape[1]
    _kernel(f"sa_dkv_segments_{_row_suffix(rows)}", 0, defines)(
        (n_keys,), (D_QK // 4,), (rows, pairs, starts, np.int32(k), np.int32(passes), dkv))


def dkv_rows_dtype(q, precise_dkv: bool):
    """The dtype of the dkv rows: bfloat16 bits (uint16) for bfloat16 inputs unless
    ``precise_dkv``; float32 otherwise (float16's range could overflow a row)."""
    cp = cupy_module()
    return cp.uint16 if np.dtype(q.dtype) == bfloat16 and not precise_dkv else cp.float32


def backward_operands(q, kv, out, lse, dout, d_v: int, scale: float):
    """``(defines, out16, dout16, lse32)``: the kernels' operands, or None where gpu_fallback runs."""
    defines = _defines(q, kv, d_v, scale)
    if defines is None:
        return None
    return defines, _as_dtype(out, q.dtype), _as_dtype(dout, q.dtype), cupy_module().ascontiguousarray(
        widen(lse, cupy_module().float32))


def _side_stream(cp):
    """A second, non-blocking stream of the current device that takes each
    chunk's dkv rows and per-key sums while the current stream runs the next
    chunk's dq kernel (one per device, made on first use)."""
    device = cp.cuda.Device().id
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = cp.cuda.Stream(non_blocking=True)
    return _SIDE_STREAMS[device]


_SIDE_STREAMS: dict[int, object] = {}


def sparse_attention_backward(q, kv, indices, out, lse, dout, d_v: int, scale: float, precise_dkv: bool = False):
    operands = backward_operands(q, kv, out, lse, dout, d_v, scale)
    if operands is None:
        return gpu_fallback.sparse_attention_backward(q, kv, indices, out, lse, dout, d_v, scale)
    defines, out16, dout16, lse32 = operands
    cp = cupy_module()
    passes, rows_as = head_passes(q.shape[1]), dkv_rows_dtype(q, precise_dkv)
    dq = cp.empty(q.shape, dtype=cp.uint16)
    if POISON_OUTPUTS:
        dq.fill(0xFFFF)
    dkv = cp.zeros(kv.shape, dtype=cp.float32)
    main = cp.cuda.get_current_stream()
    side = _side_stream(cp) if OVERLAP_CHUNKS else main
    # Chunk c's dkv rows and sums run on `side` after its dq kernel, beside
    # chunk c + 1's dq kernel on `main`. The sums keep their order (one
    # stream), so dkv is the same as on one stream. in_flight holds the images
    # `side` still reads (at most two chunks'), each with the event after
    # which `main` may reuse its memory.
    in_flight = []
    for t0, t1 in query_chunks(q.shape[0], passes * indices.shape[1], rows_as):
        if len(in_flight) == 2:
            main.wait_event(in_flight.pop(0)[0])  # the images of two chunks back are free after this
        chunk = slice(t0, t1)
        images = dq_and_images(q[chunk], kv, indices[chunk], out16[chunk], dout16[chunk], lse32[chunk], dq[chunk],
                               scale, defines)
        side.wait_event(main.record())
        with side:
            rows = dkv_rows(q[chunk], dout16[chunk], indices[chunk], images, scale, defines, rows_as)
            add_rows_by_key(indices[chunk], rows, passes, dkv, defines)
            in_flight.append((side.record(), images))
        del rows, images
    main.wait_event(side.record())
    return dq.view(q.dtype), narrow(dkv, kv.dtype)
