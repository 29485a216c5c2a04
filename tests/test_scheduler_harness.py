"""UCMConnector under vLLM's real scheduler (ucm_testing/kvharness.py): hits,
misses, chunked prefill, local prefix cache + store, preemption and resume,
aborts mid-load, MultiConnector, and load failures in every load mode on
every kind of store.  After every step the store must hold exactly the KV
of each block's tokens, and every output must equal the reference.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from ucm_testing.kvharness import Harness, reference_generate

MODES = ["sync", "async", "layer"]
STORES = ["disk", "shm", "redis", "tier"]
BS = 16


def _stop_shm(name: str) -> None:
    from store_backends import stop_server

    try:
        stop_server(name)
    except Exception:
        pass


@pytest.fixture(params=STORES)
def store_url(request, tmp_path):
    kind = request.param
    name = "h" + uuid.uuid4().hex[:10]
    stop = None
    if kind == "disk":
        url = f"disk://{tmp_path}/store"
    elif kind == "redis":
        url = request.getfixturevalue("redis_server").url + f"?namespace={name}"
    elif kind == "shm":
        url, stop = f"shm://{name}?capacity=64MiB", name
    else:
        url, stop = [f"shm://{name}?capacity=64MiB", f"disk://{tmp_path}/lower"], name
    yield url
    if stop:
        _stop_shm(stop)


@pytest.fixture
def disk_url(tmp_path):
    return f"disk://{tmp_path}/store"


@pytest.fixture
def harnesses():
    made: list[Harness] = []

    def make(**kwargs) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed * 13) % 500 + 3 for i in range(n_tokens)]


def run_one(h: Harness, tokens: list[int], max_tokens: int = 3) -> str:
    req = h.add(tokens, max_tokens)
    h.run()
    assert h.outputs[req] == reference_generate(tokens, max_tokens, h.num_layers, h.weights), \
        f"request {req}: output differs from the reference"
    return req


def scheduler_is_empty(h: Harness) -> None:
    pool = h.scheduler.kv_cache_manager.block_pool
    assert not h.scheduler.requests, "requests left in the scheduler"
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "blocks leaked"


# -- hits and misses ---------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_restarted_engine_hits_what_another_saved(store_url, mode, harnesses):
    tokens = prompt(10 * BS + 5)
    first = harnesses(store=store_url, load_mode=mode)
    run_one(first, tokens)
    assert first.counters()["saved_blocks"] == 10

    second = harnesses(store=store_url, load_mode=mode)
    run_one(second, tokens)
    assert second.counters()["loaded_blocks"] == 10
    assert second.counters()["load_errors"] == 0
    scheduler_is_empty(second)


@pytest.mark.parametrize("mode", MODES)
def test_after_a_sleep_mode_release_and_restore_the_engine_saves_and_loads_as_before(disk_url, mode, harnesses):
    """vLLM 0.33's sleep mode calls unregister_kv_caches before it unmaps the
    KV cache and restore_kv_caches once it is mapped again (vLLM 0.32 calls
    neither; here they are called as 0.33 does, twice for good measure)."""
    h = harnesses(store=disk_url, load_mode=mode, prefix_caching=False)
    tokens = prompt(6 * BS + 1, seed=3)
    run_one(h, tokens)
    h.worker.unregister_kv_caches()
    h.worker.unregister_kv_caches()
    h.worker.restore_kv_caches()
    h.worker.restore_kv_caches()
    run_one(h, tokens)
    assert h.counters()["loaded_blocks"] == 6
    run_one(h, prompt(4 * BS + 1, seed=4))
    assert len(h.stored_blocks()) == 10 and h.counters()["load_errors"] == 0


def test_a_miss_computes_and_saves(disk_url, harnesses):
    h = harnesses(store=disk_url)
    run_one(h, prompt(5 * BS + 1))
    assert h.counters()["loaded_blocks"] == 0
    assert len(h.stored_blocks()) == 5


def test_vllm_treats_the_connector_as_a_best_effort_cache_on_preemption(disk_url, harnesses):
    """Saves are copied out in wait_for_save, so vLLM's scheduler need not
    throw away a preempted request's in-flight tokens for a hand-off."""
    h = harnesses(store=disk_url)
    assert h.scheduler.connector is not None and h.scheduler.requires_kv_delivery is False


