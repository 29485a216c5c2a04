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
at the block's current epoch.  A stale summary is checked, the first time a
decode step needs it, against one key element per token read from the page
when the block was completed (``probe``): a block refilled with the same keys
(a prefix-cache hit, a store load of the same prefix) keeps its summary; any
other is rebuilt from its page.

Knows attention math and tensors; knows nothing of vLLM's classes.
"""

from __future__ import annotations

import torch


class BlockEpochs:
    """One counter per cache block, shared by all layers; bumped when a
    block's content is replaced behind the forward pass's back."""

    def __init__(self) -> None:
        self.epochs: torch.Tensor | None = None
        self._pending: list[int] = []

    def bump(self, block_ids) -> None:
        self._pending.extend(int(b) for b in block_ids)

    def get(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        if self.epochs is None or self.epochs.numel() < num_blocks or self.epochs.device != device:
            fresh = torch.zeros(num_blocks, dtype=torch.int64, device=device)
            if self.epochs is not None:
                n = min(num_blocks, self.epochs.numel())
                fresh[:n] = self.epochs[:n].to(device)
            self.epochs = fresh
        if self._pending:
            ids = torch.tensor(self._pending, dtype=torch.int64, device=device)
            self._pending.clear()
            ids = ids[ids < self.epochs.numel()]
            self.epochs.index_add_(0, ids, torch.ones_like(ids))
        return self.epochs


class WritePlan:
    """Where one step's new keys go, by block: the same for every layer of
    the step, so it is worked out once."""

    def __init__(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        keep = slot_mapping >= 0
        self.keep = None if bool(keep.all()) else keep
        slots = (slot_mapping if self.keep is None else slot_mapping[keep]).to(torch.int64)
        self.num_tokens = slots.numel()
        self.blocks = torch.div(slots, block_size, rounding_mode="floor")
        self.offsets = slots - self.blocks * block_size
        self.starts = self.blocks[self.offsets == 0]
        self.ends = self.blocks[self.offsets == block_size - 1]
        self._index: torch.Tensor | None = None
        self._parts: tuple[int, torch.Tensor] | None = None

    def parts(self, parts: int, part_size: int) -> torch.Tensor:
        """Row of each token in a ``[num_blocks * parts]`` view."""
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
    ``[num_blocks, parts, H, D]``; a slice's mean key, finer than the
    block's, keeps a few strong keys from being averaged away over 128
    tokens), and with ``bounds`` their elementwise max and min side by side
    (``minmax`` ``[num_blocks, H, 2D]``: Quest's bound is one matmul against
    ``[max(q, 0), min(q, 0)]``).  How many keys each slice holds follows from
    the block's fill, which the caller knows: a current summary covers
    exactly the block's first ``fill`` tokens."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device, parts: int = 1, bounds: bool = True,
                 made_at: torch.Tensor | None = None) -> None:
        d = head_size
        self.minmax = self.kmax = self.kmin = None
        if bounds:
            self.minmax = torch.empty((num_blocks, num_kv_heads, 2 * d), dtype=dtype, device=device)
            self.kmax = self.minmax[:, :, :d]
            self.kmin = self.minmax[:, :, d:]
            self.kmax.fill_(float("-inf"))
            self.kmin.fill_(float("inf"))
        self.parts = parts
        self.part_size = block_size // parts
        self.part_sum = torch.zeros((num_blocks, parts, num_kv_heads, d), dtype=dtype, device=device)
        # Epoch at which each block's summary was started; -1 = never.  May be
        # shared by the layers of a model: they all see the same writes.
        self.made_at = (torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
                        if made_at is None else made_at)
        # Per token of each full block, the key element KeyPages.probe reads
        # (kv head 0, dim t % head_size), read from the page when the block
        # was completed or rebuilt; NaN where unknown (never equal).  Only
        # full blocks come back behind the forward's back (prefix-cache hits
        # and connector loads are whole blocks).
        self.probe = torch.full((num_blocks, block_size), float("nan"), dtype=dtype, device=device)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.part_sum.shape[0]

    def add_keys(self, key: torch.Tensor, plan: "WritePlan", epochs: torch.Tensor, pages=None) -> None:
        """Fold the keys just written (``plan`` says where) into their
        blocks' summaries.  A token at offset 0 starts its block afresh:
        tokens of a block are written in order, so that is where a block's
        new content begins (whatever the block held before).  Blocks
        completed by these keys get their probe from ``pages`` (the cache
        already holds the keys); without pages they get none."""
        if plan.num_tokens == 0:
            return
        if plan.keep is not None:
            key = key[plan.keep]
        if plan.starts.numel():
            if self.minmax is not None:
                self.kmin.index_fill_(0, plan.starts, float("inf"))
                self.kmax.index_fill_(0, plan.starts, float("-inf"))
            self.part_sum.index_fill_(0, plan.starts, 0.0)
            self.made_at.index_copy_(0, plan.starts, epochs.index_select(0, plan.starts))
            self.probe.index_fill_(0, plan.starts, float("nan"))
        if pages is not None and plan.ends.numel():
            self.probe.index_copy_(0, plan.ends, pages.probe(plan.ends).to(self.probe.dtype))
        key = key.to(self.part_sum.dtype)
        if self.minmax is not None:
            index = plan.index(key.shape[1:])
            self.kmin.scatter_reduce_(0, index, key, "amin")
            self.kmax.scatter_reduce_(0, index, key, "amax")
        parts = plan.parts(self.parts, self.part_size)
        self.part_sum.view(-1, *key.shape[1:]).index_add_(0, parts, key)

    def stale(self, blocks: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor:
        return self.made_at.index_select(0, blocks) != epochs.index_select(0, blocks)

    def refresh(self, blocks: torch.Tensor, fills: torch.Tensor, epochs: torch.Tensor,
                pages) -> tuple[int, int]:
        """Make the summaries of these stale ``blocks`` (``fills`` = valid
        tokens in each) current: kept if the page still holds the keys they
        were made from, else rebuilt from the page.  Returns (kept, rebuilt)."""
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
            kmin, kmax, part_sum = pages.reduce(blocks[full], self.parts)
            if self.minmax is not None:
                self.kmin.index_copy_(0, blocks[full], kmin.to(self.kmin.dtype))
                self.kmax.index_copy_(0, blocks[full], kmax.to(self.kmax.dtype))
            self.part_sum.index_copy_(0, blocks[full], part_sum.to(self.part_sum.dtype))
        if not bool(full.all()):
            some, some_fills = blocks[~full], fills[~full]
            keys = pages.read(some).to(self.part_sum.dtype)  # [n, B, H, D]
            pad = (torch.arange(block_size, device=keys.device).unsqueeze(0)
                   >= some_fills.unsqueeze(1))[:, :, None, None]
            if self.minmax is not None:
                self.kmin.index_copy_(0, some, keys.masked_fill(pad, float("inf")).amin(dim=1))
                self.kmax.index_copy_(0, some, keys.masked_fill(pad, float("-inf")).amax(dim=1))
            part_sum = keys.masked_fill(pad, 0.0).view(len(some), self.parts, self.part_size, *keys.shape[2:])
            self.part_sum.index_copy_(0, some, part_sum.sum(dim=2))
        self.probe.index_copy_(0, blocks, now.masked_fill(
            torch.arange(block_size, device=blocks.device).unsqueeze(0) >= fills.unsqueeze(1), float("nan")))
        return int(same.sum()), int(blocks.numel())
