"""The connector's worker on a CUDA device, without vLLM: saves and loads of
a batch of blocks through ``UCMWorker`` (row pools, the background writer,
block checks) against raw pinned copies of the same bytes, measured in one
run.

    python benchmarks/gpu_worker_bench.py [--blocks 128] [--reps 5] [--layer-ms 1.0]

Caches are vLLM 0.33's default layout (``LBNHC`` views into one buffer) with
Llama-3-8B attention shapes (32 layers, 8 KV heads, head size 128, 16-token
blocks, bf16: 2 MiB per block).  The store is an in-memory dict (a copy per
put and per get, like a local store at memory speed), so the figures are the
worker's own cost: what the engine thread spends in ``wait_for_save`` /
``start_load_kv``, and the time until the blocks are in the store / in the
pages (a save seals each block with xxh3 checksums, a load checks them: one
core's xxh3 rate is printed as the host-side bound).  A second table puts a
save inside a stand-in forward pass (``--layer-ms`` of compute-stream work
per layer) and compares a save gathered after it with one gathered layer by
layer (``save_layerwise``).  ``--json`` writes both tables too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from store_backends.base import KVStore, StoreStats  # noqa: E402
from ucm_connector import blockfmt  # noqa: E402
from ucm_connector.cache_views import fill_random_, vllm_layer_caches  # noqa: E402
from ucm_connector.config import LoadMode  # noqa: E402
from ucm_connector.counters import StatsCollector  # noqa: E402
from ucm_connector.hashing import keys_for_rank  # noqa: E402
from ucm_connector.plans import BlockPlan  # noqa: E402
from ucm_connector.worker import UCMWorker  # noqa: E402


class MemStore(KVStore):
    """Blocks in one preallocated arena: every put and get is one memcpy,
    as in a local shared-memory store, with no allocation on the way."""

    url = "mem://"

    def __init__(self, capacity_nbytes: int) -> None:
        self.arena = np.empty(capacity_nbytes, dtype=np.uint8)
        self.arena.fill(0)
        self.index: dict[bytes, tuple[int, int]] = {}
        self.used = 0

    def clear(self) -> None:
        self.index.clear()
        self.used = 0

    def put(self, keys, values):
        for k, v in zip(keys, values):
            src = np.frombuffer(v, dtype=np.uint8)
            lo = self.used
            self.arena[lo:lo + src.size] = src
            self.used += src.size
            self.index[k] = (lo, src.size)
        return [True] * len(keys)

    def get_into(self, keys, buffers):
        out = []
        for k, buf in zip(keys, buffers):
            where = self.index.get(k)
            if where is not None:
                lo, n = where
                np.frombuffer(buf, dtype=np.uint8)[:n] = self.arena[lo:lo + n]
            out.append(where is not None)
        return out

    def get(self, keys):
        return [bytes(self.arena[w[0]:w[0] + w[1]]) if (w := self.index.get(k)) else None for k in keys]

    def contains(self, keys):
        return [k in self.index for k in keys]

    def delete(self, keys):
        for k in keys:
            self.index.pop(k, None)

    def stats(self):
        return StoreStats(url=self.url, num_blocks=len(self.index), nbytes=self.used)

    def close(self):
        pass


def _raw_copies(nbytes: int, reps: int) -> tuple[float, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
    return float(np.median(d2h)), float(np.median(h2d))


def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles that keep the compute stream busy 1 ms."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _saves_in_a_forward_pass(caches, args, ns: bytes) -> list[dict]:
    """A step that saves ``--blocks`` blocks, its forward pass stood in for
    by ``--layer-ms`` of compute-stream work per layer: how much later the
    compute stream is free for the next step than after the forward pass
    alone (the save's page reads hold it back), what the engine thread
    spends in the hooks, and when the blocks are in the store; saved after
    the forward pass (``wait_for_save``) and layer by layer
    (``save_layerwise``).  A few blocks are read back from the store: the
    two ways must have stored the same bytes."""
    from ucm_connector import saves as saves_mod

    n = args.blocks
    cycles = int(args.layer_ms * _sleep_cycles_per_ms())
    names = list(caches)
    out = []
    samples: list[bytes] = []
    for layerwise in (False, True):
        store = MemStore(n * blockfmt.block_nbytes(len(names) * 8 * 16 * 2 * 128 * 2) + (1 << 20))
        w = UCMWorker(store=store, namespace_digest=ns, tp_rank=0, num_blocks=args.num_blocks,
                      max_pending_nbytes=2 * n * (2 << 20) + (1 << 20), stats=StatsCollector(),
                      blocks_per_request=n, save_layerwise=layerwise)
        w.register_kv_caches(caches)
        payload = w.payload_nbytes
        assert w.saves.layerwise == layerwise, "no layer gathers here (CUDA runtime library?)"
        assert n * payload >= saves_mod.LAYERWISE_SAVE_MIN_NBYTES or not layerwise
        alone, extra, hooks, stored = [], [], [], []
        for rep in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in names:
                torch.cuda._sleep(cycles)
            torch.cuda.current_stream().synchronize()
            alone.append(time.perf_counter() - t0)
            keys = [b"f%d-%d-%d" % (layerwise, rep, i) for i in range(n)]
            plans = [BlockPlan("r", list(range(n)), keys)]
            store.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host = 0.0
            h = time.perf_counter()
            w.begin_step(n * 16, [], [], saves=plans)
            host += time.perf_counter() - h
            for name in names:
                torch.cuda._sleep(cycles)
                h = time.perf_counter()
                w.save_layer(name)
                host += time.perf_counter() - h
            h = time.perf_counter()
            w.end_step()
            w.save(plans)
            host += time.perf_counter() - h
            torch.cuda.current_stream().synchronize()   # the next step could start here
            free = time.perf_counter() - t0
            assert w.flush(60)
            stored.append(time.perf_counter() - t0)
            extra.append(free - alone[-1])
            hooks.append(host)
        # Both ways store the same bytes for the same blocks.
        got = store.get(keys_for_rank(keys, 0))   # the worker stores its rank's keys
        payloads = [bytes(got[i])[blockfmt.HEADER_NBYTES:] for i in (0, n // 2, n - 1)]
        if samples:
            assert payloads == samples, "a block saved layer by layer differs from the same block saved whole"
        samples = payloads
        out.append({"save": "layer by layer" if layerwise else "after the forward pass",
                    "forward_ms": 1e3 * float(np.median(alone)),
                    "compute_extra_ms": 1e3 * float(np.median(extra)),
                    "engine_thread_ms": 1e3 * float(np.median(hooks)),
                    "stored_ms": 1e3 * float(np.median(stored)),
                    "layerwise_saved_blocks": w.stats.totals()["layerwise_saved_blocks"]})
        w.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layer-ms", type=float, default=1.0,
                   help="compute-stream work per layer standing in for a forward pass (saves during one)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    n = args.blocks
    raw, caches = vllm_layer_caches("LBNHC", num_layers=args.layers, num_blocks=args.num_blocks, num_heads=8,
                                  block_size=16, content_nbytes=2 * 128 * 2, dtype=torch.bfloat16, device="cuda")
    fill_random_(caches, raw, seed=1)
    caches_nbytes_per_block = args.layers * 8 * 16 * 2 * 128 * 2
    # The host-side bound: the checksums the envelope needs, one core.
    import xxhash

    sample = np.random.default_rng(0).integers(0, 255, n * caches_nbytes_per_block, dtype=np.uint8)
    t0 = time.perf_counter()
    for lo in range(0, sample.size, caches_nbytes_per_block):
        xxhash.xxh3_64_intdigest(memoryview(sample[lo:lo + caches_nbytes_per_block]))
    xxh3_gbps = sample.size / (time.perf_counter() - t0) / 1e9
    ns = b"gpu-worker-bench"
    rows = []
    raw_d2h = raw_h2d = None
    for mode in (LoadMode.SYNC, LoadMode.LAYER, LoadMode.ASYNC):
        store = MemStore(n * blockfmt.block_nbytes(caches_nbytes_per_block) + (1 << 20))
        w = UCMWorker(store=store, namespace_digest=ns, tp_rank=0, num_blocks=args.num_blocks,
                      max_pending_nbytes=2 * n * (2 << 20) + (1 << 20), stats=StatsCollector(),
                      blocks_per_request=n, load_mode=mode)
        w.register_kv_caches(caches)
        payload = w.payload_nbytes
        if raw_d2h is None:
            raw_d2h, raw_h2d = _raw_copies(n * payload, args.reps)
        save_call, save_done, load_call, load_done = [], [], [], []
        for rep in range(args.reps):
            keys = [b"k%d-%d" % (rep, i) for i in range(n)]
            src = list(range(n))
            dst = list(range(n, 2 * n))
            store.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.save([BlockPlan("r", src, keys)])
            t1 = time.perf_counter()
            assert w.flush(60)
            t2 = time.perf_counter()
            save_call.append(t1 - t0)
            save_done.append(t2 - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.load([BlockPlan("q", dst, keys)])
            t1 = time.perf_counter()
            if mode is LoadMode.ASYNC:
                while not (w.get_finished() or set()):
                    time.sleep(0.0002)
            else:
                for name in caches:
                    w.wait_for_layer(name)
            assert w.take_load_errors() == set()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            load_call.append(t1 - t0)
            load_done.append(t2 - t0)
        # The loaded pages hold exactly the saved ones.
        for name, view in caches.items():
            assert torch.equal(view[n:2 * n].view(torch.uint8), view[:n].view(torch.uint8)), name
        nbytes = n * payload
        rows.append({
            "mode": mode.value,
            "save_call_ms": 1e3 * float(np.median(save_call)),
            "save_gbps": nbytes / float(np.median(save_done)) / 1e9,
            "load_call_ms": 1e3 * float(np.median(load_call)),
            "load_gbps": nbytes / float(np.median(load_done)) / 1e9,
            "raw_d2h_gbps": nbytes / raw_d2h / 1e9,
            "raw_h2d_gbps": nbytes / raw_h2d / 1e9,
        })
        w.close()
    name = torch.cuda.get_device_name()
    print(f"{name}; {n} blocks of {payload / 2**20:.1f} MiB per batch, in-memory store; medians of {args.reps}")
    print("| load mode | save: engine thread ms | save to store GB/s | ÷ raw d2h | load: engine thread ms "
          "| load into pages GB/s | ÷ raw h2d |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['save_call_ms']:.2f} | {r['save_gbps']:.1f} | "
              f"{r['save_gbps'] / r['raw_d2h_gbps']:.2f} | {r['load_call_ms']:.2f} | {r['load_gbps']:.1f} | "
              f"{r['load_gbps'] / r['raw_h2d_gbps']:.2f} |")
    print(f"raw pinned copies: d2h {rows[0]['raw_d2h_gbps']:.1f} GB/s, h2d {rows[0]['raw_h2d_gbps']:.1f} GB/s; "
          f"xxh3_64 on one core: {xxh3_gbps:.1f} GB/s")
    forward = _saves_in_a_forward_pass(caches, args, ns)
    print(f"\nA step saving {n} blocks, {args.layers} layers of {args.layer_ms} ms of compute-stream work "
          f"standing in for its forward pass; medians of {args.reps}")
    print("| save | forward pass alone ms | compute stream free later by ms | engine thread in hooks ms "
          "| in the store after ms | blocks saved layer by layer |")
    print("|---|---|---|---|---|---|")
    for r in forward:
        print(f"| {r['save']} | {r['forward_ms']:.1f} | {r['compute_extra_ms']:.2f} | {r['engine_thread_ms']:.2f} "
              f"| {r['stored_ms']:.1f} | {r['layerwise_saved_blocks']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows, "xxh3_gbps": xxh3_gbps, "saves_in_a_forward_pass": forward},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
