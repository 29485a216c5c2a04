"""The connector's counters and their thread-safe collector.

Knows nothing of vLLM: the worker and the scheduler count here, and
``metrics.py`` turns what is taken into vLLM's ``KVConnectorStats`` and
Prometheus counters.
"""

from __future__ import annotations

import threading

COUNTERS = (
    "lookup_tokens",      # prompt tokens looked up in the store (scheduler)
    "hit_tokens",         # tokens the store supplied (scheduler)
    "loaded_blocks", "loaded_bytes", "load_seconds",
    "saved_blocks", "saved_bytes", "save_seconds",
    "skipped_saves",      # already stored, or the writer's backlog was full
    "load_errors",        # blocks that failed to load (missing, corrupt, store down)
    "store_errors",       # store calls that failed
    # Stored prompt tokens not loaded, by reason (scheduler; loadpolicy.REASONS).
    "unloaded_hit_tokens_slow_store",   # a tier load_policy auto found slower than recomputing
    "unloaded_hit_tokens_latency",      # too short a hit to pay for the store's call latency
    "unloaded_hit_tokens_min_hit_blocks",   # shorter than min_hit_blocks
)



class StatsCollector:
    """Thread-safe counters, taken (and zeroed) once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = {name: 0 for name in COUNTERS}
        self._totals = {name: 0 for name in COUNTERS}

    def add(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                self._data[name] += value
                self._totals[name] += value

    def take(self) -> dict[str, float] | None:
        """The counts since the last take (None when all are zero)."""
        with self._lock:
            if not any(self._data.values()):
                return None
            data, self._data = self._data, {name: 0 for name in COUNTERS}
        return data

    def totals(self) -> dict[str, float]:
        """Counts since start (for tests and the demo)."""
        with self._lock:
            return dict(self._totals)
