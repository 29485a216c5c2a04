"""Where a layer's pages lie, and in what order a stored block holds them.

A stored block is the concatenation, layer by layer, of that block's pages:
``payload = page(layer 0) | page(layer 1) | ...``.  A page is what the
attention backend keeps for one block of one layer, and its bytes go into
the payload in address order: a page is one or more equal runs of bytes
(one for block-major caches, two for K/V-first ones, one per head where
heads sit outside blocks), copied whole and in the order they lie in
memory (where vLLM splits a block into smaller kernel blocks, in the order
the unsplit block would have).  So the payload depends on the order inside
a page (tokens outside heads or heads outside tokens), not on how layers
and blocks nest around pages; the inner layout of a page is the backend's
business (the CPU backend packs K and V per ISA), and the namespace names it
(``layout.py``).

Any strided cache view is understood, as long as its last dimension is
contiguous and it has a dimension of ``num_blocks`` blocks first (or second,
after a K/V dimension of 2): vLLM's ``[B, H, N, C]`` views of one backing
buffer in all six ``KVCacheLayout`` orders (kernel-block splits included),
and the older per-layer K/V-first and block-major tensors.  Consecutive
layers that share a backing buffer at a constant distance form one
``Segment``, copied as one strided view, so a default vLLM cache moves with
one index operation per batch, not one per layer.

This module reads shapes and strides and builds views of the caches'
storage; it copies no bytes, allocates no memory, and knows nothing of host
rows, streams, stores or requests.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclasses.dataclass(frozen=True)
class LayerView:
    """Where one layer keeps a block's page, in bytes of its storage."""

    name: str
    tensor: torch.Tensor
    kv_first: bool
    num_blocks: int
    page_nbytes: int          # bytes of one block of this layer (K and V)
    base: int = 0             # storage offset of block 0's first run
    block_stride: int = 0
    runs: tuple[tuple[int, int], ...] = ()   # (count, stride) of the runs, outermost first
    run_nbytes: int = 0


