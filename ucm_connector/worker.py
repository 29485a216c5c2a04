"""Worker role: move whole blocks between the paged KV cache and the store.

``UCMWorker`` composes small parts, one job each:

* ``BlockReader`` reads a batch of blocks with one ``get_into``, checks every
  envelope and checksum, copies the good blocks into their pages and deletes
  bad ones from the store (a bad block would otherwise be found, fail and be
  recomputed on every later hit);
* one way of loading, by ``LoadMode``: ``SyncLoads`` (before the step's
  forward pass; ``start_load_kv`` returns when done), ``AsyncLoads``
  (``load_kv_async``: a loader thread while the engine runs other requests;
  ``get_finished`` reports each request when its blocks are in) or
  ``LayerLoads`` (``load_layerwise``: read on the loader thread, copied layer
  by layer, so layer i's attention waits only for layer i's pages);
* ``Saves``: gathers a step's new blocks out of the cache when its forward
  pass is done (``wait_for_save``; the pages can be reused at once) and hands
  them to one background writer, so the engine never waits on the store's
  I/O.  Blocks the store has are skipped; a full backlog skips saves rather
  than wait; KV computed on a page whose load failed is never saved.

Every way of loading answers the same questions (start, wait for a layer,
this step's failures, what finished, the errors to report), so the worker
reads the same for each, and a device-specific copy path only changes how
the reader and the saves move bytes (``BlockTransfer``).
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
from .config import LoadMode
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


class _Reporter:
    """Counts a kind of failure every time and logs it once."""

    def __init__(self, stats: StatsCollector) -> None:
        self.stats = stats
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, what: str, exc: BaseException) -> None:
        self.stats.add(store_errors=1)
        if self.first(what):
            logger.warning("ucm-connector: %s failed: %s; the engine carries on without those blocks "
                           "(further errors of this kind are counted, not logged)", what, exc)

    def first(self, what: str) -> bool:
        with self._lock:
            if what in self._logged:
                return False
            self._logged.add(what)
            return True


# -- loads ----------------------------------------------------------------------


class BlockReader:
    """Reads, checks and copies one batch of blocks into their pages."""

    def __init__(self, *, store: KVStore, transfer: BlockTransfer, namespace_digest: bytes, tp_rank: int,
                 stats: StatsCollector, events: OutcomeLog, report: _Reporter) -> None:
        self.store = store
        self.transfer = transfer
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.stats = stats
        self.events = events
        self.report = report
        self.payload_nbytes = transfer.payload_nbytes
        self.block_nbytes = blockfmt.block_nbytes(self.payload_nbytes)

    def _read(self, keys: list[bytes], rows: np.ndarray) -> list[bool]:
        try:
            return self.store.get_into(keys, [memoryview(row) for row in rows])
        except StoreError as exc:
            self.report.failed("store load", exc)
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
                    self.report.failed(f"block check ({exc.reason})", exc)
                    bad_keys.append(keys[i])
        return good, bad_keys

    def fetch(self, plans: list[BlockPlan], buf: np.ndarray, scatter: bool = True
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
            self.scatter(block_ids, rows, good)
        if bad_keys:
            try:
                self.store.delete(bad_keys)
                self.events.add(REMOVED, bad_keys)
            except StoreError as exc:
                self.report.failed("store delete of bad blocks", exc)
        self.stats.add(loaded_blocks=len(good), loaded_bytes=len(good) * self.payload_nbytes,
                       load_errors=n - len(good))
        return block_ids, rows, good, buf

    def scatter(self, block_ids: list[int], rows: np.ndarray, good: list[int],
                layers: range | None = None) -> None:
        """Copy the rows ``good`` into the pages of their blocks."""
        payload = rows[:, blockfmt.HEADER_NBYTES:]
        if len(good) == len(block_ids):
            self.transfer.scatter(block_ids, payload, layers)
        elif good:
            self.transfer.scatter([block_ids[i] for i in good], payload[good], layers)

    @staticmethod
    def bad_ids(block_ids: list[int], good: list[int]) -> set[int]:
        ok = set(good)
        return {b for i, b in enumerate(block_ids) if i not in ok}


class SyncLoads:
    """Loads done before the forward pass, in the engine's thread."""

    mode = LoadMode.SYNC

    def __init__(self, reader: BlockReader, initial_nbytes: int = 0) -> None:
        self.reader = reader
        self._buf = _touched(initial_nbytes) if initial_nbytes > 0 else np.empty(0, dtype=np.uint8)
        self._errors: set[int] = set()

    def start(self, plans: list[BlockPlan]) -> None:
        t0 = time.perf_counter()
        block_ids, _, good, self._buf = self.reader.fetch(plans, self._buf)
        self._errors |= BlockReader.bad_ids(block_ids, good)
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        pass

    def step_failures(self) -> set[int]:
        """Blocks whose load failed in this step, known before its saves."""
        return set(self._errors)

    def finished(self) -> set[str] | None:
        return None

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        pass


