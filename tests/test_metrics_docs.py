"""docs/metrics.md and the Grafana dashboard name exactly the counters the
connector registers on vLLM's /metrics (ucm_connector.metrics.PROM_COUNTERS)."""

from __future__ import annotations

import json
import os
import re

from ucm_connector.metrics import PROM_COUNTERS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "metrics.md")
DASHBOARD = os.path.join(ROOT, "examples", "grafana", "ucm-connector.json")
EXPOSED = {name + "_total" for name, *_ in PROM_COUNTERS}
VLLM_METRICS = {"vllm:prompt_tokens_total", "vllm:external_prefix_cache_hits_total",
                "vllm:external_prefix_cache_queries_total", "vllm:prompt_tokens_cached_total"}


def _doc_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    with open(DOC, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|$", line.strip())
            if m:
                rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def test_every_counter_is_documented_with_its_unit_and_meaning():
    rows = _doc_rows()
    for name, _key, unit, doc in PROM_COUNTERS:
        assert name + "_total" in rows, f"{name}_total is not in docs/metrics.md"
        assert rows[name + "_total"] == (unit, doc), f"docs/metrics.md row for {name}_total is stale"


def test_docs_name_no_connector_counter_that_does_not_exist():
    with open(DOC, encoding="utf-8") as f:
        named = set(re.findall(r"vllm:ucm_[a-z_]+", f.read()))
    assert named <= EXPOSED, f"docs/metrics.md names unknown counters: {sorted(named - EXPOSED)}"


def test_dashboard_queries_only_existing_counters_and_shows_each():
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    assert exprs and all(panel["targets"] for panel in dash["panels"])
    used = {m for e in exprs for m in re.findall(r"vllm:[a-z_:]+", e)}
    assert used <= EXPOSED | VLLM_METRICS, f"unknown metrics in the dashboard: {sorted(used - EXPOSED - VLLM_METRICS)}"
    missing = {name for name in EXPOSED if name not in used}
    assert not missing, f"counters with no panel: {sorted(missing)}"
    for e in exprs:
        assert e.count("(") == e.count(")"), f"unbalanced query: {e}"


def test_hit_tokens_left_unloaded_are_exported_with_their_reason():
    """One counter, a sample per reason, on top of vLLM's own labels."""
    import functools

    import prometheus_client

    from ucm_connector.metrics import build_prom_metrics

    registry = prometheus_client.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)}

    class Config:
        kv_transfer_config = None

    metrics = build_prom_metrics(Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe({"unloaded_hit_tokens_slow_store": 256, "unloaded_hit_tokens_latency": 16, "hit_tokens": 128})
    metrics.observe({"unloaded_hit_tokens_slow_store": 128})

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    assert value("vllm:ucm_unloaded_hit_tokens_total", reason="slow_store") == 384
    assert value("vllm:ucm_unloaded_hit_tokens_total", reason="latency") == 16
    assert value("vllm:ucm_unloaded_hit_tokens_total", reason="min_hit_blocks") == 0
    assert value("vllm:ucm_hit_tokens_total") == 128
