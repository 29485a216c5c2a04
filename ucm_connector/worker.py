"""Worker role: move whole blocks between the paged KV cache and the store.

``UCMWorker`` composes small parts, one job each:

* ``BlockReader`` reads a batch of blocks with one ``get_into`` straight into
  rows of a pool (pinned and allocated once on CUDA), checks every envelope
  and checksum, copies the good blocks into their pages and deletes bad ones
  from the store (a bad block would otherwise be found, fail and be
  recomputed on every later hit);
* one way of loading, by ``LoadMode``: ``SyncLoads`` (before the step's
  forward pass; ``start_load_kv`` returns when done), ``AsyncLoads``
  (``load_kv_async``: a loader thread while the engine runs other requests;
  ``get_finished`` reports each request when its blocks are in) or
  ``LayerLoads`` (``load_layerwise``: read on the loader thread, copied layer
  by layer, so layer i's attention waits only for layer i's pages);
* ``Saves``: gathers a step's new blocks out of the cache when its forward
  pass is done (``wait_for_save``; on CUDA the gather is issued and the
  engine goes on, its later kernels ordered after the page reads) into rows
  of a pool bounded by ``max_pending_save_mib``, and hands them to one
  background writer, which puts the rows themselves, so the engine never
  waits on the store's I/O.  Blocks the store has are skipped; a full
  backlog skips saves rather than wait; KV computed on a page whose load
  failed is never saved;
* with ``load_policy: auto``, measurements for the scheduler's decision
  (``measure.py``): every store read timed per tier, every step's forward
  pass timed, and ``Prober``, which reads a few blocks of a tier the
  scheduler does not load from on a thread of its own, for the timing only.

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
from .counters import StatsCollector
from .hashing import keys_for_rank
from .measure import LoadObserver, StepClock, observe_reads, tiers_of
from .outcomes import NOT_STORED, PRESENT, REMOVED, WRITTEN, OutcomeLog
from .plans import BlockPlan, BlockProbe
from .transfer import BlockTransfer, HostRows, RowPool, Transfer

# Under "vllm." so that vLLM's log handlers and format apply.
logger = logging.getLogger("vllm.ucm_connector.worker")


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


class _Chunk:
    """Blocks read into rows of the pool: ``good`` are the indices of the rows
    that passed their checks."""

    def __init__(self, block_ids: list[int], rows: HostRows, good: list[int]) -> None:
        self.block_ids = block_ids
        self.rows = rows
        self.good = good

    @property
    def good_ids(self) -> list[int]:
        return [self.block_ids[i] for i in self.good]


class BlockReader:
    """Reads, checks and copies batches of blocks into their pages, through
    rows of one pool (pinned and allocated once on CUDA): the store writes
    into the rows themselves, and the copy into the pages reads them."""

    def __init__(self, *, store: KVStore, transfer: BlockTransfer, pool: RowPool, namespace_digest: bytes,
                 tp_rank: int, stats: StatsCollector, events: OutcomeLog, report: _Reporter) -> None:
        self.store = store
        self.transfer = transfer
        self.pool = pool
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.stats = stats
        self.events = events
        self.report = report
        self.payload_nbytes = transfer.payload_nbytes

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

    def read(self, plans: list[BlockPlan], *, scatter: bool = True, after=None
             ) -> tuple[list[int], set[int], list[_Chunk], list[Transfer]]:
        """Read the plans' blocks (a batch per pool's worth), check them and
        (``scatter``) copy the good ones into their pages, ordered after the
        work queued on the stream ``after`` (CUDA).  Returns the block ids,
        the bad ones, the chunks still holding rows (``scatter=False``: the
        caller copies and releases them) and the issued copies.  Bad blocks
        go to the stats and are deleted from the store."""
        block_ids = [b for plan in plans for b in plan.block_ids]
        keys = keys_for_rank([k for plan in plans for k in plan.keys], self.tp_rank)
        kept: list[_Chunk] = []
        copies: list[Transfer] = []
        bad: set[int] = set()
        bad_keys: list[bytes] = []
        num_good = 0
        step = self.pool.capacity
        for lo in range(0, len(keys), step):
            ids, chunk_keys = block_ids[lo:lo + step], keys[lo:lo + step]
            rows = self.pool.take(len(ids))
            try:
                # One batched read per chunk.  Reading a chunk ahead on
                # another thread measured no faster on disk and 25% slower
                # on shm on two cores (benchmarks/RESULTS.md).
                good, chunk_bad_keys = self._check(chunk_keys, rows.rows, self._read(chunk_keys, rows.rows))
            except BaseException:
                rows.release()
                raise
            bad_keys += chunk_bad_keys
            num_good += len(good)
            chunk = _Chunk(ids, rows, good)
            bad |= set(ids) - set(chunk.good_ids)
            if not scatter:
                kept.append(chunk)
                continue
            copy = None
            try:
                if good:
                    copy = self.transfer.scatter_rows(chunk.good_ids, rows, row_ids=good, after=after)
            finally:
                rows.release(after=copy)
            if copy is not None:
                copies.append(copy)
        if bad_keys:
            # A bad block would otherwise be found, fail and be recomputed
            # on every later hit, and never be saved again.
            try:
                self.store.delete(bad_keys)
                self.events.add(REMOVED, bad_keys)
            except StoreError as exc:
                self.report.failed("store delete of bad blocks", exc)
        self.stats.add(loaded_blocks=num_good, loaded_bytes=num_good * self.payload_nbytes,
                       load_errors=len(keys) - num_good)
        return block_ids, bad, kept, copies


def _engine_stream():
    """The stream the forward pass runs on (CUDA), captured on the engine's
    thread so that a loader thread can order its copies after it."""
    import torch

    return torch.cuda.current_stream() if torch.cuda.is_available() else None


class SyncLoads:
    """Loads done before the forward pass, in the engine's thread: the copy
    into the pages is ordered before the forward pass on the device, the
    host does not wait for it."""

    mode = LoadMode.SYNC

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._errors: set[int] = set()

    def start(self, plans: list[BlockPlan]) -> None:
        t0 = time.perf_counter()
        _, bad, _, _ = self.reader.read(plans)
        self._errors |= bad
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
    """A thread that runs jobs in order until closed."""

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
    reads a page of an asynchronous load in the step that starts it, and a
    request is reported only once its pages are written."""

    mode = LoadMode.ASYNC

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._recv_errors: set[int] = set()
        self._errors: set[int] = set()
        self._thread = _LoaderThread(self._run)

    def start(self, plans: list[BlockPlan]) -> None:
        stream = _engine_stream() if self.reader.transfer.on_cuda else None
        self._thread.put(*[(plan, stream) for plan in plans])

    def _run(self, job) -> None:
        plan, stream = job
        t0 = time.perf_counter()
        bad: set[int] = set(plan.block_ids)
        try:
            _, bad, _, copies = self.reader.read([plan], after=stream)
            for copy in copies:
                copy.synchronize()   # this thread may wait; the engine does not
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

    def __init__(self, plans: list[BlockPlan], num_layers: int, stream) -> None:
        self.plans = plans
        self.stream = stream
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()
        self.bad_block_ids: set[int] = set()
        self.copies: list[Transfer] = []


