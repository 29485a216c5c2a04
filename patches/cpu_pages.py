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
from typing import Callable

import torch

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


def key_reader(kv_cache: torch.Tensor, isa: str, head_size: int,
               kv_cache_dtype: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function block_ids -> keys ``[n, block_size, num_kv_heads, head_size]``
    for a CPU cache viewed as ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``."""
    if kv_cache_dtype not in ("auto", None) or kv_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    perm = key_permutation(isa, block_size, head_size, kv_cache.dtype)
    if perm is None:
        return None
    n = block_size * head_size

    def read(block_ids: torch.Tensor) -> torch.Tensor:
        pages = kv_cache.index_select(0, block_ids).view(block_ids.numel(), num_kv_heads, -1)[:, :, :n]
        keys = pages.index_select(2, perm).view(block_ids.numel(), num_kv_heads, block_size, head_size)
        return keys.transpose(1, 2)

    return read
