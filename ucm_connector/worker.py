"""Worker role: move whole blocks between the paged KV cache and the store.

Loads are one batched ``get_into`` into a reusable buffer, every block's
envelope and checksum checked, good blocks scattered into their pages, bad
ones reported through ``load_errors`` so vLLM recomputes them (and deleted
from the store).  Three modes: ``sync`` loads before the step's forward pass
(``start_load_kv`` returns when done); ``async`` (``load_kv_async``) hands
the loads to a loader thread while the engine runs other requests, and
``get_finished`` reports each request when its blocks are in; ``layer``
(``load_layerwise``) reads on the loader thread and scatters layer by layer,
so the forward pass of layer i (``wait_for_layer_load``) waits only for layer
i's pages.  Saves are gathered when the step's
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
from typing import Callable

import numpy as np

from store_backends import KVStore, StoreError

from . import blockfmt
from .events import NOT_STORED, PRESENT, REMOVED, WRITTEN, OutcomeLog
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


class _LayerJob:
    """One step's loads, scattered layer by layer as the forward pass goes."""

    def __init__(self, plans: list[BlockPlan], layer_done: list[threading.Event]) -> None:
        self.plans = plans
        self.layer_done = layer_done
        self.done = threading.Event()
        self.bad_block_ids: set[int] = set()