class _LoaderThread:
    """A thread that runs jobs in order until closed; a job that raises is
    reported by ``on_error`` and the thread carries on."""

    def __init__(self, run: Callable[[object], None]) -> None:
        self._run = run
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ucm-loader", daemon=True)
        self._thread.start()

    def put(self, *jobs: object) -> None:
        with self._cond:
            self._jobs.extend(jobs)
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            self._run(job)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)


class AsyncLoads:
    """Loads on a loader thread; the request waits (vLLM keeps it out of the
    batch) until ``finished`` reports it, its bad blocks with it.  Nothing
    reads a page of an asynchronous load in the step that starts it."""

    mode = LoadMode.ASYNC

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._buf = np.empty(0, dtype=np.uint8)
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._recv_errors: set[int] = set()
        self._errors: set[int] = set()
        self._thread = _LoaderThread(self._run)

    def start(self, plans: list[BlockPlan]) -> None:
        self._thread.put(*plans)

    def _run(self, plan: BlockPlan) -> None:
        t0 = time.perf_counter()
        bad: set[int] = set(plan.block_ids)
        try:
            block_ids, _, good, self._buf = self.reader.fetch([plan], self._buf)
            bad = BlockReader.bad_ids(block_ids, good)
        except Exception as exc:  # the loader must outlive any one bad job
            self.reader.report.failed("block load", exc)
        with self._lock:
            self._finished.add(plan.req_id)
            self._recv_errors |= bad
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        pass

    def step_failures(self) -> set[int]:
        return set()

    def finished(self) -> set[str] | None:
        with self._lock:
            finished, self._finished = self._finished, set()
            self._errors |= self._recv_errors
            self._recv_errors = set()
        return finished or None

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._thread.close()


class _LayerJob:
    """One step's loads, copied layer by layer as the forward pass goes."""

    def __init__(self, plans: list[BlockPlan], num_layers: int) -> None:
        self.plans = plans
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()
        self.bad_block_ids: set[int] = set()


class LayerLoads:
    """Reads a step's blocks on the loader thread and copies them layer by
    layer; the forward pass of layer i waits only for layer i's pages."""

    mode = LoadMode.LAYER

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._buf = np.empty(0, dtype=np.uint8)
        self._job: _LayerJob | None = None
        self._thread = _LoaderThread(self._run)

    def start(self, plans: list[BlockPlan]) -> None:
        self._job = _LayerJob(plans, self.reader.transfer.num_layers)
        self._thread.put(self._job)

    def _run(self, job: _LayerJob) -> None:
        t0 = time.perf_counter()
        try:
            block_ids, rows, good, self._buf = self.reader.fetch(job.plans, self._buf, scatter=False)
            job.bad_block_ids = BlockReader.bad_ids(block_ids, good)
            for i in range(self.reader.transfer.num_layers):
                self.reader.scatter(block_ids, rows, good, range(i, i + 1))
                job.layer_done[i].set()
        except Exception as exc:  # every block of the job counts as failed
            self.reader.report.failed("block load", exc)
            job.bad_block_ids = {b for plan in job.plans for b in plan.block_ids}
        finally:
            for event in job.layer_done:
                event.set()
            job.done.set()
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        job = self._job
        if job is not None:
            job.layer_done[layer].wait()

    def step_failures(self) -> set[int]:
        job = self._job
        if job is None:
            return set()
        job.done.wait()
        return set(job.bad_block_ids)

    def finished(self) -> set[str] | None:
        return None

    def take_errors(self) -> set[int]:
        job, self._job = self._job, None
        if job is None:
            return set()
        job.done.wait()
        return set(job.bad_block_ids)

    def close(self) -> None:
        self._thread.close()


_LOADS = {LoadMode.SYNC: SyncLoads, LoadMode.ASYNC: AsyncLoads, LoadMode.LAYER: LayerLoads}


# -- saves ----------------------------------------------------------------------


