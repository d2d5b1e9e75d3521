"""One benchmark run in several copies of the repository, the copies taking
turns, and one results JSON of all the runs.

    python -m benchmarks.ab_runs --tree main=ab_old@6e0c894 --tree ring=.@a49f3b6 \\
        --rounds 2 -- sparse_attention_gpu --sizes 32768 131072 --impls "hs bwd"

Each round runs ``python -m benchmarks.NAME ARGS --out TMP`` once per tree,
in the order given, from inside the tree (its own package on the path:
PYTHONPATH is the tree) with $HYSCALE_COMMIT set to the commit named after
``@`` (a copied tree's git metadata may name another commit), so trees
alternate and a slow spell of the machine falls on all of them. The
benchmark must take ``--out FOLDER`` and write one results JSON there. The
merged file (results/NAME_ab.json, or ``--label``) holds every row, each
with ``tree`` and ``round`` added, and ``commits`` mapping each tree to the
commit its runs recorded; a table of median_ms per row and tree closes the output. A run
that fails stops the whole (its output shows above the error).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import RESULTS, table


def parse_tree(spec: str) -> tuple[str, Path, str | None]:
    """'LABEL=PATH[@COMMIT]' -> (label, path, commit or None)."""
    label, sep, rest = spec.partition("=")
    if not sep or not label or not rest:
        raise SystemExit(f"--tree wants LABEL=PATH[@COMMIT], got {spec!r}")
    path, _, commit = rest.partition("@")
    tree = Path(path).resolve()
    if not (tree / "benchmarks").is_dir():
        raise SystemExit(f"--tree {label}: {tree} holds no benchmarks/ folder")
    return label, tree, commit or None


def run_once(tree: Path, commit: str | None, bench: str, args: list[str], out: Path) -> dict:
    """The benchmark's results JSON after one run in `tree`, writing to the empty folder `out`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    if commit:
        env["HYSCALE_COMMIT"] = commit
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{bench}", *args, "--out", str(out)], cwd=tree, env=env)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks.{bench} in {tree} ended with status {done.returncode}")
    written = sorted(out.glob("*.json"))
    if len(written) != 1:
        raise SystemExit(f"benchmarks.{bench} in {tree} wrote {len(written)} JSON files to {out}, not one")
    return json.loads(written[0].read_text())


def summary(rows: list[dict], labels: list[str]) -> str:
    """median_ms of each (config, impl) per tree, the rounds joined by ' / '."""
    cells: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        if "median_ms" not in r:
            continue
        key = f"{r.get('impl', '')} {json.dumps(r.get('config', {}), sort_keys=True)}"
        cells.setdefault(key, {}).setdefault(r["tree"], []).append(f"{r['median_ms']:g}")
    lines = [{"row": key, **{label: " / ".join(times.get(label, [])) for label in labels}}
             for key, times in cells.items()]
    return table(lines, ["row", *labels])


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: ab_runs --tree LABEL=PATH[@COMMIT] ... [--rounds N] -- NAME [ARGS ...]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH[@COMMIT], in run order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--label", default=None, help="name of the merged JSON (default NAME_ab)")
    parser.add_argument("--out", default=None, help="folder of the merged JSON (default benchmarks/results)")
    args = parser.parse_args(argv[:split])
    if not argv[split + 1:]:
        raise SystemExit("ab_runs: name a benchmark after --")
    bench, bench_args = argv[split + 1], argv[split + 2:]
    trees = [parse_tree(spec) for spec in args.tree]
    labels = [label for label, _, _ in trees]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--tree labels repeat: {labels}")
    rows, first, commits = [], None, {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(1, args.rounds + 1):
            for label, tree, commit in trees:
                print(f"== round {round_}, tree {label} ({tree})", flush=True)
                out = Path(scratch) / f"{label}_{round_}"
                out.mkdir()
                payload = run_once(tree, commit, bench, bench_args, out)
                first = first or payload
                commits.setdefault(label, payload.get("commit"))
                rows += [{**r, "tree": label, "round": round_} for r in payload["rows"]]
    merged = {"device": first["device"], "date": first["date"],
              "commit": ", ".join(f"{label}={commit}" for label, commit in commits.items()), "commits": commits,
              "python": first.get("python"), "command": " ".join([bench, *bench_args]), "rows": rows}
    folder = Path(args.out) if args.out else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{args.label or bench + '_ab'}.json"
    path.write_text(json.dumps(merged, indent=1) + "\n")
    print(summary(rows, labels))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