def _dims_nbytes(tensor: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Sizes, strides and storage offset of ``tensor`` counted in bytes."""
    itemsize = tensor.element_size()
    sizes = list(tensor.shape)
    sizes[-1] *= itemsize
    strides = [s * itemsize for s in tensor.stride()]
    strides[-1] = 1
    return sizes, strides, tensor.storage_offset() * itemsize


def _merge_dims(dims: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(count, stride) dimensions, outermost first, with every dimension
    that continues the next inner one folded into it (longer runs)."""
    merged = [dims[-1]]
    for n, s in reversed(dims[:-1]):
        inner_n, inner_s = merged[0]
        if s == inner_s * inner_n:
            merged[0] = (n * inner_n, inner_s)
        else:
            merged.insert(0, (n, s))
    return tuple(merged)


def describe_layer(name: str, tensor: torch.Tensor, num_blocks: int) -> LayerView:
    """Work out where the pages of a layer's cache lie."""

    def refuse(why: str) -> ValueError:
        return ValueError(
            f"KV cache of layer {name!r} (shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}): "
            f"{why}; ucm-connector copies whole pages and needs a dimension of {num_blocks} "
            "blocks first (or second, after K/V) and a contiguous last dimension")

    if tensor.dim() < 2 or tensor.stride(-1) != 1:
        raise refuse("the last dimension is not contiguous")
    sizes, strides, base = _dims_nbytes(tensor)
    kv_first = sizes[0] == 2 and sizes[1] == num_blocks and num_blocks != 2
    split: tuple[int, int] | None = None
    if kv_first:
        block_axis = 1
    elif sizes[0] == num_blocks:
        block_axis = 0
    elif tensor.dim() == 4 and num_blocks > 0 and sizes[0] > num_blocks and sizes[0] % num_blocks == 0:
        # vLLM's kernel blocks smaller than its blocks ([B * ratio, H, N, C]):
        # block b is kernel blocks [b * ratio, (b + 1) * ratio), equally spaced.
        block_axis = 0
        split = (sizes[0] // num_blocks, strides[0])
        sizes[0], strides[0] = num_blocks, strides[0] * split[0]
    else:
        raise refuse(f"no dimension of {num_blocks} blocks (pages of shape {tuple(tensor.shape)} are not "
                     "contiguous runs that ucm-connector can find)")
    block_stride = strides[block_axis]
    dims = sorted(((n, s) for axis, (n, s) in enumerate(zip(sizes, strides)) if axis != block_axis and n != 1),
                  key=lambda d: -d[1])
    for (outer_n, outer_s), (inner_n, inner_s) in zip(dims, dims[1:]):
        if outer_s < inner_s * inner_n:
            raise refuse("its pages overlap themselves")
    if block_stride <= 0 or not dims or dims[-1][1] != 1:
        raise refuse("its pages are not runs of contiguous bytes")
    if split is not None:
        # Kernel pages go in just outside the token axis, so that a block's
        # payload is the same as without the split ([H, N, C] stays [H, N, C]
        # rather than becoming [ratio, H, N / ratio, C]).
        tokens = (sizes[2], strides[2])
        at = dims.index(tokens) if tokens in dims else len(dims) - 1
        dims.insert(at, split)
    merged = _merge_dims(dims)
    run_nbytes = merged[-1][0]
    runs = tuple(merged[:-1])
    page_nbytes = run_nbytes * int(np.prod([n for n, _ in runs], dtype=np.int64))
    return LayerView(name, tensor, kv_first, num_blocks, page_nbytes, base, block_stride, runs, run_nbytes)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive layers whose pages one strided view covers: dims after the
    block dimension are (count, byte stride), the last one the contiguous
    run."""

    first_layer: int
    num_layers: int
    storage_of: torch.Tensor
    base: int
    block_stride: int
    dims: tuple[tuple[int, int], ...]
    offset: int              # where its first page starts in the payload
    nbytes: int              # its bytes of one block

    @property
    def align(self) -> int:
        """Widest word that every offset and stride of the view is made of."""
        values = [self.base, self.block_stride, self.dims[-1][0]] + [s for _, s in self.dims[:-1]]
        return next(w for w in (8, 4, 2, 1) if all(v % w == 0 for v in values))

    def view(self, num_blocks: int, word: int = 1) -> torch.Tensor:
        storage = self.storage_of.untyped_storage()
        flat = torch.empty(0, dtype=WORDS[word], device=self.storage_of.device)
        flat.set_(storage, 0, (storage.nbytes() // word,), (1,))
        sizes = [num_blocks] + [n for n, _ in self.dims[:-1]] + [self.dims[-1][0] // word]
        strides = [self.block_stride // word] + [s // word for _, s in self.dims[:-1]] + [1]
        return flat.as_strided(sizes, strides, self.base // word)

    @property
    def inner_sizes(self) -> list[int]:
        return [n for n, _ in self.dims]


def segment_layers(layers: list[LayerView], offsets: list[int], merge: bool) -> list[Segment]:
    """One segment per run of layers that sit at a constant distance in one
    storage with identical page geometry (vLLM's layers of one group)."""
    groups: list[list[int]] = []
    for i, layer in enumerate(layers):
        if merge and groups:
            first = layers[groups[-1][0]]
            last = layers[groups[-1][-1]]
            same = (layer.tensor.untyped_storage().data_ptr() == first.tensor.untyped_storage().data_ptr()
                    and layer.tensor.device == first.tensor.device
                    and (layer.block_stride, layer.runs, layer.run_nbytes)
                    == (first.block_stride, first.runs, first.run_nbytes))
            step = layer.base - last.base
            if same and step > 0 and (len(groups[-1]) == 1 or step == last.base - layers[groups[-1][-2]].base):
                groups[-1].append(i)
                continue
        groups.append([i])
    segments = []
    for group in groups:
        first = layers[group[0]]
        dims = list(first.runs) + [(first.run_nbytes, 1)]
        if len(group) > 1:
            dims.insert(0, (len(group), layers[group[1]].base - first.base))
        segments.append(Segment(group[0], len(group), first.tensor, first.base, first.block_stride,
                                 _merge_dims(dims), offsets[group[0]], first.page_nbytes * len(group)))
    return segments
