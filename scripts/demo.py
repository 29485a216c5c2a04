"""A newcomer's first five minutes with ucm-connector (what `make run` calls).

    .venv/bin/python scripts/demo.py [--store URL] [--port N] [--prompt-tokens 2000] [--dtype D]

1. starts vLLM's OpenAI-compatible server with SmolLM2-135M and UCMConnector
   on a store (default: disk:// under ./.cache/ucm-demo), prefix caching off,
   in the model's bfloat16, or in float32 on a CPU that does not multiply
   bfloat16 natively (AVX2 alone), where a bfloat16 prefill is about five
   times slower;
2. sends one long prompt (about 2,000 tokens of Python standard-library
   source) twice with the `openai` client, streaming, and measures the time to
   the first token of each: the first is computed (and its KV saved to the
   store), the second loads the KV from the store;
3. prints both TTFTs, the prompt tokens the store supplied (from the server's
   Prometheus /metrics) and the store's own stats;
4. stops the server, also on Ctrl-C or an error.

The prompt starts with a random line, so every run's first request is a real
miss even when the store already holds earlier runs' blocks.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import sysconfig
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts.vllm_server import free_port, stop_server, tail, wait_health  # noqa: E402
BLOCK_SIZE = 128          # vLLM's CPU block size: the unit the store keeps
METRICS = (
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:prompt_tokens_total",
)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def build_prompt(model_dir: str, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of standard-library source, after a random line."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    stdlib = sysconfig.get_paths()["stdlib"]
    ids: list[int] = []
    for name in ("collections/__init__.py", "argparse.py", "dataclasses.py", "functools.py"):
        path = os.path.join(stdlib, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                ids.extend(tok.encode(f.read()).ids)
        if len(ids) >= n_tokens:
            break
    nonce = f"# demo run {random.getrandbits(64):016x}\n"
    return nonce + tok.decode(ids[:n_tokens]) + "\n# Summary of the code above:"


def read_metrics(base: str) -> dict[str, float]:
    """The few counters we show, summed over their label sets."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {name: 0.0 for name in METRICS}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)", line)
        if m and (m.group(1) in out or m.group(1).startswith("vllm:ucm_")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def store_blocks(url: str) -> int | None:
    from store_backends import open_store

    try:
        store = open_store(url)
    except Exception:
        return None
    try:
        return store.stats().num_blocks
    finally:
        store.close()


def stream_once(client, model: str, prompt: str) -> tuple[float, float, str, int | None]:
    """(TTFT s, total s, text, prompt tokens) of one streamed completion."""
    start = time.perf_counter()
    ttft = None
    text = []
    prompt_tokens = None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - start
            text.append(chunk.choices[0].text)
        if getattr(chunk, "usage", None):
            prompt_tokens = chunk.usage.prompt_tokens
    total = time.perf_counter() - start
    return (ttft if ttft is not None else total), total, "".join(text), prompt_tokens


def default_dtype() -> str | None:
    """float32 where vLLM's CPU build would run the model's bfloat16 without
    native bfloat16 matmuls (torch's slow path); None (the model's dtype)
    elsewhere."""
    import torch

    from ucm_testing.dtypes import cpu_multiplies_bf16

    if torch.cuda.is_available() or cpu_multiplies_bf16():
        return None
    return "float32"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_dir = os.path.join(ROOT, ".cache", "ucm-demo")
    parser.add_argument("--store", default=f"disk://{os.path.join(default_dir, 'kv')}?capacity=4GiB",
                        help="store URL (default: disk:// under ./.cache/ucm-demo); e.g. shm://demo?capacity=2GiB "
                             "or redis://127.0.0.1:6379/0")
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--dtype", help="the engine's dtype (default: the model's, or float32 on a CPU without "
                                        "native bfloat16 matmuls)")
    opts = parser.parse_args()

    if not os.path.isdir(opts.model):
        say(f"no model at {opts.model}: build it first with `make models`")
        return 2
    try:
        import openai  # noqa: F401
    except ImportError:
        say("the demo needs the `openai` package: .venv/bin/pip install openai")
        return 2

    os.makedirs(default_dir, exist_ok=True)
    port = opts.port or free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = os.path.join(default_dir, "server.log")
    kv_config = ('{"kv_connector":"UCMConnector","kv_role":"kv_both",'
                 '"kv_connector_extra_config":{"store":"%s"}}' % opts.store)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", opts.model,
           "--port", str(port), "--max-model-len", "4096", "--enforce-eager",
           "--no-enable-prefix-caching", "--kv-transfer-config", kv_config]
    dtype = opts.dtype or default_dtype()
    if dtype:
        cmd += ["--dtype", dtype]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    say("ucm-connector demo")
    say(f"  model : {os.path.relpath(opts.model, ROOT)}")
    say(f"  store : {opts.store}")
    if dtype:
        say(f"  dtype : {dtype}" + ("" if opts.dtype else " (this CPU does not multiply bfloat16 natively)"))
    say(f"  vLLM's own prefix cache is OFF, so any reuse below comes from the store.")
    say()
    proc = None
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        say(f"starting vLLM on port {port} (about 20 s; its log is in {os.path.relpath(log_path, ROOT)})")
        wait_health(base, proc, log_path, timeout=300, progress=True)
        say("vLLM is up.")

        from openai import OpenAI

        client = OpenAI(base_url=base + "/v1", api_key="not-needed")
        model = client.models.list().data[0].id
        prompt = build_prompt(opts.model, opts.prompt_tokens)
        blocks_before = store_blocks(opts.store)

        say()
        say("request 1: a ~%d-token prompt the store has never seen (computed, then saved)..." % opts.prompt_tokens)
        m0 = read_metrics(base)
        ttft1, total1, text1, n_prompt = stream_once(client, model, prompt)
        time.sleep(0.5)
        m1 = read_metrics(base)
        say(f"  TTFT {ttft1:.3f} s ({n_prompt} prompt tokens)")

        # The connector writes blocks in the background after the request;
        # give it a moment so the second request finds all of them.
        if blocks_before is not None and n_prompt:
            expected = blocks_before + n_prompt // BLOCK_SIZE
            deadline = time.monotonic() + 15
            while (store_blocks(opts.store) or 0) < expected and time.monotonic() < deadline:
                time.sleep(0.1)

        say("request 2: the same prompt again (loaded from the store)...")
        ttft2, total2, text2, _ = stream_once(client, model, prompt)
        time.sleep(0.5)
        m2 = read_metrics(base)
        say(f"  TTFT {ttft2:.3f} s")

        hits1 = m1["vllm:external_prefix_cache_hits_total"] - m0["vllm:external_prefix_cache_hits_total"]
        hits2 = m2["vllm:external_prefix_cache_hits_total"] - m1["vllm:external_prefix_cache_hits_total"]
        queried2 = m2["vllm:external_prefix_cache_queries_total"] - m1["vllm:external_prefix_cache_queries_total"]
        say()
        say("results")
        say(f"  cold TTFT (computed)        : {ttft1:.3f} s")
        say(f"  warm TTFT (from the store)  : {ttft2:.3f} s   ({ttft2 / ttft1:.2f}x of cold, "
            f"{ttft1 / ttft2:.1f}x faster)")
        say(f"  tokens loaded from the store: request 1: {hits1:.0f}, request 2: {hits2:.0f} of {queried2:.0f} "
            f"prompt tokens (vllm:external_prefix_cache_hits_total)")
        say(f"  (the last partial {BLOCK_SIZE}-token block and at least one token are always computed)")
        same = "yes" if text1 == text2 else "no (in bf16 a split prompt can differ after a few tokens)"
        say(f"  same completion both times  : {same}")
        say(f"  completion: {text2.strip()[:70]!r}")

        say()
        say("connector counters on /metrics (vllm:ucm_*, this server's whole run; docs/metrics.md)")
        m3 = read_metrics(base)
        ucm = {k[len("vllm:ucm_"):].removesuffix("_total"): v for k, v in m3.items()
               if k.startswith("vllm:ucm_")}
        if not ucm:
            say("  none yet (the server reports them with its next stats interval)")
        else:
            def rate(nbytes: float, seconds: float) -> str:
                return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds else "-"
            say(f"  hit tokens {ucm.get('hit_tokens', 0):.0f} of {ucm.get('lookup_tokens', 0):.0f} looked up")
            say(f"  loaded {ucm.get('loaded_blocks', 0):.0f} blocks, {ucm.get('loaded_bytes', 0) / 2**20:.1f} MiB "
                f"in {ucm.get('load_seconds', 0):.3f} s ({rate(ucm.get('loaded_bytes', 0), ucm.get('load_seconds', 0))})")
            say(f"  saved  {ucm.get('saved_blocks', 0):.0f} blocks, {ucm.get('saved_bytes', 0) / 2**20:.1f} MiB "
                f"in {ucm.get('save_seconds', 0):.3f} s, {ucm.get('skipped_saves', 0):.0f} skipped (already stored)")
            say(f"  load errors {ucm.get('load_errors', 0):.0f}, store errors {ucm.get('store_errors', 0):.0f}")

        from store_backends import open_store

        store = open_store(opts.store)
        try:
            st = store.stats()
        finally:
            store.close()
        say()
        say(f"store stats ({st.url})")
        size = f"{st.nbytes / 2**20:.1f} MiB" if st.nbytes is not None else "?"
        cap = f" of {st.capacity_nbytes / 2**30:.1f} GiB" if st.capacity_nbytes else ""
        say(f"  blocks {st.num_blocks}, {size}{cap}, puts {st.num_puts}, gets {st.num_gets}, "
            f"hits {st.num_hits}, misses {st.num_misses}, evictions {st.num_evictions}")
        say("  (gets/hits/puts are what this process saw; blocks and bytes are the whole store's)")
        if opts.store.startswith("shm://"):
            name = opts.store[len("shm://"):].split("?")[0]
            say(f"  the shm store's server keeps running; stop it with: "
                f"python -m store_backends.shm_server stop {name}")
        say()
        return 0
    except KeyboardInterrupt:
        say("\ninterrupted")
        return 130
    except Exception as exc:
        say(f"\nthe demo failed: {exc}")
        if proc is not None:
            say(f"last lines of the server log ({log_path}):\n{tail(log_path)}")
        return 1
    finally:
        if proc is not None and proc.poll() is None:
            say("stopping the vLLM server...")
        stop_server(proc)
        say("done.")


if __name__ == "__main__":
    sys.exit(main())
