"""What ``ucm-bench`` prints: the table, its header and footer, and its errors.

Owns the text form of a run's report (the ``--json`` form is the report
itself) and the ``ucm-bench: ...`` lines on stderr.  Must not compute
figures: everything it prints is in the report.
"""

from __future__ import annotations

import sys

# How many failures are printed one by one before the rest are only counted:
# a store that corrupts everything must not bury the summary.
MAX_FAILURES_SHOWN = 10


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, object]) -> str:
    rows = [("op", "store GB/s", "raw GB/s", "store/raw", "store ops/s", "raw ops/s", "p50 ms", "p99 ms")]
    for op, fig in report["ops"].items():  # type: ignore[union-attr]
        store, raw = fig["store"], fig["raw"]
        ratio = fig["ratio"]
        rows.append((
            op,
            _fmt(store["gb_s"], ".3f"),
            _fmt(raw["gb_s"], ".3f") if raw else "n/a",
            f"{ratio:.2f}x" if ratio is not None else "n/a",
            _fmt(store["ops_s"], ",.0f"),
            _fmt(raw["ops_s"], ",.0f") if raw else "n/a",
            _fmt(store["latency_ms"]["p50"], ".3f"),
            _fmt(store["latency_ms"]["p99"], ".3f"),
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def header(report: dict[str, object]) -> str:
    store = report["store"]
    stores = store if isinstance(store, str) else " > ".join(store)  # type: ignore[arg-type]
    threads = report["threads"]
    return (f"ucm-bench  store {stores}\n"
            f"  {report['block_kib']} KiB x {report['blocks']} blocks, {threads} thread{'s' if threads != 1 else ''}, "
            f"batch {report['batch']}, median of {report['repeat']} round(s) after {report['warmup']} warm-up\n"
            f"  raw: {report['raw_description']}")


def footer(report: dict[str, object]) -> str:
    lines = ["ops/s = blocks (keys) per second; p50/p99 = latency of one call "
             f"({report['batch']} keys per call; prefix_len: one call over all {report['blocks']} keys)"]
    ops = report["ops"]
    if "prefix_len" in ops:  # type: ignore[operator]
        p50 = ops["prefix_len"]["store"]["latency_ms"]["p50"]  # type: ignore[index]
        lines.append(f"prefix_len over {report['blocks']} keys: {_fmt(p50, '.3f')} ms per call (p50)")
    lines.append("verified: every block read back equals what was put" if report["verified"] and "get" in ops
                 else ("verified: no failures in " + ", ".join(report["checked"])) if report["verified"]  # type: ignore[arg-type]
                 else f"VERIFY FAILED: {len(report['failures'])} failure(s)")  # type: ignore[arg-type]
    return "\n".join(lines)


def err(message: str) -> None:
    print(f"ucm-bench: {' '.join(str(message).split())}", file=sys.stderr)
