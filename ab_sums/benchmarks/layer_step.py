"""The layer table: one DSA layer, forward + backward with activation
recomputation, HyScale against the selection a user has today.

The layer is the engine's DSABlock run through ``engine.checkpoint`` (the
forward keeps the block input and its selection; the backward recomputes
the block, then back-propagates): RMSNorm, q and latent-kv projections,
RoPE on the last 64 dims, ``hs.sparse_attention`` (h = 64, d_qk = 576,
d_v = 512, k = 2048), the output projection, the lightning indexer's
projections (H_I = 64 as DeepSeek-V3.2 or 32 as GLM-5, d_I = 128; input
detached) with its KL loss, and a SwiGLU MLP. Parameters and activations
are float32 except the sparse attention's q, kv and out (bfloat16 by
default: the GPU tensor-core kernels); the indexer kernels round q and k to
bfloat16 as DSA's do. float32 matrix products run on TF32 tensor cores by
default (``--matmul tf32``, CuPy's CUPY_TF32=1), as a float32 training step
on this hardware would; ``--matmul float32`` keeps them in full float32.
Implementations differ only in where the selection comes from:

* ``hyscale``: ``hs.indexer_topk`` (streaming, exact) in the forward; the
  recompute replays the stored selection;
* ``baseline``: materialised indexer scores (per query chunk: a bf16 einsum,
  ReLU, head-weighted sum, causal mask) + ``torch.topk``, in the forward and
  again in the recompute. Without torch (a CPU check): the scores from
  ``hs.indexer_scores`` + ``hs.topk``, labelled as such;
* ``hyscale, no replay`` (``--impls``): ``hs.indexer_topk`` in both passes,
  separating the streaming kernel's gain from replay's.

Columns: median_ms, one step (forward, recompute, backward; the device
synchronised around each selection, so selection_ms is that time);
selection_share = selection_ms / median_ms; peak_extra_gib, the device
memory the step took beyond its inputs and parameters (GPU with torch:
CuPy allocates through torch's caching allocator, one pool for both, and
this is its high-water mark of allocated bytes; CPU: tracemalloc's peak of
NumPy allocations, whose bookkeeping the CPU times include); speedup =
baseline / this implementation at the same shape.

A time budget (``--budget-s``) skips a configuration whose time, predicted
from the last one measured, would not fit; sizes whose float32 activations
would not fit the device are skipped too, both with a printed reason.
Results are rewritten after every configuration (a killed run keeps what it
measured). ``--plot FILE.json`` draws an existing results file (no run).

H200 (one device call, about 3 minutes):
    PYTHONPATH=. python -m benchmarks.layer_step --out $OUT
CPU check (tiny shapes):
    python -m benchmarks.layer_step --sizes 256 --index-heads 4 --index-dim 16 --heads 2 --d-qk 24 --d-v 16 \\
        --rope-dim 8 --topk 16 --d-model 32 --d-ff 64
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import RESULTS, cpu_device, gpu_device, table, write_results

BASELINE, HYSCALE, NO_REPLAY = "baseline", "hyscale", "hyscale, no replay"


def torch_materialised(torch, chunk: int) -> Callable[..., Any]:
    """Baseline selection: per chunk of queries, scores [chunk, keys] from a bf16
    einsum (fp32 accumulate), ReLU, head-weighted sum and the causal mask, then
    torch.topk; -1 where a row has fewer than topk visible keys. Arrays cross
    from CuPy to torch and back by DLPack (no copies)."""
    import cupy as cp

    def select(q, k, w, topk, *, causal=True, cu_seqlens=None):
        tq, tk = (torch.from_dlpack(a).to(torch.bfloat16) for a in (q, k))
        tw = torch.from_dlpack(w)
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=tq.device)
        for t0 in range(0, q.shape[0], chunk):
            t1 = min(t0 + chunk, q.shape[0])
            logits = torch.einsum("thd,sd->ths", tq[t0:t1], tk[:t1]).float().relu_()
            scores = torch.einsum("th,ths->ts", tw[t0:t1], logits)
            rows = torch.arange(t0, t1, device=tq.device)[:, None]
            scores.masked_fill_(torch.arange(t1, device=tq.device)[None, :] > rows, float("-inf"))
            values, idx = torch.topk(scores, min(topk, t1))
            out[t0:t1, :idx.shape[1]] = torch.where(values == float("-inf"), -1, idx).to(torch.int32)
        return cp.from_dlpack(out)

    return select


def host_materialised(chunk: int) -> Callable[..., Any]:
    """Baseline without torch: ``hs.indexer_scores`` per query chunk + ``hs.topk``."""
    import hyscale_core as hs
    from hyscale_core._backend import array_module

    def select(q, k, w, topk, *, causal=True, cu_seqlens=None):
        xp = array_module(q)
        out = xp.full((q.shape[0], topk), -1, dtype=xp.int32)
        for t0 in range(0, q.shape[0], chunk):
            t1 = min(t0 + chunk, q.shape[0])
            scores = hs.indexer_scores(q[t0:t1], k[:t1], w[t0:t1], q_pos=np.arange(t0, t1))
            values, idx = hs.topk(scores, min(topk, t1))
            out[t0:t1, :idx.shape[1]] = xp.where(values == -xp.inf, -1, idx)
        return out

    return select


class Device:
    """What differs between the GPU and CPU runs: arrays, synchronisation, memory."""

    def __init__(self, gpu: bool) -> None:
        from hyscale_core._backend import cupy_module

        self.gpu = gpu
        self.xp = cupy_module() if gpu else np
        # Segments that grow in place: the baseline's score chunks differ in size
        # from chunk to chunk, which fixed-size cached blocks would fragment.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        try:
            import torch
        except ImportError:
            torch = None
        self.torch = torch if gpu and torch is not None and torch.cuda.is_available() else None
        if self.torch is not None:
            share_torch_allocator(self.xp, self.torch)
        self.name = gpu_device() if gpu else cpu_device()

    def sync(self) -> None:
        if self.gpu:
            self.xp.cuda.Device().synchronize()  # covers torch's kernels: same device, legacy stream

    def free_bytes(self) -> int:
        """Device memory free once the allocators' caches are given back."""
        if not self.gpu:
            return 1 << 62
        self.recover()
        return self.xp.cuda.runtime.memGetInfo()[0]

    def _in_use(self) -> int:
        """Bytes allocated now: torch's counter (it serves CuPy too), else CuPy's pool."""
        if self.torch is not None:
            return self.torch.cuda.memory_allocated()
        return self.xp.get_default_memory_pool().used_bytes()

    def start_memory(self) -> None:
        if self.gpu:
            self.recover()
            if self.torch is not None:
                self.torch.cuda.reset_peak_memory_stats()
            self._before = self._in_use()
        else:
            tracemalloc.start()
            tracemalloc.reset_peak()

    def recover(self) -> None:
        """Give back the allocators' cached memory (and stop tracing, after a failed step)."""
        if self.gpu:
            self.xp.get_default_memory_pool().free_all_blocks()
            if self.torch is not None:
                self.torch.cuda.empty_cache()
        elif tracemalloc.is_tracing():
            tracemalloc.stop()

    def peak_memory(self) -> int:
        """Peak bytes allocated since :meth:`start_memory`, beyond what was allocated then
        (with torch: its allocator's high-water mark, CuPy's arrays included;
        without: CuPy's pool size at the end, an upper bound)."""
        if not self.gpu:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            return peak
        if self.torch is not None:
            return self.torch.cuda.max_memory_allocated() - self._before
        return self.xp.get_default_memory_pool().total_bytes() - self._before


