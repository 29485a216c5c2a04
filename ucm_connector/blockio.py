"""What the worker's block reader, loads and saves share.

* ``logger``: the worker side's one logger, under ``vllm.`` so that vLLM's
  log handlers and format apply;
* ``Reporter``: counts a kind of failure every time and logs it once;
* ``JobThread``: one thread that runs queued jobs in order (the loader and
  the prober each own one).

This module moves no blocks itself, and must not import vLLM: the worker
side runs where vLLM cannot (a GPU check machine).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from .counters import StatsCollector

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


class JobThread:
    """A thread that runs jobs in order until closed."""

    def __init__(self, run: Callable[[object], None]) -> None:
        self._run = run
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ucm-loader", daemon=True)
        self._thread.start()

    def put(self, *jobs: object) -> None:
        with self._cond:
            self._jobs.extend(jobs)
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            self._run(job)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
