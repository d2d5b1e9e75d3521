"""Why selection replay matters: selecting again in the recompute, under a
score computation that is legitimately different from the forward's, flips
selections and moves the gradients; replay flips nothing and gives the
gradients of no checkpointing bit for bit.

Model: the training example's TinyDSA (``--model DIR``: the folder
``examples/train_tiny_dsa.py`` wrote, with params.npz and config.json;
random initialisation otherwise) on fresh needle-task batches. The forward
always selects with ``hs.indexer_topk`` (float32). The recompute then:

* replays the forward's selection (HyScale);
* selects again with ``hs.indexer_topk`` (the same kernel: exact again);
* selects again from scores computed another way, each a computation some
  stack really uses: float64; float32 with the heads summed in reverse
  order; float32 with each dot product split in two halves (a split-K
  GEMM); q and k rounded to bfloat16 first (tensor-core inputs, as the GPU
  backend computes float32 indexers), float32 sums.

Reported per recompute: flipped, the fraction of selected keys not in the
forward's selection; rows_flipped, the fraction of rows with any flip;
the relative change of each parameter's gradient, |g - g_ref| / |g_ref|,
against the gradients without checkpointing (max, median, the parameter
that moved most); bitwise, whether every gradient equals g_ref exactly.
median_ms: one training step (forward + backward) with that recompute.

The model's indexer is tiny and its scores often tie exactly (one layer
reads token embeddings only, so equal tokens score equally), which hides
rounding flips. The second part therefore counts flips alone at a DSA
indexer shape (``--dsa-n`` tokens, H_I = 64, d_I = 128, k = 2048, random
inputs): there every variant flips some selections.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import cpu_device, table, write_results

Scores = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def _split_k(q, k, w):
    half = q.shape[2] // 2
    logits = (np.einsum("thd,sd->ths", q[..., :half], k[:, :half], optimize=True)
              + np.einsum("thd,sd->ths", q[..., half:], k[:, half:], optimize=True))
    return _head_sum(np.maximum(logits, 0), w, range(q.shape[1]))


def _head_sum(relu_logits, w, order):
    acc = np.zeros((relu_logits.shape[0], relu_logits.shape[2]), dtype=relu_logits.dtype)
    for h in order:
        acc += w[:, h, None] * relu_logits[:, h, :]
    return acc


def _float32(q, k, w, order_reversed=False):
    logits = np.maximum(np.einsum("thd,sd->ths", q, k, optimize=True), np.float32(0))
    heads = range(q.shape[1] - 1, -1, -1) if order_reversed else range(q.shape[1])
    return _head_sum(logits, w, heads)


def _bfloat16(q, k, w):
    from hyscale_core._dtypes import bfloat16

    return _float32(q.astype(bfloat16).astype(np.float32), k.astype(bfloat16).astype(np.float32), w)


def _float64(q, k, w):
    return _float32(q.astype(np.float64), k.astype(np.float64), w.astype(np.float64))


VARIANTS: dict[str, Scores] = {
    "float64 scores": _float64,
    "float32, heads summed in reverse": lambda q, k, w: _float32(q, k, w, order_reversed=True),
    "float32, split-K dot products": _split_k,
    "bfloat16 q/k, float32 sums": _bfloat16,
}


def materialised_topk(scores: Scores, chunk: int = 64) -> Callable[..., np.ndarray]:
    """An ``indexer_topk`` replacement: ``scores`` per chunk of queries over the
    keys of their packed sequence (causal), then the exact ``hs.topk``; -1 where
    fewer than topk keys are visible."""
    import hyscale_core as hs

    def topk_fn(q, k, w, topk, *, causal=True, cu_seqlens=None):
        n = q.shape[0]
        cu = np.asarray(cu_seqlens if cu_seqlens is not None else [0, n])
        out = np.full((n, topk), -1, dtype=np.int32)
        for a, b in zip(cu[:-1], cu[1:]):
            for t0 in range(a, b, chunk):
                t1 = min(b, t0 + chunk)
                s = scores(q[t0:t1], k[a:t1], w[t0:t1])
                s[np.arange(t0, t1)[:, None] < np.arange(a, t1)[None, :]] = -np.inf
                keep = min(topk, t1 - a)
                values, idx = hs.topk(s, keep)
                out[t0:t1, :keep] = np.where(values == -np.inf, -1, idx + a)
        return out

    return topk_fn


def dsa_shape_flips(n: int, heads: int, dim: int, topk: int) -> list[dict]:
    """Rows measuring selection flips alone at a DSA indexer shape: one causal
    sequence, q, k ~ N(0, 1) and w ~ N(0, 1/heads) in float32. Each variant's
    selection against ``hs.indexer_topk``'s; median_ms is the variant's
    (materialised, NumPy) selection time."""
    import hyscale_core as hs

    rng = np.random.default_rng(0)
    q = rng.standard_normal((n, heads, dim), dtype=np.float32)
    k = rng.standard_normal((n, dim), dtype=np.float32)
    w = rng.standard_normal((n, heads), dtype=np.float32) / np.float32(np.sqrt(heads))
    forward = hs.indexer_topk(q, k, w, topk)
    config = {"kind": "dsa_shape", "n": n, "index_heads": heads, "index_dim": dim, "topk": topk,
              "inputs": "random normal, float32"}
    rows = []
    for name, fn in VARIANTS.items():
        start = time.perf_counter()
        again = materialised_topk(fn, chunk=32)(q, k, w, topk)
        seconds = time.perf_counter() - start  # the selection alone, not the flip count below
        missing, flipped_rows, selected = flips(forward, again)
        rows.append({"bench": "replay_drift", "config": config, "impl": f"select again, {name}", "kind": "dsa_shape",
                     "median_ms": round(seconds * 1e3, 1),
                     "flipped": missing / max(selected, 1), "rows_flipped": flipped_rows / n})
        print(f"  N={n} H={heads} D={dim} k={topk}, {name}: flipped {rows[-1]['flipped']:.2e} "
              f"(rows {rows[-1]['rows_flipped']:.2e})", flush=True)
    return rows


def flips(forward: np.ndarray, again: np.ndarray) -> tuple[int, int, int]:
    """(selected keys of ``forward`` missing from ``again``, rows with any, selected keys)."""
    missing = rows = 0
    for a, b in zip(forward, again):
        gone = len(set(a[a >= 0].tolist()) - set(b[b >= 0].tolist()))
        missing, rows = missing + gone, rows + (gone > 0)
    return missing, rows, int((forward >= 0).sum())


def load_model(model_dir: Path | None, length: int):
    from hyscale_core.engine import DSAConfig, TinyDSA
    from hyscale_core.engine.needle import NeedleTask

    if model_dir is None:
        task = NeedleTask(length=length, fillers=256)
        return TinyDSA(DSAConfig(vocab=task.vocab, n_layers=1), seed=0), task, "random init"
    config = json.loads((model_dir / "config.json").read_text())
    task = NeedleTask(**{**config["task"], "length": length})
    model = TinyDSA(DSAConfig(**config["model"]), seed=0)
    with np.load(model_dir / "params.npz") as state:
        model.load_state_dict(dict(state))
    return model, task, f"trained ({model_dir})"


def step(model, batch, recompute: bool, recompute_selector: Any = None) -> tuple[dict, Any, float]:
    """Gradients by name, the forward's selector and the step's wall time (ms)."""
    from hyscale_core.engine import LiveSelection, backward

    for p in model.parameters():
        p.grad = None
    selector = LiveSelection(model.cfg.topk, cu_seqlens=batch.cu_seqlens)
    start = time.perf_counter()
    out = model.forward(batch.ids, batch.rows, batch.targets, selector, recompute=recompute,
                        recompute_selector=recompute_selector, kl_on_loss_rows=True)
    backward(out.loss)
    ms = (time.perf_counter() - start) * 1e3
    return {p.name: p.grad.astype(np.float64) for p in model.parameters()}, selector, ms


def compare(model, batch, ref: dict, recompute_topk) -> dict:
    """One batch: the no-checkpoint gradients ``ref`` against one recompute (None = replay)."""
    from hyscale_core.engine import LiveSelection

    again = None if recompute_topk is None else LiveSelection(model.cfg.topk, cu_seqlens=batch.cu_seqlens,
                                                               topk_fn=recompute_topk)
    grads, forward_sel, ms = step(model, batch, recompute=True, recompute_selector=again)
    counts = np.zeros(3, dtype=np.int64)
    if again is not None:
        for block in model.blocks:
            counts += flips(forward_sel.store.selection(block.name), again.store.selection(block.name))
    rel = {name: float(np.linalg.norm(g - ref[name]) / max(np.linalg.norm(ref[name]), 1e-30))
           for name, g in grads.items()}
    bitwise = all(g.tobytes() == ref[name].tobytes() for name, g in grads.items())
    return {"counts": counts, "rel": rel, "bitwise": bitwise, "ms": ms}


def model_rows(args) -> list[dict]:
    """Rows of the training-step comparison (every recompute on every batch)."""
    import hyscale_core as hs

    model, task, origin = load_model(args.model, args.length)
    batches = [task.batch(np.random.default_rng(1000 + i), args.sequences) for i in range(args.batches)]
    config = {"kind": "model", "model": origin, "layers": model.cfg.n_layers, "topk": model.cfg.topk,
              "length": args.length, "sequences": args.sequences, "batches": args.batches,
              "index_heads": model.cfg.index_heads, "index_dim": model.cfg.index_dim}
    recomputes = {"replay (HyScale)": None, "select again, same kernel (hs.indexer_topk)": hs.indexer_topk,
                  **{f"select again, {name}": materialised_topk(fn) for name, fn in VARIANTS.items()}}
    refs = [step(model, b, recompute=False)[0] for b in batches]
    n_rows = len(batches) * args.sequences * args.length * model.cfg.n_layers
    rows = []
    for impl, topk_fn in recomputes.items():
        results = [compare(model, b, ref, topk_fn) for b, ref in zip(batches, refs)]
        missing, flipped_rows, selected = sum(r["counts"] for r in results)
        worst = {name: max(r["rel"][name] for r in results) for name in results[0]["rel"]}
        top = max(worst, key=worst.get)
        rows.append({"bench": "replay_drift", "config": config, "impl": impl, "kind": "model",
                     "median_ms": round(statistics.median(r["ms"] for r in results), 1),
                     "flipped": missing / max(selected, 1), "rows_flipped": flipped_rows / n_rows,
                     "grad_rel_max": worst[top], "grad_rel_median": statistics.median(worst.values()),
                     "worst_param": top, "bitwise": all(r["bitwise"] for r in results), "grad_rel": worst})
        r = rows[-1]
        print(f"{impl:48s} flipped {r['flipped']:.2e} (rows {r['rows_flipped']:.2e})  grad rel max "
              f"{r['grad_rel_max']:.2e} ({top}), median {r['grad_rel_median']:.2e}  bitwise {r['bitwise']}",
              flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="folder written by examples/train_tiny_dsa.py (--out)")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--sequences", type=int, default=8, help="sequences packed per batch")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--dsa-n", type=int, default=8192, help="tokens of the DSA-shape flip count (0: skip it)")
    parser.add_argument("--dsa-heads", type=int, default=64)
    parser.add_argument("--dsa-dim", type=int, default=128)
    parser.add_argument("--dsa-topk", type=int, default=2048)
    parser.add_argument("--name", default="replay_drift", help="results file name (OUT/NAME.json)")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = model_rows(args)
    if args.dsa_n:
        rows += dsa_shape_flips(args.dsa_n, args.dsa_heads, args.dsa_dim, args.dsa_topk)
    path = write_results(args.name, cpu_device(), rows, args.out)
    short = [{**r, "shape": "model" if r["kind"] == "model" else f"N={args.dsa_n} k={args.dsa_topk}",
              **{c: f"{r[c]:.2e}" for c in ("flipped", "rows_flipped", "grad_rel_max", "grad_rel_median") if c in r}}
             for r in rows]
    print(table(short, ["shape", "impl", "flipped", "rows_flipped", "grad_rel_max", "worst_param", "grad_rel_median",
                        "bitwise", "median_ms"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
