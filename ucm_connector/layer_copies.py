"""Copies between the caches and host rows made a layer at a time, while
the forward pass runs.

* ``LayerGather`` (``save_layerwise``): vLLM's ``save_kv_layer`` comes once
  a layer's attention has written its KV for the step; that layer's pages
  of the step's save blocks are copied into their columns of the host rows
  right then, so that the copies overlap the layers still to run.
  ``finish`` copies the layers it was never told of (a CUDA graph replays
  no Python per layer) and returns the ``Transfer`` the writer waits on.
* ``LayerScatter`` (``load_layerwise``): checked rows are copied into the
  pages a layer at a time, and layer i's attention waits only for layer i.

On CUDA a layer is one index kernel and one pitched DMA
(``cudart.copy_2d_async``) between a contiguous device slot and that
layer's columns of the pinned rows, on one side stream per direction; the
stream's own order keeps the slot from being reused before the kernel or
DMA that reads it is done, so one slot of one layer's pages serves every
layer.  A gather's stream first waits for the compute stream, where the
layer's pages were just written, and ``finish`` makes the compute stream
wait for the last page read, so later kernels may overwrite the pages.  A
scatter's stream waits for the stream the forward pass was queued on when
the load started (queued kernels may still read pages of freed blocks), and
``order(i)`` makes a stream wait for layer i's pages.  The host never
waits.  On CPU a layer is copied on the calling thread.

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
from .staging import host_event, ids_on_device, round_up
from .transfer import Transfer

if TYPE_CHECKING:
    from .transfer import BlockTransfer


class LayerStaging:
    """The side stream and the device slot that one direction's layer
    copies of a transfer share (CUDA); ``lock`` is held while a layer's
    copy is issued."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.lock = threading.Lock()
        self._slot: torch.Tensor | None = None

    def slot(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` of device memory, kept for the next copies."""
        if self._slot is None or self._slot.numel() < nbytes:
            # Allocated on the side stream: the caching allocator then hands
            # a slot dropped here only to later work of that stream.
            with torch.cuda.stream(self.stream):
                self._slot = torch.empty(round_up(nbytes, 1 << 20), dtype=torch.uint8, device=self.device)
        return self._slot

    def release(self) -> int:
        """Wait for the side stream, then drop the slot; the bytes it took."""
        with self.lock:
            self.stream.synchronize()
            released = 0 if self._slot is None else self._slot.numel()
            self._slot = None
            return released


def slot_pages(slot: torch.Tensor, rows: int, segment, word: int) -> torch.Tensor:
    """The first ``rows`` pages of a layer (``segment``) in ``slot``, a
    contiguous uint8 buffer, shaped like ``BlockTransfer.layer_source``:
    ``[rows, *page dims]`` of ``word``-byte elements.  Row i's bytes are
    the layer's columns of block i's payload, in order."""
    sizes = segment.inner_sizes[:-1] + [segment.inner_sizes[-1] // word]
    return slot[:rows * segment.nbytes].view(WORDS[word]).view(rows, *sizes)


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
            self._staging = transfer.layer_staging("gather")
            self._ids = ids_on_device(transfer.device, self.block_ids, self._staging.stream)
            self._pages_read = host_event()

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
        return self.abort()

    def abort(self) -> Transfer:
        """Copy nothing more: what was issued so far, for giving the rows
        back (``finish`` returns it from now on)."""
        if self._finished is None:
            self._pending.clear()
            if not self._cuda or not self.block_ids:
                self._finished = Transfer()
            else:
                host_done = host_event()
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
        n = len(self.block_ids)
        compute = torch.cuda.current_stream(transfer.device)
        with staging.lock:
            slot = staging.slot(n * segment.nbytes)
            # The layer's pages were just written by the compute stream.
            staging.stream.wait_stream(compute)
            with torch.cuda.stream(staging.stream):
                torch.index_select(transfer.layer_source(layer, segment.align), 0, self._ids,
                                   out=slot_pages(slot, n, segment, segment.align))
                self._pages_read.record(staging.stream)
            cudart.copy_2d_async(self._rows.tensor.data_ptr() + pool.payload_offset + segment.offset,
                                 pool.row_nbytes, slot.data_ptr(), segment.nbytes, segment.nbytes, n,
                                 cudart.DEVICE_TO_HOST, staging.stream.cuda_stream)


class LayerScatter:
    """Copies the payload of row ``row_ids[i]`` of ``rows`` (default: row
    i) into the pages of ``block_ids[i]``, a layer at a time: ``layer(i)``
    issues layer i (on CPU: copies it), ``order(i)`` makes a stream wait for
    it (CUDA), ``finish()`` issues what is left and returns the whole copy,
    after which the rows may be given back (``abort()``: issue no more).  ``after``: the stream whose
    queued kernels come first (CUDA; default, the caller's current one).
    Made by ``BlockTransfer.layer_scatter``."""

    def __init__(self, transfer: "BlockTransfer", block_ids: Sequence[int], rows: HostRows,
                 row_ids: Sequence[int] | None = None, after: torch.cuda.Stream | None = None) -> None:
        if row_ids is not None and len(row_ids) != len(block_ids):
            raise ValueError("row_ids and block_ids differ in length")
        self._transfer = transfer
        self._rows = rows
        self.block_ids = list(block_ids)
        self._row_ids = list(range(len(block_ids))) if row_ids is None else list(row_ids)
        self._pending = set(range(transfer.num_layers))
        self._finished: Transfer | None = None
        self._cuda = transfer.on_cuda
        if self._cuda and self.block_ids:
            self._staging = transfer.layer_staging("scatter")
            # The slot holds rows 0..max(row_ids) of a layer; the kernel
            # picks the wanted ones where they are not all of them in order.
            self._span = max(self._row_ids) + 1
            whole = self._row_ids == list(range(self._span))
            values = self.block_ids + ([] if whole else self._row_ids)
            ids = ids_on_device(transfer.device, values, self._staging.stream)
            self._ids = ids[:len(self.block_ids)]
            self._picks = None if whole else ids[len(self.block_ids):]
            # Pages of freed blocks may still be read by kernels queued there.
            self._staging.stream.wait_stream(after or torch.cuda.current_stream(transfer.device))
            self._written: dict[int, torch.cuda.Event] = {}

    def layer(self, layer: int) -> None:
        """Copy (on CUDA: issue) layer ``layer``'s pages; once only."""
        if layer not in self._pending or self._finished is not None:
            return
        self._pending.discard(layer)
        if not self.block_ids:
            return
        if not self._cuda:
            self._transfer.scatter(self.block_ids, self._rows.payload, range(layer, layer + 1),
                                   row_ids=self._row_ids)
            return
        transfer, staging, pool = self._transfer, self._staging, self._rows.pool
        segment = transfer.layer_segment(layer)
        with staging.lock:
            slot = staging.slot(self._span * segment.nbytes)
            cudart.copy_2d_async(slot.data_ptr(), segment.nbytes,
                                 self._rows.tensor.data_ptr() + pool.payload_offset + segment.offset,
                                 pool.row_nbytes, segment.nbytes, self._span, cudart.HOST_TO_DEVICE,
                                 staging.stream.cuda_stream)
            with torch.cuda.stream(staging.stream):
                src = slot_pages(slot, self._span, segment, segment.align)
                if self._picks is not None:
                    src = src.index_select(0, self._picks)
                transfer.layer_source(layer, segment.align).index_copy_(0, self._ids, src)
                done = torch.cuda.Event()
                done.record(staging.stream)
            self._written[layer] = done

    def order(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the caller's current one) wait, on the
        device, for layer ``layer``'s pages (CUDA; issued already)."""
        if self._cuda and self.block_ids:
            event = self._written.get(layer)
            if event is not None:
                (stream or torch.cuda.current_stream(self._transfer.device)).wait_event(event)

    def finish(self) -> Transfer:
        """Issue every layer not issued yet; the whole copy (``wait()``:
        the rows may be reused)."""
        if self._finished is None:
            for layer in sorted(self._pending):
                self.layer(layer)
        return self.abort()

    def abort(self) -> Transfer:
        """Issue nothing more: what was issued so far, for giving the rows
        back (``finish`` returns it from now on)."""
        if self._finished is None:
            self._pending.clear()
            if not self._cuda or not self.block_ids:
                self._finished = Transfer()
            else:
                done = host_event()
                done.record(self._staging.stream)
                self._finished = Transfer(done, done)
        return self._finished

