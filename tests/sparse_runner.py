"""Runs ONE vLLM engine in this process and a list of steps from a JSON spec;
used by tests/test_sparse_e2e.py as a subprocess.

    python tests/sparse_runner.py SPEC.json OUT.json

The engine core and its worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a step can switch sparse attention
on and off between generate calls, and read what the attention kernel was
given.

Spec::

    {"model": DIR, "max_model_len": 4096, "prefix_caching": false,
     "max_num_batched_tokens": 256,
     "num_blocks": N,                # KV cache blocks (num_gpu_blocks_override)
     "enforce_eager": true,          # false: torch.compile, attention as a split point
     "store": URL | null,            # UCMConnector with this store, or none
     "extra_config": {...},          # more kv_connector_extra_config keys
     "sparse": {...} | null,         # a method on from the start (and in extra_config)
     "speculative": {...} | null,    # vLLM's speculative_config
     "activate": true,               # false: leave turning it on to the connector
     "steps": [...]}

Steps (results keyed by "name"):

* ``{"op": "sparse", "config": {"method": ...} | null}``: turn the method on
  the way the connector does (``ucm_connector.plugin.apply_sparse``), or
  null: ``patches.revert()``.
* ``{"op": "generate", "name": N, "prompts": [{"tokens": [...]}], "max_tokens": 8}``:
  one greedy ``LLM.generate`` call; the result holds ``outputs`` (token ids),
  ``patched`` (whether vLLM was patched), ``kernel`` (what the CPU attention
  kernel was handed for decode rows: calls, blocks), ``method`` (the
  method's own counters for this call) and ``spec`` (vLLM's speculative
  decoding counters for it).
* ``{"op": "flush"}``: wait until the connector's store stops growing.

The method ``test_all_blocks`` is registered here: it hands the kernel every
block of every decode row through the same swap path a real selection takes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _register_test_methods() -> None:
    from ucm_connector.sparse import BlockSelection, SparseMethod, register_method

    class AllBlocks(SparseMethod):
        """Selects every block: a full copy of the table and lengths."""

        name = "test_all_blocks"

        @classmethod
        def from_config(cls, options):
            return cls()

        def before_attention(self, batch):
            return BlockSelection(block_table=batch.block_table.clone(), seq_lens=batch.seq_lens.clone())

    register_method(AllBlocks.name, AllBlocks)


class KernelSpy:
    """Counts the rows of one query token (decode rows) the CPU attention
    kernel is handed, per layer call, and their blocks (ceil(seq_len /
    block_size) each); and the rows of 2 to 4 query tokens (with
    speculative decoding: a request verifying draft tokens) and theirs."""

    def __init__(self) -> None:
        self.calls = 0
        self.rows = 0
        self.blocks = 0
        self.verify_rows = 0
        self.verify_blocks = 0

    def install(self) -> None:
        from vllm.v1.attention.backends import cpu_attn

        ops = cpu_attn.ops
        original = ops.cpu_attention_with_kv_cache
        spy = self

        def counted(*args, **kwargs):
            qsl, seq_lens = kwargs["query_start_loc"], kwargs["seq_lens"]
            block_size = kwargs["key_cache"].shape[2]
            q_lens = qsl[1:] - qsl[:-1]
            decode, verify = q_lens == 1, (q_lens > 1) & (q_lens <= 4)
            spy.verify_rows += int(verify.sum())
            spy.verify_blocks += int(((seq_lens[verify] + block_size - 1) // block_size).sum())
            if bool(decode.any()):
                spy.calls += 1
                spy.rows += int(decode.sum())
                spy.blocks += int(((seq_lens[decode] + block_size - 1) // block_size).sum())
            return original(*args, **kwargs)

        ops.cpu_attention_with_kv_cache = counted

    def take(self) -> dict:
        out = {"calls": self.calls, "rows": self.rows, "blocks": self.blocks, "verify_rows": self.verify_rows,
               "verify_blocks": self.verify_blocks}
        self.calls = self.rows = self.blocks = self.verify_rows = self.verify_blocks = 0
        return out


def signature(batch) -> str:
    """What a kernel compiled for a layer call depends on: dtypes, shapes
    past the first dimension, 16-byte alignment where the kernels
    specialise on it (not vLLM's metadata), the layer's sizes and how its
    pages are read."""
    def tensor(t, aligned=True):
        if t is None:
            return None
        return [str(t.dtype), list(t.shape[1:])] + ([t.data_ptr() % 16 == 0] if aligned else [])

    pages = batch.pages
    view = pages.key_view() if pages is not None else None
    return json.dumps({
        "query": tensor(batch.query), "key": tensor(batch.key),
        "slot_mapping": tensor(batch.slot_mapping, False), "query_start_loc": tensor(batch.query_start_loc, False),
        "seq_lens": tensor(batch.seq_lens, False), "block_table": tensor(batch.block_table, False),
        "sizes": [batch.block_size, batch.num_cache_blocks, batch.num_kv_heads, batch.head_size],
        "pages": type(pages).__name__, "key_view": None if view is None else [tensor(view), list(view.stride())],
    }, sort_keys=True)


class SignatureSpy:
    """The signatures of the example calls ``block_topk`` is warmed up on
    at start-up and of the layer calls it is handed while serving."""

    def __init__(self) -> None:
        self.warm_up: set[str] = set()
        self.calls: set[str] = set()

    def install(self) -> None:
        from ucm_connector.sparse.block_topk import BlockTopK

        warm_up, before = BlockTopK.warm_up, BlockTopK.before_attention
        spy = self

        def spied_warm_up(method, example):
            spy.warm_up.add(signature(example))
            return warm_up(method, example)

        def spied_before(method, batch):
            spy.calls.add(signature(batch))
            return before(method, batch)

        BlockTopK.warm_up, BlockTopK.before_attention = spied_warm_up, spied_before


def build_llm(spec: dict):
    from vllm import LLM

    from ucm_testing.dtypes import engine_dtype

    kwargs = dict(
        model=spec["model"], dtype=engine_dtype(), max_model_len=int(spec.get("max_model_len", 4096)),
        enforce_eager=bool(spec.get("enforce_eager", True)),
        enable_prefix_caching=bool(spec.get("prefix_caching", False)), seed=0,
        max_num_batched_tokens=int(spec.get("max_num_batched_tokens", 256)),
    )
    if spec.get("speculative"):
        kwargs.update(speculative_config=spec["speculative"], disable_log_stats=False)
    if spec.get("num_blocks"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_blocks"])
    if spec.get("store") is not None:
        # Every hit is loaded unless a test asks otherwise (as in e2e_runner).
        extra = {"store": spec["store"], "load_policy": "always", **spec.get("extra_config", {})}
        if spec.get("sparse"):
            extra["sparse"] = spec["sparse"]
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UCMConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra,
        }
    return LLM(**kwargs)


def spec_counters(llm, spec: dict) -> dict[str, float]:
    """vLLM's speculative decoding counters (drafts, draft tokens, accepted
    tokens), summed over labels; none for an engine without speculation
    (it keeps no metrics)."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    if not spec.get("speculative"):
        return out
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and "spec_decode" in metric.name:
            out[metric.name] = out.get(metric.name, 0) + metric.value
    return out


