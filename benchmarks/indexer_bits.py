"""The GPU indexer's scores and top-k on awkward shapes, saved from one tree
for a bitwise comparison with another (a kernel change that should keep
every bit, checked before it is timed).

    (cd ab_main && PYTHONPATH=. python -m benchmarks.indexer_bits save /tmp/main.npz)
    PYTHONPATH=. python -m benchmarks.indexer_bits save /tmp/branch.npz
    python -m benchmarks.indexer_bits compare /tmp/main.npz /tmp/branch.npz

Run ``save`` with ``-m`` from inside each tree: ``python -m`` puts the
current folder first on the path, so each save imports its own tree's
package (a script run as ``python ../script.py`` imports the package
beside the script instead). Each file records the package folder it
imported, and ``compare`` refuses two files from the same folder.

``compare`` prints IDENTICAL or the arrays whose bytes differ, and exits
with status 1 when any do. Cases (N, H, k, mask), D = 128, random bf16
inputs with a repeated query and ten repeated keys (ties), a NaN in one
key and +inf in one query: causal at H = 64, 32, 16, 8 and 128, a packed
batch of lengths 1, 7, 63, 300, 1229 and 1000, and a query shard (the
second half, with q_pos).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

CASES = [(3000, 64, 2048, "causal"), (3000, 32, 256, "causal"), (2600, 64, 300, "packed"),
         (1500, 64, 2048, "shard"), (700, 16, 7, "causal"), (800, 8, 64, "causal"), (600, 128, 64, "causal")]
PACKED_LENGTHS = [1, 7, 63, 300, 1229, 1000]


def save(path: str) -> None:
    """Scores and top-k (indices, scores) of every case on the GPU, to `path` (.npz)."""
    from pathlib import Path

    import cupy as cp

    import hyscale_core as hs

    from .indexer_gpu import inputs

    saved = {"package": np.array(str(Path(hs.__file__).resolve().parent))}
    for n, heads, topk, mode in CASES:
        q, k, w = inputs(cp, n, heads, 128, seed=n + heads)
        q[5] = q[4]  # a repeated query and repeated keys: ties
        k[10:20] = k[9]
        k.view(cp.uint16)[30, 0] = 0x7FC0  # bfloat16 NaN
        q.view(cp.uint16)[40, 0, 0] = 0x7F80  # bfloat16 +inf
        mask = {}
        if mode == "packed":
            mask["cu_seqlens"] = cp.asarray(np.cumsum([0, *PACKED_LENGTHS]), dtype=cp.int32)
        if mode == "shard":
            mask["q_pos"] = cp.arange(n // 2, n, dtype=cp.int32)
            q, w = q[n // 2:], w[n // 2:]
        tag = f"{n}_{heads}_{topk}_{mode}"
        saved[f"table_{tag}"] = cp.asnumpy(hs.indexer_scores(q, k, w, **mask))
        indices, scores = hs.indexer_topk(q, k, w, topk, return_scores=True, **mask)
        saved[f"idx_{tag}"], saved[f"sc_{tag}"] = cp.asnumpy(indices), cp.asnumpy(scores)
    np.savez(path, **saved)
    print(f"saved {path} from the package in {saved['package']}")


def differing(a: str, b: str) -> tuple[list[str], int]:
    """(names of the arrays of file `a` missing from `b` or with other bytes
    there, how many arrays `a` holds); stops when both files come from the
    same package folder."""
    x, y = dict(np.load(a)), dict(np.load(b))
    if str(x["package"]) == str(y["package"]):
        raise SystemExit(f"{a} and {b} both come from {x['package']}: the comparison would compare nothing")
    names = [n for n in x if n != "package"]
    bad = [n for n in names if n not in y or x[n].shape != y[n].shape or x[n].tobytes() != y[n].tobytes()]
    return bad, len(names)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("save").add_argument("path")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.path)
        return
    bad, count = differing(args.a, args.b)
    print(f"{args.b}: {'IDENTICAL' if not bad else 'DIFFERENT: ' + ', '.join(bad)} ({count} arrays)")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
