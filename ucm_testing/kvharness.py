"""A scheduler-level harness for UCMConnector: vLLM's real scheduler, stepped
with a fake model runner, over real stores.

What is real: ``vllm.v1.core.sched.scheduler.Scheduler`` (block allocation,
prefix caching, chunked prefill, preemption, load-failure recovery), the
connector in both roles (created by vLLM's ``KVConnectorFactory``, so
``MultiConnector`` works too), the stores, and the order in which vLLM's
model runner calls the worker-side hooks (``kv_connector_model_runner_mixin``:
bind, ``start_load_kv`` before the forward when the step has sync loads and
after it otherwise, ``wait_for_layer_load`` / ``save_kv_layer`` per layer,
``wait_for_save``, transfer results, load errors, clear).

What is fake: the model.  Its KV cache is one int64 page per block and
layer, and its "forward pass" is a deterministic integer function that,
like attention, reads the pages of every earlier position, so KV computed
on top of a bad page comes out wrong:

    h_0(p)     = token(p) + 1 + W * weights     (weights: 0 unless a test changes them)
    kv_l(p)    = mix(l, h_l(p))                  written into the page of p
    d_l(p)     = digest of kv_l(0..p), read from the pages
    h_l+1(p)   = mix(h_l(p), d_l(p))
    next token = h_L(last) % VOCAB + 1

All of a layer's new KV is written before any of it is read, as in vLLM,
so requests sharing blocks within a step see each other's writes.  Because
the arithmetic is exact, the right KV of a block is a function of the
tokens up to its end; ``check_store`` compares every block in the store
with it, byte for byte, after every step.
"""

from __future__ import annotations

import collections
import itertools
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "tiny-llama")

MOD = (1 << 61) - 1
VOCAB = 997
_MUL_KV = 1_000_003
_MUL_D = 7_919
_MUL_H = 104_729
_MUL_W = 15_485_863     # what a change of the model's weights (``Harness.weights``) adds


def _h0(token: int, weights: int) -> int:
    """A token's input to the first layer, under the model's weights."""
    return token + 1 + weights * _MUL_W


def _mix_kv(layer: int, h: int) -> int:
    return (h * _MUL_KV + 31 * layer + 17) % MOD


def _mix_h(h: int, d: int) -> int:
    return (h * _MUL_H + d + 1) % MOD


def reference_kv(tokens: list[int], num_layers: int, weights: int = 0) -> list[list[int]]:
    """kv[l][p] of a sequence computed from scratch by the model with these
    weights: what every page of it must hold."""
    h = [_h0(t, weights) for t in tokens]
    kv_layers = []
    for layer in range(num_layers):
        kv = [_mix_kv(layer, x) for x in h]
        kv_layers.append(kv)
        d = 0
        for p, value in enumerate(kv):
            d = (d * _MUL_D + value) % MOD
            h[p] = _mix_h(h[p], d)
    kv_layers.append(h)  # the last entry: the final hidden states
    return kv_layers


def reference_generate(prompt: list[int], max_tokens: int, num_layers: int, weights: int = 0) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        h = reference_kv(tokens, num_layers, weights)[-1]
        nxt = h[-1] % VOCAB + 1
        out.append(nxt)
        tokens.append(nxt)
    return out


# Every token sequence seen in this process, and the blocks each must have.
_SEQUENCES: set[tuple[int, ...]] = set()
_EXPECTED: dict[tuple, dict[bytes, bytes]] = {}
# Every (generation of keys, weights) a connector of this process has keyed
# blocks with: a harness starts with the first generation and weights 0.
_GENERATIONS: list[tuple[bytes, int]] = [(b"", 0)]


@dataclass
class Step:
    """What one step did, for assertions."""
    num: int
    scheduled: dict[str, int]
    invalid_block_ids: set[int]
    finished_recving: set[str]
    loads: dict[str, int]                   # req_id -> blocks planned to load


