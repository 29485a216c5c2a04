"""``load_policy: auto``: load a stored prefix only as far as loading beats
recomputing it.

The scheduler decides; the workers measure (``measure.py``) and their
measurements reach the scheduler with every step's output.  From them this
module keeps two estimates, both lines ``seconds = fixed + n * per_unit``
made of medians, so that a stray sample does not move them:

* per tier of the store, what a read call costs, ``latency + blocks *
  seconds_per_block``, through the last reads (``fit_line``); a tier is
  judged by what a block costs at the size of the hits that come to it;
* for the engine, what a step costs, ``overhead + tokens *
  seconds_per_token``, through the medians of recent steps of each size
  (``StepCosts``: short steps, a decode or a hit's tail, do not push the
  long ones out).  Recomputing a block costs ``block_size *
  seconds_per_token`` more; the step's overhead is paid anyway.

A request's stored prefix is a run of blocks per tier (the fast tier's
blocks first).  The decision loads the longest prefix of those runs whose
estimated load time is within 1.2x of the time to recompute it, except that
a tier marked slow is never loaded.  What is not loaded is counted by
reason: ``slow_store`` (a tier marked slow, and whatever lies behind it) or
``latency`` (a hit too short to pay for the store's per-call latency).

So that the decision neither lags nor flaps:

* hysteresis: a tier is marked slow when a block, at the size of the hits
  that come to it, loads more than 1.2x slower than it recomputes, and
  cleared only when it loads more than 1.2x faster; each change is logged
  once;
* change: two reads in a row that are at least 2x off the estimate, in the
  same direction and by a margin that matters (half a recompute), replace
  the estimate's history, so a store that slowed down or recovered is
  believed after two reads, and a single stray read (a pause of the host,
  a burst of traffic) changes no decision;
* probes: a request that leaves blocks of a tier unloaded asks the workers
  to read two of them in the background (never into the KV cache, never
  on the request's way), one probe per tier at a time, so a skipped tier is
  still measured and is used again once it is fast.

With no measurement yet (of the engine, or of a tier), it loads, like
``always``.  Knows nothing of vLLM, stores or KV data: blocks, tokens and
seconds only.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
import time
from typing import Callable, Sequence

logger = logging.getLogger("vllm.ucm_connector.loadpolicy")

SLOW_STORE = "slow_store"
LATENCY = "latency"
MIN_HIT_BLOCKS = "min_hit_blocks"
REASONS = (SLOW_STORE, LATENCY, MIN_HIT_BLOCKS)

SKIP_ABOVE = 1.2            # load / recompute per block past which a tier is marked slow
RESUME_BELOW = 1 / 1.2      # ... and under which it is used again
CHANGE_FACTOR = 2.0         # a read this far off the estimate counts toward a change
CHANGE_READS = 2            # ... and this many in a row make one
PROBE_BLOCKS = 2            # blocks a probe reads: little for a slow link to carry
PROBE_TIMEOUT_S = 10.0      # a probe with no answer by then is given up
READ_WINDOW = 8             # recent reads per tier an estimate is made of
STEPS_PER_SIZE = 8          # recent steps of each size (power of two) the prefill estimate is made of
MIN_STEP_TOKENS = 16        # smaller steps say more about overhead than about tokens


@dataclasses.dataclass(frozen=True)
class ReadSample:
    """One store read call as a worker saw it: ``num_blocks`` found (a miss
    costs a round trip but moves no block) in ``seconds``."""

    tier: int
    seconds: float
    num_blocks: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One engine step as a worker saw it: ``num_tokens`` computed in
    ``seconds`` of forward pass (the connector's own load waits excluded)."""

    seconds: float
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class Line:
    """``seconds = fixed + n * per_unit``."""

    fixed: float
    per_unit: float

    def __call__(self, n: float) -> float:
        return self.fixed + n * self.per_unit