def share_torch_allocator(cp, torch) -> None:
    """Route CuPy's allocations through torch's caching allocator, so the layer
    (CuPy) and the baseline's selection (torch) draw on one pool: two pools
    each keep freed blocks the other cannot use, which made the baseline run
    out of memory at sizes where the step fits. Blocks are tied to torch's
    current stream, the legacy default stream CuPy also uses here."""

    def malloc(nbytes: int):
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(block.data_ptr(), nbytes, block), 0)

    cp.cuda.set_allocator(malloc)


def selections_per_step(impl: str) -> int:
    """Selections one step runs: replay selects in the forward only."""
    return 1 if impl == HYSCALE else 2


def timed(fn: Callable[..., Any], dev: Device, spent: list[float]) -> Callable[..., Any]:
    """``fn`` with its wall time (device synchronised) appended to ``spent``."""

    def run(*args, **kwargs):
        dev.sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        dev.sync()
        spent.append(time.perf_counter() - start)
        return out

    return run


def baseline_label(dev: Device) -> str:
    return ("materialised scores + torch.topk, reselect" if dev.torch is not None
            else "materialised hs.indexer_scores + hs.topk (no torch), reselect")


def build(args, index_heads: int, dev: Device, made: dict):
    """The DSA block (parameters on the device) and its config, made once per
    indexer shape and kept in ``made``."""
    from hyscale_core.engine import DSABlock, DSAConfig

    if index_heads in made:
        return made[index_heads]

    cfg = DSAConfig(vocab=1, d_model=args.d_model, n_layers=1, heads=args.heads, d_v=args.d_v,
                    rope_dim=args.rope_dim, d_ff=args.d_ff, index_heads=index_heads, index_dim=args.index_dim,
                    topk=args.topk, attention_dtype=args.attention_dtype)
    if cfg.d_qk != args.d_qk:
        raise SystemExit(f"--d-qk {args.d_qk} must be --d-v + --rope-dim = {cfg.d_qk}")
    made[index_heads] = DSABlock(cfg, "layer0", np.random.default_rng(0), dev.xp), cfg
    return made[index_heads]