def test_chunked_prefill_saves_each_chunk_and_loads_it_back(disk_url, harnesses):
    tokens = prompt(12 * BS + 3, seed=1)
    first = harnesses(store=disk_url, max_num_batched_tokens=40)
    run_one(first, tokens)
    assert len(first.steps) > 4, "the prompt was not split into chunks"
    assert len(first.stored_blocks()) == 12

    second = harnesses(store=disk_url, max_num_batched_tokens=40)
    longer = tokens + prompt(60, seed=2)
    run_one(second, longer)
    assert second.counters()["loaded_blocks"] == 12


def test_local_prefix_cache_and_store_together(disk_url, harnesses):
    long = prompt(16 * BS + 2, seed=3)
    run_one(harnesses(store=disk_url), long)

    h = harnesses(store=disk_url)
    run_one(h, long[:6 * BS] + prompt(20, seed=4))   # 6 blocks in the local cache now
    loaded_before = h.counters()["loaded_blocks"]
    run_one(h, long)
    # The first 6 blocks come from vLLM's own cache, the next 10 from the store.
    assert h.counters()["loaded_blocks"] - loaded_before == 10


# -- load failures -------------------------------------------------------------------


def _poison_setup(store_url, mode, harnesses, how, **kwargs):
    """A stored 10-block prompt; then a new engine (made with ``kwargs``)
    asks for its first 6 blocks followed by 4 new ones, and block 2 fails
    to load."""
    stored = prompt(10 * BS + 5, seed=5)
    run_one(harnesses(store=store_url), stored)
    asked = stored[:6 * BS] + prompt(4 * BS + 5, seed=6)
    h = harnesses(store=store_url, load_mode=mode, **kwargs)
    bad_key = h.keys_of(stored)[2]
    if how == "corrupt":
        h.damage(bad_key)
    else:
        def drop_once(harness, out, done=[]):
            if not done and harness.scheduler.requests:
                harness.drop(bad_key)
                done.append(1)
        h.before_load = drop_once
    return h, asked, bad_key


def test_an_engine_that_only_loads_reports_the_blocks_it_drops_from_the_store(disk_url, harnesses):
    """A kv_consumer engine (the decode side of a prefill/decode pair) drops
    a stored block that fails its check, as any engine does; with vLLM's KV
    events on it says so (BlockRemoved from STORAGE) for routers to hear,
    and reports nothing as stored."""
    from ucm_connector.hashing import key_digest

    stored = prompt(10 * BS + 5, seed=5)
    run_one(harnesses(store=disk_url), stored)
    h = harnesses(store=disk_url, kv_role="kv_consumer", kv_events=True)
    bad_key = h.keys_of(stored)[2]
    h.damage(bad_key)
    run_one(h, stored)
    assert h.counters()["load_errors"] >= 1 and h.counters()["saved_blocks"] == 0
    assert bad_key not in h.stored_blocks()
    kinds = [type(e).__name__ for e in h.connector_events]
    assert set(kinds) == {"BlockRemoved"}, kinds
    assert [d for e in h.connector_events for d in e.block_hashes] == [key_digest(bad_key)]
    assert all(e.medium == "STORAGE" for e in h.connector_events)


@pytest.mark.parametrize("how", ["corrupt", "missing"])
@pytest.mark.parametrize("mode", MODES)
def test_a_failed_load_never_leaves_wrong_kv_in_the_store(store_url, mode, how, harnesses):
    h, asked, bad_key = _poison_setup(store_url, mode, harnesses, how)
    run_one(h, asked)                      # check_store runs after every step
    assert h.counters()["load_errors"] >= 1
    assert any(s.invalid_block_ids for s in h.steps), "the failed block was not reported"
    # Everything the request computed is stored, the failed block included,
    # and a third engine gets a full, correct hit.
    blocks = h.stored_blocks()
    assert all(k in blocks for k in h.keys_of(asked)), "blocks of the recomputed request are missing"
    third = harnesses(store=store_url, load_mode=mode)
    run_one(third, asked)
    assert third.counters()["loaded_blocks"] == 10
    assert third.counters()["load_errors"] == 0


