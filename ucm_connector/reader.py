"""Reading a batch of blocks from the store into their pages.

``BlockReader`` reads a batch of blocks with one ``get_into`` straight into
rows of a pool (pinned and allocated once on CUDA), checks every envelope
and checksum, copies the good blocks into their pages (``BlockTransfer``)
and deletes bad ones from the store: a bad block would otherwise be found,
fail and be recomputed on every later hit.

This module decides nothing about when or on which thread blocks are read
(``loads.py`` does), and must not import vLLM.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from store_backends import StoreError

from . import blockfmt
from .blockio import BlockIO
from .checksums import checksums
from .hashing import keys_for_rank
from .outcomes import REMOVED
from .plans import BlockPlan
from .rows import HostRows
from .transfer import Transfer


class ReadChunk:
    """Blocks read into rows of the pool: ``good`` are the indices of the rows
    that passed their checks."""

    def __init__(self, block_ids: list[int], rows: HostRows, good: list[int]) -> None:
        self.block_ids = block_ids
        self.rows = rows
        self.good = good

    @property
    def good_ids(self) -> list[int]:
        return [self.block_ids[i] for i in self.good]


class BlockReader(BlockIO):
    """Reads, checks and copies batches of blocks into their pages, through
    rows of one pool (pinned and allocated once on CUDA): the store writes
    into the rows themselves, and the copy into the pages reads them.  On
    CPU, where the store reads a value into several buffers without a
    temporary (``reads_into_parts``) and every page is one run of bytes, a
    block goes straight into its pages instead, and is checked there: one
    copy fewer.  A block that fails its check then leaves its pages
    written, like any failed load: vLLM recomputes them."""

    @property
    def into_pages(self) -> bool:
        return self.transfer.pages_contiguous and self.store.reads_into_parts

    def _read(self, keys: list[bytes], rows: np.ndarray) -> list[bool]:
        try:
            return self.store.get_into(keys, [memoryview(row) for row in rows])
        except StoreError as exc:
            self.report.failed("store load", exc)
            return [False] * len(keys)

    def _check(self, keys: list[bytes], found: list[bool], verify: Callable[[int], object]
               ) -> tuple[list[int], list[bytes]]:
        """Indices of the blocks that were found and passed ``verify(i)``
        (a ``blockfmt`` check of block i), and keys of the blocks that were
        found but failed it."""
        good: list[int] = []
        bad_keys: list[bytes] = []
        for i, ok in enumerate(found):
            if ok:
                try:
                    verify(i)
                    good.append(i)
                except blockfmt.BlockFormatError as exc:
                    self.report.failed(f"block check ({exc.reason})", exc)
                    bad_keys.append(keys[i])
        return good, bad_keys

    def read(self, plans: list[BlockPlan], *, scatter: bool = True, after=None, ordered: bool = True
             ) -> tuple[list[int], set[int], list[ReadChunk], list[Transfer]]:
        """Read the plans' blocks (a batch per pool's worth), check them and
        (``scatter``) copy the good ones into their pages, ordered after the
        work queued on the stream ``after`` (CUDA; ``ordered``: and that
        stream waits for them, see ``BlockTransfer.scatter_rows``).  Returns
        the block ids, the bad ones, the chunks still holding rows
        (``scatter=False``: the caller copies and releases them) and the
        issued copies.  Bad blocks go to the stats and are deleted from the
        store."""
        block_ids = [b for plan in plans for b in plan.block_ids]
        keys = keys_for_rank([k for plan in plans for k in plan.keys], self.tp_rank)
        if scatter and self.into_pages:
            bad, bad_keys = self._read_into_pages(block_ids, keys)
            self._drop(bad_keys, num_good=len(keys) - len(bad), num_keys=len(keys))
            return block_ids, bad, [], []
        kept: list[ReadChunk] = []
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
                found = self._read(chunk_keys, rows.rows)
                # The payloads' checksums, on several threads.
                lo, hi = blockfmt.HEADER_NBYTES, blockfmt.HEADER_NBYTES + self.payload_nbytes
                found_at = [i for i, ok in enumerate(found) if ok]
                sums = dict(zip(found_at, checksums([rows.rows[i, lo:hi] for i in found_at])))
                good, chunk_bad_keys = self._check(
                    chunk_keys, found,
                    lambda i: blockfmt.verify(rows.rows[i], self.namespace_digest, self.payload_nbytes,
                                              key=chunk_keys[i], payload_checksum=sums[i]))
            except BaseException:
                rows.release()
                raise
            bad_keys += chunk_bad_keys
            num_good += len(good)
            chunk = ReadChunk(ids, rows, good)
            bad |= set(ids) - set(chunk.good_ids)
            if not scatter:
                kept.append(chunk)
                continue
            copy = None
            try:
                if good:
                    copy = self.transfer.scatter_rows(chunk.good_ids, rows, row_ids=good, after=after,
                                                      ordered=ordered)
            finally:
                rows.release(after=copy)
            if copy is not None:
                copies.append(copy)
        self._drop(bad_keys, num_good=num_good, num_keys=len(keys))
        return block_ids, bad, kept, copies

    def _read_into_pages(self, block_ids: list[int], keys: list[bytes]) -> tuple[set[int], list[bytes]]:
        """Read the blocks straight into their pages (headers into a small
        array of their own) and check them there.  Returns the block ids
        that failed and the keys of those found but bad."""
        headers = np.empty((len(keys), blockfmt.HEADER_NBYTES), dtype=np.uint8)
        parts = [[memoryview(headers[i])] + self.transfer.page_parts(b) for i, b in enumerate(block_ids)]
        checked: dict[int, blockfmt.BlockFormatError | None] = {}

        def check(i: int) -> None:
            try:
                blockfmt.verify_parts(headers[i], parts[i][1:], self.namespace_digest, self.payload_nbytes,
                                      key=keys[i])
                checked[i] = None
            except blockfmt.BlockFormatError as exc:
                checked[i] = exc

        try:
            # One call for the whole batch (a round trip per group of blocks
            # measured slower), each block checked as soon as it is in its
            # pages, while still in the CPU's caches: after the whole batch
            # the check reads it back from memory (benchmarks/RESULTS.md).
            found = self.store.get_into_parts(keys, parts, check)
        except StoreError as exc:
            self.report.failed("store load", exc)
            found = [False] * len(keys)

        def verdict(i: int) -> None:
            if i not in checked:     # a store that did not call back
                check(i)
            if checked[i] is not None:
                raise checked[i]

        good, bad_keys = self._check(keys, found, verdict)
        return set(block_ids) - {block_ids[i] for i in good}, bad_keys

    def _drop(self, bad_keys: list[bytes], *, num_good: int, num_keys: int) -> None:
        """Delete the blocks that failed their checks and count the batch."""
        if bad_keys:
            # A bad block would otherwise be found, fail and be recomputed
            # on every later hit, and never be saved again.
            try:
                self.store.delete(bad_keys)
                self.events.add(REMOVED, bad_keys)
            except StoreError as exc:
                self.report.failed("store delete of bad blocks", exc)
        self.stats.add(loaded_blocks=num_good, loaded_bytes=num_good * self.payload_nbytes,
                       load_errors=num_keys - num_good)
