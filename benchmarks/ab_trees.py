"""Copies of commits as trees for ``benchmarks.ab_runs`` on the device machine.

    python -m benchmarks.ab_trees main sort-radix-2 probe-no-sort-2

writes ab_main/, ab_sort-radix-2/, ... at the repository root: ``git archive``
of each ref without benchmarks/results (a device call carries at most 64
MiB), each folder listed in the repository's info/exclude so that git ignores
it. It prints the device call's ``carry`` list and the ``--tree`` arguments
of ab_runs, LABEL=FOLDER@COMMIT (a copied tree's git metadata names no
commit). ``--remove`` deletes the folders again (the exclude lines stay).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

SKIPPED = "benchmarks/results/"  # committed results: megabytes no run needs
_SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4, 3.12


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def label_of(ref: str) -> str:
    """A tree label for ``ref``: its name with anything but letters, digits, '-', '_' and '.' made '-'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", ref)


def make_tree(repo: Path, ref: str) -> tuple[str, Path, str]:
    """(label, folder, short commit) of a fresh copy of ``ref`` at repo/ab_LABEL."""
    commit = _git(repo, "rev-parse", "--short", f"{ref}^{{commit}}")
    label = label_of(ref)
    folder = repo / f"ab_{label}"
    if folder.exists():
        shutil.rmtree(folder)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", commit], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        for member in tar:
            if not member.name.startswith(SKIPPED):
                tar.extract(member, folder, **_SAFE)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {commit} ended with status {archive.returncode}")
    (folder / SKIPPED).mkdir(parents=True, exist_ok=True)
    return label, folder, commit


def exclude(repo: Path, folders: list[Path]) -> None:
    """List each folder (as /NAME/) in the repository's info/exclude, once."""
    path = Path(_git(repo, "rev-parse", "--git-path", "info/exclude"))
    path = path if path.is_absolute() else repo / path
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.exists() else []
    lines += [f"/{f.name}/" for f in folders if f"/{f.name}/" not in lines]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("refs", nargs="+", help="branches, tags or commits, in ab_runs' run order")
    parser.add_argument("--repo", default=".", help="the repository (default: here)")
    parser.add_argument("--remove", action="store_true", help="delete the refs' folders instead")
    args = parser.parse_args(argv)
    repo = Path(_git(Path(args.repo), "rev-parse", "--show-toplevel"))
    labels = [label_of(ref) for ref in args.refs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"refs give repeated labels: {labels}")
    if args.remove:
        for label in labels:
            shutil.rmtree(repo / f"ab_{label}", ignore_errors=True)
        return
    trees = [make_tree(repo, ref) for ref in args.refs]
    exclude(repo, [folder for _, folder, _ in trees])
    print("carry:", " ".join(folder.name for _, folder, _ in trees))
    print(" ".join(f"--tree {label}={folder.name}@{commit}" for label, folder, commit in trees))


if __name__ == "__main__":
    main()