def activation_bytes(n: int, cfg) -> int:
    """Bytes the step holds at its peak, about: in the backward, the attention's
    saved q and out (attention dtype), the output projection's saved float32
    input and its gradient, float32 dq twice (the cast and RoPE's copy), the
    index table and probabilities, and 8 GiB for chunk temporaries and the
    baseline's score chunks."""
    itemsize = 2 if cfg.attention_dtype in ("bfloat16", "float16") else 4
    per_token = cfg.heads * (itemsize * (cfg.d_qk + cfg.d_v) + 4 * (2 * cfg.d_v + 2 * cfg.d_qk))
    return n * per_token + 8 * n * cfg.topk + (8 << 30)


def selectors(impl: str, cfg, dev: Device, chunk: int, spent: list[float]):
    """(forward selector, recompute selector or None for replay) of one implementation."""
    import hyscale_core as hs
    from hyscale_core.engine import LiveSelection

    streaming = timed(hs.indexer_topk, dev, spent)
    if impl == HYSCALE:
        return LiveSelection(cfg.topk, topk_fn=streaming), None
    if impl == NO_REPLAY:
        return LiveSelection(cfg.topk, topk_fn=streaming), LiveSelection(cfg.topk, topk_fn=streaming)
    make = torch_materialised(dev.torch, chunk) if dev.torch is not None else host_materialised(chunk)
    select = timed(make, dev, spent)
    return LiveSelection(cfg.topk, topk_fn=select), LiveSelection(cfg.topk, topk_fn=select)


def one_step(block, cfg, x_data, g, rope, impl: str, dev: Device, chunk: int) -> tuple[float, float, int]:
    """(step seconds, selection seconds, peak extra bytes) of forward + recompute + backward."""
    from hyscale_core.engine import Tensor, backward, checkpoint

    for p in block.parameters():
        p.grad = None
    spent: list[float] = []
    forward_sel, recompute_sel = selectors(impl, cfg, dev, chunk, spent)
    dev.start_memory()
    dev.sync()
    start = time.perf_counter()
    x = Tensor(x_data, requires_grad=True)
    y = checkpoint(block, x, rope, forward_sel, cfg.kl_weight, recompute_sel)
    backward(y, g)
    dev.sync()
    seconds = time.perf_counter() - start
    peak = dev.peak_memory()
    expected = selections_per_step(impl)
    if len(spent) != expected:
        raise RuntimeError(f"{impl}: {len(spent)} selections in one step, expected {expected}")
    return seconds, sum(spent), peak


def inputs(n: int, cfg, dev: Device):
    from hyscale_core.engine import ops

    rng = dev.xp.random.default_rng(1)
    x = rng.standard_normal((n, cfg.d_model), dtype=dev.xp.float32)
    g = rng.standard_normal((n, cfg.d_model), dtype=dev.xp.float32)
    return x, g, ops.rope_tables(dev.xp, dev.xp.arange(n), cfg.rope_dim)


def predict(last: dict[str, tuple[int, float, float]], impl: str, n: int) -> float | None:
    """Seconds of one step at ``n`` from the last measurement of ``impl`` (selection
    quadratic in n, the rest linear); None when nothing comparable was measured."""
    if impl not in last:
        return None
    n0, step_s, sel_s = last[impl]
    return sel_s * (n / n0) ** 2 + (step_s - sel_s) * (n / n0)


