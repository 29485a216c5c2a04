"""load_policy auto, the decision alone (ucm_connector/loadpolicy.py): fed
measurements, it loads what is worth loading, says why it leaves the rest,
follows a store that slows down or recovers, and does not flap on a stray
measurement.  No store, no engine, no clock: every figure is given."""

from __future__ import annotations

import logging

import pytest

from ucm_connector.loadpolicy import (
    LATENCY,
    PROBE_TIMEOUT_S,
    SLOW_STORE,
    LoadPolicy,
    ReadSample,
    StepSample,
    fit_line,
)

BS = 16
RC = 0.010                     # seconds to recompute one block (16 tokens)
PER_TOKEN = RC / BS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(tiers=("redis://slow",), clock=None) -> LoadPolicy:
    return LoadPolicy(tier_names=list(tiers), block_size=BS, clock=clock or Clock())


def measured(p: LoadPolicy, *, per_block: float, latency: float = 0.0, tier: int = 0, sizes=(4, 10, 16, 6)) -> None:
    """The engine computes RC per block (plus 5 ms a step); the tier reads
    ``latency + n * per_block``."""
    p.observe(steps=[StepSample(0.005 + n * PER_TOKEN, n) for n in (32, 64, 128, 256)])
    p.observe(reads=[ReadSample(tier, latency + n * per_block, n, n * 1000) for n in sizes])


def read(p: LoadPolicy, n: int, per_block: float, tier: int = 0, latency: float = 0.0) -> None:
    p.observe(reads=[ReadSample(tier, latency + n * per_block, n, n * 1000)])


# -- the estimates --------------------------------------------------------------------


def test_a_line_through_reads_separates_latency_from_throughput():
    line = fit_line([(n, 0.003 + n * 0.0005) for n in (1, 4, 10, 16, 2)])
    assert line.fixed == pytest.approx(0.003)
    assert line.per_unit == pytest.approx(0.0005)


def test_one_wild_read_does_not_move_the_line():
    samples = [(n, 0.003 + n * 0.0005) for n in (1, 4, 10, 16, 2, 8)] + [(10, 5.0)]
    line = fit_line(samples)
    assert line.per_unit == pytest.approx(0.0005, rel=0.3)


def test_reads_all_of_one_size_give_the_cost_per_block():
    line = fit_line([(10, 0.02), (10, 0.021), (10, 0.019)])
    assert line.fixed == 0 and line.per_unit == pytest.approx(0.002)


def test_the_recompute_estimate_is_the_marginal_cost_of_a_token():
    p = policy()
    p.observe(steps=[StepSample(0.005 + n * PER_TOKEN, n) for n in (20, 40, 128, 256, 300)])
    assert p.recompute_seconds_per_block == pytest.approx(RC)


def test_many_short_steps_do_not_push_out_what_long_ones_said():
    """A prefill, then hit after hit computing only a tail: the cost of a
    token stays the slope between the two, not a tail step's cost per token
    (mostly the step's overhead)."""
    p = policy()
    p.observe(steps=[StepSample(0.100 + 1000 * PER_TOKEN, 1000)])
    p.observe(steps=[StepSample(0.100 + 104 * PER_TOKEN, 104) for _ in range(50)])
    assert p.recompute_seconds_per_block == pytest.approx(RC)


# -- with nothing measured, it loads -------------------------------------------------------


def test_with_no_measurement_everything_stored_is_loaded():
    p = policy()
    assert p.decide(0, [(0, 10)]).num_blocks == 10
    p.observe(reads=[ReadSample(0, 100.0, 10, 10_000)])       # a slow store, but no engine figure yet
    assert p.decide(0, [(0, 10)]).num_blocks == 10


def test_a_tier_not_measured_yet_is_loaded():
    p = policy(tiers=("shm://a", "disk:///b"))
    measured(p, per_block=RC / 10, tier=0)
    decision = p.decide(0, [(0, 4), (1, 6)])
    assert decision.num_blocks == 10 and not decision.unloaded


