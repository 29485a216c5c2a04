"""UCMWorker without an engine: real stores, real torch caches shaped like
vLLM's CPU layout, on the CPU and, where there is one, on a CUDA device;
loads in each mode put back exactly the saved bytes, bad blocks are reported
and dropped."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from store_backends import open_store
from ucm_connector import blockfmt, worker as worker_mod
from ucm_connector.outcomes import OutcomeLog
from ucm_connector.counters import StatsCollector
from ucm_connector.plans import BlockPlan

NUM_BLOCKS = 24
NS = b"namespace-digest"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _caches(seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(NUM_BLOCKS, 2, 32, 64, generator=g).to(torch.bfloat16).to(device) for i in range(3)}


def _worker(store, caches, mode="sync", events=False):
    w = worker_mod.UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=NUM_BLOCKS,
                             max_pending_nbytes=1 << 30, stats=StatsCollector(), blocks_per_request=8,
                             load_mode=mode, events=OutcomeLog(enabled=events))
    w.register_kv_caches(caches)
    return w


def _saved(store, seed: int, n: int, device: str = "cpu"):
    """Caches of ``seed`` whose blocks 0..n-1 were saved under ``_keys(n)``."""
    src = _caches(seed, device)
    saver = _worker(store, src)
    keys = _keys(n)
    saver.save([BlockPlan("r", list(range(n)), keys)])
    assert saver.flush(10)
    saver.close()
    return src, keys


def _keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 16 + b"\0\0" for i in range(n)]


def _pages(caches, block_ids) -> list[bytes]:
    return [b"".join(c[b].contiguous().view(torch.uint8).cpu().numpy().tobytes() for c in caches.values())
            for b in block_ids]


def _load_back(store, keys, block_ids, seed: int, device: str = "cpu") -> list[bytes]:
    """Load ``keys`` with a new worker into ``block_ids`` of fresh caches
    (random from ``seed``, which must not be the saved caches' own); the
    pages it loaded, after checking that no load failed."""
    dst = _caches(seed, device)
    loader = _worker(store, dst)
    try:
        loader.load([BlockPlan("q", list(block_ids), keys)])
        assert loader.take_load_errors() == set()
        return _pages(dst, block_ids)
    finally:
        loader.close()


def _writer_jobs(monkeypatch) -> list[int]:
    """The number of blocks in each job the save writer gets, in order."""
    from ucm_connector import saves as saves_mod

    jobs: list[int] = []
    write = saves_mod.Saves._write
    monkeypatch.setattr(saves_mod.Saves, "_write", lambda self, job: (jobs.append(len(job[0])), write(self, job)))
    return jobs


@pytest.fixture(params=["pages", "rows", "shm", "tier"])
def store(request, tmp_path):
    """A disk store, which reads blocks straight into the pages on CPU
    (``reads_into_parts``); the same with that switched off, as for a store
    that cannot: loads go through host rows; an shm store, which also
    writes blocks straight from the pages (``writes_from_parts``): on CPU
    its saves skip the writer; and a tier of two disk stores, whose tiers
    each read into the pages."""
    if request.param in ("pages", "rows"):
        s = open_store(f"disk://{tmp_path}/store")
        if request.param == "rows":
            s.reads_into_parts = False
    elif request.param == "tier":
        s = open_store([f"disk://{tmp_path}/top", f"disk://{tmp_path}/bottom"], write_mode="sync")
    else:
        s = open_store(f"shm://w{uuid.uuid4().hex[:12]}?capacity=256MiB&runtime_dir={tmp_path}")
    assert s.reads_into_parts == (request.param != "rows")
    assert s.writes_from_parts == (request.param == "shm")
    yield s
    if request.param == "shm":
        s.shutdown_server()
    s.close()


def _wait_loaded(w, req_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished = w.get_finished()
        if finished and req_id in finished:
            return
        time.sleep(0.01)
    raise AssertionError(f"load of {req_id} never finished")


@pytest.mark.parametrize("mode", ["sync", "async", "layer"])
def test_load_puts_back_the_saved_bytes(store, mode, device):
    src = _caches(1, device)
    saver = _worker(store, src)
    keys = _keys(7)
    saver.save([BlockPlan("r", list(range(7)), keys[:7])])
    assert saver.flush(10)
    want = _pages(src, range(7))
    saver.close()

    dst = _caches(2, device)
    loader = _worker(store, dst, mode)
    loader.load([BlockPlan("q", list(range(10, 17)), keys)])
    if mode == "async":
        _wait_loaded(loader, "q")
    elif mode == "layer":
        for name in dst:
            loader.wait_for_layer(name)
    assert loader.take_load_errors() == set()
    assert _pages(dst, range(10, 17)) == want
    assert loader.stats.totals()["loaded_blocks"] == 7
    loader.close()


def test_a_layer_name_without_a_cache_of_its_own_waits_for_every_layers_copy(store, device, monkeypatch):
    """A layer that reads another layer's cache (or a name the worker does
    not know) starts its attention only once every layer is loaded."""
    from ucm_connector import layer_copies
    src, keys = _saved(store, 5, 4, device)
    layer = layer_copies.LayerScatter.layer

    def slow_after_the_first(self, i):
        if i > 0:
            time.sleep(0.2)
        return layer(self, i)

    monkeypatch.setattr(layer_copies.LayerScatter, "layer", slow_after_the_first)
    dst = _caches(6, device)
    loader = _worker(store, dst, "layer")
    loader.load([BlockPlan("q", [10, 11, 12, 13], keys)])
    loader.wait_for_layer("model.layers.3.self_attn.shared")
    assert _pages(dst, [10, 11, 12, 13]) == _pages(src, [0, 1, 2, 3])
    assert loader.take_load_errors() == set()
    loader.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_only_synchronous_loads_make_the_engines_stream_wait_for_their_copies(tmp_path, mode, monkeypatch):
    """An asynchronous load's request is scheduled only once its copies are
    done (the loader waits for them on the host): queueing a wait for them
    on the engine's stream would stall the other requests' forward passes
    on a GPU."""
    from ucm_connector.transfer import BlockTransfer
    store = open_store(f"disk://{tmp_path}/store")
    store.reads_into_parts = False          # loads go through host rows and scatter_rows
    src, keys = _saved(store, 7, 3)
    scatter_rows = BlockTransfer.scatter_rows
    ordered = []

    def recording(self, *args, **kwargs):
        ordered.append(kwargs.get("ordered", True))
        return scatter_rows(self, *args, **kwargs)

    monkeypatch.setattr(BlockTransfer, "scatter_rows", recording)
    dst = _caches(8)
    loader = _worker(store, dst, mode)
    loader.load([BlockPlan("q", [10, 11, 12], keys)])
    if mode == "async":
        _wait_loaded(loader, "q")
    assert _pages(dst, [10, 11, 12]) == _pages(src, [0, 1, 2])
    assert ordered and set(ordered) == {mode == "sync"}
    loader.close()
    store.close()


def test_a_job_thread_sets_itself_up_before_its_first_job_and_runs_jobs_if_that_fails():
    from ucm_connector.blockio import JobThread
    seen = []
    ok = JobThread(seen.append, on_start=lambda: seen.append(("start", threading.current_thread().name)))
    ok.put(1, 2)
    assert ok.flush(5)
    assert seen == [("start", "ucm-loader"), 1, 2]
    ok.close()

    def fail():
        raise RuntimeError("no such device")

    done = []
    failing = JobThread(done.append, name="ucm-test", on_start=fail)
    failing.put(3)
    assert failing.flush(5) and done == [3]
    failing.close()


@pytest.mark.parametrize("mode", ["sync", "async", "layer"])
def test_a_bad_block_is_reported_dropped_and_the_others_loaded(store, mode, device):
    src, keys = _saved(store, 3, 4, device)
    value = bytearray(store.get([keys[2]])[0])
    value[blockfmt.HEADER_NBYTES + 5] ^= 0xFF
    store.delete([keys[2]])
    assert store.put([keys[2]], [bytes(value)]) == [True]

    dst = _caches(4, device)
    before = _pages(dst, [12])
    loader = _worker(store, dst, mode, events=True)
    loader.load([BlockPlan("q", [10, 11, 12, 13], keys)])
    if mode == "async":
        _wait_loaded(loader, "q")
    assert loader.take_load_errors() == {12}
    assert _pages(dst, [10, 11, 13]) == _pages(src, [0, 1, 3])
    if not loader.loads.reader.into_pages:
        # Read into host rows and checked there, a bad block never reaches
        # the pages.  Read straight into its pages (CPU, a store that
        # reads into parts), it does; it is reported above, and vLLM
        # recomputes every block it reports.
        assert _pages(dst, [12]) == before, "a bad block's bytes reached the cache"
    assert store.contains(keys) == [True, True, False, True], "the bad block was not dropped"
    assert loader.stats.totals()["load_errors"] == 1
    outcomes = loader.events.take()
    assert outcomes == [("removed", keys[2])]
    loader.close()


def test_a_save_goes_to_the_writer_in_parts_and_every_block_arrives(store, device, monkeypatch):
    """A save larger than SAVE_PART_NBYTES (on CUDA SAVE_PART_NBYTES_CUDA)
    is gathered and written a part at a time (the writer puts one while the
    next is gathered); every block still arrives whole, in its own key."""
    from ucm_connector import saves as saves_mod

    parts = _writer_jobs(monkeypatch)
    src = _caches(6, device)
    saver = _worker(store, src)
    monkeypatch.setattr(saves_mod, "SAVE_PART_NBYTES_CUDA" if device == "cuda" else "SAVE_PART_NBYTES",
                        2 * saver.payload_nbytes)
    keys = _keys(7)
    saver.save([BlockPlan("r", list(range(7)), keys)])
    assert saver.flush(10)
    direct = saver.saves.direct
    saver.close()
    # On CPU a store that writes from the pages takes them all at once.
    assert parts == ([] if direct else [2, 2, 2, 1])
    assert direct == (store.writes_from_parts and device == "cpu")
    assert _load_back(store, keys, range(10, 17), 7, device) == _pages(src, range(7))


def test_a_direct_save_the_store_refuses_sends_the_next_saves_through_the_writer(tmp_path, monkeypatch):
    """On CPU an shm store takes saves straight from the pages, on the
    engine thread.  Once it refuses one (full, or not answering), saves go
    through the writer for ``DIRECT_SAVE_PAUSE_S`` (longer after each
    refusal in a row), so a store that stopped answering holds up the
    engine thread once, not every step; then they go straight again.
    Every block that was not refused arrives whole."""
    from ucm_connector import saves as saves_mod

    store = open_store(f"shm://w{uuid.uuid4().hex[:12]}?capacity=64MiB&runtime_dir={tmp_path}")
    refuse = [True]
    put_parts = type(store).put_parts

    def refusing(self, keys, parts, before_value=None):
        if refuse:
            refuse.clear()
            return [False] * len(keys)
        return put_parts(self, keys, parts, before_value)

    monkeypatch.setattr(type(store), "put_parts", refusing)
    jobs = _writer_jobs(monkeypatch)
    src = _caches(11)
    w = _worker(store, src)
    keys = _keys(6)
    try:
        assert w.saves.direct
        w.save([BlockPlan("r", [0, 1], keys[:2])])
        assert w.flush(10)
        assert store.contains(keys[:2]) == [False, False]
        assert w.stats.totals()["skipped_saves"] == 2
        w.save([BlockPlan("r", [2, 3], keys[2:4])])      # paused: the writer
        assert w.flush(10)
        assert jobs == [2]
        assert w.saves._direct_pause == 2 * saves_mod.DIRECT_SAVE_PAUSE_S   # the next one in a row: longer
        w.saves._direct_paused_until = 0.0              # the pause is over
        w.save([BlockPlan("r", [4, 5], keys[4:6])])
        assert w.flush(10)
        assert jobs == [2]
        assert w.saves._direct_pause == saves_mod.DIRECT_SAVE_PAUSE_S
        assert w.stats.totals()["saved_blocks"] == 4
        assert _load_back(store, keys[2:6], range(10, 14), 12) == _pages(src, range(2, 6))
    finally:
        w.close()
        store.shutdown_server()


def test_a_tier_over_shm_saves_straight_from_the_pages_and_the_lower_tier_gets_the_blocks(tmp_path):
    """shm over disk (async): saves go straight from the pages into shm,
    and the disk tier gets the same blocks in the background; a loader on
    the disk tier alone puts back the saved bytes."""
    shm_url = f"shm://w{uuid.uuid4().hex[:12]}?capacity=64MiB&runtime_dir={tmp_path}"
    tier = open_store([shm_url, f"disk://{tmp_path}/disk"])
    src = _caches(14)
    w = _worker(tier, src)
    keys = _keys(5)
    try:
        assert w.saves.direct
        w.save([BlockPlan("r", list(range(5)), keys)])
        assert w.flush(10) and tier.flush(timeout=30)
        assert w.stats.totals()["saved_blocks"] == 5
    finally:
        w.close()
        tier.close()
        tier.stores[0].shutdown_server()
    with open_store(f"disk://{tmp_path}/disk") as disk:
        assert _load_back(disk, keys, range(10, 15), 15) == _pages(src, range(5))


def test_a_re_save_replaces_the_stored_block_through_the_writer(store, monkeypatch):
    """A re-save (``overwrite``: the request recomputed blocks after a
    failed load) deletes what the store holds and puts the new KV, also
    where saves otherwise go straight from the pages: its delete stays on
    the writer."""
    jobs = _writer_jobs(monkeypatch)
    old, new = _caches(16), _caches(17)
    keys = _keys(2)
    first = _worker(store, old)
    first.save([BlockPlan("r", [0, 1], keys)])
    assert first.flush(10)
    first.close()
    second = _worker(store, new)
    second.save([BlockPlan("r", [0, 1], keys, overwrite=True)])
    assert second.flush(10)
    second.close()
    assert jobs[-1] == 2
    assert _load_back(store, keys, [10, 11], 18) == _pages(new, [0, 1])


def test_a_stopped_shm_server_refuses_a_direct_save_and_the_next_go_through_the_writer(tmp_path, monkeypatch):
    """A real shm server, SIGSTOPped: the save straight from the pages
    waits the store's timeout, is refused and counted; once the server runs
    again, saves still go through the writer until the pause is over, and
    arrive."""
    import os
    import signal

    jobs = _writer_jobs(monkeypatch)
    store = open_store(f"shm://w{uuid.uuid4().hex[:12]}?capacity=64MiB&timeout=0.5&runtime_dir={tmp_path}")
    pid = store.stats().extra["server_pid"]
    w = _worker(store, _caches(13))
    keys = _keys(4)
    os.kill(pid, signal.SIGSTOP)
    try:
        w.save([BlockPlan("r", [0, 1], keys[:2])])
    finally:
        os.kill(pid, signal.SIGCONT)
    assert w.stats.totals()["skipped_saves"] == 2
    assert jobs == []
    w.save([BlockPlan("r", [2, 3], keys[2:])])
    assert w.flush(10)
    assert jobs == [2]
    assert store.contains(keys) == [False, False, True, True]
    w.close()
    store.shutdown_server()


def test_save_outcomes_say_written_present_and_not_stored(store, device):
    src = _caches(5, device)
    w = _worker(store, src, events=True)
    keys = _keys(3)
    w.save([BlockPlan("r", [0, 1], keys[:2])])
    assert w.flush(10)
    w.save([BlockPlan("r", [0, 1, 2], keys)])
    assert w.flush(10)
    outcomes = w.events.take()
    assert sorted(outcomes) == sorted([("written", keys[0]), ("written", keys[1]),
                                       ("present", keys[0]), ("present", keys[1]),
                                       ("written", keys[2])])
    w.close()


@pytest.mark.parametrize("errors_first", [False, True], ids=["saves-then-errors", "errors-then-saves"])
@pytest.mark.parametrize("mode", ["sync", "layer"])
def test_kv_computed_on_a_block_that_failed_to_load_is_not_saved(store, mode, device, errors_first):
    """A block fails its check in this step's load: the step's saves that
    read it (``loaded_inputs``) are dropped; the others are written.  Also
    where vLLM takes the load errors before the saves (with a speculator it
    calls ``wait_for_save`` after the draft model's forward)."""
    src = _caches(7, device)
    saver = _worker(store, src)
    keys = _keys(8)
    saver.save([BlockPlan("r", [0, 1, 2], keys[:3])])
    assert saver.flush(10)
    saver.close()
    value = bytearray(store.get([keys[1]])[0])
    value[blockfmt.HEADER_NBYTES + 5] ^= 0xFF
    store.delete([keys[1]])
    store.put([keys[1]], [bytes(value)])

    w = _worker(store, _caches(8, device), mode)
    w.begin_step(0, [], [])
    w.load([BlockPlan("q", [10, 11, 12], keys[:3])])
    if mode == "layer":
        for name in w._layer_index:
            w.wait_for_layer(name)
    if errors_first:
        assert w.take_load_errors() == {11}
    w.save([BlockPlan("q", [13, 14], keys[3:5], loaded_inputs=[10, 11, 12]),
            BlockPlan("other", [15], keys[5:6], loaded_inputs=[])])
    assert w.flush(10)
    assert w.take_load_errors() == (set() if errors_first else {11})
    assert store.contains(keys[3:6]) == [False, False, True]
    w.close()


def test_with_tp_a_failure_on_another_rank_drops_the_save_here(store, device):
    """This rank loaded every block, but another rank's load failed: the
    union over the TP group decides."""
    src = _caches(9, device)
    saver = _worker(store, src)
    keys = _keys(4)
    saver.save([BlockPlan("r", [0, 1], keys[:2])])
    assert saver.flush(10)
    saver.close()

    w = worker_mod.UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=NUM_BLOCKS,
                             max_pending_nbytes=1 << 30, stats=StatsCollector(), blocks_per_request=8,
                             share_failures=lambda mine: mine | {11})
    w.register_kv_caches(_caches(10, device))
    w.load([BlockPlan("q", [10, 11], keys[:2])])
    w.save([BlockPlan("q", [12], keys[2:3], loaded_inputs=[10, 11])])
    assert w.flush(10)
    assert w.take_load_errors() == set()
    assert store.contains(keys[2:3]) == [False]
    w.close()


