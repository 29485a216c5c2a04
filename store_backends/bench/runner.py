"""The benchmark itself: rounds of phases on the store and the raw medium, and their report.

Owns ``BenchConfig`` (what one run measures), ``Bench`` (each round puts
fresh keys, reads them back, asks for them and deletes them, store and raw
alternating which goes first; warm-up rounds untimed) and the report of a
run: the figures, the verification, the store's stats and the host, as the
dict that ``--json`` writes.  Must not print (``output`` does) or open
stores (``command`` opens them).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform

import numpy as np

from store_backends import KVStore, Progress, mask_password

from .figures import OpFigures, ratio
from .parsing import ALL_OPS
from .phases import Call, batched_calls, run_phase, slices
from .raw import RawMedium
from .verify import Verifier

# prefix_len asks about the whole key list in one call; one call per round
# would give too few samples for a percentile, so each round makes several.
PREFIX_LEN_CALLS_PER_ROUND = 5


@dataclasses.dataclass
class BenchConfig:
    urls: list[str]
    block_nbytes: int
    num_blocks: int
    num_threads: int
    batch: int
    ops: list[str]
    repeat: int
    warmup: int
    seed: int
    raw: bool
    keep: bool


class Bench:
    def __init__(self, cfg: BenchConfig, store: KVStore, raw: RawMedium | None, raw_note: str,
                 values: np.ndarray, dest: np.ndarray, run_id: str, progress: Progress) -> None:
        self.cfg = cfg
        self.store = store
        self.raw = raw
        self.raw_note = raw_note
        self.values = values
        self.dest = dest
        self.run_id = run_id
        self.progress = progress
        self.value_views = [memoryview(row) for row in values]
        self.dest_views = [memoryview(row) for row in dest]
        self.slices = slices(cfg.num_blocks, cfg.num_threads)
        self.verifier = Verifier()
        self.store_figures = {op: OpFigures(op in ("put", "get"), cfg.block_nbytes) for op in cfg.ops}
        self.raw_figures = ({op: OpFigures(op in ("put", "get"), cfg.block_nbytes) for op in cfg.ops
                             if raw.has_lookup or op in ("put", "get")} if raw is not None else {})
        self.key_prefix = f"ucm-bench:{run_id}:".encode()
        self.live_keys: list[bytes] = []

    # -- calls per thread, built before the clock starts

    def _store_calls(self, op: str, keys: list[bytes]) -> list[list[Call]]:
        store, batch, views, bufs = self.store, self.cfg.batch, self.value_views, self.dest_views
        if op == "prefix_len":
            return [[Call(store.prefix_len, (keys,), 0, len(keys))] * PREFIX_LEN_CALLS_PER_ROUND]
        make = {
            "put": lambda a, b: Call(store.put, (keys[a:b], views[a:b]), a, b - a),
            "get": lambda a, b: Call(store.get_into, (keys[a:b], bufs[a:b]), a, b - a),
            "contains": lambda a, b: Call(store.contains, (keys[a:b],), a, b - a),
        }[op]
        return [batched_calls(make, lo, hi, batch) for lo, hi in self.slices]

    def _raw_calls(self, op: str) -> list[list[Call]]:
        raw, batch, n = self.raw, self.cfg.batch, self.cfg.num_blocks
        assert raw is not None
        if op == "prefix_len":
            return [[Call(raw.prefix_len, (0, n), 0, n)] * PREFIX_LEN_CALLS_PER_ROUND]
        fn = {"put": raw.put, "get": raw.get, "contains": raw.contains}[op]
        return [batched_calls(lambda a, b: Call(fn, (a, b), a, b - a), lo, hi, batch) for lo, hi in self.slices]

    def calls_per_round(self) -> int:
        def count(op: str) -> int:
            if op == "prefix_len":
                return PREFIX_LEN_CALLS_PER_ROUND
            return sum(-(-(hi - lo) // self.cfg.batch) for lo, hi in self.slices)

        store_ops = set(self.cfg.ops) | {"put"}
        total = sum(count(op) for op in store_ops)
        if self.raw is not None:
            total += sum(count(op) for op in set(self.raw_figures) | {"put"})
        return total

    # -- one round

    def _store_phase(self, op: str, keys: list[bytes], label: str, timed: bool) -> None:
        self.progress.label = f"{op} store, round {label}"
        if op == "get":
            self.dest.fill(0)  # a store that "hits" without copying must not pass on stale bytes
        result = run_phase(self._store_calls(op, keys), self.progress)
        check = {"put": self.verifier.check_put, "contains": self.verifier.check_contains,
                 "prefix_len": self.verifier.check_prefix_len}
        if op == "get":
            self.verifier.check_get(result, label, keys, self.values, self.dest)
        else:
            check[op](result, label, keys)
        if timed and op in self.store_figures:
            self.store_figures[op].rounds.append(result)

    def _raw_phase(self, op: str, label: str, timed: bool) -> None:
        self.progress.label = f"{op} raw, round {label}"
        if op == "get":
            self.dest.fill(0)  # the same state of the buffers as the store's get had
        result = run_phase(self._raw_calls(op), self.progress)
        if timed and op in self.raw_figures:
            self.raw_figures[op].rounds.append(result)

    def run_round(self, index: int, label: str, timed: bool) -> None:
        # One length for every key of a round, like the connector's content addresses.
        keys = [self.key_prefix + f"{label}:{i:010d}".encode() for i in range(self.cfg.num_blocks)]
        self.live_keys = keys
        if self.raw is not None:
            self.raw.start_round(label)
        store_ops = [op for op in ALL_OPS if op in self.cfg.ops or op == "put"]
        # Like the store, the raw medium is always written first: its lookups
        # must find the blocks, or they would time misses.
        raw_ops = [op for op in ALL_OPS if op in self.raw_figures or (op == "put" and self.raw_figures)]
        raw_first = index % 2 == 1
        for op in ALL_OPS:
            phases = []
            if op in store_ops:
                phases.append(lambda op=op: self._store_phase(op, keys, label, timed))
            if op in raw_ops:
                phases.append(lambda op=op: self._raw_phase(op, label, timed))
            for phase in (reversed(phases) if raw_first else phases):
                phase()
        self.progress.label = f"cleanup, round {label}"
        self.progress.draw()
        last = index == self.cfg.warmup + self.cfg.repeat - 1
        if not (self.cfg.keep and last):
            self.store.delete(keys)
            self.live_keys = []
        if self.raw is not None:
            self.raw.end_round()

    def run(self) -> None:
        rounds = [("warm-up" if self.cfg.warmup == 1 else f"warm-up{w + 1}", False) for w in range(self.cfg.warmup)]
        rounds += [(str(r + 1), True) for r in range(self.cfg.repeat)]
        self.progress.total = max(self.calls_per_round() * len(rounds), 1)
        for index, (label, timed) in enumerate(rounds):
            self.run_round(index, label, timed)

    def cleanup(self) -> None:
        if self.live_keys and not self.cfg.keep:
            try:
                self.store.delete(self.live_keys)
            except Exception:
                pass
            self.live_keys = []
        if self.raw is not None:
            try:
                self.raw.close()
            except Exception:
                pass

    # -- report

    def report(self) -> dict[str, object]:
        cfg = self.cfg
        ops: dict[str, object] = {}
        for op in cfg.ops:
            store = self.store_figures[op]
            raw = self.raw_figures.get(op)
            ops[op] = {
                "store": store.to_dict(),
                "raw": raw.to_dict() if raw is not None else None,
                "ratio": ratio(store, raw),
            }
        try:
            stats = self.store.stats().to_dict()
            # A store is meant to mask its URL, but a JSON file gets shared:
            # do not rely on it.
            if isinstance(stats.get("url"), str):
                stats["url"] = mask_password(stats["url"])
        except Exception as exc:
            stats = {"error": str(exc)}
        masked = [mask_password(u) for u in cfg.urls]
        return {
            "tool": "ucm-bench",
            "format": 1,
            "store": masked[0] if len(masked) == 1 else masked,
            "block_nbytes": cfg.block_nbytes,
            "block_kib": cfg.block_nbytes // 1024,
            "blocks": cfg.num_blocks,
            "threads": cfg.num_threads,
            "batch": cfg.batch,
            "repeat": cfg.repeat,
            "warmup": cfg.warmup,
            "seed": cfg.seed,
            "prefix_len_calls_per_round": PREFIX_LEN_CALLS_PER_ROUND,
            "timing": (f"throughput: median of {cfg.repeat} timed round(s) after {cfg.warmup} warm-up round(s), "
                       "best in *_best; latency: percentiles over every call of the timed rounds, per call "
                       "(latency_ms) and per call divided by its keys (latency_per_block_ms); GB = 1e9 bytes"),
            "raw_medium": self.raw.name if self.raw is not None else None,
            "raw_description": self.raw.description if self.raw is not None else self.raw_note,
            "verified": self.verifier.ok,
            "checked": self._checked(),
            "failures": self.verifier.failures,
            "kept_key_prefix": self.key_prefix.decode() if cfg.keep else None,
            "ops": ops,
            "store_stats": stats,
            "host": _host_info(),
        }

    def _checked(self) -> list[str]:
        checked = ["put answers"]
        if "get" in self.cfg.ops:
            checked.append("get bytes equal to put")
        if "contains" in self.cfg.ops:
            checked.append("contains answers")
        if "prefix_len" in self.cfg.ops:
            checked.append("prefix_len answers")
        return checked


def _host_info() -> dict[str, object]:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