def measure(args, dev: Device, n: int, index_heads: int, clock: dict, last: dict, made: dict) -> list[dict]:
    """Rows of every implementation at one shape (empty if skipped)."""
    block, cfg = build(args, index_heads, dev, made)
    need, free = activation_bytes(n, cfg), dev.free_bytes()
    if need > 0.9 * free:
        print(f"  N={n} H_I={index_heads}: skipped, float32 activations need ~{need / 2**30:.0f} GiB, "
              f"{free / 2**30:.0f} GiB free", flush=True)
        return []
    guesses = [predict(last, impl, n) for impl in args.impls]
    if all(g is not None for g in guesses):
        left = args.budget_s - (time.perf_counter() - clock["start"])
        if sum(guesses) * args.repeats > left:
            print(f"  N={n} H_I={index_heads}: skipped, predicted {sum(guesses) * args.repeats:.0f} s, "
                  f"{left:.0f} s of the budget left", flush=True)
            return []
    x, g, rope = inputs(n, cfg, dev)
    rows = []
    for impl in args.impls:
        try:
            runs = [one_step(block, cfg, x, g, rope, impl, dev, args.chunk) for _ in range(args.repeats)]
        except Exception as exc:  # e.g. out of memory: report it, keep the other implementations' rows
            print(f"  N={n} H_I={index_heads} {impl}: failed: {type(exc).__name__}: {exc}", flush=True)
            dev.recover()
            continue
        step_s = statistics.median(r[0] for r in runs)
        sel_s = statistics.median(r[1] for r in runs)
        last[impl] = (n, step_s, sel_s)
        config = {"n": n, "index_heads": index_heads, "index_dim": cfg.index_dim, "heads": cfg.heads,
                  "d_qk": cfg.d_qk, "d_v": cfg.d_v, "topk": cfg.topk, "d_model": cfg.d_model, "d_ff": cfg.d_ff,
                  "attention_dtype": cfg.attention_dtype, "matmul": args.matmul, "repeats": args.repeats}
        label = baseline_label(dev) if impl == BASELINE else impl
        rows.append({"bench": "layer_step", "config": config, "impl": label, "kind": impl,
                     "median_ms": round(step_s * 1e3, 1), "selection_ms": round(sel_s * 1e3, 1),
                     "selection_share": round(sel_s / step_s, 3), "selections_per_step": selections_per_step(impl),
                     "peak_extra_gib": round(max(r[2] for r in runs) / 2**30, 2)})
        print(f"[{time.perf_counter() - clock['start']:6.0f} s] N={n} H_I={index_heads} {label}: step "
              f"{step_s * 1e3:.0f} ms, selection {sel_s * 1e3:.0f} ms ({100 * sel_s / step_s:.0f}%), peak +"
              f"{rows[-1]['peak_extra_gib']} GiB", flush=True)
    base = next((r["median_ms"] for r in rows if r["kind"] == BASELINE), None)
    for r in rows:
        r["speedup"] = round(base / r["median_ms"], 2) if base else None
    return rows


def warm_up(args, dev: Device, made: dict, last: dict) -> None:
    """Two small steps of every implementation and indexer shape: the first compiles
    the kernels, the second seeds the time predictions."""
    n = min(args.warm_n, min(args.sizes))
    for index_heads in args.index_heads:
        block, cfg = build(args, index_heads, dev, made)
        x, g, rope = inputs(n, cfg, dev)
        for impl in args.impls:
            one_step(block, cfg, x, g, rope, impl, dev, args.chunk)
            step_s, sel_s, _ = one_step(block, cfg, x, g, rope, impl, dev, args.chunk)
            last[impl] = max(last.get(impl, (n, 0.0, 0.0)), (n, step_s, sel_s), key=lambda m: m[1])


