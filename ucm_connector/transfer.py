"""Whole-block copies between vLLM's paged KV caches and contiguous buffers.

A stored block is the concatenation, layer by layer, of that block's pages:
``payload = page(layer 0) | page(layer 1) | ...``.  A page is whatever the
attention backend keeps for one block of one layer; its inner layout is the
backend's business (the CPU backend packs K and V per ISA), so pages are only
ever copied whole and the layout goes into the namespace.

Two layouts of a layer's cache tensor are understood:

* block-major, ``[num_blocks, ...]`` (CPU_ATTN, FlashInfer): a page is
  ``cache[b]``, one contiguous run of bytes;
* K/V-first, ``[2, num_blocks, ...]`` (FlashAttention): a page is
  ``cache[0, b] | cache[1, b]``, two runs.

On CPU a copy is one fancy-indexed assignment per layer over numpy views of
the caches.  On CUDA, gathers and scatters run on a side stream through a
pinned staging buffer; the compute stream is never synchronised, only made
to wait on an event where its next kernels need the loaded pages.

This module knows torch and tensor layouts; it knows nothing of stores,
requests or the scheduler.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class LayerView:
    name: str
    tensor: torch.Tensor
    kv_first: bool
    num_blocks: int
    page_nbytes: int          # bytes of one block of this layer (K and V)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def describe_layer(name: str, tensor: torch.Tensor, num_blocks: int) -> LayerView:
    """Work out where the block dimension of a layer's cache is."""
    if tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks and num_blocks != 2:
        kv_first = True
        page = tensor[0, 0]
        page_nbytes = 2 * page.numel() * tensor.element_size()
        if not (tensor[0].is_contiguous() or tensor[0, 0].is_contiguous()):
            raise ValueError(f"KV cache of layer {name!r}: pages of shape {tuple(tensor.shape)} are not contiguous")
    elif tensor.shape[0] == num_blocks:
        kv_first = False
        page = tensor[0]
        page_nbytes = page.numel() * tensor.element_size()
        if not page.is_contiguous():
            raise ValueError(f"KV cache of layer {name!r}: pages of shape {tuple(tensor.shape)} are not contiguous")
    else:
        raise ValueError(
            f"KV cache of layer {name!r} has shape {tuple(tensor.shape)}: no dimension of "
            f"{num_blocks} blocks where ucm-connector expects one (dim 0, or dim 1 after K/V)")
    return LayerView(name, tensor, kv_first, num_blocks, page_nbytes)


class BlockTransfer:
    """Gathers blocks out of, and scatters them into, the registered caches."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV caches were registered")
        self.layers = [describe_layer(n, t, num_blocks) for n, t in kv_caches.items()]
        self.device = self.layers[0].tensor.device
        self.payload_nbytes = sum(l.page_nbytes for l in self.layers)
        self._offsets = np.cumsum([0] + [l.page_nbytes for l in self.layers]).tolist()
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._staging: torch.Tensor | None = None
        else:
            # Byte views of every page, block-major: [num_blocks, page_nbytes]
            # (K/V-first layers: two halves).
            self._np_views = []
            for layer in self.layers:
                raw = _as_bytes(layer.tensor)
                if layer.kv_first:
                    halves = [raw[i].reshape(num_blocks, -1).numpy() for i in (0, 1)]
                    self._np_views.append(halves)
                else:
                    self._np_views.append([raw.reshape(num_blocks, -1).numpy()])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # -- CPU ---------------------------------------------------------------

    def gather(self, block_ids: Sequence[int], out: np.ndarray) -> None:
        """Copy the pages of ``block_ids`` into ``out[i, :payload_nbytes]``
        (``out`` is ``[len(block_ids), >= payload_nbytes]`` uint8)."""
        if self._cuda:
            self._gather_cuda(block_ids, out)
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        for views, lo in zip(self._np_views, self._offsets):
            for view in views:
                width = view.shape[1]
                out[:, lo:lo + width] = view[ids]
                lo += width

    def scatter(self, block_ids: Sequence[int], src: np.ndarray, layers: range | None = None) -> None:
        """Copy ``src[i, :payload_nbytes]`` into the pages of ``block_ids``;
        with ``layers``, only those layers' pages (on CUDA every layer is
        copied by the first call of a block set: its upload is one copy)."""
        if self._cuda:
            if layers is None or layers.start == 0:
                self._scatter_cuda(block_ids, src)
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        chosen = range(len(self.layers)) if layers is None else layers
        for i in chosen:
            views, lo = self._np_views[i], self._offsets[i]
            for view in views:
                width = view.shape[1]
                view[ids] = src[:, lo:lo + width]
                lo += width

    # -- CUDA --------------------------------------------------------------

    def _pinned(self, n: int) -> torch.Tensor:
        need = n * self.payload_nbytes
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.uint8, pin_memory=True)
        return self._staging[:need].view(n, self.payload_nbytes)

    def _gather_cuda(self, block_ids: Sequence[int], out: np.ndarray) -> None:
        n = len(block_ids)
        staging = self._pinned(n)
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        # Saves read pages the compute stream has just written.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for layer, lo in zip(self.layers, self._offsets):
                raw = _as_bytes(layer.tensor)
                parts = [raw[0], raw[1]] if layer.kv_first else [raw]
                for part in parts:
                    pages = part.reshape(layer.num_blocks, -1).index_select(0, ids)
                    width = pages.shape[1]
                    staging[:, lo:lo + width].copy_(pages, non_blocking=True)
                    lo += width
        self._stream.synchronize()
        out[:, :self.payload_nbytes] = staging.numpy()

    def _scatter_cuda(self, block_ids: Sequence[int], src: np.ndarray) -> None:
        n = len(block_ids)
        staging = self._pinned(n)
        staging.numpy()[:] = src[:, :self.payload_nbytes]
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        with torch.cuda.stream(self._stream):
            device_buf = staging.to(self.device, non_blocking=True)
            for layer, lo in zip(self.layers, self._offsets):
                raw = _as_bytes(layer.tensor)
                parts = [raw[0], raw[1]] if layer.kv_first else [raw]
                for part in parts:
                    flat = part.reshape(layer.num_blocks, -1)
                    width = flat.shape[1]
                    flat.index_copy_(0, ids, device_buf[:, lo:lo + width])
                    lo += width
            done = torch.cuda.Event()
            done.record(self._stream)
        # The forward pass reads these pages: order it after the copies
        # without blocking the host.
        torch.cuda.current_stream(self.device).wait_event(done)
        # The staging buffer is reused by the next call: wait for the upload.
        done.synchronize()
