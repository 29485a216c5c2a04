"""Saving a step's new blocks without making the engine wait.

``Saves`` gathers a step's new blocks out of the cache when its forward
pass is done (``wait_for_save``; on CUDA the gather is issued and the engine
goes on, its later kernels ordered after the page reads) into rows of a
pool bounded by ``max_pending_save_mib``, and hands them, a part of about
``SAVE_PART_NBYTES`` at a time, to one background writer, which puts the
rows themselves, so the engine never waits on the store's I/O.  Blocks the
store has are skipped; a full backlog skips saves rather than wait; KV
computed on a page whose load failed is never saved.

This module only writes to the store; loading is ``loads.py``'s.  It must
not import vLLM.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

from store_backends import StoreError

from . import blockfmt
from .blockio import BlockIO, JobThread, logger
from .hashing import keys_for_rank
from .outcomes import NOT_STORED, PRESENT, WRITTEN
from .plans import BlockPlan
from .rows import HostRows
from .transfer import Transfer


#: Bytes of payload handed to the writer at a time.
SAVE_PART_NBYTES = 24 << 20


class Saves(BlockIO):
    """A step's new blocks: checked against the store, gathered out of the
    cache into rows of a pool bounded by ``max_pending_save_mib`` (pinned
    and allocated once on CUDA, where the gather returns as soon as it is
    issued), and written by one background writer, which waits for the
    copy, seals each row's envelope and puts the rows themselves.  Built
    from ``BlockIO``'s parts, and ``share_failures`` (below)."""

    def __init__(self, *, share_failures: Callable[[set[int]], set[int]] | None = None, **parts) -> None:
        super().__init__(**parts)
        # With TP > 1 every rank's forward pass reads every rank's pages
        # (through the all-reduce), so a save is dropped when a load failed
        # on any rank: this returns the union over the TP group.
        self._share_failures = share_failures
        # Blocks whose load failed, this step and the one before.
        self._recent_failures: collections.deque[set[int]] = collections.deque([set(), set()], maxlen=2)
        # Jobs: (keys, rows, their copy, keys whose stored value is replaced).
        self._writer = JobThread(self._write, name="ucm-save-writer")

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
        # Parts of about SAVE_PART_NBYTES: the writer puts one while the
        # next is gathered (benchmarks/RESULTS.md).
        step = min(self.pool.capacity, max(1, SAVE_PART_NBYTES // self.payload_nbytes))
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
                # On CPU the gather checksums each payload as it copies it.
                copy = self.transfer.gather_rows([block_ids[i] for i in part], rows,
                                                 hasher=blockfmt.payload_hasher)
            except BaseException:
                rows.release()
                raise
            self._writer.put(([keys[i] for i in part], rows, copy, [keys[i] for i in part if overwrite[i]]))
        if skipped:
            self.stats.add(skipped_saves=skipped)
        self.stats.add(save_seconds=time.perf_counter() - t0)

    def _write(self, job: tuple[list[bytes], HostRows, Transfer, list[bytes]]) -> None:
        keys, rows, copy, replace = job
        t0 = time.perf_counter()
        try:
            copy.wait()
            # Sealed here, after the copy: on CUDA it writes whole rows.
            if copy.checksums is not None:
                for row, key, checksum in zip(rows.rows, keys, copy.checksums):
                    blockfmt.pack_header_into(row, self.namespace_digest, self.payload_nbytes, checksum, key=key)
            else:
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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        self.flush(timeout=60)
        self._writer.close()
