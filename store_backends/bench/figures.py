"""Throughput and latency of one op on one medium, from the timed phases.

Owns what is computed from the clock: ops/s and GB/s (median and best of
the rounds), latency percentiles per call and per block, and the store/raw
ratio.  Must not time anything itself.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .phases import PhaseResult


def _percentiles_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    if not len(seconds):
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(seconds, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(arr.mean())}


@dataclasses.dataclass
class OpFigures:
    """One op on one medium, over the timed rounds."""

    moves_bytes: bool
    block_nbytes: int
    rounds: list[PhaseResult] = dataclasses.field(default_factory=list)

    def rates(self) -> list[float]:
        return [r.num_keys / r.wall_s for r in self.rounds if r.wall_s > 0]

    def ops_s(self, best: bool = False) -> float | None:
        rates = self.rates()
        if not rates:
            return None
        return float(max(rates) if best else np.median(rates))

    def gb_s(self, best: bool = False) -> float | None:
        rate = self.ops_s(best)
        if rate is None or not self.moves_bytes:
            return None
        return rate * self.block_nbytes / 1e9

    def to_dict(self) -> dict[str, object]:
        latencies = [s for r in self.rounds for s in r.latencies_s]
        keys = [k for r in self.rounds for k in r.keys_per_call]
        per_block = [s / k for s, k in zip(latencies, keys) if k]
        return {
            "gb_s": self.gb_s(), "gb_s_best": self.gb_s(best=True),
            "ops_s": self.ops_s(), "ops_s_best": self.ops_s(best=True),
            "rounds_ops_s": self.rates(),
            "rounds_wall_s": [r.wall_s for r in self.rounds],
            "calls": len(latencies),
            "keys_per_call": (sum(keys) / len(keys)) if keys else None,
            "latency_ms": _percentiles_ms(latencies),
            "latency_per_block_ms": _percentiles_ms(per_block),
        }


def ratio(store: OpFigures, raw: OpFigures | None) -> float | None:
    if raw is None:
        return None
    s, r = store.ops_s(), raw.ops_s()
    return s / r if s and r else None