def plot(rows: list[dict], device: str, path: Path) -> None:
    """Step time split into selection and the rest, per shape and implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install \"hyscale-core[plot]\")")
        return
    shapes = sorted({(r["config"]["index_heads"], r["config"]["n"]) for r in rows}, key=lambda s: (-s[0], s[1]))
    kinds = [k for k in (BASELINE, NO_REPLAY, HYSCALE) if any(r["kind"] == k for r in rows)]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(shapes), 4.2))
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        for i, shape in enumerate(shapes):
            found = [r for r in rows if r["kind"] == kind and (r["config"]["index_heads"], r["config"]["n"]) == shape]
            if not found:
                continue
            r = found[0]
            x = i + (j - (len(kinds) - 1) / 2) * width
            sel, rest = r["selection_ms"] / 1e3, (r["median_ms"] - r["selection_ms"]) / 1e3
            ax.bar(x, sel, width, color=f"C{j}", hatch="//", edgecolor="white",
                   label=f"{kind}: selection" if i == 0 else None)
            ax.bar(x, rest, width, bottom=sel, color=f"C{j}", alpha=0.45, label=f"{kind}: rest" if i == 0 else None)
            if kind != BASELINE and r.get("speedup"):
                ax.text(x, sel + rest, f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shapes)), [f"N={n // 1024 if n >= 1024 else n}{'K' if n >= 1024 else ''}\nH_I={h}"
                                       for h, n in shapes])
    ax.set(ylabel="seconds per step (fwd + recompute + bwd)",
           title=f"One DSA layer, top-{rows[0]['config']['topk']} ({device})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072], help="tokens N (causal, one sequence)")
    p.add_argument("--index-heads", type=int, nargs="+", default=[64, 32], help="H_I: 64 DeepSeek-V3.2, 32 GLM-5")
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--d-qk", type=int, default=576)
    p.add_argument("--d-v", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=1536, help="the block's width (MLA's q input is 1536 wide)")
    p.add_argument("--d-ff", type=int, default=4096)
    p.add_argument("--attention-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="q, kv, out of the sparse attention (bfloat16: the GPU kernels); the rest is float32")
    p.add_argument("--matmul", choices=["tf32", "float32"], default="tf32",
                   help="float32 matrix products on TF32 tensor cores (CUPY_TF32=1) or in full float32")
    p.add_argument("--impls", nargs="+", default=[BASELINE, HYSCALE], choices=[BASELINE, HYSCALE, NO_REPLAY])
    p.add_argument("--repeats", type=int, default=1, help="steps per implementation and shape (median)")
    p.add_argument("--chunk", type=int, default=128, help="query chunk of the materialised baseline")
    p.add_argument("--budget-s", type=float, default=200, help="skip shapes predicted to end later than this")
    p.add_argument("--warm-n", type=int, default=4096, help="size of the compile / warm-up step")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for NAME.json and NAME.png")
    p.add_argument("--name", default="layer_step")
    p.add_argument("--plot", type=Path, help="only draw this results JSON to a PNG beside it")
    return p.parse_args(argv)


def main(argv=None) -> None:
    import json

    from hyscale_core._backend import cupy_module

    args = parse(argv)
    if args.plot:
        payload = json.loads(args.plot.read_text())
        plot(payload["rows"], payload["device"], args.plot.with_suffix(".png"))
        return
    # CuPy reads CUPY_TF32 at its first float32 matrix product, which comes later.
    os.environ["CUPY_TF32"] = "1" if args.matmul == "tf32" else "0"
    dev = Device(gpu=args.device != "cpu" and cupy_module() is not None)
    if args.device == "gpu" and not dev.gpu:
        raise SystemExit("--device gpu: CuPy sees no CUDA device")
    clock, last, made, rows = {"start": time.perf_counter()}, {}, {}, []
    print(f"{dev.name}; baseline: {baseline_label(dev)}; matmul {args.matmul}; budget {args.budget_s:.0f} s",
          flush=True)
    warm_up(args, dev, made, last)
    print(f"[{time.perf_counter() - clock['start']:6.0f} s] warmed up (N={min(args.warm_n, min(args.sizes))})",
          flush=True)
    for n in args.sizes:
        for index_heads in args.index_heads:
            rows += measure(args, dev, n, index_heads, clock, last, made)
            if rows:
                path = write_results(args.name, dev.name, rows, args.out)
    short = [{"N": r["config"]["n"], "H_I": r["config"]["index_heads"], "impl": r["kind"], "step_ms": r["median_ms"],
              "selection_ms": r["selection_ms"], "share": r["selection_share"], "peak_GiB": r["peak_extra_gib"],
              "speedup": r["speedup"]} for r in rows]
    print(table(short, ["N", "H_I", "impl", "step_ms", "selection_ms", "share", "peak_GiB", "speedup"]))
    if rows:
        print(f"wrote {path}")
        plot(rows, dev.name, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
