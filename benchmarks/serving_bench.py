"""Prefix-sharing serving benchmark: vLLM's OpenAI server with and without UCMConnector.

    .venv/bin/python benchmarks/serving_bench.py [--configs noconn,prefix,ucm-shm,ucm-disk]
                                                 [--requests 32] [--concurrency 4] [--docs 4]
                                                 [--doc-tokens 1536] [--max-tokens 24]
                                                 [--passes 2] [--json out.json]

The workload: a few long shared prefixes ("documents": a short instruction and
a slice of Python standard-library source, --doc-tokens tokens each, a
different slice per document) and many requests, each one document followed
by a short question of its own.  The request list is built once, shuffled
with a fixed seed, and sent in the same order to every configuration, with
the `openai` client, streaming (TTFT = time to the first streamed chunk),
--concurrency requests in flight, greedy, exactly --max-tokens output tokens
each (ignore_eos, so every configuration decodes the same amount).

Every configuration gets its own server, started and stopped in turn (never
two at once), with the same VLLM_CPU_KVCACHE_SPACE and
VLLM_CPU_NUM_OF_RESERVED_CPU (so all get the same cores: a kv_transfer_config
otherwise makes vLLM-CPU reserve one more), bf16, --enforce-eager,
--block-size 128:

  noconn       no connector, vLLM prefix caching off (everything recomputed)
  prefix       no connector, vLLM prefix caching on
  ucm-shm      UCMConnector on a fresh shm:// store, prefix caching off
  ucm-disk     UCMConnector on a fresh disk:// store (a temp dir), prefix caching off
  ucm-shm+pc   UCMConnector on shm:// with vLLM prefix caching on
  ucm-disk+pc  UCMConnector on disk:// with vLLM prefix caching on

With prefix caching off, every reused token of a ucm-* configuration came from
the store.  A server first answers one short unrelated request (not counted);
then the request list is sent --passes times.  Pass 1 includes the first
request of each document, a miss in every configuration (and requests of a
document that arrive while its first one is still computing also miss);
pass 2 sends the same list again, with everything already seen.

Reported per configuration and pass: requests/s and output tokens/s (over the
pass's wall time), TTFT p50/p90/p99, mean end-to-end latency, failed requests,
and the counters the server exports on /metrics over the pass
(vllm:external_prefix_cache_hits_total = tokens the connector supplied,
vllm:prompt_tokens_cached_total = prompt tokens not computed, whatever their
source).  Error and warning lines of each server's log are counted and the
first few are printed.

Absolute figures from a shared 2-core machine are noisy; the configurations
run one after another, so compare ratios and read them with that in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from scripts.vllm_server import free_port, stop_server, wait_health  # noqa: E402
BLOCK_SIZE = 128

METRICS = (
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


@dataclass(frozen=True)
class ServerConfig:
    name: str
    description: str
    store_kind: str | None      # None, "shm" or "disk"
    prefix_caching: bool


CONFIGS = {c.name: c for c in (
    ServerConfig("noconn", "no connector, prefix caching off", None, False),
    ServerConfig("prefix", "no connector, vLLM prefix caching on", None, True),
    ServerConfig("ucm-shm", "UCMConnector shm://, prefix caching off", "shm", False),
    ServerConfig("ucm-disk", "UCMConnector disk://, prefix caching off", "disk", False),
    ServerConfig("ucm-shm+pc", "UCMConnector shm://, prefix caching on", "shm", True),
    ServerConfig("ucm-disk+pc", "UCMConnector disk://, prefix caching on", "disk", True),
)}
DEFAULT_CONFIGS = "noconn,prefix,ucm-shm,ucm-disk"


@dataclass
class Request:
    index: int
    doc: int
    prompt: str


@dataclass
class RequestResult:
    index: int
    doc: int
    start_s: float = 0.0        # from the start of the pass
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class PassResult:
    pass_index: int
    wall_s: float
    results: list[RequestResult]
    metrics: dict[str, float | None]
    load_avg: tuple[float, float] = (0.0, 0.0)   # 1-minute load average at the pass's start and end

    def summary(self) -> dict:
        ok = [r for r in self.results if r.error is None and r.ttft_s is not None]
        ttfts = sorted(r.ttft_s for r in ok)
        lats = [r.latency_s for r in ok]
        out_tokens = sum(r.completion_tokens or 0 for r in ok)
        return {
            "pass": self.pass_index,
            "load_avg_start_end": self.load_avg,
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "wall_s": self.wall_s,
            "req_per_s": len(ok) / self.wall_s if self.wall_s else None,
            "out_tok_per_s": out_tokens / self.wall_s if self.wall_s else None,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90),
            "ttft_p99_s": percentile(ttfts, 99),
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "latency_mean_s": sum(lats) / len(lats) if lats else None,
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
            "output_tokens": out_tokens,
            "external_hit_tokens": self.metrics.get("vllm:external_prefix_cache_hits_total"),
            "external_query_tokens": self.metrics.get("vllm:external_prefix_cache_queries_total"),
            "cached_prompt_tokens": self.metrics.get("vllm:prompt_tokens_cached_total"),
            "metric_prompt_tokens": self.metrics.get("vllm:prompt_tokens_total"),
        }


@dataclass
class ConfigResult:
    config: ServerConfig
    store_url: str | None
    startup_s: float | None = None
    passes: list[PassResult] = field(default_factory=list)
    store_stats: dict | None = None
    log_path: str | None = None
    log_findings: dict = field(default_factory=dict)
    error: str | None = None


def say(msg: str = "") -> None:
    print(msg, flush=True)


def percentile(sorted_xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_xs:
        return None
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


# ---------------------------------------------------------------------------
# The workload.
# ---------------------------------------------------------------------------

def build_documents(model_dir: str, num_docs: int, doc_tokens: int) -> list[str]:
    """``num_docs`` texts of about ``doc_tokens`` tokens each: an instruction
    line and a distinct slice of standard-library source."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    stdlib = sysconfig.get_paths()["stdlib"]
    names = ("collections/__init__.py", "argparse.py", "dataclasses.py", "functools.py",
             "textwrap.py", "shutil.py", "tempfile.py", "configparser.py", "logging/__init__.py",
             "inspect.py", "subprocess.py", "typing.py")
    ids: list[int] = []
    for name in names:
        path = os.path.join(stdlib, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                ids.extend(tok.encode(f.read()).ids)
        if len(ids) >= num_docs * doc_tokens:
            break
    if len(ids) < num_docs * doc_tokens:
        raise RuntimeError(f"not enough standard-library text for {num_docs} documents of {doc_tokens} tokens")
    docs = []
    for d in range(num_docs):
        body = tok.decode(ids[d * doc_tokens:(d + 1) * doc_tokens])
        docs.append(f"Document {d + 1}. You are a careful Python reviewer. Read the source below and "
                    f"answer the question after it.\n\n{body}\n\n")
    return docs


def build_requests(docs: list[str], num_requests: int, seed: int) -> list[Request]:
    """One request per (document, question); questions name identifiers of
    their document, so every prompt is distinct after the shared prefix."""
    questions_of = []
    for doc in docs:
        names = list(dict.fromkeys(re.findall(r"\b(?:def|class)\s+([A-Za-z_]\w*)", doc)))
        if not names:
            names = ["this code"]
        questions_of.append(names)
    templates = ("What does `{}` do, in one sentence?",
                 "Which arguments does `{}` take?",
                 "Name one way `{}` could fail.",
                 "Where is `{}` used in this file?")
    reqs = []
    for i in range(num_requests):
        d = i % len(docs)
        j = i // len(docs)
        names = questions_of[d]
        q = templates[(j // len(names)) % len(templates)].format(names[j % len(names)])
        reqs.append(Request(index=i, doc=d, prompt=f"{docs[d]}Question {j + 1}: {q}\nAnswer:"))
    random.Random(seed).shuffle(reqs)
    return reqs


# ---------------------------------------------------------------------------
# Server handling.
# ---------------------------------------------------------------------------

def read_metrics(base: str) -> dict[str, float | None]:
    """The counters in METRICS, summed over their label sets (None if absent)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float | None] = {name: None for name in METRICS}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)", line)
        if m and m.group(1) in out:
            out[m.group(1)] = (out[m.group(1)] or 0.0) + float(m.group(3))
    return out


def metric_delta(after: dict, before: dict) -> dict:
    return {k: (after[k] - before[k]) if after.get(k) is not None and before.get(k) is not None else None
            for k in METRICS}


LOG_PROBLEM = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")
# Warnings of the connector and its stores (vLLM's own start-up warnings about
# connectors in general are left out).
LOG_CONNECTOR_WARNING = re.compile(r"WARNING.*(ucm|store)", re.IGNORECASE)


def scan_log(path: str, stop_offset: int | None, max_examples: int = 8) -> dict:
    """Error lines and connector/store warnings of a server log up to
    ``stop_offset`` (its size when the benchmark asked it to stop); error
    lines after that, during the shutdown, are only counted."""
    problems: list[str] = []
    warnings: list[str] = []
    n_problems = n_warnings = n_shutdown = 0
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        data = b""
    offset = 0
    for raw in data.splitlines(keepends=True):
        shutting_down = stop_offset is not None and offset >= stop_offset
        offset += len(raw)
        line = raw.decode(errors="replace").rstrip()
        if LOG_PROBLEM.search(line):
            if shutting_down:
                n_shutdown += 1
                continue
            n_problems += 1
            if len(problems) < max_examples:
                problems.append(line[:400])
        elif not shutting_down and LOG_CONNECTOR_WARNING.search(line):
            n_warnings += 1
            if len(warnings) < max_examples:
                warnings.append(line[:400])
    return {"error_lines": n_problems, "error_examples": problems,
            "connector_warning_lines": n_warnings, "warning_examples": warnings,
            "shutdown_error_lines": n_shutdown}


def store_stats(url: str) -> dict | None:
    from store_backends import open_store

    try:
        store = open_store(url)
    except Exception as exc:
        return {"error": str(exc)}
    try:
        st = store.stats()
        return {k: getattr(st, k) for k in ("num_blocks", "nbytes", "num_evictions") if hasattr(st, k)}
    except Exception as exc:
        return {"error": str(exc)}
    finally:
        store.close()


# ---------------------------------------------------------------------------
# Sending requests.
# ---------------------------------------------------------------------------

_clients = threading.local()


def _client(base: str):
    from openai import OpenAI

    c = getattr(_clients, "c", None)
    if c is None or getattr(_clients, "base", None) != base:
        c = OpenAI(base_url=base + "/v1", api_key="not-needed", timeout=600, max_retries=0)
        _clients.c, _clients.base = c, base
    return c


def send_one(base: str, model: str, req: Request, max_tokens: int, t_pass: float) -> RequestResult:
    res = RequestResult(index=req.index, doc=req.doc)
    start = time.perf_counter()
    res.start_s = start - t_pass
    try:
        stream = _client(base).completions.create(
            model=model, prompt=req.prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and res.ttft_s is None:
                res.ttft_s = time.perf_counter() - start
            usage = getattr(chunk, "usage", None)
            if usage:
                res.prompt_tokens = usage.prompt_tokens
                res.completion_tokens = usage.completion_tokens
        res.latency_s = time.perf_counter() - start
        if res.ttft_s is None:
            res.error = "no token streamed"
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:500]
        res.latency_s = time.perf_counter() - start
    return res


def run_pass(base: str, model: str, reqs: list[Request], concurrency: int, max_tokens: int,
             pass_index: int) -> PassResult:
    before = read_metrics(base)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda r: send_one(base, model, r, max_tokens, t0), reqs))
    wall = time.perf_counter() - t0
    time.sleep(1.0)     # let the last step's stats reach the frontend's Prometheus counters
    return PassResult(pass_index=pass_index, wall_s=wall, results=results,
                      metrics=metric_delta(read_metrics(base), before),
                      load_avg=(load0, os.getloadavg()[0]))


# ---------------------------------------------------------------------------
# One configuration.
# ---------------------------------------------------------------------------

def run_config(cfg: ServerConfig, opts, reqs: list[Request], work: str, env: dict) -> ConfigResult:
    url = None
    shm_name = None
    if cfg.store_kind == "shm":
        shm_name = "servebench" + uuid.uuid4().hex[:8]
        url = f"shm://{shm_name}?capacity=1GiB"     # reserved up front; the workload needs ~150 MB
    elif cfg.store_kind == "disk":
        url = f"disk://{tempfile.mkdtemp(prefix='store-' + cfg.name + '-', dir=work)}?capacity=8GiB"
    out = ConfigResult(config=cfg, store_url=url)
    port = opts.port or free_port()
    base = f"http://127.0.0.1:{port}"
    out.log_path = os.path.join(work, f"server-{cfg.name}.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", opts.model,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(opts.max_model_len),
           "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE), "--seed", "0",
           "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if cfg.prefix_caching else "--no-enable-prefix-caching"]
    if url:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "UCMConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"store": url}})]
    proc = None
    try:
        t0 = time.perf_counter()
        with open(out.log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        wait_health(base, proc, out.log_path, timeout=420)
        out.startup_s = time.perf_counter() - t0
        model = _client(base).models.list().data[0].id
        # One short unrelated request first (shorter than a block: nothing is
        # stored): the server's first request pays one-time costs.
        send_one(base, model, Request(-1, -1, "def add(a, b):\n    return a + b\n\n# A short note:"),
                 4, time.perf_counter())
        for p in range(1, opts.passes + 1):
            if p > 1:
                time.sleep(opts.pause)
            pr = run_pass(base, model, reqs, opts.concurrency, opts.max_tokens, p)
            out.passes.append(pr)
            s = pr.summary()
            say(f"  {cfg.name} pass {p}: {s['wall_s']:.1f} s, {fmt(s['req_per_s'], 2)} req/s, "
                f"TTFT p50 {fmt(s['ttft_p50_s'])} s p90 {fmt(s['ttft_p90_s'])} s, "
                f"external hits {fmt(s['external_hit_tokens'], 0)}, cached {fmt(s['cached_prompt_tokens'], 0)} "
                f"of {s['prompt_tokens']} prompt tokens, failed {s['failed']}")
            for r in pr.results:
                if r.error:
                    say(f"    request {r.index} (doc {r.doc}) failed: {r.error}")
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        say(f"  {cfg.name}: FAILED: {out.error}")
    finally:
        try:
            stop_offset = os.path.getsize(out.log_path)
        except OSError:
            stop_offset = None
        stop_server(proc)
        out.log_findings = scan_log(out.log_path, stop_offset)
        if url and out.startup_s is not None:
            out.store_stats = store_stats(url)      # the shm server outlives vLLM's: stop it after
        if shm_name:
            stopped = subprocess.run([sys.executable, "-m", "store_backends.shm_server", "stop", shm_name],
                                     cwd=ROOT, env=env, capture_output=True, text=True)
            if stopped.returncode != 0:
                say(f"  (stopping shm server {shm_name}: rc {stopped.returncode} {stopped.stderr.strip()[-200:]})")
    return out


def fmt(x, digits=3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def render(results: list[ConfigResult], meta: dict) -> str:
    lines = [f"Command: `{meta['command']}`; wall {meta['wall_s']:.0f} s. {meta['num_requests']} requests "
             f"({meta['num_docs']} documents of ~{meta['doc_tokens']} tokens + a short question; "
             f"{meta['mean_prompt_tokens']:.0f} prompt tokens on average), concurrency {meta['concurrency']}, "
             f"{meta['max_tokens']} output tokens each (ignore_eos), same order in every configuration. "
             f"Every server: VLLM_CPU_KVCACHE_SPACE={meta['kv_space']}, "
             f"VLLM_CPU_NUM_OF_RESERVED_CPU={meta['reserved_cpus']}, bf16, --enforce-eager, --block-size 128. "
             "Load avg: the machine's 1-minute load average at the pass's start and end (2 cores; "
             "above about 1.5 something else was running).",
             "",
             "| config | pass | req/s | out tok/s | TTFT p50 s | TTFT p90 s | TTFT p99 s | mean latency s "
             "| external hit tokens | prompt tokens cached | prompt tokens | failed | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cr in results:
        if cr.error and not cr.passes:
            lines.append(f"| {cr.config.name} | - | failed: {cr.error[:120]} ||||||||||||")
            continue
        for pr in cr.passes:
            s = pr.summary()
            lines.append(f"| {cr.config.name} | {s['pass']} | {fmt(s['req_per_s'], 2)} | {fmt(s['out_tok_per_s'], 1)} | "
                         f"{fmt(s['ttft_p50_s'])} | {fmt(s['ttft_p90_s'])} | {fmt(s['ttft_p99_s'])} | "
                         f"{fmt(s['latency_mean_s'])} | {fmt(s['external_hit_tokens'], 0)} | "
                         f"{fmt(s['cached_prompt_tokens'], 0)} | {s['prompt_tokens']} | {s['failed']} | "
                         f"{pr.load_avg[0]:.1f}-{pr.load_avg[1]:.1f} |")
    base = next((cr for cr in results if cr.config.name == "noconn" and cr.passes), None)
    if base is not None:
        lines += ["", "Against `noconn` (same pass): throughput = req/s ratio, TTFT = p50 ratio.", "",
                  "| config | pass | req/s vs noconn | TTFT p50 vs noconn | mean latency vs noconn |",
                  "|---|---|---|---|---|"]
        for cr in results:
            if cr is base:
                continue
            for pr in cr.passes:
                if pr.pass_index > len(base.passes):
                    continue
                s, b = pr.summary(), base.passes[pr.pass_index - 1].summary()
                r = lambda k: (s[k] / b[k]) if s[k] and b[k] else None  # noqa: E731
                lines.append(f"| {cr.config.name} | {s['pass']} | {fmt(r('req_per_s'), 2)}x | "
                             f"{fmt(r('ttft_p50_s'), 3)} | {fmt(r('latency_mean_s'), 3)} |")
    notes = []
    for cr in results:
        f = cr.log_findings
        if f.get("error_lines") or f.get("connector_warning_lines") or f.get("shutdown_error_lines"):
            notes.append(f"- {cr.config.name}: {f['error_lines']} error lines and "
                         f"{f['connector_warning_lines']} connector/store warnings while serving, "
                         f"{f['shutdown_error_lines']} error lines during shutdown, in {cr.log_path}")
            for ex in f["error_examples"][:4] + f["warning_examples"][:4]:
                notes.append(f"    {ex}")
        if cr.store_stats:
            notes.append(f"- {cr.config.name}: store after the run: {cr.store_stats}")
    if notes:
        lines += ["", "Server logs and stores:"] + notes
    return "\n".join(lines)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated, in run order, from {', '.join(CONFIGS)} (default {DEFAULT_CONFIGS})")
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    parser.add_argument("--docs", type=int, default=4, help="shared prefixes (default 4)")
    parser.add_argument("--doc-tokens", type=int, default=1536, help="tokens of standard-library text per document (default 1536)")
    parser.add_argument("--requests", type=int, default=32, help="requests per pass (default 32)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=24, help="output tokens per request (default 24)")
    parser.add_argument("--passes", type=int, default=2, help="times the request list is sent (default 2)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between passes (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed of the request order (default 0)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-space", default="2", help="VLLM_CPU_KVCACHE_SPACE in GiB (default 2)")
    parser.add_argument("--reserved-cpus", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU (default 1)")
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one per server)")
    parser.add_argument("--work-dir", default=None, help="stores and server logs (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (it is also kept when a log has errors)")
    parser.add_argument("--json", help="write the summary and every request's timings here")
    opts = parser.parse_args()

    names = [c.strip() for c in opts.configs.split(",") if c.strip()]
    for n in names:
        if n not in CONFIGS:
            parser.error(f"--configs: unknown configuration {n!r} (one of {', '.join(CONFIGS)})")
    if not os.path.isdir(opts.model):
        parser.error(f"no model at {opts.model} (make models)")
    try:
        import openai  # noqa: F401
    except ImportError:
        parser.error("needs the `openai` package: .venv/bin/pip install openai")

    work = opts.work_dir or tempfile.mkdtemp(prefix="serving-bench-")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(opts.kv_space),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": str(opts.reserved_cpus),
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                "UCM_SHM_RUNTIME_DIR": os.path.join(work, "shm-run")})
    os.environ["UCM_SHM_RUNTIME_DIR"] = env["UCM_SHM_RUNTIME_DIR"]

    docs = build_documents(opts.model, opts.docs, opts.doc_tokens)
    reqs = build_requests(docs, opts.requests, opts.seed)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(opts.model, "tokenizer.json"))
    mean_prompt = sum(len(tok.encode(r.prompt).ids) for r in reqs) / len(reqs)
    say(f"# serving_bench: {names}; {len(reqs)} requests over {opts.docs} documents, "
        f"~{mean_prompt:.0f} prompt tokens each, concurrency {opts.concurrency}, {opts.max_tokens} output tokens, "
        f"{opts.passes} passes; work dir {work}")

    # A plain `kill` (SIGTERM) unwinds like Ctrl-C, so the running server and
    # its shm store are stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    t_run = time.perf_counter()
    results: list[ConfigResult] = []
    for n in names:
        say(f"[{time.perf_counter() - t_run:5.0f} s] {n}: {CONFIGS[n].description}")
        results.append(run_config(CONFIGS[n], opts, reqs, work, env))

    meta = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
            "wall_s": time.perf_counter() - t_run, "num_requests": len(reqs), "num_docs": opts.docs,
            "doc_tokens": opts.doc_tokens, "mean_prompt_tokens": mean_prompt,
            "concurrency": opts.concurrency, "max_tokens": opts.max_tokens, "passes": opts.passes,
            "kv_space": opts.kv_space, "reserved_cpus": opts.reserved_cpus, "model": opts.model}
    table = render(results, meta)
    say()
    say(table)
    if opts.json:
        doc = {"meta": meta, "table": table, "configs": [{
            "name": cr.config.name, "config": asdict(cr.config), "store_url": cr.store_url,
            "startup_s": cr.startup_s, "error": cr.error, "store_stats": cr.store_stats,
            "log_findings": cr.log_findings,
            "passes": [{"summary": pr.summary(), "metrics": pr.metrics,
                        "requests": [asdict(r) for r in pr.results]} for pr in cr.passes]}
            for cr in results]}
        with open(opts.json, "w") as f:
            json.dump(doc, f, indent=1)
        say(f"\nJSON written to {opts.json}")
    troubled = any(cr.error or cr.log_findings.get("error_lines") for cr in results)
    if opts.work_dir or opts.keep or troubled:
        say(f"work dir kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(cr.error for cr in results) else 0


if __name__ == "__main__":
    sys.exit(main())
