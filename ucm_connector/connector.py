"""UCMConnector: vLLM's KV-connector interface, routed to the two roles.

Thin on purpose: it builds the config, the store and the namespace, then
hands every hook to ``UCMScheduler`` (scheduler role) or ``UCMWorker``
(worker role).  ``kv_role`` decides what runs: ``kv_producer`` only saves,
``kv_consumer`` only loads, ``kv_both`` does both.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from store_backends import StoreError, open_store, pause_unavailable
from store_backends.urls import mask_password

from .adapters import AdapterIdentities
from .config import LoadMode, UCMConfig, UCMConfigError
from .events import EventTracker, OutcomeLog, UCMKVEvents, events_enabled
from .hashing import BlockHasher
from .layout import block_layer_order, lora_engine_settings, namespace_for
from .loadpolicy import LoadPolicy, ReadSample, StepSample
from .manifest import write_manifest
from .measure import LoadObserver, tiers_of
from .metrics import StatsCollector, UCMStats, build_prom_metrics
from .plans import BlockProbe
from .scheduler import BlockPlan, UCMScheduler

# Under "vllm." so that vLLM's log handlers and format apply.
logger = logging.getLogger("vllm.ucm_connector.connector")


@dataclasses.dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker (picklable)."""

    loads: list[BlockPlan] = dataclasses.field(default_factory=list)
    saves: list[BlockPlan] = dataclasses.field(default_factory=list)
    # load_policy auto: the tokens the step computes (its forward pass is
    # timed against them) and blocks to read in the background for timing.
    num_tokens: int = 0
    probes: list[BlockProbe] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class UCMWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers measured in a step (``load_policy: auto``), carried
    to the scheduler with the step's output; vLLM joins the TP ranks'."""

    reads: list[ReadSample] = dataclasses.field(default_factory=list)
    steps: list[StepSample] = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "UCMWorkerMeta":
        if isinstance(other, UCMWorkerMeta):
            return UCMWorkerMeta(self.reads + other.reads, self.steps + other.steps)
        return self


KEEP_POLICY_ENV = "UCM_KEEP_KV_LOAD_FAILURE_POLICY"
_logged: set[str] = set()     # messages logged once per process


def _log_once(key: str, log, message: str, *args) -> None:
    """``log(message, *args)`` the first time ``key`` comes up in this process."""
    if key not in _logged:
        _logged.add(key)
        log(message, *args)


def _policy_given() -> bool:
    """Whether the user set ``kv_load_failure_policy`` themselves.  vLLM's
    config object holds the value, not whether it was given, so: on the
    command line (the JSON of ``--kv-transfer-config`` or its dotted form;
    vLLM's engine processes inherit the command line), or
    UCM_KEEP_KV_LOAD_FAILURE_POLICY=1 (for the Python API)."""
    if os.environ.get(KEEP_POLICY_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return any("kv_load_failure_policy" in arg for arg in sys.argv[1:])


def settle_load_failure_policy(transfer_config) -> None:
    """A block that fails its checks, or is gone by the time it is read,
    must cost a recompute, never a failed request.  vLLM's default policy
    ('fail') is switched to 'recompute'; a policy the user chose is kept,
    with a warning of what 'fail' means here."""
    policy = getattr(transfer_config, "kv_load_failure_policy", None)
    if policy != "fail":
        return
    if _policy_given():
        _log_once("kept", logger.warning,
                  "ucm-connector: kv_load_failure_policy is 'fail' as configured: a stored block that fails "
                  "its checks or is evicted between lookup and load fails its request (FINISHED_ERROR); "
                  "'recompute' is recommended: vLLM then recomputes the block and the request succeeds")
        return
    transfer_config.kv_load_failure_policy = "recompute"
    _log_once("switched", logger.info,
              "ucm-connector: kv_load_failure_policy set to 'recompute' (vLLM's default is 'fail'): a stored "
              "block that cannot be loaded is recomputed instead of failing its request; to keep 'fail', give "
              "it in --kv-transfer-config or set %s=1", KEEP_POLICY_ENV)


def _tp_union(block_ids: set[int]) -> set[int]:
    """The union of the TP ranks' sets (a collective on vLLM's TP group)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    gathered: list = [None] * group.world_size
    dist.all_gather_object(gathered, sorted(block_ids), group=group.cpu_group)
    return {b for part in gathered for b in part}


