"""Reading keys back out of the CPU backend's pages.

Inside each (block, kv head) page the CPU attention kernel packs the keys in
an ISA-dependent order (transposed for ``vec``/``vec16``, VNNI tiles for
``amx``, ...).  Rather than hard-coding each packing, the packing is learned
from vLLM's own cache-writing op: write a scratch page whose key values
encode each element's (token, dim) index, and see where each one lands.  The
result, a permutation from page order to token-major order, is what turns a
page back into ``[block_size, head_size]`` keys.  Any ISA the op supports is
handled the same way; a packing that does not round-trip exactly (a
quantized fp8 cache) yields no reader, and the method keeps such blocks.
"""

from __future__ import annotations

import functools
import torch

from ucm_connector.sparse.base import KeyPages

_DIGIT = 128     # integers below 128 are exact in bf16 / fp16 / fp32


@functools.lru_cache(maxsize=16)
def key_permutation(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``perm`` such that ``page_keys.flatten()[perm]`` is the block's keys in
    token-major order; None when the packing could not be learned."""
    from vllm import _custom_ops as ops

    n = block_size * head_size
    digits = 1
    while _DIGIT ** digits < n:
        digits += 1
    index = torch.arange(n, dtype=torch.int64)
    found = torch.zeros(n, dtype=torch.int64)
    for i in range(digits):
        scratch = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = scratch.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        digit = (index // _DIGIT ** i) % _DIGIT
        key = digit.view(block_size, 1, head_size).to(dtype)
        value = torch.zeros_like(key)
        try:
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                           torch.arange(block_size, dtype=torch.int64), isa)
        except Exception:
            return None
        page = scratch.view(-1)[:n].to(torch.int64)
        found += page * _DIGIT ** i
    # found[p] = token-major index of the element stored at page position p.
    if not torch.equal(found.sort().values, index):
        return None
    perm = torch.empty(n, dtype=torch.int64)
    perm[found] = torch.arange(n, dtype=torch.int64)
    return perm


class CpuKeyPages(KeyPages):
    """``KeyPages`` over a CPU cache viewed as
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (each page's
    first half holds the packed keys)."""

    def __init__(self, kv_cache: torch.Tensor, perm: torch.Tensor, head_size: int) -> None:
        num_blocks, self.num_kv_heads, self.block_size, _ = kv_cache.shape
        self.head_size = head_size
        n = self.block_size * head_size
        self._keys = kv_cache.view(num_blocks, self.num_kv_heads, 2 * n)[:, :, :n]
        self._perm = perm
        tokens = torch.arange(self.block_size)
        self._probe_at = perm[tokens * head_size + tokens % head_size]
        # vec / vec16 store each page's keys as [head_size, block_size].
        transposed = (torch.arange(head_size).unsqueeze(0) * self.block_size + tokens.unsqueeze(1)).flatten()
        self._transposed = torch.equal(perm, transposed)

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        pages = self._keys.index_select(0, block_ids).index_select(2, self._perm)
        return pages.view(-1, self.num_kv_heads, self.block_size, self.head_size).transpose(1, 2)

    def reduce(self, block_ids: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._transposed:
            return super().reduce(block_ids, parts)
        pages = self._keys.index_select(0, block_ids).view(-1, self.num_kv_heads, self.head_size,
                                                           self.block_size)
        kmin, kmax = torch.aminmax(pages, dim=-1)
        sums = pages.view(*pages.shape[:3], parts, -1).sum(dim=-1, dtype=torch.float32)
        return kmin, kmax, sums.permute(0, 3, 1, 2)

    def probe(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self._keys[:, 0].index_select(0, block_ids).index_select(1, self._probe_at)


_by_cache: dict[tuple, CpuKeyPages | None] = {}


def key_pages(kv_cache: torch.Tensor, isa: str, head_size: int, kv_cache_dtype: str) -> CpuKeyPages | None:
    """Page access for a CPU cache (one object per cache tensor), or None
    where the packing cannot be read back exactly (a quantized cache)."""
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype, isa, head_size, kv_cache_dtype)
    if key in _by_cache:
        return _by_cache[key]
    pages = None
    if kv_cache_dtype in ("auto", None) and kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32):
        perm = key_permutation(isa, kv_cache.shape[2], head_size, kv_cache.dtype)
        if perm is not None:
            pages = CpuKeyPages(kv_cache, perm, head_size)
    _by_cache[key] = pages
    return pages


def forget() -> None:
    """Drop the page views (they keep the caches alive)."""
    _by_cache.clear()