def fit_line(samples: Sequence[tuple[float, float]]) -> Line | None:
    """The line that best explains ``(n, seconds)`` samples (the smaller
    median miss), of two: a Theil-Sen line (the median slope over pairs
    whose sizes differ enough to give one, three at least or every pair
    there is, and the median intercept under it), which tells a fixed cost
    from a cost per unit; and the median cost per unit with no fixed part,
    which is exact at the sizes seen and stays sound when the samples mix
    two regimes or are all of one size.  With an even count the median
    leans low (toward loading), so that two samples, one of them stray,
    give the other.  ``None`` without a sample of n > 0."""
    median = statistics.median_low
    per_unit = [s / n for n, s in samples if n > 0]
    if not per_unit:
        return None
    lines = [Line(0.0, median(per_unit))]
    slopes = []
    for i, (n1, s1) in enumerate(samples):
        for n2, s2 in samples[i + 1:]:
            if abs(n2 - n1) >= max(1.0, 0.25 * max(n1, n2)):
                slopes.append((s2 - s1) / (n2 - n1))
    num_pairs = len(samples) * (len(samples) - 1) // 2
    if slopes and len(slopes) >= min(3, num_pairs):
        slope = median(slopes)
        if slope > 0:
            lines.append(Line(max(0.0, median([s - slope * n for n, s in samples])), slope))
    return min(lines, key=lambda line: statistics.median(abs(s - line(n)) for n, s in samples))


class _Window:
    """Recent ``(n, seconds)`` samples and the line through them; two samples
    in a row far off the line (``relevant`` says whether a miss matters)
    replace the history."""

    def __init__(self, size: int) -> None:
        self.samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=size)
        self.line: Line | None = None
        self._off: list[tuple[int, tuple[float, float]]] = []   # (direction, sample)

    def add(self, n: float, seconds: float, relevant: Callable[[float, float], bool] | None = None) -> bool:
        """Add a sample; True when it completed a change (history replaced)."""
        sample = (float(n), float(seconds))
        direction = 0
        if self.line is not None:
            expected = self.line(n)
            if expected > 0 and (relevant is None or relevant(abs(seconds - expected), n)):
                if seconds > CHANGE_FACTOR * expected:
                    direction = 1
                elif seconds * CHANGE_FACTOR < expected:
                    direction = -1
        if direction and all(d == direction for d, _ in self._off):
            self._off.append((direction, sample))
        else:
            self._off = [(direction, sample)] if direction else []
        changed = len(self._off) >= CHANGE_READS
        if changed:
            self.samples.clear()
            self.samples.extend(s for _, s in self._off)
            self._off = []
        else:
            self.samples.append(sample)
        self.line = fit_line(list(self.samples))
        return changed


class StepCosts:
    """Recent steps by size (powers of two of their token counts), the
    last few of each, and the line through each size's median: the cost of
    a token is the slope between sizes, so a step's fixed overhead is not
    counted as compute.  With one size seen, the median cost per token of
    it (overhead included: an upper bound, which leans toward loading)."""

    def __init__(self, per_size: int = STEPS_PER_SIZE) -> None:
        self._sizes: dict[int, collections.deque[tuple[float, float]]] = {}
        self._per_size = per_size
        self.line: Line | None = None

    def add(self, n: int, seconds: float) -> None:
        size = max(0, int(math.log2(n)))
        self._sizes.setdefault(size, collections.deque(maxlen=self._per_size)).append((float(n), float(seconds)))
        points = []
        for samples in self._sizes.values():
            n_mid = statistics.median_low(n for n, _ in samples)
            points.append((n_mid, n_mid * statistics.median_high(s / n for n, s in samples)))
        if len(points) == 1:
            self.line = Line(0.0, points[0][1] / points[0][0])
            return
        slopes = [(s2 - s1) / (n2 - n1) for i, (n1, s1) in enumerate(points) for n2, s2 in points[i + 1:]]
        slope = statistics.median_high(slopes)
        if slope <= 0:
            n_big, s_big = max(points)
            self.line = Line(0.0, s_big / n_big)
            return
        self.line = Line(max(0.0, statistics.median(s - slope * n for n, s in points)), slope)


