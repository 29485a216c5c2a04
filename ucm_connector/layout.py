"""The geometry of this engine's KV cache, as the namespace needs it.

Both connector roles build the same ``Namespace`` from vLLM's config; the
scheduler hashes prompts with it and the workers stamp and check blocks with
it, so the two must agree without talking to each other.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable

from .blockfmt import FORMAT_VERSION
from .cache_views import PAGE_ORDER
from .hashing import HUGGINGFACE, Namespace, model_hub, model_identity


@functools.lru_cache(maxsize=8)
def _fingerprint(model: str, revision: str | None = None, weights: str | None = None,
                 hub: str = HUGGINGFACE) -> str:
    fingerprint = model_identity(model, revision, weights, hub)
    if fingerprint.startswith("config:") and not weights:
        _warn_once(f"ucm-connector: the model directory {model} holds no weight files; its blocks are keyed "
                   "by its config alone (as for --load-format dummy, whose weights depend on the config only)")
    return fingerprint


def _identity(model_config) -> str:
    return _fingerprint(str(model_config.model), getattr(model_config, "revision", None),
                        getattr(model_config, "model_weights", None) or None, model_hub())


#: RoPE types whose rotation depends on the engine's ``max_model_len``:
#: LongRoPE takes its long or short factors for every position by it, and
#: dynamic NTK its base from the largest position a model gives it (some cap
#: that at ``max_model_len``).
_LENGTH_DEPENDENT_ROPE = frozenset({"longrope", "su", "dynamic"})


def _rope_types(hf_config) -> set[str]:
    """Every RoPE type the model's text config names (``rope_parameters``
    may hold one per kind of layer)."""
    found: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            kind = value.get("rope_type") or value.get("type")
            if isinstance(kind, str):
                found.add(kind)
            for inner in value.values():
                walk(inner)

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for name in ("rope_parameters", "rope_scaling"):
        walk(getattr(text, name, None))
    return found


def _canonical_json(value) -> str:
    """``value`` as JSON that every process writes alike (sorted keys, no
    spaces; what JSON cannot hold, by its ``str``)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _digest(value) -> str:
    """32 hex digits of SHA-256 over ``_canonical_json(value)``."""
    import hashlib

    return hashlib.sha256(_canonical_json(value).encode()).hexdigest()[:32]