def _open_store(config: UCMConfig, stats: StatsCollector | None = None):
    """The configured store; a medium (a tier) that stops answering is not
    asked again for a while, so the engine waits a store's timeout once,
    not on every call (``store_backends.pausing``; counted in ``stats``)."""
    urls = config.store_urls
    store = open_store(urls[0]) if len(urls) == 1 else open_store(urls, write_mode=config.tier_write_mode)
    return pause_unavailable(store, None if stats is None else (lambda: stats.add(store_pauses=1)))


def _prefix_reusable(model_config) -> bool:
    """Whether a prompt's KV may be reused by prefix for this model, as
    vLLM decides for its own prefix cache: not for pooling models with
    MEAN or CLS pooling (the pooler needs every token's hidden state; a
    partial prefill kills the engine) nor bidirectional ones.  The
    connector then neither loads nor saves, and says so once."""
    if getattr(model_config, "is_prefix_caching_supported", True) is not False:
        return True
    _log_once("prefix", logger.warning,
              "ucm-connector: vLLM does not reuse this model's KV by prefix (pooler %s); the connector neither "
              "loads nor saves",
              getattr(getattr(model_config, "pooler_config", None), "seq_pooling_type", None) or "none")
    return False


def mm_named_by_content(vllm_config) -> bool:
    """Whether vLLM names each multimodal input by a hash of its content.
    With both of its caches off (``--mm-processor-cache-gb 0`` and no prefix
    caching) it names inputs without a client-given UUID by a per-process
    counter ("renderer0-mm-7-image-0"), which another engine, or this one
    restarted, gives to another image: such requests must not share KV."""
    mm_config = getattr(vllm_config.model_config, "multimodal_config", None)
    if mm_config is None or getattr(mm_config, "mm_processor_cache_gb", None) != 0 \
            or vllm_config.cache_config.enable_prefix_caching:
        return True
    _log_once("mm-counter", logger.warning,
              "ucm-connector: with --mm-processor-cache-gb 0 and prefix caching off, vLLM names images "
              "and other multimodal inputs by a counter, not by their content; requests with such inputs "
              "run without the external cache (text-only requests are not affected). Give "
              "--mm-processor-cache-gb above 0, or enable prefix caching, to share them")
    return False


def _refuse_unsupported_parallelism(parallel_config) -> None:
    """Pipeline stages hold other layers under the same keys, and context
    parallelism splits a block's tokens across ranks: block keys and
    payloads here are per tensor-parallel rank only, so both would load
    another stage's or rank's KV."""
    sizes = {name: getattr(parallel_config, name, 1) or 1 for name in (
        "pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size")}
    used = [f"{name} {size}" for name, size in sizes.items() if size > 1]
    if used:
        raise RuntimeError(
            f"ucm-connector cannot start: {', '.join(used)} is not supported (blocks are keyed per "
            "tensor-parallel rank only); run with tensor parallelism alone, or without the connector")


def async_scheduling(vllm_config) -> bool:
    """Whether vLLM schedules a step before the previous one's output is in
    (``--async-scheduling``, its default on GPUs; off on CPUs)."""
    return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))


