"""The connector's counters and their thread-safe collector.

Knows nothing of vLLM: the worker and the scheduler count here, and
``metrics.py`` turns what is taken into vLLM's ``KVConnectorStats`` and
Prometheus counters.
"""

from __future__ import annotations

import dataclasses
import threading

from .loadpolicy import REASONS


@dataclasses.dataclass(frozen=True)
class Counter:
    """One counter: the key workers and the scheduler add to, and how it
    shows on vLLM's ``/metrics`` (name without vLLM's ``_total``, unit, help).
    Counters that share a metric tell apart by its ``reason`` label."""

    key: str
    metric: str
    unit: str
    help: str
    reason: str | None = None


_UNLOADED_HELP = ("Prompt tokens found in the external store but recomputed instead of loaded, by reason: "
                  "slow_store, latency (load_policy auto), min_hit_blocks.")

#: The one table of counters: what is counted, and how it is shown.
#: docs/metrics.md documents each metric (a test keeps the two in step).
TABLE: tuple[Counter, ...] = (
    Counter("lookup_tokens", "vllm:ucm_lookup_tokens", "tokens",
            "Prompt tokens (whole blocks) looked up in the external store."),
    Counter("hit_tokens", "vllm:ucm_hit_tokens", "tokens",
            "Prompt tokens scheduled to load from the external store instead of a prefill (a load that then "
            "fails, recomputed, stays counted: see vllm:ucm_load_errors_total)."),
    Counter("loaded_blocks", "vllm:ucm_loaded_blocks", "blocks",
            "Blocks loaded from the external store into the KV cache (summed over TP ranks)."),
    Counter("loaded_bytes", "vllm:ucm_loaded_bytes", "bytes",
            "Bytes of KV loaded from the external store (summed over TP ranks)."),
    Counter("load_seconds", "vllm:ucm_load_seconds", "seconds",
            "Time spent loading blocks: store reads, checks and copies into the cache."),
    Counter("saved_blocks", "vllm:ucm_saved_blocks", "blocks",
            "Blocks written to the external store (summed over TP ranks)."),
    Counter("saved_bytes", "vllm:ucm_saved_bytes", "bytes",
            "Bytes of KV written to the external store (summed over TP ranks)."),
    Counter("save_seconds", "vllm:ucm_save_seconds", "seconds",
            "Time spent saving blocks: copies out of the cache and store writes."),
    Counter("skipped_saves", "vllm:ucm_skipped_saves", "blocks",
            "Blocks not saved: already stored, computed on a failed load, the writer's backlog was full, "
            "the store refused them, or a store lookup or copy before the save failed."),
    Counter("layerwise_saved_blocks", "vllm:ucm_layerwise_saved_blocks", "blocks",
            "Blocks to save that were copied out of the cache layer by layer during the forward pass "
            "(save_layerwise); the others were copied after it."),
    Counter("load_errors", "vllm:ucm_load_errors", "blocks",
            "Blocks that failed to load (missing, corrupt or store down) and were recomputed."),
    Counter("store_errors", "vllm:ucm_store_errors", "operations",
            "Store operations that failed (the engine carried on without them)."),
    Counter("store_pauses", "vllm:ucm_store_pauses", "pauses",
            "Times a store (or a tier of it) stopped answering and was then not asked for a while, "
            "so that each costs one timeout, not one per call."),
    *(Counter(f"unloaded_hit_tokens_{reason}", "vllm:ucm_unloaded_hit_tokens", "tokens", _UNLOADED_HELP,
              reason=reason) for reason in REASONS),
)

#: The keys, in table order.
COUNTERS = tuple(c.key for c in TABLE)


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