@pytest.mark.parametrize("how", ["corrupt", "missing"])
@pytest.mark.parametrize("mode", MODES)
def test_layerwise_saves_store_the_right_kv_and_none_of_a_failed_load(disk_url, mode, how, harnesses):
    """save_layerwise (each layer's pages copied out as the harness's
    forward pass reports it): hits, chunked prefill and the failed load of
    the test above; after every step the store holds exactly each block's
    KV, and every saved block went out layer by layer."""
    tokens = prompt(9 * BS + 3, seed=8)
    first = harnesses(store=disk_url, load_mode=mode, max_num_batched_tokens=40,
                      extra={"save_layerwise": True})
    run_one(first, tokens)
    counters = first.counters()
    assert counters["saved_blocks"] == 9
    assert counters["layerwise_saved_blocks"] == 9
    h, asked, _ = _poison_setup(disk_url, mode, harnesses, how, extra={"save_layerwise": True})
    run_one(h, asked)
    assert h.counters()["load_errors"] >= 1
    assert h.counters()["layerwise_saved_blocks"] >= 1
    assert all(k in h.stored_blocks() for k in h.keys_of(asked))


def test_blocks_replanned_after_a_failure_replace_what_the_store_holds(store_url, harnesses):
    """A block re-saved after a load failure is written even when its key is
    present: whatever the store held under it (here a value with a valid
    envelope but the wrong KV) does not survive."""
    from ucm_connector import blockfmt

    stored = prompt(8 * BS + 5, seed=7)
    first = harnesses(store=store_url)
    run_one(first, stored)
    keys = first.keys_of(stored)
    # Block 5 holds sound-looking wrong KV (as a poisoned save would have left).
    (value,) = first._store.get([keys[5]])
    payload = bytearray(value[blockfmt.HEADER_NBYTES:])
    payload[0] ^= 1
    forged = blockfmt.encode_block(first.namespace.digest, bytes(payload), key=keys[5])
    first.flush()
    first._store.delete([keys[5]])
    first._store.put([keys[5]], [forged])
    first.flush()
    first.damaged.add(keys[5])   # check_store: allowed until replaced
    # Block 2 is corrupt: the load fails there, and blocks 2.. are recomputed.
    h = harnesses(store=store_url, check_every_step=False)
    h.damage(keys[2])
    run_one(h, stored)
    h.flush()
    (now,) = h._store.get([keys[5]])
    assert now != forged, "the re-saved block did not replace what the store held"
    for tier in getattr(h._store, "stores", []):   # a lower tier keeps no old copy either
        (held,) = tier.get([keys[5]])
        assert held != forged, f"tier {tier.url} kept the value the re-save replaced"
    h.damaged.discard(keys[5])
    h.damaged.discard(keys[2])
    h.check_store()


# -- preemption, aborts --------------------------------------------------------------


def test_a_resumed_request_sees_the_blocks_it_saved_before_preemption(disk_url, harnesses):
    """A request that saved blocks, was preempted and resumes loads what it
    saved rather than what the store held when it first arrived."""
    seed_tokens = prompt(2 * BS, seed=8)
    run_one(harnesses(store=disk_url), seed_tokens + prompt(3, seed=9))   # 2 blocks stored

    # 12 usable blocks.  B (5 blocks, about to need a 6th) decodes; A (6
    # full blocks + 1 token, the first 2 stored) is admitted into the 7
    # free blocks and prefills in chunks; B's next block preempts A after
    # A has saved 3 more blocks.
    h = harnesses(store=disk_url, num_blocks=13, max_num_batched_tokens=64, max_num_seqs=2,
                  prefix_caching=False)
    b_tokens = prompt(4 * BS + 14, seed=11)
    b = h.add(b_tokens, 30, req_id="B")
    h.step()
    h.step()
    a_tokens = seed_tokens + prompt(4 * BS + 1, seed=10)
    a = h.add(a_tokens, 2, req_id="A")
    h.run()
    a_loads = [s.loads["A"] for s in h.steps if "A" in s.loads]
    assert h.requests["A"].num_preemptions >= 1, "A was never preempted; the scenario needs it"
    assert a_loads[0] == 2
    assert len(a_loads) >= 2 and a_loads[-1] > 2, \
        f"A resumed and loaded {a_loads[1:]} blocks: not the ones it saved before preemption"
    assert h.outputs[a] == reference_generate(a_tokens, 2, h.num_layers)
    assert h.outputs[b] == reference_generate(b_tokens, 30, h.num_layers)
    scheduler_is_empty(h)