class LayerLoads:
    """Reads a step's blocks on the loader thread and copies them layer by
    layer; the forward pass of layer i waits only for layer i's pages.  On
    CUDA the upload of every layer is one copy, and layer i's attention
    waits for it on the device (an event), not on the host."""

    mode = LoadMode.LAYER

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._job: _LayerJob | None = None
        self._thread = _LoaderThread(self._run)

    def start(self, plans: list[BlockPlan]) -> None:
        stream = _engine_stream() if self.reader.transfer.on_cuda else None
        self._job = _LayerJob(plans, self.reader.transfer.num_layers, stream)
        self._thread.put(self._job)

    def _run(self, job: _LayerJob) -> None:
        t0 = time.perf_counter()
        transfer = self.reader.transfer
        num_blocks = sum(len(plan.block_ids) for plan in job.plans)
        try:
            if transfer.on_cuda or num_blocks > self.reader.pool.capacity:
                # One upload of every layer (or more rows than the pool
                # holds at once): the layers are ready together.
                _, job.bad_block_ids, _, job.copies = self.reader.read(job.plans, after=job.stream)
            else:
                _, job.bad_block_ids, chunks, _ = self.reader.read(job.plans, scatter=False)
                try:
                    for i in range(transfer.num_layers):
                        for chunk in chunks:
                            if chunk.good:
                                transfer.scatter(chunk.good_ids, chunk.rows.payload[chunk.good], range(i, i + 1))
                        job.layer_done[i].set()
                finally:
                    for chunk in chunks:
                        chunk.rows.release()
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
            for copy in job.copies:
                copy.order_stream()

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
    cache into rows of a pool bounded by ``max_pending_save_mib`` (pinned
    and allocated once on CUDA, where the gather returns as soon as it is
    issued), and written by one background writer, which waits for the
    copy, seals each row's envelope and puts the rows themselves."""

    def __init__(self, *, store: KVStore, transfer: BlockTransfer, pool: RowPool, namespace_digest: bytes,
                 tp_rank: int, stats: StatsCollector, events: OutcomeLog, report: _Reporter,
                 share_failures: Callable[[set[int]], set[int]] | None = None) -> None:
        self.store = store
        self.transfer = transfer
        self.pool = pool
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.stats = stats
        self.events = events
        self.report = report
        self.payload_nbytes = transfer.payload_nbytes
        # With TP > 1 every rank's forward pass reads every rank's pages
        # (through the all-reduce), so a save is dropped when a load failed
        # on any rank: this returns the union over the TP group.
        self._share_failures = share_failures
        # Blocks whose load failed, this step and the one before.
        self._recent_failures: collections.deque[set[int]] = collections.deque([set(), set()], maxlen=2)
        self._cond = threading.Condition()
        # (keys, rows, their copy, keys whose stored value is replaced)
        self._queue: collections.deque[tuple[list[bytes], HostRows, Transfer, list[bytes]]] = collections.deque()
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
        step = self.pool.capacity
        for lo in range(0, len(todo), step):
            part = todo[lo:lo + step]
            # A full backlog skips saves rather than make the engine wait.
            rows = self.pool.take(len(part), wait=False)
            if rows is None:
                rest = todo[lo:]
                skipped += len(rest)
                self.events.add(NOT_STORED, [keys[i] for i in rest])
                break
            try:
                copy = self.transfer.gather_rows([block_ids[i] for i in part], rows)
            except BaseException:
                rows.release()
                raise
            with self._cond:
                self._queue.append(([keys[i] for i in part], rows, copy,
                                    [keys[i] for i in part if overwrite[i]]))
                self._cond.notify_all()
        if skipped:
            self.stats.add(skipped_saves=skipped)
        self.stats.add(save_seconds=time.perf_counter() - t0)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                keys, rows, copy, replace = self._queue.popleft()
                self._writing += 1
            t0 = time.perf_counter()
            try:
                copy.wait()
                # Sealed here, after the copy: on CUDA it writes whole rows.
                for row, key in zip(rows.rows, keys):
                    blockfmt.pack_into(row, self.namespace_digest, self.payload_nbytes, key=key)
                if replace:
                    # Stores keep the first value put under a key; a value
                    # that must not survive is deleted first (in every tier).
                    self.store.delete(replace)
                stored = self.store.put(keys, [memoryview(row) for row in rows.rows])
            except Exception as exc:  # the writer must outlive any one bad batch
                self.report.failed("store save", exc)
                stored = [False] * len(keys)
            finally:
                rows.release()
            n = sum(stored)
            if n < len(keys) and self.report.first("store refused"):
                logger.warning("ucm-connector: store %s refused %d of %d blocks (full?); refused saves "
                               "are skipped and counted in vllm:ucm_skipped_saves (logged once)",
                               self.store.url, len(keys) - n, len(keys))
            self.events.add(WRITTEN, [k for k, ok in zip(keys, stored) if ok])
            self.events.add(NOT_STORED, [k for k, ok in zip(keys, stored) if not ok])
            self.stats.add(saved_blocks=n, saved_bytes=n * self.payload_nbytes,
                           skipped_saves=len(keys) - n, save_seconds=time.perf_counter() - t0)
            with self._cond:
                self._writing -= 1
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


