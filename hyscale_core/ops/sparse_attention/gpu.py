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
  order (head groups of h > 64 are added in order); there each warpgroup
  takes every other block in its own buffer and gathers its next block
  under its own products.
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
  adds. The dq kernel fills every SM, so the memory-bound sums cannot run
  beside it unless SMs are kept for them: a chunk's sums of bfloat16 rows
  run on a second stream on a few SMs (``set_aside_sms``, one CTA each)
  while the next chunk's dq kernel runs on the others (fewer CTAs than
  items, each taking items in turn); the first dq kernel and the last sums
  take every SM, and float32 rows run on one stream (``sets_aside``; the
  same bits on any schedule). The scratch (one rows buffer of up to
  ``rows_budget()`` bytes, one chunk's images, two key tables) comes from
  CuPy's pool, which keeps the blocks for the next backward;
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
SET_ASIDE_SMS = 24  # SMs of an H200's 132 the per-key sums take beside the next dq kernel at h <= 64; 0: one stream
_SET_ASIDE_REFERENCE = 132  # SET_ASIDE_SMS scales by the device's SM count over this
MIN_CHUNKS = 8  # query chunks at least where SMs are set aside: the first chunk's sums are the only ones alone


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
    per-key sums over the float32 dkv. The backward's scratch is about 1.25x
    this: the rows, one chunk's images (0.22x) and two key tables."""
    if ROWS_BYTES is not None:
        return ROWS_BYTES
    cp = cupy_module()
    free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
    return min(MAX_ROWS_BYTES, max(MIN_ROWS_BYTES, free // FREE_SHARE))


def query_chunks(n: int, rows_per_query: int, row_dtype, at_least: int = 1):
    """Query ranges whose dkv rows (``rows_per_query`` rows [576] of ``row_dtype`` per query) fit
    ``rows_budget()``: as few as fit but at least ``at_least`` (or n), of equal length but for
    the last (no short tail chunk)."""
    most = max(1, rows_budget() // max(1, rows_per_query * D_QK * np.dtype(row_dtype).itemsize))
    count = max(-(-n // most), min(at_least, n))
    step = -(-n // count) if n else 1
    for t0 in range(0, n, step):
        yield t0, min(n, t0 + step)


def dq_and_images(q, kv, indices, out, dout, lse, dq, scale: float, defines: tuple[str, ...], ctas: int | None = None):
    """sa_backward_dq on a chunk of queries (16-bit q, out, dout; float32 lse):
    writes dq [C, h, 576] (uint16 bits) and returns the ds / p' images (uint8).
    ``ctas``: at most this many CTAs, each taking (query, head group) items in
    turn (default: one CTA per item)."""
    cp = cupy_module()
    (n, h, _), k = q.shape, indices.shape[1]
    items = n * _groups(h)
    images = cp.empty(items * -(-k // SLOTS_PER_BLOCK) * IMAGE_BYTES, dtype=cp.uint8)
    grid = items if ctas is None else max(1, min(items, ctas))
    _kernel("sa_backward_dq", SMEM_DQ, defines)(
        (grid,), (THREADS,), (_bits(q), _bits(kv), indices, _bits(out), _bits(dout), lse, dq, images, np.int32(h),
                              np.int32(k), np.float32(scale), np.int32(items)), shared_mem=SMEM_DQ)
    return images


def _row_suffix(rows) -> str:
    return "bf16" if rows.dtype == cupy_module().uint16 else "f32"


def dkv_rows(q, dout, indices, images, scale: float, defines: tuple[str, ...], row_dtype, rows=None):
    """sa_backward_dkv_rows{1,2}_{f32,bf16} on the chunk of ``dq_and_images``: [C * passes
    * k, 576] of ``row_dtype`` (float32, or uint16 holding bfloat16 bits), row (t * passes
    + p) * k + i = the dkv contribution of slot i of query t from the heads of pass p
    (128 p .. 128 p + 127). ``rows``: an array of that shape and dtype to write (default:
    a new one)."""
    cp = cupy_module()
    (n, h, _), k = q.shape, indices.shape[1]
    groups, passes = _groups(h), head_passes(h)
    if rows is None:
        rows = cp.empty((n * passes * k, D_QK), dtype=row_dtype)
    for p in range(passes):
        gp = min(GROUPS_PER_PASS, groups - GROUPS_PER_PASS * p)
        smem = SMEM_DKV_ROWS[gp]
        _kernel(f"sa_backward_dkv_rows{gp}_{_row_suffix(rows)}", smem, defines)(
            (2 * n,), (THREADS,), (_bits(q), _bits(dout), indices, images, rows, np.int32(h), np.int32(k),
                                   np.float32(scale), np.int32(p)), shared_mem=smem)
    return rows


SET_ASIDE_THREADS = 720  # cuda/sparse_attention_bwd.cu


def sum_rows_by_key(rows, pairs, starts, k: int, passes: int, dkv, defines: tuple[str, ...],
                    sms: int | None = None) -> None:
    """dkv[s] += every row whose slot selected key s, in ascending (query, slot,
    pass) order, in float32, from the key table of ``key_segments``; rows as
    ``dkv_rows`` makes them. ``sms`` (bfloat16 rows only): run on at most this
    many SMs (one CTA each, every other SM free for another kernel); default:
    one CTA per key, all SMs. The same bits either way."""
    n_keys = dkv.shape[0]
    if n_keys == 0 or rows.size == 0:
        return
    if sms is None:
        _kernel(f"sa_dkv_segments_{_row_suffix(rows)}", 0, defines)(
            (n_keys,), (D_QK // 4,), (rows, pairs, starts, np.int32(k), np.int32(passes), dkv))
    else:
        if rows.dtype != cupy_module().uint16:
            raise ValueError("the set-aside sums take bfloat16 rows")
        _kernel("sa_dkv_segments_set_aside_bf16", 0, defines)(
            (sms,), (SET_ASIDE_THREADS,), (rows, pairs, starts, np.int32(k), np.int32(passes), np.int32(n_keys), dkv))


def add_rows_by_key(indices, rows, passes: int, dkv, defines: tuple[str, ...]) -> None:
    """dkv[s] += every row of the chunk whose slot selected key s (``sum_rows_by_key``
    on all SMs, after sorting the chunk's int32 indices [C, k] by key)."""
    if dkv.shape[0] == 0 or indices.size == 0:
        return
    pairs, starts = key_segments(indices, cupy_module().int32, dkv.shape[0])
    sum_rows_by_key(rows, pairs, starts, indices.shape[1], passes, dkv, defines)


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
    chunk's per-key sums while the current stream runs the next chunk's dq
    kernel (one per device, made on first use)."""
    device = cp.cuda.Device().id
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = cp.cuda.Stream(non_blocking=True)
    return _SIDE_STREAMS[device]


_SIDE_STREAMS: dict[int, object] = {}


def sets_aside(row_dtype) -> bool:
    """Whether the backward sets SMs aside for the per-key sums: for bfloat16
    rows. Float32 rows (``precise_dkv``, float16 inputs) have twice the bytes
    to sum, and the bfloat16 count made that backward slower (578 ms against
    556-559 at N = 131072, h = 64; 852 against 752-754 at h = 128); they run on
    one stream until a count for them is measured."""
    return SET_ASIDE_SMS > 0 and np.dtype(row_dtype).itemsize == 2


def set_aside_sms(chunks: int, h: int, sms: int) -> int:
    """SMs the per-key sums of a chunk keep beside the next chunk's dq kernel, 0
    where the kernels run one after another on one stream (a single chunk, or
    ``SET_ASIDE_SMS`` = 0). ``SET_ASIDE_SMS`` is the count for one head group
    and pass on a device of 132 SMs; it scales with the device's SMs, and by
    passes / groups, since the sums' bytes grow with the passes and the dq
    kernel's time with the head groups (h = 128: half). At least one SM, and
    one fewer than the device has (``sms``)."""
    if chunks < 2 or SET_ASIDE_SMS <= 0:
        return 0
    share = SET_ASIDE_SMS * sms / _SET_ASIDE_REFERENCE * head_passes(h) / _groups(h)
    return max(1, min(sms - 1, round(share)))


def sparse_attention_backward(q, kv, indices, out, lse, dout, d_v: int, scale: float, precise_dkv: bool = False):
    operands = backward_operands(q, kv, out, lse, dout, d_v, scale)
    if operands is None:
        return gpu_fallback.sparse_attention_backward(q, kv, indices, out, lse, dout, d_v, scale)
    defines, out16, dout16, lse32 = operands
    cp = cupy_module()
    (n, h, _), k = q.shape, indices.shape[1]
    passes, rows_as = head_passes(h), dkv_rows_dtype(q, precise_dkv)
    dq = cp.empty(q.shape, dtype=cp.uint16)
    if POISON_OUTPUTS:
        dq.fill(0xFFFF)
    dkv = cp.zeros(kv.shape, dtype=cp.float32)
    aside = sets_aside(rows_as)
    chunks = list(query_chunks(n, passes * k, rows_as, at_least=MIN_CHUNKS if aside else 1))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    spare = set_aside_sms(len(chunks), h, sms) if aside else 0
    main = cp.cuda.get_current_stream()
    side = _side_stream(cp) if spare else main
    rows = cp.empty((max((t1 - t0 for t0, t1 in chunks), default=0) * passes * k, D_QK), dtype=rows_as)
    # Per chunk, on `main`: the dq kernel, the dkv rows, the key sort. The
    # per-key sums go to `side` on `spare` SMs, beside the next chunk's dq
    # kernel on the others; the first dq kernel and the last sums have all
    # SMs. The sums keep their order (dkv's adds are the same on any
    # schedule), and `main` waits for them before the next rows overwrite
    # the one rows buffer. `held` keeps the key table `side` reads alive
    # until then (CuPy's pool would hand it out again on `main`).
    summed, held = None, None
    for c, (t0, t1) in enumerate(chunks):
        part = slice(t0, t1)
        images = dq_and_images(q[part], kv, indices[part], out16[part], dout16[part], lse32[part], dq[part], scale,
                               defines, ctas=sms - spare if spare and c > 0 else None)
        if summed is not None:
            main.wait_event(summed)
        summed, held = None, None
        chunk_rows = dkv_rows(q[part], dout16[part], indices[part], images, scale, defines, rows_as,
                              rows=rows[: (t1 - t0) * passes * k])
        del images
        if dkv.shape[0] == 0 or k == 0:
            continue  # no rows to add
        pairs, starts = key_segments(indices[part], cp.int32, dkv.shape[0])
        if spare and c + 1 < len(chunks):
            side.wait_event(main.record())
            with side:
                sum_rows_by_key(chunk_rows, pairs, starts, k, passes, dkv, defines, sms=spare)
                summed = side.record()
            held = (pairs, starts)  # alive until the side stream's sums are waited for (the pool must not reuse them)
        else:
            sum_rows_by_key(chunk_rows, pairs, starts, k, passes, dkv, defines)
    return dq.view(q.dtype), narrow(dkv, kv.dtype)
