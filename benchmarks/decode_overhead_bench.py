"""What a decode step pays for UCMConnector: the time inside the connector's
hooks, per step, under vLLM's real scheduler.

    .venv/bin/python benchmarks/decode_overhead_bench.py [--requests 8] [--steps 100] [--store disk]

``ucm_testing.kvharness`` steps vLLM's real ``Scheduler`` with a fake model
over a real store, calling the connector's hooks in the order vLLM's model
runner does.  After the prompts are prefilled (and their blocks saved), each
hook of both roles is timed over ``--steps`` decode steps of ``--requests``
requests: SmolLM2-135M's 30 layers and 128-token blocks, so a decode step
completes a block now and then, whose save is counted too.  Prints the time
per step in the hooks, hook by hook; compare it with a real engine's decode
step (``ttft_bench.py`` prints tokens/s).  The fake model's own time is not
part of any figure.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import shutil
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
                "get_block_ids_with_load_errors", "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
                "build_connector_worker_meta", "clear_connector_metadata")
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished")


def _time_hooks(obj, names: tuple[str, ...], role: str, totals: collections.Counter) -> None:
    for name in names:
        hook = getattr(obj, name, None)
        if hook is None:
            continue

        @functools.wraps(hook)
        def timed(*args, _hook=hook, _label=f"{role}.{name}", **kwargs):
            t0 = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - t0

        setattr(obj, name, timed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=320,
                   help="default 320: each request completes a block (at 384 tokens) during the decode steps")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--store", choices=["disk", "shm"], default="disk")
    args = p.parse_args(argv)
    from ucm_testing.kvharness import Harness

    tmp = tempfile.mkdtemp(prefix="ucm-decode-bench-")
    shm_name = "db" + uuid.uuid4().hex[:8]
    url = f"disk://{tmp}/store" if args.store == "disk" else f"shm://{shm_name}?capacity=1GiB"
    h = None
    try:
        h = Harness(store=url, num_layers=30, block_size=128, num_blocks=args.requests * 8 + 16,
                    max_num_batched_tokens=4096, max_num_seqs=args.requests, check_every_step=False)
        totals: collections.Counter = collections.Counter()
        _time_hooks(h.worker, WORKER_HOOKS, "worker", totals)
        _time_hooks(h.scheduler.connector, SCHEDULER_HOOKS, "scheduler", totals)
        rng = random.Random(0)
        max_tokens = args.steps + 2
        for _ in range(args.requests):
            h.add([rng.randint(1, 900) for _ in range(args.prompt_tokens)], max_tokens=max_tokens)
        while any(not out for out in h.outputs.values()):
            h.step()
        totals.clear()
        steps = 0
        t0 = time.perf_counter()
        while steps < args.steps and h.scheduler.get_num_unfinished_requests():
            h.step()
            steps += 1
        wall = time.perf_counter() - t0
        h.flush()
        saved = h.counters().get("saved_blocks", 0)
    finally:
        if h is not None:
            h.close()
        if args.store == "shm":
            from store_backends import stop_server

            stop_server(shm_name)
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(totals.values())
    print(f"{steps} decode steps of {args.requests} requests ({args.store} store, 30 layers, 128-token blocks, "
          f"{saved:.0f} blocks saved in all): {1e6 * total / steps:.0f} us per step in the connector's hooks "
          f"(a harness step took {1e3 * wall / steps:.2f} ms with its fake model)")
    for label, seconds in totals.most_common():
        print(f"  {label:45s} {1e6 * seconds / steps:8.1f} us/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