def test_an_abort_during_an_async_load_frees_everything(disk_url, harnesses):
    tokens = prompt(10 * BS + 5, seed=12)
    run_one(harnesses(store=disk_url), tokens)
    h = harnesses(store=disk_url, load_mode="async")
    req = h.add(tokens, 3)
    h.step()                                  # the load is handed to the loader
    h.abort(req)
    for _ in range(50):
        if not h.scheduler.requests:
            break
        h.step()
    scheduler_is_empty(h)
    run_one(h, tokens)                        # the engine carries on, correct


# -- MultiConnector, the failure policy ----------------------------------------------


def test_under_multiconnector_a_load_failure_is_recomputed_not_failed(disk_url, harnesses):
    stored = prompt(10 * BS + 5, seed=13)
    run_one(harnesses(store=disk_url, multi=True, policy=None), stored)
    h = harnesses(store=disk_url, multi=True, policy=None)
    assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    h.damage(h.keys_of(stored)[3])
    req = run_one(h, stored)
    assert "error" not in h.finished[req].lower()


def test_an_explicit_fail_policy_is_kept_and_the_reason_logged(disk_url, harnesses, monkeypatch, caplog):
    monkeypatch.setenv("UCM_KEEP_KV_LOAD_FAILURE_POLICY", "1")
    with caplog.at_level(logging.WARNING, logger="vllm.ucm_connector"):
        h = harnesses(store=disk_url, policy="fail")
    assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
    assert any("kv_load_failure_policy" in r.getMessage() and "recompute" in r.getMessage()
               for r in caplog.records), "no log line says why recompute is recommended"


def test_vllms_default_fail_policy_is_switched_to_recompute(disk_url, harnesses):
    h = harnesses(store=disk_url, policy=None)
    assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_a_fail_policy_given_on_the_command_line_is_kept(monkeypatch):
    from vllm.config import KVTransferConfig

    from ucm_connector.connector import settle_load_failure_policy

    monkeypatch.delenv("UCM_KEEP_KV_LOAD_FAILURE_POLICY", raising=False)
    config = KVTransferConfig(kv_connector="UCMConnector", kv_role="kv_both", kv_load_failure_policy="fail")
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "--kv-transfer-config",
                                     '{"kv_connector":"UCMConnector","kv_load_failure_policy":"fail"}'])
    settle_load_failure_policy(config)
    assert config.kv_load_failure_policy == "fail"
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "--kv-transfer-config", '{"kv_connector":"UCMConnector"}'])
    settle_load_failure_policy(config)
    assert config.kv_load_failure_policy == "recompute"


