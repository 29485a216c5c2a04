"""Whole-block copies between vLLM's paged KV caches and host rows.

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
layers that share a backing buffer at a constant distance are copied as one
strided view, so a default vLLM cache moves with one index operation per
batch, not one per layer.

On CPU a copy is one fancy-indexed assignment per such view, over numpy
views of the caches.  On CUDA, a batch moves in chunks through a small ring
of device staging buffers: an index kernel gathers a chunk's pages into a
staging slot (rows laid out exactly like the host rows) while the copy
engine moves the previous chunk over PCIe, straight into or out of pinned
host rows; so a batch costs one pass of the PCIe link plus one chunk's
gather.  Host rows come from a ``RowPool`` (pinned once, reused), so the
store reads into and writes from the very memory the DMA uses.  Nothing
here synchronises the host with the compute stream: the side streams wait
on it (a save sees the kernels that just wrote its pages), and it waits on
them through events (the forward pass runs after the pages it reads are
loaded, and does not overwrite pages a save has not yet read).

This module knows torch and tensor layouts; it knows nothing of stores,
requests or the scheduler.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import numpy as np
import torch

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


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
class _Segment:
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
        flat = torch.empty(0, dtype=_WORDS[word], device=self.storage_of.device)
        flat.set_(storage, 0, (storage.nbytes() // word,), (1,))
        sizes = [num_blocks] + [n for n, _ in self.dims[:-1]] + [self.dims[-1][0] // word]
        strides = [self.block_stride // word] + [s // word for _, s in self.dims[:-1]] + [1]
        return flat.as_strided(sizes, strides, self.base // word)

    @property
    def inner_sizes(self) -> list[int]:
        return [n for n, _ in self.dims]


def _segments(layers: list[LayerView], offsets: list[int], merge: bool) -> list[_Segment]:
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
        segments.append(_Segment(group[0], len(group), first.tensor, first.base, first.block_stride,
                                 _merge_dims(dims), offsets[group[0]], first.page_nbytes * len(group)))
    return segments


# -- host rows ---------------------------------------------------------------


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call made outside
    torch, which would otherwise surface at torch's next launch check."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _unregister(address: int, keep_alive: object) -> None:
    # keep_alive is the mapping itself: unmapped before it is unregistered,
    # its range would stay registered and a later mapping there would fail.
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:
        pass


def _pinned_memory(owner: object, nbytes: int) -> tuple[np.ndarray, torch.Tensor, object]:
    """Page-locked host memory of exactly ``nbytes`` (torch's pinned
    allocator rounds every request up to a power of two): fresh anonymous
    pages registered with CUDA, unregistered when ``owner`` is collected;
    torch's pinned memory where registration fails.  Returns the memory as
    numpy and torch, and the unregistering finalizer (None for torch's)."""
    import mmap
    import weakref

    mapping = mmap.mmap(-1, max(nbytes, 1))
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = array.ctypes.data
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(address, array.nbytes, 0))
    except Exception:
        rc = -1
    if rc == 0:
        return array, torch.from_numpy(array), weakref.finalize(owner, _unregister, address, mapping)
    _clear_cuda_error()
    del array
    try:
        mapping.close()
    except BufferError:
        pass
    tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
    return tensor.numpy(), tensor, None


class HostRows:
    """Rows taken from a ``RowPool``: ``rows`` is ``[n, row_nbytes]`` uint8,
    a numpy view of the pool's (pinned, on CUDA) memory; each row holds a
    block's payload at the pool's ``payload_offset``.  Give them back with
    ``release`` (``after``: once that transfer no longer needs them)."""

    def __init__(self, pool: "RowPool", start: int, count: int) -> None:
        self.pool = pool
        self.start = start
        self.count = count
        self.rows = pool._array[start:start + count]
        self.tensor = pool._tensor[start:start + count]
        self._released = False

    @property
    def payload(self) -> np.ndarray:
        lo = self.pool.payload_offset
        return self.rows[:, lo:lo + self.pool.payload_nbytes]

    def release(self, after: "Transfer | None" = None) -> None:
        if not self._released:
            self._released = True
            self.pool._give_back(self, after)