# -- save_layerwise ---------------------------------------------------------------


def _layerwise_worker(store, caches, monkeypatch, **kw):
    from ucm_connector import saves as saves_mod

    monkeypatch.setattr(saves_mod, "LAYERWISE_SAVE_MIN_NBYTES", 0)   # tiny test blocks on CUDA too
    w = worker_mod.UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=NUM_BLOCKS,
                             max_pending_nbytes=1 << 30, stats=StatsCollector(), blocks_per_request=8,
                             save_layerwise=True, **kw)
    w.register_kv_caches(caches)
    assert w.saves.layerwise
    return w


def test_save_layerwise_auto_copies_layer_by_layer_on_cuda_only(tmp_path, device):
    """``save_layerwise: auto`` (None to the worker) decides by the caches'
    device: layer by layer on CUDA, where it frees the next step's kernels
    sooner, after the forward pass on CPU, where it is slower."""
    store = open_store(f"disk://{tmp_path}/store")
    w = worker_mod.UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=NUM_BLOCKS,
                             max_pending_nbytes=1 << 30, stats=StatsCollector(), save_layerwise=None)
    w.register_kv_caches(_caches(3, device))
    assert w.save_layerwise == (device == "cuda")
    assert w.saves.layerwise == (device == "cuda" and w.transfer.can_copy_by_layer)
    w.close()
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("asked", ["auto", "save", "load"])
def test_without_pitched_copies_only_a_layerwise_way_asked_for_warns(tmp_path, monkeypatch, caplog, asked):
    """Where the CUDA runtime's pitched copies do not work, the layerwise
    ways copy whole blocks; a warning says so where one was asked for, an
    info line where only save_layerwise's auto default would have used them."""
    import logging

    from ucm_connector import cudart

    monkeypatch.setattr(cudart, "pitched_copies_work", lambda device: False)
    store = open_store(f"disk://{tmp_path}/store")
    w = worker_mod.UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=NUM_BLOCKS,
                             max_pending_nbytes=1 << 30, stats=StatsCollector(),
                             save_layerwise={"auto": None, "save": True, "load": False}[asked],
                             load_mode="layer" if asked == "load" else "sync")
    with caplog.at_level(logging.INFO, logger="vllm.ucm_connector.worker"):
        w.register_kv_caches(_caches(3, "cuda"))
    said = [r for r in caplog.records if "pitched copies are unavailable" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO if asked == "auto" else logging.WARNING]
    assert not w.saves.layerwise
    w.close()
    store.close()