# -- fast and slow stores -----------------------------------------------------------------


def test_a_fast_store_is_loaded_in_full():
    p = policy()
    measured(p, per_block=RC / 20)
    decision = p.decide(0, [(0, 12)])
    assert decision.num_blocks == 12 and not decision.unloaded and not decision.probes


def test_a_store_far_slower_than_recomputing_is_not_loaded_and_is_probed(caplog):
    p = policy()
    with caplog.at_level(logging.INFO, logger="vllm.ucm_connector"):
        measured(p, per_block=RC * 100)
    decision = p.decide(2, [(0, 12)])          # 2 blocks in the engine's own cache
    assert decision.num_blocks == 2
    assert decision.unloaded == {SLOW_STORE: 10}
    assert [(pr.tier, pr.first, pr.num_blocks) for pr in decision.probes] == [(0, 2, 2)]
    lines = [r.getMessage() for r in caplog.records if "load_policy auto" in r.getMessage()]
    assert len(lines) == 1 and "not loading hits from store redis://slow" in lines[0]


def test_a_store_just_slower_than_recomputing_is_skipped():
    p = policy()
    measured(p, per_block=RC * 1.5)
    assert p.decide(0, [(0, 12)]).num_blocks == 0


def test_a_high_latency_store_loads_long_hits_and_leaves_short_ones():
    p = policy()
    for _ in range(5):                              # the hits that come in are long
        p.scheduled(p.decide(0, [(0, 20)]))
    measured(p, per_block=RC / 10, latency=RC * 5, sizes=(1, 4, 10, 16, 2))
    assert not p.tiers[0].slow, "at the size of its hits, the store loads faster than recomputing"
    short = p.decide(0, [(0, 3)])
    assert short.num_blocks == 0 and short.unloaded == {LATENCY: 3}
    assert short.probes, "a tier left for its latency is still probed"
    assert p.decide(0, [(0, 20)]).num_blocks == 20


def test_a_store_judged_at_the_size_of_its_hits():
    """The same store, whose reads cost 5 recomputed blocks of latency and a
    tenth of one per block: slow for hits of 3 blocks, fast for hits of 30."""
    judged = {}
    for size in (3, 30):
        p = policy()
        for _ in range(5):
            p.scheduled(p.decide(0, [(0, size)]))
        measured(p, per_block=RC / 10, latency=RC * 5, sizes=(1, 4, 10, 16, 2))
        judged[size] = p.tiers[0].slow
    assert judged == {3: True, 30: False}


def test_a_fast_tier_is_loaded_and_a_slow_one_behind_it_left():
    p = policy(tiers=("shm://fast", "redis://slow"))
    measured(p, per_block=RC / 20, tier=0)
    p.observe(reads=[ReadSample(1, n * RC * 50, n, n * 1000) for n in (4, 10, 16, 6)])
    decision = p.decide(0, [(0, 5), (1, 7)])
    assert decision.num_blocks == 5
    assert decision.unloaded == {SLOW_STORE: 7}
    assert [(pr.tier, pr.first) for pr in decision.probes] == [(1, 5)]


def test_a_slow_tier_in_front_hides_what_lies_behind_it():
    p = policy(tiers=("redis://slow", "shm://fast"))
    measured(p, per_block=RC * 50, tier=0)
    measured(p, per_block=RC / 20, tier=1)
    decision = p.decide(0, [(0, 3), (1, 7)])
    assert decision.num_blocks == 0 and decision.unloaded == {SLOW_STORE: 10}


# -- changes, hysteresis, noise ------------------------------------------------------------


