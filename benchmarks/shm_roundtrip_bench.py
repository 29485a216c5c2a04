"""What a batch of shm puts and gets pays for asking the server, in one run.

    .venv/bin/python benchmarks/shm_roundtrip_bench.py [--batch 16] [--value-kib 1024] [--rounds 200]

Starts a private shm store (capacity 1 GiB), then times, as p50 over
``--rounds``: a bare request (HELLO), each request of a put, timed inside
``put`` (ALLOC and COMMIT; a put into a reservation sends DECLARE, which is
not answered, then COMMIT), a whole ``put`` of ``--batch`` values of
``--value-kib``, a ``get_into`` of them, and one ``np.copyto`` of the same
number of bytes (what the copies alone cost).  The store is stopped
afterwards.  Every value read back is compared with what was put.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from store_backends import open_store  # noqa: E402
from store_backends.shm import stop_server  # noqa: E402
from store_backends.shm.protocol import Op  # noqa: E402


def _p50_ms(times: list[float]) -> float:
    return float(np.median(times)) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--value-kib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args(argv)
    name = f"rtbench-{uuid.uuid4().hex[:8]}"
    nbytes = args.value_kib * 1024
    rng = np.random.default_rng(1)
    values = [rng.integers(0, 256, nbytes, np.uint8).tobytes() for _ in range(args.batch)]
    store = open_store(f"shm://{name}?capacity=1GiB")
    try:
        by_op: dict[str, list[float]] = {"ALLOC": [], "DECLARE": [], "COMMIT": []}

        def timed(inner, ops):
            def call(op, *a, **k):
                started = time.perf_counter()
                try:
                    return inner(op, *a, **k)
                finally:
                    if Op(op).name in ops:
                        by_op[Op(op).name].append(time.perf_counter() - started)
            return call

        # DECLARE goes out as a bare call (it is not answered), the others as requests.
        store._conn.request = timed(store._conn.request, ("ALLOC", "COMMIT"))
        store._conn.call = timed(store._conn.call, ("DECLARE",))
        hello, puts, gets = [], [], []
        buffers = [bytearray(nbytes) for _ in range(args.batch)]
        for r in range(args.rounds):
            keys = [b"rt-%06d-%04d" % (r, i) for i in range(args.batch)]
            started = time.perf_counter()
            assert store.put(keys, values) == [True] * args.batch
            puts.append(time.perf_counter() - started)
            started = time.perf_counter()
            ok = store.get_into(keys, buffers)
            gets.append(time.perf_counter() - started)
            assert ok == [True] * args.batch and all(bytes(b) == v for b, v in zip(buffers, values))
            started = time.perf_counter()
            store._conn.call(Op.HELLO, deadline=time.monotonic() + 5)
            hello.append(time.perf_counter() - started)
        src = np.frombuffer(b"".join(values), np.uint8)
        dst = np.empty_like(src)
        copies = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - started)
        print(f"{args.batch} values of {args.value_kib} KiB, p50 of {args.rounds} rounds (ms)")
        print("  HELLO %.3f  " % _p50_ms(hello)
              + "  ".join(f"{op} {_p50_ms(t):.3f} (x{len(t)})" for op, t in by_op.items() if t))
        print(f"  put {_p50_ms(puts):.3f}  get_into {_p50_ms(gets):.3f}  one np.copyto of the batch "
              f"{_p50_ms(copies):.3f}")
        extra = store.stats().extra
        print(f"  local gets {extra.get('local_gets', 'n/a')}, puts into a reservation "
              f"{extra.get('reserved_puts', 'n/a')}")
    finally:
        store.close()
        stop_server(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