class RowPool:
    """Host rows for whole blocks, allocated once (pinned on CUDA) and lent
    out again and again: at most ``max_nbytes`` of them.  Thread-safe."""

    def __init__(self, row_nbytes: int, payload_offset: int, payload_nbytes: int, max_nbytes: int,
                 pinned: bool, prefault: bool = True) -> None:
        if payload_offset + payload_nbytes > row_nbytes:
            raise ValueError(f"rows of {row_nbytes} bytes cannot hold {payload_nbytes} bytes of payload at "
                             f"offset {payload_offset}")
        self.row_nbytes = row_nbytes
        self.payload_offset = payload_offset
        self.payload_nbytes = payload_nbytes
        self.capacity = max(1, max_nbytes // row_nbytes)
        nbytes = self.capacity * row_nbytes
        self._unregister = None
        if pinned:
            flat, tensor, self._unregister = _pinned_memory(self, nbytes)
        else:
            flat = np.empty(nbytes, dtype=np.uint8)
            if prefault:
                flat.fill(0)  # fault the pages in now, not during the first copy
            tensor = torch.from_numpy(flat)
        self._array = flat[:nbytes].reshape(self.capacity, row_nbytes)
        self._tensor = tensor[:nbytes].view(self.capacity, row_nbytes)
        self.pinned = pinned
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]   # (start, count), sorted
        self._pending: list[tuple[HostRows, Transfer]] = []

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_nbytes

    def take(self, count: int, wait: bool = True, timeout: float | None = None) -> HostRows | None:
        """``count`` consecutive rows, or None when they cannot be had: more
        than the pool holds (take at most ``capacity`` at a time), or, with
        ``wait=False`` or a ``timeout``, none free in time.  Waiting may
        mean waiting for a copy that still holds rows given back to the pool."""
        if count < 1 or count > self.capacity:
            return None
        with self._cond:
            while True:
                self._reap(block=False)
                start = self._fit(count)
                if start is not None:
                    return HostRows(self, start, count)
                if not wait:
                    return None
                if self._pending:
                    self._reap(block=True)
                    continue
                if not self._cond.wait(timeout):
                    return None

    def _fit(self, count: int) -> int | None:
        for i, (start, n) in enumerate(self._free):
            if n >= count:
                if n == count:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + count, n - count)
                return start
        return None

    def _reap(self, block: bool) -> None:
        """Free the rows whose copies are done (``block``: wait for the oldest)."""
        pending, self._pending, still = self._pending, [], []
        for i, (rows, transfer) in enumerate(pending):
            if block and i == 0:
                self._cond.release()
                try:
                    transfer.wait()
                finally:
                    self._cond.acquire()
            if transfer.done():
                self._free_rows(rows)
            else:
                still.append((rows, transfer))
        self._pending = still + self._pending   # those given back while we waited

    def _free_rows(self, rows: HostRows) -> None:
        self._free.append((rows.start, rows.count))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged

    def _give_back(self, rows: HostRows, after: "Transfer | None") -> None:
        with self._cond:
            if after is not None and not after.done():
                self._pending.append((rows, after))
            else:
                self._free_rows(rows)
            self._cond.notify_all()

    @property
    def registered(self) -> bool:
        """Whether the rows are memory of ours registered with CUDA (else
        torch's pinned memory, or plain memory on CPU)."""
        return self._unregister is not None and self._unregister.alive

    def close(self) -> None:
        """Unpin now rather than when the pool is collected; rows lent out
        stay readable, as plain memory."""
        if self._unregister is not None:
            self._unregister()


class Transfer:
    """An issued copy.  ``wait()`` blocks the calling host thread until the
    host rows are written (gather) or read (scatter); ``order_stream()``
    makes a CUDA stream (default: the caller's current one) wait, on the
    device, until the pages are written (scatter) or read (gather)."""

    def __init__(self, host_done: torch.cuda.Event | None = None,
                 device_done: torch.cuda.Event | None = None) -> None:
        self._host_done = host_done
        self._device_done = device_done

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


