"""Saving a step's new blocks without making the engine wait.

``Saves`` gathers a step's new blocks out of the cache when its forward
pass is done (``wait_for_save``; on CUDA the gather is issued and the engine
goes on, its later kernels ordered after the page reads) into rows of a
pool bounded by ``max_pending_save_mib``, and hands them, a part of about
``SAVE_PART_NBYTES`` (on CUDA ``SAVE_PART_NBYTES_CUDA``) at a time, to one
background writer, which puts the rows themselves, so the engine never
waits on the store's I/O.  Blocks the store has are skipped; a full
backlog skips saves rather than wait; KV computed on a page whose load
failed is never saved.

On CPU, a store that writes a value from several buffers
(``writes_from_parts``: shm, or a tier over shm) instead takes the blocks
straight from the pages in ``wait_for_save`` (one copy, not two), unless
the step re-saves blocks (their deletes stay on the writer); after it
refuses a save, saves go through the writer for ``DIRECT_SAVE_PAUSE_S``,
twice as long after each further refusal in a row.

With ``save_layerwise`` (by default on CUDA) the gather moves into the
forward pass: the step's save blocks get their rows when the step begins,
each layer's pages are copied out as vLLM reports the layer written
(``save_kv_layer``), and ``wait_for_save`` copies what was not reported,
applies the same checks and hands the rows of the blocks to store to the
writer.

This module only writes to the store; loading is ``loads.py``'s.  It must
not import vLLM.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Callable

from store_backends import StoreError

from . import blockfmt
from .blockio import BlockIO, JobThread, logger
from .checksums import checksums
from .hashing import keys_for_rank
from .outcomes import NOT_STORED, PRESENT, WRITTEN
from .plans import BlockPlan
from .rows import HostRows
from .transfer import Transfer

if TYPE_CHECKING:
    from .layer_copies import LayerGather


#: Bytes of payload handed to the writer at a time.
SAVE_PART_NBYTES = 24 << 20

#: On CUDA: each part costs the engine thread the issue of its copies
#: (about 0.3 ms on an H100 machine), and the writer waits for them anyway.
SAVE_PART_NBYTES_CUDA = 64 << 20

#: On CUDA, with ``save_layerwise``, a step saves layer by layer only from
#: this many bytes of payload: each layer costs a few launches of engine
#: thread, which a step saving a block or two does not win back.
LAYERWISE_SAVE_MIN_NBYTES = 16 << 20

#: After a save straight into the store failed (refused, or the store did
#: not answer), saves go through the writer for this long, so that a store
#: that stopped answering holds up the engine thread once, not every step;
#: each failure in a row doubles the pause, up to DIRECT_SAVE_MAX_PAUSE_S.
DIRECT_SAVE_PAUSE_S = 30.0
DIRECT_SAVE_MAX_PAUSE_S = 600.0

#: A layer gather begun for a step: each plan's first row, by the plan's id
#: (with the plan, so that the id cannot be reused while it is kept), and
#: the gather.
_Layered = tuple[dict[int, tuple[BlockPlan, int]], "LayerGather"]


class Saves(BlockIO):
    """A step's new blocks: checked against the store, gathered out of the
    cache into rows of a pool bounded by ``max_pending_save_mib`` (pinned
    and allocated once on CUDA, where the gather returns as soon as it is
    issued), and written by one background writer, which waits for the
    copy, seals each row's envelope and puts the rows themselves.  Built
    from ``BlockIO``'s parts, and ``share_failures`` (below)."""

    def __init__(self, *, share_failures: Callable[[set[int]], set[int]] | None = None,
                 layerwise: bool = False, **parts) -> None:
        super().__init__(**parts)
        # save_layerwise: the step's save blocks are gathered as each
        # layer's attention finishes (``begin``, ``layer_done``).
        self.layerwise = layerwise and self.transfer.can_copy_by_layer
        self._layered: _Layered | None = None
        # With TP > 1 every rank's forward pass reads every rank's pages
        # (through the all-reduce), so a save is dropped when a load failed
        # on any rank: this returns the union over the TP group.
        self._share_failures = share_failures
        # Blocks whose load failed, this step and the one before.
        self._recent_failures: collections.deque[set[int]] = collections.deque([set(), set()], maxlen=2)
        # Jobs: (keys, rows, their copy, keys whose stored value is replaced).
        self._writer = JobThread(self._write, name="ucm-save-writer", on_start=self.transfer.bind_thread)
        # On CPU, a store that writes a value from several buffers
        # (``writes_from_parts``: shm, a tier over shm) takes the blocks
        # straight from the pages, one copy instead of two (``_put_direct``).
        self.direct = self.transfer.pages_contiguous and self.store.writes_from_parts
        self._direct_paused_until = 0.0
        self._direct_pause = DIRECT_SAVE_PAUSE_S

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

    # -- save_layerwise: the gather runs during the forward pass -------------

    def begin(self, plans: list[BlockPlan]) -> None:
        """The step's forward pass is about to run: with ``layerwise``, take
        rows for all of its save blocks and gather them layer by layer as
        ``layer_done`` comes.  Where the rows cannot be had now, the step
        saves as without ``layerwise``."""
        self._abandon()
        if not self.layerwise or not plans:
            return
        block_ids = [b for plan in plans for b in plan.block_ids]
        if not block_ids or (self.transfer.on_cuda
                             and len(block_ids) * self.payload_nbytes < LAYERWISE_SAVE_MIN_NBYTES):
            return
        rows = self.pool.take(len(block_ids), wait=False)
        if rows is None:
            return
        try:
            gather = self.transfer.layer_gather(block_ids, rows)
        except Exception as exc:
            rows.release()
            self._copy_failed(exc)
            return
        starts, at = {}, 0
        for plan in plans:
            starts[id(plan)] = (plan, at)
            at += len(plan.block_ids)
        self._layered = (starts, gather)

    def layer_done(self, layer: int) -> None:
        """``save_kv_layer``: layer ``layer``'s KV of the step is written.
        A copy that fails never fails the forward pass: the step's blocks
        are then gathered whole in ``wait_for_save``."""
        if self._layered is not None:
            try:
                self._layered[1].layer(layer)
            except Exception as exc:
                self._abandon()
                self._copy_failed(exc)

    def _copy_failed(self, exc: Exception) -> None:
        if self.report.first("layerwise save copy"):
            logger.warning("ucm-connector: a layer-by-layer save copy failed (%s); such steps are saved "
                           "after the forward pass instead (logged once)", exc)

    def _abandon(self) -> None:
        """Drop a layer gather that no save took: it copies nothing more,
        and its rows come back once what it issued is done."""
        if self._layered is not None:
            gather = self._layered[1]
            self._layered = None
            gather.rows.release(after=gather.abort())

    # -- the save --------------------------------------------------------------

    def save(self, plans: list[BlockPlan]) -> None:
        """``wait_for_save``: the step's blocks to save (those kept by
        ``drop_tainted``)."""
        try:
            self._save(plans)
        finally:
            self._abandon()   # a layer gather this save did not take

    def _save(self, plans: list[BlockPlan]) -> None:
        layered = self._layered
        if layered is not None and not all(layered[0].get(id(plan), (None,))[0] is plan for plan in plans):
            layered = None   # not the plans it was begun with
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
        if layered is not None:
            self._layered = None
            if self._save_gathered(plans, layered, keys, todo, overwrite):
                if skipped:
                    self.stats.add(skipped_saves=skipped)
                self.stats.add(save_seconds=time.perf_counter() - t0)
                return
            # The layer gather failed: the blocks are gathered whole below.
        if (todo and self.direct and not any(overwrite[i] for i in todo) and self._writer.idle()
                and time.monotonic() >= self._direct_paused_until):
            # Behind the writer's jobs it would race their deletes and puts;
            # a re-save's delete (a tier's waits for its backlog) stays there.
            self._put_direct([block_ids[i] for i in todo], [keys[i] for i in todo])
            if skipped:
                self.stats.add(skipped_saves=skipped)
            self.stats.add(save_seconds=time.perf_counter() - t0)
            return
        # Parts of about SAVE_PART_NBYTES: the writer puts one while the
        # next is gathered (benchmarks/RESULTS.md).
        part_nbytes = SAVE_PART_NBYTES_CUDA if self.transfer.on_cuda else SAVE_PART_NBYTES
        step = min(self.pool.capacity, max(1, part_nbytes // self.payload_nbytes))
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
            except Exception as exc:
                # A copy that fails (on a GPU, out of memory for a staging
                # slot, say) costs the step's saves left, never the step.
                rows.release()
                self.report.failed("block save copy", exc)
                rest = todo[lo:]
                skipped += len(rest)
                self.events.add(NOT_STORED, [keys[i] for i in rest])
                break
            except BaseException:
                rows.release()
                raise
            self._writer.put(([keys[i] for i in part], rows, copy, [keys[i] for i in part if overwrite[i]], None))
        if skipped:
            self.stats.add(skipped_saves=skipped)
        self.stats.add(save_seconds=time.perf_counter() - t0)

    def _save_gathered(self, plans: list[BlockPlan], layered: "_Layered",
                       keys: list[bytes], todo: list[int], overwrite: list[bool]) -> bool:
        """Hand the writer the rows of a layer gather that hold blocks to
        save (``todo``, indices into the kept ``plans``' blocks); False if
        the gather failed (its rows given back)."""
        starts, gather = layered
        row_of = [starts[id(plan)][1] + j for plan in plans for j in range(len(plan.block_ids))]
        whole_in_forward = gather.layers_left == 0
        try:
            copy = gather.finish()
        except Exception as exc:
            gather.rows.release(after=gather.abort())
            self._copy_failed(exc)
            return False
        if whole_in_forward:
            self.stats.add(layerwise_saved_blocks=len(todo))
        if not todo:
            gather.rows.release(after=copy)
            return True
        self._writer.put(([keys[i] for i in todo], gather.rows, copy, [keys[i] for i in todo if overwrite[i]],
                          [row_of[i] for i in todo]))
        return True

    def _put_direct(self, block_ids: list[int], keys: list[bytes]) -> None:
        """Put the blocks straight from their pages, on the engine thread,
        before ``wait_for_save`` returns (vLLM may reuse the pages in the
        next step): the store copies each page once, and each block's
        header is sealed just before its copy, over a checksum read while
        its pages are about to be copied (benchmarks/RESULTS.md)."""
        headers = [bytearray(blockfmt.HEADER_NBYTES) for _ in keys]
        parts = [[memoryview(header)] + self.transfer.page_parts(b) for header, b in zip(headers, block_ids)]

        def seal(i: int) -> None:
            hasher = blockfmt.payload_hasher()
            for page in parts[i][1:]:
                hasher.update(page)
            headers[i][:] = blockfmt.header_bytes(self.namespace_digest, self.payload_nbytes,
                                                  hasher.intdigest(), key=keys[i])

        try:
            stored = self.store.put_parts(keys, parts, seal)
        except Exception as exc:
            self.report.failed("store save", exc)
            stored = [False] * len(keys)
        if all(stored):
            self._direct_pause = DIRECT_SAVE_PAUSE_S
        else:
            self._direct_paused_until = time.monotonic() + self._direct_pause
            self._direct_pause = min(2 * self._direct_pause, DIRECT_SAVE_MAX_PAUSE_S)
        self._written(keys, stored)

    def _write(self, job: tuple[list[bytes], HostRows, Transfer, list[bytes], list[int] | None]) -> None:
        keys, rows, copy, replace, picks = job
        t0 = time.perf_counter()
        try:
            copy.wait()
            # The rows to put: all of them, or those a layer gather picked.
            chosen = list(rows.rows) if picks is None else [rows.rows[i] for i in picks]
            # Sealed here, after the copy: on CUDA it writes whole rows.
            # Checksums the copy did not take are taken on several threads.
            sums = copy.checksums
            if sums is None:
                lo = blockfmt.HEADER_NBYTES
                sums = checksums([row[lo:lo + self.payload_nbytes] for row in chosen])
            for row, key, checksum in zip(chosen, keys, sums):
                blockfmt.pack_header_into(row, self.namespace_digest, self.payload_nbytes, checksum, key=key)
            if replace:
                # Stores keep the first value put under a key; a value
                # that must not survive is deleted first (in every tier).
                self.store.delete(replace)
            stored = self.store.put(keys, [memoryview(row) for row in chosen])
        except Exception as exc:  # the writer must outlive any one bad batch
            self.report.failed("store save", exc)
            stored = [False] * len(keys)
        finally:
            rows.release()
        self._written(keys, stored, time.perf_counter() - t0)

    def _written(self, keys: list[bytes], stored: list[bool], seconds: float = 0.0) -> None:
        """Count and report a put's outcome."""
        n = sum(stored)
        if n < len(keys) and self.report.first("store refused"):
            logger.warning("ucm-connector: store %s refused %d of %d blocks (full?); refused saves "
                           "are skipped and counted in vllm:ucm_skipped_saves_total (logged once)",
                           self.store.url, len(keys) - n, len(keys))
        self.events.add(WRITTEN, [k for k, ok in zip(keys, stored) if ok])
        self.events.add(NOT_STORED, [k for k, ok in zip(keys, stored) if not ok])
        self.stats.add(saved_blocks=n, saved_bytes=n * self.payload_nbytes,
                       skipped_saves=len(keys) - n, save_seconds=seconds)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        self._abandon()
        self.flush(timeout=60)
        self._writer.close()
