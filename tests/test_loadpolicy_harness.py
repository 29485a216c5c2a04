"""load_policy under vLLM's real scheduler (ucm_testing/kvharness.py) against a real
slow store: a private redis-server behind a bandwidth-limiting TCP proxy
(tests/throttle_proxy.py) whose rate the test sets and lifts.  The fake
model sleeps per token it computes, so recomputing has a known price, and
the store is throttled far (40x) below break-even, so that every decision
asserted here has a wide margin over the machine's noise.  Outputs always
equal the reference."""

from __future__ import annotations

import time
import uuid

import pytest

from ucm_testing.kvharness import Harness, reference_generate
from throttle_proxy import ThrottleProxy

BS = 16
WIDTH = 1024                  # 16 tokens x 1024 x 8 bytes x 2 layers: 256 KiB a block
SECONDS_PER_TOKEN = 0.0005    # the fake prefill: 8 ms a block
BELOW_BREAK_EVEN = 40


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed * 13) % 500 + 3 for i in range(n_tokens)]


@pytest.fixture
def proxy(redis_server):
    p = ThrottleProxy(("127.0.0.1", redis_server.port)).start()
    yield p
    p.close()


@pytest.fixture
def harnesses():
    made: list[Harness] = []

    def make(store, **kwargs) -> Harness:
        kwargs = {"kv_width": WIDTH, "seconds_per_token": SECONDS_PER_TOKEN, "prefix_caching": False,
                  "check_every_step": False, **kwargs}
        h = Harness(store=store, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def urls(redis_server, proxy) -> tuple[str, str]:
    """The same Redis namespace, straight and through the proxy."""
    ns = "lp" + uuid.uuid4().hex[:8]
    return (redis_server.url + f"?namespace={ns}",
            f"redis://127.0.0.1:{proxy.port}/0?namespace={ns}&timeout=60")


def run(h: Harness, tokens: list[int]) -> tuple[int, float]:
    """One request; the blocks it loaded and its wall time.  Its output must
    equal the reference."""
    before = h.counters()["loaded_blocks"]
    t0 = time.perf_counter()
    req = h.add(tokens, 2)
    h.run()
    seconds = time.perf_counter() - t0
    assert h.outputs[req] == reference_generate(tokens, 2, h.num_layers), "output differs from the reference"
    return h.counters()["loaded_blocks"] - before, seconds


def unloaded(h: Harness, reason: str) -> int:
    return h.ucm_scheduler.stats.totals()[f"unloaded_hit_tokens_{reason}"]


def policy(h: Harness):
    return h.ucm_scheduler._scheduler.policy


def throttle_below_break_even(h: Harness, proxy: ThrottleProxy) -> None:
    """Throttle the link to BELOW_BREAK_EVEN times slower than the engine
    recomputes, as the connector itself measured the engine."""
    per_block = policy(h).recompute_seconds_per_block
    assert per_block, "the engine's prefill was not measured"
    block_nbytes = h.ucm_worker._worker.block_nbytes
    proxy.set_rate(block_nbytes / per_block / BELOW_BREAK_EVEN)


def warm_up(h: Harness, tokens: list[int]) -> None:
    """A cold prompt (the engine's prefill measured) and a hit at full speed."""
    run(h, prompt(8 * BS + 3, seed=99))
    loaded, _ = run(h, tokens)
    assert loaded == len(tokens) // BS


def test_auto_stops_loading_a_throttled_store_and_resumes_once_it_is_lifted(redis_server, proxy, harnesses,
                                                                             caplog):
    direct, slow = urls(redis_server, proxy)
    tokens = prompt(10 * BS + 5, seed=1)
    run(harnesses(direct), tokens)                       # stored, at full speed
    h = harnesses(slow)
    warm_up(h, tokens)

    throttle_below_break_even(h, proxy)
    with caplog.at_level("INFO", logger="vllm.ucm_connector"):
        # Two reads in a row far slower than the estimate: the store has
        # slowed down (one alone could be a pause of the host).
        slow = [run(h, tokens) for _ in range(2)]
        assert [n for n, _ in slow] == [10, 10]
        slow_seconds = min(s for _, s in slow)
        skipped = [run(h, tokens) for _ in range(6)]
        assert [n for n, _ in skipped] == [0] * 6, "a hit was loaded from a store 40x slower than recomputing"
        assert unloaded(h, "slow_store") == 6 * 10 * BS and unloaded(h, "latency") == 0
        assert max(s for _, s in skipped) < slow_seconds / 4, "skipped hits are not faster than the slow load"
        assert policy(h).tiers[0].slow
        assert sum("not loading hits from store" in r.getMessage() for r in caplog.records) == 1

        proxy.set_rate(None)
        after = [run(h, tokens)[0] for _ in range(8)]
    assert 10 in after[:6], f"loads did not resume within 6 requests of the store recovering: {after}"
    resumed = after.index(10)
    assert after[resumed:] == [10] * (8 - resumed), f"loads flapped after resuming: {after}"
    assert sum("loading hits from store" in r.getMessage() and " again: " in r.getMessage()
               for r in caplog.records) == 1


def test_always_loads_from_the_throttled_store_every_time(redis_server, proxy, harnesses):
    direct, slow = urls(redis_server, proxy)
    tokens = prompt(6 * BS + 5, seed=2)
    run(harnesses(direct), tokens)
    h = harnesses(slow, extra={"load_policy": "always"})
    run(h, prompt(8 * BS + 3, seed=98))
    proxy.set_rate(256 * 1024 * 8)                       # about 8 blocks a second
    assert [run(h, tokens)[0] for _ in range(2)] == [6, 6]
    assert unloaded(h, "slow_store") == unloaded(h, "latency") == 0
    assert h.ucm_scheduler._scheduler.policy is None


def test_a_fast_tier_is_loaded_and_the_throttled_tier_behind_it_recomputed(redis_server, proxy, harnesses,
                                                                           tmp_path):
    direct, slow = urls(redis_server, proxy)
    disk = f"disk://{tmp_path}/fast"
    shared = prompt(4 * BS, seed=3)
    prompts = [shared + prompt(6 * BS + 5, seed=10 + i) for i in range(6)]
    writer = harnesses(direct)
    for tokens in prompts:
        run(writer, tokens)                              # Redis holds every block
    run(harnesses(disk), shared + [7])                   # the disk tier only the shared 4
    h = harnesses([disk, slow])
    warm_up(h, prompts[0])
    throttle_below_break_even(h, proxy)
    # The reads that find the lower tier slow.
    assert [run(h, tokens)[0] for tokens in prompts[1:3]] == [10, 10]
    loads = [run(h, tokens)[0] for tokens in prompts[3:]]
    assert loads == [4, 4, 4], "not the disk tier's 4 blocks alone"
    assert unloaded(h, "slow_store") == 3 * 6 * BS
    tiers = policy(h).tiers
    assert not tiers[0].slow and tiers[1].slow


def test_what_the_workers_measure_reaches_the_scheduler_under_multiconnector(redis_server, proxy, harnesses):
    direct, slow = urls(redis_server, proxy)
    tokens = prompt(5 * BS + 5, seed=4)
    run(harnesses(direct), tokens)
    h = harnesses(slow, multi=True)
    warm_up(h, tokens)
    p = policy(h)
    assert p.recompute_seconds_per_block == pytest.approx(SECONDS_PER_TOKEN * BS, rel=1.0)
    assert p.tiers[0].reads.line is not None and p.tiers[0].nbytes_per_block > WIDTH * BS * 8
    assert list(p.tiers[0].hit_blocks) == [5], "the size of the hit a tier is judged at"