class Saves:
    """A step's new blocks: checked against the store, gathered out of the
    cache, and written by one background writer."""

    def __init__(self, *, store: KVStore, transfer: BlockTransfer, namespace_digest: bytes, tp_rank: int,
                 max_pending_nbytes: int, stats: StatsCollector, events: OutcomeLog, report: _Reporter,
                 share_failures: Callable[[set[int]], set[int]] | None = None) -> None:
        self.store = store
        self.transfer = transfer
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.max_pending_nbytes = max_pending_nbytes
        self.stats = stats
        self.events = events
        self.report = report
        self.payload_nbytes = transfer.payload_nbytes
        self.block_nbytes = blockfmt.block_nbytes(self.payload_nbytes)
        # With TP > 1 every rank's forward pass reads every rank's pages
        # (through the all-reduce), so a save is dropped when a load failed
        # on any rank: this returns the union over the TP group.
        self._share_failures = share_failures
        # Blocks whose load failed, this step and the one before.
        self._recent_failures: collections.deque[set[int]] = collections.deque([set(), set()], maxlen=2)
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

    def drop_tainted(self, plans: list[BlockPlan], failures: set[int]) -> list[BlockPlan]:
        """Never save KV computed on a page whose load failed: vLLM rewinds
        the request and recomputes it, but this step's forward pass already
        wrote KV that read the bad page.  ``failures`` are this step's;
        those of the step before count too, for a step scheduled before vLLM
        saw them."""
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
            if self.report.first("tainted"):
                logger.warning(
                    "ucm-connector: not saving %d blocks of request %s: computed on blocks whose load failed "
                    "in this step; vLLM recomputes them and they are saved then (logged once)",
                    len(keys), plan.req_id)
        return kept

    def save(self, plans: list[BlockPlan]) -> None:
        if not plans:
            return
        t0 = time.perf_counter()
        block_ids = [b for plan in plans for b in plan.block_ids]
        keys = keys_for_rank([k for plan in plans for k in plan.keys], self.tp_rank)
        overwrite = [plan.overwrite for plan in plans for _ in plan.block_ids]
        try:
            # Re-saves after a load failure replace what the store holds.
            asked = [k for k, o in zip(keys, overwrite) if not o]
            answers = iter(self.store.contains(asked) if asked else [])
            present = [False if o else next(answers) for o in overwrite]
        except StoreError as exc:
            self.report.failed("store lookup before save", exc)
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
            except Exception as exc:  # the writer must outlive any one bad batch
                self.report.failed("store save", exc)
                stored = [False] * len(keys)
            n = sum(stored)
            if n < len(keys) and self.report.first("store refused"):
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
        self._writer.join(timeout=60)


# -- the worker -------------------------------------------------------------------


class UCMWorker:
    """The worker role's hooks, over one way of loading and the saves."""

    def __init__(self, *, store: KVStore, namespace_digest: bytes, tp_rank: int, num_blocks: int,
                 max_pending_nbytes: int, stats: StatsCollector, blocks_per_request: int = 0,
                 load_mode: LoadMode | str = LoadMode.SYNC, events: OutcomeLog | None = None,
                 share_failures: Callable[[set[int]], set[int]] | None = None) -> None:
        self.store = store
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.max_pending_nbytes = max_pending_nbytes
        self.stats = stats
        self.blocks_per_request = blocks_per_request
        self.load_mode = LoadMode(load_mode)
        self.events = events or OutcomeLog(enabled=False)
        self._share_failures = share_failures
        self._report = _Reporter(stats)
        self.transfer: BlockTransfer | None = None
        self.loads: SyncLoads | AsyncLoads | LayerLoads | None = None
        self.saves: Saves | None = None
        self._layer_index: dict[str, int] = {}

    def register_kv_caches(self, kv_caches) -> None:
        self.transfer = BlockTransfer(kv_caches, self.num_blocks)
        self.payload_nbytes = self.transfer.payload_nbytes
        self.block_nbytes = blockfmt.block_nbytes(self.payload_nbytes)
        self._layer_index = {layer.name: i for i, layer in enumerate(self.transfer.layers)}
        parts = dict(store=self.store, transfer=self.transfer, namespace_digest=self.namespace_digest,
                     tp_rank=self.tp_rank, stats=self.stats, events=self.events, report=self._report)
        reader = BlockReader(**parts)
        if self.load_mode is LoadMode.SYNC:
            # A whole-prompt load fits without growing the buffer, and its
            # pages are touched now rather than during the first hit (capped:
            # a load of more blocks grows it then).
            initial = min(self.blocks_per_request, (512 << 20) // self.block_nbytes)
            self.loads = SyncLoads(reader, initial * self.block_nbytes)
        else:
            self.loads = _LOADS[self.load_mode](reader)
        self.saves = Saves(**parts, max_pending_nbytes=self.max_pending_nbytes,
                           share_failures=self._share_failures)
        logger.info("ucm-connector: %d layers registered, %d bytes of KV per block and rank",
                    self.transfer.num_layers, self.payload_nbytes)

    # -- the hooks, in the order vLLM calls them in a step ------------------------

    def load(self, plans: list[BlockPlan]) -> None:
        """``start_load_kv``: start (sync: do) this step's loads."""
        if plans and self.loads is not None:
            self.loads.start(plans)

    def wait_for_layer(self, layer_name: str) -> None:
        if self.loads is not None:
            self.loads.wait_for_layer(self._layer_index.get(layer_name, 0))

    def save(self, plans: list[BlockPlan]) -> None:
        """``wait_for_save``: this step's saves.  Called every step, with or
        without plans, so that load failures are seen step by step."""
        if self.saves is None:
            if plans:
                self.events.add(NOT_STORED, keys_for_rank([k for p in plans for k in p.keys], self.tp_rank))
            return
        self.saves.save(self.saves.drop_tainted(plans, self.loads.step_failures()))

    def get_finished(self) -> set[str] | None:
        """Requests whose asynchronous loads are done; their bad blocks go
        out with this step's load errors."""
        return self.loads.finished() if self.loads is not None else None

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors() if self.loads is not None else set()

    # -- the rest ------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written."""
        return self.saves.flush(timeout) if self.saves is not None else True

    def close(self) -> None:
        if self.saves is not None:
            self.saves.close()
        if self.loads is not None:
            self.loads.close()
