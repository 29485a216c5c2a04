"""Run ucm-bench against every store backend and print the figures as a
Markdown table (the one in benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/store_bench.py [--out benchmarks/out] [--blocks 256] [--repeat 5]

Starts its own private redis-server and a 3-node Redis Cluster on loopback,
a shared-memory store server, and a disk store in a temporary directory under
--disk-dir (page cache), and stops all of them afterwards.  Each row is one
ucm-bench run: the store and its raw medium measured in the same run, so the
ratio is what to read on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid

from ucm_testing import RedisCluster, RedisServer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TARGETS = {
    # (kind, op) -> minimum store/raw ratio
    ("shm", "put"): 0.8, ("shm", "get"): 0.8,
    ("disk", "put"): 0.8, ("disk", "get"): 0.8,
    ("redis", "put"): 0.9, ("redis", "get"): 0.9,
    ("redis-cluster", "put"): 0.9, ("redis-cluster", "get"): 0.9,
}
LOOKUP_TARGET_MS = {"shm": 1.0, "disk": 5.0, "redis": 5.0, "redis-cluster": 5.0}


def run_bench(args: list[str], json_path: str) -> dict:
    cmd = [sys.executable, "-m", "store_backends.bench", *args, "--json", json_path, "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ucm-bench failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    with open(json_path) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "out"))
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--disk-dir", default=None, help="parent of the disk store's directory (default: a temp dir)")
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)

    from store_backends import stop_server

    disk_parent = tempfile.mkdtemp(prefix="ucm-bench-disk-", dir=opts.disk_dir)
    shm_name = "bench" + uuid.uuid4().hex[:8]
    shm_url = f"shm://{shm_name}?capacity=2GiB"
    shm_lookup_url = f"shm://{shm_name}l?capacity=512MiB&chunk=4KiB"
    redis = RedisServer(extra=["--maxmemory", "3gb", "--maxmemory-policy", "allkeys-lru"]).start()
    cluster = RedisCluster(3).start()
    rows: list[tuple[str, str, dict]] = []
    try:
        throughput = {
            "shm": [shm_url],
            "disk": [f"disk://{disk_parent}/store?capacity=4GiB"],
            "redis": [redis.url],
            "redis-cluster": [cluster.url],
            "tier shm>disk": [shm_url, f"disk://{disk_parent}/tier?capacity=4GiB"],
        }
        for kind, urls in throughput.items():
            args = [a for u in urls for a in ("--store", u)]
            args += ["--block-kib", "1024", "--blocks", str(opts.blocks), "--batch", "16",
                     "--repeat", str(opts.repeat), "--ops", "put,get"]
            data = run_bench(args, os.path.join(opts.out, f"{kind.split()[0]}-1MiB.json"))
            rows.append((kind, "1 MiB x %d, batch 16" % opts.blocks, data))
        lookup = {
            "shm": shm_lookup_url,
            "disk": f"disk://{disk_parent}/lookup?capacity=4GiB",
            "redis": redis.url,
            "redis-cluster": cluster.url,
        }
        for kind, url in lookup.items():
            args = ["--store", url, "--block-kib", "4", "--blocks", "8192", "--batch", "8192",
                    "--repeat", str(opts.repeat), "--ops", "contains,prefix_len"]
            data = run_bench(args, os.path.join(opts.out, f"{kind}-lookup.json"))
            rows.append((kind, "lookup of 8,192 keys", data))
    finally:
        for name in (shm_name, shm_name + "l"):
            try:
                stop_server(name)
            except Exception as exc:  # the table is still worth printing
                print(f"could not stop the shm server {name!r}: {exc}", file=sys.stderr)
        redis.cleanup()
        cluster.cleanup()
        subprocess.run(["rm", "-rf", disk_parent])

    print("| store | workload | op | store | raw | store/raw | target | met |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, workload, data in rows:
        for op, fig in data["ops"].items():
            store, raw, ratio = fig["store"], fig["raw"], fig["ratio"]
            if op in ("contains", "prefix_len"):
                ms = store["latency_ms"]["p50"]
                target = LOOKUP_TARGET_MS.get(kind)
                raw_txt = f"{raw['latency_ms']['p50']:.2f} ms" if raw else "n/a"
                ratio_txt = f"{ratio:.2f}x" if ratio is not None else "n/a"
                met = "-" if target is None else ("yes" if ms < target else "NO")
                print(f"| {kind} | {workload} | {op} | {ms:.2f} ms/call (p50) | {raw_txt} | {ratio_txt} | "
                      f"{'< %g ms' % target if target else '-'} | {met} |")
            else:
                target = TARGETS.get((kind, op))
                raw_txt = f"{raw['gb_s']:.2f} GB/s" if raw else "n/a"
                ratio_txt = f"{ratio:.2f}x" if ratio is not None else "n/a"
                met = "-" if target is None or ratio is None else ("yes" if ratio >= target else "NO")
                print(f"| {kind} | {workload} | {op} | {store['gb_s']:.2f} GB/s | {raw_txt} | {ratio_txt} | "
                      f"{'>= %gx' % target if target else '-'} | {met} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
