"""``hyscale log inspect FILE`` and ``hyscale log diff A B``.

Exit status: 0 all is well; 1 the log is readable but something in it is
wrong (incomplete, a selection that does not read back, entries that do not
match up in a diff); 2 a file is not a readable selection log (it cannot be
opened, or its layout or an entry's metadata is malformed). Every error is
one line on stderr naming the file, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from .entry import SelectionLogError

_ROW_BLOCK = 4096  # rows read at once by diff


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *rows])


def _check(log: Any, entry: Any, verify: bool) -> tuple[str, bool]:
    """(fingerprint check result, whether it passed) of one entry."""
    if not verify:
        return "not checked", True
    try:
        log.read(entry.sample, entry.layer)
    except SelectionLogError as exc:
        return f"FAILED: {str(exc).removeprefix(f'{log.path}: ')}", False
    return "ok", True


def _fail(command: str, exc: Exception) -> int:
    """Print ``exc`` as one line on stderr (a SelectionLogError names its file); exit status 2."""
    print(f"hyscale log {command}: {exc}", file=sys.stderr)
    return 2


def inspect(args: argparse.Namespace) -> int:
    """Print a log's samples, layers, shapes, encodings, sizes, compression and fingerprint checks."""
    from .selection_log import SelectionLog

    try:
        with SelectionLog(args.file, allow_incomplete=True) as log:
            return _inspect(log, args.verify)
    except (SelectionLogError, OSError) as exc:
        return _fail("inspect", exc)


def _inspect(log: Any, verify: bool) -> int:
    """The report of :func:`inspect` on an open log; raises SelectionLogError on a malformed one."""
    entries, rows, ok = list(log), [], log.complete  # every entry's metadata, before any output
    attrs = log.metadata
    state = "complete" if log.complete else "INCOMPLETE (its writer did not close it)"
    print(f"{log.path}: hyscale selection log, format_version {attrs['format_version']}, "
          f"created {attrs.get('created', '?')} by hyscale-core {attrs.get('hyscale_version', '?')}, {state}")
    for e in entries:
        check, passed = _check(log, e, verify)
        ok &= passed
        rows.append([e.sample, e.layer, f"[{e.n_queries}, {e.k}]", str(e.n_keys), "yes" if e.causal else "no",
                     e.encoding, _size(e.stored_bytes), _size(e.raw_bytes), f"{100 * e.ratio:.1f}%",
                     f"{e.stored_bytes / max(e.n_queries, 1):.1f}", check])
    print(f"{len(entries)} selections in {len(log.samples())} samples")
    print(_table(rows, ["sample", "layer", "shape", "n_keys", "causal", "encoding", "stored", "raw int32",
                        "ratio", "B/token", "fingerprint"]))
    stored, raw = sum(e.stored_bytes for e in entries), sum(e.raw_bytes for e in entries)
    print(f"total: stored {_size(stored)}, raw int32 {_size(raw)}, ratio {100 * stored / max(raw, 1):.1f}%")
    for sample, layer in log.incomplete_entries():
        print(f"cut off mid-append (not readable): sample {sample!r} layer {layer!r}")
        ok = False
    return 0 if ok else 1


def _drift(log_a: Any, log_b: Any, sample: str, layer: str, n: int) -> tuple[float, float, int, bool]:
    """(mean row drift, max row drift, rows with equal sets, bitwise equal) of one entry."""
    from .compare import row_drift

    total, worst, same_rows, bitwise = 0.0, 0.0, 0, True
    for a in range(0, n, _ROW_BLOCK):
        rows = slice(a, min(n, a + _ROW_BLOCK))
        ta, tb = log_a.read(sample, layer, rows), log_b.read(sample, layer, rows)
        drift = row_drift(ta, tb)
        total, worst = total + float(drift.sum()), max(worst, float(drift.max(initial=0.0)))
        same_rows += int(np.count_nonzero(drift == 0))
        bitwise &= ta.shape == tb.shape and bool(np.array_equal(ta, tb))
    return total / max(n, 1), worst, same_rows, bitwise


def diff(args: argparse.Namespace) -> int:
    """Per (sample, layer) of two logs: the fraction of selected keys that differ."""
    from .selection_log import SelectionLog

    try:
        with SelectionLog(args.a, allow_incomplete=args.allow_incomplete) as log_a, \
                SelectionLog(args.b, allow_incomplete=args.allow_incomplete) as log_b:
            return _diff(log_a, log_b)
    except (SelectionLogError, OSError) as exc:
        return _fail("diff", exc)


def _diff_row(log_a: Any, log_b: Any, sample: str, layer: str) -> tuple[list[str], bool]:
    """(table row, whether comparable) of one entry in both logs."""
    ia, ib = log_a.info(sample, layer), log_b.info(sample, layer)
    if ia.n_queries != ib.n_queries:
        return [sample, layer, f"[{ia.n_queries}, {ia.k}] vs [{ib.n_queries}, {ib.k}]",
                "-", "-", "-", "not comparable: different queries"], False
    mean, worst, same, bitwise = _drift(log_a, log_b, sample, layer, ia.n_queries)
    return [sample, layer, f"[{ia.n_queries}, {ia.k}]" + ("" if ia.k == ib.k else f" vs k={ib.k}"),
            f"{mean:.4f}", f"{worst:.4f}", f"{same}/{ia.n_queries}",
            "identical" if bitwise else ("same sets" if mean == 0 else "differ")], True


def _diff(log_a: Any, log_b: Any) -> int:
    """The report of :func:`diff` on two open logs; raises SelectionLogError on a malformed one."""
    keys_a, keys_b = log_a.keys(), log_b.keys()
    in_a, in_b = set(keys_a), set(keys_b)
    rows, ok = [], True
    for sample, layer in (key for key in keys_a if key in in_b):
        row, comparable = _diff_row(log_a, log_b, sample, layer)
        rows.append(row)
        ok &= comparable
    print(f"A = {log_a.path}\nB = {log_b.path}")
    print("drift: per row 1 - |A & B| / max(|A|, |B|) over the selected keys (-1 excluded), "
          "averaged over rows")
    print(_table(rows, ["sample", "layer", "shape", "drift", "max row", "same-set rows", "tables"]))
    for label, only in (("A", [key for key in keys_a if key not in in_b]),
                        ("B", [key for key in keys_b if key not in in_a])):
        for sample, layer in only:
            print(f"only in {label}: sample {sample!r} layer {layer!r}")
            ok = False
    return 0 if ok else 1


def add_commands(sub: Any) -> None:
    """Add the ``log`` command group to the ``hyscale`` subparsers ``sub``."""
    group = sub.add_parser("log", help="selection logs (HDF5): inspect, diff")
    log_sub = group.add_subparsers(dest="log_command", required=True)
    p = log_sub.add_parser("inspect", help="samples, layers, shapes, encodings, sizes, compression, "
                                                  "fingerprint check")
    p.add_argument("file")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip reading every selection back against its fingerprint")
    p.set_defaults(run=inspect)
    p = log_sub.add_parser("diff", help="per layer, the fraction of selected keys that differ between two logs")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="compare logs whose writer did not close them (the completely appended entries)")
    p.set_defaults(run=diff)
