"""The ``vllm.general_plugins`` entry point: makes ``"kv_connector":
"UCMConnector"`` work without ``kv_connector_module_path``.

vLLM loads general plugins in every process it starts (frontend, engine
core, each worker), so registering must be cheap and harmless to repeat.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("vllm.ucm_connector.plugin")

CONNECTOR_NAME = "UCMConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import patches

    patches.apply_connector_patches()
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "ucm_connector.connector", "UCMConnector")
    except ValueError:
        # Registered already (vLLM loads general plugins more than once per
        # process): vLLM's public call refuses a second registration.
        pass


def apply_sparse(sparse, vllm_config=None):
    """Turn on the configured sparse-attention method in this process:
    build it and patch vLLM's step and attention calls to reach it.

    ``sparse`` is the validated ``sparse`` option (``{"method": NAME, ...}``)
    or None (dense: nothing is patched).  Called where the worker's connector
    is built, the one place that knows both the config and that this
    process runs the model.  Calling it again with the same option keeps the
    method (and its state); a different option replaces the method.
    Returns the active method.
    """
    global _sparse_option
    if not sparse:
        return None
    import patches
    from ucm_connector.sparse import build_method

    option = dict(sparse)
    if patches.applied() and _sparse_option == option and patches.active_hooks() is not None:
        method = patches.active_hooks()
        if vllm_config is not None:
            _tell_of_speculation(method, vllm_config)
        return method
    if vllm_config is not None:
        _refuse_full_cuda_graphs(vllm_config)
    method = build_method(option)
    if vllm_config is not None:
        _tell_of_speculation(method, vllm_config)
    patches.apply(method)
    _sparse_option = option
    return method


_sparse_option: dict | None = None


def _tell_of_speculation(method, vllm_config) -> int:
    """With speculative decoding a request verifies its drafts in a decode
    row of up to 1 + ``num_speculative_tokens`` query tokens: the method is
    told (``block_topk`` then thins those rows too), and told 0 for an
    engine without.  Returns the drafts per step (0: no speculation)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    drafts = int(getattr(speculative, "num_speculative_tokens", 0) or 0) if speculative is not None else 0
    method.speculate(drafts)
    if drafts > 0:
        logger.info("ucm-connector: speculative decoding (%s, %d draft tokens): sparse method %r told that a "
                    "decode row carries up to %d query tokens", getattr(speculative, "method", "?"), drafts,
                    method.name, 1 + drafts)
    return drafts


def _attention_layers(vllm_config) -> dict:
    """vLLM's static forward context of a loaded model: layer name -> layer."""
    return getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}


def warn_of_dense_layers(vllm_config) -> dict[str, str]:
    """Once the model is loaded: warn where a configured sparse method does
    not reach some attention layers (their backend is not patched), which
    then stay dense.  Returns those layers (name -> backend class)."""
    import patches

    if not patches.applied():
        return {}
    context = _attention_layers(vllm_config)
    missing = patches.layers_not_reached(context)
    if missing:
        backends = ", ".join(sorted(set(missing.values())))
        logger.warning(
            "ucm-connector: sparse attention does not reach %d of %d attention layers, which stay dense: "
            "their backend (%s) is not one it patches (CPU attention; FlashAttention on CUDA). On a GPU, "
            "start vLLM with --attention-backend FLASH_ATTN to thin them", len(missing),
            sum(1 for layer in context.values() if getattr(layer, "impl", None) is not None), backends)
    return missing


def warm_up_sparse(vllm_config, kv_caches: dict) -> int:
    """Once the KV cache exists, at start-up: the active sparse method does
    what its layer calls would otherwise do in the middle of serving
    (``SparseMethod.warm_up``: on CUDA, compiling its Triton kernels), with
    one example call per kind of attention layer.  Returns the launches
    made.  A failure costs the warm-up, not the engine: the kernels then
    compile at their first call."""
    import patches

    hooks = patches.active_hooks()
    if hooks is None or vllm_config is None:
        return 0
    started, launches = time.perf_counter(), 0
    try:
        model = vllm_config.model_config
        for example in patches.example_batches(_attention_layers(vllm_config), kv_caches, model.dtype,
                                               model.max_model_len):
            launches += hooks.warm_up(example)
    except Exception as exc:  # never stop the engine for it
        logger.warning("ucm-connector: warming up the sparse attention kernels failed (%s: %s)"
                       "; they will compile at their first call instead", type(exc).__name__, exc)
        return launches
    if launches:
        logger.info("ucm-connector: sparse attention kernels warmed up (%d launches, %.1f s)", launches,
                    time.perf_counter() - started)
    return launches


def full_cuda_graphs(vllm_config) -> bool:
    """Whether this engine replays whole forward passes, attention included,
    from CUDA graphs (vLLM's FULL modes, on CUDA): on those steps no Python
    runs in an attention call, so neither a layer's load wait nor a sparse
    method is reached.  vLLM settles the mode before it builds connectors
    (0.32 and 0.33 ask ``UCMConnector.requires_piecewise_for_cudagraph``)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    return bool(callable(has_full) and has_full())


def _refuse_full_cuda_graphs(vllm_config) -> None:
    """A captured CUDA graph replays attention without running Python: the
    method would neither see keys nor choose blocks on those steps."""
    if full_cuda_graphs(vllm_config):
        raise RuntimeError(
            "ucm-connector sparse attention needs attention to run outside CUDA graphs: start vLLM "
            "with --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' (or --enforce-eager)")
