"""``ucm-bench``: from the command line to the exit status.

Owns ``main``: checking what argparse cannot (threads against blocks, the
memory the values and buffers need), opening the store and its raw medium,
running the benchmark, removing what it wrote (also on Ctrl-C and on a
store that fails mid-run), and printing or writing the report.  Must not
reach into a backend: it opens a store by its URL through ``open_store``.
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import Sequence

from store_backends import Progress, StoreError, StoreOpenError, mask_password, open_store, url_scheme

from .buffers import aligned_empty, make_values
from .output import MAX_FAILURES_SHOWN, err, footer, format_table, header
from .parsing import UsageError, build_parser, store_urls
from .raw import RawMedium, open_raw
from .runner import Bench, BenchConfig

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): a return value, not an exit, for callers
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    try:
        urls = store_urls(args.store)
        if args.threads > args.blocks:
            raise UsageError(f"--threads {args.threads} is more than --blocks {args.blocks}: "
                             "every thread needs at least one block")
    except UsageError as exc:
        err(f"error: {exc}")
        return EXIT_USAGE

    cfg = BenchConfig(urls=urls, block_nbytes=args.block_kib * 1024, num_blocks=args.blocks,
                      num_threads=args.threads, batch=args.batch, ops=args.ops, repeat=args.repeat,
                      warmup=args.warmup, seed=args.seed, raw=not args.no_raw, keep=args.keep)
    total = cfg.block_nbytes * cfg.num_blocks
    need = total * (3 if cfg.raw and url_scheme_or_none(urls) == "shm" else 2)
    available = _memory_available()
    if available is not None and need > 0.8 * available:
        err(f"error: {args.blocks} blocks of {args.block_kib} KiB need about {need / 2**30:.1f} GiB of "
             f"memory for the values and read buffers, but only {available / 2**30:.1f} GiB is available; "
             "use fewer --blocks or a smaller --block-kib")
        return EXIT_USAGE

    try:
        store = open_store(urls if len(urls) > 1 else urls[0])
    except StoreError as exc:
        err(f"error: {exc}")
        return EXIT_USAGE
    except ImportError as exc:
        err(f"error: store {' '.join(mask_password(u) for u in urls)} cannot be opened: "
             f"its backend failed to import: {exc}")
        return EXIT_USAGE

    quiet = args.quiet
    progress_on = not quiet and (args.progress or sys.stderr.isatty())
    run_id = uuid.uuid4().hex[:10]
    bench: Bench | None = None
    raw: RawMedium | None = None
    status = EXIT_OK
    try:
        values = make_values(cfg.num_blocks, cfg.block_nbytes, cfg.seed)
        dest = aligned_empty(cfg.num_blocks, cfg.block_nbytes)
        dest.fill(0)
        raw_note = "n/a: skipped (--no-raw)"
        if cfg.raw:
            try:
                raw, raw_note = open_raw(urls, store, values, dest, run_id)
            except Exception as exc:
                reason = " ".join(str(exc).split())
                raw, raw_note = None, f"n/a: the raw medium could not be opened: {reason}"
                if not quiet:
                    err(f"warning: running without a raw baseline: {reason}")
        bench = Bench(cfg, store, raw, raw_note, values, dest, run_id, Progress(progress_on, unit="calls"))
        try:
            bench.run()
        finally:
            bench.progress.close()
        report = bench.report()
    except KeyboardInterrupt:
        err("interrupted; the blocks written so far are removed")
        status = EXIT_INTERRUPTED
        report = None
    except StoreError as exc:
        err(f"error: the store failed during the run: {exc}")
        status = EXIT_VERIFY
        report = None
    finally:
        if bench is not None:
            bench.cleanup()
        elif raw is not None:
            raw.close()
        store.close()
    if report is None:
        return status

    if not report["verified"]:
        status = EXIT_VERIFY
        failures: list[str] = report["failures"]  # type: ignore[assignment]
        for failure in failures[:MAX_FAILURES_SHOWN]:
            err(f"VERIFY FAILED: {failure}")
        if len(failures) > MAX_FAILURES_SHOWN:
            err(f"VERIFY FAILED: ... and {len(failures) - MAX_FAILURES_SHOWN} more")
        if bench is not None and bench.verifier.num_misses:
            err(f"hint: a store with a capacity evicts; {cfg.num_blocks} blocks of {args.block_kib} KiB "
                 f"need {total / 2**20:.0f} MiB in it, more where it rounds blocks up to a chunk size")
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
            except OSError as exc:
                err(f"error: cannot write --json {args.json}: {exc.strerror or exc}")
                return EXIT_USAGE if status == EXIT_OK else status
    if not quiet:
        out = sys.stderr if args.json == "-" else sys.stdout
        print(header(report), file=out)
        print(format_table(report), file=out)
        print(footer(report), file=out)
        if cfg.keep:
            print(f"kept the last round's blocks under the key prefix {report['kept_key_prefix']!r}", file=out)
    return status


def url_scheme_or_none(urls: list[str]) -> str | None:
    if len(urls) != 1:
        return None
    try:
        return url_scheme(urls[0])
    except StoreOpenError:
        return None
