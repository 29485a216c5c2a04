"""Patches of the attention backends' ``forward``: the layer call hook.

The attention op (``unified_attention_with_output``) calls
``layer.impl.forward(...)`` at run time, in eager mode and where the op is a
torch.compile split point alike, so replacing ``forward`` on the backend's
impl class reaches every layer.  When the step's keys have been written to
the cache (vLLM does it in a separate op before ``forward`` on both
backends), the wrapper describes the call to the method as an
``AttentionBatch``; if the method answers with a ``BlockSelection``, the
kernel gets a shallow copy of the metadata with that block table and those
lengths (and what the backend derives from them) swapped in.  vLLM's own
metadata object is never changed, so nothing needs restoring.

Only plain causal decoder self-attention is handed to the method; anything
else (sliding window, ALiBi, encoder, shared KV, non-causal, DCP) runs as
vLLM would.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable

from ucm_connector.sparse.base import AttentionBatch, KeyPages

from . import _core
from ._core import Patch, fields_missing

logger = logging.getLogger("vllm.ucm_connector.patches")

_FORWARD_PARAMS = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")


@functools.lru_cache(maxsize=4096)
def _layer_index(layer_name: str) -> int | None:
    """The first integer in a vLLM layer name ("model.layers.7.self_attn.attn" -> 7)."""
    for part in layer_name.split("."):
        if part.isdigit():
            return int(part)
    return None


def _batch(impl: Any, layer: Any, query, key, kv_cache, md: Any, block_size: int, pages: Any,
           query_scale: float):
    num_tokens = md.num_actual_tokens
    name = getattr(layer, "layer_name", str(id(layer)))
    return AttentionBatch(
        layer_name=name,
        layer_index=_layer_index(name),
        query=query[:num_tokens],
        key=key[:num_tokens],
        slot_mapping=md.slot_mapping[:num_tokens],
        query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        block_table=md.block_table,
        block_size=block_size,
        num_cache_blocks=kv_cache.shape[0],
        num_kv_heads=impl.num_kv_heads,
        head_size=impl.head_size,
        scale=impl.scale * query_scale,
        pages=pages,
        # Host-side: the step hook's count, and the bounds vLLM's metadata
        # builder already worked out (no device read).
        step=_core.step_index,
        max_seq_len=md.max_seq_len,
        max_query_len=md.max_query_len,
    )


def _one_scale(layer: Any, name: str) -> float | None:
    """The layer's ``_q_scale`` / ``_k_scale`` as one number, or None where
    it has one per head (compressed-tensors' per-head fp8 scales: the
    float vLLM keeps beside them is only their largest)."""
    scale = getattr(layer, name, None)
    if scale is not None and getattr(scale, "numel", lambda: 1)() != 1:
        return None
    return float(getattr(layer, name + "_float", 1.0))


def _query_scale(layer: Any, query) -> float | None:
    """What the call's query values are to be multiplied by: a query vLLM
    quantized to fp8 for an fp8 cache holds ``q / q_scale``; None where the
    scale is per head (the call is then left to vLLM, dense)."""
    return _one_scale(layer, "_q_scale") if query.element_size() == 1 else 1.0


def _decoder_impl(impl: Any) -> bool:
    """Whether a layer's impl is plain decoder self-attention, as far as
    the impl alone tells."""
    from vllm.v1.attention.backend import AttentionType

    return (impl.attn_type == AttentionType.DECODER
            and getattr(impl, "kv_sharing_target_layer_name", None) is None
            and impl.alibi_slopes is None
            and impl.sliding_window in (-1, None, (-1, -1)))


def _plain_decoder(impl: Any, key: Any, md: Any) -> bool:
    return md is not None and key is not None and _decoder_impl(impl) and md.causal is True


def _hooked_forward(original: Callable, *, declines: Callable[[Any, Any], bool],
                   key_pages: Callable[[Any, Any, Any], KeyPages | None],
                   fix_up: Callable[[Any, Any, Any, Any, Any], None]) -> Callable:
    """A backend impl's ``forward`` that hands plain decoder calls to the
    method; what differs between backends comes in as functions:

    * ``declines(impl, md)``: metadata this backend's hook does not handle
      (vLLM's forward runs untouched);
    * ``key_pages(impl, layer, kv_cache)``: the ``KeyPages`` of the layer's
      cache, or None where its packing cannot be read;
    * ``fix_up(impl, layer, query, dense_md, md)``: bring what the backend
      derives from the lengths up to date in ``md``, the copy that carries
      the selection (``dense_md`` is vLLM's own, unchanged).
    """
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        hooks = _core.hooks
        md = attn_metadata
        if hooks is None or not _plain_decoder(self, key, md) or declines(self, md):
            return original(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs)
        query_scale = _query_scale(layer, query)
        if query_scale is None:
            return original(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs)
        batch = _batch(self, layer, query, key, kv_cache, md, kv_cache.shape[2], key_pages(self, layer, kv_cache),
                       query_scale)
        selection = hooks.before_attention(batch)
        if selection is not None:
            md = copy.copy(md)
            md.block_table = selection.block_table
            md.seq_lens = selection.seq_lens
            fix_up(self, layer, query, attn_metadata, md)
        try:
            return original(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs)
        finally:
            hooks.after_attention(batch, selection)

    forward.ucm_key_pages = key_pages          # for example_batch
    return forward


def patched_key_pages(impl: Any) -> Callable | None:
    """The ``key_pages`` of the hook on ``impl``'s ``forward``, or None
    where the hook does not reach that impl (not patched, or a subclass
    with a ``forward`` of its own)."""
    return getattr(getattr(type(impl), "forward", None), "ucm_key_pages", None) if impl is not None else None


def hooked_impl(impl: Any) -> Any | None:
    """The impl whose ``forward`` the hook runs in for a layer's decoder
    calls: the layer's own, or the causal one a composite impl (vLLM's for
    multimodal prefixes) hands them to; None where the hook does not reach."""
    for candidate in (impl, getattr(impl, "causal_impl", None)):
        if patched_key_pages(candidate) is not None:
            return candidate
    return None


def example_batch(name: str, layer: Any, kv_cache, dtype, max_model_len: int) -> AttentionBatch | None:
    """A call of ``layer`` with no request in it, as the hook would hand it
    to the method, for ``SparseMethod.warm_up`` at start-up: one padding
    token of ``dtype`` (the model's), the dtypes of vLLM's attention
    metadata (int32 offsets, lengths and block table, the table as wide as
    ``max_model_len`` needs; int64 slots), the layer's cache and its pages.
    None for a layer whose calls the hook never hands over."""
    import torch

    impl = hooked_impl(getattr(layer, "impl", None))
    if impl is None or not _decoder_impl(impl):
        return None
    key_pages = patched_key_pages(impl)
    device, block_size = kv_cache.device, kv_cache.shape[2]
    query_dtype = dtype
    if getattr(layer, "query_quant", None) is not None and getattr(impl, "supports_quant_query_input", False):
        # An fp8 cache: the layer quantizes the query (not the key) before forward.
        from vllm.platforms import current_platform

        query_dtype = current_platform.fp8_dtype()
    return AttentionBatch(
        layer_name=name, layer_index=_layer_index(name),
        query=torch.zeros((1, impl.num_heads, impl.head_size), dtype=query_dtype, device=device),
        key=torch.zeros((1, impl.num_kv_heads, impl.head_size), dtype=dtype, device=device),
        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.zeros(1, dtype=torch.int32, device=device),
        block_table=torch.zeros((1, -(-max_model_len // block_size)), dtype=torch.int32, device=device),
        block_size=block_size, num_cache_blocks=kv_cache.shape[0], num_kv_heads=impl.num_kv_heads,
        head_size=impl.head_size, scale=impl.scale, pages=key_pages(impl, layer, kv_cache),
        step=None, max_seq_len=0, max_query_len=1)


def _forward_patch(name: str, module: str, owner: str, *, declines, key_pages, fix_up,
                   check_more: Callable[[Any], list[str]]) -> Patch:
    """The patch of one backend impl's ``forward`` with ``_hooked_forward``."""
    return Patch(name=name, module=module, owner=owner, attr="forward", params=_FORWARD_PARAMS,
                 make=functools.partial(_hooked_forward, declines=declines, key_pages=key_pages, fix_up=fix_up),
                 check_more=check_more)


# -- CPU_ATTN -------------------------------------------------------------------

class _CpuSchedule:
    """The CPU kernel's work split (``scheduler_metadata``) follows seq_lens,
    so compacted lengths need their own; layers of a step usually share the
    same lengths, so one is kept per (metadata, lengths)."""

    md: Any = None
    lens: tuple[int, ...] | None = None
    value: Any = None

    @classmethod
    def get(cls, impl: Any, layer: Any, query, md: Any, seq_lens) -> Any:
        lens = tuple(seq_lens.tolist())
        if cls.md is md and cls.lens == lens:
            return cls.value
        from vllm import _custom_ops as ops
        from vllm import envs

        value = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size, seq_lens=seq_lens, dtype=query.dtype,
            query_start_loc=md.query_start_loc, causal=md.causal,
            sliding_window_size=impl.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=md.dynamic_causal,
            kv_cache_dtype=impl.kv_cache_dtype)
        cls.md, cls.lens, cls.value = md, lens, value
        return value

    @classmethod
    def clear(cls) -> None:
        cls.md = cls.lens = cls.value = None


def _cpu_declines(impl: Any, md: Any) -> bool:
    return md.dynamic_causal is not None or md.encoder_cache is not None


def _cpu_pages(impl: Any, layer: Any, kv_cache) -> KeyPages | None:
    from .cpu_pages import key_pages

    return key_pages(kv_cache, layer.isa, impl.head_size, impl.kv_cache_dtype)


def _cpu_fix_up(impl: Any, layer: Any, query, dense_md: Any, md: Any) -> None:
    md.scheduler_metadata = _CpuSchedule.get(impl, layer, query, dense_md, md.seq_lens)


def _check_cpu(owner: Any) -> list[str]:
    import inspect

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    problems = fields_missing(cpu_attn.CPUAttentionMetadata, (
        "num_actual_tokens", "query_start_loc", "seq_lens", "block_table", "slot_mapping",
        "scheduler_metadata", "causal", "dynamic_causal", "encoder_cache", "max_seq_len", "max_query_len"))
    fn = getattr(ops, "cpu_attn_get_scheduler_metadata", None)
    want = ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc",
            "causal", "sliding_window_size", "isa", "enable_kv_split", "dynamic_causal", "kv_cache_dtype")
    if fn is None:
        problems.append("vllm._custom_ops.cpu_attn_get_scheduler_metadata is gone")
    elif not set(want) <= set(inspect.signature(fn).parameters):
        problems.append("vllm._custom_ops.cpu_attn_get_scheduler_metadata has parameters "
                        f"({', '.join(inspect.signature(fn).parameters)}); expected ({', '.join(want)})")
    if not hasattr(ops, "cpu_attn_reshape_and_cache"):
        problems.append("vllm._custom_ops.cpu_attn_reshape_and_cache is gone")
    if not hasattr(cpu_attn.CPUAttentionBackend, "forward_includes_kv_cache_update") or \
            cpu_attn.CPUAttentionBackend.forward_includes_kv_cache_update:
        problems.append("CPUAttentionBackend writes the KV cache inside forward; the patch expects "
                        "keys in the cache before forward")
    return problems


