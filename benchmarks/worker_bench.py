"""The connector's own data path on CPU, against the store alone, in one run.

    .venv/bin/python benchmarks/worker_bench.py [--stores shm,disk,redis,tier] [--blocks 64] [--reps 5]

``UCMWorker`` (no vLLM: the worker side imports without it) saves and loads
batches of blocks between vLLM CPU-style caches (one contiguous
``[num_blocks, kv_heads, block_size, 2*head_size]`` tensor per layer,
SmolLM2-135M's shapes: 30 layers, 3 KV heads, head size 64, 128-token
blocks, bf16, so 2.95 MB per block) and a real store.  A save is timed from
``save`` until every block is put: straight from the pages where the store
writes from parts (shm), else gather, envelope, checksum and the writer's
put; the same save through the writer is timed beside it, with how long
each holds the engine thread; and the same again with ``save_layerwise`` (each layer copied as
``save_kv_layer`` would report it, back to back here: on CPU that overlaps
nothing, it only copies in another order); a load from ``load`` until every
block is checked and in its pages
(``sync`` mode: the engine thread does it all), straight into the pages
where the store can (``reads_into_parts``), and again through host rows.
The store alone is the same store's ``put`` / ``get_into`` of the same
sized rows with the same batch, which is what ``ucm-bench --ops put,get``
times.  The two alternate
within each repeat; a ratio is the median of the per-repeat ratios.

Also printed, each on its own: the gather / scatter of the batch (the
copies between pages and rows) and the envelope (seal / check, xxh3 over
the payload), so that where the time goes is visible.  Every loaded page is
compared with the saved one at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from store_backends import open_store  # noqa: E402
from store_backends.shm import stop_server  # noqa: E402
from ucm_connector import blockfmt  # noqa: E402
from ucm_connector.config import LoadMode  # noqa: E402
from ucm_connector.counters import StatsCollector  # noqa: E402
from ucm_connector.plans import BlockPlan  # noqa: E402
from ucm_connector.worker import UCMWorker  # noqa: E402
from ucm_testing.servers import RedisServer  # noqa: E402

NS = b"worker-bench-ns-"


def cpu_caches(num_layers: int, num_blocks: int, heads: int, block_size: int, head_size: int
               ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randint(-30000, 30000, (num_blocks, heads, block_size, 2 * head_size), generator=g,
                          dtype=torch.int16).view(torch.bfloat16)
            for i in range(num_layers)}


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def bench_store(url: str | list[str], args, caches) -> dict:
    n = args.blocks
    store = open_store(url)
    w = UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=args.num_blocks,
                  max_pending_nbytes=2 * n * 3 << 20, stats=StatsCollector(),
                  blocks_per_request=n, load_mode=LoadMode.SYNC)
    w.register_kv_caches(caches)
    # The same saves with save_layerwise: each layer copied as the forward
    # pass would report it (here, back to back), then sealed and put.
    wl = UCMWorker(store=store, namespace_digest=NS, tp_rank=0, num_blocks=args.num_blocks,
                   max_pending_nbytes=2 * n * 3 << 20, stats=StatsCollector(),
                   blocks_per_request=n, load_mode=LoadMode.SYNC, save_layerwise=True)
    wl.register_kv_caches(caches)
    payload = w.payload_nbytes
    # A tier's background writes to its lower tiers, finished between the
    # timed parts (never timed).
    flush = getattr(store, "flush", None)

    def settle() -> None:
        if flush is not None:
            assert flush(timeout=120)
    block = blockfmt.block_nbytes(payload)
    nbytes = n * payload
    rows = np.random.default_rng(1).integers(0, 255, (n, block), dtype=np.uint8)
    out = np.empty_like(rows)
    views = [memoryview(r) for r in rows]
    out_views = [memoryview(r) for r in out]
    t = {k: [] for k in ("save", "save_writer", "engine", "engine_writer", "save_layers", "load", "rows",
                         "put", "get", "gather", "scatter", "seal", "check")}
    src = list(range(n))
    dst = list(range(n, 2 * n))
    for rep in range(args.warmup + args.reps):
        keep = rep >= args.warmup
        keys = [b"%s-w%d-%d" % (uuid.uuid4().hex.encode(), rep, i) for i in range(n)]
        t0 = time.perf_counter()
        w.save([BlockPlan("r", src, keys)])
        t_engine = time.perf_counter() - t0
        assert w.flush(120)
        t_save = time.perf_counter() - t0
        settle()
        # The same save through the writer, where the store could take it
        # straight from the pages (``writes_from_parts``: shm).
        writer_keys = [b"%s-x%d-%d" % (uuid.uuid4().hex.encode(), rep, i) for i in range(n)]
        direct, w.saves.direct = w.saves.direct, False
        try:
            t0 = time.perf_counter()
            w.save([BlockPlan("r", src, writer_keys)])
            t_engine_writer = time.perf_counter() - t0
            assert w.flush(120)
            t_save_writer = time.perf_counter() - t0
            settle()
        finally:
            w.saves.direct = direct
        store.delete(writer_keys)
        layer_keys = [b"%s-l%d-%d" % (uuid.uuid4().hex.encode(), rep, i) for i in range(n)]
        plans = [BlockPlan("r", src, layer_keys)]
        t0 = time.perf_counter()
        wl.begin_step(n, [], [], saves=plans)
        for name in caches:
            wl.save_layer(name)
        wl.save(plans)
        assert wl.flush(120)
        t_save_layers = time.perf_counter() - t0
        store.delete(layer_keys)
        t0 = time.perf_counter()
        w.load([BlockPlan("q", dst, keys)])
        t_load = time.perf_counter() - t0
        assert w.take_load_errors() == set(), "a block failed its check"
        # The same load through host rows (a store that cannot read into
        # parts): read into rows, checked there, then copied into the pages.
        with mock.patch.object(type(w.loads.reader), "into_pages", False):
            t0 = time.perf_counter()
            w.load([BlockPlan("q", dst, keys)])
            t_rows = time.perf_counter() - t0
        assert w.take_load_errors() == set(), "a block failed its check"
        # The store alone: the same rows, put and read back with one call each.
        raw_keys = [b"%s-s%d-%d" % (uuid.uuid4().hex.encode(), rep, i) for i in range(n)]
        t0 = time.perf_counter()
        assert all(store.put(raw_keys, views))
        t_put = time.perf_counter() - t0
        settle()
        t0 = time.perf_counter()
        assert all(store.get_into(raw_keys, out_views))
        t_get = time.perf_counter() - t0
        store.delete(keys + raw_keys)
        # The parts: copies between pages and rows, and the envelope.
        pool_rows = w.save_pool.take(n)
        try:
            t0 = time.perf_counter()
            w.transfer.gather_rows(src, pool_rows).wait()
            t_gather = time.perf_counter() - t0
            t0 = time.perf_counter()
            for row, key in zip(pool_rows.rows, keys):
                blockfmt.pack_into(row, NS, payload, key=key)
            t_seal = time.perf_counter() - t0
            t0 = time.perf_counter()
            for row, key in zip(pool_rows.rows, keys):
                blockfmt.verify(row, NS, payload, key=key)
            t_check = time.perf_counter() - t0
            t0 = time.perf_counter()
            w.transfer.scatter_rows(dst, pool_rows).wait()
            t_scatter = time.perf_counter() - t0
        finally:
            pool_rows.release()
        if keep:
            for k, v in (("save", t_save), ("save_writer", t_save_writer), ("engine", t_engine),
                         ("engine_writer", t_engine_writer), ("save_layers", t_save_layers), ("load", t_load),
                         ("rows", t_rows), ("put", t_put), ("get", t_get),
                         ("gather", t_gather), ("scatter", t_scatter), ("seal", t_seal), ("check", t_check)):
                t[k].append(v)
    for name, view in caches.items():
        assert torch.equal(view[n:2 * n].view(torch.int16), view[:n].view(torch.int16)), name
    assert wl.stats.totals()["layerwise_saved_blocks"] == n * (args.warmup + args.reps)
    w.close()
    wl.close()
    store.close()
    gbps = {k: nbytes / _median(v) / 1e9 for k, v in t.items()}
    return {
        "store": "tier" if isinstance(url, list) else url.split(":")[0], "blocks": n, "block_mb": payload / 1e6,
        "gbps": gbps,
        "save_ratio": _median([p / s for p, s in zip(t["put"], t["save"])]),
        "writer_ratio": _median([p / s for p, s in zip(t["put"], t["save_writer"])]),
        "direct": direct,
        "engine_ms": 1000 * _median(t["engine"]), "engine_writer_ms": 1000 * _median(t["engine_writer"]),
        "load_ratio": _median([g / s for g, s in zip(t["get"], t["load"])]),
        "rows_ratio": _median([g / s for g, s in zip(t["get"], t["rows"])]),
        "into_pages": getattr(store, "reads_into_parts", False),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="shm,disk,redis",
                   help="store kinds, of shm, disk, redis and tier (shm over disk, async)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per batch (default 64: 189 MB)")
    p.add_argument("--num-blocks", type=int, default=160, help="blocks in the cache")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.num_blocks < 2 * args.blocks:
        p.error("--num-blocks must be at least twice --blocks")
    caches = cpu_caches(args.layers, args.num_blocks, heads=3, block_size=128, head_size=64)
    results = []
    tmp = tempfile.mkdtemp(prefix="ucm-worker-bench-")
    shm_name = "wb" + uuid.uuid4().hex[:8]
    redis = None
    try:
        for kind in args.stores.split(","):
            if kind == "shm":
                url = f"shm://{shm_name}?capacity=2GiB"
            elif kind == "disk":
                url = f"disk://{tmp}/disk?capacity=4GiB"
            elif kind == "redis":
                redis = RedisServer(extra=["--maxmemory", "2gb"]).start()
                url = redis.url
            elif kind == "tier":
                url = [f"shm://{shm_name}t?capacity=2GiB", f"disk://{tmp}/tier?capacity=4GiB"]
            else:
                p.error(f"unknown store kind {kind!r} (shm, disk, redis, tier)")
            results.append(bench_store(url, args, caches))
            print(f"done: {kind}", file=sys.stderr)
    finally:
        for name, kind in ((shm_name, "shm"), (shm_name + "t", "tier")):
            if kind not in args.stores.split(","):
                continue
            try:
                stop_server(name)
            except Exception as exc:  # noqa: BLE001 - report, do not hide the results
                print(f"could not stop the shm server: {exc}", file=sys.stderr)
        if redis is not None:
            redis.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    r0 = results[0]
    print(f"{r0['blocks']} blocks of {r0['block_mb']:.2f} MB per batch; medians of {args.reps}; GB/s of payload")
    print("| store | connector save | save layer by layer | store put | save / put | connector load | store get "
          "| load / get | load via rows | rows / get | gather | seal | check | scatter |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        g = r["gbps"]
        how = "into pages" if r["into_pages"] else "via rows"
        print(f"| {r['store']} | {g['save']:.2f} | {g['save_layers']:.2f} | {g['put']:.2f} | {r['save_ratio']:.2f}x "
              f"| {g['load']:.2f} "
              f"({how}) | {g['get']:.2f} | {r['load_ratio']:.2f}x | {g['rows']:.2f} | {r['rows_ratio']:.2f}x | "
              f"{g['gather']:.1f} | {g['seal']:.1f} | {g['check']:.1f} | {g['scatter']:.1f} |")
    print()
    print("Saves: straight from the pages where the store can (writes_from_parts), against the same save")
    print("through the writer; engine thread: ms until save() returns (what wait_for_save costs the step).")
    print("| store | connector save | save / put | through the writer | writer / put | engine thread ms: save "
          "| engine thread ms: through the writer |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        g = r["gbps"]
        how = "straight" if r["direct"] else "writer"
        print(f"| {r['store']} | {g['save']:.2f} ({how}) | {r['save_ratio']:.2f}x | {g['save_writer']:.2f} "
              f"| {r['writer_ratio']:.2f}x | {r['engine_ms']:.1f} | {r['engine_writer_ms']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
