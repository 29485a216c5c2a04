"""ucm-bench: throughput and latency of a store, next to the raw medium it sits on.

This module owns the ``ucm-bench`` console script.  It measures a store only
through the public ``KVStore`` interface, and in the same run measures the
plain medium underneath (memcpy, plain files, plain redis-py) with the same
block size, block count, batching and threads, so that the figure that
matters, store/raw, is not spoiled by a machine that was busier at another
time.  Every block read back is compared with what was written: a benchmark
that can report a fast store returning wrong bytes is worse than none.

It must not reach into a backend's internals; it knows a store only by its
URL and its interface.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from typing import Callable, Sequence

import numpy as np

from .base import KVStore, StoreError, StoreOpenError
from .registry import open_store, url_scheme
from .urls import mask_password

ALL_OPS = ("put", "get", "contains", "prefix_len")
DEFAULT_OPS = "put,get,contains,prefix_len"
# prefix_len asks about the whole key list in one call; one call per round
# would give too few samples for a percentile, so each round makes several.
PREFIX_LEN_CALLS_PER_ROUND = 5
# How many failures are printed one by one before the rest are only counted:
# a store that corrupts everything must not bury the summary.
MAX_FAILURES_SHOWN = 10
EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

_REDIS_SCHEMES = ("redis", "rediss", "unix")
# Query options of a store URL that redis-py's from_url understands too; the
# others (namespace, ttl...) belong to the store and would make redis-py fail.
_REDIS_PY_QUERY = {"db", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile",
                   "ssl_keyfile", "ssl_check_hostname", "socket_timeout", "socket_connect_timeout"}

_DESCRIPTION = """\
Benchmark a KV-cache store: throughput (GB/s, blocks/s) and latency
percentiles of put, get (get_into preallocated buffers), contains and
prefix_len, and -- in the same run, with the same block size, block count,
batch size and threads -- the raw medium the store sits on:

  shm://                      memcpy between the buffers and a /dev/shm region
  disk:///DIR                 plain open/write/close and open/readinto/close,
                              one file per block, in a temporary subdirectory of DIR
  redis://, rediss://, unix://  plain redis-py pipelined SET and MGET on the same
                              server and db, under a separate key prefix
  redis-cluster://            plain redis-py RedisCluster pipeline SET and mget_nonatomic
  a tier or another scheme    no raw baseline (shown as n/a)

The raw Redis get is MGET alone: its values come back as bytes and are not
copied into the buffers, so the store/raw ratio of get charges a Redis store
for that copy.  The memcpy and file baselines do fill the same buffers.
Buffers and values are page-aligned, as a caller's pinned buffers are.

Every block read back is compared with what was put; a miss or a wrong byte
is reported with its key and block and makes the exit status 1.

Timing: one or more untimed warm-up rounds (--warmup), then --repeat timed
rounds; throughput is the median of the rounds (the best is in the JSON),
latency percentiles are taken over every call of the timed rounds.  Each
round puts --blocks fresh keys (so no put is short-circuited by an existing
key), reads them back, asks for them, and deletes them.  Store and raw
alternate which goes first from round to round.  GB/s means 10^9 bytes/s.

Exit status: 0 ok, 1 verification failure (or the store failed mid-run),
2 bad arguments or the store could not be opened."""

_EPILOG = """\
examples:
  ucm-bench --store 'shm://bench?capacity=1GiB' --block-kib 1024 --blocks 256
  ucm-bench --store disk:///var/tmp/ucm-bench --threads 2 --json disk.json
  ucm-bench --store redis://:secret@127.0.0.1:6379/0 --batch 32
  ucm-bench --store unix:///run/redis/redis.sock
  ucm-bench --store redis-cluster://10.0.0.1:7000,10.0.0.2:7000
  ucm-bench --store shm://ucm --store disk:///var/tmp/ucm      (a tier, fastest first)
  ucm-bench --store disk:///var/tmp/ucm --block-kib 4 --blocks 8192 --ops contains,prefix_len
                                      (the lookup target: prefix_len on 8,192 keys)"""


# --------------------------------------------------------------------------
# arguments


class _UsageError(Exception):
    """Bad arguments found after parsing; exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must not be negative")
    return value


