"""Saving a step's new blocks without making the engine wait.

``Saves`` gathers a step's new blocks out of the cache when its forward
pass is done (``wait_for_save``; on CUDA the gather is issued and the engine
goes on, its later kernels ordered after the page reads) into rows of a
pool bounded by ``max_pending_save_mib``, and hands them to one background
writer, which puts the rows themselves, so the engine never waits on the
store's I/O.  Blocks the store has are skipped; a full backlog skips saves
rather than wait; KV computed on a page whose load failed is never saved.

This module only writes to the store; loading is ``loads.py``'s.  It must
not import vLLM.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from store_backends import KVStore, StoreError

from . import blockfmt
from .blockio import Reporter, logger
from .counters import StatsCollector
from .hashing import keys_for_rank
from .outcomes import NOT_STORED, PRESENT, WRITTEN, OutcomeLog
from .plans import BlockPlan
from .rows import HostRows, RowPool
from .transfer import BlockTransfer, Transfer


class Saves:
    """A step's new blocks: checked against the store, gathered out of the
    cache into rows of a pool bounded by ``max_pending_save_mib`` (pinned
    and allocated once on CUDA, where the gather returns as soon as it is
    issued), and written by one background writer, which waits for the
    copy, seals each row's envelope and puts the rows themselves."""

    def __init__(self, *, store: KVStore, transfer: BlockTransfer, pool: RowPool, namespace_digest: bytes,
                 tp_rank: int, stats: StatsCollector, events: OutcomeLog, report: Reporter,
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