# -- probes ---------------------------------------------------------------------


class Prober:
    """Reads a few blocks of one tier into scratch buffers, on a thread of
    its own, so that the reads are timed (the store given is the timed one):
    how ``load_policy: auto`` keeps measuring a tier it does not load from.
    Nothing read is checked or copied anywhere; at most one probe per tier
    waits or runs, further ones are dropped."""

    def __init__(self, store: KVStore, block_nbytes: int, tp_rank: int) -> None:
        self.tiers = tiers_of(store)
        self.block_nbytes = block_nbytes
        self.tp_rank = tp_rank
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._thread = _LoaderThread(self._run)

    def probe(self, probes: list[BlockProbe]) -> None:
        for probe in probes:
            if not probe.keys or not 0 <= probe.tier < len(self.tiers):
                continue
            with self._lock:
                if probe.tier in self._busy:
                    continue
                self._busy.add(probe.tier)
            self._thread.put(probe)

    def _run(self, probe: BlockProbe) -> None:
        keys = keys_for_rank(probe.keys, self.tp_rank)
        while len(self._buffers) < len(keys):
            self._buffers.append(bytearray(self.block_nbytes))
        try:
            self.tiers[probe.tier].get_into(keys, [memoryview(b) for b in self._buffers[:len(keys)]])
        except StoreError:
            pass   # a store that fails is the loads' business; a probe only times
        finally:
            with self._lock:
                self._busy.discard(probe.tier)

    def close(self) -> None:
        self._thread.close()