def _ops(text: str) -> list[str]:
    ops = [op.strip() for op in text.split(",") if op.strip()]
    unknown = [op for op in ops if op not in ALL_OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"unknown op(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(ALL_OPS)}")
    return [op for op in ALL_OPS if op in ops]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucm-bench", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", action="append", required=True, metavar="URL",
                        help="store URL; give it several times (or a JSON list) for a tier, fastest first")
    parser.add_argument("--block-kib", type=_positive_int, default=1024, metavar="N",
                        help="block size in KiB (default 1024)")
    parser.add_argument("--blocks", type=_positive_int, default=256, metavar="N",
                        help="distinct blocks per round (default 256)")
    parser.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                        help="worker threads, each with its own slice of the keys (default 1)")
    parser.add_argument("--batch", type=_positive_int, default=16, metavar="N",
                        help="keys per store call (default 16)")
    parser.add_argument("--ops", type=_ops, default=_ops(DEFAULT_OPS), metavar="LIST",
                        help=f"comma-separated ops to time, from {','.join(ALL_OPS)} (default all); "
                             "blocks are always put, untimed if put is not listed")
    parser.add_argument("--repeat", type=_positive_int, default=3, metavar="N",
                        help="timed rounds; throughput is their median (default 3)")
    parser.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N",
                        help="untimed warm-up rounds before the timed ones (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the block values (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH ('-' = stdout)")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw-medium baseline")
    parser.add_argument("--keep", action="store_true",
                        help="leave the last round's blocks in the store (their key prefix is printed)")
    parser.add_argument("--progress", action="store_true",
                        help="show the progress bar even when stderr is not a terminal")
    parser.add_argument("--quiet", action="store_true",
                        help="print nothing but errors and verification failures (use with --json)")
    return parser


def _store_urls(values: Sequence[str]) -> list[str]:
    urls: list[str] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                listed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _UsageError(f"--store {text!r} starts with '[' but is not a JSON list: {exc}") from None
            if not isinstance(listed, list) or not all(isinstance(u, str) for u in listed):
                raise _UsageError(f"--store {text!r}: a JSON list of URL strings was expected")
            urls.extend(listed)
        else:
            urls.append(text)
    if not urls:
        raise _UsageError("--store names no store")
    return urls


# --------------------------------------------------------------------------
# progress