def config_digest(hf_config) -> str:
    """A digest of the model config vLLM runs with (after its overrides),
    without the fields that only say where it came from."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()
                    if k not in ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version")}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        if isinstance(value, (set, frozenset)):     # in an order every process agrees on
            return sorted(map(str, value))
        return value

    return _digest(clean(hf_config.to_dict()))


def _llama4_temperature_tuning(model_config) -> bool | None:
    """Llama 4 scales its queries by position when this is on, by default
    when ``max_model_len`` is over 32k (vLLM's ``Llama4ForCausalLM``)."""
    if not any("Llama4" in str(a) for a in getattr(model_config, "architectures", None) or ()):
        return None
    settings = dict(model_config.try_get_generation_config() or {})
    settings.update(getattr(model_config, "override_generation_config", None) or {})
    return bool(settings.get("attn_temperature_tuning", model_config.max_model_len > 32768))


def engine_settings(model_config) -> tuple[tuple[str, str], ...]:
    """What changes the KV of a model beyond its files (its weights and
    ``config.json`` are in the fingerprint), as namespace extras; none at
    the defaults, so that such engines keep their namespace: a quantization
    vLLM applies at load time (``--quantization``, which for a
    pre-quantized checkpoint also names the kernels vLLM chose),
    ``--hf-overrides`` (RoPE, layers and the like), a config read from
    elsewhere than ``config.json`` (``--hf-config-path``, ``--config-format``),
    ``max_model_len`` where the RoPE depends on it, Llama 4's attention
    temperature tuning, the engine's ``--mm-processor-kwargs`` and
    ``--media-io-kwargs``, and the Python files of a model directory that
    ``--trust-remote-code`` runs."""
    out = []
    hf_config = getattr(model_config, "hf_config", None)
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        out.append(("quantization", str(quantization)))
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        # What the function did, not its name: two lambdas share a name.
        out.append(("hf_overrides", "callable:" + (config_digest(hf_config) if hf_config is not None else
                                                   f"{overrides.__module__}.{overrides.__qualname__}")))
    elif overrides:
        out.append(("hf_overrides", _canonical_json(overrides)))
    if hf_config is not None:
        config_format = str(getattr(model_config, "config_format", "auto") or "auto").split(".")[-1].lower()
        if getattr(model_config, "hf_config_path", None) or config_format not in ("auto", "hf"):
            out.append(("hf_config", config_digest(hf_config)))
        if _rope_types(hf_config) & _LENGTH_DEPENDENT_ROPE:
            out.append(("max_model_len", str(model_config.max_model_len)))
        tuning = _llama4_temperature_tuning(model_config)
        if tuning is not None:
            out.append(("attn_temperature_tuning", str(tuning)))
    # The engine's own multimodal processing options: vLLM's names for a
    # request's images take in the request's options, not these.
    mm_config = getattr(model_config, "multimodal_config", None)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        value = getattr(mm_config, name, None)
        if value:
            out.append((name, _canonical_json(value)))
    if getattr(model_config, "trust_remote_code", False):
        code = _remote_code(str(getattr(model_config, "model", "")))
        if code:
            out.append(("remote_code", code))
    return tuple(out)


def _remote_code(model: str) -> str | None:
    """A digest of the Python files in a model directory (the code that
    ``--trust-remote-code`` runs: its config classes, and with
    ``--model-impl transformers`` its model); None without any.  A hub
    name's files are covered by its snapshot's commit."""
    import hashlib
    import os

    if not os.path.isdir(model):
        return None
    names = sorted(n for n in os.listdir(model) if n.endswith(".py") and os.path.isfile(os.path.join(model, n)))
    if not names:
        return None
    hasher = hashlib.sha256()
    for name in names:
        with open(os.path.join(model, name), "rb") as f:
            data = f.read()
        hasher.update(f"{name}\0{len(data)}\0".encode() + data)
    return hasher.hexdigest()[:32]


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    import logging

    if message not in _warned:
        _warned.add(message)
        logging.getLogger("vllm.ucm_connector.layout").warning(message)


def page_order(layout_name: str | None) -> str:
    """What a stored block's bytes depend on in a resolved ``KVCacheLayout``.

    ``transfer.py`` copies a page's bytes in address order, and every layout
    that keeps tokens outside heads within a page (``LBNHC``, ``BLNHC``)
    gives the same bytes for the same KV, as does every layout that keeps
    heads outside tokens (``LBHNC LHBNC BLHNC BHLNC``): where layers and
    blocks nest changes the strides, not the payload.  So engines with, say,
    ``LBNHC`` and ``BLNHC`` share blocks, and ``LBNHC`` and ``LBHNC`` never
    do.  A layout this build does not know is kept apart by its name."""
    if not layout_name:
        return "default"
    name = layout_name.upper()
    name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(name, name)   # vLLM's own aliases
    order = PAGE_ORDER.get(name)
    return f"page={order}" if order else f"layout={name}"


def _resolved_layout(vllm_config) -> str | None:
    """The ``KVCacheLayout`` name vLLM resolved for this engine: recorded on
    the cache config before either connector role is built (the engine core
    resolves it, workers adopt it), or the one forced by the environment."""
    import os

    return (getattr(vllm_config.cache_config, "kv_cache_layout", None)
            or os.environ.get("VLLM_KV_CACHE_LAYOUT"))


def kv_layout(vllm_config) -> str:
    """Backend and packing of a KV page: pages are only meaningful to the
    same layout (the CPU backend packs K and V per ISA)."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    if current_platform.is_cpu():
        from patches import PatchError
        from patches.probes import cpu_attention_isa

        try:
            isa = cpu_attention_isa(model_config.dtype, cache_config.block_size, model_config.get_head_size(),
                                    cache_config.cache_dtype)
        except PatchError as exc:
            # Without the packing, only engines of this very vLLM may share.
            from patches import vllm_version

            isa = f"unknown-vllm-{vllm_version()}"
            _warn_once(f"ucm-connector: the CPU KV packing is unknown ({exc}); blocks are shared only "
                       "with engines of this vLLM version")
        return f"cpu/CPU_ATTN/{isa}/{cache_config.cache_dtype}"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None) or "auto"
    order = page_order(_resolved_layout(vllm_config))
    if order == "default":
        # vLLM builds from before KVCacheLayout: their NHD/HND page order.
        try:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            order = get_kv_cache_layout() or "default"
        except Exception:
            pass
    return f"{current_platform.device_name}/{backend}/{order}/{cache_config.cache_dtype}"


#: Speculative methods whose drafter keeps no KV cache of its own.
_DRAFTERS_WITHOUT_KV = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")


def drafter(vllm_config) -> str:
    """The drafter whose layers' KV the workers store beside the model's
    (EAGLE, MTP, a draft model: vLLM registers their caches with the
    model's), as a suffix of the KV layout; "" for none, or for one that
    keeps no KV (n-gram, suffix, Medusa), which shares blocks with an
    engine that drafts nothing."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if spec is None or method is None or method in _DRAFTERS_WITHOUT_KV:
        return ""
    draft_config = getattr(spec, "draft_model_config", None)
    return f"/draft={method}:{_identity(draft_config) if getattr(draft_config, 'model', None) else '-'}"


#: Load formats that read the weights in the model's own files (the fingerprint).
_FILE_LOAD_FORMATS = frozenset({"auto", "pt", "safetensors", "npcache", "fastsafetensors", "mistral",
                                "gguf", "bitsandbytes", "runai_streamer", "instanttensor"})


def load_settings(vllm_config) -> tuple[tuple[str, str], ...]:
    """A load format that does not take the weights from the model's files
    (``dummy``: random weights; a tensorizer or sharded-state file) keeps
    its engine apart from those that do, with its loader's settings
    (``--model-loader-extra-config``: where the weights are); so do the layers
    ``--kv-cache-dtype-skip-layers`` leaves unquantized."""
    load_config = getattr(vllm_config, "load_config", None)
    load_format = getattr(load_config, "load_format", None) or "auto"
    name = str(getattr(load_format, "value", load_format)).lower()
    out = () if name in _FILE_LOAD_FORMATS else (("load_format", name),)
    loader = getattr(load_config, "model_loader_extra_config", None)
    if out and loader:
        # Where such a loader takes the weights from (a tensorizer URI, a
        # sharded state's pattern), by a digest: it may hold credentials.
        settings = loader.to_serializable() if hasattr(loader, "to_serializable") else loader
        out += (("model_loader_extra_config", _digest(settings)),)
    # Layers whose KV stays unquantized under --kv-cache-dtype: which ones
    # decides what each layer's part of a block holds (their order in it is
    # ``block_layer_order``'s).
    skipped = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_dtype_skip_layers", None)
    if skipped:
        out += (("kv_cache_dtype_skip_layers", ",".join(sorted(map(str, skipped)))),)
    return out


def _spec_buckets(kv_cache_config) -> list[list[str]]:
    """The layers of vLLM's ``KVCacheConfig`` by the cache tensor they live
    in: vLLM 0.32 and 0.33 give each group one tensor per kind of layer
    (per spec), and the scheduler's copy of the config keeps them (it
    keeps only one spec of a group)."""
    return [list(tensor.layers) for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ()
            if getattr(tensor, "layers", None)]


def mixed_layers(kv_cache_config) -> bool:
    """Whether the engine's layers keep KV of more than one kind (several
    cache groups, or one group whose layers live in several cache tensors:
    other head counts or dtypes, MLA beside an indexer).  vLLM then
    registers the caches tensor by tensor, in an order of its own making
    that another vLLM version may change, so blocks lay their layers out
    in ``block_layer_order`` instead.  Both connector roles decide it alike
    from what their copies of the config share."""
    if kv_cache_config is None:
        return False
    return len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) > 1 or len(_spec_buckets(kv_cache_config)) > 1


def _model_order(name: str) -> tuple[int, str]:
    """A layer's place in the model by its name alone: its layer number
    ("model.layers.12.self_attn.attn": 12), then its name."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return (int(match.group(1)) if match else -1, name)


def block_layer_order(names: Iterable[str], kv_cache_config) -> list[str]:
    """The order of the layers in a stored block: vLLM's registration order
    where all layers are alike (the model's own order, which existing
    blocks have), by layer number and name where they are mixed."""
    names = list(names)
    return sorted(names, key=_model_order) if mixed_layers(kv_cache_config) else names


def layer_settings(kv_cache_config) -> tuple[tuple[str, str], ...]:
    """Mixed layers, as a namespace extra (none where the layers are
    alike): which layers share a kind, in ``block_layer_order``, and that
    blocks hold them in that order (blocks of builds that held them in
    vLLM's order are never read as such)."""
    if not mixed_layers(kv_cache_config):
        return ()
    bucket_of = {name: i for i, bucket in enumerate(_spec_buckets(kv_cache_config)) for name in bucket}
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            bucket_of.setdefault(name, -1 - len(bucket_of))
    kinds: dict[int, int] = {}
    described = [[name, kinds.setdefault(bucket_of[name], len(kinds))] for name in sorted(bucket_of, key=_model_order)]
    return (("layers", _digest(["by-layer-number", described])),)


def namespace_for(vllm_config, tp_rank: int = 0, sparse: dict | None = None,
                  kv_cache_config=None) -> Namespace:
    """The engine's namespace.  With a ``sparse`` method (its validated
    option) the engine's KV lives apart from dense engines' and other
    methods': a token decoded with thinned attention gets other KV in every
    layer after the first, and so does every token computed after it over
    vLLM's own prefix cache.  ``kv_cache_config`` (vLLM's, as both connector
    roles get it) adds its layers where they are mixed (``layer_settings``)."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    extra = engine_settings(model_config) + load_settings(vllm_config) + layer_settings(kv_cache_config)
    if sparse:
        extra += (("sparse", _canonical_json(dict(sparse))),)
    return Namespace(
        model_fingerprint=_identity(model_config),
        dtype=str(model_config.dtype),
        kv_layout=kv_layout(vllm_config) + drafter(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        num_layers=model_config.get_num_layers(parallel_config),
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_size=model_config.get_head_size(),
        tp_rank=tp_rank,
        tp_size=parallel_config.tensor_parallel_size,
        format_version=FORMAT_VERSION,
        extra=extra,
    )


def lora_engine_settings(vllm_config) -> str:
    """The engine's LoRA settings that change what an adapter computes, as
    one canonical string ("" without LoRA); ``AdapterIdentities`` puts it in
    every adapter's identity, next to the fingerprint of the adapter's files.

    In: the dtype the adapter's weights are cast to, the deployment-time
    restriction of the modules LoRA applies to, fully sharded LoRA layers
    (another reduction order across TP ranks) and the MoE weight layouts,
    which decide how an adapter's tensors are read. Out: how many adapters
    fit (``max_loras``, ``max_cpu_loras``), ``max_lora_rank`` (smaller ranks
    are zero-padded, which adds exact zeros) and classification-head sizes,
    which act after the KV.
    """
    from .adapters import lora_settings

    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        return ""
    dtype = lora_config.lora_dtype
    if dtype in (None, "auto"):
        dtype = vllm_config.model_config.dtype
    return lora_settings(
        dtype=str(dtype),
        target_modules=getattr(lora_config, "target_modules", None),
        fully_sharded=getattr(lora_config, "fully_sharded_loras", False),
        moe_mixed_format=getattr(lora_config, "enable_mixed_moe_lora_format", False),
        moe_shared=getattr(lora_config, "enable_moe_shared_loras", False),
        tower=getattr(lora_config, "enable_tower_connector_lora", False),
    )