def method_stats() -> dict | None:
    import patches

    hooks = patches.active_hooks()
    return dataclasses.asdict(hooks.stats()) if hooks is not None else None


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result: dict = {"ok": False, "error": None, "steps": {}}

    def dump() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, out_path)

    try:
        import patches
        from vllm import SamplingParams

        from ucm_connector.plugin import apply_sparse

        _register_test_methods()
        spy = KernelSpy()
        spy.install()
        signatures = SignatureSpy()
        signatures.install()
        if spec.get("sparse") and spec.get("activate", True):
            apply_sparse(spec["sparse"])
        llm = build_llm(spec)
        result["patched_at_start"] = patches.applied()
        for n, step in enumerate(spec.get("steps", [])):
            op = step["op"]
            name = step.get("name", f"{n}:{op}")
            if op == "sparse":
                if step.get("config") is None:
                    patches.revert()
                else:
                    # As the connector does it: with the engine's config
                    # (speculative decoding, CUDA graphs).
                    apply_sparse(step["config"], llm.llm_engine.vllm_config)
                res = {"patched": patches.applied()}
            elif op == "generate":
                prompts = [{"prompt_token_ids": [int(t) for t in p["tokens"]]} for p in step["prompts"]]
                params = SamplingParams(temperature=0.0, max_tokens=int(step.get("max_tokens", 8)),
                                        ignore_eos=True, detokenize=False)
                before, spec_before = method_stats(), spec_counters(llm, spec)
                spy.take()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                after = method_stats()
                counted = {k: v - spec_before.get(k, 0) for k, v in spec_counters(llm, spec).items()}
                res = {
                    "outputs": [list(o.outputs[0].token_ids) for o in outs],
                    "cached": [o.num_cached_tokens for o in outs],
                    "seconds": time.perf_counter() - t0,
                    "patched": patches.applied(),
                    "kernel": spy.take(),
                    "spec": counted,
                    "method": None if after is None else {
                        k: v - (before or {}).get(k, 0) for k, v in after.items()},
                }
            elif op == "flush":
                sys.path.insert(0, HERE)
                from e2e_runner import wait_quiet

                res = {"blocks": wait_quiet(spec["store"], min_blocks=int(step.get("min_blocks", 0)))}
            else:
                raise ValueError(f"unknown step op {op!r}")
            res["op"] = op
            result["steps"][name] = res
            dump()
        result["signatures"] = {"warm_up": sorted(signatures.warm_up), "calls": sorted(signatures.calls)}
        result["ok"] = True
    except BaseException as exc:
        result["error"] = "".join(traceback.format_exception(exc))
        traceback.print_exc()
        dump()
        return 3
    finally:
        dump()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
