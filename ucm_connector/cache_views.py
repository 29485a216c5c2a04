"""Paged KV caches laid out the way vLLM lays them out, built without vLLM.

Tests and ``benchmarks/gpu_bench.py`` need caches whose strides are exactly
the ones a real engine hands to ``register_kv_caches``, on machines where
vLLM cannot be imported (the GPU machine has torch alone).  This module
rebuilds them from the rules, and from nothing else:

* vLLM 0.32/0.33 (``create_kv_cache_views`` over a ``KVCacheLayout``): one
  flat int8 allocation; each layer's cache is a strided view
  ``[num_blocks, num_heads, block_size, C]`` whose byte strides follow a
  permutation of the logical axes ``L B H N C``.  The layout's name spells
  the physical order, outermost first (``LBNHC``: layer, block, token, head,
  content).  Block-outermost layouts (``B`` first) put every layer's page of
  a block side by side.  A padded page (MLA alignment) pads the innermost of
  the two outer axes ``L``/``B``; kernel blocks smaller than the manager
  block split each block into equal, equally spaced kernel pages.
* older CUDA backends: one tensor per layer, K/V-first
  ``[2, num_blocks, block_size, heads, head_size]`` (FlashAttention) or
  block-major ``[num_blocks, 2, block_size, heads, head_size]`` (FlashInfer),
  and MLA ``[num_blocks, block_size, latent]``.

It also names, for each layout, the order a page's bytes take in a stored
block (``PAGE_ORDER``), which ``layout.py`` puts into the namespace.  It
knows torch and shapes only; nothing here reads or writes KV.
"""

from __future__ import annotations

import torch

# The layouts vLLM can resolve; each name is the physical order of the
# logical axes, outermost first.
LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")

# Order of a page's bytes as transfer.py copies them (runs in address order):
# every layout whose token axis sits outside its head axis keeps a page as
# [N, H, C], the others as [H, N, C].  Layouts of one class give identical
# stored blocks for identical KV, so the namespace names the class.
PAGE_ORDER = {name: ("NHC" if name.index("N") < name.index("H") else "HNC") for name in LAYOUTS}


def layout_strides(layout: str, sizes: dict[str, int], page_pad_to: int | None = None) -> dict[str, int]:
    """Byte strides of the axes ``L B H N C`` for ``layout``: contiguous in
    the layout's order, except that with ``page_pad_to`` the stride of the
    innermost of ``L``/``B`` is rounded up to a whole padded page."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV cache layout {layout!r}; vLLM resolves one of {', '.join(LAYOUTS)}")
    strides: dict[str, int] = {}
    current = 1
    page_axis = max(layout.index("L"), layout.index("B"))
    for position in reversed(range(len(layout))):
        axis = layout[position]
        if page_pad_to is not None and position == page_axis:
            if any(sizes[a] > 1 for a in layout[:page_axis] if a not in "LB"):
                raise ValueError(f"{layout}: a padded page needs L and B outside the page")
            current = max(current, page_pad_to)
        strides[axis] = current
        current *= sizes[axis]
    return strides


def vllm_layer_caches(layout: str, *, num_layers: int, num_blocks: int, num_heads: int, block_size: int,
                      content_nbytes: int, dtype: torch.dtype, device="cpu", page_pad_to: int | None = None,
                      kernel_block_size: int | None = None, prefix: str = "model.layers"
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One backing int8 buffer and a ``[B, H, N, C]`` view of it per layer,
    as vLLM's ``allocate_kv_cache`` builds them for one group of identical
    layers.  ``content_nbytes`` is C in bytes (``2 * head_size * itemsize``
    for K and V, ``latent * itemsize`` for MLA)."""
    sizes = {"L": num_layers, "B": num_blocks, "H": num_heads, "N": block_size, "C": content_nbytes}
    strides = layout_strides(layout, sizes, page_pad_to)
    outer = layout[0]
    raw = torch.zeros(strides[outer] * sizes[outer], dtype=torch.int8, device=device)
    view_sizes = sizes
    if kernel_block_size is not None and kernel_block_size != block_size:
        # Each manager block is split into `ratio` kernel blocks, and the
        # page interior is laid out again for the kernel block's token count
        # (so a split LBHNC block is [ratio, H, N / ratio, C]).
        ratio = block_size // kernel_block_size
        dense_page = num_heads * block_size * content_nbytes
        if block_size % kernel_block_size or strides["B"] != dense_page:
            raise ValueError(f"{layout}: blocks of {block_size} tokens cannot be split into kernel blocks of "
                             f"{kernel_block_size} (block stride {strides['B']}, dense page {dense_page})")
        view_sizes = dict(sizes, B=num_blocks * ratio, N=kernel_block_size)
        strides = dict(layout_strides(layout, view_sizes), L=strides["L"])
    views = {}
    for layer in range(num_layers):
        view = torch.as_strided(raw, tuple(view_sizes[a] for a in "BHNC"), tuple(strides[a] for a in "BHNC"),
                                raw.storage_offset() + layer * strides["L"])
        views[f"{prefix}.{layer}.self_attn.attn"] = view.view(dtype)
    return raw, views


def kv_first_caches(*, num_layers: int, num_blocks: int, num_heads: int, block_size: int, head_size: int,
                    dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Older FlashAttention: ``[2, num_blocks, block_size, heads, head_size]`` per layer."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(2, num_blocks, block_size, num_heads, head_size, dtype=dtype, device=device)
            for i in range(num_layers)}


def block_major_caches(*, num_layers: int, num_blocks: int, num_heads: int, block_size: int, head_size: int,
                       dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Older FlashInfer: ``[num_blocks, 2, block_size, heads, head_size]`` per layer."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(num_blocks, 2, block_size, num_heads, head_size, dtype=dtype, device=device)
            for i in range(num_layers)}


def mla_caches(*, num_layers: int, num_blocks: int, block_size: int, latent: int, dtype: torch.dtype,
               device="cpu") -> dict[str, torch.Tensor]:
    """MLA, block-major: ``[num_blocks, block_size, latent]`` per layer."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(num_blocks, block_size, latent, dtype=dtype, device=device)
            for i in range(num_layers)}


def fill_random_(caches: dict[str, torch.Tensor], raw: torch.Tensor | None = None, seed: int = 0) -> None:
    """Random bytes everywhere (NaN patterns included: transfers copy bytes),
    drawn on the tensors' own device."""
    targets = [raw] if raw is not None else list(caches.values())
    for t in targets:
        if not t.is_contiguous():
            raise ValueError("fill_random_ needs contiguous backing tensors")
        flat = t.view(-1).view(torch.uint8)
        g = torch.Generator(device=flat.device).manual_seed(seed)
        chunk = 1 << 28
        for lo in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - lo)
            flat[lo:lo + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, device=flat.device, generator=g)


def page_bytes_logical(view: torch.Tensor, block_id: int) -> torch.Tensor:
    """A block's page of a layer as uint8 in logical order (not the stored
    order): for checks that must not share code with transfer.py."""
    return view[block_id].contiguous().view(torch.uint8).reshape(-1)
