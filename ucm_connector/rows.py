"""Host rows: the whole-block buffers that the store and the copies share.

A ``RowPool`` is allocated once (page-locked on CUDA: fresh pages registered
with the driver, or torch's pinned memory) and lends runs of consecutive
rows (``HostRows``) again and again, so the store reads into and writes from
the very memory the copy engine's DMA uses.  Rows given back while a copy
still uses them (``release(after=transfer)``) stay out of the pool until
that copy is done.

This module owns host memory and its pinning; it must not copy pages, nor
know cache layouts (``pages.py``), CUDA streams (``staging.py``) or stores.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import cudart

if TYPE_CHECKING:
    from .transfer import Transfer


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
    torch's pinned memory where registration fails or the CUDA runtime
    library cannot be loaded.  Returns the memory as
    numpy and torch, and the unregistering finalizer (None for torch's)."""
    import mmap
    import weakref

    if not cudart.available():
        # A failed registration leaves its error in the runtime's last-error
        # slot, to surface at the next kernel launch; without the library
        # nothing could clear it, so nothing is registered.
        tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return tensor.numpy(), tensor, None
    mapping = mmap.mmap(-1, max(nbytes, 1))
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = array.ctypes.data
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(address, array.nbytes, 0))
    except Exception:
        rc = -1
    if rc == 0:
        return array, torch.from_numpy(array), weakref.finalize(owner, _unregister, address, mapping)
    cudart.clear_last_error()
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
        """Unpin now rather than when the pool is collected, once the copies
        still reading or writing rows given back are done; rows lent out
        stay readable, as plain memory."""
        with self._cond:
            pending, self._pending = self._pending, []
        for rows, transfer in pending:
            transfer.wait()
            self._give_back(rows, None)
        if self._unregister is not None:
            self._unregister()
