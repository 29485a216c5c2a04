"""A save's gather made layer by layer, while the forward pass runs.

With ``save_layerwise``, vLLM's ``save_kv_layer`` comes once a layer's
attention has written its KV for the step.  A ``LayerGather`` copies that
layer's pages of the step's save blocks into their columns of the host rows
right then, so that the copies overlap the layers still to run; ``finish``
copies the layers it was never told of (a CUDA graph replays no Python per
layer) and returns the ``Transfer`` the writer waits on.

On CUDA a layer is one index kernel into a contiguous device slot and one
pitched DMA (``cudart.copy_2d_async``) from the slot into that layer's
columns of the pinned rows, both on one side stream that first waits for the
compute stream, where the layer's pages were just written.  The stream's own
order keeps the slot from being refilled before its DMA has read it, so one
slot of one layer's pages serves every layer.  ``finish`` makes the compute
stream wait, on the device, for the last page read: kernels queued after it
may overwrite the pages.  The host never waits.  On CPU a layer is copied on
the calling thread.

This module knows torch and the transfer's layer geometry (``pages.py``);
nothing of stores, requests or vLLM.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

import torch

from . import cudart
from .pages import WORDS
from .rows import HostRows
from .staging import ids_on_device, round_up
from .transfer import Transfer

if TYPE_CHECKING:
    from .transfer import BlockTransfer


class LayerStaging:
    """The side stream and the device slot that one transfer's layer gathers
    share (CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.lock = threading.Lock()
        self._slot: torch.Tensor | None = None

    def slot(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` of device memory, kept for the next gathers."""
        if self._slot is None or self._slot.numel() < nbytes:
            # Allocated on the side stream: the caching allocator then hands
            # a slot dropped here only to later work of that stream.
            with torch.cuda.stream(self.stream):
                self._slot = torch.empty(round_up(nbytes, 1 << 20), dtype=torch.uint8, device=self.device)
        return self._slot


class LayerGather:
    """Copies the pages of ``block_ids`` into ``rows`` (row i for block i),
    a layer at a time: ``layer(i)`` once layer i's pages are written,
    ``finish()`` for the rest.  Made by ``BlockTransfer.layer_gather``."""

    def __init__(self, transfer: "BlockTransfer", block_ids: Sequence[int], rows: HostRows) -> None:
        self._transfer = transfer
        self._rows = rows
        self.block_ids = list(block_ids)
        self._pending = set(range(transfer.num_layers))
        self._finished: Transfer | None = None
        self._cuda = transfer.on_cuda
        if self._cuda:
            self._staging = transfer.layer_staging()
            self._ids = ids_on_device(transfer.device, self.block_ids, self._staging.stream)
            self._pages_read = torch.cuda.Event()

    @property
    def rows(self) -> HostRows:
        return self._rows

    @property
    def layers_left(self) -> int:
        """Layers not copied yet."""
        return len(self._pending)

    def layer(self, layer: int) -> None:
        """Layer ``layer``'s pages of the blocks are written: copy them
        (once; a layer told of twice, or after ``finish``, is ignored)."""
        if layer not in self._pending or self._finished is not None or not self.block_ids:
            return
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return   # a graph being captured: copied by finish() instead
        self._pending.discard(layer)
        self._copy(layer)

    def finish(self) -> Transfer:
        """Copy every layer not copied yet, and return the whole copy: on
        CUDA ``wait()`` for the rows; the caller's stream already waits for
        the page reads.  Called again, it returns the same copy."""
        if self._finished is None:
            for layer in sorted(self._pending):
                self._copy(layer)
            self._pending.clear()
            if not self._cuda or not self.block_ids:
                self._finished = Transfer()
            else:
                host_done = torch.cuda.Event()
                host_done.record(self._staging.stream)
                torch.cuda.current_stream(self._transfer.device).wait_event(self._pages_read)
                self._finished = Transfer(host_done, self._pages_read)
        return self._finished

    def _copy(self, layer: int) -> None:
        if not self._cuda:
            self._transfer.gather_layer(layer, self.block_ids, self._rows.payload)
            return
        transfer, staging, pool = self._transfer, self._staging, self._rows.pool
        segment = transfer.layer_segment(layer)
        word = segment.align
        n = len(self.block_ids)
        sizes = segment.inner_sizes[:-1] + [segment.inner_sizes[-1] // word]
        compute = torch.cuda.current_stream(transfer.device)
        with staging.lock:
            slot = staging.slot(n * segment.nbytes)
            out = slot[:n * segment.nbytes].view(WORDS[word]).view(n, *sizes)
            # The layer's pages were just written by the compute stream.
            staging.stream.wait_stream(compute)
            with torch.cuda.stream(staging.stream):
                torch.index_select(transfer.layer_source(layer, word), 0, self._ids, out=out)
                self._pages_read.record(staging.stream)
            cudart.copy_2d_async(self._rows.tensor.data_ptr() + pool.payload_offset + segment.offset,
                                 pool.row_nbytes, slot.data_ptr(), segment.nbytes, segment.nbytes, n,
                                 cudart.DEVICE_TO_HOST, staging.stream.cuda_stream)
