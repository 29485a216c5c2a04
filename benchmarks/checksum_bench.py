"""Payload checksums of a batch of blocks: one thread (as the worker took
them before) against ``ucm_connector.checksums`` (the batch split over a
few threads; python-xxhash releases the GIL for inputs this large), in one
run.  Also with a second Python thread kept busy alongside, standing in for
an engine thread: each checksum thread then needs the GIL between blocks.

    .venv/bin/python benchmarks/checksum_bench.py [--blocks 128] [--block-mib 2] [--reps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm_connector import checksums  # noqa: E402


def _timed(fn, reps: int, busy: bool) -> tuple[float, float]:
    """(p50 seconds of ``fn``, loop iterations per second of a Python
    thread running alongside, or 0 when ``busy`` is False)."""
    times, rates = [], []
    for _ in range(reps):
        stop = threading.Event()
        count = [0]

        def spin():
            n = 0
            while not stop.is_set():
                n += 1
            count[0] = n

        thread = threading.Thread(target=spin) if busy else None
        if thread is not None:
            thread.start()
            time.sleep(0.01)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        stop.set()
        if thread is not None:
            thread.join()
            rates.append(count[0] / (dt + 0.01))
        times.append(dt)
    return statistics.median(times), (statistics.median(rates) if rates else 0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    nbytes = int(args.block_mib * (1 << 20))
    rows = np.random.default_rng(0).integers(0, 256, (args.blocks, nbytes), dtype=np.uint8)
    buffers = [rows[i] for i in range(args.blocks)]
    total = rows.nbytes
    assert checksums.checksums(buffers) == [xxhash.xxh3_64_intdigest(b) for b in buffers]
    ways = {
        "one thread": lambda: checksums._hash_all(buffers),
        f"{checksums.THREADS} threads": lambda: checksums.checksums(buffers),
    }
    out = []
    for name, fn in ways.items():
        alone, _ = _timed(fn, args.reps, busy=False)
        with_engine, rate = _timed(fn, args.reps, busy=True)
        out.append({"way": name, "gbps": total / alone / 1e9, "gbps_with_engine_thread": total / with_engine / 1e9,
                    "engine_loops_per_s": rate})
    _, idle_rate = _timed(lambda: time.sleep(0.05), 3, busy=True)
    print(f"{args.blocks} blocks of {args.block_mib:g} MiB ({total / 2**20:.0f} MiB), {os.cpu_count()} CPUs, "
          f"medians of {args.reps}")
    print("| checksums | GB/s | GB/s with a busy Python thread | that thread's loops/s (÷ idle) |")
    print("|---|---|---|---|")
    for r in out:
        print(f"| {r['way']} | {r['gbps']:.1f} | {r['gbps_with_engine_thread']:.1f} | "
              f"{r['engine_loops_per_s'] / 1e6:.1f} M ({r['engine_loops_per_s'] / idle_rate:.2f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "rows": out, "idle_loops_per_s": idle_rate}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
