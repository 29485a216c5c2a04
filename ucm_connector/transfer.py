"""Whole-block copies between vLLM's paged KV caches and host rows.

``BlockTransfer`` gathers blocks out of the registered caches into host
rows, scatters them back, and hands back a ``Transfer`` for each copy it
issues.  It is made of parts that live beside it:

* ``pages.py``: where a layer's pages lie (``describe_layer``,
  ``LayerView``), the order of a stored block's payload, and the strided
  views that cover runs of layers;
* ``rows.py``: host rows (``RowPool``, ``HostRows``), allocated once and
  pinned on CUDA;
* ``staging.py``: the ring of device staging slots a CUDA copy moves
  through in chunks;
* ``layer_copies.py``: gathers and scatters made a layer at a time while
  the forward pass runs (``save_layerwise``, ``load_layerwise``;
  ``layer_gather`` and ``layer_scatter`` make them).

On CPU a copy is one fancy-indexed assignment per layer, over numpy views
of the caches.  On CUDA, an index kernel gathers a chunk's pages into a
staging slot while the copy engine moves the previous chunk over PCIe,
straight into or out of the pinned host rows.  Nothing here synchronises
the host with the compute stream: the side streams wait on it (a save sees
the kernels that just wrote its pages), and it waits on them through events
(the forward pass runs after the pages it reads are loaded, and does not
overwrite pages a save has not yet read).

This module and those parts know torch and tensor layouts; they know
nothing of stores, requests or the scheduler.  ``LayerView``,
``describe_layer``, ``HostRows`` and ``RowPool`` stay importable from here.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np
import torch

from .pages import LayerView, Segment, describe_layer, segment_layers
from .rows import HostRows, RowPool
from .staging import StagingRing, ids_on_device, payload_views, round_up

if TYPE_CHECKING:
    from .layer_copies import LayerGather, LayerScatter, LayerStaging

__all__ = ["BlockTransfer", "HostRows", "LayerView", "RowPool", "Transfer", "describe_layer"]

#: On CPU, pages of at least this many bytes are copied page by page
#: (benchmarks/worker_bench.py measures the two ways).
PAGE_BY_PAGE_MIN_NBYTES = 32 << 10


class Hasher(Protocol):
    """A streaming hash (``blockfmt.payload_hasher`` makes them)."""

    def update(self, data, /) -> None: ...

    def intdigest(self) -> int: ...


def _digest(hasher: Callable[[], Hasher], data: np.ndarray) -> int:
    h = hasher()
    h.update(data)
    return h.intdigest()


class Transfer:
    """An issued copy.  ``wait()`` blocks the calling host thread until the
    host rows are written (gather) or read (scatter); ``order_stream()``
    makes a CUDA stream (default: the caller's current one) wait, on the
    device, until the pages are written (scatter) or read (gather)."""

    def __init__(self, host_done: torch.cuda.Event | None = None,
                 device_done: torch.cuda.Event | None = None, checksums: list[int] | None = None) -> None:
        self._host_done = host_done
        self._device_done = device_done
        #: A gather's payload checksums, row by row, where they were taken
        #: during the copy (CPU, with a ``hasher``); None otherwise.
        self.checksums = checksums

    def done(self) -> bool:
        return self._host_done is None or self._host_done.query()

    def wait(self) -> None:
        if self._host_done is not None:
            self._host_done.synchronize()

    def synchronize(self) -> None:
        """Wait for everything: the rows and the pages."""
        self.wait()
        if self._device_done is not None:
            self._device_done.synchronize()

    def order_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        if self._device_done is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._device_done)


_DONE = Transfer()


class BlockTransfer:
    """Gathers blocks out of, and scatters them into, the registered caches.

    ``staging_nbytes`` bounds the device memory of each direction's staging
    ring on CUDA; ``merge_layers=False`` makes CUDA copies layer by layer
    (to measure what merging gains; CPU copies always are);
    ``page_by_page`` chooses how CPU copies go (default: by page size,
    ``PAGE_BY_PAGE_MIN_NBYTES``)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, *,
                 staging_nbytes: int = 128 << 20, merge_layers: bool = True, slots: int = 2,
                 page_by_page: bool | None = None) -> None:
        if not kv_caches:
            raise ValueError("no KV caches were registered")
        self.layers = [describe_layer(n, t, num_blocks) for n, t in kv_caches.items()]
        self.num_blocks = num_blocks
        self.device = self.layers[0].tensor.device
        self.payload_nbytes = sum(l.page_nbytes for l in self.layers)
        self._offsets = np.cumsum([0] + [l.page_nbytes for l in self.layers]).tolist()
        self._segments = segment_layers(self.layers, self._offsets, merge_layers)
        self._layer_segments = segment_layers(self.layers, self._offsets, merge=False)
        self._cuda = self.device.type == "cuda"
        self.staging_nbytes = staging_nbytes
        self._layer_views: dict[tuple[int, int], torch.Tensor] = {}
        if self._cuda:
            slot_nbytes = round_up(max(staging_nbytes // slots, 1), 256)
            self._gather_ring = StagingRing(self.device, slot_nbytes, slots)
            self._scatter_ring = StagingRing(self.device, slot_nbytes, slots)
            self._views: dict[tuple[int, int], torch.Tensor] = {}
            self._own_pool: RowPool | None = None
            self._own_pool_lock = threading.Lock()
            self._layer_staging: dict[str, LayerStaging] = {}
        else:
            # uint8 numpy views of each layer's pages: [num_blocks, *dims].
            # Layer by layer even where one view could cover all layers: a
            # layer's pages stay in the CPU's caches between the gather and
            # the copy into the rows, and one merged fancy index measured
            # at half the speed on the 2-core machines (benchmarks/RESULTS.md).
            self._np_views = [s.view(num_blocks).numpy() for s in self._layer_segments]
            # Large pages move page by page: a copy each, straight between
            # page and row (one fancy index per layer copies twice, through
            # a temporary); small ones by one fancy index per layer, whose
            # per-call cost is paid once per batch, not once per page.
            self._page_by_page = (min(s.nbytes for s in self._layer_segments) >= PAGE_BY_PAGE_MIN_NBYTES
                                  if page_by_page is None else page_by_page)
            # Each layer's pages as [num_blocks, page bytes], where every
            # page is one contiguous run (vLLM's CPU caches): a store can
            # then read a block straight into its pages.
            self._flat_views = None
            if all(view[0].flags.c_contiguous for view in self._np_views):
                self._flat_views = [np.lib.stride_tricks.as_strided(view, (num_blocks, view[0].nbytes),
                                                                    (view.strides[0], 1))
                                    for view in self._np_views]

    # Kernels of a CUDA copy: the index kernels read and write the strided
    # staging views directly; False goes through a contiguous temporary
    # (benchmarks/gpu_bench.py measures both).
    _gather_in_place = True
    _scatter_in_place = True

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_segments(self) -> int:
        """Index operations per copied chunk on CUDA (1 for a cache of vLLM's
        ``KVCacheLayout`` views)."""
        return len(self._segments)

    def row_pool(self, row_nbytes: int, payload_offset: int, max_nbytes: int, prefault: bool = True) -> RowPool:
        """Host rows for this cache's blocks, pinned on CUDA: at most
        ``max_nbytes`` (at least one row), allocated now, once.  On CPU,
        ``prefault=False`` leaves the pages to be mapped by their first use
        (a pool sized for a worst case costs no memory until it is used)."""
        return RowPool(row_nbytes, payload_offset, self.payload_nbytes, max_nbytes, pinned=self._cuda,
                       prefault=prefault)

    @property
    def on_cuda(self) -> bool:
        return self._cuda

    def bind_thread(self) -> None:
        """Make the calling thread's current CUDA device the caches' one.  A
        new thread's is device 0: its first CUDA call (an event wait, a
        copy) would otherwise open a context on GPU 0, which another rank
        has filled (tensor parallelism)."""
        if self._cuda:
            torch.cuda.set_device(self.device)

    @property
    def pages_contiguous(self) -> bool:
        """On CPU, every page is one contiguous run of bytes: ``page_parts``
        can be handed to a store to read a block straight into its pages."""
        return not self._cuda and self._flat_views is not None

    def page_parts(self, block_id: int) -> list[memoryview]:
        """Writable byte views of a block's pages, in payload order (CPU,
        where ``pages_contiguous``)."""
        return [memoryview(flat[block_id]) for flat in self._flat_views]

    # -- copies through host rows -------------------------------------------

    def gather_rows(self, block_ids: Sequence[int], rows: HostRows, hasher: Callable[[], Hasher] | None = None
                    ) -> Transfer:
        """Copy the pages of ``block_ids`` into the payloads of ``rows``
        (row i for block i).  The bytes around the payloads (a header) are
        left unspecified: on CUDA whole rows move in one DMA, so write
        headers after ``wait()``.  On CUDA it returns once the copy is
        issued: ``wait()`` before reading the rows; the caller's stream
        already waits for the reads of the pages, so kernels queued later
        may overwrite them.  On CPU, ``hasher`` (a factory of streaming
        hashes) checksums each payload as it is copied, while its bytes are
        in the CPU's caches: the result's ``checksums``."""
        if len(block_ids) > rows.count:
            raise ValueError(f"{len(block_ids)} blocks do not fit in {rows.count} rows")
        if not self._cuda:
            checksums = self.gather(block_ids, rows.payload, hasher)
            return _DONE if checksums is None else Transfer(checksums=checksums)
        return self._gather_cuda(block_ids, rows)

    def scatter_rows(self, block_ids: Sequence[int], rows: HostRows,
                     row_ids: Sequence[int] | None = None,
                     after: torch.cuda.Stream | None = None, ordered: bool = True) -> Transfer:
        """Copy the payload of row ``row_ids[i]`` (default: row i) into the
        pages of ``block_ids[i]``.  On CUDA it returns once issued: the
        copies start after the work already queued on ``after`` (default:
        the caller's current stream), and that stream waits for them to
        finish (``ordered=False``: it does not; for a caller that waits on
        the host with ``synchronize()`` before any kernel reads the
        pages); a forward pass queued on another stream needs
        ``order_stream``.  The rows may be reused after ``wait()`` (or
        ``rows.release(after=transfer)``)."""
        if row_ids is not None and len(row_ids) != len(block_ids):
            raise ValueError("row_ids and block_ids differ in length")
        if not block_ids:
            return _DONE
        if not self._cuda:
            self.scatter(block_ids, rows.payload, row_ids=row_ids)
            return _DONE
        return self._scatter_cuda(block_ids, rows, row_ids, after, ordered)

    # -- copies through caller buffers --------------------------------------

    def gather(self, block_ids: Sequence[int], out: np.ndarray, hasher: Callable[[], Hasher] | None = None
               ) -> list[int] | None:
        """Copy the pages of ``block_ids`` into ``out[i, :payload_nbytes]``
        (``out`` is ``[len(block_ids), >= payload_nbytes]`` uint8).  On CPU,
        with ``hasher``, returns each payload's checksum (None otherwise)."""
        if self._cuda:
            self._through_own_rows(block_ids, out, gather=True)
            return None
        if self._page_by_page:
            return self._gather_pages(block_ids, out, hasher)
        ids = np.asarray(block_ids, dtype=np.int64)
        for layer in range(len(self.layers)):
            self.gather_layer(layer, ids, out)
        if hasher is None:
            return None
        return [_digest(hasher, out[i, :self.payload_nbytes]) for i in range(len(ids))]

    def gather_layer(self, layer: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        """CPU: copy one layer's pages of ``block_ids`` into that layer's
        columns of ``out[i, :payload_nbytes]``; the other columns are left
        as they are."""
        segment, view = self._layer_segments[layer], self._np_views[layer]
        lo, nbytes = segment.offset, segment.nbytes
        if self._page_by_page:
            for row, block in zip(out, block_ids):
                np.copyto(row[lo:lo + nbytes].reshape(view.shape[1:]), view[block])
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        out[:len(ids), lo:lo + nbytes] = view[ids].reshape(len(ids), nbytes)

    def layer_gather(self, block_ids: Sequence[int], rows: HostRows) -> "LayerGather":
        """A gather of ``block_ids`` into ``rows`` (row i for block i), made
        one layer at a time as each layer's pages are written
        (``LayerGather``)."""
        from .layer_copies import LayerGather

        if len(block_ids) > rows.count:
            raise ValueError(f"{len(block_ids)} blocks do not fit in {rows.count} rows")
        return LayerGather(self, block_ids, rows)

    def layer_scatter(self, block_ids: Sequence[int], rows: HostRows, row_ids: Sequence[int] | None = None,
                      after: torch.cuda.Stream | None = None) -> "LayerScatter":
        """A scatter of row ``row_ids[i]`` (default: row i) into the pages
        of ``block_ids[i]``, made one layer at a time (``LayerScatter``)."""
        from .layer_copies import LayerScatter

        return LayerScatter(self, block_ids, rows, row_ids, after)

    @property
    def can_copy_by_layer(self) -> bool:
        """Whether ``layer_gather`` and ``layer_scatter`` work here: on CUDA
        they need the runtime's pitched copies, tried once on the device."""
        if not self._cuda:
            return True
        from . import cudart

        return cudart.pitched_copies_work(self.device)

    def layer_segment(self, layer: int) -> Segment:
        """Where one layer's pages lie, and its columns in a payload."""
        return self._layer_segments[layer]

    def layer_source(self, layer: int, word: int) -> torch.Tensor:
        """One layer's pages as ``[num_blocks, *page dims]`` of ``word``-byte
        elements, a strided view of the cache (built once; the CUDA layer
        copies index it)."""
        view = self._layer_views.get((layer, word))
        if view is None:
            view = self._layer_views[(layer, word)] = self._layer_segments[layer].view(self.num_blocks, word)
        return view

    def reserve_staging(self, row_nbytes: int, gather: bool = True, scatter: bool = True) -> int:
        """CUDA: the staging slots of the directions asked for allocated
        now, for rows of ``row_nbytes``; the device bytes they take (0 on
        CPU).  Raises ``torch.OutOfMemoryError`` where there is no room: the
        copies then try again when they first need the slots."""
        if not self._cuda:
            return 0
        rings = [ring for ring, wanted in ((self._gather_ring, gather), (self._scatter_ring, scatter)) if wanted]
        return sum(ring.reserve(row_nbytes) for ring in rings)

    def release_staging(self) -> int:
        """CUDA: wait for every copy queued on this transfer's side streams,
        then give the staging slots back to the device (sleep mode); the
        next copies allocate them again.  The device bytes released (0 on
        CPU)."""
        if not self._cuda:
            return 0
        released = sum(ring.release() for ring in (self._gather_ring, self._scatter_ring))
        released += sum(staging.release() for staging in self._layer_staging.values())
        torch.cuda.empty_cache()
        return released

    def layer_staging(self, direction: str) -> "LayerStaging":
        """The side stream and device slot of this transfer's layer copies
        in one direction, ``"gather"`` or ``"scatter"`` (CUDA; made on
        first use)."""
        from .layer_copies import LayerStaging

        with self._own_pool_lock:
            staging = self._layer_staging.get(direction)
            if staging is None:
                staging = self._layer_staging[direction] = LayerStaging(self.device)
            return staging

    def scatter(self, block_ids: Sequence[int], src: np.ndarray, layers: range | None = None,
                row_ids: Sequence[int] | None = None) -> None:
        """Copy ``src[row_ids[i], :payload_nbytes]`` (default: row i) into
        the pages of ``block_ids[i]``; with ``layers``, only those layers'
        pages (on CUDA every layer is copied by the first call of a block
        set: its upload is one copy).  Done when it returns."""
        if self._cuda:
            if layers is None or layers.start == 0:
                if row_ids is not None:
                    src = src[np.asarray(row_ids)]
                self._through_own_rows(block_ids, src, gather=False)
            return
        layer_ids = range(len(self.layers)) if layers is None else layers
        rows = range(len(block_ids)) if row_ids is None else row_ids
        if self._page_by_page:
            for row, block in zip(rows, block_ids):
                for i in layer_ids:
                    segment, view = self._layer_segments[i], self._np_views[i]
                    lo = segment.offset
                    np.copyto(view[block], src[row, lo:lo + segment.nbytes].reshape(view.shape[1:]))
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        picked = slice(0, len(ids)) if row_ids is None else np.asarray(row_ids, dtype=np.int64)
        for i in layer_ids:
            segment, view = self._layer_segments[i], self._np_views[i]
            lo = segment.offset
            view[ids] = src[picked, lo:lo + segment.nbytes].reshape((len(ids),) + view.shape[1:])

    def _gather_pages(self, block_ids: Sequence[int], out: np.ndarray, hasher: Callable[[], Hasher] | None
                      ) -> list[int] | None:
        """A gather page by page: each page is copied once, straight into
        its row, and hashed while it is still in the CPU's caches."""
        checksums = [] if hasher is not None else None
        for j, block in enumerate(block_ids):
            row = out[j]
            h = hasher() if hasher is not None else None
            for segment, view in zip(self._layer_segments, self._np_views):
                lo = segment.offset
                part = row[lo:lo + segment.nbytes]
                np.copyto(part.reshape(view.shape[1:]), view[block])
                if h is not None:
                    h.update(part)
            if h is not None:
                checksums.append(h.intdigest())
        return checksums

    # -- CUDA ----------------------------------------------------------------

    def _through_own_rows(self, block_ids: Sequence[int], buf: np.ndarray, gather: bool) -> None:
        """The copy-at-return API over pageable numpy buffers: through a
        pinned pool of this transfer's own (one host memcpy more than the
        row API)."""
        with self._own_pool_lock:
            if self._own_pool is None:
                self._own_pool = self.row_pool(self.payload_nbytes, 0, 256 << 20)
            pool = self._own_pool
            step = pool.capacity
            for lo in range(0, len(block_ids), step):
                ids = list(block_ids[lo:lo + step])
                rows = pool.take(len(ids))
                try:
                    if gather:
                        self.gather_rows(ids, rows).wait()
                        buf[lo:lo + len(ids), :self.payload_nbytes] = rows.payload[:len(ids)]
                    else:
                        rows.payload[:len(ids)] = buf[lo:lo + len(ids), :self.payload_nbytes]
                        self.scatter_rows(ids, rows).synchronize()
                finally:
                    rows.release()

    def _word(self, pool: RowPool) -> int:
        values = [pool.row_nbytes] + [pool.payload_offset + s.offset for s in self._segments]
        values += [s.align for s in self._segments]
        return next(w for w in (8, 4, 2, 1) if all(v % w == 0 for v in values))

    def _segment_views(self, word: int) -> list[torch.Tensor]:
        views = self._views.get(word)
        if views is None:
            views = self._views[word] = [s.view(self.num_blocks, word) for s in self._segments]
        return views

    def _gather_cuda(self, block_ids: Sequence[int], rows: HostRows) -> Transfer:
        pool = rows.pool
        n = len(block_ids)
        if n == 0:
            return _DONE
        ring = self._gather_ring
        compute = torch.cuda.current_stream(self.device)
        with ring.lock:
            ring.fit(pool.row_nbytes)
            word = self._word(pool)
            sources = self._segment_views(word)
            per_slot = ring.rows_per_slot(pool.row_nbytes)
            ids = ids_on_device(self.device, block_ids, ring.kernel_stream)
            # The pages were just written by kernels on the compute stream.
            ring.kernel_stream.wait_stream(compute)
            starts = range(0, n, per_slot)
            with ring.issuing(len(starts)):
                for chunk, lo in enumerate(starts):
                    hi = min(n, lo + per_slot)
                    k = ring.slot(chunk)
                    as_bytes, as_words, outs = ring.chunk(k, hi - lo, word, pool, self._segments)
                    if ring.used[k]:
                        ring.kernel_stream.wait_event(ring.drained[k])
                    chunk_ids = ids[lo:hi]
                    with torch.cuda.stream(ring.kernel_stream):
                        for source, out in zip(sources, outs):
                            if self._gather_in_place:
                                torch.index_select(source, 0, chunk_ids, out=out)
                            else:
                                out.copy_(source.index_select(0, chunk_ids))
                        ring.filled[k].record(ring.kernel_stream)
                    ring.copy_stream.wait_event(ring.filled[k])
                    with torch.cuda.stream(ring.copy_stream):
                        rows.tensor[lo:hi].copy_(as_bytes, non_blocking=True)
                        ring.drained[k].record(ring.copy_stream)
                    ring.used[k] = True
            host_done, pages_read = ring.issued()
        # Kernels queued after this may overwrite the pages: not before the
        # gather has read them (the host does not wait).
        compute.wait_event(pages_read)
        return Transfer(host_done, pages_read)

    def _scatter_cuda(self, block_ids: Sequence[int], rows: HostRows, row_ids: Sequence[int] | None,
                      after: torch.cuda.Stream | None, ordered: bool = True) -> Transfer:
        pool = rows.pool
        ring = self._scatter_ring
        compute = after or torch.cuda.current_stream(self.device)
        n_rows = len(block_ids) if row_ids is None else max(row_ids) + 1
        with ring.lock:
            ring.fit(pool.row_nbytes)
            word = self._word(pool)
            targets_views = self._segment_views(word)
            per_slot = ring.rows_per_slot(pool.row_nbytes)
            # Per chunk of rows: the blocks its rows go to, and (when some
            # rows are skipped) where in the chunk those rows are.
            order = np.arange(len(block_ids)) if row_ids is None else np.asarray(row_ids, dtype=np.int64)
            targets = np.asarray(block_ids, dtype=np.int64)
            chunks = []
            for lo in range(0, n_rows, per_slot):
                hi = min(n_rows, lo + per_slot)
                pick = np.nonzero((order >= lo) & (order < hi))[0]
                if len(pick):
                    whole = len(pick) == hi - lo and np.array_equal(order[pick], np.arange(lo, hi))
                    chunks.append((lo, hi, targets[pick], None if whole else order[pick] - lo))
            ids = ids_on_device(self.device,
                                np.concatenate([c[2] for c in chunks] + [c[3] for c in chunks if c[3] is not None]),
                                ring.kernel_stream)
            # Pages of freed blocks may still be read by queued kernels.
            ring.kernel_stream.wait_stream(compute)
            start, cursor = 0, sum(len(c[2]) for c in chunks)
            # A failure half-way waits for the chunks already issued: they
            # still read the host rows, which the caller then gives back.
            with ring.issuing(len(chunks)):
                for chunk, (lo, hi, dst, pos) in enumerate(chunks):
                    k = ring.slot(chunk)
                    as_bytes, as_words, srcs = ring.chunk(k, hi - lo, word, pool, self._segments)
                    if ring.used[k]:
                        ring.copy_stream.wait_event(ring.drained[k])
                    with torch.cuda.stream(ring.copy_stream):
                        as_bytes.copy_(rows.tensor[lo:hi], non_blocking=True)
                        ring.filled[k].record(ring.copy_stream)
                    ring.kernel_stream.wait_event(ring.filled[k])
                    dst_ids = ids[start:start + len(dst)]
                    start += len(dst)
                    with torch.cuda.stream(ring.kernel_stream):
                        if pos is not None:   # only some rows passed their checks
                            picked = as_words.index_select(0, ids[cursor:cursor + len(pos)])
                            cursor += len(pos)
                            srcs = payload_views(picked, word, pool.payload_offset, self._segments)
                        for target, src in zip(targets_views, srcs):
                            if self._scatter_in_place:
                                target.index_copy_(0, dst_ids, src)
                            else:
                                target[dst_ids] = src.contiguous()
                        ring.drained[k].record(ring.kernel_stream)
                    ring.used[k] = True
            host_done, pages_written = ring.issued()
        if ordered:
            compute.wait_event(pages_written)
        return Transfer(host_done, pages_written)
