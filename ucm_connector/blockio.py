"""What the worker's block reader, loads and saves share.

* ``logger``: the worker side's one logger, under ``vllm.`` so that vLLM's
  log handlers and format apply;
* ``Reporter``: counts a kind of failure every time and logs it once;
* ``BlockIO``: the parts that reading or saving blocks is built from (the
  store, the copy path, a pool of host rows, the namespace digest that
  envelopes are sealed and checked with, the TP rank that keys are for, the
  counters, the outcome log and the reporter);
* ``JobThread``: one thread that runs queued jobs in order (the loader, the
  prober and the save writer each own one), and can be waited on until
  every queued job is done.

This module moves no blocks itself, and must not import vLLM: the worker
side runs where vLLM cannot (a GPU check machine).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from store_backends import KVStore

from .counters import StatsCollector
from .outcomes import OutcomeLog
from .rows import RowPool
from .transfer import BlockTransfer

# Under "vllm." so that vLLM's log handlers and format apply.
logger = logging.getLogger("vllm.ucm_connector.worker")


class Reporter:
    """Counts a kind of failure every time and logs it once."""

    def __init__(self, stats: StatsCollector) -> None:
        self.stats = stats
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, what: str, exc: BaseException) -> None:
        self.stats.add(store_errors=1)
        if self.first(what):
            logger.warning("ucm-connector: %s failed: %s; the engine carries on without those blocks "
                           "(further errors of this kind are counted, not logged)", what, exc)

    def first(self, what: str) -> bool:
        with self._lock:
            if what in self._logged:
                return False
            self._logged.add(what)
            return True


class BlockIO:
    """The parts a ``BlockReader`` or the ``Saves`` moves blocks with."""

    def __init__(self, *, store: KVStore, transfer: BlockTransfer, pool: RowPool, namespace_digest: bytes,
                 tp_rank: int, stats: StatsCollector, events: OutcomeLog, report: Reporter) -> None:
        self.store = store
        self.transfer = transfer
        self.pool = pool
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.stats = stats
        self.events = events
        self.report = report
        self.payload_nbytes = transfer.payload_nbytes


class JobThread:
    """A thread that runs jobs in order until closed."""

    def __init__(self, run: Callable[[object], None], name: str = "ucm-loader",
                 on_start: Callable[[], None] | None = None) -> None:
        self._run = run
        self._on_start = on_start
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._running = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, *jobs: object) -> None:
        with self._cond:
            self._jobs.extend(jobs)
            self._cond.notify_all()

    def _loop(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # noqa: BLE001 - the jobs still run; they report their own failures
                logger.warning("ucm-connector: setting up thread %s failed: %s", self._thread.name, exc)
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running += 1
            self._run(job)
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def idle(self) -> bool:
        """No job queued or running."""
        with self._cond:
            return not self._jobs and not self._running

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._running, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
