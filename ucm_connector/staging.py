"""The CUDA staging ring: device buffers a batch of blocks moves through.

On CUDA, a batch moves in chunks through a small ring of device staging
slots: an index kernel gathers a chunk's pages into a slot (rows laid out
exactly like the host rows) while the copy engine moves the previous chunk
over PCIe, straight into or out of pinned host rows; so a batch costs one
pass of the PCIe link plus one chunk's gather.

This module owns the slots, the two side streams of a direction (index
kernels, host copies), the events that order a slot's reuse, and the views
of a slot shaped like each segment's pages, and the pinned ring that block
ids go to the device from (``ids_on_device``).  Beside those ids it issues
no copies of its own (``BlockTransfer`` does), and it makes the host wait
only where that ring comes round to a slice whose copy is not done yet
(many steps' worth of ids later).
"""

from __future__ import annotations

import collections
import contextlib
import threading

import numpy as np
import torch

from .pages import WORDS, Segment
from .rows import RowPool


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


class StagingRing:
    """Device staging slots for one direction, with the events that order
    their reuse; one copy at a time per direction (``lock``).  The strided
    views of a slot that the index kernels write or read are built once
    per chunk shape and kept: building them per copy cost more host time
    than the copy's kernels took (benchmarks/RESULTS.md)."""

    def __init__(self, device: torch.device, slot_nbytes: int, slots: int) -> None:
        self.device = device
        self.slot_nbytes = slot_nbytes
        self.slots = slots
        self.buffer: torch.Tensor | None = None
        self.kernel_stream = torch.cuda.Stream(device=device)
        self.copy_stream = torch.cuda.Stream(device=device)
        self.filled = [torch.cuda.Event() for _ in range(slots)]
        self.drained = [torch.cuda.Event() for _ in range(slots)]
        self.used = [False] * slots
        #: The slot the next copy starts at: copies go round the slots, so a
        #: copy of one slot's worth does not wait for the one just before.
        self.next = 0
        self.lock = threading.Lock()
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}

    def fit(self, row_nbytes: int) -> None:
        if self.slot_nbytes < row_nbytes:   # a block larger than a slot: one block per slot
            self.slot_nbytes = round_up(row_nbytes, 256)
            if self.buffer is not None:
                # Its memory goes back to the allocator, which must not hand
                # it out again before the side streams' queued copies are done.
                self.buffer.record_stream(self.kernel_stream)
                self.buffer.record_stream(self.copy_stream)
            self.buffer = None
            self._views.clear()

    def reserve(self, row_nbytes: int) -> int:
        """Allocate the slots now, for rows of ``row_nbytes`` (at start-up,
        rather than at the first copy); the device bytes they take.  Raises
        ``torch.OutOfMemoryError`` where there is no room."""
        with self.lock:
            self.fit(row_nbytes)
            if self.buffer is None:
                self._allocate()
            return self.slot_nbytes * self.slots

    def release(self) -> int:
        """Wait for both side streams, then drop the slots; the bytes they
        took (``reserve`` or the next copy allocates them again)."""
        with self.lock:
            self.kernel_stream.synchronize()
            self.copy_stream.synchronize()
            released = 0 if self.buffer is None else self.buffer.numel()
            self.buffer = None
            self._views.clear()
            return released

    def rows_per_slot(self, row_nbytes: int) -> int:
        return max(1, self.slot_nbytes // row_nbytes)

    def chunk(self, k: int, rows: int, word: int, pool: RowPool, segments: list[Segment]
              ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Slot ``k`` holding ``rows`` host rows: as bytes (for the DMA), as
        words, and each segment's payload columns shaped like its view."""
        key = (k, rows, word, pool.row_nbytes, pool.payload_offset)
        views = self._views.get(key)
        if views is None:
            if self.buffer is None:
                self._allocate()
            lo = k * self.slot_nbytes
            as_bytes = self.buffer[lo:lo + rows * pool.row_nbytes].view(rows, pool.row_nbytes)
            as_words = as_bytes.view(WORDS[word])
            views = (as_bytes, as_words, payload_views(as_words, word, pool.payload_offset, segments))
            if len(self._views) >= 64:    # odd last-chunk sizes: keep it bounded
                self._views.clear()
            self._views[key] = views
        return views

    def _allocate(self) -> None:
        # The buffer comes from the current stream's memory, which work
        # still queued there may be using (memory it freed is reused in
        # its order, not in the side streams'): neither side stream
        # touches the buffer before that work is done.
        current = torch.cuda.current_stream(self.device)
        self.buffer = torch.empty(self.slot_nbytes * self.slots, dtype=torch.uint8, device=self.device)
        self.kernel_stream.wait_stream(current)
        self.copy_stream.wait_stream(current)

    def slot(self, chunk: int) -> int:
        """The slot of the current copy's ``chunk``-th chunk."""
        return (self.next + chunk) % self.slots

    @contextlib.contextmanager
    def issuing(self, chunks: int):
        """Around the issue of a copy of ``chunks`` chunks: the next copy
        starts at the slot after them (a copy of one slot's worth does not
        wait for the one just before), and a copy that fails half-way
        waits on the host for what it issued before the error goes on: its
        host rows must not be handed back, nor its page writes left
        unordered, while those chunks still run.  A device error while
        waiting is not raised over the one being handled."""
        try:
            yield
        except BaseException:
            try:
                self.copy_stream.synchronize()
                self.kernel_stream.synchronize()
            except Exception:
                pass
            raise
        finally:
            self.next = (self.next + chunks) % self.slots

    def issued(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """``(host_done, pages_done)``: events behind all that is queued so
        far on the copy stream (the host rows are written or read) and on
        the kernel stream (the pages are read or written)."""
        host_done = host_event()
        host_done.record(self.copy_stream)
        pages_done = host_event()
        pages_done.record(self.kernel_stream)
        return host_done, pages_done


def host_event() -> torch.cuda.Event:
    """An event that a host thread may wait for (``Transfer.wait`` and
    ``synchronize``: the writer, the loader, a row pool short of rows).
    The thread sleeps until the device signals it, instead of spinning a
    core for the whole copy (tens of milliseconds for a large save) that
    vLLM's own threads and processes on the host could use; waking costs
    microseconds, against copies of milliseconds."""
    return torch.cuda.Event(blocking=True)


class _PinnedIds:
    """Pinned host memory that block ids are copied to the device from,
    taken in turn round a ring: pinning a fresh buffer per copy cost about
    0.25 ms of the calling thread each time (the engine thread, for every
    part of a save), while a slice of memory pinned once costs a memcpy of
    a few kB.  A slice is written again only once the copy that read it
    last is done; the ring holds ``CAPACITY`` ids, many steps' worth, so
    that copy is long finished (the wait does not hold the host behind
    the forward pass that the copies are queued after)."""

    CAPACITY = 1 << 18

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.host: torch.Tensor | None = None
        self.at = 0
        # (start, end, event after the copy that read host[start:end]), oldest first.
        self.reads: collections.deque[tuple[int, int, torch.cuda.Event]] = collections.deque()

    def upload(self, device: torch.device, values: np.ndarray, stream: torch.cuda.Stream) -> torch.Tensor:
        n = len(values)
        with self.lock:
            if self.host is None:
                self.host = torch.empty(self.CAPACITY, dtype=torch.int64).pin_memory()
            if self.at + n > self.CAPACITY:
                # Round to the start: the last round's slices past here,
                # the oldest reads, are never written again in this one.
                while self.reads and self.reads[0][0] >= self.at:
                    self.reads.popleft()[2].synchronize()
                self.at = 0
            lo, hi = self.at, self.at + n
            # Oldest first, the last round's slices from ``lo`` on: those that
            # overlap this one.
            while self.reads and self.reads[0][0] < hi and self.reads[0][0] >= lo:
                self.reads.popleft()[2].synchronize()
            self.host[lo:hi].numpy()[:] = values
            with torch.cuda.stream(stream):
                out = self.host[lo:hi].to(device, non_blocking=True)
                done = host_event()
                done.record(stream)
            self.reads.append((lo, hi, done))
            # Keep the ring's record short where the copies are done.
            while len(self.reads) > 64 and self.reads[0][2].query():
                self.reads.popleft()
            self.at = hi
            return out


_PINNED_IDS = _PinnedIds()


def ids_on_device(device: torch.device, values, stream: torch.cuda.Stream) -> torch.Tensor:
    """Block ids as an int64 tensor on ``device``, copied on ``stream``
    from pinned memory (a pageable host-to-device copy would wait for the
    compute stream, blocking the host): a slice of a ring pinned once, or,
    for more ids than half of it, memory pinned for this copy."""
    values = np.asarray(values, dtype=np.int64)
    if 0 < len(values) <= _PinnedIds.CAPACITY // 2:
        return _PINNED_IDS.upload(device, values, stream)
    host = torch.as_tensor(values).pin_memory()
    with torch.cuda.stream(stream):
        return host.to(device, non_blocking=True)


def payload_views(rows_words: torch.Tensor, word: int, payload_offset: int, segments: list[Segment]
                  ) -> list[torch.Tensor]:
    """Each segment's columns of ``[rows, row words]``, shaped
    ``[rows, *segment dims]`` like the segment's view of the cache."""
    views = []
    for segment in segments:
        col = (payload_offset + segment.offset) // word
        sizes = segment.inner_sizes[:-1] + [segment.inner_sizes[-1] // word]
        views.append(rows_words[:, col:col + segment.nbytes // word].unflatten(1, sizes))
    return views