CPU_FORWARD = _forward_patch("cpu_attention.forward", "vllm.v1.attention.backends.cpu_attn",
                             "CPUAttentionBackendImpl", declines=_cpu_declines, key_pages=_cpu_pages,
                             fix_up=_cpu_fix_up, check_more=_check_cpu)


# -- FLASH_ATTN (CUDA) ------------------------------------------------------------
# Written against vLLM 0.32/0.33's FlashAttentionImpl; its kv_cache is the
# logical view [num_blocks, num_kv_heads, block_size, 2 * head_size] with
# per-token rows, so keys read back by plain indexing.

_KEY_VIEWS: dict[tuple, Any] = {}


class FlashKeyPages(KeyPages):
    """``KeyPages`` over FlashAttention's per-token page rows.  An fp8
    cache (``fp8_dtype``: the type its bytes hold; ``k_scale``: what its
    keys are multiplied by to come back) is read back dequantized; its
    probes and its key view are the values as stored."""

    def __init__(self, kv_cache, head_size: int, fp8_dtype=None, k_scale: float = 1.0) -> None:
        self._kv = kv_cache.view(fp8_dtype) if fp8_dtype is not None else kv_cache
        self.head_size = head_size
        self._k_scale = float(k_scale) if fp8_dtype is not None else None

    def read(self, block_ids):
        keys = self._kv.index_select(0, block_ids).transpose(1, 2)[..., :self.head_size]
        return keys if self._k_scale is None else keys.float() * self._k_scale

    def key_view(self):
        # One view per cache tensor, kept: a decode layer call should not pay
        # for making it again (the patch builds a reader per call).
        kv = self._kv
        key = (kv.data_ptr(), kv.dtype, kv.shape, kv.stride(), self.head_size)
        view = _KEY_VIEWS.get(key)
        if view is None:
            if len(_KEY_VIEWS) > 1024:
                _KEY_VIEWS.clear()
            view = _KEY_VIEWS[key] = kv.transpose(1, 2)[..., :self.head_size]
        return view

    def probe(self, block_ids):
        import torch

        tokens = torch.arange(self._kv.shape[2], device=self._kv.device)
        return self._kv[:, 0].index_select(0, block_ids)[:, tokens, tokens % self.head_size]