def engine_load_mode(config: UCMConfig, vllm_config) -> LoadMode:
    """How this engine loads hits, in both roles: the configured way, except

    * under async scheduling, asynchronously: the next step is scheduled,
      and run, before a load's failure reaches vLLM's scheduler, which then
      rewinds the request but still delivers the token that step computed
      on the failed block (and lets another request read that block).  A
      request whose load runs on the loader thread is not scheduled until
      its blocks are checked;
    * with full CUDA graphs, before the step: their replays skip
      ``wait_for_layer_load``, so attention would read pages a
      layer-by-layer load has not written yet (a vLLM that does not ask
      ``requires_piecewise_for_cudagraph``, or a mode set after it asked)."""
    from .plugin import full_cuda_graphs

    mode = config.load_mode
    if mode is not LoadMode.ASYNC and async_scheduling(vllm_config):
        why = ""
        if mode is LoadMode.LAYER:
            # Sparse attention wants piecewise CUDA graphs in any case.
            why = ", not layer by layer" + ("" if config.sparse else " (vLLM captures piecewise CUDA graphs for "
                                             "load_layerwise all the same: drop it to keep full ones)")
        _log_once(f"async-scheduling-{mode.name}", logger.warning if mode is LoadMode.LAYER else logger.info,
                  "ucm-connector: vLLM schedules asynchronously, so a step can run before a failed load is known; "
                  "loading hits on the loader thread (load_kv_async), where a request waits until its blocks are "
                  "checked%s", why)
        return LoadMode.ASYNC
    if mode is LoadMode.LAYER and full_cuda_graphs(vllm_config):
        logger.warning(
            "ucm-connector: load_layerwise needs attention to run outside CUDA graphs, and this engine replays "
            "full ones (cudagraph_mode %s); loading each step's blocks before its forward pass instead. To load "
            "layer by layer, start vLLM with --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}'",
            getattr(getattr(vllm_config.compilation_config, "cudagraph_mode", None), "name", "?"))
        return LoadMode.SYNC
    return mode


def layerwise_saves(config: UCMConfig, vllm_config) -> bool | None:
    """``save_layerwise`` as configured (None for ``auto``: the worker
    decides by the device of the KV cache), except with microbatches
    (``--enable-dbo``, ``ubatch_size`` above 1): each microbatch reports a
    layer as soon as its own attention is done, so the first report would
    copy pages the other microbatch has not written yet.  Such an engine
    gathers after the forward pass, with a warning where it was asked to
    save layer by layer."""
    if config.save_layerwise is False:
        return False
    if getattr(getattr(vllm_config, "parallel_config", None), "use_ubatching", False):
        if config.save_layerwise is True:
            _log_once("dbo", logger.warning,
                      "ucm-connector: save_layerwise does not work with microbatches (--enable-dbo or "
                      "ubatch_size above 1): each microbatch finishes a layer on its own; gathering saved "
                      "blocks after the forward pass instead")
        return False
    return None if config.save_layerwise == "auto" else True