def _all_rows_free(w) -> bool:
    rows = w.save_pool.take(w.save_pool.capacity, wait=True, timeout=10)
    if rows is None:
        return False
    rows.release()
    return True


def test_a_layerwise_save_stores_each_layer_as_its_attention_left_it(store, device, monkeypatch):
    """begin_step with the step's saves, then save_layer as each layer's
    pages are written: the stored blocks hold those bytes.  On CPU the pages
    are overwritten after the last layer and before wait_for_save, so a
    gather made there (not layer by layer) would store the wrong bytes; on
    CUDA the overwrite is queued after wait_for_save and must not reach the
    rows.  A block the store has is skipped, a save computed on a failed
    load is dropped, and every row comes back to the pool."""
    src = _caches(11, device)
    w = _layerwise_worker(store, src, monkeypatch, share_failures=lambda mine: mine | {20},
                          events=OutcomeLog(enabled=True))
    keys = _keys(6)
    assert store.put([keys[1]], [b"already there"]) == [True]
    plans = [BlockPlan("r", [0, 1, 2], keys[:3]), BlockPlan("s", [5, 6], keys[3:5]),
             BlockPlan("t", [7], keys[5:6], loaded_inputs=[20])]
    w.begin_step(64, [], [], saves=plans)
    for layer, (name, cache) in enumerate(src.items()):
        cache[[0, 2, 5, 6, 7]] = float(layer + 1)      # the layer's attention writes its pages
        w.save_layer(name)
    want = _pages(src, [0, 2, 5, 6])
    if device == "cpu":
        for cache in src.values():
            cache[[0, 2, 5, 6, 7]] = -1.0
    w.end_step()
    w.save(plans)
    for cache in src.values():
        cache[[0, 2, 5, 6, 7]] = -2.0
    assert w.flush(10)
    assert store.contains(keys) == [True, True, True, True, True, False]
    got = [bytes(v)[blockfmt.HEADER_NBYTES:] for v in store.get([keys[0], keys[2], keys[3], keys[4]])]
    assert got == want
    assert sorted(w.events.take()) == sorted([("written", keys[0]), ("present", keys[1]), ("written", keys[2]),
                                              ("written", keys[3]), ("written", keys[4]),
                                              ("not_stored", keys[5])])
    assert w.stats.totals()["layerwise_saved_blocks"] == 4
    assert _all_rows_free(w)
    w.close()