@dataclass
class Harness:
    store: Any                              # a store URL or a list of URLs (a tier)
    load_mode: str = "sync"
    block_size: int = 16
    num_blocks: int = 128
    num_layers: int = 2
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    prefix_caching: bool = True
    multi: bool = False                     # UCMConnector as a MultiConnector child
    policy: str | None = "recompute"        # kv_load_failure_policy; None = vLLM's default
    extra: dict = field(default_factory=dict)
    check_every_step: bool = True
    # Called as before_load(harness, scheduler_output) between the schedule
    # (the lookup) and the worker's loads: a test breaks the store there.
    before_load: Any = None
    # Bigger pages: each slot holds its value kv_width times (blocks of
    # block_size * kv_width * 8 bytes per layer), so that a store's speed
    # shows at realistic sizes.
    kv_width: int = 1
    # What the fake forward pass costs: it sleeps this long per token it
    # computes, so that recomputing has a price (load_policy auto).
    seconds_per_token: float = 0.0
    # The fake model's weights: 0, the weight files', until ``update_weights``
    # changes them, as a reinforcement-learning step does to a running engine.
    weights: int = field(default=0, init=False)
    # vLLM's async scheduling (its default on GPUs): a step is scheduled and
    # run before the previous step's output reaches the scheduler.
    async_scheduling: bool = False
    kv_role: str = "kv_both"
    # vLLM's KV events on (published nowhere): what the connector hands
    # vLLM's scheduler is kept in ``connector_events``.
    kv_events: bool = False

    def __post_init__(self) -> None:
        from vllm import SamplingParams  # noqa: F401  (imported early: fails fast without vLLM)
        from vllm.config import (CacheConfig, DeviceConfig, KVEventsConfig, KVTransferConfig, ModelConfig,
                                 SchedulerConfig, VllmConfig)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from ucm_connector.plugin import register

        register()
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]
        mode = {"sync": {}, "async": {"load_kv_async": True}, "layer": {"load_layerwise": True}}[self.load_mode]
        ucm = {"kv_connector": "UCMConnector", "kv_role": self.kv_role,
               "kv_connector_extra_config": {"store": self.store, **mode, **self.extra}}
        if self.multi:
            top = {"kv_connector": "MultiConnector", "kv_role": self.kv_role,
                   "kv_connector_extra_config": {"connectors": [ucm]}}
        else:
            top = dict(ucm)
        if self.policy is not None:
            top["kv_load_failure_policy"] = self.policy
        model_config = ModelConfig(model=MODEL, dtype="bfloat16", seed=0, max_model_len=4096)
        self.vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=4096, enable_chunked_prefill=True,
                is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=self.block_size, enable_prefix_caching=self.prefix_caching),
            kv_transfer_config=KVTransferConfig(**top),
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if self.kv_events else None,
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=self.num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(self.layer_names, FullAttentionSpec(
                block_size=self.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        self.vllm_config.cache_config.num_gpu_blocks = self.num_blocks
        if self.async_scheduling:
            # vLLM turns it off on CPUs; the connector reads it from the config.
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            self.vllm_config.scheduler_config.async_scheduling = True
        self.scheduler = (AsyncScheduler if self.async_scheduling else Scheduler)(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.block_size, log_stats=True)
        self.worker = KVConnectorFactory.create_connector(
            config=self.vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config)
        # One int64 page of block_size slots per block and layer.
        shape = (self.num_blocks, self.block_size) + ((self.kv_width,) if self.kv_width > 1 else ())
        self.caches = {name: torch.zeros(*shape, dtype=torch.int64) for name in self.layer_names}
        self.worker.register_kv_caches(self.caches)
        self.ucm_worker = _ucm(self.worker)
        self.ucm_scheduler = _ucm(self.scheduler.connector)
        self.connector_events: list = []
        take_events = self.scheduler.connector.take_events

        def keep_events():
            events = list(take_events())
            self.connector_events.extend(events)
            return events

        self.scheduler.connector.take_events = keep_events
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(self.block_size, sha256)
        self.requests: dict[str, Any] = {}
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}        # req_id -> finish reason
        self.damaged: set[bytes] = set()          # keys the test broke on purpose
        self.steps: list[Step] = []
        self._pending_finished: set[str] = set()
        self._in_flight: collections.deque = collections.deque()
        self._worker_tokens: dict[str, list[int]] = {}
        self._store = self.ucm_worker.store

    # -- requests --------------------------------------------------------------

    def add(self, prompt: list[int], max_tokens: int = 4, req_id: str | None = None) -> str:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req_id = req_id or "r" + uuid.uuid4().hex[:8]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        params.update_from_generation_config({}, None)
        request = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                          pooling_params=None, block_hasher=self._block_hasher)
        self.requests[req_id] = request
        self.prompts[req_id] = list(prompt)
        self.outputs[req_id] = []
        self.scheduler.add_request(request)
        return req_id

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.finished[req_id] = "abort"

    # -- one step --------------------------------------------------------------

    def step(self) -> Step | None:
        """Schedule and run one step; with ``async_scheduling``, as vLLM's
        engine core does with its batch queue of two: step N+1 is scheduled
        and run before step N's output reaches the scheduler.  Returns the
        step whose output the scheduler took in (None if it took none)."""
        if not self.async_scheduling:
            out = self.scheduler.schedule()
            return self._finish(out, *self._execute(out))
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            self._in_flight.append((out, *self._execute(out)))
            if len(self._in_flight) < 2 and out.total_num_scheduled_tokens > 0:
                return None
        return self._finish(*self._in_flight.popleft()) if self._in_flight else None

    def _execute(self, out):
        """The worker's side of a step, in the order vLLM's model runner calls it."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        if self.before_load is not None:
            self.before_load(self, out)
        meta = out.kv_connector_metadata
        w = self.worker
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        sampled = self._forward(out)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_cache_events=w.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_output)
        return runner_output, meta, invalid, results

    def _finish(self, out, runner_output, meta, invalid, results) -> Step:
        """The scheduler takes in a step's output."""
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.new_token_ids:
                    self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)
        ucm_meta = _ucm_meta(meta)
        loads: dict[str, int] = {}
        for plan in (ucm_meta.loads if ucm_meta is not None else ()):
            loads[plan.req_id] = loads.get(plan.req_id, 0) + len(plan.block_ids)
        step = Step(len(self.steps), dict(out.num_scheduled_tokens), set(invalid),
                    set(results.finished_recving or ()), loads)
        self.steps.append(step)
        if self.check_every_step:
            self.check_store()
        return step

    def run(self, max_steps: int = 200) -> None:
        """Step until no request is left."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self._in_flight:
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def _forward(self, out) -> dict[str, list[int]]:
        """The fake model: write each scheduled token's KV, layer by layer,
        reading every earlier position from the pages.  Returns the sampled
        token of each request that reached the end of its tokens."""
        if self.async_scheduling:
            # The worker runs on the tokens it sampled itself, before the
            # scheduler has seen them (vLLM's async scheduling).
            resumed = getattr(out.scheduled_cached_reqs, "resumed_req_ids", set()) or set()
            for req_id in [new.req_id for new in out.scheduled_new_reqs] + list(resumed):
                self._worker_tokens[req_id] = list(self.scheduler.requests[req_id].all_token_ids)
        work = []
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            c = request.num_computed_tokens       # already advanced by schedule()
            start = c - n
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            tokens = self._worker_tokens[req_id] if self.async_scheduling else list(request.all_token_ids)
            h = [_h0(tokens[p], self.weights) for p in range(start, start + n)]
            work.append((req_id, start, n, list(block_ids), tokens, h))
        for layer, name in enumerate(self.layer_names):
            self.worker.wait_for_layer_load(name)
            page = self.caches[name]
            for req_id, start, n, block_ids, tokens, h in work:
                for i in range(n):
                    p = start + i
                    page[block_ids[p // self.block_size], p % self.block_size] = _mix_kv(layer, h[i])
            for req_id, start, n, block_ids, tokens, h in work:
                end = start + n
                nblk = (end + self.block_size - 1) // self.block_size
                pages = page[block_ids[:nblk]]
                flat = (pages[..., 0] if self.kv_width > 1 else pages).reshape(-1)[:end].tolist()
                d = 0
                for p, value in enumerate(flat):
                    d = (d * _MUL_D + (value % MOD)) % MOD
                    if p >= start:
                        h[p - start] = _mix_h(h[p - start], d)
            self.worker.save_kv_layer(name, page, None)
        if self.seconds_per_token:
            time.sleep(self.seconds_per_token * sum(n for _, _, n, _, _, _ in work))
        sampled = {}
        for req_id, start, n, block_ids, tokens, h in work:
            if start + n >= len(tokens):
                sampled[req_id] = [h[-1] % VOCAB + 1]
                if self.async_scheduling:
                    del tokens[start + n:]          # a rewound request samples again
                    tokens.append(sampled[req_id][0])
        return sampled

    # -- the store ---------------------------------------------------------------

    @property
    def namespace(self):
        from ucm_connector.layout import namespace_for

        return namespace_for(self.vllm_config)

    def keys_of(self, tokens: list[int], generation: bytes = b"") -> list[bytes]:
        """The stored keys of the full blocks of ``tokens`` (TP rank 0), in
        the first generation of keys or in ``generation``."""
        from ucm_connector.hashing import BlockHasher, keys_for_rank

        return keys_for_rank(BlockHasher(self.namespace, generation).request().update(tokens), 0)

    @property
    def generation(self) -> bytes:
        """The generation of keys the connector's scheduler uses now."""
        return self.ucm_scheduler._scheduler.hasher.generation

    def update_weights(self, weights: int, **reset) -> bool:
        """Change the model's weights the way a reinforcement-learning step
        does to a running engine: reset vLLM's prefix cache (``reset`` holds
        ``reset_prefix_cache``'s arguments, e.g. ``reset_connector=True``),
        then load other weights.  Returns what the reset returned."""
        before = self.generation
        done = self.scheduler.reset_prefix_cache(**reset)
        self.weights = weights
        if self.generation != before:
            _GENERATIONS.append((self.generation, weights))
        return done

    def expected_blocks(self) -> dict[bytes, bytes]:
        """key -> the payload its block must hold, for every sequence any
        harness of this process has seen (prompts and what was generated):
        engines share stores, so a store holds other harnesses' blocks."""
        for req_id, prompt in self.prompts.items():
            _SEQUENCES.add(tuple(prompt + self.outputs[req_id]))
        digest = self.namespace.digest
        expected: dict[bytes, bytes] = {}
        for (generation, weights), tokens in itertools.product(_GENERATIONS, _SEQUENCES):
            memo_key = (tokens, self.num_layers, self.block_size, self.kv_width, digest, generation, weights)
            blocks = _EXPECTED.get(memo_key)
            if blocks is None:
                kv = reference_kv(list(tokens), self.num_layers, weights)
                blocks = {}
                for j, key in enumerate(self.keys_of(list(tokens), generation)):
                    lo, hi = j * self.block_size, (j + 1) * self.block_size
                    blocks[key] = b"".join(
                        np.repeat(np.asarray(kv[layer][lo:hi], dtype=np.int64), self.kv_width).tobytes()
                        for layer in range(self.num_layers))
                _EXPECTED[memo_key] = blocks
            expected.update(blocks)
        return expected

    def flush(self) -> None:
        assert self.ucm_worker._worker.flush(timeout=30), "saves did not finish"
        flush = getattr(self._store, "flush", None)
        if callable(flush):
            flush(timeout=30)

    def stored_blocks(self) -> dict[bytes, bytes]:
        from ucm_connector.manifest import is_manifest_key

        self.flush()
        keys = [k for batch in self._store.iter_keys() for k in batch if not is_manifest_key(k)]
        values = self._store.get(keys) if keys else []
        return {k: v for k, v in zip(keys, values) if v is not None}

    def check_store(self) -> None:
        """Every sound block in the store holds exactly the KV of its tokens;
        a block that fails its checks is one the test damaged on purpose."""
        from ucm_connector import blockfmt

        expected = self.expected_blocks()
        digest = self.namespace.digest
        wrong = []
        for key, value in self.stored_blocks().items():
            try:
                blockfmt.verify(value, digest, key=key)
            except blockfmt.BlockFormatError as exc:
                assert key in self.damaged, f"block {key.hex()[:16]} fails its checks ({exc}) " \
                                            "but the test did not damage it"
                continue
            if key not in expected:
                wrong.append(f"{key.hex()[:16]}: no sequence of this test has this key")
            elif value[blockfmt.HEADER_NBYTES:] != expected[key]:
                wrong.append(f"{key.hex()[:16]}: wrong KV with a valid checksum")
        assert not wrong, f"step {len(self.steps)}: the store holds wrong blocks:\n  " + "\n  ".join(wrong)

    def damage(self, key: bytes) -> None:
        """Flip a payload byte of a stored block (its checksum then fails)."""
        from ucm_connector import blockfmt

        self.flush()
        (value,) = self._store.get([key])
        assert value is not None, "no such block to damage"
        broken = bytearray(value)
        broken[blockfmt.HEADER_NBYTES + 3] ^= 0x5A
        self._store.delete([key])
        assert self._store.put([key], [bytes(broken)]) == [True]
        self.damaged.add(key)
        self.flush()

    def drop(self, key: bytes) -> None:
        """Delete a stored block, as an eviction between lookup and load would."""
        self.flush()
        self._store.delete([key])

    def counters(self) -> dict[str, float]:
        return self.ucm_worker.stats.totals() if hasattr(self.ucm_worker.stats, "totals") else {}

    def close(self) -> None:
        for connector in (self.worker, self.scheduler.connector):
            try:
                connector.shutdown()
            except Exception:
                pass


def _ucm(connector):
    """The UCMConnector itself, also when it is a MultiConnector's child."""
    from ucm_connector.connector import UCMConnector

    if isinstance(connector, UCMConnector):
        return connector
    for child in getattr(connector, "_connectors", ()):
        if isinstance(child, UCMConnector):
            return child
    raise AssertionError(f"no UCMConnector in {type(connector).__name__}")


def _ucm_meta(meta):
    from ucm_connector.connector import UCMConnectorMetadata

    if isinstance(meta, UCMConnectorMetadata):
        return meta
    for child in getattr(meta, "metadata", ()):
        if isinstance(child, UCMConnectorMetadata):
            return child
    return None
