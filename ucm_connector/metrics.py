"""Connector statistics: what vLLM's logs and ``/metrics`` show about the
external cache (hit tokens, blocks and bytes moved, time spent, errors).

Counters are summed over an interval and over TP ranks (``aggregate``), then
reported once (``reduce``).  Knows vLLM's ``KVConnectorStats`` shape only.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .counters import COUNTERS, TABLE, StatsCollector  # noqa: F401  (StatsCollector: re-exported)

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

def _prom_counters() -> tuple:
    """``counters.TABLE`` as (metric, key or {reason: key}, unit, help), one
    entry per metric: what ``build_prom_metrics`` registers."""
    out: dict[str, list] = {}
    for c in TABLE:
        if c.reason is None:
            out[c.metric] = [c.metric, c.key, c.unit, c.help]
        else:
            out.setdefault(c.metric, [c.metric, {}, c.unit, c.help])[1][c.reason] = c.key
    return tuple(tuple(v) for v in out.values())


PROM_COUNTERS = _prom_counters()


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
