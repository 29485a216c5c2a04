"""Per-block key summaries: for every cache block and KV head, the elementwise
minimum and maximum of the block's keys (Quest's bound: for a query q,
``sum_d max(q_d * min_d, q_d * max_d)`` is an upper bound of q . k over the
block's keys).

Summaries follow the keys as they are written (prefill chunks and decode
tokens), so they cost no extra read of the cache.  Blocks whose content was
put there by someone else (vLLM's prefix cache, a KV connector's load, a
block copy, or anything written while no method was active) are told apart
by epochs: the step hook bumps a block's epoch when its content comes from
outside, and a layer's summary of a block is trusted only while it was made
at the block's current epoch.  A stale summary is rebuilt from the block's
page, read back through the backend's page reader, the first time a decode
step needs it.

Knows attention math and tensors; knows nothing of vLLM's classes.
"""

from __future__ import annotations

from typing import Callable

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


class LayerSummaries:
    """Min/max of each block's keys for one layer: ``[num_blocks, H, D]``."""

    def __init__(self, num_blocks: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, num_kv_heads, head_size)
        self.kmin = torch.full(shape, float("inf"), dtype=dtype, device=device)
        self.kmax = torch.full(shape, float("-inf"), dtype=dtype, device=device)
        # Epoch at which each block's summary was started; -1 = never.
        self.made_at = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)

    @property
    def num_blocks(self) -> int:
        return self.kmin.shape[0]

    def add_keys(self, key: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                 epochs: torch.Tensor) -> None:
        """Fold the keys just written at ``slot_mapping`` into their blocks'
        summaries.  A token at offset 0 starts its block afresh: tokens of a
        block are written in order, so that is where a block's new content
        begins (whatever the block held before)."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, slot_mapping = key[keep], slot_mapping[keep]
        if slot_mapping.numel() == 0:
            return
        slots = slot_mapping.to(torch.int64)
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        starts = blocks[slots - blocks * block_size == 0]
        if starts.numel():
            self.kmin.index_fill_(0, starts, float("inf"))
            self.kmax.index_fill_(0, starts, float("-inf"))
            self.made_at.index_copy_(0, starts, epochs.index_select(0, starts))
        flat = key.reshape(key.shape[0], -1).to(self.kmin.dtype)
        index = blocks.unsqueeze(1).expand(-1, flat.shape[1])
        width = flat.shape[1]
        self.kmin.view(-1, width).scatter_reduce_(0, index, flat, "amin")
        self.kmax.view(-1, width).scatter_reduce_(0, index, flat, "amax")

    def stale(self, blocks: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor:
        return self.made_at.index_select(0, blocks) != epochs.index_select(0, blocks)

    def rebuild(self, blocks: torch.Tensor, fills: torch.Tensor, epochs: torch.Tensor,
                read_keys: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Summarize ``blocks`` from their pages; ``fills`` = valid tokens in each."""
        keys = read_keys(blocks)                        # [n, B, H, D]
        block_size = keys.shape[1]
        pad = torch.arange(block_size, device=keys.device).unsqueeze(0) >= fills.unsqueeze(1)
        pad = pad[:, :, None, None]
        big = torch.tensor(float("inf"), dtype=keys.dtype, device=keys.device)
        kmin = keys.masked_fill(pad, big).amin(dim=1)
        kmax = keys.masked_fill(pad, -big).amax(dim=1)
        self.kmin.index_copy_(0, blocks, kmin.to(self.kmin.dtype))
        self.kmax.index_copy_(0, blocks, kmax.to(self.kmax.dtype))
        self.made_at.index_copy_(0, blocks, epochs.index_select(0, blocks))
