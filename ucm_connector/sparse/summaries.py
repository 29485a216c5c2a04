"""Per-block key summaries: for every cache block and KV head, the sums of
the keys of equal slices of the block (their mean keys, scored against the
query) and, when asked for, the elementwise minimum and maximum of the
block's keys (Quest's bound: for a query q, ``sum_d max(q_d * min_d, q_d *
max_d)`` is an upper bound of q . k over the block's keys).

Summaries follow the keys as they are written (prefill chunks and decode
tokens), so they cost no extra read of the cache.  Blocks whose content was
put there by someone else (vLLM's prefix cache, a KV connector's load, a
block copy, or anything written while no method was active) are told apart
by epochs: the step hook bumps a block's epoch when its content comes from
outside, and a layer's summary of a block is trusted only while it was made
at the block's current epoch.  A stale summary is checked against one key
element per token read from the page when the block was completed
(``probe``): a block refilled with the same keys (a prefix-cache hit, a store
load of the same prefix) keeps its summary; any other is rebuilt from its
page.  Blocks the step hook names are checked at that step, in shapes the
host fixes (``refresh_known``, ``copy_blocks``); only blocks nobody named
(written before the method started) are found by comparing epochs on the
device (``stale`` / ``refresh``), which waits for it.

Every update has a shape fixed by its inputs' shapes, never by their values:
writes that must go nowhere go to a scratch row (see ``LayerSummaries``).

Knows attention math and tensors; knows nothing of vLLM's classes.
"""

from __future__ import annotations

import torch

