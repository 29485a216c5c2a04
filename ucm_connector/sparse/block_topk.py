"""``block_topk``: at each decode step, attention reads only the cache blocks
whose keys can matter most to the current query.

For each decode request and layer, every block gets an estimate of the
attention mass it can take: per query head, the Quest upper bound of q . k
over the block (from the block's per-head key min/max, ``summaries.py``),
scaled and soft-maxed over the request's blocks, then averaged over heads (the
kernel takes one block list for all heads of a request).  The first
``sink_blocks`` blocks (attention sinks) and the last ``local_blocks`` blocks
(the recent window, which holds the partly filled block) are always read; the
rest of the budget goes to the highest estimates.  Chosen blocks are handed to
the kernel in position order.

Options (``"sparse": {"method": "block_topk", ...}``):

* ``keep_ratio`` (default 0.25): fraction of a request's blocks read, rounded up;
* ``budget_blocks``: a fixed number of blocks instead (give one of the two);
* ``sink_blocks`` (default 1), ``local_blocks`` (default 1, at least 1).

A request whose budget covers all its blocks reads them all (no sparsity):
short requests are exactly dense.  Prefill and chunked-prefill rows (more
than one query token) are always dense.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from .base import AttentionBatch, BlockSelection, SparseConfigError, SparseMethod, SparseStats, StepInfo
from .summaries import BlockEpochs, LayerSummaries


@dataclasses.dataclass(frozen=True)
class BlockTopKOptions:
    keep_ratio: float | None = 0.25
    budget_blocks: int | None = None
    sink_blocks: int = 1
    local_blocks: int = 1

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> "BlockTopKOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        for key in options:
            if key not in known:
                raise SparseConfigError(
                    f"block_topk: unknown option {key!r}; known options: {', '.join(sorted(known))}")
        ratio = options.get("keep_ratio")
        budget = options.get("budget_blocks")
        if ratio is not None and budget is not None:
            raise SparseConfigError("block_topk: give keep_ratio or budget_blocks, not both")
        if ratio is None and budget is None:
            ratio = cls.keep_ratio
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
                raise SparseConfigError(f"block_topk: keep_ratio: expected a number in (0, 1], got {ratio!r}")
            ratio = float(ratio)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise SparseConfigError(f"block_topk: budget_blocks: expected a positive integer, got {budget!r}")
        sinks = options.get("sink_blocks", cls.sink_blocks)
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise SparseConfigError(f"block_topk: sink_blocks: expected an integer >= 0, got {sinks!r}")
        local = options.get("local_blocks", cls.local_blocks)
        if isinstance(local, bool) or not isinstance(local, int) or local < 1:
            raise SparseConfigError(
                f"block_topk: local_blocks: expected an integer >= 1 (the last, partly filled "
                f"block is always read), got {local!r}")
        return cls(keep_ratio=ratio, budget_blocks=budget, sink_blocks=sinks, local_blocks=local)

    def budget(self, num_blocks: torch.Tensor) -> torch.Tensor:
        """Blocks to read for requests of ``num_blocks`` blocks (elementwise)."""
        if self.budget_blocks is not None:
            keep = torch.full_like(num_blocks, self.budget_blocks)
        else:
            # A small slack keeps 0.25 * 64 at 16, not 17, despite float error.
            keep = torch.ceil(num_blocks.to(torch.float64) * self.keep_ratio - 1e-9).to(num_blocks.dtype)
        return keep.clamp(min=self.sink_blocks + self.local_blocks)


class BlockTopK(SparseMethod):
    name = "block_topk"

    def __init__(self, options: BlockTopKOptions) -> None:
        self.options = options
        self._epochs = BlockEpochs()
        self._layers: dict[str, LayerSummaries] = {}
        self._stats = SparseStats()

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> "BlockTopK":
        return cls(BlockTopKOptions.parse(options))

    def stats(self) -> SparseStats:
        return dataclasses.replace(self._stats)

    def reset_stats(self) -> None:
        self._stats = SparseStats()

    # -- step ----------------------------------------------------------------

    def begin_step(self, step: StepInfo) -> None:
        for start in step.started:
            if start.num_computed_tokens > 0:
                # These blocks' keys were written without us (prefix cache or
                # connector load): their summaries must come from the pages.
                num = -(-start.num_computed_tokens // step.block_size)
                self._epochs.bump(start.block_ids[:num])
        if step.block_copies:
            self._epochs.bump(dst for _, dst in step.block_copies)

    # -- layer ---------------------------------------------------------------

    def _layer(self, batch: AttentionBatch, dtype: torch.dtype) -> LayerSummaries:
        layer = self._layers.get(batch.layer_name)
        if layer is None or layer.num_blocks < batch.num_cache_blocks:
            layer = LayerSummaries(batch.num_cache_blocks, batch.num_kv_heads, batch.head_size,
                                   dtype, batch.query.device)
            self._layers[batch.layer_name] = layer
        return layer

    def before_attention(self, batch: AttentionBatch) -> BlockSelection | None:
        block_size = batch.block_size
        epochs = self._epochs.get(batch.num_cache_blocks, batch.query.device)
        layer = None
        if batch.key is not None and batch.slot_mapping is not None:
            layer = self._layer(batch, batch.key.dtype)
            num_tokens = batch.slot_mapping.shape[0]
            layer.add_keys(batch.key[:num_tokens], batch.slot_mapping, block_size, epochs)

        qsl = batch.query_start_loc
        seq_lens = batch.seq_lens
        num_reqs = seq_lens.shape[0]
        query_lens = qsl[1:num_reqs + 1] - qsl[:num_reqs]
        num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        is_decode = query_lens == 1
        keep = self.options.budget(num_blocks)
        sparse = is_decode & (keep < num_blocks) & (seq_lens > 0)

        stats = self._stats
        num_decode = int(is_decode.sum())
        if num_decode == 0:
            return None
        dense_blocks = int(num_blocks[is_decode].sum())
        stats.layer_calls += 1
        stats.decode_rows += num_decode
        stats.blocks_dense += dense_blocks
        rows = sparse.nonzero().flatten()
        if rows.numel() == 0 or layer is None:
            stats.blocks_read += dense_blocks
            return None

        n_rows = num_blocks[rows].to(torch.int64)
        keep_rows = keep[rows].to(torch.int64)
        width = int(n_rows.max())
        pos = torch.arange(width, device=rows.device)
        valid = pos.unsqueeze(0) < n_rows.unsqueeze(1)
        table = batch.block_table[rows, :width].to(torch.int64)
        table = torch.where(valid, table, torch.zeros_like(table))
        last_fill = seq_lens[rows].to(torch.int64) - (n_rows - 1) * block_size

        forced = (pos.unsqueeze(0) < self.options.sink_blocks) | (
            pos.unsqueeze(0) >= (n_rows - self.options.local_blocks).unsqueeze(1))
        forced |= self._refresh(layer, batch, table, valid, pos, n_rows, last_fill, epochs)
        forced &= valid

        scores = self._scores(layer, batch, rows, table, valid)
        scores = scores.masked_fill(forced, float("inf"))
        keep_rows = torch.maximum(keep_rows, forced.sum(dim=1))
        k = int(keep_rows.max())
        top = scores.topk(k, dim=1).indices
        top = torch.where(torch.arange(k, device=rows.device).unsqueeze(0) < keep_rows.unsqueeze(1),
                          top, torch.full_like(top, width))
        chosen = top.sort(dim=1).values.clamp(max=width - 1)
        new_rows = table.gather(1, chosen)

        block_table = batch.block_table.clone()
        block_table[rows, :k] = new_rows.to(block_table.dtype)
        new_lens = seq_lens.clone()
        new_lens[rows] = ((keep_rows - 1) * block_size + last_fill).to(new_lens.dtype)

        stats.sparse_rows += int(rows.numel())
        stats.blocks_read += dense_blocks - int((n_rows - keep_rows).sum())
        return BlockSelection(block_table=block_table, seq_lens=new_lens)

    def _refresh(self, layer: LayerSummaries, batch: AttentionBatch, table: torch.Tensor,
                 valid: torch.Tensor, pos: torch.Tensor, n_rows: torch.Tensor,
                 last_fill: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor:
        """Rebuild stale summaries of the blocks these rows read; returns the
        (row, position) entries that still have none (always read)."""
        stale = layer.stale(table.flatten(), epochs).view_as(table) & valid
        if not bool(stale.any()):
            return stale
        if batch.read_keys is None:
            self._stats.blocks_kept_unsummarized += int(stale.sum())
            return stale
        fills = torch.where(pos.unsqueeze(0) == (n_rows - 1).unsqueeze(1), last_fill.unsqueeze(1),
                            torch.full_like(table, batch.block_size))
        blocks, fills = table[stale], fills[stale]
        layer.rebuild(blocks, fills, epochs, batch.read_keys)
        self._stats.blocks_summarized_from_pages += int(blocks.numel())
        return torch.zeros_like(stale)

    def _scores(self, layer: LayerSummaries, batch: AttentionBatch, rows: torch.Tensor,
                table: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Estimated share of each block in the attention of each row's query."""
        num_kv_heads = batch.num_kv_heads
        q = batch.query[batch.query_start_loc[rows].to(torch.int64)].float()
        n, num_heads, head_size = q.shape
        q = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_size)
        kmax = layer.kmax[table].float()               # [n, width, H, D]
        kmin = layer.kmin[table].float()
        bound = torch.einsum("nhgd,nbhd->nhgb", q.clamp(min=0), kmax)
        bound += torch.einsum("nhgd,nbhd->nhgb", q.clamp(max=0), kmin)
        bound = (bound * batch.scale).masked_fill(~valid[:, None, None, :], float("-inf"))
        mass = bound.softmax(dim=-1)
        return mass.mean(dim=(1, 2))