def _fa_declines(impl: Any, md: Any) -> bool:
    return (getattr(impl, "dcp_world_size", 1) > 1
            or getattr(md, "mm_prefix_query_range_tensor", None) is not None
            or getattr(md, "rswa_prefix_lens", None) is not None)


def _fa_pages(impl: Any, layer: Any, kv_cache) -> KeyPages | None:
    if impl.kv_cache_dtype == "auto":
        return FlashKeyPages(kv_cache, impl.head_size)
    k_scale = _one_scale(layer, "_k_scale")
    if impl.kv_cache_dtype in ("fp8", "fp8_e4m3") and kv_cache.element_size() == 1 and k_scale is not None:
        # Bytes of the platform's fp8 type, one scale per layer (FlashAttention
        # views them so itself); other quantized caches stay unread.
        from vllm.platforms import current_platform

        return FlashKeyPages(kv_cache, impl.head_size, current_platform.fp8_dtype(), k_scale)
    return None


def _fa_fix_up(impl: Any, layer: Any, query, dense_md: Any, md: Any) -> None:
    # FA3's ahead-of-time split plan was made for the dense lengths.
    md.scheduler_metadata = None


def _check_fa(owner: Any) -> list[str]:
    from vllm.v1.attention.backends import flash_attn

    return fields_missing(flash_attn.FlashAttentionMetadata, (
        "num_actual_tokens", "query_start_loc", "seq_lens", "block_table", "slot_mapping",
        "scheduler_metadata", "causal", "max_seq_len", "max_query_len"))


FLASH_ATTN_FORWARD = _forward_patch("flash_attention.forward", "vllm.v1.attention.backends.flash_attn",
                                    "FlashAttentionImpl", declines=_fa_declines, key_pages=_fa_pages,
                                    fix_up=_fa_fix_up, check_more=_check_fa)
