"""Lookups of an ``shm://`` store: ``contains`` and ``prefix_len`` of a long
prompt's keys, answered from the server's key table, against the same
calls asked of the server (the path every lookup took before the table), in
one run.

Keys are the connector's: 18 bytes (a 16-byte chain digest and the TP rank).
8,192 keys are a 128k-token prompt at 16-token blocks.

    .venv/bin/python benchmarks/lookup_bench.py [--keys 8192] [--calls 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from store_backends import open_store, stop_server  # noqa: E402


def _p50_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    name = "lookup-bench-" + uuid.uuid4().hex[:8]
    keys = [os.urandom(18) for _ in range(args.keys)]
    stored = keys[: args.keys * 15 // 16]          # a prefix hit, then misses
    out: dict = {"keys": args.keys, "stored": len(stored), "calls": args.calls}
    try:
        store = open_store(f"shm://{name}?capacity=1GiB")
        try:
            assert all(store.put(stored, [b"\0" * 4096] * len(stored)))
            assert store.prefix_len(keys) == len(stored)
            assert store._published(keys) is not None, "no key table: this machine's server publishes none"
            rows = {}
            for path in ("table", "server"):
                if path == "server":
                    store._published = lambda keys: None       # what every lookup did before the table
                assert store.prefix_len(keys) == len(stored)
                assert sum(store.contains(keys)) == len(stored)
                rows[path] = {"contains_ms": _p50_ms(lambda: store.contains(keys), args.calls),
                              "prefix_len_ms": _p50_ms(lambda: store.prefix_len(keys), args.calls)}
            out["p50_ms"] = rows
        finally:
            store.close()
    finally:
        stop_server(name)
    print(f"shm lookups of {args.keys} keys of 18 bytes ({len(stored)} stored), p50 of {args.calls} calls:")
    print(f"{'path':8} {'contains ms':>12} {'prefix_len ms':>14}")
    for path, row in out["p50_ms"].items():
        print(f"{path:8} {row['contains_ms']:12.3f} {row['prefix_len_ms']:14.3f}")
    table, server = out["p50_ms"]["table"], out["p50_ms"]["server"]
    print(f"table / server: contains {table['contains_ms'] / server['contains_ms']:.2f}x, "
          f"prefix_len {table['prefix_len_ms'] / server['prefix_len_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