class _Ring:
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
        self.lock = threading.Lock()
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}

    def fit(self, row_nbytes: int) -> None:
        if self.slot_nbytes < row_nbytes:   # a block larger than a slot: one block per slot
            self.slot_nbytes = _round_up(row_nbytes, 256)
            self.buffer = None
            self._views.clear()

    def rows_per_slot(self, row_nbytes: int) -> int:
        return max(1, self.slot_nbytes // row_nbytes)

    def chunk(self, k: int, rows: int, word: int, pool: "RowPool", segments: list[_Segment]
              ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Slot ``k`` holding ``rows`` host rows: as bytes (for the DMA), as
        words, and each segment's payload columns shaped like its view."""
        key = (k, rows, word, pool.row_nbytes, pool.payload_offset)
        views = self._views.get(key)
        if views is None:
            if self.buffer is None:
                self.buffer = torch.empty(self.slot_nbytes * self.slots, dtype=torch.uint8, device=self.device)
            lo = k * self.slot_nbytes
            as_bytes = self.buffer[lo:lo + rows * pool.row_nbytes].view(rows, pool.row_nbytes)
            as_words = as_bytes.view(_WORDS[word])
            views = (as_bytes, as_words, _payload_views(as_words, word, pool.payload_offset, segments))
            if len(self._views) >= 64:    # odd last-chunk sizes: keep it bounded
                self._views.clear()
            self._views[key] = views
        return views


def _payload_views(rows_words: torch.Tensor, word: int, payload_offset: int, segments: list[_Segment]
                   ) -> list[torch.Tensor]:
    """Each segment's columns of ``[rows, row words]``, shaped
    ``[rows, *segment dims]`` like the segment's view of the cache."""
    views = []
    for segment in segments:
        col = (payload_offset + segment.offset) // word
        sizes = segment.inner_sizes[:-1] + [segment.inner_sizes[-1] // word]
        views.append(rows_words[:, col:col + segment.nbytes // word].unflatten(1, sizes))
    return views


class BlockTransfer:
    """Gathers blocks out of, and scatters them into, the registered caches.

    ``staging_nbytes`` bounds the device memory of each direction's staging
    ring on CUDA; ``merge_layers=False`` makes CUDA copies layer by layer
    (to measure what merging gains; CPU copies always are)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, *,
                 staging_nbytes: int = 128 << 20, merge_layers: bool = True, slots: int = 2) -> None:
        if not kv_caches:
            raise ValueError("no KV caches were registered")
        self.layers = [describe_layer(n, t, num_blocks) for n, t in kv_caches.items()]
        self.num_blocks = num_blocks
        self.device = self.layers[0].tensor.device
        self.payload_nbytes = sum(l.page_nbytes for l in self.layers)
        self._offsets = np.cumsum([0] + [l.page_nbytes for l in self.layers]).tolist()
        self._segments = _segments(self.layers, self._offsets, merge_layers)
        self._layer_segments = _segments(self.layers, self._offsets, merge=False)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            slot_nbytes = _round_up(max(staging_nbytes // slots, 1), 256)
            self._gather_ring = _Ring(self.device, slot_nbytes, slots)
            self._scatter_ring = _Ring(self.device, slot_nbytes, slots)
            self._views: dict[tuple[int, int], torch.Tensor] = {}
            self._own_pool: RowPool | None = None
            self._own_pool_lock = threading.Lock()
        else:
            # uint8 numpy views of each layer's pages: [num_blocks, *dims].
            # Layer by layer even where one view could cover all layers: a
            # layer's pages stay in the CPU's caches between the gather and
            # the copy into the rows, and one merged fancy index measured
            # at half the speed on the 2-core machines (benchmarks/RESULTS.md).
            self._np_views = [s.view(num_blocks).numpy() for s in self._layer_segments]

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

    # -- copies through host rows -------------------------------------------

    def gather_rows(self, block_ids: Sequence[int], rows: HostRows) -> Transfer:
        """Copy the pages of ``block_ids`` into the payloads of ``rows``
        (row i for block i).  The bytes around the payloads (a header) are
        left unspecified: on CUDA whole rows move in one DMA, so write
        headers after ``wait()``.  On CUDA it returns once the copy is
        issued: ``wait()`` before reading the rows; the caller's stream
        already waits for the reads of the pages, so kernels queued later
        may overwrite them."""
        if len(block_ids) > rows.count:
            raise ValueError(f"{len(block_ids)} blocks do not fit in {rows.count} rows")
        if not self._cuda:
            self.gather(block_ids, rows.payload)
            return _DONE
        return self._gather_cuda(block_ids, rows)

    def scatter_rows(self, block_ids: Sequence[int], rows: HostRows,
                     row_ids: Sequence[int] | None = None,
                     after: torch.cuda.Stream | None = None) -> Transfer:
        """Copy the payload of row ``row_ids[i]`` (default: row i) into the
        pages of ``block_ids[i]``.  On CUDA it returns once issued: the
        copies start after the work already queued on ``after`` (default:
        the caller's current stream), and that stream waits for them to
        finish; a forward pass queued on another stream needs
        ``order_stream``.  The rows may be reused after ``wait()`` (or
        ``rows.release(after=transfer)``)."""
        if row_ids is not None and len(row_ids) != len(block_ids):
            raise ValueError("row_ids and block_ids differ in length")
        if not block_ids:
            return _DONE
        if not self._cuda:
            payload = rows.payload
            self.scatter(block_ids, payload if row_ids is None else payload[np.asarray(row_ids)])
            return _DONE
        return self._scatter_cuda(block_ids, rows, row_ids, after)

    # -- copies through caller buffers --------------------------------------

    def gather(self, block_ids: Sequence[int], out: np.ndarray) -> None:
        """Copy the pages of ``block_ids`` into ``out[i, :payload_nbytes]``
        (``out`` is ``[len(block_ids), >= payload_nbytes]`` uint8)."""
        if self._cuda:
            self._through_own_rows(block_ids, out, gather=True)
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        n = len(ids)
        for segment, view in zip(self._layer_segments, self._np_views):
            lo = segment.offset
            out[:, lo:lo + segment.nbytes] = view[ids].reshape(n, segment.nbytes)

    def scatter(self, block_ids: Sequence[int], src: np.ndarray, layers: range | None = None) -> None:
        """Copy ``src[i, :payload_nbytes]`` into the pages of ``block_ids``;
        with ``layers``, only those layers' pages (on CUDA every layer is
        copied by the first call of a block set: its upload is one copy).
        Done when it returns."""
        if self._cuda:
            if layers is None or layers.start == 0:
                self._through_own_rows(block_ids, src, gather=False)
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        n = len(ids)
        for i in range(len(self.layers)) if layers is None else layers:
            segment, view = self._layer_segments[i], self._np_views[i]
            lo = segment.offset
            view[ids] = src[:, lo:lo + segment.nbytes].reshape((n,) + view.shape[1:])

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

    def _ids_on_device(self, values: Sequence[int], stream: torch.cuda.Stream) -> torch.Tensor:
        # Pinned, then copied on our own stream: a pageable host-to-device
        # copy would wait for the compute stream, blocking the host.
        host = torch.as_tensor(np.asarray(values, dtype=np.int64)).pin_memory()
        with torch.cuda.stream(stream):
            return host.to(self.device, non_blocking=True)

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
            ids = self._ids_on_device(block_ids, ring.kernel_stream)
            # The pages were just written by kernels on the compute stream.
            ring.kernel_stream.wait_stream(compute)
            for chunk, lo in enumerate(range(0, n, per_slot)):
                hi = min(n, lo + per_slot)
                k = chunk % ring.slots
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
            pages_read = torch.cuda.Event()
            pages_read.record(ring.kernel_stream)
            host_done = torch.cuda.Event()
            host_done.record(ring.copy_stream)
        # Kernels queued after this may overwrite the pages: not before the
        # gather has read them (the host does not wait).
        compute.wait_event(pages_read)
        return Transfer(host_done, pages_read)

    def _scatter_cuda(self, block_ids: Sequence[int], rows: HostRows, row_ids: Sequence[int] | None,
                      after: torch.cuda.Stream | None) -> Transfer:
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
            ids = self._ids_on_device(np.concatenate([c[2] for c in chunks] + [c[3] for c in chunks
                                                                                 if c[3] is not None]),
                                      ring.kernel_stream)
            # Pages of freed blocks may still be read by queued kernels.
            ring.kernel_stream.wait_stream(compute)
            start, cursor = 0, sum(len(c[2]) for c in chunks)
            for chunk, (lo, hi, dst, pos) in enumerate(chunks):
                k = chunk % ring.slots
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
                        srcs = _payload_views(picked, word, pool.payload_offset, self._segments)
                    for target, src in zip(targets_views, srcs):
                        if self._scatter_in_place:
                            target.index_copy_(0, dst_ids, src)
                        else:
                            target[dst_ids] = src.contiguous()
                    ring.drained[k].record(ring.kernel_stream)
                ring.used[k] = True
            host_done = torch.cuda.Event()
            host_done.record(ring.copy_stream)
            pages_written = torch.cuda.Event()
            pages_written.record(ring.kernel_stream)
        compute.wait_event(pages_written)
        return Transfer(host_done, pages_written)
