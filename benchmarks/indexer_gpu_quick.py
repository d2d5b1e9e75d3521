"""One line per tree for A/B runs of the GPU indexer kernels: the score
kernel alone (``hs.indexer_scores`` over query chunks, the table discarded,
as in ``indexer_gpu_breakdown``) and, unless ``--scores-only``, the
streaming ``hs.indexer_topk`` at each k. Run it from each tree's root with
that tree on ``PYTHONPATH`` (and its own ``HYSCALE_CACHE_DIR``), in one
device call, so that the trees share the GPU's state.

    python -m benchmarks.indexer_gpu_quick --label 91e8e1c --n 131072

``--guess-beta`` sets the kernel's threshold guess (``GUESS_BETA``; 0 turns
it off) for A/B runs in one tree; each top-k's line counts the rows its
timed runs selected again after a failed guess. ``--tie-run L`` repeats
every key L times (the copies scattered along the sequence), so a query's
picks hold runs of up to L equal scores: the final sort's tie handling at
its worst where L is its run limit. ``--out FOLDER`` also writes
the line's figures as a results JSON (rows with ``median_ms``), as
``benchmarks.ab_runs`` wants:

    python -m benchmarks.ab_runs --tree main=ab_main@d8d1406 --tree new=. -- \
        indexer_gpu_quick --n 131072 --ks 2048 --topk-only --repeats 3
"""
from __future__ import annotations

import argparse
import json

import numpy as np

SCORE_REPEATS = 3  # runs of the score kernel alone (median)


def main(argv=None) -> None:
    import cupy as cp

    import hyscale_core as hs
    from hyscale_core.ops.indexer import gpu

    from .indexer_gpu import inputs
    from .indexer_gpu_breakdown import scores_only, wall_ms

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="run", help="names the tree in the output line")
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="*", default=[256, 2048])
    parser.add_argument("--scores-only", action="store_true")
    parser.add_argument("--topk-only", action="store_true", help="skip the score kernel's run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each top-k (median)")
    parser.add_argument("--chunk", type=int, default=16384, help="query chunk of the score-only run")
    parser.add_argument("--guess-beta", type=float, default=None, help="the kernel's GUESS_BETA (0: no guess)")
    parser.add_argument("--tie-run", type=int, default=1, help="copies of every key (1: all keys distinct)")
    parser.add_argument("--out", default=None, help="folder for a results JSON of this run")
    args = parser.parse_args(argv)
    if args.tie_run < 1:
        parser.error("--tie-run wants at least 1")
    reselected = count_reselections(args.guess_beta)

    q, k, w = inputs(cp, args.n, args.heads, args.dim)
    if args.tie_run > 1:
        k = repeated_keys(cp, k, args.tie_run)
    row = {"label": args.label, "n": args.n, "heads": args.heads, "guess_beta": gpu.GUESS_BETA,
           "tie_run": args.tie_run}
    if not args.topk_only:
        scores_only(hs, q[:2048], k[:2048], w[:2048], 1024)  # compile
        row["scores_ms"] = round(wall_ms(cp, lambda: scores_only(hs, q, k, w, args.chunk), SCORE_REPEATS), 2)
    for topk in [] if args.scores_only else args.ks:
        hs.indexer_topk(q[:1024], k[:1024], w[:1024], topk, q_pos=np.arange(1024))  # compile
        reselected.clear()
        row[f"topk{topk}_ms"] = round(wall_ms(cp, lambda: hs.indexer_topk(q, k, w, topk), args.repeats), 2)
        row[f"topk{topk}_reselected"] = max(reselected, default=0)  # the same rows in every run
    print(json.dumps(row), flush=True)
    if args.out:
        from pathlib import Path

        from .common import gpu_device, write_results

        write_results("indexer_gpu_quick", gpu_device(), result_rows(row, args.repeats), Path(args.out))


def repeated_keys(cp, k, copies: int):
    """[n, D] keys made of the first ceil(n / copies) rows of k, each `copies`
    times (the last row fewer where copies does not divide n), in a fixed random order."""
    n = k.shape[0]
    rows = (cp.arange(n) // copies)[cp.random.RandomState(1).permutation(n)]
    return k.view(cp.uint16)[rows].view(k.dtype)  # gathered as 16-bit words: any 2-byte dtype


def result_rows(row: dict, repeats: int) -> list[dict]:
    """The printed line as results rows: one per timed call, with ``median_ms``."""
    config = {"n": row["n"], "heads": row["heads"], "guess_beta": row["guess_beta"], "tie_run": row["tie_run"]}
    rows = []
    if "scores_ms" in row:
        rows.append({"impl": "scores alone", "config": config, "median_ms": row["scores_ms"],
                     "repeats": SCORE_REPEATS})
    for key, value in row.items():
        if key.startswith("topk") and key.endswith("_ms"):
            topk = key[len("topk"):-len("_ms")]
            rows.append({"impl": f"indexer_topk k={topk}", "config": config, "median_ms": value,
                         "repeats": repeats, "reselected_rows": row[f"topk{topk}_reselected"]})
    return rows


def count_reselections(guess_beta):
    """Set GUESS_BETA (unless None) and return the list that gets, for each
    indexer_topk call that selected rows again, how many."""
    from hyscale_core.ops.indexer import gpu

    if guess_beta is not None:
        gpu.GUESS_BETA = guess_beta
    counts, select_again = [], gpu._select_again

    def counting(q, k, w, lo, hi, rows, indices, scores):
        counts.append(len(rows))
        select_again(q, k, w, lo, hi, rows, indices, scores)

    gpu._select_again = counting
    return counts


if __name__ == "__main__":
    main()