# -- the worker -------------------------------------------------------------------


class UCMWorker:
    """The worker role's hooks, over one way of loading and the saves."""

    def __init__(self, *, store: KVStore, namespace_digest: bytes, tp_rank: int, num_blocks: int,
                 max_pending_nbytes: int, stats: StatsCollector, blocks_per_request: int = 0,
                 load_mode: LoadMode | str = LoadMode.SYNC, events: OutcomeLog | None = None,
                 share_failures: Callable[[set[int]], set[int]] | None = None,
                 observer: LoadObserver | None = None) -> None:
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
        # load_policy auto: what the scheduler's decision is made of.
        self.observer = observer
        self.clock: StepClock | None = None
        self.prober: Prober | None = None

    def register_kv_caches(self, kv_caches) -> None:
        self.transfer = BlockTransfer(kv_caches, self.num_blocks)
        self.payload_nbytes = self.transfer.payload_nbytes
        self.block_nbytes = blockfmt.block_nbytes(self.payload_nbytes)
        self._layer_index = {layer.name: i for i, layer in enumerate(self.transfer.layers)}
        parts = dict(store=self.store, transfer=self.transfer, namespace_digest=self.namespace_digest,
                     tp_rank=self.tp_rank, stats=self.stats, events=self.events, report=self._report)
        # Loads: a whole prompt's blocks at once where they fit in 512 MiB
        # (more are loaded a pool's worth at a time), touched now rather
        # than during the first hit.  Saves: the backlog bound itself, its
        # pages mapped as they are first used on CPU.
        load_rows = max(1, min(self.blocks_per_request or 1, (512 << 20) // self.block_nbytes))
        self.load_pool = self.transfer.row_pool(self.block_nbytes, blockfmt.HEADER_NBYTES,
                                                load_rows * self.block_nbytes)
        self.save_pool = self.transfer.row_pool(self.block_nbytes, blockfmt.HEADER_NBYTES,
                                                self.max_pending_nbytes, prefault=self.transfer.on_cuda)
        reader = dict(parts)
        if self.observer is not None:
            reader["store"] = observe_reads(self.store, self.observer)
            self.clock = StepClock(self.observer, on_cuda=self.transfer.on_cuda)
            self.prober = Prober(reader["store"], self.block_nbytes, self.tp_rank)
        self.loads = _LOADS[self.load_mode](BlockReader(**reader, pool=self.load_pool))
        self.saves = Saves(**parts, pool=self.save_pool, share_failures=self._share_failures)
        logger.info("ucm-connector: %d layers registered, %d bytes of KV per block and rank",
                    self.transfer.num_layers, self.payload_nbytes)

    # -- the hooks, in the order vLLM calls them in a step ------------------------

    def begin_step(self, num_tokens: int, plans: list[BlockPlan], probes: list[BlockProbe]) -> None:
        """A step's plan is bound: its forward pass is about to run."""
        if self.clock is not None:
            loads_first = bool(plans) and self.load_mode is not LoadMode.ASYNC
            self.clock.begin(num_tokens, loads_first=loads_first)
        if probes and self.prober is not None:
            self.prober.probe(probes)

    def load(self, plans: list[BlockPlan]) -> None:
        """``start_load_kv``: start (sync: do) this step's loads."""
        if plans and self.loads is not None:
            if self.clock is None:
                self.loads.start(plans)
                return
            with self.clock.excluded():
                self.loads.start(plans)
            self.clock.loads_done()

    def wait_for_layer(self, layer_name: str) -> None:
        if self.loads is not None:
            if self.clock is None:
                self.loads.wait_for_layer(self._layer_index.get(layer_name, 0))
                return
            with self.clock.excluded():
                self.loads.wait_for_layer(self._layer_index.get(layer_name, 0))

    def end_step(self) -> None:
        """``wait_for_save``: the step's forward pass is done."""
        if self.clock is not None:
            self.clock.end()

    def take_measurements(self):
        """``(reads, steps)`` measured since the last call, or None."""
        return self.observer.take() if self.observer is not None else None

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
        if self.prober is not None:
            self.prober.close()
        if self.transfer is not None:
            self.save_pool.close()
            self.load_pool.close()