def test_a_layer_gather_no_save_takes_gives_its_rows_back(store, device, monkeypatch):
    """A step begun with saves whose wait_for_save brings other plans (or
    none), or a second begin_step before any save: the layer gather's rows
    come back, and plans not begun are saved the usual way."""
    src = _caches(12, device)
    w = _layerwise_worker(store, src, monkeypatch)
    keys = _keys(4)
    w.begin_step(64, [], [], saves=[BlockPlan("r", [0, 1], keys[:2])])
    w.begin_step(64, [], [], saves=[BlockPlan("r", [0, 1], keys[:2])])
    for name in src:
        w.save_layer(name)
    w.save([BlockPlan("q", [2, 3], keys[2:4])])
    w.begin_step(64, [], [], saves=[BlockPlan("r", [0], keys[:1])])
    w.save([])
    assert w.flush(10)
    assert store.contains(keys) == [False, False, True, True]
    assert [bytes(v)[blockfmt.HEADER_NBYTES:] for v in store.get(keys[2:4])] == _pages(src, [2, 3])
    assert w.stats.totals()["layerwise_saved_blocks"] == 0
    assert _all_rows_free(w)
    w.close()


@pytest.mark.parametrize("fails_in", ["save_kv_layer", "wait_for_save"])
def test_a_layer_copy_that_fails_never_fails_the_step_and_the_save_is_made_whole(tmp_path, monkeypatch,
                                                                                   fails_in):
    """A layer copy raises (in save_kv_layer, or for a layer copied in
    wait_for_save): the hook returns normally, the step's blocks are
    gathered whole after the forward pass and stored right, and every row
    comes back."""
    from ucm_connector.transfer import BlockTransfer

    store = open_store(f"disk://{tmp_path}/store")
    src = _caches(13)
    w = _layerwise_worker(store, src, monkeypatch)
    names = list(src)
    copy_layer = BlockTransfer.gather_layer
    failed = []

    def fails_once(self, layer, block_ids, out):
        if layer == 1 and not failed:
            failed.append(layer)
            raise RuntimeError("copy failed")
        return copy_layer(self, layer, block_ids, out)

    monkeypatch.setattr(BlockTransfer, "gather_layer", fails_once)
    keys = _keys(3)
    plans = [BlockPlan("r", [0, 1, 2], keys)]
    w.begin_step(64, [], [], saves=plans)
    for name in names if fails_in == "save_kv_layer" else names[:1]:
        w.save_layer(name)
    assert bool(failed) == (fails_in == "save_kv_layer")
    w.save(plans)
    assert failed
    assert w.flush(10)
    assert [bytes(v)[blockfmt.HEADER_NBYTES:] for v in store.get(keys)] == _pages(src, [0, 1, 2])
    assert w.stats.totals()["layerwise_saved_blocks"] == 0
    assert _all_rows_free(w)
    w.close()
    store.close()


