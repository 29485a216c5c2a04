"""Connector statistics: what vLLM's logs and ``/metrics`` show about the
external cache (hit tokens, blocks and bytes moved, time spent, errors).

Counters are summed over an interval and over TP ranks (``aggregate``), then
reported once (``reduce``).  Knows vLLM's ``KVConnectorStats`` shape only.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .counters import COUNTERS, StatsCollector  # noqa: F401  (StatsCollector: re-exported)
from .loadpolicy import REASONS

class UCMStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "UCMStats":
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        for kind in ("load", "save"):
            seconds = self.data.get(f"{kind}_seconds", 0)
            nbytes = self.data.get(f"{'loaded' if kind == 'load' else 'saved'}_bytes", 0)
            out[f"{kind}_gb_per_s"] = round(nbytes / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)


# -- Prometheus ------------------------------------------------------------------

# (counter name on /metrics without "_total", stats key, unit, help text);
# a counter with a "reason" label has {reason: stats key} for its key.
# vLLM's Prometheus client appends "_total" to counters.  docs/metrics.md
# documents each one (a test keeps the two in step).
PROM_COUNTERS = (
    ("vllm:ucm_lookup_tokens", "lookup_tokens", "tokens",
     "Prompt tokens (whole blocks) looked up in the external store."),
    ("vllm:ucm_hit_tokens", "hit_tokens", "tokens",
     "Prompt tokens whose KV the external store supplied instead of a prefill."),
    ("vllm:ucm_loaded_blocks", "loaded_blocks", "blocks",
     "Blocks loaded from the external store into the KV cache (summed over TP ranks)."),
    ("vllm:ucm_loaded_bytes", "loaded_bytes", "bytes",
     "Bytes of KV loaded from the external store (summed over TP ranks)."),
    ("vllm:ucm_load_seconds", "load_seconds", "seconds",
     "Time spent loading blocks: store reads, checks and copies into the cache."),
    ("vllm:ucm_saved_blocks", "saved_blocks", "blocks",
     "Blocks written to the external store (summed over TP ranks)."),
    ("vllm:ucm_saved_bytes", "saved_bytes", "bytes",
     "Bytes of KV written to the external store (summed over TP ranks)."),
    ("vllm:ucm_save_seconds", "save_seconds", "seconds",
     "Time spent saving blocks: copies out of the cache and store writes."),
    ("vllm:ucm_skipped_saves", "skipped_saves", "blocks",
     "Blocks not saved: already stored, the writer's backlog was full, or the store refused them."),
    ("vllm:ucm_load_errors", "load_errors", "blocks",
     "Blocks that failed to load (missing, corrupt or store down) and were recomputed."),
    ("vllm:ucm_store_errors", "store_errors", "operations",
     "Store operations that failed (the engine carried on without them)."),
    ("vllm:ucm_unloaded_hit_tokens", {reason: f"unloaded_hit_tokens_{reason}" for reason in REASONS}, "tokens",
     "Prompt tokens found in the external store but recomputed instead of loaded, by reason: "
     "slow_store, latency (load_policy auto), min_hit_blocks."),
)


def build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues):
    """The connector's own counters on vLLM's ``/metrics`` (what
    ``UCMConnector.build_prom_metrics`` returns)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    class UCMPromMetrics(KVConnectorPromMetrics):
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters: dict[str, dict[int, object]] = {}
            for name, key, _unit, doc in PROM_COUNTERS:
                if isinstance(key, str):
                    counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                    self._counters[key] = create_metric_per_engine(counter, per_engine_labelvalues)
                    continue
                counter = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "reason"])
                for reason, reason_key in key.items():
                    self._counters[reason_key] = {
                        engine: counter.labels(*values, reason)
                        for engine, values in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data, engine_idx: int = 0) -> None:
            for key, per_engine in self._counters.items():
                value = (transfer_stats_data or {}).get(key, 0)
                if value and engine_idx in per_engine:
                    per_engine[engine_idx].inc(value)

    return UCMPromMetrics()
