"""One phase of a round: the same op on every thread's slice of the blocks, timed.

Owns the threads of a phase: the calls are built before the clock starts
(``Call``), each thread makes its own calls in order and times each one,
and the phase's wall time runs from the first thread's start to the last
one's end (``PhaseResult``).  The worker threads only count calls on the
shared ``Progress``; the main thread redraws it while it waits.  Must not
look at what the calls return (``verify`` does, after the clock stopped).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from store_backends import Progress


@dataclasses.dataclass
class Call:
    """One timed call: ``fn(*args)`` on ``num_keys`` blocks from ``first``."""

    fn: Callable[..., object]
    args: tuple
    first: int
    num_keys: int


@dataclasses.dataclass
class PhaseResult:
    wall_s: float
    num_keys: int
    latencies_s: list[float]
    keys_per_call: list[int]
    # (call, what it returned), for verification after the clock stopped
    returns: list[tuple[Call, object]]


def slices(num_blocks: int, num_threads: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal slices of the block indices, one per thread."""
    bounds = [num_blocks * t // num_threads for t in range(num_threads + 1)]
    return [(bounds[t], bounds[t + 1]) for t in range(num_threads)]


def batched_calls(fn: Callable[[int, int], Call], lo: int, hi: int, batch: int) -> list[Call]:
    return [fn(a, min(a + batch, hi)) for a in range(lo, hi, batch)]


def run_phase(per_thread: list[list[Call]], progress: Progress) -> PhaseResult:
    """Run each thread's calls in order; the phase's wall time runs from the
    first thread's start to the last thread's end."""
    per_thread = [calls for calls in per_thread if calls]
    barrier = threading.Barrier(len(per_thread))
    outcome: list[object] = [None] * len(per_thread)
    # Set on Ctrl-C so workers stop after their current call and the main
    # thread can delete what was written without racing them.
    stop = threading.Event()

    def work(index: int, calls: list[Call]) -> None:
        latencies: list[float] = []
        returns: list[tuple[Call, object]] = []
        clock = time.perf_counter
        try:
            barrier.wait()
            start = clock()
            for call in calls:
                if stop.is_set():
                    break
                t0 = clock()
                answer = call.fn(*call.args)
                latencies.append(clock() - t0)
                returns.append((call, answer))
                progress.add()
            outcome[index] = (start, clock(), latencies, returns)
        except BaseException as exc:  # handed to the main thread, which re-raises it
            barrier.abort()
            outcome[index] = exc

    threads = [threading.Thread(target=work, args=(i, calls), name=f"ucm-bench-{i}", daemon=True)
               for i, calls in enumerate(per_thread)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.1)
                progress.draw()
    except KeyboardInterrupt:
        stop.set()
        barrier.abort()
        for thread in threads:
            thread.join()
        raise
    errors = [o for o in outcome if isinstance(o, BaseException)]
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    starts, ends, latencies, keys_per_call, returns = [], [], [], [], []
    for start, end, lat, ret in outcome:  # type: ignore[misc]
        starts.append(start)
        ends.append(end)
        latencies.extend(lat)
        keys_per_call.extend(call.num_keys for call, _ in ret)
        returns.extend(ret)
    return PhaseResult(wall_s=max(ends) - min(starts), num_keys=sum(keys_per_call) if keys_per_call else 0,
                       latencies_s=latencies, keys_per_call=keys_per_call, returns=returns)