#: The most keys one pass of ``LayerSummaries.rebuild`` reads from the pages
#: (as float32); each pass holds a few copies of them.
REBUILD_PASS_NBYTES = 64 << 20


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host integers on ``device``.  On CUDA it goes
    through pinned memory with a non-blocking copy: a plain ``torch.tensor(...,
    device="cuda")`` copies from pageable memory and waits for the device."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class BlockEpochs:
    """One counter per cache block, shared by all layers; bumped when a
    block's content is replaced behind the forward pass's back.  One more
    entry than there are blocks: the scratch row (see ``LayerSummaries``)."""

    def __init__(self) -> None:
        self.epochs: torch.Tensor | None = None
        self._pending: list[int] = []

    def bump(self, block_ids) -> None:
        self._pending.extend(int(b) for b in block_ids)

    def get(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        if self.epochs is None or self.epochs.numel() < num_blocks + 1 or self.epochs.device != device:
            fresh = torch.zeros(num_blocks + 1, dtype=torch.int64, device=device)
            if self.epochs is not None:
                n = min(num_blocks, self.epochs.numel() - 1)
                fresh[:n] = self.epochs[:n].to(device)
            self.epochs = fresh
        if self._pending:
            # Filtered here, on the host: a mask on the device would wait for it.
            ids = [b for b in self._pending if 0 <= b < self.epochs.numel() - 1]
            self._pending.clear()
            if ids:
                ids_t = to_device(ids, device)
                self.epochs.index_add_(0, ids_t, torch.ones_like(ids_t))
        return self.epochs


class WritePlan:
    """Where one step's new keys go, by block: the same for every layer of
    the step, so it is worked out once.

    Every tensor here has a shape fixed by the number of tokens, never by
    their values, so that building and using the plan never waits for the
    device: padding tokens (slot -1) and "no such block" entries point at
    the scratch row ``trash`` instead of being filtered out."""

    def __init__(self, slot_mapping: torch.Tensor, block_size: int, trash: int, num_reqs: int) -> None:
        slots = slot_mapping.to(torch.int64)
        written = slots >= 0
        self.num_tokens = int(slots.shape[0])
        self.blocks = torch.where(written, torch.div(slots, block_size, rounding_mode="floor"), trash)
        self.offsets = torch.where(written, slots % block_size, 0)
        self.starts = torch.where(written & (self.offsets == 0), self.blocks, trash)
        ends = written & (self.offsets == block_size - 1)
        # Blocks completed by these tokens take their probe from the page.
        # A request's tokens are consecutive, so at most one token in
        # block_size completes a block, plus one per request: pick that many
        # entries (end tokens first) rather than a data-dependent count.
        bound = min(self.num_tokens, self.num_tokens // block_size + num_reqs)
        if bound < self.num_tokens:
            order = torch.argsort((~ends).to(torch.uint8), stable=True)[:bound]
            end_blocks, ends = self.blocks.index_select(0, order), ends.index_select(0, order)
        else:
            end_blocks = self.blocks
        self.end_targets = torch.where(ends, end_blocks, trash)
        self.end_sources = torch.where(ends, end_blocks, 0)      # any real block: read, then dropped
        self._parts: tuple[int, torch.Tensor] | None = None
        self._index: torch.Tensor | None = None

    def parts(self, parts: int, part_size: int) -> torch.Tensor:
        """Row of each token in a ``[(num_blocks + 1) * parts]`` view."""
        if self._parts is None or self._parts[0] != parts:
            self._parts = (parts, self.blocks * parts + torch.div(self.offsets, part_size, rounding_mode="floor"))
        return self._parts[1]

    def index(self, shape: torch.Size) -> torch.Tensor:
        """``blocks`` broadcast over a key's ``[H, D]``."""
        if self._index is None or self._index.shape[1:] != shape:
            self._index = self.blocks.view(-1, 1, 1).expand(-1, *shape)
        return self._index


class LayerSummaries:
    """What one layer knows of each cache block's keys, per KV head: the sum
    of the keys of each of the block's ``parts`` equal slices (``part_sum``
    ``[num_blocks + 1, parts, H, D]``; a slice's mean key, finer than the
    block's, keeps a few strong keys from being averaged away over 128
    tokens), and with ``bounds`` their elementwise max and min side by side
    (``minmax`` ``[num_blocks + 1, H, 2D]``: Quest's bound is one matmul
    against ``[max(q, 0), min(q, 0)]``).  How many keys each slice holds
    follows from the block's fill, which the caller knows: a current summary
    covers exactly the block's first ``fill`` tokens.

    Every tensor has one row more than the cache has blocks: row
    ``num_blocks`` (``trash``) takes the writes that fixed-shape updates
    must send somewhere (padding tokens, "not this block"), so that no
    update has to filter its indices first, which would wait for the device."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device, parts: int = 1, bounds: bool = True,
                 made_at: torch.Tensor | None = None) -> None:
        d = head_size
        rows = num_blocks + 1
        self.minmax = self.kmax = self.kmin = None
        if bounds:
            self.minmax = torch.empty((rows, num_kv_heads, 2 * d), dtype=dtype, device=device)
            self.kmax = self.minmax[:, :, :d]
            self.kmin = self.minmax[:, :, d:]
            self.kmax.fill_(float("-inf"))
            self.kmin.fill_(float("inf"))
        self.parts = parts
        self.part_size = block_size // parts
        self.part_sum = torch.zeros((rows, parts, num_kv_heads, d), dtype=dtype, device=device)
        # Epoch at which each block's summary was started; -1 = never.  May be
        # shared by the layers of a model: they all see the same writes.
        self.made_at = (torch.full((rows,), -1, dtype=torch.int64, device=device)
                        if made_at is None else made_at)
        # Per token of each full block, the key element KeyPages.probe reads
        # (kv head 0, dim t % head_size), read from the page when the block
        # was completed or rebuilt; NaN where unknown (never equal).  Only
        # full blocks come back behind the forward's back (prefix-cache hits
        # and connector loads are whole blocks).
        self.probe = torch.full((rows, block_size), float("nan"), dtype=dtype, device=device)
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        # Keys went by unfolded (calls left dense below a length threshold):
        # the blocks the next thinned call reads are rebuilt from their pages.
        self.behind = False
        # Of a layer left behind after a rebuild: the requests whose keys it
        # still has not seen (none of them ran in that step); it rebuilds
        # again only at a step one of them runs in (``SummaryKeeper.due``).
        # None: at its next thinned call.
        self.awaited: set[str] | None = None
        # Under speculative decoding with pages that cannot be read: keys
        # folded into each block since it started (``distrust_rewritten``).
        self.folded: torch.Tensor | None = None

    @staticmethod
    def nbytes(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
               parts: int = 1, bounds: bool = True) -> int:
        """What one layer's summaries take (``made_at``, shared, aside)."""
        rows, item = num_blocks + 1, torch.empty((), dtype=dtype).element_size()
        per_row = parts * num_kv_heads * head_size + block_size + (2 * num_kv_heads * head_size if bounds else 0)
        return rows * per_row * item

    @property
    def num_blocks(self) -> int:
        return self.part_sum.shape[0] - 1

    @property
    def trash(self) -> int:
        return self.part_sum.shape[0] - 1

    def add_keys(self, key: torch.Tensor, plan: "WritePlan", epochs: torch.Tensor, pages=None) -> None:
        """Fold the keys just written (``plan`` says where) into their
        blocks' summaries.  A token at offset 0 starts its block afresh:
        tokens of a block are written in order, so that is where a block's
        new content begins (whatever the block held before).  Blocks
        completed by these keys get their probe from ``pages`` (the cache
        already holds the keys) if their summary saw them start; without
        pages they get none."""
        if plan.num_tokens == 0:
            return
        starts = plan.starts
        if self.minmax is not None:
            self.kmin.index_fill_(0, starts, float("inf"))
            self.kmax.index_fill_(0, starts, float("-inf"))
        self.part_sum.index_fill_(0, starts, 0.0)
        self.made_at.index_copy_(0, starts, epochs.index_select(0, starts))
        self.probe.index_fill_(0, starts, float("nan"))
        if pages is not None:
            # Only a summary that saw its block start can vouch for the
            # block's keys: one started unseen must not look current later.
            targets = plan.end_targets
            seen_start = (self.made_at.index_select(0, targets) == epochs.index_select(0, targets)).unsqueeze(1)
            probe = pages.probe(plan.end_sources).to(self.probe.dtype)
            self.probe.index_copy_(0, targets, probe.masked_fill(~seen_start, float("nan")))
        key = key.to(self.part_sum.dtype)
        if self.minmax is not None:
            index = plan.index(key.shape[1:])
            self.kmin.scatter_reduce_(0, index, key, "amin")
            self.kmax.scatter_reduce_(0, index, key, "amax")
        parts = plan.parts(self.parts, self.part_size)
        self.part_sum.view(-1, *key.shape[1:]).index_add_(0, parts, key)

    def remake_completed(self, plan: "WritePlan", epochs: torch.Tensor, pages) -> None:
        """The summaries of the blocks these keys completed (``add_keys``
        has folded them), made again from their pages, current at their
        epoch.  Under speculative decoding a slot is written again after its
        draft was rejected, and a fold counts both keys: a block's summary
        is made exact where it stops changing.  Shapes fixed by the plan's
        (entries that completed nothing write the scratch row)."""
        src, dst = plan.end_sources, plan.end_targets
        step = self._pass_blocks()
        for lo in range(0, src.numel(), step):
            hi = lo + step
            self._store(dst[lo:hi], *pages.reduce(src[lo:hi], self.parts))
            self.probe.index_copy_(0, dst[lo:hi], pages.probe(src[lo:hi]).to(self.probe.dtype))
        self.made_at.index_copy_(0, dst, epochs.index_select(0, dst))

    def distrust_rewritten(self, plan: "WritePlan") -> None:
        """``remake_completed`` where the pages cannot be read: count the
        keys folded into each block since it started, and a block completed
        with more keys than it has slots (a slot written again after its
        draft was rejected) loses its summary (``made_at`` -1): it is then
        read rather than scored, as any block without one."""
        if self.folded is None:
            self.folded = torch.zeros_like(self.made_at, dtype=torch.int32)
        self.folded.index_fill_(0, plan.starts, 0)
        self.folded.index_add_(0, plan.blocks, torch.ones_like(plan.blocks, dtype=torch.int32))
        ends = plan.end_targets
        over = self.folded.index_select(0, ends) > self.block_size
        self.made_at.index_copy_(0, ends, torch.where(over, -1, self.made_at.index_select(0, ends)))

    def stale(self, blocks: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor:
        return self.made_at.index_select(0, blocks) != epochs.index_select(0, blocks)

    def refresh_known(self, full: torch.Tensor | None, partial: torch.Tensor | None,
                      partial_fills: torch.Tensor | None, epochs: torch.Tensor, pages) -> torch.Tensor:
        """Make the summaries of blocks known (on the host) to have been
        filled behind the forward current, without waiting for the device:
        ``full`` blocks and ``partial`` ones holding ``partial_fills``
        tokens (distinct ids).  Each is kept if its page still holds the keys
        its summary was made from, else rebuilt from the page: both are
        computed and one is chosen per block, so the shapes never depend on
        which.  Returns ``[kept, rebuilt]`` on the device."""
        counts = torch.zeros(2, dtype=torch.int64, device=self.part_sum.device)
        for blocks, fills, whole in ((full, None, True), (partial, partial_fills, False)):
            if blocks is None or blocks.numel() == 0:
                continue
            n = blocks.shape[0]
            if whole:
                fills = torch.full((n,), self.block_size, dtype=torch.int64, device=blocks.device)
            filled = torch.arange(self.block_size, device=blocks.device).unsqueeze(0) < fills.unsqueeze(1)
            seen = self.probe.index_select(0, blocks)
            now = pages.probe(blocks).to(seen.dtype)
            same = ((seen == now) | ~filled).all(dim=1)
            counts += torch.stack((same.sum(), (~same).sum()))
            self.made_at.index_copy_(0, blocks, epochs.index_select(0, blocks))
            if whole:
                kmin, kmax, part_sum = pages.reduce(blocks, self.parts)
            else:
                kmin, kmax, part_sum = self._from_pages(blocks, fills, pages)
            keep = same.view(n, 1, 1, 1)
            self.part_sum.index_copy_(0, blocks, torch.where(
                keep, self.part_sum.index_select(0, blocks), part_sum.to(self.part_sum.dtype)))
            if self.minmax is not None:
                self.kmin.index_copy_(0, blocks, torch.where(
                    keep[:, 0], self.kmin.index_select(0, blocks), kmin.to(self.kmin.dtype)))
                self.kmax.index_copy_(0, blocks, torch.where(
                    keep[:, 0], self.kmax.index_select(0, blocks), kmax.to(self.kmax.dtype)))
            self.probe.index_copy_(0, blocks, now.masked_fill(~filled, float("nan")))
        return counts

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, epochs: torch.Tensor) -> None:
        """vLLM copied whole pages ``src`` -> ``dst``: the summaries follow.
        A copy of a current summary is current at the destination's epoch;
        a copy of a stale one stays stale (never made)."""
        self.part_sum.index_copy_(0, dst, self.part_sum.index_select(0, src))
        if self.minmax is not None:
            self.minmax.index_copy_(0, dst, self.minmax.index_select(0, src))
        self.probe.index_copy_(0, dst, self.probe.index_select(0, src))
        current = self.made_at.index_select(0, src) == epochs.index_select(0, src)
        self.made_at.index_copy_(0, dst, torch.where(current, epochs.index_select(0, dst), -1))

    def rebuild(self, table: torch.Tensor, valid: torch.Tensor, fills: torch.Tensor, epochs: torch.Tensor,
                pages) -> None:
        """Summaries of every valid ``table`` entry (``fills`` tokens each)
        made again from the pages, in shapes fixed by the table's: invalid
        entries read block 0 and write the scratch row.  A pass reads at
        most ``REBUILD_PASS_NBYTES`` of keys (sizes known on the host, so
        no wait for the device): a whole batch's table at once would hold
        a few copies of every key it covers, gigabytes at long contexts."""
        flat, ok, fills = table.flatten(), valid.flatten(), fills.flatten()
        step = self._pass_blocks()
        for lo in range(0, flat.numel(), step):
            self._rebuild(flat[lo:lo + step], ok[lo:lo + step], fills[lo:lo + step], epochs, pages)
        self.behind = False

    def _pass_blocks(self) -> int:
        """Blocks one pass reads from the pages (``REBUILD_PASS_NBYTES``)."""
        per_block = self.block_size * self.num_kv_heads * self.head_size * self.part_sum.element_size()
        return max(1, REBUILD_PASS_NBYTES // per_block)

    def _rebuild(self, flat: torch.Tensor, ok: torch.Tensor, fills: torch.Tensor, epochs: torch.Tensor,
                 pages) -> None:
        src = torch.where(ok, flat, 0)
        dst = torch.where(ok, flat, self.trash)
        fills = torch.where(ok, fills, 0)
        self._store(dst, *self._from_pages(src, fills, pages))
        pad = torch.arange(self.block_size, device=src.device).unsqueeze(0) >= fills.unsqueeze(1)
        self.probe.index_copy_(0, dst, pages.probe(src).to(self.probe.dtype).masked_fill(pad, float("nan")))
        self.made_at.index_copy_(0, dst, epochs.index_select(0, dst))

    def _store(self, blocks: torch.Tensor, kmin, kmax, part_sum: torch.Tensor) -> None:
        """Summaries of ``blocks`` set to these (min and max ignored without bounds)."""
        self.part_sum.index_copy_(0, blocks, part_sum.to(self.part_sum.dtype))
        if self.minmax is not None:
            self.kmin.index_copy_(0, blocks, kmin.to(self.kmin.dtype))
            self.kmax.index_copy_(0, blocks, kmax.to(self.kmax.dtype))

    def _from_pages(self, blocks: torch.Tensor, fills: torch.Tensor, pages):
        """min, max and slice sums of the first ``fills`` tokens of each block."""
        keys = pages.read(blocks).to(self.part_sum.dtype)  # [n, B, H, D]
        pad = (torch.arange(self.block_size, device=keys.device).unsqueeze(0)
               >= fills.unsqueeze(1))[:, :, None, None]
        kmin = kmax = None
        if self.minmax is not None:
            kmin = keys.masked_fill(pad, float("inf")).amin(dim=1)
            kmax = keys.masked_fill(pad, float("-inf")).amax(dim=1)
        part_sum = keys.masked_fill(pad, 0.0).view(len(blocks), self.parts, self.part_size, *keys.shape[2:])
        return kmin, kmax, part_sum.sum(dim=2)

    def refresh(self, blocks: torch.Tensor, fills: torch.Tensor, epochs: torch.Tensor,
                pages) -> tuple[int, int]:
        """Make the summaries of these stale ``blocks`` (``fills`` = valid
        tokens in each) current: kept if the page still holds the keys they
        were made from, else rebuilt from the page.  Returns (kept, rebuilt).

        The path for blocks found stale on the device (a method that starts
        while requests run): it filters by value, so it waits for the device."""
        blocks, inverse = torch.unique(blocks, return_inverse=True)
        fills = torch.zeros_like(blocks).scatter_reduce_(0, inverse, fills, "amax", include_self=False)
        block_size = self.block_size
        seen = self.probe.index_select(0, blocks)
        now = pages.probe(blocks).to(seen.dtype)
        filled = torch.arange(block_size, device=blocks.device).unsqueeze(0) < fills.unsqueeze(1)
        same = ((seen == now) | ~filled).all(dim=1)
        self.made_at.index_copy_(0, blocks, epochs.index_select(0, blocks))
        if bool(same.all()):
            return int(blocks.numel()), 0
        redo = ~same
        blocks, fills, now = blocks[redo], fills[redo], now[redo]
        full = fills == block_size
        if bool(full.any()):
            self._store(blocks[full], *pages.reduce(blocks[full], self.parts))
        if not bool(full.all()):
            some = blocks[~full]
            self._store(some, *self._from_pages(some, fills[~full], pages))
        self.probe.index_copy_(0, blocks, now.masked_fill(
            torch.arange(block_size, device=blocks.device).unsqueeze(0) >= fills.unsqueeze(1), float("nan")))
        return int(same.sum()), int(blocks.numel())
