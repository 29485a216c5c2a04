"""What ``load_policy: auto`` measures in a worker: how fast the store
reads, per tier, and how fast the engine computes.

* ``observe_reads`` times every ``get_into`` of the store the worker reads
  from, or of each tier of a ``TieredStore`` (whose reads go through its
  ``stores`` list): seconds, blocks found, bytes.  Loads and background
  probes alike.
* ``StepClock`` times each step's forward pass, from the moment the step's
  plan is bound to ``wait_for_save``, without the time spent in the
  connector's own load hooks; on CUDA with events on the compute stream,
  read once they have completed (the host never waits for them).

``LoadObserver`` holds both until they are taken, once per step, to travel
to the scheduler (``loadpolicy.py`` decides there).  Knows stores and, on
CUDA, torch events; nothing of vLLM.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Iterator, Sequence

from store_backends import KVStore
from store_backends.base import Buffer, StoreStats

from .loadpolicy import ReadSample, StepSample

MAX_SAMPLES = 256   # kept between two takes; more is a scheduler not listening


class LoadObserver:
    """Samples recorded by the engine's thread, the loader and the prober,
    handed over once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: collections.deque[ReadSample] = collections.deque(maxlen=MAX_SAMPLES)
        self._steps: collections.deque[StepSample] = collections.deque(maxlen=MAX_SAMPLES)

    def read(self, tier: int, seconds: float, num_blocks: int, nbytes: int) -> None:
        with self._lock:
            self._reads.append(ReadSample(tier, seconds, num_blocks, nbytes))

    def step(self, seconds: float, num_tokens: int) -> None:
        with self._lock:
            self._steps.append(StepSample(seconds, num_tokens))

    def take(self) -> tuple[list[ReadSample], list[StepSample]] | None:
        with self._lock:
            if not self._reads and not self._steps:
                return None
            reads, steps = list(self._reads), list(self._steps)
            self._reads.clear()
            self._steps.clear()
        return reads, steps


class TimedReads(KVStore):
    """A store whose ``get_into`` and ``get_into_parts`` calls are timed
    into an observer as reads of ``tier``; everything else is passed
    through."""

    def __init__(self, store: KVStore, tier: int, observer: LoadObserver) -> None:
        self.inner = store
        self.tier = tier
        self.observer = observer
        self.url = store.url

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        return self._timed(self.inner.get_into, keys, [[b] for b in buffers], buffers)

    @property
    def reads_into_parts(self) -> bool:
        return self.inner.reads_into_parts

    def get_into_parts(self, keys, parts, on_value=None) -> list[bool]:
        if on_value is None:
            return self._timed(self.inner.get_into_parts, keys, parts, parts)
        # The caller's work on each value is not the store's time.
        spent = [0.0]

        def timed_on_value(i: int) -> None:
            t0 = time.perf_counter()
            try:
                on_value(i)
            finally:
                spent[0] += time.perf_counter() - t0

        return self._timed(lambda k, p: self.inner.get_into_parts(k, p, timed_on_value), keys, parts, parts,
                           spent)

    def _timed(self, read, keys, parts, arg, spent: list[float] | None = None) -> list[bool]:
        """``read(keys, arg)``, told to the observer as one read of the
        found values' bytes (``parts[i]`` hold value i), less the seconds
        ``spent`` in the caller's callbacks."""
        t0 = time.perf_counter()
        found = read(keys, arg)
        seconds = time.perf_counter() - t0 - (spent[0] if spent else 0.0)
        nbytes = sum(memoryview(p).nbytes for ps, ok in zip(parts, found) if ok for p in ps)
        self.observer.read(self.tier, seconds, sum(1 for ok in found if ok), nbytes)
        return found

    def put(self, keys, values):
        return self.inner.put(keys, values)

    @property
    def writes_from_parts(self) -> bool:
        return self.inner.writes_from_parts

    def put_parts(self, keys, parts, before_value=None) -> list[bool]:
        return self.inner.put_parts(keys, parts, before_value)

    def get(self, keys):
        return self.inner.get(keys)

    def contains(self, keys):
        return self.inner.contains(keys)

    def prefix_len(self, keys) -> int:
        return self.inner.prefix_len(keys)

    def delete(self, keys) -> None:
        self.inner.delete(keys)

    def stats(self) -> StoreStats:
        return self.inner.stats()

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        return self.inner.iter_keys(batch)

    def peek(self, keys, nbytes=None):
        return self.inner.peek(keys, nbytes)

    def last_used(self, keys):
        return self.inner.last_used(keys)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        # flush() and whatever else a backend offers beyond the interface.
        return getattr(self.inner, name)


def tiers_of(store: KVStore) -> list[KVStore]:
    """The tiers of a ``TieredStore`` (fastest first), or the store itself."""
    tiers = getattr(store, "stores", None)
    return list(tiers) if isinstance(tiers, list) and tiers else [store]


def observe_reads(store: KVStore, observer: LoadObserver) -> KVStore:
    """The store to read through so that every read is timed per tier: the
    store itself, its tiers wrapped in place, when it is a tier; else a
    timed wrapper."""
    tiers = getattr(store, "stores", None)
    if isinstance(tiers, list) and tiers:
        for i, tier in enumerate(tiers):
            if not isinstance(tier, TimedReads):
                tiers[i] = TimedReads(tier, i, observer)
        return store
    return store if isinstance(store, TimedReads) else TimedReads(store, 0, observer)


class StepClock:
    """Times each step's forward pass.  On the CPU, wall time from ``begin``
    to ``end`` less the time inside ``excluded()`` blocks (the connector's
    load hooks).  On CUDA, the device time between two events recorded on
    the compute stream: from ``begin`` (or, in a step whose loads come
    first, from the end of those loads) to ``end``; a pair is read once
    both events have completed, never waited for."""

    def __init__(self, observer: LoadObserver, on_cuda: bool = False) -> None:
        self.observer = observer
        self.on_cuda = on_cuda
        self._num_tokens = 0
        self._t0: float | None = None
        self._excluded = 0.0
        self._start_event = None
        self._pending: collections.deque = collections.deque()

    def begin(self, num_tokens: int, loads_first: bool = False) -> None:
        self._num_tokens = num_tokens
        self._excluded = 0.0
        self._t0 = time.perf_counter() if num_tokens > 0 else None
        self._start_event = None
        if self.on_cuda and num_tokens > 0 and not loads_first:
            self._start_event = self._record()

    def loads_done(self) -> None:
        """A step's loads that come before its forward pass are issued."""
        if self.on_cuda and self._t0 is not None and self._start_event is None:
            self._start_event = self._record()

    @contextlib.contextmanager
    def excluded(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - t0

    def end(self) -> None:
        if self._t0 is None:
            return
        if self.on_cuda:
            if self._start_event is not None:
                self._pending.append((self._start_event, self._record(), self._num_tokens))
            self._collect()
        else:
            seconds = time.perf_counter() - self._t0 - self._excluded
            if seconds > 0:
                self.observer.step(seconds, self._num_tokens)
        self._t0 = None

    def _record(self):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream())
        return event

    def _collect(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, stop, num_tokens = self._pending.popleft()
            self.observer.step(start.elapsed_time(stop) / 1e3, num_tokens)
        while len(self._pending) > MAX_SAMPLES:
            self._pending.popleft()