def test_the_worker_side_imports_without_vllm():
    """The worker's modules run where vLLM cannot (a GPU check machine)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "class NoVllm:\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'vllm' or name.startswith('vllm.'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, NoVllm())\n"
            "import ucm_connector.worker, ucm_connector.transfer, ucm_connector.plans\n"
            "import ucm_connector.measure, ucm_connector.loadpolicy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- load_policy auto: what the worker measures ------------------------------------------


@pytest.fixture
def slow_tier(tmp_path, redis_server):
    """A tier: a disk store in front of a Redis behind a throttling proxy
    (tests/throttle_proxy.py), throttled by each test."""
    from throttle_proxy import ThrottleProxy

    proxy = ThrottleProxy(("127.0.0.1", redis_server.port)).start()
    ns = "w" + time.strftime("%H%M%S") + str(id(proxy))[-6:]
    urls = [f"disk://{tmp_path}/front", f"redis://127.0.0.1:{proxy.port}/0?namespace={ns}&timeout=30"]
    store = open_store(urls)
    yield store, proxy
    store.close()
    proxy.close()


def _measuring_worker(store, caches):
    from ucm_connector.measure import LoadObserver

    w = worker_mod.UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=NUM_BLOCKS,
                             max_pending_nbytes=1 << 30, stats=StatsCollector(), blocks_per_request=8,
                             observer=LoadObserver())
    w.register_kv_caches(caches)
    return w


def _stored_in_tiers(store, keys, num_front: int) -> None:
    """Every key saved in the lower tier, the first ``num_front`` in the front one too."""
    saver = _worker(store.stores[1], _caches(11))
    saver.save([BlockPlan("r", list(range(len(keys))), keys)])
    assert saver.flush(10)
    saver.close()
    front = _worker(store.stores[0], _caches(11))
    front.save([BlockPlan("r", list(range(num_front)), keys[:num_front])])
    assert front.flush(10)
    front.close()


def test_reads_are_timed_per_tier_and_the_forward_pass_without_them(slow_tier):
    store, proxy = slow_tier
    keys = _keys(7)
    _stored_in_tiers(store, keys, num_front=3)
    w = _measuring_worker(store, _caches(12))
    proxy.set_rate(200_000)
    plans = [BlockPlan("q", list(range(10, 17)), keys)]
    w.begin_step(200, plans, [])
    t0 = time.perf_counter()
    w.load(plans)
    load_seconds = time.perf_counter() - t0
    time.sleep(0.05)                                   # the forward pass
    w.end_step()
    assert w.take_load_errors() == set()
    reads, steps = w.take_measurements()
    by_tier = {r.tier: r for r in reads}
    assert sorted(by_tier) == [0, 1]
    assert by_tier[0].num_blocks == 3 and by_tier[1].num_blocks == 4
    assert by_tier[1].nbytes == 4 * w.block_nbytes
    assert by_tier[1].seconds > 10 * by_tier[0].seconds, "the throttled tier does not read slower"
    assert load_seconds > 0.3
    (step,) = steps
    assert step.num_tokens == 200
    assert 0.05 <= step.seconds < 0.05 + load_seconds / 2, "the load's time was counted as the forward pass's"
    assert w.take_measurements() is None
    w.close()


def test_a_probe_reads_its_tier_in_the_background_and_touches_no_page(slow_tier):
    from ucm_connector.plans import BlockProbe

    store, proxy = slow_tier
    keys = _keys(4)
    _stored_in_tiers(store, keys, num_front=0)
    caches = _caches(13)
    before = _pages(caches, range(NUM_BLOCKS))
    w = _measuring_worker(store, caches)
    proxy.set_rate(100_000)
    t0 = time.perf_counter()
    w.begin_step(0, [], [BlockProbe(1, keys[:2]), BlockProbe(1, keys[2:4])])
    w.end_step()
    assert time.perf_counter() - t0 < 0.1, "the step waited for the probe"
    deadline = time.monotonic() + 10
    reads = []
    while time.monotonic() < deadline and not reads:
        time.sleep(0.05)
        measured = w.take_measurements()
        reads = measured[0] if measured else []
    assert [(r.tier, r.num_blocks) for r in reads] == [(1, 2)], "one probe per tier at a time"
    time.sleep(0.3)
    assert w.take_measurements() is None
    assert _pages(caches, range(NUM_BLOCKS)) == before
    w.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_step_clock_times_the_device_and_never_waits_for_it():
    from ucm_connector.measure import LoadObserver, StepClock

    observer = LoadObserver()
    clock = StepClock(observer, on_cuda=True)
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    clock.begin(512)
    t0 = time.perf_counter()
    for _ in range(50):
        a = torch.tanh(a @ a)
    clock.end()
    host_seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    clock.begin(1)
    clock.end()                                        # collects the first step, now complete
    reads, steps = observer.take()
    assert steps[0].num_tokens == 512
    assert steps[0].seconds > host_seconds, "the clock timed the host's launches, not the device's work"


def test_a_copy_that_raises_costs_blocks_never_the_step(tmp_path, monkeypatch, device):
    """A copy between the pages and host rows that raises (on a GPU: no
    device memory left for a staging slot) costs that step's saves, or a
    recompute of the blocks being loaded; the hook returns, and later steps
    save and load again."""
    s = open_store(f"disk://{tmp_path}/store")
    s.reads_into_parts = False                    # loads go through rows, as on a GPU

    def raising(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    src, keys = _caches(3, device), _keys(2)
    saver = _worker(s, src)
    real = saver.transfer.gather_rows
    monkeypatch.setattr(saver.transfer, "gather_rows", raising)
    saver.begin_step(0, [], [])
    saver.save([BlockPlan("r", [0, 1], keys)])
    assert saver.flush(10) and s.contains(keys) == [False, False]
    assert saver.stats.take()["skipped_saves"] == 2
    monkeypatch.setattr(saver.transfer, "gather_rows", real)
    saver.save([BlockPlan("r", [0, 1], keys)])
    assert saver.flush(10) and s.contains(keys) == [True, True]
    saver.close()

    dst = _caches(4, device)
    loader = _worker(s, dst)
    real = loader.transfer.scatter_rows
    monkeypatch.setattr(loader.transfer, "scatter_rows", raising)
    loader.begin_step(0, [], [])
    loader.load([BlockPlan("q", [5, 6], keys)])
    assert loader.take_load_errors() == {5, 6}
    monkeypatch.setattr(loader.transfer, "scatter_rows", real)
    loader.begin_step(0, [], [])
    loader.load([BlockPlan("q", [5, 6], keys)])
    assert loader.take_load_errors() == set()
    assert _pages(dst, [5, 6]) == _pages(src, [0, 1])
    loader.close()
    s.close()


def test_with_no_room_for_staging_buffers_at_start_up_the_worker_warns_and_still_saves_and_loads(
        store, monkeypatch, caplog):
    from ucm_connector.transfer import BlockTransfer

    asked = []

    def no_room(self, row_nbytes, gather=True, scatter=True):
        asked.append((gather, scatter))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB")

    monkeypatch.setattr(BlockTransfer, "reserve_staging", no_room)
    src, keys = _saved(store, 3, 4)
    assert asked == [(True, True)]
    assert "no room on the GPU for the KV staging buffers (256 MiB)" in caplog.text
    assert _load_back(store, keys, [20, 21, 22, 23], 4) == _pages(src, range(4))
    # A producer only saves: it asks for the gather's slots alone.
    caplog.clear()
    producer = worker_mod.UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=NUM_BLOCKS,
                                    max_pending_nbytes=1 << 30, stats=StatsCollector(), copies=(False, True))
    producer.register_kv_caches(_caches(5))
    producer.close()
    assert asked[-1] == (True, False) and "buffers (128 MiB)" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_staging_buffers_stay_out_of_the_memory_pool_the_caches_are_registered_in(tmp_path):
    """vLLM 0.33 registers the KV caches inside its sleep-mode allocator's
    ``runtime`` pool, which it copies to the host at every sleep: the
    staging buffers, given back at a sleep and taken again at wake-up, are
    taken outside it."""
    store = open_store(f"disk://{tmp_path}/store")
    caches = _caches(0, "cuda")
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        w = _worker(store, caches)
    try:
        assert w.transfer._gather_ring.buffer is not None and w.transfer._scatter_ring.buffer is not None
        in_pool = sum(segment["total_size"] for segment in pool.snapshot())
        assert in_pool < w.transfer.staging_nbytes, f"{in_pool} bytes taken in the caller's pool"
    finally:
        w.close()
        store.close()


@pytest.mark.parametrize("mode", ["async", "layer"])
def test_sleep_mode_waits_for_the_loads_in_flight_and_gives_the_staging_back(tmp_path, mode, device):
    """vLLM 0.33 calls unregister_kv_caches just before it unmaps the KV
    cache: a load still on its way into the pages (one for a request the
    pause aborted) must be in before that returns, and the device staging
    buffers go back to the device. After restore_kv_caches the worker loads
    and saves as before."""
    store = open_store(f"disk://{tmp_path}/store")
    src, keys = _saved(store, 1, 6, device)
    dst = _caches(2, device)
    w = _worker(store, dst, mode)
    reading, go_on = threading.Event(), threading.Event()
    for name in ("get_into", "get_into_parts"):
        real = getattr(store, name)

        def held(*args, _real=real, **kwargs):
            reading.set()
            assert go_on.wait(10)
            return _real(*args, **kwargs)
        setattr(store, name, held)
    w.load([BlockPlan("q", list(range(10, 16)), keys)])
    assert reading.wait(10)
    suspend = threading.Thread(target=w.suspend)
    suspend.start()
    suspend.join(0.3)
    assert suspend.is_alive()                   # the load is still reading
    go_on.set()
    suspend.join(10)
    assert not suspend.is_alive()
    assert _pages(dst, range(10, 16)) == _pages(src, range(6))     # in before suspend returned
    if device == "cuda":
        assert w.transfer._gather_ring.buffer is None and w.transfer._scatter_ring.buffer is None
    w.suspend()                                 # twice: nothing more
    w.resume()
    if device == "cuda":
        assert w.transfer._scatter_ring.buffer is not None
    for name in ("get_into", "get_into_parts"):
        delattr(store, name)
    if mode == "async":
        _wait_loaded(w, "q")
    assert w.take_load_errors() == set()
    w.save([BlockPlan("r", [10, 11], _keys(8)[6:])])
    assert w.flush(10)
    assert _load_back(store, _keys(8)[6:], [20, 21], 3, device) == _pages(src, range(2))
    w.close()
    store.close()
