"""Payload checksums (the envelope's xxh3_64) of a batch of blocks, on
several threads.

python-xxhash releases the GIL while it hashes a large input (a payload of
a MiB or more: two threads hash two such payloads in the time one takes;
small inputs stay under the GIL), so a batch of payloads split over a few
threads of a shared pool is checksummed at several cores' rate.  That
matters where one core's checksums bound a transfer: the save writer
sealing rows after a DMA on CUDA, and loads checking rows before they are
copied into the pages (one core of the H100 machine hashes 7 GB/s,
benchmarks/RESULTS.md).

Small batches, small payloads, or a machine with one core stay on the
calling thread: there a thread hop costs more than it saves.  This module
knows bytes only (no blocks, no stores).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Sequence

import xxhash

#: Batches below this many bytes are checksummed on the calling thread.
PARALLEL_MIN_NBYTES = 8 << 20

#: Payloads smaller than this are hashed under the GIL (python-xxhash
#: releases it only for large inputs): no threads for them.
PARALLEL_MIN_BUFFER_NBYTES = 512 << 10

#: Threads that share a batch (the calling thread is one of them).
THREADS = max(1, min(8, os.cpu_count() or 1))

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_all(buffers: Sequence) -> list[int]:
    return [xxhash.xxh3_64_intdigest(b) for b in buffers]


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, THREADS - 1),
                                                          thread_name_prefix="ucm-checksum")
        return _pool


def checksums(buffers: Sequence) -> list[int]:
    """``xxhash.xxh3_64_intdigest`` of each buffer (any contiguous buffer),
    in order; a large batch of large buffers is split over threads."""
    sizes = [memoryview(b).nbytes for b in buffers]
    total = sum(sizes)
    parts = min(THREADS, len(buffers))
    if parts < 2 or total < PARALLEL_MIN_NBYTES or min(sizes) < PARALLEL_MIN_BUFFER_NBYTES:
        return _hash_all(buffers)
    # Consecutive shares of about equal bytes; the calling thread takes the last.
    bounds, acc, share_nbytes = [0], 0, total / parts
    for i, n in enumerate(sizes):
        acc += n
        if acc >= share_nbytes * len(bounds) and len(bounds) < parts:
            bounds.append(i + 1)
    bounds.append(len(buffers))
    shares = [buffers[lo:hi] for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    pool = _executor()
    futures = [pool.submit(_hash_all, share) for share in shares[:-1]]
    last = _hash_all(shares[-1])
    return [digest for future in futures for digest in future.result()] + last