class Progress:
    """A one-line bar on stderr, redrawn by the main thread only, so the
    timed worker threads pay nothing but an integer increment."""

    def __init__(self, total: int, enabled: bool, stream=None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.label = ""
        self._last_draw = 0.0
        self._drawn = False

    def tick(self) -> None:
        self.done += 1

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        frac = min(self.done / self.total, 1.0)
        width = 28
        filled = int(frac * width)
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\r[{bar}] {frac * 100:5.1f}%  {self.label:<32.32}")
        self.stream.flush()
        self._drawn = True

    def finish(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()


# --------------------------------------------------------------------------
# running one phase: threads, each with its own list of batch calls


@dataclasses.dataclass
class Call:
    """One timed call: ``fn(*args)`` on ``num_keys`` blocks from ``first``."""

    fn: Callable[..., object]
    args: tuple
    first: int
    num_keys: int


@dataclasses.dataclass
class PhaseResult:
    wall_s: float
    num_keys: int
    latencies_s: list[float]
    keys_per_call: list[int]
    # (call, what it returned), for verification after the clock stopped
    returns: list[tuple[Call, object]]


def _slices(num_blocks: int, num_threads: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal slices of the block indices, one per thread."""
    bounds = [num_blocks * t // num_threads for t in range(num_threads + 1)]
    return [(bounds[t], bounds[t + 1]) for t in range(num_threads)]


def _batched_calls(fn: Callable[[int, int], Call], lo: int, hi: int, batch: int) -> list[Call]:
    return [fn(a, min(a + batch, hi)) for a in range(lo, hi, batch)]


def run_phase(per_thread: list[list[Call]], progress: Progress) -> PhaseResult:
    """Run each thread's calls in order; the phase's wall time runs from the
    first thread's start to the last thread's end."""
    per_thread = [calls for calls in per_thread if calls]
    barrier = threading.Barrier(len(per_thread))
    outcome: list[object] = [None] * len(per_thread)
    # Set on Ctrl-C so workers stop after their current call and the main
    # thread can delete what was written without racing them.
    stop = threading.Event()

    def work(index: int, calls: list[Call]) -> None:
        latencies: list[float] = []
        returns: list[tuple[Call, object]] = []
        clock = time.perf_counter
        try:
            barrier.wait()
            start = clock()
            for call in calls:
                if stop.is_set():
                    break
                t0 = clock()
                answer = call.fn(*call.args)
                latencies.append(clock() - t0)
                returns.append((call, answer))
                progress.tick()
            outcome[index] = (start, clock(), latencies, returns)
        except BaseException as exc:  # handed to the main thread, which re-raises it
            barrier.abort()
            outcome[index] = exc

    threads = [threading.Thread(target=work, args=(i, calls), name=f"ucm-bench-{i}", daemon=True)
               for i, calls in enumerate(per_thread)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.1)
                progress.draw()
    except KeyboardInterrupt:
        stop.set()
        barrier.abort()
        for thread in threads:
            thread.join()
        raise
    errors = [o for o in outcome if isinstance(o, BaseException)]
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    starts, ends, latencies, keys_per_call, returns = [], [], [], [], []
    for start, end, lat, ret in outcome:  # type: ignore[misc]
        starts.append(start)
        ends.append(end)
        latencies.extend(lat)
        keys_per_call.extend(call.num_keys for call, _ in ret)
        returns.extend(ret)
    return PhaseResult(wall_s=max(ends) - min(starts), num_keys=sum(keys_per_call) if keys_per_call else 0,
                       latencies_s=latencies, keys_per_call=keys_per_call, returns=returns)


# --------------------------------------------------------------------------
# raw media


class RawMedium:
    """The plain medium under a store, driven with the same block ranges."""

    name = ""
    description = ""
    has_lookup = True

    def start_round(self, label: str) -> None:
        """Name this round's blocks (fresh names, as for the store)."""

    def put(self, lo: int, hi: int) -> None:
        raise NotImplementedError

    def get(self, lo: int, hi: int) -> None:
        raise NotImplementedError

    def contains(self, lo: int, hi: int) -> list[bool]:
        raise NotImplementedError

    def prefix_len(self, lo: int, hi: int) -> int:
        n = 0
        for present in self.contains(lo, hi):
            if not present:
                break
            n += 1
        return n

    def end_round(self) -> None:
        """Remove this round's blocks."""

    def close(self) -> None:
        """Remove everything written; idempotent."""


def _shared_region(shape: tuple[int, ...]) -> tuple[mmap.mmap | None, np.ndarray]:
    """A mapped /dev/shm file of ``shape`` bytes (unlinked at once, so
    nothing is left behind), or private memory where there is no /dev/shm."""
    nbytes = int(np.prod(shape))
    if not os.path.isdir("/dev/shm"):
        return None, aligned_empty(*shape)
    fd, path = tempfile.mkstemp(prefix="ucm-bench-raw-", dir="/dev/shm")
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return region, np.frombuffer(region, dtype=np.uint8).reshape(shape)


class MemcpyRaw(RawMedium):
    name = "memcpy"
    description = "memcpy: numpy copyto between the buffers and a region of shared memory (/dev/shm)"
    has_lookup = False

    def __init__(self, values: np.ndarray, dest: np.ndarray) -> None:
        self.values = values
        self.dest = dest
        # The region a put copies into is shared memory, the medium an shm
        # store sits on (its pages behave unlike private anonymous memory,
        # which may be backed by huge pages); touched by the warm-up round so
        # page faults are not timed.
        self._map, self.region = _shared_region(values.shape)

    def close(self) -> None:
        self.region = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
            self._map = None

    def put(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            np.copyto(self.region[i], self.values[i])

    def get(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            np.copyto(self.dest[i], self.region[i])


class FileRaw(RawMedium):
    name = "file"
    has_lookup = True

    def __init__(self, directory: str, values: np.ndarray, dest: np.ndarray) -> None:
        self.dir = tempfile.mkdtemp(prefix=".ucm-bench-raw-", dir=directory)
        self.description = f"plain file open/write/close and open/readinto/close in {self.dir}"
        self.values = [memoryview(row) for row in values]
        self.dest = [memoryview(row) for row in dest]
        self.paths: list[str] = []

    def start_round(self, label: str) -> None:
        self.paths = [os.path.join(self.dir, f"{label}-{i}") for i in range(len(self.values))]

    def put(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            with open(self.paths[i], "wb", buffering=0) as f:
                f.write(self.values[i])

    def get(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            with open(self.paths[i], "rb", buffering=0) as f:
                f.readinto(self.dest[i])

    def contains(self, lo: int, hi: int) -> list[bool]:
        exists = os.path.exists
        return [exists(p) for p in self.paths[lo:hi]]

    def end_round(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.paths = []

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisRaw(RawMedium):
    has_lookup = True

    def __init__(self, client, values: np.ndarray, run_id: str, cluster: bool, where: str) -> None:
        self.client = client
        self.cluster = cluster
        self.name = "redis-cluster" if cluster else "redis"
        if cluster:
            self.description = f"redis-py RedisCluster pipeline SET and mget_nonatomic on {where}"
        else:
            self.description = f"redis-py pipelined SET (transaction=False) and MGET on {where}"
        self.values = [memoryview(row) for row in values]
        self.prefix = f"ucm-bench-raw:{run_id}:".encode()
        self.keys: list[bytes] = []
        self.written: set[bytes] = set()

    def _pipeline(self):
        return self.client.pipeline() if self.cluster else self.client.pipeline(transaction=False)

    def start_round(self, label: str) -> None:
        self.keys = [self.prefix + f"{label}:{i}".encode() for i in range(len(self.values))]

    def put(self, lo: int, hi: int) -> None:
        pipe = self._pipeline()
        for key, value in zip(self.keys[lo:hi], self.values[lo:hi]):
            pipe.set(key, value)
        pipe.execute()

    def get(self, lo: int, hi: int) -> None:
        if self.cluster:
            self.client.mget_nonatomic(self.keys[lo:hi])
        else:
            self.client.mget(self.keys[lo:hi])

    def contains(self, lo: int, hi: int) -> list[bool]:
        pipe = self._pipeline()
        for key in self.keys[lo:hi]:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def end_round(self) -> None:
        self._delete(self.keys)
        self.keys = []

    def _delete(self, keys: list[bytes]) -> None:
        for a in range(0, len(keys), 512):
            pipe = self._pipeline()
            for key in keys[a:a + 512]:
                pipe.delete(key)
            pipe.execute()

    def close(self) -> None:
        try:
            if self.keys:
                self._delete(self.keys)
                self.keys = []
        finally:
            self.client.close()


def _redis_client(url: str):
    import redis

    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k in _REDIS_PY_QUERY]
    # Rebuilt by hand: urlunsplit turns unix:///path into unix:/path, which
    # redis-py rejects.
    clean = url.split("?", 1)[0] + (f"?{urllib.parse.urlencode(query)}" if query else "")
    return redis.Redis.from_url(clean, socket_connect_timeout=5, socket_timeout=30)


def _redis_cluster_client(url: str):
    from redis.cluster import ClusterNode, RedisCluster

    parts = urllib.parse.urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if pw else None
    nodes = []
    for host_port in filter(None, hosts.split(",")):
        host, _, port = host_port.rpartition(":")
        nodes.append(ClusterNode(host.strip("[]") or "127.0.0.1", int(port or 6379)))
    options = dict(urllib.parse.parse_qsl(parts.query))
    ssl = options.get("ssl", "").lower() in ("1", "true", "yes", "on")
    return RedisCluster(startup_nodes=nodes, username=username, password=password, ssl=ssl,
                        socket_connect_timeout=5, socket_timeout=30)


def _disk_directory(url: str, store: KVStore) -> str | None:
    for attr in ("root", "directory", "path", "dir"):
        value = getattr(store, attr, None)
        if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
            return os.fspath(value)
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    return path if path and os.path.isdir(path) else None


def open_raw(urls: list[str], store: KVStore, values: np.ndarray, dest: np.ndarray,
             run_id: str) -> tuple[RawMedium | None, str]:
    """The raw medium for these store URLs, or None and why there is none."""
    if len(urls) > 1:
        return None, "n/a: a tier of stores has no single raw medium"
    url = urls[0]
    scheme = url_scheme(url)
    if scheme == "shm":
        return MemcpyRaw(values, dest), ""
    if scheme == "disk":
        directory = _disk_directory(url, store)
        if directory is None:
            return None, f"n/a: could not tell which directory {mask_password(url)} uses"
        return FileRaw(directory, values, dest), ""
    if scheme in _REDIS_SCHEMES:
        client = _redis_client(url)
        client.ping()
        return RedisRaw(client, values, run_id, cluster=False, where=mask_password(url)), ""
    if scheme == "redis-cluster":
        client = _redis_cluster_client(url)
        return RedisRaw(client, values, run_id, cluster=True, where=mask_password(url)), ""
    return None, f"n/a: no raw baseline for the scheme {scheme!r}"


# --------------------------------------------------------------------------
# figures


def _percentiles_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    if not len(seconds):
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(seconds, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(arr.mean())}


@dataclasses.dataclass
class OpFigures:
    """One op on one medium, over the timed rounds."""

    moves_bytes: bool
    block_nbytes: int
    rounds: list[PhaseResult] = dataclasses.field(default_factory=list)

    def rates(self) -> list[float]:
        return [r.num_keys / r.wall_s for r in self.rounds if r.wall_s > 0]

    def ops_s(self, best: bool = False) -> float | None:
        rates = self.rates()
        if not rates:
            return None
        return float(max(rates) if best else np.median(rates))

    def gb_s(self, best: bool = False) -> float | None:
        rate = self.ops_s(best)
        if rate is None or not self.moves_bytes:
            return None
        return rate * self.block_nbytes / 1e9

    def to_dict(self) -> dict[str, object]:
        latencies = [s for r in self.rounds for s in r.latencies_s]
        keys = [k for r in self.rounds for k in r.keys_per_call]
        per_block = [s / k for s, k in zip(latencies, keys) if k]
        return {
            "gb_s": self.gb_s(), "gb_s_best": self.gb_s(best=True),
            "ops_s": self.ops_s(), "ops_s_best": self.ops_s(best=True),
            "rounds_ops_s": self.rates(),
            "rounds_wall_s": [r.wall_s for r in self.rounds],
            "calls": len(latencies),
            "keys_per_call": (sum(keys) / len(keys)) if keys else None,
            "latency_ms": _percentiles_ms(latencies),
            "latency_per_block_ms": _percentiles_ms(per_block),
        }


def _ratio(store: OpFigures, raw: OpFigures | None) -> float | None:
    if raw is None:
        return None
    s, r = store.ops_s(), raw.ops_s()
    return s / r if s and r else None


# --------------------------------------------------------------------------
# verification


class Verifier:
    """Collects every way the store disagreed with what was put."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.num_misses = 0

    @property
    def ok(self) -> bool:
        return not self.failures

    def _answers(self, result: PhaseResult, what: str, round_label: str, keys: list[bytes]):
        for call, answer in result.returns:
            if not isinstance(answer, (list, tuple)) or len(answer) != call.num_keys:
                self.failures.append(
                    f"round {round_label}: {what} of {call.num_keys} keys from block {call.first} "
                    f"returned {type(answer).__name__} {str(answer)[:60]}, not one bool per key")
                continue
            for j, flag in enumerate(answer):
                yield call.first + j, bool(flag)

    def check_put(self, result: PhaseResult, round_label: str, keys: list[bytes]) -> None:
        for block, ok in self._answers(result, "put", round_label, keys):
            if not ok:
                self.failures.append(f"round {round_label}: put refused key {keys[block]!r} (block {block})")

    def check_contains(self, result: PhaseResult, round_label: str, keys: list[bytes]) -> None:
        for block, ok in self._answers(result, "contains", round_label, keys):
            if not ok:
                self.num_misses += 1
                self.failures.append(
                    f"round {round_label}: contains says key {keys[block]!r} (block {block}) is missing after put")

    def check_prefix_len(self, result: PhaseResult, round_label: str, keys: list[bytes]) -> None:
        for call, answer in result.returns:
            if answer != call.num_keys:
                first_missing = answer if isinstance(answer, int) and 0 <= answer < len(keys) else None
                named = (f"; key {keys[first_missing]!r} (block {first_missing}) is the first it does not see"
                         if first_missing is not None else "")
                self.failures.append(
                    f"round {round_label}: prefix_len over {call.num_keys} stored keys returned {answer!r}{named}")

    def check_get(self, result: PhaseResult, round_label: str, keys: list[bytes],
                  values: np.ndarray, dest: np.ndarray) -> None:
        hit = np.zeros(len(keys), dtype=bool)
        for block, ok in self._answers(result, "get_into", round_label, keys):
            hit[block] = ok
            if not ok:
                self.num_misses += 1
                self.failures.append(
                    f"round {round_label}: get missed key {keys[block]!r} (block {block}) after a successful put")
        # Compare in slabs so a large run does not double its memory for the mask.
        rows_per_slab = max(1, (64 << 20) // max(values.shape[1], 1))
        for lo in range(0, len(keys), rows_per_slab):
            hi = min(lo + rows_per_slab, len(keys))
            differs = (dest[lo:hi] != values[lo:hi]).any(axis=1)
            for offset in np.flatnonzero(differs & hit[lo:hi]):
                block = lo + int(offset)
                wrong = dest[block] != values[block]
                self.failures.append(
                    f"round {round_label}: get returned wrong bytes for key {keys[block]!r} (block {block}): "
                    f"{int(wrong.sum())} of {values.shape[1]} bytes differ, first at offset {int(np.argmax(wrong))}")


# --------------------------------------------------------------------------
# the benchmark


@dataclasses.dataclass
class BenchConfig:
    urls: list[str]
    block_nbytes: int
    num_blocks: int
    num_threads: int
    batch: int
    ops: list[str]
    repeat: int
    warmup: int
    seed: int
    raw: bool
    keep: bool


PAGE = 4096


def aligned_empty(num_blocks: int, block_nbytes: int) -> np.ndarray:
    """An uninitialised (blocks, nbytes) uint8 array starting on a page.

    numpy's large arrays start 16 bytes into a page, and the kernel's and
    libc's copies run at half speed or less into such a destination (seen:
    6 GB/s against 12 GB/s for file reads).  Real callers use page-aligned
    buffers (pinned tensors, mmaps), so the benchmark does too; otherwise the
    ratio would mostly measure which side happened to meet a better offset."""
    nbytes = num_blocks * block_nbytes
    backing = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-backing.ctypes.data) % PAGE
    return backing[start:start + nbytes].reshape(num_blocks, block_nbytes)


def make_values(num_blocks: int, block_nbytes: int, seed: int) -> np.ndarray:
    """Reproducible, pairwise-distinct blocks: each is a window at its own
    offset into one random stream, stamped with its index at both ends, so
    a store that returns another block's bytes is caught too."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, 256, size=2 * block_nbytes, dtype=np.uint8)
    values = aligned_empty(num_blocks, block_nbytes)
    for i in range(num_blocks):
        offset = (i * 4099) % block_nbytes
        values[i] = stream[offset:offset + block_nbytes]
    stamp = np.arange(num_blocks, dtype="<u8").view(np.uint8).reshape(num_blocks, 8)
    width = min(8, block_nbytes)
    values[:, :width] = stamp[:, :width]
    values[:, block_nbytes - width:] = stamp[:, :width]
    return values


class Bench:
    def __init__(self, cfg: BenchConfig, store: KVStore, raw: RawMedium | None, raw_note: str,
                 values: np.ndarray, dest: np.ndarray, run_id: str, progress: Progress) -> None:
        self.cfg = cfg
        self.store = store
        self.raw = raw
        self.raw_note = raw_note
        self.values = values
        self.dest = dest
        self.run_id = run_id
        self.progress = progress
        self.value_views = [memoryview(row) for row in values]
        self.dest_views = [memoryview(row) for row in dest]
        self.slices = _slices(cfg.num_blocks, cfg.num_threads)
        self.verifier = Verifier()
        self.store_figures = {op: OpFigures(op in ("put", "get"), cfg.block_nbytes) for op in cfg.ops}
        self.raw_figures = ({op: OpFigures(op in ("put", "get"), cfg.block_nbytes) for op in cfg.ops
                             if raw.has_lookup or op in ("put", "get")} if raw is not None else {})
        self.key_prefix = f"ucm-bench:{run_id}:".encode()
        self.live_keys: list[bytes] = []

    # -- calls per thread, built before the clock starts

    def _store_calls(self, op: str, keys: list[bytes]) -> list[list[Call]]:
        store, batch, views, bufs = self.store, self.cfg.batch, self.value_views, self.dest_views
        if op == "prefix_len":
            return [[Call(store.prefix_len, (keys,), 0, len(keys))] * PREFIX_LEN_CALLS_PER_ROUND]
        make = {
            "put": lambda a, b: Call(store.put, (keys[a:b], views[a:b]), a, b - a),
            "get": lambda a, b: Call(store.get_into, (keys[a:b], bufs[a:b]), a, b - a),
            "contains": lambda a, b: Call(store.contains, (keys[a:b],), a, b - a),
        }[op]
        return [_batched_calls(make, lo, hi, batch) for lo, hi in self.slices]

    def _raw_calls(self, op: str) -> list[list[Call]]:
        raw, batch, n = self.raw, self.cfg.batch, self.cfg.num_blocks
        assert raw is not None
        if op == "prefix_len":
            return [[Call(raw.prefix_len, (0, n), 0, n)] * PREFIX_LEN_CALLS_PER_ROUND]
        fn = {"put": raw.put, "get": raw.get, "contains": raw.contains}[op]
        return [_batched_calls(lambda a, b: Call(fn, (a, b), a, b - a), lo, hi, batch) for lo, hi in self.slices]

    def calls_per_round(self) -> int:
        def count(op: str) -> int:
            if op == "prefix_len":
                return PREFIX_LEN_CALLS_PER_ROUND
            return sum(-(-(hi - lo) // self.cfg.batch) for lo, hi in self.slices)

        store_ops = set(self.cfg.ops) | {"put"}
        total = sum(count(op) for op in store_ops)
        if self.raw is not None:
            total += sum(count(op) for op in set(self.raw_figures) | {"put"})
        return total

    # -- one round

    def _store_phase(self, op: str, keys: list[bytes], label: str, timed: bool) -> None:
        self.progress.label = f"{op} store, round {label}"
        if op == "get":
            self.dest.fill(0)  # a store that "hits" without copying must not pass on stale bytes
        result = run_phase(self._store_calls(op, keys), self.progress)
        check = {"put": self.verifier.check_put, "contains": self.verifier.check_contains,
                 "prefix_len": self.verifier.check_prefix_len}
        if op == "get":
            self.verifier.check_get(result, label, keys, self.values, self.dest)
        else:
            check[op](result, label, keys)
        if timed and op in self.store_figures:
            self.store_figures[op].rounds.append(result)

    def _raw_phase(self, op: str, label: str, timed: bool) -> None:
        self.progress.label = f"{op} raw, round {label}"
        if op == "get":
            self.dest.fill(0)  # the same state of the buffers as the store's get had
        result = run_phase(self._raw_calls(op), self.progress)
        if timed and op in self.raw_figures:
            self.raw_figures[op].rounds.append(result)

    def run_round(self, index: int, label: str, timed: bool) -> None:
        keys = [self.key_prefix + f"{label}:{i}".encode() for i in range(self.cfg.num_blocks)]
        self.live_keys = keys
        if self.raw is not None:
            self.raw.start_round(label)
        store_ops = [op for op in ALL_OPS if op in self.cfg.ops or op == "put"]
        # Like the store, the raw medium is always written first: its lookups
        # must find the blocks, or they would time misses.
        raw_ops = [op for op in ALL_OPS if op in self.raw_figures or (op == "put" and self.raw_figures)]
        raw_first = index % 2 == 1
        for op in ALL_OPS:
            phases = []
            if op in store_ops:
                phases.append(lambda op=op: self._store_phase(op, keys, label, timed))
            if op in raw_ops:
                phases.append(lambda op=op: self._raw_phase(op, label, timed))
            for phase in (reversed(phases) if raw_first else phases):
                phase()
        self.progress.label = f"cleanup, round {label}"
        self.progress.draw()
        last = index == self.cfg.warmup + self.cfg.repeat - 1
        if not (self.cfg.keep and last):
            self.store.delete(keys)
            self.live_keys = []
        if self.raw is not None:
            self.raw.end_round()

    def run(self) -> None:
        rounds = [("warm-up" if self.cfg.warmup == 1 else f"warm-up{w + 1}", False) for w in range(self.cfg.warmup)]
        rounds += [(str(r + 1), True) for r in range(self.cfg.repeat)]
        self.progress.total = max(self.calls_per_round() * len(rounds), 1)
        for index, (label, timed) in enumerate(rounds):
            self.run_round(index, label, timed)

    def cleanup(self) -> None:
        if self.live_keys and not self.cfg.keep:
            try:
                self.store.delete(self.live_keys)
            except Exception:
                pass
            self.live_keys = []
        if self.raw is not None:
            try:
                self.raw.close()
            except Exception:
                pass

    # -- report

    def report(self) -> dict[str, object]:
        cfg = self.cfg
        ops: dict[str, object] = {}
        for op in cfg.ops:
            store = self.store_figures[op]
            raw = self.raw_figures.get(op)
            ops[op] = {
                "store": store.to_dict(),
                "raw": raw.to_dict() if raw is not None else None,
                "ratio": _ratio(store, raw),
            }
        try:
            stats = self.store.stats().to_dict()
            # A store is meant to mask its URL, but a JSON file gets shared:
            # do not rely on it.
            if isinstance(stats.get("url"), str):
                stats["url"] = mask_password(stats["url"])
        except Exception as exc:
            stats = {"error": str(exc)}
        masked = [mask_password(u) for u in cfg.urls]
        return {
            "tool": "ucm-bench",
            "format": 1,
            "store": masked[0] if len(masked) == 1 else masked,
            "block_nbytes": cfg.block_nbytes,
            "block_kib": cfg.block_nbytes // 1024,
            "blocks": cfg.num_blocks,
            "threads": cfg.num_threads,
            "batch": cfg.batch,
            "repeat": cfg.repeat,
            "warmup": cfg.warmup,
            "seed": cfg.seed,
            "prefix_len_calls_per_round": PREFIX_LEN_CALLS_PER_ROUND,
            "timing": (f"throughput: median of {cfg.repeat} timed round(s) after {cfg.warmup} warm-up round(s), "
                       "best in *_best; latency: percentiles over every call of the timed rounds, per call "
                       "(latency_ms) and per call divided by its keys (latency_per_block_ms); GB = 1e9 bytes"),
            "raw_medium": self.raw.name if self.raw is not None else None,
            "raw_description": self.raw.description if self.raw is not None else self.raw_note,
            "verified": self.verifier.ok,
            "checked": self._checked(),
            "failures": self.verifier.failures,
            "kept_key_prefix": self.key_prefix.decode() if cfg.keep else None,
            "ops": ops,
            "store_stats": stats,
            "host": _host_info(),
        }

    def _checked(self) -> list[str]:
        checked = ["put answers"]
        if "get" in self.cfg.ops:
            checked.append("get bytes equal to put")
        if "contains" in self.cfg.ops:
            checked.append("contains answers")
        if "prefix_len" in self.cfg.ops:
            checked.append("prefix_len answers")
        return checked


def _host_info() -> dict[str, object]:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, object]) -> str:
    rows = [("op", "store GB/s", "raw GB/s", "store/raw", "store ops/s", "raw ops/s", "p50 ms", "p99 ms")]
    for op, fig in report["ops"].items():  # type: ignore[union-attr]
        store, raw = fig["store"], fig["raw"]
        ratio = fig["ratio"]
        rows.append((
            op,
            _fmt(store["gb_s"], ".3f"),
            _fmt(raw["gb_s"], ".3f") if raw else "n/a",
            f"{ratio:.2f}x" if ratio is not None else "n/a",
            _fmt(store["ops_s"], ",.0f"),
            _fmt(raw["ops_s"], ",.0f") if raw else "n/a",
            _fmt(store["latency_ms"]["p50"], ".3f"),
            _fmt(store["latency_ms"]["p99"], ".3f"),
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _header(report: dict[str, object]) -> str:
    store = report["store"]
    stores = store if isinstance(store, str) else " > ".join(store)  # type: ignore[arg-type]
    threads = report["threads"]
    return (f"ucm-bench  store {stores}\n"
            f"  {report['block_kib']} KiB x {report['blocks']} blocks, {threads} thread{'s' if threads != 1 else ''}, "
            f"batch {report['batch']}, median of {report['repeat']} round(s) after {report['warmup']} warm-up\n"
            f"  raw: {report['raw_description']}")


def _footer(report: dict[str, object]) -> str:
    lines = ["ops/s = blocks (keys) per second; p50/p99 = latency of one call "
             f"({report['batch']} keys per call; prefix_len: one call over all {report['blocks']} keys)"]
    ops = report["ops"]
    if "prefix_len" in ops:  # type: ignore[operator]
        p50 = ops["prefix_len"]["store"]["latency_ms"]["p50"]  # type: ignore[index]
        lines.append(f"prefix_len over {report['blocks']} keys: {_fmt(p50, '.3f')} ms per call (p50)")
    lines.append("verified: every block read back equals what was put" if report["verified"] and "get" in ops
                 else ("verified: no failures in " + ", ".join(report["checked"])) if report["verified"]  # type: ignore[arg-type]
                 else f"VERIFY FAILED: {len(report['failures'])} failure(s)")  # type: ignore[arg-type]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# entry point


def _err(message: str) -> None:
    print(f"ucm-bench: {' '.join(str(message).split())}", file=sys.stderr)


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): a return value, not an exit, for callers
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    try:
        urls = _store_urls(args.store)
        if args.threads > args.blocks:
            raise _UsageError(f"--threads {args.threads} is more than --blocks {args.blocks}: "
                              "every thread needs at least one block")
    except _UsageError as exc:
        _err(f"error: {exc}")
        return EXIT_USAGE

    cfg = BenchConfig(urls=urls, block_nbytes=args.block_kib * 1024, num_blocks=args.blocks,
                      num_threads=args.threads, batch=args.batch, ops=args.ops, repeat=args.repeat,
                      warmup=args.warmup, seed=args.seed, raw=not args.no_raw, keep=args.keep)
    total = cfg.block_nbytes * cfg.num_blocks
    need = total * (3 if cfg.raw and url_scheme_or_none(urls) == "shm" else 2)
    available = _memory_available()
    if available is not None and need > 0.8 * available:
        _err(f"error: {args.blocks} blocks of {args.block_kib} KiB need about {need / 2**30:.1f} GiB of "
             f"memory for the values and read buffers, but only {available / 2**30:.1f} GiB is available; "
             "use fewer --blocks or a smaller --block-kib")
        return EXIT_USAGE

    try:
        store = open_store(urls if len(urls) > 1 else urls[0])
    except StoreError as exc:
        _err(f"error: {exc}")
        return EXIT_USAGE
    except ImportError as exc:
        _err(f"error: store {' '.join(mask_password(u) for u in urls)} cannot be opened: "
             f"its backend failed to import: {exc}")
        return EXIT_USAGE

    quiet = args.quiet
    progress_on = not quiet and (args.progress or sys.stderr.isatty())
    run_id = uuid.uuid4().hex[:10]
    bench: Bench | None = None
    raw: RawMedium | None = None
    status = EXIT_OK
    try:
        values = make_values(cfg.num_blocks, cfg.block_nbytes, cfg.seed)
        dest = aligned_empty(cfg.num_blocks, cfg.block_nbytes)
        dest.fill(0)
        raw_note = "n/a: skipped (--no-raw)"
        if cfg.raw:
            try:
                raw, raw_note = open_raw(urls, store, values, dest, run_id)
            except Exception as exc:
                reason = " ".join(str(exc).split())
                raw, raw_note = None, f"n/a: the raw medium could not be opened: {reason}"
                if not quiet:
                    _err(f"warning: running without a raw baseline: {reason}")
        bench = Bench(cfg, store, raw, raw_note, values, dest, run_id, Progress(0, progress_on))
        try:
            bench.run()
        finally:
            bench.progress.finish()
        report = bench.report()
    except KeyboardInterrupt:
        _err("interrupted; the blocks written so far are removed")
        status = EXIT_INTERRUPTED
        report = None
    except StoreError as exc:
        _err(f"error: the store failed during the run: {exc}")
        status = EXIT_VERIFY
        report = None
    finally:
        if bench is not None:
            bench.cleanup()
        elif raw is not None:
            raw.close()
        store.close()
    if report is None:
        return status

    if not report["verified"]:
        status = EXIT_VERIFY
        failures: list[str] = report["failures"]  # type: ignore[assignment]
        for failure in failures[:MAX_FAILURES_SHOWN]:
            _err(f"VERIFY FAILED: {failure}")
        if len(failures) > MAX_FAILURES_SHOWN:
            _err(f"VERIFY FAILED: ... and {len(failures) - MAX_FAILURES_SHOWN} more")
        if bench is not None and bench.verifier.num_misses:
            _err(f"hint: a store with a capacity evicts; {cfg.num_blocks} blocks of {args.block_kib} KiB "
                 f"need {total / 2**20:.0f} MiB in it, more where it rounds blocks up to a chunk size")
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
            except OSError as exc:
                _err(f"error: cannot write --json {args.json}: {exc.strerror or exc}")
                return EXIT_USAGE if status == EXIT_OK else status
    if not quiet:
        out = sys.stderr if args.json == "-" else sys.stdout
        print(_header(report), file=out)
        print(format_table(report), file=out)
        print(_footer(report), file=out)
        if cfg.keep:
            print(f"kept the last round's blocks under the key prefix {report['kept_key_prefix']!r}", file=out)
    return status


def url_scheme_or_none(urls: list[str]) -> str | None:
    if len(urls) != 1:
        return None
    try:
        return url_scheme(urls[0])
    except StoreOpenError:
        return None


if __name__ == "__main__":
    sys.exit(main())