@dataclasses.dataclass
class TierState:
    """What the scheduler knows of one tier of the store."""

    name: str
    reads: _Window = dataclasses.field(default_factory=lambda: _Window(READ_WINDOW))
    nbytes_per_block: float = 0.0
    slow: bool = False              # marked slow: never loaded while so
    probe_sent_at: float | None = None
    # Blocks that recent requests had stored in this tier: the size a tier
    # is judged at (a split of a read's cost into latency and throughput is
    # surest near the sizes read).
    hit_blocks: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=16))

    def seconds_per_block(self) -> float | None:
        """What a block costs to load, at the size of the hits that come here."""
        line = self.reads.line
        if line is None:
            return None
        if self.hit_blocks:
            n = statistics.median_low(self.hit_blocks)
        else:
            n = statistics.median_low([n for n, _ in self.reads.samples if n > 0] or [1.0])
        return line(max(n, 1)) / max(n, 1)


@dataclasses.dataclass
class Probe:
    """Read blocks ``[first, first + num_blocks)`` of a request's keys from
    ``tier`` in the background, for the timing only."""

    tier: int
    first: int
    num_blocks: int


@dataclasses.dataclass
class LoadDecision:
    """How many of a request's leading blocks to have (its local blocks plus
    those to load), what is left unloaded and why, and the probes to send."""

    num_blocks: int
    unloaded: dict[str, int] = dataclasses.field(default_factory=dict)
    probes: list[Probe] = dataclasses.field(default_factory=list)
    # (tier, blocks) of the stored prefix past the local blocks.
    hits: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class LoadPolicy:
    """The scheduler's estimates and decisions for ``load_policy: auto``."""

    def __init__(self, *, tier_names: Sequence[str], block_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.tiers = [TierState(name) for name in tier_names]
        self.steps = StepCosts()
        self._clock = clock

    # -- measurements -----------------------------------------------------------

    @property
    def recompute_seconds_per_block(self) -> float | None:
        line = self.steps.line
        if line is None or line.per_unit <= 0:
            return None
        return line.per_unit * self.block_size

    def observe(self, reads: Sequence[ReadSample] = (), steps: Sequence[StepSample] = ()) -> None:
        """Fold in what the workers measured in a step, then re-judge each tier."""
        for step in steps:
            if step.num_tokens >= MIN_STEP_TOKENS and step.seconds > 0:
                self.steps.add(step.num_tokens, step.seconds)
        per_block = self.recompute_seconds_per_block

        def relevant(miss: float, n: float) -> bool:
            # Only a miss that could change a decision counts toward a change.
            return per_block is None or miss >= 0.5 * per_block * max(n, 1.0)

        for read in reads:
            if not 0 <= read.tier < len(self.tiers):
                continue
            tier = self.tiers[read.tier]
            tier.probe_sent_at = None
            if read.num_blocks:
                tier.nbytes_per_block = read.nbytes / read.num_blocks
            tier.reads.add(read.num_blocks, read.seconds, relevant)
        if per_block is None:
            return
        for tier in self.tiers:
            self._judge(tier, per_block)

    def _judge(self, tier: TierState, per_block: float) -> None:
        load = tier.seconds_per_block()
        if load is None:
            return
        ratio = load / per_block
        if not tier.slow and ratio > SKIP_ABOVE:
            tier.slow = True
            logger.warning(
                "ucm-connector: load_policy auto: not loading hits from store %s: a block takes %s to load "
                "(%s), %s to recompute; those hits are recomputed until the store is faster again "
                "(counted in vllm:ucm_unloaded_hit_tokens_total{reason=\"slow_store\"})",
                tier.name, _ms(load), self._speed(tier), _ms(per_block))
        elif tier.slow and ratio < RESUME_BELOW:
            tier.slow = False
            logger.info(
                "ucm-connector: load_policy auto: loading hits from store %s again: a block takes %s to load "
                "(%s), %s to recompute", tier.name, _ms(load), self._speed(tier), _ms(per_block))

    @staticmethod
    def _speed(tier: TierState) -> str:
        line = tier.reads.line
        rate = tier.nbytes_per_block / line.per_unit / 1e6 if line.per_unit > 0 else float("inf")
        return f"{rate:.1f} MB/s per worker, {_ms(line.fixed)} per call"

    # -- decisions --------------------------------------------------------------

    def decide(self, first: int, runs: Sequence[tuple[int, int]]) -> LoadDecision:
        """``first``: leading blocks the engine has already (its own prefix
        cache); ``runs``: ``(tier, num_blocks)`` of the stored prefix in
        order, from block 0.  Pure: call ``scheduled`` once the decision is
        acted on."""
        found = sum(n for _, n in runs)
        hits = [(t, hi - max(lo, first)) for t, _, (lo, hi) in _spans(runs) if hi > first]
        per_block = self.recompute_seconds_per_block
        if per_block is None or found <= first:
            return LoadDecision(max(first, found), hits=hits)
        end = first                 # the prefix to have, so far
        blocked: int | None = None  # where a tier marked slow starts
        load_seconds = 0.0
        probes: list[Probe] = []
        lo = 0
        for tier_index, n in runs:
            hi = lo + n
            if hi <= first:
                lo = hi
                continue
            start = max(lo, first)
            tier = self.tiers[tier_index] if 0 <= tier_index < len(self.tiers) else None
            if tier is not None and tier.slow:
                blocked = start
                probes.append(Probe(tier_index, start, min(PROBE_BLOCKS, hi - start)))
                break
            line = tier.reads.line if tier is not None else None
            if line is not None:
                load_seconds += line(hi - start)
            if load_seconds <= SKIP_ABOVE * (hi - first) * per_block:
                end = hi
            lo = hi
        unloaded: dict[str, int] = {}
        if blocked is None:
            blocked = found
        if blocked > end:
            unloaded[LATENCY] = blocked - end
            probe_tier = self._tier_at(runs, end)
            if probe_tier is not None and not any(p.tier == probe_tier for p in probes):
                probes.insert(0, Probe(probe_tier, end, min(PROBE_BLOCKS, blocked - end)))
        if found > blocked:
            unloaded[SLOW_STORE] = found - blocked
        now = self._clock()
        probes = [p for p in probes if self._may_probe(p.tier, now)]
        return LoadDecision(end, unloaded, probes, hits)

    @staticmethod
    def _tier_at(runs: Sequence[tuple[int, int]], block: int) -> int | None:
        lo = 0
        for tier, n in runs:
            if lo <= block < lo + n:
                return tier
            lo += n
        return None

    def _may_probe(self, tier_index: int, now: float) -> bool:
        if not 0 <= tier_index < len(self.tiers):
            return False
        sent = self.tiers[tier_index].probe_sent_at
        return sent is None or now - sent > PROBE_TIMEOUT_S

    def scheduled(self, decision: LoadDecision) -> None:
        """The decision was acted on: its probes are on their way, and its
        hits tell the size a tier is judged at."""
        now = self._clock()
        for probe in decision.probes:
            self.tiers[probe.tier].probe_sent_at = now
        for tier, n in decision.hits:
            if 0 <= tier < len(self.tiers) and n > 0:
                self.tiers[tier].hit_blocks.append(n)


def _spans(runs: Sequence[tuple[int, int]]):
    """``(tier, num_blocks, (first block, end block))`` of each run."""
    lo = 0
    for tier, n in runs:
        yield tier, n, (lo, lo + n)
        lo += n


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