def test_one_stray_slow_read_changes_no_decision(caplog):
    p = policy()
    measured(p, per_block=RC / 10)
    with caplog.at_level(logging.INFO, logger="vllm.ucm_connector"):
        read(p, 10, RC * 100)                       # a pause of the host, once
        held = p.decide(0, [(0, 10)])
        read(p, 10, RC / 10)
        read(p, 10, RC * 100)                       # and once more, not in a row
    assert held.num_blocks == 10 and not held.unloaded
    assert not p.tiers[0].slow
    assert p.decide(0, [(0, 10)]).num_blocks == 10
    assert not [r for r in caplog.records if "load_policy auto" in r.getMessage()]


def test_a_stray_read_after_the_first_changes_no_decision():
    p = policy()
    p.observe(steps=[StepSample(0.005 + n * PER_TOKEN, n) for n in (32, 64, 128, 256)])
    read(p, 10, RC / 10)
    read(p, 10, RC * 100)
    assert not p.tiers[0].slow and p.decide(0, [(0, 10)]).num_blocks == 10


def test_two_slow_reads_in_a_row_mark_the_tier_slow():
    p = policy()
    measured(p, per_block=RC / 10)
    read(p, 10, RC * 100)
    read(p, 2, RC * 100)
    assert p.tiers[0].slow
    assert p.decide(0, [(0, 10)]).num_blocks == 0


def test_slow_reads_that_still_beat_recomputing_change_nothing():
    p = policy()
    measured(p, per_block=RC / 100)
    for _ in range(5):
        read(p, 10, RC / 30)                        # 3x slower than before, still 30x faster than recompute
    assert not p.tiers[0].slow
    assert p.decide(0, [(0, 10)]).num_blocks == 10


def test_a_recovered_store_is_used_again_after_two_fast_probes(caplog):
    p = policy()
    measured(p, per_block=RC * 100)
    assert p.tiers[0].slow
    with caplog.at_level(logging.INFO, logger="vllm.ucm_connector"):
        read(p, 2, RC / 10)
        assert p.tiers[0].slow, "one fast probe is not enough"
        read(p, 2, RC / 10)
    assert not p.tiers[0].slow
    assert p.decide(0, [(0, 10)]).num_blocks == 10
    assert any("loading hits from store redis://slow again" in r.getMessage() for r in caplog.records)


def test_near_break_even_the_state_holds_either_way():
    slow = policy()
    measured(slow, per_block=RC * 2)
    assert slow.tiers[0].slow
    for _ in range(10):
        read(slow, 10, RC * 1.05)                   # just slower than recomputing...
        read(slow, 10, RC * 0.95)                   # ...and just faster
    assert slow.tiers[0].slow

    fast = policy()
    measured(fast, per_block=RC / 2)
    for _ in range(10):
        read(fast, 10, RC * 1.05)
        read(fast, 10, RC * 0.95)
    assert not fast.tiers[0].slow


def test_a_slower_engine_makes_a_store_worth_loading_again():
    p = policy()
    measured(p, per_block=RC * 2)
    assert p.tiers[0].slow
    # The engine now computes 10x slower (a bigger batch, a busier host).
    p.observe(steps=[StepSample(0.005 + n * PER_TOKEN * 10, n) for n in (32, 64, 128, 256) * 4])
    assert not p.tiers[0].slow


# -- probes --------------------------------------------------------------------------------


def test_one_probe_per_tier_at_a_time():
    clock = Clock()
    p = policy(clock=clock)
    measured(p, per_block=RC * 100)
    first = p.decide(0, [(0, 10)])
    p.scheduled(first)
    assert first.probes
    assert not p.decide(0, [(0, 10)]).probes, "a probe is on its way"
    clock.now += PROBE_TIMEOUT_S + 1
    assert p.decide(0, [(0, 10)]).probes, "a probe never answered is given up"
    p.scheduled(p.decide(0, [(0, 10)]))
    read(p, 2, RC * 100)                            # the answer
    assert p.decide(0, [(0, 10)]).probes


def test_decide_is_pure():
    p = policy()
    measured(p, per_block=RC * 100)
    assert p.decide(0, [(0, 10)]) == p.decide(0, [(0, 10)])
