"""How ``ucm`` speaks: exit statuses, errors, numbers, the one question, progress.

Owns what every command shares about talking to the operator: the exit
statuses and ``UserError`` (one line on stderr, ``ucm: ...``, never a
traceback), the way sizes, times and counts are written, the ``[y/N]``
question of the commands that delete, the progress line
(``store_backends.Progress``, shown when asked, else when stderr is a
terminal), and the two forms of each report: text for a person, ``--json``
for a script.  The JSON forms are a contract with scripts: keys are only
ever added.

Must not open stores, walk them or decide anything: the commands do the
work and hand what they found (the dataclasses of ``survey``, an shm
``ServerStatus``) here to be said.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from store_backends import KVStore, Progress, StoreError, mask_password

from .. import blockfmt
from .survey import BadEntry, StatsReport, Usage, VerifyReport

if TYPE_CHECKING:  # the shm code is loaded only by the shm commands
    from store_backends import ServerStatus

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_STORE = 3
EXIT_NEWER = 4
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Something the user can fix; printed as one line, exit ``status``."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def error(message: object) -> None:
    """``ucm: message`` on stderr, on one line."""
    text = " ".join(str(message).split())
    print(f"ucm: {text}", file=sys.stderr)


def nbytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def print_json(document: object, sort_keys: bool = True, **options: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=sort_keys, **options))


def confirm(question: str, assume_yes: bool) -> bool:
    """Ask ``question [y/N]`` on stderr; only "y" or "yes" is a yes."""
    if assume_yes:
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    # Under cron or systemd (`<&-`) there is no stdin at all: sys.stdin is
    # None. That, an empty one and an unreadable one are all a "no".
    try:
        answer = sys.stdin.readline() if sys.stdin is not None else ""
    except (OSError, ValueError):
        answer = ""
    if not answer:
        sys.stderr.write("\nno answer: stdin is closed or empty (as under cron or systemd)\n")
        return False
    if not answer.endswith("\n"):
        sys.stderr.write("\n")
    return answer.strip().lower() in ("y", "yes")


def progress(args: argparse.Namespace, label: str, store: KVStore | None = None) -> Progress:
    """The progress line of a command walking ``store``'s keys: shown with
    ``--progress``, hidden with ``--no-progress``, else shown when stderr is
    a terminal; with a bar when the store can say how many keys it holds."""
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    total = None
    if enabled and store is not None:
        try:
            stats = store.stats()
            # Redis counts every key of the database, not the store's namespace.
            if stats.num_blocks is not None and stats.counts_this_store:
                total = stats.num_blocks
        except StoreError:
            pass
    return Progress(enabled, label, total)


def newer_message(shown: str, newer: dict[int, Usage]) -> str:
    count = sum(u.num_blocks for u in newer.values())
    versions = ", ".join(str(v) for v in sorted(newer))
    blocks = plural(count, "block")
    return (f"store '{shown}' holds {blocks} of format version {versions}, newer than this build reads "
            f"({blockfmt.FORMAT_VERSION}): upgrade ucm-connector (pip install -U ucm-connector) to read them; "
            f"they were left in place")


def _newer_format(newer: dict[int, Usage]) -> list[dict]:
    return [{"version": v, **u.to_dict()} for v, u in sorted(newer.items())]


# -- ucm store stats ----------------------------------------------------------------------

def print_stats_json(report: StatsReport) -> None:
    found, stats = report.found, report.stats
    print_json({
        "url": report.shown,
        "num_keys": found.num_keys,
        "num_blocks": report.num_blocks,
        "nbytes": report.nbytes,
        "capacity_nbytes": stats.capacity_nbytes,
        "namespaces": [row.to_dict() for row in report.rows],
        "newer_format": _newer_format(found.newer),
        "damaged": found.damaged.to_dict(),
        "bad_manifests": len(found.bad_manifests),
        "not_ucm": found.foreign.to_dict(),
        "store": {**stats.to_dict(), "url": mask_password(stats.url)},
    }, default=str)


def print_stats_text(report: StatsReport) -> None:
    found, stats = report.found, report.stats
    capacity = stats.capacity_nbytes
    print(f"store {report.shown}")
    print(f"  {plural(len(found.namespaces), 'namespace')}, {plural(report.num_blocks, 'block')}, "
          f"{nbytes(report.nbytes)} of blocks ({plural(found.num_keys, 'key')} in all)")
    used = stats.nbytes
    line = f"  the store reports {nbytes(used)} used"
    if capacity:
        share = f", {100 * used / capacity:.1f}% used" if used is not None else ""
        line += f" of a capacity of {nbytes(capacity)}{share}"
    else:
        line += ", no capacity set"
    if not stats.counts_this_store:
        line += f" ({stats.counts_scope})"
    print(line)
    if stats.read_only:
        print(f"  read-only: {stats.read_only}")
    if report.rows:
        print()
        print(f"{'NAMESPACE':<16}  {'BLOCKS':>8}  {'BYTES':>10}  {'OLDEST USE':<19}  {'NEWEST USE':<19}  "
              f"DESCRIPTION")
        for row in report.rows:
            usage = row.usage
            print(f"{row.digest.hex()[:16]:<16}  {usage.num_blocks:>8}  {nbytes(usage.nbytes):>10}  "
                  f"{when(usage.oldest_use):<19}  {when(usage.newest_use):<19}  "
                  f"{row.description or ('(bad manifest)' if row.bad_manifest else '(no manifest)')}")
    notes = []
    for version, usage in sorted(found.newer.items()):
        notes.append(f"format v{version} (newer than this build): {plural(usage.num_blocks, 'block')}, "
                     f"{nbytes(usage.nbytes)}")
    if found.damaged.num_blocks:
        notes.append(f"damaged headers: {plural(found.damaged.num_blocks, 'block')}, "
                     f"{nbytes(found.damaged.nbytes)} (`ucm store verify --repair` removes them)")
    if found.bad_manifests:
        notes.append(f"bad manifests: {len(found.bad_manifests)} (`ucm store verify` says what is wrong, "
                     f"`--repair` removes them)")
    if found.foreign.num_blocks:
        notes.append(f"not ucm blocks: {plural(found.foreign.num_blocks, 'key')}, {nbytes(found.foreign.nbytes)}")
    if notes:
        print()
        for note in notes:
            print(note)


# -- ucm store verify ---------------------------------------------------------------------

def bad_entry_line(entry: BadEntry) -> str:
    digest = entry.namespace_digest
    return (f"bad  {entry.key.hex()}  ns {digest.hex()[:16] if digest else '-':<16}  {entry.problem}"
            f"{'  (removed)' if entry.removed else ''}")


def print_verify_json(report: VerifyReport) -> None:
    print_json({"url": report.shown, **report.counts.to_dict(), "bad_keys": [e.to_dict() for e in report.bad],
                "newer_format": _newer_format(report.newer)})


def verify_summary(report: VerifyReport) -> str:
    counts = report.counts
    summary = (f"checked {plural(counts.checked, 'key')} of "
               f"store {report.shown}: {counts.good} good, {plural(counts.manifest, 'manifest')}, "
               f"{counts.bad} bad")
    if counts.bad:
        summary += " (removed)" if report.repair else " (left in place; --repair removes them)"
    if counts.newer:
        summary += f", {counts.newer} of a newer format"
    return summary


# -- ucm shm ------------------------------------------------------------------------------

def shm_list_line(name: str, status: ServerStatus) -> str:
    if not status.answering:
        return f"shm://{name}  (not answering)"
    return (f"shm://{name}  {plural(status.num_blocks, 'block')}, {nbytes(status.nbytes)} of "
            f"{nbytes(status.capacity_nbytes)}, pid {status.pid}")


def print_shm_status_text(name: str, status: ServerStatus) -> None:
    capacity = status.capacity_nbytes
    used = status.used_nbytes
    cpus = status.cpus or []
    on = f", on CPUs {','.join(map(str, cpus))}" if cpus and len(cpus) < (os.cpu_count() or 0) else ""
    print(f"shm://{name}: server pid {status.pid}, up {status.uptime_s / 3600:.1f} h{on}")
    print(f"  {plural(status.num_blocks, 'block')}, {nbytes(status.nbytes)} of values in {nbytes(used)} "
          f"of chunks; capacity {nbytes(capacity)} ({100 * used / capacity:.1f}% used), "
          f"chunk {nbytes(status.chunk_nbytes)}")
    print(f"  gets {status.gets}, hits {status.hits}, misses {status.misses}, "
          f"puts {status.puts}, put failures {status.put_failures}, "
          f"evictions {status.evictions}")
    reserved = f", {status.reserved_chunks} reserved for next puts" if status.reserved_chunks else ""
    print(f"  open write leases {status.num_leases} ({status.leased_chunks} chunks{reserved}), "
          f"leases reclaimed {status.leases_reclaimed}, idle timeout "
          f"{'never' if status.idle_timeout_s is None else str(status.idle_timeout_s) + ' s'}")
    if status.key_table_slots:
        state = "answers lookups" if status.key_table_active else "switched off (lookups ask the server)"
        print(f"  key table {state}: {plural(status.key_table_live, 'key')}, {status.key_table_used} of "
              f"{status.key_table_slots} slots used; gets "
              f"{'find values from it' if status.where_path else 'ask the server'}")
    else:
        print("  key table: none (lookups ask the server)")
    print(f"  segment {status.data_path}")