def test_a_worker_that_cannot_tell_its_tp_rank_refuses_to_start_with_tp_above_one(disk_url, harnesses):
    """Falling back to rank 0 would make every rank load rank 0's shards."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ucm_connector.connector import UCMConnector

    h = harnesses(store=disk_url)
    config = copy.copy(h.vllm_config)
    config.parallel_config = copy.copy(config.parallel_config)
    config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(RuntimeError, match="tensor-parallel rank is unknown.*tensor_parallel_size 2"):
        UCMConnector(config, KVConnectorRole.WORKER, h.kv_cache_config)


def test_a_second_engines_kv_cache_is_refused_and_the_first_engines_stays_in_use(disk_url, harnesses):
    """vLLM keeps one worker-side connector per process: a second engine in
    the process registers its KV cache with the first engine's connector.
    That is refused (taking it would save the first engine's blocks from
    the second one's pages); registering the same tensors again changes
    nothing, and the first engine's blocks are stored and loaded as before."""
    import torch

    h = harnesses(store=disk_url)
    h.worker.register_kv_caches(h.caches)
    other = {name: torch.zeros_like(t) for name, t in h.caches.items()}
    with pytest.raises(RuntimeError, match="one worker-side connector per process.*VLLM_ENABLE_V1_MULTIPROCESSING"):
        h.worker.register_kv_caches(other)
    tokens = prompt(6 * BS + 1, seed=5)
    run_one(h, tokens)                      # every stored block checked against its tokens' KV
    assert len(h.stored_blocks()) == 6
    second = harnesses(store=disk_url)
    run_one(second, tokens)
    assert second.counters()["loaded_blocks"] == 6


# -- weight updates ------------------------------------------------------------------
# The namespace fingerprints the weight files; weights changed in a running
# engine reach the connector only as vLLM's reset of its cache.


@pytest.mark.parametrize("mode", MODES)
def test_after_a_weight_update_nothing_stored_before_is_loaded(store_url, mode, harnesses):
    """After ``reset_prefix_cache(reset_connector=True)`` and new weights,
    the engine loads none of the blocks the old weights made, computes
    (outputs of the new weights), and stores the new KV under keys of a new
    generation, which it then hits; every block in the store holds the KV
    of the weights its generation was made with (checked after each step).
    A new engine, with the files' weights, still hits the first blocks."""
    tokens = prompt(6 * BS + 1, seed=11)
    always = {"load_policy": "always"}      # every hit loaded, however fast the fake model
    h = harnesses(store=store_url, load_mode=mode, extra=always)
    run_one(h, tokens)
    h.scheduler.reset_prefix_cache()
    run_one(h, tokens)
    assert h.counters()["loaded_blocks"] == 6

    assert h.update_weights(1, reset_connector=True) is True
    assert h.generation != b""
    run_one(h, tokens)                          # the new weights' output
    assert h.counters()["loaded_blocks"] == 6, "blocks of the old weights were loaded after the update"
    h.scheduler.reset_prefix_cache()
    run_one(h, tokens)
    assert h.counters()["loaded_blocks"] == 12
    stored = h.stored_blocks()
    assert set(h.keys_of(tokens)) | set(h.keys_of(tokens, h.generation)) <= set(stored)

    fresh = harnesses(store=store_url, load_mode=mode, extra=always)
    run_one(fresh, tokens)
    assert fresh.counters()["loaded_blocks"] == 6


def test_resetting_only_vllms_prefix_cache_after_a_weight_update_loads_the_old_weights_kv(disk_url, harnesses):
    """vLLM's contract: ``reset_prefix_cache()`` alone keeps the connector's
    cache.  After a weight update that loads KV of the old weights, and the
    output is not the new weights' (which is why the update must reset the
    connector too, and what the harness would catch if the connector's
    reset did not hold)."""
    tokens = prompt(6 * BS + 1, seed=11)
    h = harnesses(store=disk_url, check_every_step=False, extra={"load_policy": "always"})
    run_one(h, tokens)
    h.flush()
    assert h.update_weights(1) is True
    req = h.add(tokens, 3)
    h.run()
    assert h.counters()["loaded_blocks"] == 6
    assert h.outputs[req] != reference_generate(tokens, 3, h.num_layers, weights=1)


def test_on_cache_reset_keep_goes_on_loading(disk_url, harnesses):
    tokens = prompt(6 * BS + 1, seed=13)
    h = harnesses(store=disk_url, extra={"on_cache_reset": "keep", "load_policy": "always"})
    run_one(h, tokens)
    assert h.update_weights(0, reset_connector=True) is True
    assert h.generation == b""
    run_one(h, tokens)
    assert h.counters()["loaded_blocks"] == 6


def _half_prefilled(disk_url, harnesses, seed):
    """A request two 40-token chunks into its prefill, and the blocks it has stored."""
    tokens = prompt(6 * BS + 1, seed=seed)
    h = harnesses(store=disk_url, max_num_batched_tokens=40)
    req = h.add(tokens, 3)
    h.step()
    h.step()
    return h, tokens, req, set(h.stored_blocks())


def test_a_request_preempted_by_the_reset_is_keyed_afresh(disk_url, harnesses):
    """``reset_running_requests=True`` preempts a request half-way through
    its prefill: it computes again from the start, with the new weights,
    and stores all its blocks under the new generation's keys (the blocks
    it stored before keep their old keys and old KV)."""
    h, tokens, req, before = _half_prefilled(disk_url, harnesses, seed=14)
    assert before and before <= set(h.keys_of(tokens))
    assert h.update_weights(1, reset_running_requests=True, reset_connector=True) is True
    h.run()
    assert h.outputs[req] == reference_generate(tokens, 3, h.num_layers, weights=1)
    assert set(h.stored_blocks()) == before | set(h.keys_of(tokens, h.generation))


def test_a_request_that_holds_kv_at_the_reset_saves_no_more(disk_url, harnesses):
    """A reset that leaves running requests alone (vLLM then reports its own
    reset failed) still gives the connector new keys; a request whose pages
    hold KV of the old weights then stores none of its blocks, under the old
    keys or the new (the store is checked after every step: a block of
    mixed weights under either would fail)."""
    h, _, req, before = _half_prefilled(disk_url, harnesses, seed=15)
    assert len(before) == 5
    assert h.update_weights(1, reset_connector=True) is False     # vLLM's own reset: blocks in use
    assert h.generation != b""
    h.run()
    assert req in h.finished
    assert set(h.stored_blocks()) == before


# -- vLLM's async scheduling (its default on GPUs) ---------------------------------
# Step N+1 is scheduled and run before step N's output, and with it a failed
# load, reaches the scheduler.


@pytest.mark.parametrize("mode", MODES)
def test_under_async_scheduling_hits_give_the_reference(disk_url, mode, harnesses):
    tokens = prompt(10 * BS + 5, seed=5)
    run_one(harnesses(store=disk_url, async_scheduling=True), tokens, 6)
    second = harnesses(store=disk_url, load_mode=mode, async_scheduling=True)
    run_one(second, tokens, 6)
    assert second.counters()["loaded_blocks"] == 10
    scheduler_is_empty(second)


@pytest.mark.parametrize("how", ["corrupt", "missing"])
@pytest.mark.parametrize("mode", MODES)
def test_under_async_scheduling_a_failed_load_never_reaches_a_token(store_url, mode, how, harnesses):
    """A step after the one that loads is already on its way when the load
    fails: it must not have read the failed block (vLLM delivers its token
    even though it rewinds the request).  Loads are asynchronous there,
    whatever the configured way: the request waits until its blocks are
    checked, and vLLM recomputes the failed one."""
    h, asked, _ = _poison_setup(store_url, mode, harnesses, how, async_scheduling=True)
    run_one(h, asked, 6)                   # check_store runs after every step
    assert h.counters()["load_errors"] >= 1
    assert any(s.invalid_block_ids for s in h.steps), "the failed block was not reported"
    assert all(k in h.stored_blocks() for k in h.keys_of(asked))


def test_under_async_scheduling_a_request_sharing_a_failed_block_stores_no_wrong_kv(disk_url, harnesses):
    """R loads 10 blocks, block 2 fails; S, the same 10 blocks and more, is
    scheduled before R's failure is known.  S must not read R's failed
    page (vLLM would not rewind S: R recomputes the block), or its tokens,
    and the blocks it saves later, carry the wrong KV."""
    tokens = prompt(10 * BS + 5, seed=5)
    run_one(harnesses(store=disk_url), tokens)
    h = harnesses(store=disk_url, async_scheduling=True)
    h.damage(h.keys_of(tokens)[2])
    r = h.add(tokens, 4)
    h.step()
    s_tokens = tokens[:10 * BS] + prompt(10, seed=9)
    s = h.add(s_tokens, 30)
    h.run()                                # check_store runs after every step
    assert h.outputs[r] == reference_generate(tokens, 4, h.num_layers)
    assert h.outputs[s] == reference_generate(s_tokens, 30, h.num_layers)


def test_under_multiconnector_a_weight_update_reaches_the_connector(disk_url, harnesses):
    """MultiConnector passes vLLM's reset on to each child."""
    tokens = prompt(6 * BS + 1, seed=16)
    h = harnesses(store=disk_url, multi=True, extra={"load_policy": "always"})
    run_one(h, tokens)
    assert h.update_weights(1, reset_connector=True) is True
    assert h.generation != b""
    run_one(h, tokens)
    assert h.counters()["loaded_blocks"] == 0