def _same_caches(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same KV cache tensors, layer for layer (memory, shape and strides)."""
    def where(t) -> tuple:
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
    return a.keys() == b.keys() and all(a[k] is b[k] or where(a[k]) == where(b[k]) for k in a)


class UCMConnector(KVConnectorBase_V1):
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Asked by vLLM (0.32 and 0.33) before it settles its CUDA graph
        mode: layer-by-layer loads and sparse attention run Python in every
        attention call, which a full CUDA graph replays without; vLLM then
        captures pieces around attention instead.  Only the extra config is
        given, so ``load_layerwise`` asks for pieces also where async
        scheduling makes its loads asynchronous (``engine_load_mode``).  A
        config that does not parse answers False: the connector's
        constructor reports it."""
        try:
            config = UCMConfig.from_extra_config(extra_config)
        except UCMConfigError:
            return False
        return config.load_mode is LoadMode.LAYER or bool(config.sparse)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a step's saves are copied out in
        ``wait_for_save``, so nothing is owed to a request vLLM preempts
        (vLLM then keeps the tokens it sampled meanwhile)."""
        return False

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _refuse_unsupported_parallelism(vllm_config.parallel_config)
        transfer_config = vllm_config.kv_transfer_config
        self.config = UCMConfig.from_extra_config(transfer_config.kv_connector_extra_config)
        kv_role = transfer_config.kv_role
        reusable = _prefix_reusable(vllm_config.model_config)
        self._load_enabled = reusable and kv_role in ("kv_consumer", "kv_both")
        self._save_enabled = reusable and kv_role in ("kv_producer", "kv_both")
        self.stats = StatsCollector()
        self._scheduler: UCMScheduler | None = None
        self._worker = None
        self._registered_caches: dict[str, Any] | None = None
        with_events = events_enabled(vllm_config)
        auto = self.config.load_policy == "auto" and self._load_enabled
        try:
            self.store = _open_store(self.config, self.stats)
        except StoreError as exc:
            raise RuntimeError(f"ucm-connector cannot start: {exc}") from None
        if role == KVConnectorRole.SCHEDULER:
            # Under MultiConnector this is the child's own copy; the patch of
            # MultiConnector.__init__ settles the policy vLLM reads.
            settle_load_failure_policy(transfer_config)
            namespace = namespace_for(vllm_config, tp_rank=0, sparse=self.config.sparse,
                                      kv_cache_config=kv_cache_config)
            logger.info("ucm-connector: store %s, namespace %s, role %s", self.store.url,
                        namespace.describe(), kv_role)
            self._scheduler = UCMScheduler(
                store=self.store, hasher=BlockHasher(namespace), block_size=namespace.block_size,
                tp_size=namespace.tp_size, load=self._load_enabled, save=self._save_enabled,
                min_hit_blocks=self.config.min_hit_blocks, stats=self.stats,
                load_async=engine_load_mode(self.config, vllm_config) is LoadMode.ASYNC,
                # A load-only engine reports the blocks it drops from the store.
                events=EventTracker(enabled=with_events and (self._save_enabled or self._load_enabled),
                                    tp_size=namespace.tp_size, block_size=namespace.block_size),
                adapters=AdapterIdentities(lora_engine_settings(vllm_config)),
                policy=LoadPolicy(tier_names=[t.url for t in tiers_of(self.store)],
                                  block_size=namespace.block_size) if auto else None,
                mm_by_content=mm_named_by_content(vllm_config))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from .worker import UCMWorker

            tp_size = vllm_config.parallel_config.tensor_parallel_size
            try:
                tp_rank = get_tensor_model_parallel_rank()
            except Exception as exc:
                # Outside vLLM's distributed set-up only TP size 1 is sound:
                # with more ranks, rank 0's shards would load under a passing
                # namespace check.
                if tp_size > 1:
                    raise RuntimeError(
                        f"ucm-connector cannot start: this worker's tensor-parallel rank is unknown ({exc}); "
                        f"with tensor_parallel_size {tp_size} every worker must run inside vLLM's "
                        "distributed set-up") from None
                tp_rank = 0
            namespace = namespace_for(vllm_config, tp_rank=tp_rank, sparse=self.config.sparse,
                                      kv_cache_config=kv_cache_config)
            if self._save_enabled:
                # What `ucm store stats` shows for this namespace (never raises).
                # An object store's URL rather than the directory vLLM pulled its config into.
                model_config = vllm_config.model_config
                write_manifest(self.store, namespace,
                               model_name=mask_password(getattr(model_config, "model_weights", None)
                                                        or model_config.model))
            num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
            self._worker = UCMWorker(
                store=self.store, namespace_digest=namespace.digest, tp_rank=tp_rank,
                num_blocks=num_blocks, max_pending_nbytes=self.config.max_pending_save_mib << 20,
                stats=self.stats,
                blocks_per_request=vllm_config.model_config.max_model_len // namespace.block_size,
                load_mode=engine_load_mode(self.config, vllm_config), events=OutcomeLog(enabled=with_events),
                share_failures=_tp_union if namespace.tp_size > 1 else None,
                observer=LoadObserver() if auto else None,
                save_layerwise=layerwise_saves(self.config, vllm_config) if self._save_enabled else False,
                copies=(self._load_enabled, self._save_enabled))
            from .plugin import apply_sparse

            # Patches vLLM's attention path only when a sparse method is configured.
            apply_sparse(self.config.sparse, vllm_config)

    # -- worker side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._registered_caches is not None:
            if _same_caches(self._registered_caches, kv_caches):
                return
            # vLLM keeps one worker-side connector per process: a second
            # engine in this process reuses the first one's, and would load
            # into and save from the first engine's KV cache.
            raise RuntimeError(
                "ucm-connector cannot start: this process already runs a vLLM engine with a KV connector, and "
                "vLLM keeps one worker-side connector per process, so this engine would load and save through "
                "the first engine's KV cache. Run each engine in a process of its own (leave "
                "VLLM_ENABLE_V1_MULTIPROCESSING at 1, vLLM's default), or shut the first engine down first")
        # A block holds its layers in an order every vLLM version agrees on.
        order = block_layer_order(kv_caches, self._kv_cache_config)
        self._worker.register_kv_caches({name: kv_caches[name] for name in order})
        self._registered_caches = dict(kv_caches)
        if self.config.sparse:
            from .plugin import warm_up_sparse, warn_of_dense_layers

            vllm_config = getattr(self, "_vllm_config", None)
            warn_of_dense_layers(vllm_config)
            warm_up_sparse(vllm_config, kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep mode, before it unmaps the KV cache: no copy
        of ours may touch the pages until ``restore_kv_caches``."""
        if self._worker is not None:
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's wake-up: the KV cache is mapped again, at the same
        addresses (vLLM does not register it again)."""
        if self._worker is not None:
            self._worker.resume()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, UCMConnectorMetadata):
            self._worker.begin_step(connector_metadata.num_tokens, connector_metadata.loads,
                                    connector_metadata.probes, saves=connector_metadata.saves)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if not self._load_enabled:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, UCMConnectorMetadata):
            self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()
        if not self._save_enabled:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, UCMConnectorMetadata):
            self._worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Saves never hold a request's blocks (they are copied out in
        # wait_for_save); only asynchronous loads finish later.
        return None, self._worker.get_finished() if self._worker is not None else None

    def build_connector_worker_meta(self) -> UCMWorkerMeta | None:
        measured = self._worker.take_measurements() if self._worker is not None else None
        return UCMWorkerMeta(*measured) if measured else None

    def get_kv_connector_kv_cache_events(self) -> UCMKVEvents | None:
        outcomes = self._worker.events.take() if self._worker is not None else None
        return UCMKVEvents(outcomes) if outcomes else None

    # -- scheduler side ------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        loads, saves = self._scheduler.build_plans(scheduler_output)
        return UCMConnectorMetadata(loads=loads, saves=saves,
                                    num_tokens=scheduler_output.total_num_scheduled_tokens,
                                    probes=self._scheduler.take_probes())

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._scheduler.on_load_errors(invalid)
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, UCMKVEvents):
            self._scheduler.events.report(events)
        measured = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(measured, UCMWorkerMeta):
            self._scheduler.observe(measured.reads, measured.steps)

    def take_events(self):
        return self._scheduler.events.take() if self._scheduler is not None else ()

    def reset_cache(self) -> bool:
        """vLLM resets the connector's cache with its own (``reset_prefix_cache(reset_connector=True)``;
        ``pause_generation`` and ``sleep`` at level 1 or more do it): the
        weights may have changed since the store's blocks were made."""
        if self._scheduler is None:
            return True
        if self.config.on_cache_reset == "keep":
            logger.info("ucm-connector: vLLM reset the connector's cache; keeping the store's blocks in use "
                        "(on_cache_reset: keep)")
            return True
        self._scheduler.new_generation()
        logger.info("ucm-connector: vLLM reset the connector's cache (as after a weight update): from now on "
                    "this engine loads and saves blocks under keys of their own, and loads nothing stored "
                    "before; other engines on the store are not affected")
        return True

    # -- both ----------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return UCMStats(data=dict(data)) if data is not None else UCMStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self):
        data = self.stats.take()
        return UCMStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self.store.close()
