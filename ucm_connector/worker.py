"""Worker role: move whole blocks between the paged KV cache and the store.

Loads run when the step starts (``start_load_kv``): one batched ``get_into``
into a reusable buffer, every block's envelope and checksum checked, good
blocks scattered into their pages, bad ones reported through
``load_errors`` so vLLM recomputes them.  Saves are gathered when the step's
forward pass is done (``wait_for_save``): blocks the store already has are
skipped, the rest are copied out of the cache at once (so their pages can be
reused immediately) and written by a background thread, so the engine never
waits on the store's I/O.  A full backlog skips saves rather than waiting.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from store_backends import KVStore, StoreError

from . import blockfmt
from .hashing import keys_for_rank
from .metrics import StatsCollector
from .scheduler import BlockPlan
from .transfer import BlockTransfer

# Under "vllm." so that vLLM's log handlers and format apply.
logger = logging.getLogger("vllm.ucm_connector.worker")


def _touched(nbytes: int) -> np.ndarray:
    """A buffer whose pages are already mapped: the kernel hands out fresh
    pages lazily (np.zeros included), and faulting them in during a copy
    runs it at a fraction of memory speed."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


class UCMWorker:
    def __init__(self, *, store: KVStore, namespace_digest: bytes, tp_rank: int, num_blocks: int,
                 max_pending_nbytes: int, stats: StatsCollector, blocks_per_request: int = 0) -> None:
        self.store = store
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.max_pending_nbytes = max_pending_nbytes
        self.stats = stats
        self.transfer: BlockTransfer | None = None
        self.load_errors: set[int] = set()
        self.blocks_per_request = blocks_per_request
        self._load_buf = np.empty(0, dtype=np.uint8)
        # Save buffers come back from the writer and are reused, so that a
        # save does not pay for fresh pages (page faults) on the engine's path.
        self._free_rows: list[np.ndarray] = []
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[list[bytes], np.ndarray]] = collections.deque()
        self._pending_nbytes = 0
        self._writing = 0
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="ucm-save-writer", daemon=True)
        self._writer.start()
        self._logged: set[str] = set()

    def register_kv_caches(self, kv_caches) -> None:
        self.transfer = BlockTransfer(kv_caches, self.num_blocks)
        self.payload_nbytes = self.transfer.payload_nbytes
        self.block_nbytes = blockfmt.block_nbytes(self.payload_nbytes)
        # A whole-prompt load fits without growing the buffer, and its pages
        # are touched now rather than during the first hit (capped: a load of
        # more blocks grows it then).
        initial = min(self.blocks_per_request, (512 << 20) // self.block_nbytes)
        if initial > 0:
            self._load_buf = _touched(initial * self.block_nbytes)
        logger.info("ucm-connector: %d layers registered, %d bytes of KV per block and rank",
                    self.transfer.num_layers, self.payload_nbytes)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.add(store_errors=1)
        if what not in self._logged:
            self._logged.add(what)
            logger.warning("ucm-connector: %s failed: %s; the engine carries on without those blocks "
                           "(further errors of this kind are counted, not logged)", what, exc)

    # -- loads -------------------------------------------------------------

    def load(self, plans: list[BlockPlan]) -> None:
        if not plans or self.transfer is None:
            return
        t0 = time.perf_counter()
        block_ids = [b for plan in plans for b in plan.block_ids]
        keys = keys_for_rank([k for plan in plans for k in plan.keys], self.tp_rank)
        n = len(keys)
        need = n * self.block_nbytes
        if self._load_buf.size < need:
            self._load_buf = _touched(need)
        rows = self._load_buf[:need].reshape(n, self.block_nbytes)
        try:
            found = self.store.get_into(keys, [memoryview(row) for row in rows])
        except StoreError as exc:
            self._failed("store load", exc)
            found = [False] * n
        good: list[int] = []
        bad_keys: list[bytes] = []
        for i, ok in enumerate(found):
            if ok:
                try:
                    blockfmt.verify(rows[i], self.namespace_digest, self.payload_nbytes, key=keys[i])
                    good.append(i)
                    continue
                except blockfmt.BlockFormatError as exc:
                    self._failed(f"block check ({exc.reason})", exc)
                    bad_keys.append(keys[i])
            self.load_errors.add(block_ids[i])
        if bad_keys:
            # A bad block would otherwise be found, fail and be recomputed
            # on every later hit, and never be saved again.
            try:
                self.store.delete(bad_keys)
            except StoreError as exc:
                self._failed("store delete of bad blocks", exc)
        if len(good) == n:
            self.transfer.scatter(block_ids, rows[:, blockfmt.HEADER_NBYTES:])
        elif good:
            self.transfer.scatter([block_ids[i] for i in good], rows[good, blockfmt.HEADER_NBYTES:])
        self.stats.add(loaded_blocks=len(good), loaded_bytes=len(good) * self.payload_nbytes,
                       load_errors=n - len(good), load_seconds=time.perf_counter() - t0)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------

    def save(self, plans: list[BlockPlan]) -> None:
        if not plans or self.transfer is None:
            return
        t0 = time.perf_counter()
        block_ids = [b for plan in plans for b in plan.block_ids]
        keys = keys_for_rank([k for plan in plans for k in plan.keys], self.tp_rank)
        try:
            present = self.store.contains(keys)
        except StoreError as exc:
            self._failed("store lookup before save", exc)
            self.stats.add(skipped_saves=len(keys))
            return
        todo = [i for i, p in enumerate(present) if not p]
        skipped = len(keys) - len(todo)
        nbytes = len(todo) * self.block_nbytes
        with self._cond:
            if todo and self._pending_nbytes + nbytes > self.max_pending_nbytes and self._queue:
                skipped += len(todo)
                todo = []
            else:
                self._pending_nbytes += nbytes
        if skipped:
            self.stats.add(skipped_saves=skipped)
        if not todo:
            return
        rows = self._take_rows(len(todo))
        self.transfer.gather([block_ids[i] for i in todo], rows[:, blockfmt.HEADER_NBYTES:])
        todo_keys = [keys[i] for i in todo]
        for row, key in zip(rows, todo_keys):
            blockfmt.pack_into(row, self.namespace_digest, self.payload_nbytes, key=key)
        self.stats.add(save_seconds=time.perf_counter() - t0)
        with self._cond:
            self._queue.append((todo_keys, rows))
            self._cond.notify_all()

    def _take_rows(self, n: int) -> np.ndarray:
        with self._cond:
            for i, buf in enumerate(self._free_rows):
                if buf.shape[0] >= n:
                    return self._free_rows.pop(i)[:n]
        return _touched(n * self.block_nbytes).reshape(n, self.block_nbytes)

    def _give_rows(self, rows: np.ndarray) -> None:
        base = rows.base if rows.base is not None and rows.base.ndim == 2 else rows
        with self._cond:
            if len(self._free_rows) < 4:
                self._free_rows.append(base)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                keys, rows = self._queue.popleft()
                self._writing += 1
            t0 = time.perf_counter()
            try:
                stored = self.store.put(keys, [memoryview(row) for row in rows])
            except StoreError as exc:
                self._failed("store save", exc)
                stored = [False] * len(keys)
            except Exception as exc:  # the writer must outlive any one bad batch
                self._failed("store save", exc)
                stored = [False] * len(keys)
            n = sum(stored)
            self.stats.add(saved_blocks=n, saved_bytes=n * self.payload_nbytes,
                           skipped_saves=len(keys) - n, save_seconds=time.perf_counter() - t0)
            self._give_rows(rows)
            with self._cond:
                self._writing -= 1
                self._pending_nbytes -= rows.nbytes
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._writing, timeout)

    def close(self) -> None:
        self.flush(timeout=60)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=60)