class UCMWorker:
    def __init__(self, *, store: KVStore, namespace_digest: bytes, tp_rank: int, num_blocks: int,
                 max_pending_nbytes: int, stats: StatsCollector, blocks_per_request: int = 0,
                 load_mode: str = "sync", events: OutcomeLog | None = None,
                 share_failures: Callable[[set[int]], set[int]] | None = None) -> None:
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
        # (keys, rows, keys whose stored value is replaced rather than kept)
        self._queue: collections.deque[tuple[list[bytes], np.ndarray, list[bytes]]] = collections.deque()
        self._pending_nbytes = 0
        self._writing = 0
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="ucm-save-writer", daemon=True)
        self._writer.start()
        self._logged: set[str] = set()
        # With TP > 1 every rank's forward pass reads every rank's pages
        # (through the all-reduce), so a save is dropped when a load failed
        # on any rank: this returns the union over the TP group.
        self._share_failures = share_failures
        # Blocks whose load failed, this step and the one before.
        self._recent_failures: collections.deque[set[int]] = collections.deque([set(), set()], maxlen=2)
        self.load_mode = load_mode
        self.events = events or OutcomeLog(enabled=False)
        self._layer_index: dict[str, int] = {}
        self._layer_job: _LayerJob | None = None
        self._load_cond = threading.Condition()
        self._load_jobs: collections.deque = collections.deque()
        self._finished_recving: set[str] = set()
        self._recv_errors: set[int] = set()
        self._loader = None
        if load_mode != "sync":
            self._loader = threading.Thread(target=self._load_loop, name="ucm-loader", daemon=True)
            self._loader.start()

    def register_kv_caches(self, kv_caches) -> None:
        self.transfer = BlockTransfer(kv_caches, self.num_blocks)
        self.payload_nbytes = self.transfer.payload_nbytes
        self.block_nbytes = blockfmt.block_nbytes(self.payload_nbytes)
        self._layer_index = {layer.name: i for i, layer in enumerate(self.transfer.layers)}
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

    def _read(self, keys: list[bytes], rows: np.ndarray) -> list[bool]:
        try:
            return self.store.get_into(keys, [memoryview(row) for row in rows])
        except StoreError as exc:
            self._failed("store load", exc)
            return [False] * len(keys)

    def _check(self, keys: list[bytes], rows: np.ndarray, found: list[bool]) -> tuple[list[int], list[bytes]]:
        """Indices of the rows that passed their checks, and keys of the
        blocks that were found but failed them."""
        good: list[int] = []
        bad_keys: list[bytes] = []
        for i, ok in enumerate(found):
            if ok:
                try:
                    blockfmt.verify(rows[i], self.namespace_digest, self.payload_nbytes, key=keys[i])
                    good.append(i)
                except blockfmt.BlockFormatError as exc:
                    self._failed(f"block check ({exc.reason})", exc)
                    bad_keys.append(keys[i])
        return good, bad_keys

    def _fetch(self, plans: list[BlockPlan], buf: np.ndarray, scatter: bool = True
               ) -> tuple[list[int], np.ndarray, list[int], np.ndarray]:
        """Read the plans' blocks into ``buf`` (grown if needed), check them
        and (``scatter``) copy the good ones into their pages.  Returns the
        block ids, the rows, the indices of good rows and the (possibly new)
        buffer; bad blocks go to the stats and are deleted from the store."""
        block_ids = [b for plan in plans for b in plan.block_ids]
        keys = keys_for_rank([k for plan in plans for k in plan.keys], self.tp_rank)
        n = len(keys)
        need = n * self.block_nbytes
        if buf.size < need:
            buf = _touched(need)
        rows = buf[:need].reshape(n, self.block_nbytes)
        # One batched read.  Reading a chunk ahead on another thread while the
        # last chunk is checked and copied measured no faster on disk and 25%
        # slower on shm on two cores (benchmarks/RESULTS.md).
        good, bad_keys = self._check(keys, rows, self._read(keys, rows))
        if scatter:
            self._scatter(block_ids, rows, good)
        if bad_keys:
            # A bad block would otherwise be found, fail and be recomputed
            # on every later hit, and never be saved again.
            try:
                self.store.delete(bad_keys)
                self.events.add(REMOVED, bad_keys)
            except StoreError as exc:
                self._failed("store delete of bad blocks", exc)
        self.stats.add(loaded_blocks=len(good), loaded_bytes=len(good) * self.payload_nbytes,
                       load_errors=n - len(good))
        return block_ids, rows, good, buf

    def _scatter(self, block_ids: list[int], rows: np.ndarray, good: list[int],
                 layers: range | None = None) -> None:
        """Copy the rows ``good`` into the pages of their blocks."""
        payload = rows[:, blockfmt.HEADER_NBYTES:]
        if len(good) == len(block_ids):
            self.transfer.scatter(block_ids, payload, layers)
        elif good:
            self.transfer.scatter([block_ids[i] for i in good], payload[good], layers)

    @staticmethod
    def _bad_ids(block_ids: list[int], good: list[int]) -> set[int]:
        ok = set(good)
        return {b for i, b in enumerate(block_ids) if i not in ok}

    def load(self, plans: list[BlockPlan]) -> None:
        """Start this step's loads (``start_load_kv``): done before return
        (sync), handed to the loader thread and reported by ``get_finished``
        (async), or layer by layer while the forward pass runs (layer)."""
        if not plans or self.transfer is None:
            return
        if self.load_mode == "async":
            with self._load_cond:
                self._load_jobs.extend(plans)
                self._load_cond.notify_all()
            return
        if self.load_mode == "layer":
            job = _LayerJob(plans, [threading.Event() for _ in range(self.transfer.num_layers)])
            self._layer_job = job
            with self._load_cond:
                self._load_jobs.append(job)
                self._load_cond.notify_all()
            return
        t0 = time.perf_counter()
        block_ids, rows, good, self._load_buf = self._fetch(plans, self._load_buf)
        self.load_errors |= self._bad_ids(block_ids, good)
        self.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer_name: str) -> None:
        job = self._layer_job
        if job is not None:
            job.layer_done[self._layer_index.get(layer_name, 0)].wait()

    def _finish_layer_job(self) -> None:
        job, self._layer_job = self._layer_job, None
        if job is not None:
            job.done.wait()
            self.load_errors |= job.bad_block_ids

    def _load_loop(self) -> None:
        buf = np.empty(0, dtype=np.uint8)
        while True:
            with self._load_cond:
                while not self._load_jobs and not self._closed:
                    self._load_cond.wait()
                if not self._load_jobs:
                    return
                job = self._load_jobs.popleft()
            t0 = time.perf_counter()
            if isinstance(job, _LayerJob):
                buf = self._run_layer_job(job, buf)
            else:
                bad: set[int] = set(job.block_ids)
                try:
                    block_ids, rows, good, buf = self._fetch([job], buf)
                    bad = self._bad_ids(block_ids, good)
                except Exception as exc:  # the loader must outlive any one bad job
                    self._failed("block load", exc)
                with self._load_cond:
                    self._finished_recving.add(job.req_id)
                    self._recv_errors |= bad
            self.stats.add(load_seconds=time.perf_counter() - t0)

    def _run_layer_job(self, job: "_LayerJob", buf: np.ndarray) -> np.ndarray:
        try:
            block_ids, rows, good, buf = self._fetch(job.plans, buf, scatter=False)
            job.bad_block_ids = self._bad_ids(block_ids, good)
            for i in range(self.transfer.num_layers):
                self._scatter(block_ids, rows, good, range(i, i + 1))
                job.layer_done[i].set()
        except Exception as exc:
            self._failed("block load", exc)
            job.bad_block_ids = {b for plan in job.plans for b in plan.block_ids}
        finally:
            for event in job.layer_done:
                event.set()
            job.done.set()
        return buf

    def get_finished(self) -> set[str] | None:
        """Requests whose asynchronous loads are done; their bad blocks go
        out with this step's load errors."""
        if self.load_mode != "async":
            return None
        with self._load_cond:
            finished, self._finished_recving = self._finished_recving, set()
            self.load_errors |= self._recv_errors
            self._recv_errors = set()
        return finished or None

    def take_load_errors(self) -> set[int]:
        self._finish_layer_job()
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------

    def _step_load_failures(self) -> set[int]:
        """Blocks whose sync or layerwise load failed in this step (known
        before the save: the layer job is waited for)."""
        job = self._layer_job
        if job is not None:
            job.done.wait()
            return self.load_errors | job.bad_block_ids
        return set(self.load_errors)

    def _drop_tainted(self, plans: list[BlockPlan]) -> list[BlockPlan]:
        """Never save KV computed on a page whose load failed: vLLM rewinds
        the request and recomputes it, but this step's forward pass already
        wrote KV that read the bad page.  Failures of the step before count
        too, for a step scheduled before vLLM saw them."""
        failures = self._step_load_failures()
        if self._share_failures is not None and any(plan.loaded_inputs for plan in plans):
            # Every rank gets the same plans, so all of them take part.
            failures = self._share_failures(failures)
        self._recent_failures.append(failures)
        failed = self._recent_failures[0] | self._recent_failures[1]
        if not failed:
            return plans
        kept = []
        for plan in plans:
            if failed.isdisjoint(plan.loaded_inputs):
                kept.append(plan)
                continue
            keys = keys_for_rank(plan.keys, self.tp_rank)
            self.stats.add(skipped_saves=len(keys))
            self.events.add(NOT_STORED, keys)
            if "tainted" not in self._logged:
                self._logged.add("tainted")
                logger.warning(
                    "ucm-connector: not saving %d blocks of request %s: computed on blocks whose load failed "
                    "in this step; vLLM recomputes them and they are saved then (logged once)",
                    len(keys), plan.req_id)
        return kept

    def save(self, plans: list[BlockPlan]) -> None:
        """This step's saves (``wait_for_save``).  Called every step, with
        or without plans, so that load failures are seen step by step."""
        plans = self._drop_tainted(plans)
        if not plans:
            return
        t0 = time.perf_counter()
        block_ids = [b for plan in plans for b in plan.block_ids]
        keys = keys_for_rank([k for plan in plans for k in plan.keys], self.tp_rank)
        overwrite = [plan.overwrite for plan in plans for _ in plan.block_ids]
        if self.transfer is None:
            self.events.add(NOT_STORED, keys)
            return
        try:
            # Re-saves after a load failure replace what the store holds.
            asked = [k for k, o in zip(keys, overwrite) if not o]
            answers = iter(self.store.contains(asked) if asked else [])
            present = [False if o else next(answers) for o in overwrite]
        except StoreError as exc:
            self._failed("store lookup before save", exc)
            self.stats.add(skipped_saves=len(keys))
            self.events.add(NOT_STORED, keys)
            return
        todo = [i for i, p in enumerate(present) if not p]
        self.events.add(PRESENT, [key for key, p in zip(keys, present) if p])
        skipped = len(keys) - len(todo)
        nbytes = len(todo) * self.block_nbytes
        with self._cond:
            if todo and self._pending_nbytes + nbytes > self.max_pending_nbytes and self._queue:
                skipped += len(todo)
                self.events.add(NOT_STORED, [keys[i] for i in todo])
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
        replace = [keys[i] for i in todo if overwrite[i]]
        self.stats.add(save_seconds=time.perf_counter() - t0)
        with self._cond:
            self._queue.append((todo_keys, rows, replace))
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
                keys, rows, replace = self._queue.popleft()
                self._writing += 1
            t0 = time.perf_counter()
            try:
                if replace:
                    # Stores keep the first value put under a key; a value
                    # that must not survive is deleted first (in every tier).
                    self.store.delete(replace)
                stored = self.store.put(keys, [memoryview(row) for row in rows])
            except StoreError as exc:
                self._failed("store save", exc)
                stored = [False] * len(keys)
            except Exception as exc:  # the writer must outlive any one bad batch
                self._failed("store save", exc)
                stored = [False] * len(keys)
            n = sum(stored)
            if n < len(keys) and "store refused" not in self._logged:
                self._logged.add("store refused")
                logger.warning("ucm-connector: store %s refused %d of %d blocks (full?); refused saves "
                               "are skipped and counted in vllm:ucm_skipped_saves (logged once)",
                               self.store.url, len(keys) - n, len(keys))
            self.events.add(WRITTEN, [k for k, ok in zip(keys, stored) if ok])
            self.events.add(NOT_STORED, [k for k, ok in zip(keys, stored) if not ok])
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
        with self._load_cond:
            self._load_cond.notify_all()
        self._writer.join(timeout=60)
        if self._loader is not None:
            self._loader.join(timeout=60)
