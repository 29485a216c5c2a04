"""UCMWorker without an engine: real stores, real torch caches shaped like
vLLM's CPU layout, on the CPU and, where there is one, on a CUDA device;
loads in each mode put back exactly the saved bytes, bad blocks are reported
and dropped."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from store_backends import open_store
from ucm_connector import blockfmt, worker as worker_mod
from ucm_connector.outcomes import OutcomeLog
from ucm_connector.hashing import keys_for_rank
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


def _keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 16 + b"\0\0" for i in range(n)]


def _pages(caches, block_ids) -> list[bytes]:
    return [b"".join(c[b].contiguous().view(torch.uint8).cpu().numpy().tobytes() for c in caches.values())
            for b in block_ids]


@pytest.fixture
def store(tmp_path):
    s = open_store(f"disk://{tmp_path}/store")
    yield s
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


@pytest.mark.parametrize("mode", ["sync", "async", "layer"])
def test_a_bad_block_is_reported_dropped_and_the_others_loaded(store, mode, device):
    src = _caches(3, device)
    saver = _worker(store, src)
    keys = _keys(4)
    saver.save([BlockPlan("r", [0, 1, 2, 3], keys)])
    assert saver.flush(10)
    saver.close()
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
    assert _pages(dst, [12]) == before, "a bad block's bytes reached the cache"
    assert store.contains(keys) == [True, True, False, True], "the bad block was not dropped"
    assert loader.stats.totals()["load_errors"] == 1
    outcomes = loader.events.take()
    assert outcomes == [("removed", keys[2])]
    loader.close()


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


@pytest.mark.parametrize("mode", ["sync", "layer"])
def test_kv_computed_on_a_block_that_failed_to_load_is_not_saved(store, mode, device):
    """A block fails its check in this step's load: the step's saves that
    read it (``loaded_inputs``) are dropped; the others are written."""
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
    w.load([BlockPlan("q", [10, 11, 12], keys[:3])])
    if mode == "layer":
        for name in w._layer_index:
            w.wait_for_layer(name)
    w.save([BlockPlan("q", [13, 14], keys[3:5], loaded_inputs=[10, 11, 12]),
            BlockPlan("other", [15], keys[5:6], loaded_inputs=[])])
    assert w.flush(10)
    assert w.take_load_errors() == {11}
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
            "import ucm_connector.worker, ucm_connector.transfer, ucm_connector.plans\n")
    subprocess.run([sys.executable, "-c", code], check=True)
